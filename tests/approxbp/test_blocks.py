"""The reference blocks and the one toy transformer (approxbp/blocks.py) that experiments and benchmarks share."""

import ast

import torch
from _helpers import ROOT

from approxbp.blocks import GPTBlock, ToyGPT


def test_a_blocks_branch_is_its_residual_increment():
    torch.manual_seed(0)
    block = GPTBlock(d=32, hidden=64, heads=4, causal=True)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    block = block.double()
    f = block.attn(block.ln1(x))
    assert torch.allclose(block(x), x + f + block.fc2(block.act(block.fc1(block.ln2(x + f)))), atol=1e-12)
    assert torch.allclose(block.branch(x), block(x) - x, atol=1e-12)


def test_causal_attention_ignores_the_future():
    torch.manual_seed(0)
    model = ToyGPT(vocab=11, d=32, blocks=2, heads=4, context=8)
    idx = torch.randint(0, 11, (1, 8))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 11
    assert torch.equal(model(idx)[0, :-1], model(changed)[0, :-1])


def test_the_bdia_toy_gpt_trains_through_the_online_backward():
    torch.manual_seed(0)
    model = ToyGPT(vocab=11, d=32, blocks=3, heads=4, context=8, bdia_level=9)
    idx = torch.randint(0, 11, (2, 8))
    torch.nn.functional.cross_entropy(model(idx, seed=0).flatten(0, 1), idx.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_one_toy_transformer_in_experiments_and_benchmarks():
    """The toy language model is defined once (ToyGPT); no other module defines a model with a token
    embedding."""
    defined = []
    for folder in ("approxbp", "benchmarks"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and "nn.Embedding(" in ast.unparse(node):
                    defined.append(f"{folder}/{path.name}:{node.name}")
    assert defined == ["approxbp/blocks.py:ToyGPT"]


def test_experiments_seed_their_own_rng_and_leave_the_callers():
    """A library function that seeds for a reproducible initialisation does not reset the caller's
    random stream (approxbp.blocks.own_rng)."""
    from approxbp.blocks import saved_per_token_per_d

    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    first = saved_per_token_per_d(GPTBlock, "baseline", False, tokens=4, batch=1, d=32, hidden=64, heads=4)
    assert torch.equal(torch.rand(3), want)
    assert saved_per_token_per_d(GPTBlock, "baseline", False, tokens=4, batch=1, d=32, hidden=64, heads=4) == first
