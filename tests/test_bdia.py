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
