"""The build side (kernels/codegen/): every committed module is what its table generates, and the PyTorch twin
printed into it computes, bit for bit, what the lambdified twin (Activation.torch_fn, invact_forms.TableBackward)
computes: the run time lost sympy, not a single bit."""

import pytest
import torch
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.invact_forms import TableBackward
from approxbp.kernels.codegen import render
from approxbp.kernels.ops.modules import GENERATED, generated_module, module_name

PATHS = table_files.table_paths()
X = torch.cat([torch.linspace(-30, 30, 6001, dtype=torch.float64),
               torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, float("inf"), -float("inf"), float("nan")],
                            dtype=torch.float64)])


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_module_is_what_the_table_generates(path):
    committed = GENERATED / f"{module_name(path)}.py"
    assert committed.exists(), "run `approxbp export`"
    assert committed.read_text() == render(path)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generated_twin_equals_the_lambdified_twin(path, dtype):
    t = table_files.load(path)
    m = generated_module(path, t.family)
    x = X.to(dtype)
    assert _same(m.activation_twin(x), get_activation(t.expression).torch_fn(0)(x))
    if t.family == "invact":
        y = torch.cat([torch.linspace(t.f_T - 0.01, t.f_T + 12, 4001, dtype=dtype), x])
        rule = TableBackward(t)
        for left in (True, False):
            b = torch.full_like(y, float(left))
            assert _same(m.backward_rule_twin(y, b), rule(y, b.bool()))
