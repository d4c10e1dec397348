"""The planner's set-up options: LoRA as peft lays it out (fp32 adapters on a 16-bit base, any
targets, all-linear), fp32 weights under autocast, optimizers and sharding. On real tensors the planner's saved
bytes and trainable bytes equal those of a real peft model counted with saved_tensors_hooks."""

import pytest
import torch
from approxbp.kernels.ops.saved import charged

from approxbp.planner import models as MD
from approxbp.planner import plan as P
from approxbp.planner import plan_step as PS
from approxbp.planner import step_memory as SM
from approxbp.planner import training as SU
from approxbp.planner.request import Request
from approxbp.planner.training import PRESETS, Setup, optimizer_bytes, per_rank

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
LLAMA = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100"


def _peft_llama(weights: torch.dtype, targets, dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).to(weights)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, lora_dropout=dropout)).train()


@pytest.mark.parametrize("setup, targets", [
    (PRESETS["lora"], ["q_proj", "v_proj"]),
    (Setup(train="lora", lora_targets="all-linear"), "all-linear"),
    (Setup(weights="fp32", autocast="bf16", train="lora"), ["q_proj", "v_proj"]),  # the papers' AMP with LoRA
    (Setup(train="lora", lora_targets=("gate_proj", "up_proj", "down_proj")), ["gate_proj", "up_proj", "down_proj"]),
])
def test_lora_plans_what_a_real_peft_model_saves_and_trains(setup, targets):
    step = PS.stepper(Request(model=LLAMA, setup=setup, fake=False))(2, 16)
    model = _peft_llama(setup.dtype, targets)
    ids = torch.zeros(2, 16, dtype=torch.long)
    saved = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.autocast != "off"):
        with charged(saved, list(model.parameters()), model):
            model(input_ids=ids, labels=ids)  # the planner trains on the head's own loss
    assert sum(saved.values()) == step.activations
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}  # peft's default: fp32 adapters, on a 16-bit base too
    assert sum(p.numel() * p.element_size() for p in trainable) == step.gradients
    assert step.optimizer == 2 * step.gradients
    # fake tensors: the same, byte for byte
    assert PS.stepper(Request(model=LLAMA, setup=setup))(2, 16).saved == step.saved


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
@pytest.mark.parametrize("adapters", ["auto", "bf16"])
def test_lora_dropout_plans_what_a_real_peft_model_with_dropout_saves(targets, adapters):
    """peft's lora_dropout: each adapter saves its own dropped copy of its input and (on a GPU) a 1-byte mask; the
    real model is counted with dropout as CUDA runs it (:func:`approxbp.planner.attention.gpu_dropout`)."""
    from approxbp.planner.attention import gpu_dropout

    setup = Setup(train="lora", lora_targets=targets if isinstance(targets, str) else tuple(targets),
                  lora_dropout=0.1, adapters=adapters)
    step = PS.stepper(Request(model=LLAMA, setup=setup, fake=False))(2, 16)
    model = _peft_llama(setup.dtype, targets, dropout=0.1)
    if adapters == "bf16":
        model.to(torch.bfloat16)
    ids = torch.zeros(2, 16, dtype=torch.long)
    saved = {}
    with gpu_dropout(), charged(saved, list(model.parameters()), model):
        model(input_ids=ids, labels=ids)
    assert sum(saved.values()) == step.activations
    without = PS.stepper(Request(model=LLAMA, setup=Setup(train="lora", lora_targets=setup.lora_targets,
                                                          adapters=adapters)))(2, 16)
    assert step.activations > without.activations  # the copies and masks are counted
    assert PS.stepper(Request(model=LLAMA, setup=setup))(2, 16).saved == step.saved


def test_the_planner_counts_a_gpus_one_byte_dropout_mask_not_the_cpus():
    """On a CPU, F.dropout keeps a mask in the input's dtype (4 bytes per fp32 element); CUDA's native_dropout a
    bool. RoBERTa-style models (dropout 0.1 on attention probabilities and hidden states) are planned with the
    GPU's: Approx-BP Table 4's exact step is 1.26 GiB lighter for it (issue 45)."""
    from approxbp.planner.attention import gpu_dropout

    x = torch.randn(4, 8, requires_grad=True)
    for ctx, dtype in ((torch.enable_grad(), torch.float32), (gpu_dropout(), torch.bool)):
        kept = []

        def keep(t, kept=kept):
            kept.append(t.dtype)
            return t
        with ctx, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = torch.nn.Dropout(0.5)(x)
        assert kept == [dtype]
        y.sum().backward()  # and the gradient is a dropout's: 0 or 1/(1 − p)
        assert set(x.grad.flatten().tolist()) <= {0.0, 2.0}
        x.grad = None
    with gpu_dropout():  # eval mode, p = 0 and in place are left as they are
        assert torch.nn.Dropout(0.5).eval()(x) is x
        assert torch.nn.functional.dropout(x, 0.0).equal(x)


def test_optimizers_and_shards():
    params = [torch.empty(1000, 10, dtype=torch.bfloat16, device="meta"), torch.empty(7, dtype=torch.bfloat16,
                                                                                       device="meta")]
    assert optimizer_bytes(params, "adamw") == 2 * 2 * 10007 and optimizer_bytes(params, "sgd") == 0
    assert optimizer_bytes(params, "adamw-8bit") == 2 * (10000 + 4 * 40) + 2 * (7 + 4 * 1)  # bnb: 1 B + absmax/256
    shards = per_rank(params, 3)
    assert [tuple(p.shape) for p in shards] == [(334, 10), (3,)]  # dim 0 split, the last shard padded (FSDP2)
    whole, sharded = (PS.stepper(Request(model=LLAMA, setup=Setup(optimizer=o, shard=n)))(2, 16) for o,
                      n in (("adamw", 1), ("sgd", 4)))
    assert sharded.activations == whole.activations and sharded.optimizer == 0
    assert whole.parameters / 4 <= sharded.parameters < whole.parameters / 4 * 1.05


@pytest.mark.parametrize("bad, message", [(dict(weights="fp8"), "--weights"), (dict(train="qlora"), "--train"),
                                          (dict(shard=0), "--shard"), (dict(optimizer="adam"), "--optimizer"),
                                          (dict(lora_dropout=1.0), "--lora-dropout"),
                                          (dict(lora_dropout=-0.1), "--lora-dropout")])
def test_bad_set_ups_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        Setup(**bad)


def test_the_cli_builds_the_set_up_from_options():
    from approxbp.cli import main

    assert main(["plan", LLAMA, "--seq", "16", "--batch", "2", "--weights", "fp32", "--autocast", "bf16", "--train",
                 "lora", "--lora-targets", "all-linear", "--use", "exact", "--no-progress"]) == 0


def test_nf4_stores_4_127_bits_per_parameter_as_qlora_says():
    """QLoRA (Dettmers et al. 2023, §3): double quantisation brings the constants from 0.5 to 0.127 bits per
    parameter, so 4.127 bits in all for large blocks of weights."""
    from approxbp.planner.training import nf4_bytes

    n = 4096 * 11008
    assert 8 * nf4_bytes(n) / n == pytest.approx(4.127, abs=5e-4)


def test_qlora_counts_the_frozen_base_linears_in_nf4_and_the_rest_as_it_is():
    from approxbp.planner.training import HEADS, nf4_bytes

    setup = Setup(weights="nf4", train="lora")
    step = PS.stepper(Request(model=LLAMA, setup=setup))(2, 16)
    bf16 = PS.stepper(Request(model=LLAMA, setup=PRESETS["lora"]))(2, 16)
    assert step.saved == bf16.saved and step.gradients == bf16.gradients  # compute in bf16: the same activations
    with SU.weights_for(setup):
        model = SM.prepare(MD.model_spec(LLAMA)()[0], setup)
    want = sum(nf4_bytes(m.weight.numel()) if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
               and n.rpartition(".")[2] not in HEADS else 0 for n, m in model.named_modules())
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if not (n.endswith(".weight") and isinstance(model.get_submodule(n.rpartition(".")[0]), torch.nn.Linear)
                       and not p.requires_grad and n.rpartition(".")[0].rpartition(".")[2] not in HEADS))
    assert step.parameters == want + rest < bf16.parameters / 2
    with pytest.raises(ValueError, match="do not train"):
        Setup(weights="nf4")


def test_nothing_trains_under_train_none_whatever_the_weights_and_norms():
    """Freezing comes before the NF4 base and the fp32 norms: with --train none every base Linear is NF4 and no
    parameter trains."""
    from approxbp.planner.training import NF4Linear

    for setup in (Setup(weights="nf4", train="none"), Setup(train="none", norms="fp32")):
        with SU.weights_for(setup):
            model = SM.prepare(MD.model_spec(LLAMA)()[0], setup)
        assert not any(p.requires_grad for p in model.parameters())
        assert any(isinstance(m, NF4Linear) for m in model.modules()) == (setup.weights == "nf4")
    assert PS.stepper(Request(model=LLAMA, setup=Setup(weights="nf4", train="none")))(2, 16).gradients == 0


LLAMA4 = "llama:hidden=64,layers=4,heads=4,intermediate=128,vocab=100"


def test_devices_split_the_step_by_blocks_and_sum_to_its_peak():
    """--devices 2 on a 4-block LLaMA: GPU 0 holds the embeddings and blocks 0, 1 (their bf16 weights, gradients
    and AdamW moments, 8 bytes per parameter, and what their modules save), GPU 1 the rest; counted here from a
    real model's modules, independently of StepMemory.device_peaks."""
    from approxbp.kernels.ops.saved import charged

    whole = PS.stepper(Request(model=LLAMA4, setup=Setup(devices=2), fake=False), whole=True)(2, 16)
    assert sum(whole.device_peaks()) == whole.peak == PS.stepper(Request(model=LLAMA4), whole=True)(2, 16).peak
    extrapolated = PS.stepper(Request(model=LLAMA4, setup=Setup(devices=2)))(2, 16)
    assert extrapolated.device_peaks() == whole.device_peaks()  # extrapolated alike
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    saved = {}
    with charged(saved, list(model.parameters()), model):
        model(input_ids=torch.zeros(2, 16, dtype=torch.long), labels=torch.zeros(2, 16, dtype=torch.long))
    first = ("model.embed_tokens", "model.layers.0", "model.layers.1")
    mine = [m for n, m in model.named_modules() if n in first]
    held = 8 * sum(p.numel() for m in mine for p in m.parameters())
    keeps = sum(b for path, b in saved.items() if path.startswith(first))
    assert whole.device_peaks()[0] == held + keeps
    three = PS.stepper(Request(model=LLAMA4, setup=Setup(devices=3)), whole=True)(2, 16)
    assert three.device_peaks()[1] > 0  # 4 blocks over 3 GPUs


def test_a_budget_is_one_gpus_and_is_refused_with_devices():
    from approxbp.cli import main

    with pytest.raises(ValueError, match="--devices"):
        P.plan(Request(model=LLAMA, batch=2, seq=16, setup=Setup(devices=2)), budget=1 << 30)
    assert main(["plan", LLAMA, "--seq", "16", "--devices", "2", "--budget", "1GiB", "--no-progress"]) == 2
    with pytest.raises(ValueError, match="--devices"):
        Setup(devices=2, shard=2)
