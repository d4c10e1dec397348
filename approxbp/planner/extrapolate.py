"""One block measured, every block planned: a model whose L blocks are alike saves, per block,
what its block 2 saves in a 3-block model, and everything outside the blocks (embeddings, the final norm, the head,
a compiled graph's or a traced peak's totals, the parameters) is linear in L. So the planner measures the model at 2
and 3 blocks and writes the L-block step from them:

    block entries of blocks 0, 1: as measured at 3; blocks 2 … L−1: block 2's, renamed;
    every other number v:  v(L) = v(3) + (L − 3)·(v(3) − v(2)).

It applies when the config's per-layer lists (``layer_types``, …) are uniform and an assignment gives every block
the same options; otherwise the planner measures the whole model. A test checks it against whole measurements.
"""

from __future__ import annotations

import re
from dataclasses import replace

__all__ = ["extrapolate", "layer_count", "shrunk", "SMALL", "small_assignment"]


#: Config fields that count the repeated blocks, by the name each model family uses.
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
#: Block counts measured: a block that is neither the first nor the last at 3, and the step at 2 for the slopes.
SMALL = (2, 3)


def layer_count(config) -> tuple[str, int] | None:
    """(the field, L) of a config whose blocks are alike (every per-layer list uniform), or None."""
    field = next((f for f in _LAYER_FIELDS if isinstance(getattr(config, f, None), int)), None)
    if field is None:
        return None
    layers = getattr(config, field)
    for value in vars(config).values():
        if isinstance(value, list) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return None
    return field, layers


def shrunk(config, field: str, layers: int):
    """A copy of ``config`` with ``layers`` blocks (per-layer lists cut to match)."""
    import copy

    small = copy.deepcopy(config)
    full = getattr(config, field)
    setattr(small, field, layers)
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == full and key != "architectures":
            setattr(small, key, value[:layers])
    return small


def _split(path: str, prefix: str) -> tuple[int, str] | None:
    """(block index, rest) of a path inside the blocks ``prefix`` (``model.layers.``), or None."""
    m = re.match(re.escape(prefix) + r"(\d+)(\..*)?$", path)
    return (int(m[1]), m[2] or "") if m else None


def small_assignment(assignment: dict[str, str], prefix: str, layers: int) -> dict[str, str] | None:
    """The assignment for the 3-block model, when every block gets the same options (None otherwise)."""
    per_rest: dict[str, set[str]] = {}
    out = {}
    for path, option in assignment.items():
        where = _split(path, prefix)
        if where is None:
            out[path] = option
            continue
        per_rest.setdefault(where[1], set()).add(option)
        if where[0] < SMALL[-1]:
            out[path] = option
    if any(len(options) > 1 for options in per_rest.values()):
        return None
    counted = {r: sum(1 for p in assignment if (w := _split(p, prefix)) and w[1] == r) for r in per_rest}
    return out if all(n in (0, layers) for n in counted.values()) else None


def _renamed(entries: dict, prefix: str, layers: int, linear=None) -> dict:
    """Blocks 0, 1 as they are, block 2 copied to 2 … L−1; other keys through ``linear`` (or as they are)."""
    out = {}
    for path, value in entries.items():
        where = _split(path, prefix)
        if where is None:
            out[path] = linear(path, value) if linear else value
        elif where[0] < SMALL[-1] - 1:
            out[path] = value
        else:
            out.update({f"{prefix}{i}{where[1]}": value for i in range(SMALL[-1] - 1, layers)})
    return out


def extrapolate(two, three, layers: int, prefix: str):
    """The L-block :class:`~approxbp.planner.step_memory.StepMemory` from the steps at 2 and 3 blocks (the module
    docstring)."""
    steps = layers - SMALL[-1]

    def linear(path, value):
        return value + steps * (value - two.saved.get(path, 0))

    def linear_held(path, value):
        return value + steps * (value - two.held.get(path, 0))

    moment = three.moment
    if (where := re.search(re.escape(prefix) + r"(\d+)", moment)) and int(where[1]) == SMALL[-1] - 1:
        moment = moment.replace(where[0], f"{prefix}{layers - 1}")
    return replace(three, parameters=three.parameters + steps * (three.parameters - two.parameters),
                   gradients=three.gradients + steps * (three.gradients - two.gradients),
                   optimizer=three.optimizer + steps * (three.optimizer - two.optimizer),
                   saved=_renamed(three.saved, prefix, layers, linear), kinds=_renamed(three.kinds, prefix, layers),
                   held=_renamed(three.held, prefix, layers, linear_held),
                   layers=_renamed(three.layers, prefix, layers), moment=moment, blocks_measured=SMALL)
