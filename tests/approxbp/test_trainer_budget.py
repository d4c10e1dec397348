"""ApproxBPCallback's promises on every step of a real Trainer run (CPU, each step's peak counted by
``_step_peaks.StepPeaks`` under ``as_kernels``/``as_a_gpu_runs_it``, so that the CPU step allocates what the planned
GPU step does): a budget holds from step 1, with gradient accumulation, label smoothing and eager attention; the
moves are in force on the first call; evaluation first, a second model and a plan for another model are handled."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _plans import share_plans  # noqa: E402
from _step_peaks import LiveBytes, StepPeaks, held  # noqa: E402
from _tiny_llm import padded as _padded  # noqa: E402
from _tiny_llm import tiny_data, tiny_llama  # noqa: E402
from _tiny_llm import varied as _varied  # noqa: E402
from approxbp.kernels.ops.custom_ops import as_kernels  # noqa: E402

from approxbp.planner.attention import as_a_gpu_runs_it  # noqa: E402
from approxbp.planner.tracker import Tracker  # noqa: E402
from approxbp.trainer import ApproxBPCallback  # noqa: E402

BUDGET = 440_000  # under the stock step's 451 200 bytes (fp32 AdamW, batch 2 × 16 tokens)


@pytest.fixture(autouse=True)
def _each_step_planned_once(monkeypatch, tmp_path_factory):
    share_plans(monkeypatch, tmp_path_factory)


def _trainer(model, tmp_path, callbacks, steps=3, **extra):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, **extra)
    return transformers.Trainer(model=model, args=args, train_dataset=tiny_data(), eval_dataset=tiny_data()[:4],
                                callbacks=callbacks)


def _peaks(build, tmp_path, callback=None, **extra):
    torch.manual_seed(0)
    peaks = StepPeaks(callback)
    trainer = _trainer(build(), tmp_path, [c for c in (callback, peaks) if c], **extra)
    with as_kernels(), as_a_gpu_runs_it():
        trainer.train()
    return peaks.peaks


def test_the_step_counter_is_memtrackers_count():
    """The counter the budget tests read agrees with PyTorch's MemTracker on a whole step, byte for byte."""
    counts = []
    for make in (Tracker, None):
        torch.manual_seed(0)
        model = tiny_llama().train()
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ids = torch.stack([r["input_ids"] for r in tiny_data()[:2]])
        counter = make() if make else LiveBytes(held(model, opt))
        if make:
            counter.track_external(model, opt)
        with counter:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        counts.append(next(iter(counter.get_tracker_snapshot("peak").values()))["Total"] if make else counter.peak)
    assert counts[0] == counts[1] > 0


def _eager():
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("build, extra", [
    (tiny_llama, {}),
    (tiny_llama, {"gradient_accumulation_steps": 4}),
    (tiny_llama, {"label_smoothing_factor": 0.1}),
    (_eager, {}),
], ids=["plain", "gradient-accumulation", "label-smoothing", "eager-attention"])
@pytest.mark.slow
def test_a_budget_holds_on_every_step(build, extra, tmp_path):
    """Every step's peak within the budget, and within the trainer's own scalars (its running loss: a few bytes)
    of the plan's traced peak: accumulation plans the gradients alive through each micro-batch; label smoothing (the
    trainer computes the loss from the logits) plans without the chunked loss; eager attention is planned eager."""
    stock = _peaks(build, tmp_path / "stock", **extra)
    callback = ApproxBPCallback(budget=BUDGET)
    ours = _peaks(build, tmp_path / "ours", callback, **extra)
    plan = callback.plan
    assert max(stock) > BUDGET >= max(ours), (stock, ours)
    assert all(0 <= peak - plan.after.peak <= 512 for peak in ours[1:]), (ours, plan.after.peak)
    assert ("gradients accumulated" in plan.mode) == ("gradient_accumulation_steps" in extra)
    assert plan.chunked_loss == ("label_smoothing_factor" not in extra)


@pytest.mark.parametrize("eval_first", [False, True], ids=["train-first", "eval-on-start"])
def test_the_chunked_loss_is_in_force_on_the_first_call_and_evaluation_first_runs_stock(eval_first, tmp_path):
    """Both training steps' calls return no logits (the chunked loss ran from step 1); an evaluation before training
    (eval_on_start) runs the stock model, unpatched, and leaves the
    patch for the first training call."""
    model = tiny_llama()
    calls = []
    callback = ApproxBPCallback(family="invact", chunked_loss=True)
    model.register_forward_hook(lambda m, a, out: calls.append((m.training, "logits" not in out,
                                                                callback.report is not None)))
    _trainer(model, tmp_path, [callback], steps=2, eval_on_start=eval_first, eval_strategy="steps",
             eval_steps=10).train()
    if eval_first:
        assert calls[0] == (False, False, False), calls  # the evaluation: stock
    steps = [logits_none for training, logits_none, patched in calls if training and patched]
    assert steps == [True, True], calls  # steps 1 and 2 (the proofs ran before the report existed)


def test_label_smoothing_with_the_chunked_loss_is_refused_at_the_start(tmp_path):
    callback = ApproxBPCallback(family="invact", chunked_loss=True)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1.*drop chunked_loss"):
        _trainer(tiny_llama(), tmp_path, [callback], label_smoothing_factor=0.1).train()


@pytest.mark.slow
def test_a_second_model_is_patched_too(tmp_path):
    callback = ApproxBPCallback(budget=BUDGET)
    first = tiny_llama()
    _trainer(first, tmp_path, [callback], steps=1).train()
    report, plan = callback.report, callback.plan
    second = tiny_llama()
    _trainer(second, tmp_path, [callback], steps=1).train()
    assert callback.report is not report and callback.plan is not plan
    for model in (first, second):
        assert "_approxbp_chunked_loss" in model.__dict__


@pytest.mark.slow
def test_a_plan_applies_only_to_the_model_it_was_made_for(tmp_path):
    callback = ApproxBPCallback(budget=BUDGET)
    _trainer(tiny_llama(), tmp_path, [callback], steps=1).train()
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=64, max_position_embeddings=32))
    with pytest.raises(ValueError, match="made for another model: planned weights 21 tensors"):
        callback.plan.apply(wider)
    callback.plan.apply(tiny_llama())  # the same shapes: applies


@pytest.mark.slow
def test_the_budget_is_planned_at_the_longest_batch_the_run_will_see(tmp_path):
    """The first batch has 8 tokens, later ones 24 (dynamic padding, sequential order): planned at 24, every step
    within a budget (540 000 bytes) that the stock step at 8 tokens fits and at 24 does not (607 000)."""
    budget = 540_000
    callback = ApproxBPCallback(budget=budget)
    torch.manual_seed(0)
    peaks = StepPeaks(callback)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
                                          learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          seed=0, disable_tqdm=True, train_sampling_strategy="sequential")
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=_varied(), data_collator=_padded,
                                   callbacks=[callback, peaks])
    with as_kernels(), as_a_gpu_runs_it():
        trainer.train()
    assert callback.plan.seq == 24 and callback.plan.batch == 2
    assert max(peaks.peaks) <= budget, peaks.peaks
    assert peaks.peaks[0] < peaks.peaks[-1]  # the longer batches do reach further


def test_the_longest_sequence_is_read_off_the_dataloader():
    from types import SimpleNamespace

    from approxbp.trainer import longest_sequence

    rows = _varied()
    assert longest_sequence(torch.utils.data.DataLoader(rows, collate_fn=_padded)) == 24
    rounded = SimpleNamespace(dataset=rows, collate_fn=SimpleNamespace(pad_to_multiple_of=16))
    assert longest_sequence(rounded) == 32
    fixed = SimpleNamespace(dataset=rows, collate_fn=SimpleNamespace(padding="max_length", max_length=30))
    assert longest_sequence(fixed) == 30

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows)

    assert longest_sequence(torch.utils.data.DataLoader(Stream())) is None
    assert longest_sequence(None) is None


def test_the_model_is_planned_with_its_own_experts_implementation():
    """A Qwen3-MoE in fp32 with grouped_mm is refused with the advice experts_implementation=batched_mm; a model
    built that way is planned that way (its config JSON drops the setting: the advice once led back to the refusal)."""
    from approxbp.planner.training import Setup
    from approxbp.trainer import plan_for

    def build(**kw):
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32, **kw))

    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="experts_implementation=batched_mm"):
        plan_for(build(), {"input_ids": ids, "labels": ids}, 10**8, gpu=None, setup=Setup(weights="fp32"), longest=16)
    plan = plan_for(build(experts_implementation="batched_mm"), {"input_ids": ids, "labels": ids}, 10**8, gpu=None,
                    setup=Setup(weights="fp32"), longest=16)
    assert plan.after.peak <= 10**8


def test_on_a_gpu_each_steps_real_peak_is_checked_against_the_budget(monkeypatch, caplog):
    """The callback's GPU check with torch.cuda's counters stood in for (no GPU here): the first step's peak logged
    beside the plan's, a step over the budget warned once."""
    import logging
    from types import SimpleNamespace

    import approxbp.trainer as trainer

    callback = ApproxBPCallback(budget=BUDGET)
    callback.plan = SimpleNamespace(after=SimpleNamespace(peak=430_000))
    peaks = iter([420_000, 450_000, 460_000])
    monkeypatch.setattr(trainer, "_cuda_device", lambda model: "cuda:0")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: next(peaks))
    with caplog.at_level(logging.INFO, logger="approxbp"):
        for step in (1, 2, 3):
            callback.on_step_begin(None, SimpleNamespace(global_step=step - 1), None, model=None)
            callback.on_step_end(None, SimpleNamespace(global_step=step), None, model=None)
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 1 peaked at 420000" in m and "planned 430000" in m for m in messages), messages
    over = [m for m in messages if "over the budget" in m]
    assert len(over) == 1 and "step 2 peaked at 450000" in over[0], messages


@pytest.mark.slow
def test_a_budget_plan_weighs_the_users_own_tables(tmp_path):
    """ApproxBPCallback(budget=…, tables=[FILE]): the file is one more option of its activation in the plan's
    search (Request.tables), measured beside the packaged ones; the run trains."""
    import shutil

    from approxbp.approximations import tables as table_files

    from approxbp.planner.plan_step import TABLE_OPTION, option_table

    mine = tmp_path / "my-silu.json"
    shutil.copy(table_files.resolve(option_table("silu", "relu-sum-k2")), mine)
    callback = ApproxBPCallback(budget=BUDGET, tables=[str(mine)])
    _trainer(tiny_llama(), tmp_path, [callback], steps=1).train()
    assert TABLE_OPTION + str(mine.resolve()) in callback.plan.options["silu"]
    assert callback.plan.after.peak <= BUDGET


class _ReadsTheLogits(transformers.Trainer):
    """A compute_loss of a user's own: the loss from the model's, and a token accuracy from its logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        self.accuracy = (out.logits[:, :-1].argmax(-1) == inputs["labels"][:, 1:]).float().mean()
        return out.loss


class _PopsTheLabels(transformers.Trainer):
    """A compute_loss of a user's own that calls the model without labels and computes the loss from its logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _custom(trainer_class, model, tmp_path, callbacks, steps=2):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps,
                                          learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          seed=0, disable_tqdm=True)
    return trainer_class(model=model, args=args, train_dataset=tiny_data(), callbacks=callbacks)


@pytest.mark.slow
def test_a_compute_loss_that_reads_the_logits_is_told_why_there_are_none(tmp_path):
    """With the chunked loss in force, reading outputs.logits raises an error that names the move and the way out
    (it used to read None and fail on a None, naming neither); with chunked_loss=False it trains."""
    with pytest.raises(AttributeError, match="approxbp's chunked loss .*chunked_loss=False"):
        _custom(_ReadsTheLogits, tiny_llama(), tmp_path, [ApproxBPCallback(family="invact", chunked_loss=True)]
                ).train()
    callback = ApproxBPCallback(budget=BUDGET, chunked_loss=False)
    peaks = StepPeaks(callback)
    trainer = _custom(_ReadsTheLogits, tiny_llama(), tmp_path, [callback, peaks])
    with as_kernels(), as_a_gpu_runs_it():
        trainer.train()
    assert not callback.plan.chunked_loss and 0 < trainer.accuracy <= 1
    assert max(peaks.peaks) <= BUDGET, peaks.peaks


@pytest.mark.slow
def test_a_training_call_without_labels_is_planned_without_the_chunked_loss(tmp_path, caplog):
    """A compute_loss that pops the labels: the model computes no loss, so the budget cannot count on the chunked
    loss; planned without it (said), every step within the budget."""
    callback = ApproxBPCallback(budget=BUDGET)
    peaks = StepPeaks(callback)
    trainer = _custom(_PopsTheLabels, tiny_llama(), tmp_path, [callback, peaks], steps=3)
    with caplog.at_level("WARNING", logger="approxbp"), as_kernels(), as_a_gpu_runs_it():
        trainer.train()
    assert not callback.plan.chunked_loss and "carries no labels" in caplog.text
    assert max(peaks.peaks) <= BUDGET, peaks.peaks


def test_a_batch_past_the_planned_shape_is_said_once(tmp_path, caplog):
    """An iterable dataset (its longest sequence unreadable): planned at the first batch's 8 tokens, said; the
    first 24-token batch past it is warned once, with both shapes."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_varied())

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
                                          learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          seed=0, disable_tqdm=True)
    callback = ApproxBPCallback(budget=540_000)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Stream(), data_collator=_padded,
                                   callbacks=[callback])
    with caplog.at_level("WARNING", logger="approxbp"):
        trainer.train()
    assert callback.plan.seq == 8
    assert "cannot be read" in caplog.text
    past = [r.getMessage() for r in caplog.records if "past the" in r.getMessage()]
    assert len(past) == 1 and "2 × 24 tokens, past the 2 × 8" in past[0], past


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_budget_under_trls_fused_head_is_refused_before_the_first_step(kind, tmp_path):
    """TRL ≥ 1.x computes its loss with its own fused LM head (DPO's with the chosen and rejected rows and a
    reference model besides): measured on the CPU, DPO's steps peak at 7.8 MB where the planned step is 0.59 MB.
    The planner does not trace that loss, so a budget is refused at on_train_begin, by name."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from _tiny_llm import tiny_tokenizer

    model = tiny_llama()
    model.config.pad_token_id = 0
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                  use_cpu=True, save_strategy="no", disable_tqdm=True)
    words = [" ".join(f"t{(i + j) % 64}" for j in range(8)) for i in range(8)]
    if kind == "sft":
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), processing_class=tiny_tokenizer(),
                                 train_dataset=datasets.Dataset.from_list([{"text": w} for w in words]),
                                 callbacks=[ApproxBPCallback(budget=BUDGET)])
    else:
        rows = [{"prompt": w, "chosen": words[(i + 1) % 8], "rejected": words[(i + 3) % 8]}
                for i, w in enumerate(words)]
        trainer = trl.DPOTrainer(model=model, ref_model=tiny_llama(), args=trl.DPOConfig(**common),
                                 processing_class=tiny_tokenizer(), train_dataset=datasets.Dataset.from_list(rows),
                                 callbacks=[ApproxBPCallback(budget=BUDGET)])
    with pytest.raises(ValueError, match="TRL's fused LM head.*a budget cannot be promised"):
        trainer.train()


class _HoldsATeacher(transformers.Trainer):
    """A trainer of a user's own holding a second model through every step (an EMA teacher, updated after each)."""

    def __init__(self, *a, teacher, **k):
        super().__init__(*a, **k)
        self.teacher = teacher

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        with torch.no_grad():
            for t, p in zip(self.teacher.parameters(), model.parameters()):
                t.lerp_(p, 0.01)
        return loss


@pytest.mark.slow
def test_a_resident_model_is_taken_off_the_budget(tmp_path):
    """resident=[teacher]: its weights and buffers (90,784 bytes here) come off the budget before planning, and
    every step — the teacher's weights counted — stays within the budget; without it the same budget is exceeded."""
    def run(callback, teacher):
        peaks = StepPeaks(callback)
        peaks.held_too = [*teacher.parameters(), *teacher.buffers()]
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                              learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
                                              seed=0, disable_tqdm=True)
        trainer = _HoldsATeacher(model=tiny_llama(), args=args, train_dataset=tiny_data(), callbacks=[callback, peaks],
                                 teacher=teacher)
        with as_kernels(), as_a_gpu_runs_it():
            trainer.train()
        return peaks.peaks

    torch.manual_seed(0)
    teacher = tiny_llama().requires_grad_(False)
    held = 4 * sum(t.numel() for t in (*teacher.parameters(), *teacher.buffers()))  # 90 784 bytes
    budget = BUDGET + held  # the step planned within BUDGET; stock's step and the teacher: 541 952
    blind = run(ApproxBPCallback(budget=budget), teacher)
    callback = ApproxBPCallback(budget=budget, resident=[teacher])
    ours = run(callback, teacher)
    assert max(ours) <= budget < max(blind), (ours, blind)
    assert callback.plan.budget == BUDGET
    with pytest.raises(TypeError, match="resident= takes the modules"):
        ApproxBPCallback(family="invact", resident=[teacher])
