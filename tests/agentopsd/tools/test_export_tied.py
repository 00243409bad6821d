"""agentopsd/tools/export.py: the skeleton a checkpoint's weights are copied into keeps a tied LM head tied to the
embeddings, as the model's config says. A checkpoint holds the tied head once (as the embedding); an untied
skeleton would keep an uninitialised head and export a model that plays at random.

On the tiny Qwen2 made tied (SmolLM2, the real tied model, has its own check where it is prepared:
tests/agentopsd/test_pretrained.py)."""

from __future__ import annotations

import copy

import torch

from agentopsd.tools import export


def tied_folder(policy, tmp_path):
    """The tiny policy with ``tie_word_embeddings``, saved as a Hugging Face folder; and the model."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = policy
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(config).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    folder = tmp_path / "tied"
    tied.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tied


def test_the_skeleton_of_a_tied_model_keeps_its_head_tied(tiny_walk_policy, tmp_path):
    folder, tied = tied_folder(tiny_walk_policy, tmp_path)
    skeleton, _ = export.build_policy({"_target_": export.HF_TARGET, "path": str(folder), "lora": None})
    assert skeleton.config.tie_word_embeddings
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight, "the export skeleton's head is not tied to its embeddings"
    # a checkpoint's state without the head (as a tied model's checkpoint may hold it): the head is the embedding
    state = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = skeleton.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        torch.testing.assert_close(skeleton.float().eval()(ids).logits, tied(ids).logits, atol=1e-5, rtol=1e-5)
