"""The tiny causal LM and data the Trainer tests train (next token = token + 1, so the loss falls fast)."""

import torch
import transformers

VOCAB = 64


def tiny_data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, VOCAB, (48, 1), generator=g) + torch.arange(16)) % VOCAB  # next token = token + 1
    return [{"input_ids": r, "labels": r} for r in ids]


def tiny_llama() -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32))
