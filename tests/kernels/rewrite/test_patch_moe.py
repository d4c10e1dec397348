"""MoE experts with 3-d parameters (issue 44): transformers' grouped/batched experts forwards call
``self._apply_gate(gate_up)`` = act(g)·u; the patch installs the exact fused GLU there, so act(g) is not saved, the
model computes and trains as stock, and unpatching restores the class's gate."""

import copy

import pytest
import torch
from approxbp.kernels import patch_model, unpatch
from approxbp.kernels.ops.saved import saved_bytes
from approxbp.kernels.rewrite import swaps
from approxbp.kernels.rewrite.moe_patch import ExactExpertGate

transformers = pytest.importorskip("transformers")


def _mixtral(implementation="batched_mm", act="silu"):
    """A tiny Mixtral in float64 (batched_mm: grouped_mm takes float32/bf16/fp16 only)."""
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, hidden_act=act)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).double()


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _experts(model):
    return [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]


def _loss(model):
    return model(input_ids=IDS, labels=IDS, use_cache=False).loss


def _trains_alike(stock, model):
    """3 AdamW steps of each: the parameters equal to 1e-9 (float64)."""
    for m in (stock, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            _loss(m).backward()
            opt.step()
    for a, b in zip(stock.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_exact_gate_frees_act_g_and_trains_as_stock():
    stock = _mixtral()
    model = copy.deepcopy(stock)
    report = patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    assert len(report.glus) == 2 and all("ExactExpertGate(glu-silu)" in g for g in report.glus), report
    assert all(isinstance(swaps.expert_gate(m), ExactExpertGate) for m in _experts(model))
    # act(g) is one [tokens × top-k, intermediate] float64 tensor per layer: every routed row, 2 layers
    act_g = 2 * IDS.numel() * 2 * 48 * 8
    stock_bytes = saved_bytes(lambda: _loss(stock), exclude=list(stock.parameters()))
    ours_bytes = saved_bytes(lambda: _loss(model), exclude=list(model.parameters()))
    assert stock_bytes - ours_bytes == act_g, (stock_bytes, ours_bytes)
    _trains_alike(stock, model)


def test_grouped_mm_experts_recompute_the_down_projections_input_and_train_as_stock():
    """transformers' default implementation (grouped_mm, float32 here): the experts' forward runs the gate and the
    down projection under one checkpoint, so neither act(g) nor h = act(g)·u (the down projection's input) is
    saved — two [tokens × top-k, intermediate] float32 tensors per layer — and the model trains as stock."""
    stock = _mixtral("grouped_mm").float()
    model = copy.deepcopy(stock)
    report = patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    assert len(report.glus) == 2 and report.max_output_difference < 1e-5, report
    assert all("down projection's input act(g)·u recomputed" in g for g in report.glus), report.glus
    rows = IDS.numel() * 2  # every token routed to 2 experts
    act_g_and_h = 2 * 2 * rows * 48 * 4
    stock_bytes = saved_bytes(lambda: _loss(stock), exclude=list(stock.parameters()))
    assert stock_bytes - saved_bytes(lambda: _loss(model), exclude=list(model.parameters())) == act_g_and_h
    losses, first = [], []
    for m in (stock, model):
        opt, got = torch.optim.AdamW(m.parameters(), lr=1e-2), []
        for step in range(3):
            opt.zero_grad()
            loss = _loss(m)
            loss.backward()
            got.append(loss.item())
            if step == 0:
                first.append([p.grad.clone() for p in m.parameters()])
            opt.step()
        losses.append(got)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # float32: the fused GLU's backward rounds otherwise
    for a, b in zip(*first):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))
    unpatch(model)
    assert all("forward" not in m.__dict__ for m in _experts(model))


def test_unpatch_gives_the_class_gate_back():
    model = _mixtral()
    patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    unpatch(model)
    assert all(swaps.expert_gate(m) is None and "_apply_gate" not in m.__dict__ for m in _experts(model))


def test_the_eager_loop_is_skipped_with_the_reason():
    """The per-expert loop calls act_fn itself: nothing to install, and the skip says which setting would."""
    model = _mixtral("eager")
    report = patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    assert not report.glus and any("'eager' implementation" in s and "_experts_implementation" in s
                                   for s in report.skipped), report.skipped


def test_a_gate_that_is_not_a_fused_glu_is_skipped():
    """ReLU experts: act(g)·u has no fused GLU; reported, never guessed."""
    report = patch_model(_mixtral(act="relu"), family=None, norms=False, example_input={"input_ids": IDS})
    assert not report.glus and any("has no fused GLU" in s for s in report.skipped), report.skipped


@pytest.mark.parametrize("use_triton", [False, True])
def test_the_gate_on_a_concatenated_projection_matches_act_g_times_u(use_triton):
    """Non-contiguous halves of [g | u] (the Triton kernel under TRITON_INTERPRET=1 included), values and both
    gradients against silu(g)·u by autograd, float32."""
    z = torch.randn(37, 2 * 24, generator=torch.Generator().manual_seed(2)).requires_grad_()
    ref = z.detach().clone().requires_grad_()
    got = ExactExpertGate("silu", use_triton=use_triton)(z)
    g, u = ref.chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    dh = torch.randn_like(want)
    got.backward(dh)
    want.backward(dh)
    torch.testing.assert_close(z.grad, ref.grad, rtol=2e-6, atol=1e-6)


def _llama4():
    cfg = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                        intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(cfg).double()


def test_llama4s_own_experts_forward_keeps_gate_up_only_and_trains_as_stock():
    """Llama-4's experts run their own bmm forward (no _apply_gate): act and the down projection under one
    checkpoint keep [g | u] in place of act(g) and u·act(g) — two [experts × tokens, intermediate] float64 tensors
    per layer (every expert sees every token) — with the stock values and gradients; unpatch restores it."""
    stock = _llama4()
    model = copy.deepcopy(stock)
    report = patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    own = [g for g in report.glus if "Llama4TextExperts" in g]
    assert len(own) == 2 and all("u·act(g) recomputed" in g for g in own), report.glus
    rows = 4 * IDS.numel()
    stock_bytes = saved_bytes(lambda: _loss(stock), exclude=list(stock.parameters()))
    ours_bytes = saved_bytes(lambda: _loss(model), exclude=list(model.parameters()))
    experts = 2 * 2 * rows * 48 * 8  # act(g) and u·act(g), 2 layers
    shared = 2 * IDS.numel() * 48 * 8  # the shared expert's act(g): an ordinary gated MLP, fused
    assert stock_bytes - ours_bytes == experts + shared, (stock_bytes, ours_bytes)
    _trains_alike(stock, model)
    unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules() if type(m).__name__ == "Llama4TextExperts")


def _gpt_oss():
    """A tiny GPT-OSS in float32 (grouped_mm): its experts' own gate, (clamp(u) + 1)·g_c·σ(α g_c) with
    g_c = min(g, limit) on the interleaved [g | u], and a bias on both projections."""
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=32, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():  # biases away from their zero init, so a dropped bias would show
        for m in model.modules():
            if type(m).__name__ == "GptOssExperts":
                m.gate_up_proj_bias.normal_(0, 0.5)
                m.down_proj_bias.normal_(0, 0.5)
    return model


def test_gpt_oss_experts_keep_gate_up_only_and_train_as_stock():
    """GPT-OSS's own gate is no fused GLU, but the gate and the down projection run under one checkpoint from
    [g | u]: the gate's saved intermediates (g_c, σ(α g_c), u_c + 1, their product g_c·σ) and the down projection's
    input h, five [tokens × top-k, intermediate] float32 tensors per layer, are no longer kept (8.6 % saved before,
    on the benchmark's tiny model; 47.5 % now)."""
    stock = _gpt_oss()
    model = copy.deepcopy(stock)
    report = patch_model(model, family=None, norms=False, example_input={"input_ids": IDS})
    assert len(report.glus) == 2 and all("its own gate" in g for g in report.glus), report
    assert report.max_output_difference < 1e-5, report
    rows = IDS.numel() * 2
    intermediates = 2 * 5 * rows * 48 * 4
    stock_bytes = saved_bytes(lambda: _loss(stock), exclude=list(stock.parameters()))
    assert stock_bytes - saved_bytes(lambda: _loss(model), exclude=list(model.parameters())) == intermediates
    grads = []
    for m in (stock, model):
        m.zero_grad()
        _loss(m).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))
    unpatch(model)
    assert all(swaps.expert_gate(m) is None and "forward" not in m.__dict__ for m in model.modules())
