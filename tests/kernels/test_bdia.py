"""BDIA (§4.3): exact bit-level reversibility with quantisation, error growth without it, bounds at the edges."""

import pytest
import torch
from approxbp.approximations import bdia
from hypothesis import given
from hypothesis import strategies as st


def _blocks(K, d, seed):
    g = torch.Generator().manual_seed(seed)
    Ws = [torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5 for _ in range(K)]
    return [lambda x, W=W: torch.tanh(x @ W) for W in Ws]


@given(seed=st.integers(0, 10_000), level=st.sampled_from([-2, 0, 5, 9, 12]),
       dtype=st.sampled_from([torch.float32, torch.float64]), n=st.sampled_from([1, 7, 33]))
def test_quantised_forward_then_inverse_is_exact(seed, level, dtype, n):
    K = 12
    hs = _blocks(K, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    gammas = [bdia.GAMMAS[int(b)] for b in torch.randint(0, 2, (K,), generator=g)]
    x0 = bdia.quantize(torch.randn(3, n, generator=g, dtype=torch.float64), level).to(dtype)
    xs = [x0, x0 + bdia.quantize(hs[0](x0.double()).to(dtype), level)]  # eqs. 18–19
    sides = []
    for k in range(1, K):
        hx = hs[k](xs[k].double()).to(dtype)
        x_next, s = bdia.step(xs[k - 1], xs[k], hx, gammas[k], level, block=k)
        xs.append(x_next)
        sides.append(s)
    # online reconstruction from (x_{K−1}, x_K), eq. 24
    a, b = xs[-2], xs[-1]
    for k in range(K - 1, 0, -1):
        hx = hs[k](a.double()).to(dtype)
        prev = bdia.inverse(a, b, hx, sides[k - 1], gammas[k], level, block=k)
        assert torch.equal(prev, xs[k - 1]), f"block {k} not bit-exact"
        a, b = prev, a


def test_without_quantisation_the_error_doubles_per_block():
    K, n = 40, 16
    hs = _blocks(K, n, 0)
    x = [torch.randn(4, n, dtype=torch.float64)]
    x.append(x[0] + hs[0](x[0]))
    for k in range(1, K):
        x.append(bdia.plain_step(x[k - 1], x[k], hs[k](x[k]), 0.5))
    a, b, errs = x[-2], x[-1], []
    for k in range(K - 1, 0, -1):
        prev = bdia.plain_inverse(a, b, hs[k](a), 0.5)
        errs.append(float((prev - x[k - 1]).abs().max()))
        a, b = prev, a
    assert errs[-1] > 1e6 * max(errs[0], 1e-16)  # ×2 per block: exponential growth (Fig. 2)


@pytest.mark.parametrize("dtype,level", [(torch.float32, 9), (torch.float64, 9), (torch.bfloat16, 0)])
def test_bound_is_enforced_at_its_edge(dtype, level):
    b = bdia.bound(dtype, level)
    inside = torch.tensor([b - 2.0**-level], dtype=dtype)
    bdia.check_representable(inside, level, block=3)
    with pytest.raises(ValueError, match="BDIA block 3"):
        bdia.check_representable(torch.tensor([b], dtype=dtype), level, block=3)


def test_bound_values():
    assert bdia.bound(torch.float32, 9) == 2.0**13
    assert bdia.bound(torch.float64, 9) == 2.0**42
    with pytest.raises(TypeError):
        bdia.bound(torch.int32, 0)


def test_gamma_must_be_a_power_of_two_half():
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="γ ∈"):
        bdia.step(z, z, z, 0.3, 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("level", [0, 9])
def test_exact_just_inside_the_bound(dtype, level):
    """Worst-case values just inside |v| < 2^{m−l−2} still reconstruct bit for bit, for both γ."""
    b = bdia.bound(dtype, level)
    edge = torch.tensor([b - 2.0**-level, -(b - 2.0**-level), b / 2 + 2.0**-level, 2.0**-level], dtype=dtype)
    for gamma in bdia.GAMMAS:
        x_prev, x = edge, edge.flip(0)
        hx = torch.zeros_like(x)
        # keep x_{k+1} inside: the worst case needs (1−γ)x + γ x_prev within the bound
        x = x * 0.25
        x_next, s = bdia.step(x_prev, bdia.quantize(x, level), hx, gamma, level)
        assert torch.equal(bdia.inverse(bdia.quantize(x, level), x_next, hx, s, gamma, level), x_prev)


def test_outside_the_bound_exactness_really_fails_without_the_check():
    """The bound is not vacuous: far outside it the unchecked fp32 update loses the low bits."""
    level, v = 9, torch.tensor([2.0**24 + 1.0], dtype=torch.float64)  # 2^33 grid steps: not exact in fp32
    assert v.float().double() != v
    with pytest.raises(ValueError, match="exactness bound"):
        bdia.step(v.float(), v.float(), torch.zeros(1), 0.5, level)


@given(seed=st.integers(0, 10_000), level=st.sampled_from([-2, 0, 9, 12]), scale=st.sampled_from([1.0, 1e6, 1e12]))
def test_fixed_point_storage_is_exact_at_any_magnitude(seed, level, scale):
    """int64 grid indices make eqs. 21/24 exact even where float64 storage would raise."""
    g = torch.Generator().manual_seed(seed)
    n, K = 9, 12
    hs = _blocks(K, n, seed)
    X = [bdia.to_fixed(scale * torch.randn(2, n, generator=g, dtype=torch.float64), level)]
    X.append(X[0] + bdia.to_fixed(hs[0](bdia.from_fixed(X[0], level)), level))
    gam = bdia.draw_gammas(seed, K, 2)
    sides = []
    for k in range(1, K):
        hx = hs[k](bdia.from_fixed(X[k], level))
        nxt, s = bdia.step_fixed(X[k - 1], X[k], hx, bdia.per_sample(gam[k - 1], hx), level)
        X.append(nxt)
        sides.append(s)
    a, b = X[-2], X[-1]
    for k in range(K - 1, 0, -1):
        prev = bdia.inverse_fixed(a, b, hs[k](bdia.from_fixed(a, level)), sides[k - 1],
                                  bdia.per_sample(gam[k - 1], a.double()), level)
        assert torch.equal(prev, X[k - 1])
        a, b = prev, a


def test_fixed_point_agrees_with_float_storage_inside_the_bound():
    level, g = 9, torch.Generator().manual_seed(3)
    x_prev, x = (bdia.quantize(torch.randn(5, 7, generator=g, dtype=torch.float64), level) for _ in range(2))
    hx = torch.randn(5, 7, generator=g, dtype=torch.float64)
    for gamma in bdia.GAMMAS:
        xf, sf = bdia.step(x_prev, x, hx, gamma, level)
        Xi, si = bdia.step_fixed(bdia.to_fixed(x_prev, level), bdia.to_fixed(x, level), hx, gamma, level)
        assert torch.equal(bdia.from_fixed(Xi, level), xf) and torch.equal(si, sf)


def test_gammas_are_seeded_and_balanced():
    a, b = bdia.draw_gammas(5, 13, 1000), bdia.draw_gammas(5, 13, 1000)
    assert torch.equal(a, b) and a.shape == (12, 1000)
    assert set(a.unique().tolist()) == {-0.5, 0.5} and abs(float(a.mean())) < 0.02
    assert not torch.equal(a, bdia.draw_gammas(6, 13, 1000))


# ---- moved from test_trust.py ----
def _small_blocks(n=3, d=8, bn=False, dtype=torch.float32):
    torch.manual_seed(1)
    layers = [torch.nn.Sequential(torch.nn.Linear(d, d), *( [torch.nn.BatchNorm1d(d)] if bn else []),
                                  torch.nn.Tanh()) for _ in range(n)]
    return [m.to(dtype) for m in layers]


def test_bdia_gamma_set_is_honoured_or_refused():
    from approxbp.approximations import bdia as B
    from approxbp.kernels.ops.bdia import BDIAStack, bdia_reference

    mods = _small_blocks()
    with pytest.raises(ValueError, match="Table 3"):
        BDIAStack(mods, level=9, online=False, gammas=(0.25, -0.25))
    x = torch.randn(4, 8)
    only_half = BDIAStack(mods, level=9, gammas=(0.5,))(x, seed=3)
    ref = bdia_reference(mods, x, B.draw_gammas(3, 3, 4, (0.5,)), 9)
    assert torch.equal(only_half, ref)
    assert not torch.equal(only_half, BDIAStack(mods, level=9)(x, seed=3))  # the default set draws −0.5 too


@pytest.mark.parametrize("online", [True, False])
def test_bdia_keeps_dtype_and_updates_batchnorm_once(online):
    from approxbp.kernels.ops.bdia import BDIAStack

    mods = _small_blocks(bn=True, dtype=torch.bfloat16)
    x = (torch.randn(6, 8) * 0.5).to(torch.bfloat16)
    y = BDIAStack(mods, level=3, online=online)(x, seed=0)
    assert y.dtype == torch.bfloat16
    stats = [m[1].running_mean.clone() for m in mods]
    y.float().sum().backward()
    assert all(m[1].num_batches_tracked.item() == 1 for m in mods)
    assert all(torch.equal(s, m[1].running_mean) for s, m in zip(stats, mods))


@pytest.mark.parametrize("level", [2.5, True, "9"])
def test_bdia_level_must_be_an_integer(level):
    from approxbp.kernels.ops.bdia import BDIAStack

    with pytest.raises(TypeError, match="integer"):
        BDIAStack(_small_blocks(), level=level)
