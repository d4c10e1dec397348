"""What a plan is made of, typed: the summary of a measured step (:class:`StepSummary`: a plan's ``before``,
``after`` and ``assignment``), the MS-norms' saving and choice (:class:`MsNorm`), one planned layer
(:class:`PlannedLayer`) and the moves beyond the approximations (:class:`Moves`, with the chunked loss's cost,
:class:`ChunkedLossCost`, and a compiled budget, :class:`CompileMove`). The planner passes these between its
functions; a plan's JSON is their ``dataclasses.asdict`` (:meth:`~.result.Plan.to_json`), read back by each type's
``from_json`` (:meth:`~.result.Plan.load`), so the file's schema is theirs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from approxbp.planner.step_memory import StepMemory

__all__ = ["ChunkedLossCost", "CompileMove", "Moves", "MsNorm", "PlannedLayer", "StepSummary"]


def _known(cls, data: dict) -> dict:
    """The fields of ``cls`` that ``data`` holds (a file written by an older approxbp may lack some)."""
    return {f.name: data[f.name] for f in fields(cls) if f.name in data}


@dataclass(frozen=True)
class StepSummary:
    """One step's memory (bytes), as a plan reports it: its four parts and peak, its saved activations by kind, its
    first block and that block's App. B units, where a traced step peaked, the block counts it was extrapolated from
    and, over several devices, each device's peak. ``peak_traced``: the peak is a whole traced step's."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    activations_by_kind: dict[str, int]
    block: str = ""
    block_units: float | None = None
    peak_moment: str | None = None
    blocks_measured: tuple[int, ...] = ()
    device_peaks: tuple[int, ...] = ()
    peak_traced: bool = False

    @classmethod
    def of(cls, m: StepMemory) -> StepSummary:
        units = m.block_units
        return cls(m.parameters, m.gradients, m.optimizer, m.activations, m.peak, m.by_kind(), m.block,
                   None if units is None else round(units, 4), m.moment, tuple(m.blocks_measured),
                   tuple(m.device_peaks()) if m.devices > 1 else ())

    @classmethod
    def from_json(cls, data: dict) -> StepSummary:
        known = _known(cls, data)
        return cls(**known | {k: tuple(known.get(k) or ()) for k in ("blocks_measured", "device_peaks")})


@dataclass(frozen=True)
class MsNorm:
    """The MS-norms: what merging every mergeable norm takes off the peak (bytes; None where not measured, an
    evaluated assignment), and whether the plan does."""

    saving: int | None
    chosen: bool = False

    @classmethod
    def from_json(cls, data: dict) -> MsNorm:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class PlannedLayer:
    """One activation layer of a plan: its registry activation, the option chosen, that option's table (None for
    ``exact`` and ``glu``) and the option's measured cost (:class:`~.result.OptionCost`'s fields)."""

    activation: str | None = None  # a hand-written plan may give only the table (and the option)
    option: str | None = None
    table: str | None = None
    saving_per_layer: int = 0
    error: float = 0.0

    @classmethod
    def from_json(cls, data: dict) -> PlannedLayer:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ChunkedLossCost:
    """The chunked loss as a move: whether chosen, the bytes it takes off the peak, the one chunk's transient it
    brings back, and its modelled extra seconds."""

    chosen: bool
    saving: int = 0
    transient: int = 0
    seconds: float = 0.0

    @classmethod
    def from_json(cls, data: dict | None) -> ChunkedLossCost | None:
        return None if data is None else cls(**_known(cls, data))


@dataclass(frozen=True)
class CompileMove:
    """The step compiled at this ``activation_memory_budget`` (torch.compile's min-cut)."""

    activation_memory_budget: float


@dataclass(frozen=True)
class Moves:
    """What a plan does beyond the approximations (:func:`~.plan_moves.plan_moves`, :func:`~.compiled.fastest_within`):
    block path → move (recompute, offload, "recompute PART"), the GPU they were timed for (and whether it was the
    default), the modelled peak (its end-of-forward bytes and the one moved block or chunk back at it), the modelled
    seconds before and after, the count of each move, the chunked loss (None: not a move for this model), and for a
    compiled plan its budget and saved bytes."""

    moves: dict[str, str]
    gpu: str
    peak: int
    seconds_after: float
    gpu_source: str = ""
    end_of_forward: int | None = None
    transient: int = 0
    seconds_before: float | None = None
    by_move: dict[str, int] = field(default_factory=dict)
    chunked_loss: ChunkedLossCost | None = None
    compile: CompileMove | None = None
    saved: int | None = None
    gpu_default: bool = False

    @property
    def chunks_loss(self) -> bool:
        """Whether the moves chunk the loss."""
        return self.chunked_loss is not None and self.chunked_loss.chosen

    @classmethod
    def from_json(cls, data: dict | None) -> Moves | None:
        if data is None:
            return None
        known = _known(cls, data)
        compiled = known.get("compile")
        return cls(**known | {"chunked_loss": ChunkedLossCost.from_json(known.get("chunked_loss")),
                              "compile": None if compiled is None else CompileMove(**compiled)})
