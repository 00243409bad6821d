"""One copy of the weights per node: a node's other ranks build the policy on the meta device and get
rank 0's weights after FSDP2 sharding (agentopsd.strategies.fill_from_rank0), checked in a 2-process
torchrun run on CPU (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    import transformers
    from agentopsd.models import load_policy
    from agentopsd.strategies import fill_from_rank0

    folder = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = load_policy(folder, meta_on_other_ranks=True)
    was_meta = all(p.is_meta for p in model.parameters())
    assert was_meta == (rank == 1), (rank, was_meta)
    full = {} if was_meta else dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fill_from_rank0(model, full, "cpu")
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 3, 7]])).logits
    out = [None, None]
    dist.all_gather_object(out, logits)
    if rank == 0:
        saved = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert got.keys() == saved.keys()
        for k in saved:
            assert torch.equal(got[k], saved[k]), k
        assert torch.equal(out[0], out[1]), (out[0] - out[1]).abs().max()
        print("WEIGHTS-FROM-RANK0-OK", len(saved))
    dist.destroy_process_group()
''')


@pytest.mark.timeout(180)
def test_other_ranks_build_on_meta_and_receive_rank0s_weights(tmp_path):
    import transformers

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    folder = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    _save_tokenizer(folder)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(folder)],
                         capture_output=True, text=True, timeout=170, env=env)
    assert out.returncode == 0 and "WEIGHTS-FROM-RANK0-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def _save_tokenizer(folder: Path) -> None:
    """Any small tokenizer with a chat template: load_policy loads one beside the weights."""
    from tests.agentopsd.test_prompts import _qwen_tokenizer

    _qwen_tokenizer().save_pretrained(folder)
