"""agentopsd-export: a run's checkpoint (1 process, DDP, FSDP2 shards, a kept policy, LoRA) as a Hugging Face
folder that transformers and the vLLM CPU build load, and that plays the evaluation list as the trainer did."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from agentopsd.tools import export
from tests.test_train import run_train

ROOT = Path(__file__).resolve().parents[3]
VLLM_VENV = Path(os.environ.get("AGENTOPSD_VLLM_VENV", ROOT / ".venv-vllm"))
TINY_RUN = ["experiment=babyai_tiny", "trainer.enable_progress_bar=false", "evaluation.num_tasks=4", "checkpoint.keep_policies=true"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A 2-iteration babyai_tiny run on one process (about 12 s): last.ckpt and policy-000001/2.pt."""
    out = tmp_path_factory.mktemp("export") / "run"
    run_train(*TINY_RUN, f"output_dir={out}")
    return out


def last_eval(run: Path) -> dict[str, float]:
    """The trainer's own last evaluation (its metrics.csv row)."""
    rows = []
    for path in sorted((run / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += [r for r in csv.DictReader(f) if r.get("eval/success")]
    return {k: float(v) for k, v in rows[-1].items() if k.startswith("eval/") and v != "" and k != "eval/iteration"}


def checkpoint_policy(ckpt: Path) -> dict[str, torch.Tensor]:
    state, _ = export.read_policy_state(ckpt)
    return state


def assert_same_weights(folder: Path, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))
    assert saved, "no tensors"
    for key, tensor in saved.items():
        assert torch.equal(tensor, state[key]), key  # bit for bit
    missing = set(state) - set(saved) - {"lm_head.weight"}  # a tied head is the embedding's tensor
    assert not missing


def test_export_of_a_run_loads_in_transformers_and_plays_as_the_trainer(trained_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agentopsd.tools import eval_cli

    out = tmp_path / "hf"
    assert export.main([str(trained_run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "agentopsd.json"} <= names
    assert_same_weights(out, checkpoint_policy(trained_run / "checkpoints" / "last.ckpt"))

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    gen = GenerationConfig.from_pretrained(out)
    assert gen.stop_strings == ["</action>"] and gen.do_sample is False
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in gen.eos_token_id and tokenizer.eos_token_id in gen.eos_token_id
    meta = json.loads((out / "agentopsd.json").read_text())
    assert meta["iterations_done"] == 2 and meta["prompt"]["env_id"] == "agentopsd/BabyAI-GoToLocal-v0"
    # transformers' own generate honours the stops (the tokenizer resolves the stop strings)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Task: go to the red ball"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    produced = model.generate(ids, tokenizer=tokenizer)
    assert produced.shape[1] - ids.shape[1] <= gen.max_new_tokens

    # the exported folder plays the evaluation list exactly as the trainer's own end-of-run evaluation did
    res = eval_cli.evaluate(["+experiment=babyai_tiny", f"model.path={out}", "evaluation.num_tasks=4", f"eval_dir={tmp_path / 'ev'}"])
    trainer = last_eval(trained_run)
    assert {k: res["metrics"][k] for k in trainer} == pytest.approx(trainer, abs=1e-6)
    # ... and its greedy actions, turn by turn, are the checkpoint's (loaded the trainer's way)
    ref = eval_cli.evaluate(["+experiment=babyai_tiny", f"ckpt_path={trained_run}", "evaluation.num_tasks=4", f"eval_dir={tmp_path / 'ev_ckpt'}"])
    assert [e["actions"] for e in res["episodes"]] == [e["actions"] for e in ref["episodes"]]
    assert len(res["episodes"]) == 4


def test_the_exported_tokenizer_encodes_as_in_training(trained_run, tmp_path):
    """transformers 5 loads any qwen2 folder with Qwen2Tokenizer, which splits numbers its own way: the tiny model's
    own tokenizer.json must be what the folder is read with (agentopsd's loader; PreTrainedTokenizerFast elsewhere)."""
    from transformers import PreTrainedTokenizerFast

    from agentopsd.models.loading import load_tokenizer

    out = tmp_path / "hf"
    assert export.main([str(trained_run), str(out)]) == 0
    _, trained, _, _ = export.load_policy_from_checkpoint(trained_run)
    texts = ["You see a red ball 2 steps ahead and 1 step to the right.", "Task: go to the grey key 13 12 3 <action>turn left</action>",
             "step 10 of 24: 0.5 left"]
    want = [trained(t)["input_ids"] for t in texts]
    for tokenizer in (load_tokenizer(str(out)), PreTrainedTokenizerFast.from_pretrained(out)):
        assert [tokenizer(t)["input_ids"] for t in texts] == want
    assert load_tokenizer(str(out)).chat_template == trained.chat_template


def test_export_of_a_kept_policy_and_of_last_ckpt_agree(trained_run, tmp_path):
    kept = trained_run / "checkpoints" / "policy-000002.pt"
    assert export.main([str(kept), str(tmp_path / "kept")]) == 0
    assert export.main([str(trained_run / "checkpoints" / "last.ckpt"), str(tmp_path / "last")]) == 0
    assert_same_weights(tmp_path / "kept", checkpoint_policy(trained_run / "checkpoints" / "last.ckpt"))
    assert json.loads((tmp_path / "kept" / "agentopsd.json").read_text())["iterations_done"] is None  # a bare state dict says nothing
    # an earlier kept policy is other weights
    assert export.main([str(trained_run / "checkpoints" / "policy-000001.pt"), str(tmp_path / "first")]) == 0
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "first" / "model.safetensors")), load_file(str(tmp_path / "kept" / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_export_refuses_in_one_line(trained_run, tmp_path, capsys):
    assert export.main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "no such run folder or checkpoint" in capsys.readouterr().err
    stray = tmp_path / "stray.pt"
    torch.save({"w": torch.zeros(1)}, stray)
    assert export.main([str(stray), str(tmp_path / "out")]) == 2
    assert "--run RUN_DIR" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert export.main([str(trained_run), str(tmp_path / "full")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export.main([str(trained_run), str(tmp_path / "ad"), "--adapter"]) == 2
    assert "no LoRA adapter" in capsys.readouterr().err
    # a checkpoint kept outside its run: --run names the run
    assert export.main([str(stray), str(tmp_path / "out"), "--run", str(trained_run)]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_runs_dir_and_latest_resolve_to_the_newest_run(trained_run, tmp_path):
    runs_dir = tmp_path / "runs" / "babyai_tiny"
    runs_dir.mkdir(parents=True)
    (runs_dir / "2025-01-01_00-00-00").symlink_to(trained_run, target_is_directory=True)
    (runs_dir / "latest").symlink_to("2025-01-01_00-00-00", target_is_directory=True)
    ckpt, run = export.resolve_source(runs_dir)
    assert run == trained_run.resolve() and ckpt.name == "last.ckpt"
    assert export.resolve_source(runs_dir / "latest")[1] == trained_run.resolve()


def _lora_run(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A run folder as a LoRA run on a local model folder leaves it: .hydra/config.yaml and last.ckpt."""
    pytest.importorskip("peft")
    from omegaconf import OmegaConf

    from agentopsd.models.loading import load_policy
    from agentopsd.models.tiny import tiny_policy

    base, tokenizer = tiny_policy("agentopsd/BabyAI-GoToLocal-v0", vocab_size=384, hidden_size=64, num_layers=2, intermediate_size=128,
                                  text_episodes=8, cache_dir=str(tmp_path / "tok"))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    model, _ = load_policy(str(tmp_path / "base"), dtype="float32", lora=lora)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    run = tmp_path / "lora_run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    conf = OmegaConf.load(ROOT / "conf" / "env" / "babyai.yaml")
    cfg = {"env": OmegaConf.to_container(conf), "rollout": {"max_new_tokens": 12, "eval_temperature": 0.0},
           "model": {"_target_": "agentopsd.models.loading.load_policy", "path": str(tmp_path / "base"), "dtype": "bfloat16",
                     "gradient_checkpointing": True, "lora": lora}}
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "agentopsd": {"iterations_done": 3}}, run / "checkpoints" / "last.ckpt")
    return run, model.eval()


def test_lora_is_merged_by_default_and_kept_apart_with_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, trained = _lora_run(tmp_path)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits

    assert export.main([str(run), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
    meta = json.loads((tmp_path / "merged" / "agentopsd.json").read_text())
    assert meta["lora_merged"] and meta["iterations_done"] == 3

    assert export.main([str(run), str(tmp_path / "adapter"), "--adapter", "--dtype", "float32"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(tmp_path / "base")  # the run's own base folder
    base = AutoModelForCausalLM.from_pretrained(adapter_cfg["base_model_name_or_path"])
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)

    # auto dtype: the dtype the run loaded the model in (bf16 here)
    assert export.main([str(run), str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text()).get("dtype", "bfloat16") in ("bfloat16",)


def _two_process_run(tmp_path_factory, strategy: str) -> Path:
    out = tmp_path_factory.mktemp(strategy) / "run"
    run_train("experiment=babyai_tiny", f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
              "trainer.enable_progress_bar=false", f"output_dir={out}", "num_iterations=2", "evaluation.num_tasks=4", timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_export_of_a_two_process_run(strategy, tmp_path_factory, tmp_path):
    """DDP's last.ckpt is one file; FSDP2's a folder of shards, read on one process (about 40 s each)."""
    from transformers import AutoModelForCausalLM

    from agentopsd.tools import eval_cli

    run = _two_process_run(tmp_path_factory, strategy)
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() == (strategy == "fsdp")
    assert export.main([str(run), str(tmp_path / "hf")]) == 0
    assert_same_weights(tmp_path / "hf", checkpoint_policy(ckpt))
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    res = eval_cli.evaluate(["+experiment=babyai_tiny", f"model.path={tmp_path / 'hf'}", "evaluation.num_tasks=4", f"eval_dir={tmp_path / 'ev'}"])
    trainer = last_eval(run)
    assert {k: res["metrics"][k] for k in trainer} == pytest.approx(trainer, abs=1e-6)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_cpu_build_loads_the_export(tmp_path):
    """The vLLM CPU venv (scripts/build_vllm_cpu_env.sh) plays the exported folder through agentopsd-eval
    (rollout.backend=vllm), greedy, with the transformers backend's actions. The model is the quickstart's
    width (head size 32): vLLM's CPU attention has no kernel for babyai_tiny's head size 16."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".agentopsd-vllm-built").is_file() or not python.is_file():
        pytest.skip(f"the vLLM CPU venv is not built at {VLLM_VENV}: run `bash scripts/build_vllm_cpu_env.sh` (or set AGENTOPSD_VLLM_VENV)")
    from agentopsd.tools import eval_cli

    run = tmp_path / "run"
    run_train(*TINY_RUN, "model.hidden_size=128", "num_iterations=1", f"output_dir={run}")
    out = tmp_path / "hf"
    assert export.main([str(run), str(out)]) == 0
    common = ["+experiment=babyai_tiny", f"model.path={out}", "evaluation.num_tasks=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(python), "-m", "agentopsd.tools.eval_cli", *common, "rollout.backend=vllm",
                           "+rollout.vllm={dtype:float32,max_model_len:2048}",
                           f"eval_dir={tmp_path / 'vllm'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "eval: success" in proc.stdout
    got = [json.loads(line) for line in (tmp_path / "vllm" / "episodes.jsonl").read_text().splitlines()]
    want = eval_cli.evaluate([*common, f"eval_dir={tmp_path / 'hf_eval'}"])["episodes"]
    assert len(got) == 4
    assert [e["actions"] for e in got] == [e["actions"] for e in want]
