"""Run in a fresh process by tests/kernels/test_runtime.py: import approxbp.kernels, build every public drop-in (and
patch a small model), run a forward and a backward on the twin and on the Triton path (``TRITON_INTERPRET=1``), and
print what was imported and written as JSON. An audit hook records every file opened for writing, created, renamed
or removed."""

import json
import os
import sys

WRITES = []


def audit(event, args):
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        if any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            WRITES.append(f"open {args[0]} {mode}")
    elif event in ("os.rename", "os.replace", "os.remove", "os.unlink", "os.mkdir", "os.rmdir", "shutil.copyfile",
                   "shutil.rmtree", "os.truncate"):
        WRITES.append(f"{event} {args[0]}")


# Imported before the hook: torch's data module imports dill when it is installed (trl's datasets brings it), and
# dill probes file types at import time (opens /dev/null and a temporary file): a third party's import, not ours.
import torch.utils.data  # noqa: E402, F401

sys.addaudithook(audit)

import approxbp.kernels as K  # noqa: E402
import torch  # noqa: E402

imported_before = sorted(m for m in sys.modules if m.startswith("approxbp"))


def drop_ins(use_triton):
    yield K.ReGELU2(use_triton=use_triton)
    yield K.ReSiLU2(paper=True, use_triton=use_triton)
    yield K.ReLUSumActivation("gelu-k3-derivative", use_triton=use_triton)
    yield K.ReLUSumActivation("silu-k5-primitive", use_triton=use_triton)  # above the unrolled k: table lookups
    yield K.InvActGELU(use_triton=use_triton)
    yield K.InvActSiLU(form="newton", use_triton=use_triton)
    yield K.InvActivation("mish-fast", use_triton=use_triton)
    yield K.MSLayerNorm(16, use_triton=use_triton)
    yield K.MSRMSNorm(16, use_triton=use_triton)


ran = []
for use_triton in (False, True):
    for module in drop_ins(use_triton):
        x = torch.randn(4, 16, requires_grad=True)
        module(x).square().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        ran.append(f"{type(module).__name__} use_triton={use_triton}")

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                            torch.nn.Linear(16, 4))
K.patch_model(model, family="invact", norms=True, example_input=torch.randn(2, 16))
x = torch.randn(3, 16, requires_grad=True)
model(x).sum().backward()
ran.append("patch_model")

report = {"writes": list(WRITES)}
with open(os.devnull, "w"):  # the control: the hook sees a write
    pass
report["hook_sees_writes"] = len(WRITES) > len(report["writes"])
print(json.dumps({**report, "sympy": sorted(m for m in sys.modules if m == "sympy" or m.startswith("sympy.")),
                  "codegen": sorted(m for m in sys.modules if m.endswith(".codegen")),
                  "approxbp_at_import": imported_before, "ran": ran}))
