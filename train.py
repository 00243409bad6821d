"""Train an agent: ``python train.py [overrides]`` in a checkout; installed, ``agentopsd-train [overrides]``.

    python train.py                              # the embedded default (experiment=quickstart)
    python train.py +experiment=webshop_3b       # the paper's WebShop setup on GPUs
    python train.py algorithm=grpo env=searchqa  # swap any config group
    python train.py ckpt_path=last               # resume the latest run of this name

The run itself (compose, validate, seed, instantiate, fit, evaluate, report) is agentopsd/run/train.py;
the configs are conf/.
"""

from agentopsd.run.train import cli

if __name__ == "__main__":
    cli()
