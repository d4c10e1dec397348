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


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whitespace-split words t0 … t63 as the tokens 0 … 63 (t0 pads, t1 is unknown, t2 ends)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def varied() -> list[dict]:
    """Rows of 8 tokens, then rows of 24: a first batch shorter than the run's longest."""
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": (torch.randint(0, 64, (1,), generator=g) + torch.arange(n)) % 64}
            for n in [8] * 4 + [24] * 8]


def padded(rows: list[dict]) -> dict:
    """Dynamic padding, as DataCollatorWithPadding does: each batch to its own longest row."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r["input_ids"], (0, n - len(r["input_ids"]))) for r in rows])
    labels = torch.stack([torch.nn.functional.pad(r["input_ids"], (0, n - len(r["input_ids"])), value=-100)
                          for r in rows])
    return {"input_ids": ids, "labels": labels}
