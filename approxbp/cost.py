"""Static GPU cost of the generated kernels, measured without a GPU (``approxbp cost``).

Each kernel is launched by its own launcher on ``meta`` tensors; the launch is captured instead of run, and
compiled offline for sm_90 with the Triton wheel's bundled ``ptxas`` (the same specialisation the JIT makes for
16-byte aligned tensors and sizes divisible by 16). ``cuobjdump -sass`` gives the instructions.

The model (one line): an element-wise kernel is memory-bound while its SASS instructions per element stay
below the machine's issue rate over its bandwidth. H100 SXM: 132 SMs × 128 thread-instructions per clock ×
~1.75 GHz ≈ 3.0e13/s over 2.87e12 B/s of measured copy bandwidth, i.e. **≈ 10.45 instructions per byte moved**.
``ratio`` = (instructions/element) / (10.45 × bytes/element); under ~1 the kernel should run at copy speed.
The kernels are loop-free, so the static count is the dynamic count of every thread (checked: a backward
branch other than the closing ``BRA`` self-loop is reported). What the model leaves out: latency and
occupancy (registers per thread), the SFU's lower throughput (16 MUFU per SM per clock, reported apart), and
the tail of small grids.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from approxbp.approximations.families import Registry, member, register

__all__ = ["as_json", "bdia_launches", "BUDGET", "capture", "compile_sm90", "disassemble", "DTYPES", "ELEMENTS",
           "forward_backward_launches", "HEADER", "invact_launches", "ISSUE_RATE", "KernelCost", "Launch", "LAUNCHES",
           "measure", "norm_launches", "relu_sum_launches", "run"]


#: Thread-instructions per second (132 SMs × 128 lanes × ~1.75 GHz ≈ 3.0e13) and measured copy bandwidth of an
#: H100 SXM (see the module docstring).
ISSUE_RATE, _BANDWIDTH = 3.0e13, 2.87e12
BUDGET = ISSUE_RATE / _BANDWIDTH  # ≈ 10.45 SASS instructions per byte moved
#: Elements per measured launch (divisible by every program span, so no partial programs).
ELEMENTS = 1 << 24
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_NOT_UNDER_INTERPRETER = ("approxbp cost compiles for the GPU: unset TRITON_INTERPRET (the interpreter replaces the "
                         "kernels)")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Launch:
    """One captured launch: the kernel, its arguments as the launcher passed them, and the grid."""

    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


@dataclass
class KernelCost:
    """The measured cost of one kernel launch (per element of the activation tensor)."""

    name: str
    dtype: str
    instructions_per_element: float
    mufu_per_element: float
    bytes_per_element: float
    ratio: float
    registers: int
    spill_instructions: int
    widths: dict = field(default_factory=dict)  # tensor → widest global access in bits ("ld"/"st")
    loops: bool = False

    def row(self) -> str:
        io = " ".join(f"{k}:{v}" for k, v in self.widths.items())
        flag = "  (loop: static count)" if self.loops else ""
        return (f"{self.name:<40} {self.dtype:<5} {self.instructions_per_element:7.1f} {self.mufu_per_element:5.2f} "
                f"{self.bytes_per_element:5.2f} {self.ratio:6.2f} {self.registers:4d} {self.spill_instructions:3d}  "
                f"{io}{flag}")


HEADER = (f"{'kernel':<40} {'dtype':<5} {'instr/e':>7} {'mufu':>5} {'B/e':>5} {'ratio':>6} {'regs':>4} "
          f"{'spl':>3}  widest access per tensor (bits)")


@contextlib.contextmanager
def capture():
    """Within: ``kernel[grid](...)`` records a :class:`Launch` into the yielded list instead of running, and the
    launchers are called with ``meta`` tensors, which their device guard lets pass."""
    from triton.runtime.jit import KernelInterface

    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def record(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(self, tuple(grid), args, kwargs))

    KernelInterface.__getitem__ = record
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def _specialise(launch: Launch):
    """(signature, constexprs, attrs, options) as the JIT would specialise this call for aligned tensors."""
    fn = launch.fn
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in launch.kwargs}
    options.setdefault("num_warps", 4)
    options.setdefault("enable_fp_fusion", True)  # the JIT's default (Triton 3.9 warns when it is left unset)
    values = dict(zip(fn.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = values[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the JIT specialises 1 to a constant
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot specialise argument {name}={v!r}")
    return signature, constexprs, attrs, options


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    return str(Path(nv.__file__).parent / "bin" / name)


def compile_sm90(launch: Launch, arch: int = 90):
    """The compiled kernel (``.asm`` has ``ptx`` and ``cubin``) of a captured launch, for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(launch.fn, "arg_names") or type(launch.fn).__name__ == "InterpretedFunction":
        raise RuntimeError(_NOT_UNDER_INTERPRETER)
    signature, constexprs, attrs, options = _specialise(launch)
    src = ASTSource(launch.fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options), signature


_SASS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str, str]], int]:
    """(address, opcode, operands) of every SASS instruction in ``cubin``, and its registers per thread: one
    ``cuobjdump -res-usage -sass`` of one temporary file."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    return [(int(m[1], 16), m[3], m[4]) for m in map(_SASS.match, text.splitlines()) if m], int(regs[1]) if regs else -1


_PTX_PARAM = re.compile(r"ld\.param\.[bu]64\s+(%rd\d+),\s*\[\w+_param_(\d+)\]")
_PTX_DEF = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.]*\s+(%r[a-z]*\d+),\s*(.*);")
_PTX_MEM = re.compile(r"(ld|st)\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s+(.*?);")


def _access_widths(ptx: str, signature: dict) -> dict[str, str]:
    """For each tensor argument, its widest global load and store in bits, from the PTX: an address register is
    traced back (through its defining instructions) to the ``ld.param`` of the pointer it derives from."""
    pointers = [name for name, t in signature.items() if t != "constexpr"]  # params are numbered without constexprs
    source: dict[str, set[str]] = {}
    for line in ptx.splitlines():
        if m := _PTX_PARAM.search(line):
            name = pointers[int(m[2])]
            source[m[1]] = {name} if signature[name].startswith("*") else set()
        elif m := _PTX_DEF.match(line):
            src = set().union(*(source.get(r, set()) for r in re.findall(r"%r[a-z]*\d+", m[2])))
            if src:
                source[m[1]] = source.get(m[1], set()) | src
    widest: dict[str, dict[str, int]] = {}
    for m in _PTX_MEM.finditer(ptx):
        kind, vec, bits, operands = m[1], int(m[2] or 1), int(m[3]), m[4]
        addr = re.search(r"\[\s*(%rd\d+)", operands)
        for name in source.get(addr[1], {"?"}) if addr else {"?"}:
            w = widest.setdefault(name, {})
            w[kind] = max(w.get(kind, 0), vec * bits)
    return {name: "/".join(f"{k}{v}" for k, v in sorted(w.items())) for name, w in widest.items()}


def measure(name: str, launch: Launch, elements: int, dtype: str, arch: int = 90) -> KernelCost:
    """Compile one captured launch and count what each element costs."""
    kernel, signature = compile_sm90(launch, arch)
    code, regs = disassemble(kernel.asm["cubin"])
    branches = [(a, re.search(r"0x([0-9a-f]+)", rest)) for a, op, rest in code if op.startswith("BRA")]
    loops = any(m and int(m[1], 16) < a for a, m in branches)  # a backward branch (the closing BRA targets itself)
    body = [op for _, op, _ in code if op != "NOP"]
    if body and body[-1].startswith("BRA"):
        body = body[:-1]  # the closing self-loop after EXIT
    per_thread = 32 * kernel.metadata.num_warps / (elements / launch.grid[0])  # threads per element
    count = len(body) * per_thread
    moved = sum(v.numel() * v.element_size() for v in (*launch.args, *launch.kwargs.values())
                if isinstance(v, torch.Tensor)) / elements
    return KernelCost(name, dtype, round(count, 2), round(sum(op.startswith("MUFU") for op in body) * per_thread, 3),
                      round(moved, 3), round(count / (BUDGET * moved), 3), regs,
                      sum(op.startswith(("LDL", "STL")) for op in body), _access_widths(kernel.asm["ptx"], signature),
                      loops)


# -- the launches of each family -------------------------------------------------------------------------------
def forward_backward_launches(name: str, dtype: torch.dtype, run, label: str = "") -> list[tuple[str, Launch, int]]:
    """``[(name fwd label, launch, elements), (name bwd label, …)]``: the two launches that ``run(x)`` (a family's
    forward then its backward on the forward's saved tensors) makes on a meta tensor of :data:`ELEMENTS` elements."""
    x = torch.empty(ELEMENTS, dtype=dtype, device="meta")
    with capture() as launches:
        run(x)
    return [(f"{name} fwd{label}", launches[0], ELEMENTS), (f"{name} bwd{label}", launches[1], ELEMENTS)]


def relu_sum_launches(table, dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    from approxbp.kernels.ops.relu_sum import ReLUSumSpec

    spec = ReLUSumSpec(table)
    return forward_backward_launches(spec.name(), dtype,
                                     lambda x: spec.backward_triton(x, *spec.forward_triton(x)[1:], ELEMENTS))


def invact_launches(table, dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    from approxbp.kernels.ops.invact import InvActSpec

    spec = InvActSpec(table)
    return forward_backward_launches(f"invact {spec.name()}", dtype,
                                     lambda x: spec.backward_triton(x, *spec.forward_triton(x)))


#: table family → its kernels' launches ``(table, dtype) → [(name, launch, elements)]``: this layer's part of a family
#: (:mod:`approxbp.approximations.families`)
LAUNCHES: Registry = Registry("approxbp.cost")
register(LAUNCHES, "relu-sum", relu_sum_launches)
register(LAUNCHES, "invact", invact_launches)


def norm_launches(dtype: torch.dtype, d: int = 4096) -> list[tuple[str, Launch, int]]:
    from approxbp.kernels.ops.norms import ms_norm_backward_impl, ms_norm_forward_impl

    x = torch.empty(ELEMENTS // d, d, dtype=dtype, device="meta")
    out = []
    for center, label in ((True, "MS-LayerNorm"), (False, "MS-RMSNorm")):
        with capture() as launches:
            z, rstd = ms_norm_forward_impl(x, 1e-5, center, True, None)
            ms_norm_backward_impl(x, z, rstd, center, True, dtype)
        out += [(f"{label} d={d} fwd", launches[0], ELEMENTS), (f"{label} d={d} bwd", launches[1], ELEMENTS)]
    return out


def bdia_launches(dtype: torch.dtype, row: int = 4096) -> list[tuple[str, Launch, int]]:
    from approxbp.kernels.ops.bdia import launch_inverse, launch_step

    x = torch.empty(ELEMENTS, dtype=dtype, device="meta")
    g = torch.empty(ELEMENTS // row, dtype=dtype, device="meta")
    with capture() as launches:
        out, bits = launch_step(x, x, x, g, row, 9)
        launch_inverse(x, x, x, bits, g, row, 9)
    return [("BDIA step (eq. 21)", launches[0], ELEMENTS), ("BDIA inverse (eq. 24)", launches[1], ELEMENTS)]


def _glu_launches(dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    """The exact fused GLU of every activation that has one (kernels/ops/glu.py): forward and backward."""
    from approxbp.kernels.ops.glu import GLU_ACTIVATIONS, GLUSpec

    out = []
    for act in GLU_ACTIVATIONS:
        spec = GLUSpec(act)
        out += forward_backward_launches(spec.name(), dtype,
                                         lambda x, s=spec: (s.forward_triton(x, x), s.backward_triton(x, x, x)))
    return out


def _reference_launches(dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    """The packaged plain exact kernels of GELU and SiLU (``kernels/generated/reference_*.py``, what torch's own
    element-wise kernels cost)."""
    import importlib

    from approxbp.kernels.codegen import REFERENCE_ACTIVATIONS

    return [launch for act in REFERENCE_ACTIVATIONS for launch in _plain_launches(
        importlib.import_module(f"approxbp.kernels.generated.reference_{act}"), f"torch-like {act}", dtype)]


def _plain_launches(module, name: str, dtype: torch.dtype, label: str = "") -> list[tuple[str, Launch, int]]:
    """The forward and backward launches of a reference module (:func:`~approxbp.kernels.codegen.render_reference`),
    ``BLOCK`` elements per program and 4 warps, as the ReLU-sum kernels."""
    import triton

    grid = (triton.cdiv(ELEMENTS, module.BLOCK),)

    def run(x):
        module.forward_kernel[grid](x, x, ELEMENTS, BLOCK=module.BLOCK, num_warps=4)
        module.backward_kernel[grid](x, x, x, ELEMENTS, BLOCK=module.BLOCK, num_warps=4)

    return forward_backward_launches(name, dtype, run, label)


def _exact_launches(name: str, expression: str, dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    """The plain exact kernels of an activation without a packaged reference pair (a user's), rendered from its
    expression (:func:`approxbp.kernels.codegen.render_reference`) into a temporary module."""
    import importlib.util

    from approxbp.approximations.activations import Activation
    from approxbp.kernels.codegen import render_reference

    with tempfile.TemporaryDirectory(prefix="approxbp-reference-") as folder:  # Triton keeps the kernels' source
        path = Path(folder) / "reference_kernel.py"
        path.write_text(render_reference(Activation.from_expression(name, expression)), encoding="utf-8")
        spec = importlib.util.spec_from_file_location("approxbp_reference_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return _plain_launches(module, f"exact {name}", dtype, " (plain)")


def _reference_jobs(tables: list[Path]) -> list[tuple[str, str]]:
    """(name, expression) of each activation of ``tables`` without a reference kernel pair: its baseline."""
    from approxbp.approximations import tables as table_files
    from approxbp.kernels.codegen import REFERENCE_ACTIVATIONS

    found: dict[str, str] = {}
    for p in tables:
        t = table_files.load(p)
        if t.family in LAUNCHES and t.activation not in REFERENCE_ACTIVATIONS:
            found.setdefault(t.expression, t.activation)
    return [(name, expression) for expression, name in found.items()]


def _default_tables() -> list[Path]:
    """Every packaged table of the families with kernels (:data:`LAUNCHES`)."""
    from approxbp.approximations import tables as table_files

    return [p for family in LAUNCHES for p in table_files.table_paths(family)]


def _launches_for(table: Path | None, dtype: torch.dtype) -> list[tuple[str, Launch, int]]:
    """(name, launch, elements) of a table's kernels, or (``table=None``) of the MS-norms, BDIA, the exact GLUs and
    the torch-like references."""
    from approxbp.approximations import tables as table_files
    from approxbp.kernels.codegen import export_if_stale

    if table is None:
        return norm_launches(dtype) + bdia_launches(dtype) + _glu_launches(dtype) + _reference_launches(dtype)
    t = table_files.load(table)
    export_if_stale(table)  # a user's table: its module is written next to it first, as `approxbp export` would
    return member(LAUNCHES, t.family, "kernel launches")(table, dtype)


def _measure_group(job) -> list[KernelCost]:
    table, dtype, arch = job
    launches = (_exact_launches(*table, DTYPES[dtype]) if isinstance(table, tuple)
                else _launches_for(table, DTYPES[dtype]))
    return [measure(name, launch, elements, dtype, arch) for name, launch, elements in launches]


def run(tables: list[Path] | None = None, dtype: str = "bf16", arch: int = 90, extras: bool = True,
        workers: int | None = None, progress=None) -> list[KernelCost]:
    """Measure the kernels of ``tables`` (default: every packaged table) and, with ``extras``, the MS-norms, BDIA, GLUs
    and the torch-like references, in ``workers`` processes (default: all cores); ``progress(i, n, what)``. Given
    tables of an activation without a reference pair (a user's) also get its plain exact kernels as their
    baseline."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from approxbp.approximations import tables as table_files

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(_NOT_UNDER_INTERPRETER)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    jobs = [(table_files.resolve(p), dtype, arch) for p in (tables if tables is not None else _default_tables())]
    jobs += [(None, dtype, arch)] if extras else []
    jobs += [(pair, dtype, arch) for pair in _reference_jobs([j[0] for j in jobs if j[0] is not None])] \
        if tables is not None else []
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    results: list[KernelCost] = []
    with contextlib.ExitStack() as stack:
        groups = (map(_measure_group, jobs) if workers <= 1 else stack.enter_context(
            ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))).map(_measure_group, jobs))
        for i, (job, group) in enumerate(zip(jobs, groups)):
            results += group
            if progress:
                what = (f"exact {job[0][0]} (plain)" if isinstance(job[0], tuple) else Path(job[0]).stem if job[0]
                        else "MS-norms, BDIA, GLUs, references")
                progress(i + 1, len(jobs), what)
    return results


def as_json(results: list[KernelCost], arch: int) -> dict:
    import triton

    return {"model": {"issue_rate": ISSUE_RATE, "bandwidth": _BANDWIDTH, "budget_instructions_per_byte": BUDGET,
                      "arch": f"sm_{arch}", "triton": triton.__version__, "elements": ELEMENTS},
            "kernels": [asdict(r) for r in results]}
