"""The chunked loss: the stock loss and gradients without the logits, and the bytes it saves counted independently
(r × V fp32 log-softmax values)."""

import copy

import pytest
import torch
from approxbp.kernels.ops.saved import saved_bytes

from approxbp.planner.chunked_loss import NotChunked, apply_chunked_loss, chunk_rows, remove_chunked_loss

transformers = pytest.importorskip("transformers")

VOCAB = 512


def _llama(dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # prompt tokens the loss ignores
    return ids, labels


@pytest.mark.parametrize("num_items", [None, 37])
def test_the_chunked_loss_is_the_stock_loss_with_the_stock_gradients(num_items):
    stock = _llama(torch.float64)
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    got = []
    for model in (stock, ours):
        out = model(input_ids=ids, labels=labels, **extra)
        out.loss.backward()
        got.append(out)
    assert "logits" not in got[1] and got[0].logits.shape == (2, 24, VOCAB)
    with pytest.raises(AttributeError, match="chunked loss .* made no logits.*chunked_loss=False"):
        _ = got[1].logits  # a compute_loss of the user's that reads them: told why, and how to have them
    assert getattr(got[1], "logits", None) is None and "logits=<not made" in repr(got[1])
    assert got[1].loss.item() == pytest.approx(got[0].loss.item(), rel=1e-6)  # fp32 logits in both (HF upcasts)
    for a, b in zip(stock.parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-9)


def test_it_saves_the_log_softmax_values_a_stock_step_keeps():
    stock = _llama()
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    counts = [saved_bytes(lambda m=m: m(input_ids=ids, labels=labels).loss, exclude=list(m.parameters()))
              for m in (stock, ours)]
    rows = ids.numel()
    assert 0 <= rows * VOCAB * 4 - (counts[0] - counts[1]) <= 16, counts  # less the loss's few saved scalars


def test_under_autocast_the_loss_is_the_stock_loss():
    stock = _llama()
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [m(input_ids=ids, labels=labels).loss.item() for m in (stock, ours)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_without_labels_or_without_grad_the_model_returns_its_logits():
    stock = _llama()
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits)
    with torch.no_grad():
        out = ours(input_ids=ids, labels=labels)
    assert out.logits is not None and out.loss.item() == pytest.approx(stock(input_ids=ids, labels=labels).loss.item())
    remove_chunked_loss(ours)
    assert "forward" not in ours.__dict__ and ours(input_ids=ids, labels=labels).logits is not None


def test_a_model_that_changes_its_logits_after_the_head_is_refused_at_the_call(monkeypatch):
    """The call's own check, for a change no construction-time refusal knows (Gemma-2's cap stands in for one)."""
    from approxbp.planner import chunked_loss

    monkeypatch.setattr(chunked_loss, "refusal", lambda model: None)
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    final_logit_softcapping=30.0)
    model = apply_chunked_loss(transformers.Gemma2ForCausalLM(cfg))
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match="changes its logits after the head"):
        model(input_ids=ids, labels=labels)


def test_a_model_without_a_causal_lm_loss_is_refused():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4)
    with pytest.raises(ValueError, match="not transformers' ForCausalLMLoss"):
        apply_chunked_loss(transformers.BertForMaskedLM(cfg))


@pytest.mark.parametrize(("rows", "width", "vocab", "expected"), [(48, 32, 512, 48), (4096, 4096, 128256, 512),
                                                                   (65536, 4096, 128256, 2048), (5, 64, 32, 5)])
def test_a_chunk_has_logits_the_size_of_the_hidden_states_and_rows_enough_to_be_compute_bound(rows, width, vocab,
                                                                                                 expected):
    assert chunk_rows(rows, width, vocab) == expected


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                      output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)  # (its grouped_mm experts refuse float64)


def test_an_moe_models_auxiliary_loss_is_kept():
    """Issue 58: the chunked loss ran the model with labels=None and lost router_aux_loss_coef · aux_loss (4.563 where
    stock returns 5.565, the router's gradients off by 0.027). The model now computes its own loss with its labels."""
    stock = _qwen3_moe()
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    outs = []
    for model in (stock, ours):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        outs.append(out)
    assert outs[0].aux_loss is not None and float(outs[0].aux_loss) > 0
    assert outs[1].loss.item() == pytest.approx(outs[0].loss.item(), rel=1e-6)  # fp32, summed in another order
    for (name, a), b in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_models_signature_stays_visible():
    """Issue 58: Trainer's remove_unused_columns keeps the columns the forward's signature names; the wrapper's
    (*args, labels=None, **kwargs) made it drop input_ids."""
    import inspect

    model = _llama()
    before = list(inspect.signature(model.forward).parameters)
    apply_chunked_loss(model)
    assert list(inspect.signature(model.forward).parameters) == before and "input_ids" in before


def test_return_dict_false_gives_the_stock_tuple_with_the_stock_loss():
    """Issue 58: return_dict=False raised a misleading "changes its logits after the head"."""
    stock = _llama(torch.float64)
    ours = apply_chunked_loss(copy.deepcopy(stock))
    ids, labels = _batch()
    want = stock(input_ids=ids, labels=labels, return_dict=False)
    got = ours(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) and got[1] is None
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-9)
    positional = ours(ids, None, None, None, None, labels)  # labels given by position
    assert positional.loss.item() == pytest.approx(want[0].item(), rel=1e-9)


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32))


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                                                                         num_layers=1, num_heads=4))


@pytest.mark.parametrize("build, why", [(_gemma2, "soft-caps its logits"), (_bart, "encoder-decoder"),
                                        (_t5, "encoder-decoder")], ids=["gemma2", "bart", "t5"])
def test_soft_capped_and_seq2seq_heads_are_refused_before_any_call(build, why, tmp_path):
    """Refused by apply_chunked_loss and by the Trainer callback at on_train_begin (they once crashed at a step)."""
    from approxbp.trainer import ApproxBPCallback

    model = build()
    with pytest.raises(NotChunked, match=why):
        apply_chunked_loss(model)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=f"chunked loss: .*{why}.*drop chunked_loss"):
        ApproxBPCallback(family="invact", chunked_loss=True).on_train_begin(args, None, None, model=model)
