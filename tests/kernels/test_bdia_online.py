"""Online back-propagation through a BDIA stack (Prop. 4.4) and the eq. 21/24 Triton kernels."""

import pytest
import torch
from approxbp.approximations import bdia as B
from approxbp.kernels.ops import bdia as K
from approxbp.kernels.ops.saved import saved_bytes
from hypothesis import given
from hypothesis import strategies as st


class Block(torch.nn.Module):
    """A pre-norm MLP residual branch with dropout that reads x twice (LayerNorm and an inner residual)."""

    def __init__(self, d, p=0.1):
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        a = self.drop(self.down(torch.nn.functional.gelu(self.up(self.ln(x)))))
        return 0.2 * (a + torch.tanh(x + a))


def _run(stack, x, seed):
    for p in stack.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1234)  # dropout draws
    y = stack(x, seed=seed)
    (y.sin() * torch.arange(y.numel(), dtype=y.dtype).view(y.shape).cos()).sum().backward()
    return y.detach(), x.grad, [p.grad for p in stack.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("blocks,level", [(2, 9), (6, 9), (12, 5), (5, 0)])
def test_online_gradients_are_bitwise_equal_to_autograd(dtype, use_triton, blocks, level):
    torch.manual_seed(0)
    mods = [Block(12).to(dtype) for _ in range(blocks)]
    x = torch.randn(3, 4, 12, dtype=dtype)
    ref = _run(K.BDIAStack(mods, level=level, online=False), x, seed=11)
    got = _run(K.BDIAStack(mods, level=level, online=True, use_triton=use_triton), x, seed=11)
    assert torch.equal(ref[0], got[0])
    assert torch.equal(ref[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(ref[2], got[2], strict=True))
    assert float(ref[1].abs().sum()) > 0


def test_dropout_is_replayed_not_redrawn():
    """Without the saved RNG state the replayed dropout mask differs and the recomputation check fires."""
    torch.manual_seed(0)
    mods = [Block(8, p=0.5) for _ in range(3)]
    x = torch.randn(2, 8, requires_grad=True)
    y = K.BDIAStack(mods, online=True, preserve_rng=False)(x, seed=1)
    with pytest.raises(RuntimeError, match="not deterministic"):
        y.sum().backward()


def test_online_saves_two_states_and_side_bits():
    torch.manual_seed(0)
    d, Kb, n = 64, 8, 16 * 64
    mods = [Block(d, p=0.0) for _ in range(Kb)]
    x = torch.randn(16, d)
    plain = saved_bytes(lambda: K.BDIAStack(mods, online=False)(x, seed=0), exclude=list(mods[0].parameters()))
    online = saved_bytes(lambda: K.BDIAStack(mods, online=True, preserve_rng=False)(x, seed=0))
    assert online == 2 * 4 * n + (Kb - 1) * n // 8  # (x_{K−1}, x_K) in fp32 + 1 bit per element per block
    assert plain > 10 * online


def test_eval_is_eq25_and_training_needs_exact_gammas():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4) for _ in range(3)]
    st_ = K.BDIAStack(mods, level=9).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        y = st_(x)
        ref = B.quantize(x, 9)
        ref = ref + B.quantize(mods[0](ref), 9)
        for m in mods[1:]:
            ref = B.quantize(ref + m(ref), 9)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="at least 2"):
        K.BDIAStack(mods[:1])


def test_out_of_range_activations_raise_with_the_block():
    mods = [torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()]
    x = torch.full((2, 3), 2.0**20)
    with pytest.raises(ValueError, match="BDIA block 1"):
        K.BDIAStack(mods, level=9)(x.requires_grad_(), seed=0)


@given(seed=st.integers(0, 10_000), numel=st.sampled_from([1, 7, 8, 9, 2049, 4099]),
       level=st.sampled_from([-2, 0, 5, 9, 12]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_kernels_equal_twins_and_invert_bit_for_bit(seed, numel, level, dtype):
    g = torch.Generator().manual_seed(seed)
    batch = 1 if numel in (1, 7, 2049, 4099) else numel
    shape = (batch, numel // batch)
    scale = min(B.bound(dtype, level) / 8, 8.0)
    xp, x = (B.quantize(scale * torch.randn(shape, generator=g, dtype=dtype), level) for _ in range(2))
    h = torch.randn(shape, generator=g, dtype=dtype)
    gam = B.draw_gammas(seed, 2, batch)[0]
    o_t, b_t = K.step_torch(xp, x, h, gam, level)
    o_k, b_k = K.step_triton(xp, x, h, gam, level)
    assert torch.equal(o_t, o_k) and torch.equal(b_t, b_k) and b_k.numel() == -(-numel // 8)
    assert torch.equal(K.inverse_triton(x, o_k, h, b_k, gam, level), xp)
    assert torch.equal(K.inverse_torch(x, o_t, h, b_t, gam, level), xp)


def test_kernels_handle_empty_and_noncontiguous():
    e = torch.empty(0, 4)
    out, bits = K.step_triton(e, e, e, torch.full((0,), 0.5), 9)
    assert out.shape == (0, 4) and bits.numel() == 0
    x = B.quantize(torch.randn(6, 10), 9).t()  # non-contiguous, batch 10
    gam = B.draw_gammas(0, 2, 10)[0]
    o, b = K.step_triton(x, x, x, gam, 9)
    assert torch.equal(o, K.step_torch(x.contiguous(), x.contiguous(), x.contiguous(), gam, 9)[0].view(10, 6))


def test_unquantised_ablation_with_table3_gammas():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="online=False"):
        K.BDIAStack(mods, level=None)
    with pytest.raises(ValueError, match="online=False"):
        K.BDIAStack(mods, level=9, gammas=(0.25, -0.25))
    st_ = K.BDIAStack(mods, level=None, online=False, gammas=(0.25, -0.25))
    y = st_(x, seed=3)
    gam = B.draw_gammas(3, 3, 5, (0.25, -0.25)).view(2, 5, 1).float()
    x1 = x + mods[0](x)
    x2 = gam[0] * x + (1 - gam[0]) * x1 + (1 + gam[0]) * mods[1](x1)  # eq. 10
    x3 = gam[1] * x1 + (1 - gam[1]) * x2 + (1 + gam[1]) * mods[2](x2)
    assert torch.allclose(y, x3, atol=1e-6)
    y.sum().backward()
    assert all(p.grad is not None for p in st_.parameters())
    st_.eval()
    with torch.no_grad():
        z = x
        for m in mods:
            z = z + m(z)  # eq. 11
        assert torch.allclose(st_(x), z)


@pytest.mark.parametrize("use_triton", [False, True])
def test_frozen_block_parameters_get_no_gradient_and_the_rest_are_exact(use_triton):
    """A frozen parameter (requires_grad=False) crashed the online backward; now it is skipped."""
    torch.manual_seed(0)
    mods = [Block(12) for _ in range(4)]
    for m in mods[1:3]:
        m.up.weight.requires_grad_(False)
        m.ln.requires_grad_(False)
    x = torch.randn(3, 4, 12)
    ref = _run(K.BDIAStack(mods, level=9, online=False), x, seed=5)
    got = _run(K.BDIAStack(mods, level=9, online=True, use_triton=use_triton), x, seed=5)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for p, a, b in zip(K.BDIAStack(mods).parameters(), ref[2], got[2], strict=True):
        assert (a is None) == (b is None) == (not p.requires_grad)
        if a is not None:
            assert torch.equal(a, b)
