"""Models and their preparation: loading a policy, the pretrained folders, the tiny model, tokenizers, the warm start."""
