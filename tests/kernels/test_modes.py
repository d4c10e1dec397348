"""The saving in every mode people train in — autocast, torch.compile (zero graph breaks,
fullgraph), DDP, FSDP2 and activation checkpointing — with the drop-ins as custom ops."""

import copy

import pytest
import torch
from _patched_gpt import _ddp_worker, _patched, has_fsdp2, run_two_ranks  # noqa: E402  (spawned workers import it)
from approxbp.kernels import patch_model
from torch import nn

from approxbp.blocks import GPTBlock, saved_per_token_per_d


@pytest.mark.parametrize("variant", ["relu-sum", "invact"])
def test_autocast_saves_at_least_what_plain_bf16_saves(variant):
    """Per block of a d=128 GPT-style model (two LayerNorms, Linear→GELU→Linear), saved bytes per token·d."""
    kw = {"tokens": 64, "batch": 2}
    saving = {mode: saved_per_token_per_d(GPTBlock, "baseline", False, mode=mode, **kw)
              - saved_per_token_per_d(GPTBlock, variant, False, mode=mode, **kw) for mode in ("bf16", "autocast")}
    assert saving["bf16"] >= 10.9, saving  # measured: 11.0 (relu-sum), 11.5 (invact) of 32.2
    assert saving["autocast"] >= saving["bf16"], saving


def test_ms_norm_output_is_shared_under_autocast():
    from approxbp.kernels import MSLayerNorm, saved_bytes

    lin = nn.Linear(64, 64)
    norm = MSLayerNorm(64)
    x = torch.randn(8, 64, requires_grad=True)
    params = list(lin.parameters())
    with torch.autocast("cpu", torch.bfloat16):
        z = norm(x)
        assert z.dtype == torch.bfloat16
        total = saved_bytes(lambda: lin(norm(x)), exclude=params)
    # z once (bf16, shared with the Linear) + σ⁻¹ per row (fp32) + the bf16 weight copy autocast itself makes
    assert total == 8 * 64 * 2 + 8 * 4 + 64 * 64 * 2


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("activation", ["relu-sum", "invact"])
def test_patched_model_compiles_with_zero_graph_breaks(activation, use_triton):
    model = _patched(activation, use_triton)
    x = torch.randn(2, 8, 32, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager_out = model(x)
    eager_out.square().mean().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().mean().backward()
    assert torch.allclose(out, eager_out, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad, eager_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compiled_patched_block_saves_less_than_compiled_exact():
    kw = {"tokens": 32, "batch": 2}
    exact = saved_per_token_per_d(GPTBlock, "baseline", False, mode="compile", **kw)
    for variant in ("relu-sum", "invact"):
        ours = saved_per_token_per_d(GPTBlock, variant, False, mode="compile", **kw)
        assert ours < exact - 10, (variant, ours, exact)


@pytest.mark.parametrize("use_triton", [False, True])
def test_patched_hf_llama_has_zero_graph_breaks(use_triton):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 16))
    report = patch_model(model, family="relu-sum", example_input={"input_ids": ids})
    assert report.norms and report.glus  # the SwiGLU MLPs: the exact fused op
    for m in model.modules():
        if hasattr(m, "use_triton"):
            m.use_triton = use_triton
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda i: model(input_ids=i, use_cache=False).logits)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.slow
def test_compiled_shared_output_norms_save_what_compiled_stock_saves(autocast):
    """Compiled, the partitioner already saves a norm's input and statistics and recomputes its output for the
    Linears (the MS-norm's saving); the rewritten norms run the stock forward there, so a norms-only patched LLaMA
    saves exactly the compiled stock bytes (under autocast the MS-norm's fp32 z cost 1,536 bytes more than the
    partitioner's bf16 choice) and computes the same loss, while eager it saves less."""
    from approxbp.kernels.ops.saved import saved_bytes

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(cfg)
    ours = copy.deepcopy(stock)
    ids = torch.randint(0, 64, (2, 12))
    assert patch_model(ours, family=None, norms=True, example_input={"input_ids": ids}).norms
    got = {}
    for compiled in (False, True):
        for name, model in (("stock", stock), ("ours", ours)):
            torch._dynamo.reset()
            run = torch.compile(model, backend="aot_eager_decomp_partition") if compiled else model
            loss = []

            def step(run=run, loss=loss):
                loss.append(run(input_ids=ids, labels=ids, use_cache=False).loss)

            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                got[name, compiled] = saved_bytes(step, exclude=list(model.parameters()))
            got[name, compiled, "loss"] = loss[0].item()
    assert got["ours", True] == got["stock", True] and got["ours", False] < got["stock", False], got
    tolerance = 1e-4 if autocast else 1e-6  # bf16 products: another graph may round its reductions otherwise
    assert got["ours", True, "loss"] == pytest.approx(got["stock", True, "loss"], rel=tolerance), got


def test_activation_checkpointing_gives_the_same_gradients():
    from torch.utils.checkpoint import checkpoint

    model = _patched("relu-sum")
    x = torch.randn(2, 8, 32)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        h = x
        for m in model:
            h = checkpoint(m, h, use_reentrant=False) if ckpt and isinstance(m, GPTBlock) else m(h)
        h.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


#: name → (FSDP2 rather than DDP, patched after wrapping)
DISTRIBUTED = {"DDP": (False, False), "FSDP2": (True, False), "DDP-patched-after-wrapping": (False, True),
               "FSDP2-patched-after-sharding": (True, True)}


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    """Every case's gradients from one spawn of two gloo ranks (the cases one after the other), and the input."""
    cases = [(name, *how) for name, how in DISTRIBUTED.items() if has_fsdp2() or not how[0]]
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("distributed")
    codes = run_two_ranks(_ddp_worker, x, str(out), cases)
    assert codes == [0, 0], codes
    return x, out


@pytest.mark.parametrize("case", DISTRIBUTED)
@pytest.mark.slow
def test_distributed_gradients_equal_single_process(case, distributed_grads):
    x, out = distributed_grads
    if DISTRIBUTED[case][0] and not has_fsdp2():
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    grads = torch.load(out / f"{case}.pt")
    single = _patched("relu-sum")
    single(x).square().mean().backward()
    for g, p in zip(grads, single.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["gelu-k2-primitive", "gelu-k5-derivative", "silu-k3-primitive"])
@pytest.mark.parametrize("n", [4, 9, 4097])
def test_fake_relu_sum_forward_has_the_real_shapes(name, n):
    """torch.compile plans with the fake kernel: its packed size must be the real one (whole rows, whole words)."""
    from approxbp.approximations import tables as table_files
    from approxbp.kernels.ops.modules import register
    from approxbp.kernels.ops.relu_sum import ReLUSumSpec
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = ReLUSumSpec(table_files.resolve(name, "relu-sum"))
    key = register(spec)
    real = torch.ops.approxbp.relu_sum_forward(torch.randn(n), key, False)
    with FakeTensorMode():
        fake = torch.ops.approxbp.relu_sum_forward(torch.empty(n), key, False)
    assert [t.shape for t in fake] == [t.shape for t in real]
