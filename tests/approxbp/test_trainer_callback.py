"""Issue 58: approxbp in Hugging Face Trainer through one callback (approxbp.trainer.ApproxBPCallback): patched on
the first real batch, moves applied (chunked loss, recompute), ≥ 20 steps whose losses equal stock's, every
checkpoint loadable into the stock class with the trained values."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llm import VOCAB, tiny_data, tiny_llama  # noqa: E402

from approxbp.planner.step_memory import measure  # noqa: E402
from approxbp.planner.training import Setup  # noqa: E402
from approxbp.trainer import ApproxBPCallback  # noqa: E402

_data, _llama = tiny_data, tiny_llama


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True))


def _train(build, out_dir, callback=None):
    torch.manual_seed(0)
    model = build()
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=20,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_steps=10,
                                          use_cpu=True, seed=0, disable_tqdm=True, data_seed=0)
    # remove_unused_columns at its default (True): the chunked loss keeps the signature Trainer filters columns by
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                   callbacks=[callback] if callback else None)
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("build", [_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
@pytest.mark.slow
def test_trainer_with_the_callback_trains_as_stock_and_saves_stock_checkpoints(build, tmp_path):
    _, stock = _train(build, tmp_path / "stock")
    callback = ApproxBPCallback(family="invact", moves={"model.layers.0": "recompute"}, chunked_loss=True)
    model, ours = _train(build, tmp_path / "ours", callback)
    assert callback.report is not None and callback.report.norms and callback.report.saved_bytes[1] < \
        callback.report.saved_bytes[0], callback.report
    assert "_approxbp_chunked_loss" in model.__dict__  # the move was applied
    assert len(ours) == len(stock) == 20
    for a, b in zip(stock, ours):
        assert b == pytest.approx(a, rel=1e-6, abs=0), (stock, ours)
    ids = torch.arange(12)[None] % VOCAB
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for folder in ("final", "checkpoint-10", "checkpoint-20"):
        loaded = type(model).from_pretrained(str(tmp_path / "ours" / folder)).eval()
        assert type(loaded.model.norm).__name__ == type(build().model.norm).__name__
        if folder != "checkpoint-10":
            with torch.no_grad():
                torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)


def test_an_argument_patch_model_does_not_take_is_refused():
    with pytest.raises(TypeError, match="famliy"):
        ApproxBPCallback(famliy="invact")
    with pytest.raises(TypeError, match="example_input"):
        ApproxBPCallback(example_input=torch.zeros(1))


@pytest.mark.slow
def test_trl_sft_trainer_with_the_callback_trains_as_stock(tmp_path):
    """TRL's SFTTrainer (a Trainer subclass) takes the same callback. Its own fused-head loss (TRL ≥ 1.x chunks the
    head itself) is left as TRL computes it: the chunked-loss move returns the model's result unchanged when the
    call never runs the head module. Losses: without the MS-norms bit for bit; with them the first steps bit for
    bit, then within 5e-4 — the norms' backward rounds otherwise than stock's in fp32 and Adam amplifies it (the
    same curve with family=None, norms only)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models

    data = datasets.Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in _data()])

    def run(callback):
        torch.manual_seed(0)
        model = _llama()
        model.config.pad_token_id = 0
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2",
                                                         unk_token="t1")
        args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=20,
                             learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, save_strategy="no")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                 callbacks=[callback] if callback else None)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    stock = run(None)
    moves = {"model.layers.0": "recompute"}
    without_norms = run(ApproxBPCallback(family="invact", norms=False, moves=moves, chunked_loss=True))
    assert without_norms == stock  # InvAct and the moves: bit for bit
    callback = ApproxBPCallback(family="invact", moves=moves, chunked_loss=True)
    ours = run(callback)
    assert callback.report is not None and callback.report.norms
    assert len(ours) == len(stock) == 20 and ours[:3] == stock[:3]
    for a, b in zip(stock, ours):
        assert b == pytest.approx(a, rel=5e-4), (stock, ours)


@pytest.mark.slow
def test_given_only_a_budget_the_callback_plans_on_the_first_batch_and_trains_as_stock(tmp_path):
    """ApproxBPCallback(budget=…): the model's config planned at the first batch's shape (fp32 AdamW, read off the
    trainer), at a budget under what the fused GLUs and MS-norms alone reach, so the plan recomputes blocks and
    chunks the loss; every planned rewrite applied (none skipped) and the losses stock's."""
    _, stock = _train(_llama, tmp_path / "stock")
    callback = ApproxBPCallback(budget=440_000)
    model, ours = _train(_llama, tmp_path / "ours", callback)
    plan, report = callback.plan, callback.report
    assert plan.after.peak <= 440_000 < plan.before.peak
    assert plan.moves.moves == {"model.layers.0": "recompute", "model.layers.1": "recompute"}
    assert plan.chunked_loss and plan.moves.chunked_loss.chosen
    assert {v.option for v in plan.layers.values()} == {"glu"} and plan.ms_norm.chosen
    assert len(report.glus) == 2 and report.norms and not report.skipped, report
    assert "_approxbp_chunked_loss" in model.__dict__
    ids = torch.zeros(2, 16, dtype=torch.long)  # the step as planned: the end of its forward, byte for byte
    assert measure(model.train(), {"input_ids": ids, "labels": ids}, Setup(weights="fp32")).peak == \
        plan.moves.end_of_forward
    for a, b in zip(stock, ours, strict=True):
        assert b == pytest.approx(a, rel=1e-6, abs=0), (stock, ours)


def test_the_callbacks_ways_in_are_one_at_a_time():
    with pytest.raises(TypeError, match="budget and patch_model's"):
        ApproxBPCallback(budget="1GiB", family="invact")
    with pytest.raises(TypeError, match="give budget="):
        ApproxBPCallback(gpu="h100")
    with pytest.raises(ValueError, match="--gpu 'h1000'"):
        ApproxBPCallback(budget="1GiB", gpu="h1000")
    with pytest.raises(ValueError, match="size '1 GB!'"):
        ApproxBPCallback(budget="1 GB!")
    for bad in (-1, 0, True, 1.5):
        with pytest.raises(ValueError, match="expected bytes"):
            ApproxBPCallback(budget=bad)
    with pytest.raises(ValueError, match="not a block's move; pass chunked_loss=True"):
        ApproxBPCallback(family="invact", moves={"(loss)": "chunked-loss"})
    with pytest.raises(ValueError, match="moves=: block model.layers.0: move 'swap'"):
        ApproxBPCallback(family="invact", moves={"model.layers.0": "swap"})  # at construction, not the first batch
    with pytest.raises(TypeError, match="expected True or False"):
        ApproxBPCallback(family="invact", chunked_loss="yes")
    with pytest.raises(TypeError, match="budget and moves"):
        ApproxBPCallback(budget="1GiB", chunked_loss=True)


def test_the_set_up_read_off_the_trainer_shards_under_fsdp_and_refuses_deepspeed(tmp_path):
    from types import SimpleNamespace

    from approxbp.trainer import trainer_setup

    model = _llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert trainer_setup(args, model).shard == 1
    fsdp = SimpleNamespace(fsdp=["full_shard"], world_size=4, optim="adamw_torch", bf16=False, fp16=False)
    assert trainer_setup(fsdp, model).shard == 4  # each rank's peak is what the budget bounds
    ddp = SimpleNamespace(fsdp=[], world_size=4, optim="adamw_torch")
    assert trainer_setup(ddp, model).shard == 1  # DDP: every rank holds the whole model
    with pytest.raises(ValueError, match="DeepSpeed"):
        trainer_setup(SimpleNamespace(deepspeed="ds.json", optim="adamw_torch"), model)


@pytest.mark.slow
def test_trl_grpo_trainer_patches_after_generation_and_trains_as_stock(tmp_path):
    """GRPO's first calls are generate's (no grad, a KV cache): they run the stock model and the patch waits for the
    first training call (it once patched on the prefill, whose proofs appended to one cache and aborted). Two steps'
    gradient norms equal stock's."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2",
                                                     unk_token="t1")
    data = datasets.Dataset.from_list([{"prompt": " ".join(f"t{(i + j) % VOCAB}" for j in range(6))}
                                       for i in range(8)])

    def run(callback):
        torch.manual_seed(0)
        model = _llama()
        model.config.pad_token_id = 0
        args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=6, max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                              logging_steps=1, disable_tqdm=True, seed=0)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                                                                        completions],
                                  args=args, train_dataset=data, processing_class=tokenizer,
                                  callbacks=[callback] if callback else None)
        trainer.train()
        return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]

    stock = run(None)
    callback = ApproxBPCallback(family="invact", chunked_loss=True)
    ours = run(callback)
    assert callback.report is not None and callback.report.norms, callback.report
    assert len(ours) == len(stock) == 2
    for a, b in zip(stock, ours):
        assert b == pytest.approx(a, rel=1e-4), (stock, ours)
