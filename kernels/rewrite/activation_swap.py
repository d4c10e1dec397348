"""The activation rewrite of :func:`~.patch.patch_model`: each activation module (torch's and Hugging Face's, by
what its class computes, checked on a float64 grid) replaced by the drop-in of its table."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
from collections.abc import Mapping

import torch
from approxbp.approximations import tables as table_files
from torch import nn

from ..ops.glu import GatedMLP
from ..ops.invact import InvActGELU, InvActSiLU
from ..ops.modules import drop_in_classes, drop_in_families
from ..ops.relu_sum import ReGELU2, ReSiLU2
from . import functional_swap, swaps
from .common import FILTERED, PatchConfig, PatchReport, RewriteGuard, Undo, by_pattern, move_hooks

__all__ = ["ACTIVATION_CLASSES", "ACTIVATION_LIKE", "class_key", "swap_activations"]


#: Activation modules by class name (torch and Hugging Face transformers, matched by name so that transformers
#: stays optional) → the registry activation whose tables replace them. nn.GELU is looked up with its
#: ``approximate`` attribute.
ACTIVATION_CLASSES = {
    "GELU": "gelu", "GELUActivation": "gelu",
    "GELU/tanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh", "GELUTanh": "gelu_tanh", "AccurateGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "SiLU": "silu", "SiLUActivation": "silu",
    "Mish": "mish", "MishActivation": "mish",
    "ReLUSquaredActivation": "relu2",  # Nemotron, Primer: the exact table in either mode (no ReLU-sum fits it)
    "Softplus": "softplus",  # increasing: the exact one-branch table (saves y alone), in either mode
    "ELU": "elu", "CELU": "celu", "SELU": "selu",  # increasing, piecewise: exact one-branch tables (torch's α = 1;
    "Hardswish": "hardswish",                     # another α computes another function and is not swapped);
    # hard-swish: the ReLU-sum tables (eq. 13 holds beyond ±3); non-decreasing with constant pieces, whose torch
    # backward saves the input: the exact one-branch tables (y alone; Hardtanh with its default bounds only)
    "Hardsigmoid": "hardsigmoid", "ReLU6": "relu6", "Hardtanh": "hardtanh",
}


#: Class-name fragments of modules that look like activations; one that is not replaced is reported as skipped.
ACTIVATION_LIKE = ("GELU", "SiLU", "Swish", "Mish", "Activation", "ReLU", "Tanh", "Sigmoid", "Softplus", "ELU")


def class_key(module: nn.Module) -> str:
    name = type(module).__name__
    return "GELU/tanh" if name == "GELU" and getattr(module, "approximate", "none") == "tanh" else name


def _table_for(module: nn.Module, family: str | None, tables, bits: int):
    """(table name, path, dict or module; None) for one activation module, or (None, the reason): from ``tables``
    (a mapping by class, class name or module path, else one table for every recognised activation), else the
    ``family``'s packaged table of that activation."""
    key = class_key(module)
    if isinstance(tables, Mapping):
        for k in (type(module), key, type(module).__name__):
            if k in tables:
                return tables[k], None
        if family is None:
            return None, "not in the tables mapping"
    name = ACTIVATION_CLASSES.get(key)
    if name is None and key == "ReLU":
        return None, "already saves only its output (the next Linear saves it anyway): nothing to gain"
    if name is None:
        return None, "no table family for this activation"
    if key == "Softplus" and (module.beta != 1 or module.threshold < 20):  # torch returns x beyond the threshold
        return None, (f"beta = {module.beta:g}, threshold = {module.threshold:g}: not the table's log(1 + eˣ) (it "
                      "serves beta = 1, threshold ≥ 20, where float32 cannot tell them apart)")
    if key in ("ELU", "CELU") and module.alpha != 1.0:  # the packaged table is torch's default α = 1
        a = f"{module.alpha:g}"
        piece = f"{a}*(exp(x) - 1)" if key == "ELU" else f"{a}*(exp(x/{a}) - 1)"
        return None, (f"alpha = {a}: the packaged table is α = 1; fit its exact one: approxbp fit invact "
                      f"--activation 'Max(0, x) + Min(0, {piece})' --name {key.lower()}{a.replace('.', '_')} "
                      f"--out {key.lower()}.json, then tables={{'{key}': '{key.lower()}.json'}}")
    if tables is not None and not isinstance(tables, Mapping):
        return tables, None  # one table path: used for every recognised activation
    if _has_table(f"invact/{name}-exact"):
        return f"invact/{name}-exact", None  # f′(f⁻¹(y)) in closed form (ReLU²): exact, in either family
    chosen = _drop_in_family(family).packaged(name, bits)
    if _has_table(chosen):
        return chosen, None
    others = [f"family={f!r} has {t}" for f in drop_in_families() if f != family
              and _has_table(t := _drop_in_family(f).packaged(name, bits))]
    return None, "; ".join([f"no packaged table {chosen}", *others])


def _has_table(name: str) -> bool:
    """Whether a family's ``packaged`` table (a packaged name, or a path for another package's family) exists."""
    try:
        return table_files.resolve(name).is_file()
    except FileNotFoundError:
        return False


def _replacement(module: nn.Module, family: str | None, tables, bits: int, family_of):
    """(new module, None) or (None, why not) for an activation-like module; (None, None) for anything else.
    ``family_of(table)`` gives a table's family (cached per patch_model call: each table file is read once)."""
    name = type(module).__name__
    mapped = isinstance(tables, Mapping) and (type(module) in tables or name in tables)
    if isinstance(module, drop_in_classes()) or not (mapped or any(f.lower() in name.lower() for f in ACTIVATION_LIKE)):
        return None, None
    table, why = _table_for(module, family, tables, bits)
    if table is None:
        return None, why
    if isinstance(table, nn.Module):
        return table, None
    named = {"relu_sum/gelu-k2-primitive": ReGELU2, "relu_sum/silu-k2-primitive": ReSiLU2,
             "invact/gelu-fast": InvActGELU, "invact/silu-fast": InvActSiLU}
    if isinstance(table, str) and table in named:  # the papers' modules by their own names
        return named[table](), None
    typed = isinstance(table, dict) or table_files.is_table(table)
    family = table_files.as_table(table).family if typed else family_of(str(table))
    return _drop_in_family(family).drop_in(table), None


def _drop_in_family(family: str):
    """The spec class of a table family with a drop-in module (``kernels.modules.FAMILIES``), refused by name."""
    from approxbp.approximations.families import member

    from ..ops.modules import FAMILIES

    spec = member(FAMILIES, family, "kernels")
    if not hasattr(spec, "drop_in"):
        raise KeyError(f"table family {family!r} has no drop-in activation module")
    return spec


def swap_activations(model: nn.Module, report: PatchReport, undo: Undo, config: PatchConfig,
                     savings: RewriteGuard, functional: dict[str, list[str]] | None = None) -> None:
    """Replace each activation module by its drop-in (``config.family``, ``config.tables``; modules
    ``config.module_filter_fn`` refuses are left and reported), one pattern of paths at a time (:class:`RewriteGuard`);
    then the activations the modules of ``functional`` ({path: activations}) call as functions, at the call site
    (:func:`_swap_functional`). Each table file is read once and each drop-in checked once for both."""
    family_of = functools.cache(lambda table: table_files.header(table_files.resolve(table))[0])
    checked: dict = {}
    if isinstance(config.tables, Mapping):
        config = dataclasses.replace(config, tables=_Looked(config.tables, model))
    _swap_modules(model, report, undo, config, savings, family_of, checked)
    if functional:
        _swap_functional(model, functional, report, undo, config, savings, family_of, checked)
    if isinstance(config.tables, _Looked):
        config.tables.refuse_unmatched()


class _Looked(dict):
    """A ``tables=`` mapping that remembers which keys the swaps found, and what the model offered before them."""

    def __init__(self, mapping: Mapping, model: nn.Module):
        super().__init__(mapping)
        self.found: set = set()
        self.paths = {n for n, _ in model.named_modules() if n}
        self.keys_offered = {k for m in model.modules() for k in (type(m), type(m).__name__, class_key(m))}
        self.activations = sorted({class_key(m) for m in model.modules() if class_key(m) in ACTIVATION_CLASSES
                                   or any(f.lower() in type(m).__name__.lower() for f in ACTIVATION_LIKE)})

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.found.add(key)
        return value

    def get(self, key, default=None):
        if key in self:
            return self[key]
        return default

    def refuse_unmatched(self) -> None:
        """Every key names a module of the model (its path, class or class name) or was used at a call site; one
        that matches nothing is an error naming what the model has (patch_model then undoes everything): a key
        "SiLU" on a Hugging Face Llama, whose class is SiLUActivation, would otherwise leave its table unused
        while the packaged one is swapped in."""
        unmatched = [k for k in self if k not in self.found and k not in self.paths and k not in self.keys_offered]
        if not unmatched:
            return
        classes = sorted({k for k in self.keys_offered if isinstance(k, str)})
        hints = []
        for key in unmatched:
            text = key.__name__ if isinstance(key, type) else str(key)
            near = ([c for c in [*self.activations, *classes] if text.lower() in c.lower()]
                    or difflib.get_close_matches(text, [*self.activations, *classes, *self.paths], n=1))
            hints.append(f"{text!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ValueError(f"tables= names {', '.join(hints)}, which matches no module of this model (by path, class "
                         f"or class name); its activation classes: {', '.join(self.activations) or 'none'}")


def _swap_modules(model: nn.Module, report: PatchReport, undo: Undo, config: PatchConfig, savings: RewriteGuard,
                  family_of, checked: dict) -> None:
    tables = config.tables
    sites = [(f"{parent_name + '.' if parent_name else ''}{child_name}", parent, child_name, child)
             for parent_name, parent in model.named_modules() for child_name, child in parent.named_children()
             if not (isinstance(parent, GatedMLP) and child_name == parent.layout.act)  # the fused op computes it
             and not (swaps.expert_gate(parent) is not None and child_name == "act_fn")]  # so does an experts gate
    for pattern, group in by_pattern(sites, lambda site: site[0]):
        for sites_ in savings.attempts(f"{pattern} (activations)", group, lambda site: site[0]):
            for where, parent, child_name, child in sites_:
                chosen = tables.get(where) if isinstance(tables, Mapping) else None
                if chosen == "exact":
                    for_glu = not isinstance(config.glu, bool) and where.rpartition(".")[0] in config.glu
                    why = "left to its gated MLP's fused GLU (glu=)" if for_glu else "exact by choice"
                    report.skipped.append(f"{where} ({type(child).__name__}): {why}")
                    continue
                new, why = _checked_replacement(child, child, where, config, chosen or tables, family_of, checked)
                if new is None:
                    if why is not None:
                        report.skipped.append(f"{where} ({type(child).__name__}): {why}")
                    continue
                swaps.mark_replaced(new, child)  # for unpatch (not a submodule: no state-dict keys)
                move_hooks(child, new)
                undo.setattr(parent, child_name, new)
                report.activations.append(
                    f"{where}: {type(child).__name__} → {type(new).__name__}({new.extra_repr()}); "
                    f"{_error_of(new.spec)}"
                    + ("; inplace=True dropped: the drop-in returns a new tensor" if getattr(child, "inplace", False)
                       else ""))


def _checked_replacement(module: nn.Module, owner: nn.Module, where: str, config: PatchConfig, tables, family_of,
                         checked: dict):
    """(drop-in, None) for an activation ``module`` (run by ``owner`` at path ``where``), or (None, why not): its
    table's drop-in, unless ``config.module_filter_fn`` refuses the owner or the drop-in computes another function
    on the float64 grid."""
    new, why = _replacement(module, config.family, tables, config.bits, family_of)
    if new is not None and not config.wants(owner, where):
        return None, FILTERED
    if new is not None and (mismatch := _computes_differently(module, new, checked)):
        return None, mismatch
    return new, why


def _swap_functional(model: nn.Module, owners: dict[str, list[str]], report: PatchReport, undo: Undo,
                     config: PatchConfig, savings: RewriteGuard, family_of, checked: dict) -> None:
    """Swap the activations each module of ``owners`` ({path: activations}) calls as functions, at the call site
    (:mod:`.functional_swap`), with the drop-in a module of torch's class would get (``config.family``,
    ``config.tables`` by that class or by the module's path), checked and measured like module swaps."""
    tables, modules = config.tables, dict(model.named_modules())
    for pattern, group in by_pattern(list(owners)):
        for names in savings.attempts(f"{pattern} (activations called as functions)", group):
            for where in names:
                owner, dropins = modules[where], {}
                chosen = tables.get(where) if isinstance(tables, Mapping) else None
                for act in owners[where]:
                    stock = functional_swap.STOCK[act]()
                    new, why = (None, "exact by choice") if chosen == "exact" else _checked_replacement(
                        stock, owner, where, config, chosen or tables, family_of, checked)
                    if new is None:
                        report.skipped.append(f"{where} ({type(owner).__name__}): calls {act} as a function; {why}")
                        continue
                    dropins[act] = new
                    report.activations.append(f"{where}: {act} called as a function in {type(owner).__name__} → "
                                              f"{type(new).__name__}({new.extra_repr()}) at the call site; "
                                              f"{_error_of(new.spec)}")
                if dropins:
                    functional_swap.install(owner, dropins)
                    undo.steps.append(lambda owner=owner: functional_swap.uninstall(owner))


@functools.cache
def _error_of(spec) -> str:
    """The drop-in's gradient error, said once per table (:mod:`approxbp.approximations.gradient_error`) without
    the build side: its family's :meth:`~approxbp.kernels.ops.modules.GeneratedSpec.error_said`."""
    return spec.error_said()


def _computes_differently(old: nn.Module, new: nn.Module, checked: dict) -> str | None:
    """Why ``new`` may not replace ``old`` (None when it may): both are run in float64 on a grid of [−8, 8] and must
    agree to 1e-9, so that a table of another activation (a GELU table on a SiLU) is never swapped in silently.
    ``checked`` remembers the verdict per (class, configuration, table) within one patch_model call."""
    spec = getattr(new, "spec", None)
    from approxbp.kernels.ops.torch_private import unset_fake_temporarily

    key = (type(old), old.extra_repr(), spec.key if spec is not None else id(new))
    if key not in checked:
        with unset_fake_temporarily():  # real numbers even when the model is being planned on fake tensors
            checked[key] = _compare_float64(old, new, spec)
    return checked[key]


def _compare_float64(old: nn.Module, new: nn.Module, spec) -> str | None:
    x = torch.linspace(-8, 8, 1601, dtype=torch.float64)

    def in_float64(m: nn.Module) -> nn.Module:  # a module with state is copied, never converted in place
        return copy.deepcopy(m).to(torch.float64) if any(True for _ in m.parameters()) or any(
            True for _ in m.buffers()) else m

    try:
        with torch.no_grad():
            # forward(): the user's hooks do not fire; each side gets its own copy of the grid, since an in-place
            # module (nn.SiLU(inplace=True)) overwrites its input
            want = in_float64(old).forward(x.clone())
            got = spec.forward_only_torch(x.clone()) if spec is not None else in_float64(new).forward(x.clone())
    except Exception as err:  # noqa: BLE001 - what cannot be checked is not swapped
        return (f"could not be checked against the drop-in on a float64 vector ({type(err).__name__}: {err}); "
                "not swapped")
    diff = float((got - want).abs().max())
    if not diff <= 1e-9 * max(1.0, float(want.abs().max())):
        what = f"table {spec.name()!r} ({spec.expression})" if spec is not None else type(new).__name__
        return f"{what} computes another function (max |difference| {diff:.3g} on [−8, 8]); not swapped"
    return None
