"""LoRA under FSDP2 (``trainer=fsdp`` with ``model.lora``), in a 2-process torchrun run on CPU (gloo) under a
watchdog, on unequal data per rank.

The tiny policy's Qwen2 shape (bf16 weights as loaded from disk) with all-linear LoRA
(``agentopsd.models.loading.apply_lora``), sharded as ``trainer=fsdp`` shards it (``prepare_policy`` under
``bf16-mixed``), policy and KL reference. Every rank checks, collecting every failure before it exits:

- each decoder layer is its own FSDP unit, plus the root (a lookup of ``model.model.layers`` on the peft
  wrapper found none, so only the root was sharded and every forward gathered the whole model);
- the LoRA weights the optimizer updates are float32, the frozen base weights stay in their bf16;
- a forward, backward and AdamW step on this rank's own rows runs, moves LoRA and leaves the base alone;
- the weight sync into a fake engine (``load_weights``) yields the checkpoint names of the plain model and
  the merged weights of peft's ``merge_and_unload`` on an unsharded float32 copy with the same weights
  (the old sync raised ``aten.add.Tensor got mixed torch.Tensor and DTensor``);
- while the engine takes the weights, the tensors alive beyond those before the sync never reach half the
  model's bytes (the old sync built every layer's delta, in float32, before the first weight).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.agentopsd.models.test_meta_build import torchrun_watched

pytest.importorskip("peft")

SCRIPT = textwrap.dedent('''
    import datetime, gc, torch, torch.distributed as dist, transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from agentopsd.models.loading import apply_lora
    from agentopsd.training.strategies import frozen_copy
    from agentopsd.rollout.vllm_backend import iter_full_weights
    from agentopsd.training.strategies import prepare_policy
    from agentopsd.models.tokenizer import tiny_qwen2_config

    LAYERS = 4
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a lost rank fails in 60 s
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    def build():
        """The tiny policy's Qwen2 (GQA, tied embeddings) in bf16 as loaded, with all-linear bf16 LoRA whose B
        is random: each merged weight then differs from its base by about as much as the weight itself."""
        torch.manual_seed(0)  # the same weights on every rank, as train.py seeds them
        model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(512, num_layers=LAYERS, num_key_value_heads=1))
        model = apply_lora(model.to(torch.bfloat16), {"r": 4, "alpha": 8, "target_modules": "all-linear"})
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.1)
                if "lora_" in name:  # peft makes float32 adapters; bf16 ones (e.g. loaded) must be upcast alone
                    param.data = param.data.to(torch.bfloat16)
        return model

    def fsdp_units(module):
        return sum(isinstance(m, FSDPModule) for m in module.modules())

    model = build()
    ref = frozen_copy(model)
    prepare_policy(model, ref, "bf16-mixed", mesh)
    check(fsdp_units(model) == LAYERS + 1, f"policy: {fsdp_units(model)} FSDP units, want {LAYERS} layers + the root")
    check(fsdp_units(ref) == LAYERS + 1, f"reference: {fsdp_units(ref)} FSDP units, want {LAYERS} layers + the root")
    check(all(hasattr(p, "full_tensor") for p in model.parameters()), "a policy parameter is not a DTensor shard")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    check(trainable and all("lora_" in n for n in trainable), f"trainable: {sorted(trainable)[:3]}")
    check({p.dtype for p in trainable.values()} == {torch.float32}, "LoRA weights are not float32 master weights")
    check({p.dtype for p in frozen.values()} == {torch.bfloat16},
          f"frozen base weights in {sorted(map(str, {p.dtype for p in frozen.values()}))}, not their bf16")

    # one update on this rank's own rows: rank 1 has more and longer ones
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 512, (2 + rank, 6 + 5 * rank), generator=gen)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-2)
    model.train()
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    check(bool(torch.isfinite(loss)), f"loss {loss}")
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    check(all(not torch.equal(before[n], after[n]) for n in trainable), "a LoRA weight did not move")
    check(all(torch.equal(before[n], after[n]) for n in frozen), "a frozen base weight moved")

    # what the engine must receive: peft's merge of an unsharded float32 copy with the same weights
    plain = build().float()
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(after[name])
    want = {k: v.detach().to(torch.bfloat16) for k, v in plain.merge_and_unload().state_dict().items()}
    model_bytes = sum(v.numel() * v.element_size() for v in want.values())
    del plain, before, after

    def live_bytes():
        """Bytes of every distinct storage of the plain tensors Python can see now."""
        seen = {}
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    class FakeEngine:
        """Takes (name, tensor) as vLLM's load_weights does, checks each against ``want`` and keeps none."""

        def __init__(self):
            self.names, self.worst, self.peak_extra, self.baseline = [], 0.0, 0, live_bytes()

        def load_weights(self, weights):
            for name, tensor in weights:
                self.names.append(name)
                self.peak_extra = max(self.peak_extra, live_bytes() - self.baseline)
                ref = want.get(name)
                if ref is None or tensor.shape != ref.shape or hasattr(tensor, "full_tensor"):
                    failures.append(f"sync: {name} {tuple(tensor.shape)} {type(tensor).__name__} is not a full plain weight")
                    continue
                check(tensor.dtype == torch.bfloat16, f"sync: {name} in {tensor.dtype}")
                err = ((tensor.float() - ref.float()).abs() / (ref.float().abs() + 1e-3)).max().item()
                self.worst = max(self.worst, err)
                del tensor

    engine = FakeEngine()
    try:
        engine.load_weights(iter_full_weights(model, torch.bfloat16))
    except Exception as exc:  # every failure is reported, not only the first
        failures.append(f"sync raised {type(exc).__name__}: {str(exc)[:200]}")
    else:
        check(engine.names == list(want), f"sync names {engine.names[:4]}..., want {list(want)[:4]}...")
        # both sides round a float32 merge to bf16 (2**-8 relative): a missing delta is off by ~100%
        check(engine.worst < 2e-2, f"sync: merged weights off by {engine.worst:.3g} (relative)")
        check(engine.peak_extra < model_bytes / 2,
              f"sync held {engine.peak_extra / 1e6:.2f} MB beyond the model at once (the bf16 model: {model_bytes / 1e6:.2f} MB)")
    print(f"rank {rank}: sync peak extra {engine.peak_extra / 1e6:.2f} MB of a {model_bytes / 1e6:.2f} MB model, "
          f"worst relative error {engine.worst:.2e}", flush=True)
    dist.barrier()
    if failures:
        print(f"LORA-FSDP-FAIL rank {rank}: " + " | ".join(failures), flush=True)
        raise SystemExit(1)
    print(f"LORA-FSDP-OK rank {rank}", flush=True)
    from tests.torchrun_exit import leave
    leave()  # not a normal exit: see tests/torchrun_exit.py
''')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_under_fsdp2_shards_each_layer_trains_and_syncs_merged_weights_one_layer_at_a_time(tmp_path):
    script = tmp_path / "lora_fsdp.py"
    script.write_text(SCRIPT)
    out = torchrun_watched(script, timeout=240)
    print(*(line for line in out.splitlines() if "sync peak" in line), sep="\n")  # the measurement, with -s
    assert out.count("LORA-FSDP-OK") == 2, out[-3000:]


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("arch", ["Qwen2", "Llama"])
def test_decoder_layers_are_found_through_the_peft_wrapper(arch, lora):
    """FSDP2's units: each decoder layer, found on the plain model and on its peft wrapper alike."""
    import transformers

    from agentopsd.models.loading import apply_lora
    from agentopsd.training.strategies import decoder_layers

    config = getattr(transformers, f"{arch}Config")(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                                    num_attention_heads=2, num_key_value_heads=1)
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    want = list(model.model.layers)
    if lora:
        model = apply_lora(model, {"r": 2, "target_modules": "all-linear"})
    assert [id(m) for m in decoder_layers(model)] == [id(m) for m in want]
    assert decoder_layers(torch.nn.Linear(2, 2)) == []  # no layers: prepare_policy warns, shards the root only


def test_the_streamed_merge_equals_peft_merge_for_linear_and_embedding_lora():
    """One process: the sync's per-layer merge against ``merge_and_unload``, LoRA on the embedding too."""
    import peft
    import transformers

    from agentopsd.rollout.vllm_backend import iter_full_weights

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_" in name:  # peft starts the embedding's A at zero
                torch.nn.init.normal_(param, std=0.1)
    got = dict(iter_full_weights(model, None))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(got["model.embed_tokens.weight"], before["base_model.model.model.embed_tokens.base_layer.weight"])
