"""FedGMR gradual model restoration: how large each client's submodel is over time, and what it
holds.

A client of capacity ``c`` (the fraction of the global model it reported) starts
at ``g0`` and its submodel *grows*; its density never shrinks. How far depends on
what the capacity limits (``capacity-kind``):

* ``bandwidth`` (FedGMR's setting: slow links, not small memories): the submodel
  grows toward ``ceiling`` (the full model by default), whatever ``c`` is;
* ``memory``: ``c`` is a hard cap, the submodel grows toward ``min(ceiling, c)``.

Start density ``g0 = min(g_end, max(MIN_DENSITY, start * c))`` (``start = 1``: the
client's own capacity, as the published code starts), end density ``g_end =
ceiling`` (bandwidth) or ``min(ceiling, c)`` (memory). The clock ``t >= 0`` counts
rounds since the start (sync: ``round - 1``; async: applied updates divided by the
number of nodes, a fractional "round equivalent").

**When** a client grows (the schedule):

* ``patience`` (the published code, ``FedMapServer.GMR``, :class:`PatienceSchedule`):
  once per round a check feeds each client's latest score to its own
  early-stopping counter; a client whose score has not improved for ``patience``
  checks steps up (``ladder``: to the next larger start density among the known
  clients, else the full model; ``capped-double``: ``d + min(d, 0.2)``) and then
  waits ``2 * patience`` checks. A second counter on the round's mean score raises
  a floor under every client (from ``min_density``, by the same kind of step; the
  first exhaustion only arms it) and pauses all checks for ``patience - 1`` rounds;
* ``linear`` (the paper's text: a fixed schedule): ``g(t) = g0 + (g_end - g0) *
  min(1, t / T)`` with ``T`` = ``restore_rounds``;
* ``step``: the density is multiplied by ``factor`` at ``n`` evenly spaced
  moments, ``n = ceil(log(g_end / g0) / log(factor))`` steps spread over ``T``
  rounds: ``g(t) = min(g_end, g0 * factor ** floor(n * min(t, T) / T))``.

**Which** positions a client holds (the rule):

* ``magnitude`` (the published code, ``control/sub_algorithm.py``): one ranking
  per round shared by every client, so the submodels of one round nest. Every
  submodel holds the 1-D tensors and a per-tensor magnitude core (the
  ``n - min(int((1 - min_density) n), n - 1)`` largest ``|x|`` of each weight
  tensor, ``process_layer``); the rest of its budget is the other positions with
  the largest ``|x_j| / c_l`` (``c_l``: the tensor's cost per parameter,
  ``sub_architecture_search_fast``). The mask is re-derived every round;
* ``delta``: the same with ``|(x_j - x'_j) x_j| / c_l``, ``x'`` the model of the
  previous ranking (the branch ``accumulate_wg_square`` intends; the published
  run never reaches it);
* ``random`` (the paper's text): a fixed, seeded random priority per (run seed,
  client), deterministic so a restarted server re-derives it;
* ``fisher``: ``F_j^2 x_j^2`` as in :mod:`common.fisher.selection` (FedFIbOS ranking),
  using the server's current Fisher estimate for that client.

With ``random`` and ``fisher`` a client's new mask always contains its previous one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.config.capacity import CAPACITY_KINDS
from common.fisher.selection import budget, fisher_scores, magnitude_scores, row_guard, topk_mask
from common.models.layout import ParamLayout

Schedule = Literal["patience", "linear", "step"]
TIMED_SCHEDULES: tuple[str, ...] = ("linear", "step")
SCHEDULES: tuple[str, ...] = ("patience", *TIMED_SCHEDULES)
CapacityKind = Literal["bandwidth", "memory"]
#: Rules with one ranking per round shared by every client (the published code's).
SHARED_RULES: tuple[str, ...] = ("magnitude", "delta")
RESTORE_RULES: tuple[str, ...] = (*SHARED_RULES, "random", "fisher")
RESTORE_STEPS: tuple[str, ...] = ("ladder", "capped-double")

# Smallest start density: below ~1 % a CNN submodel cannot learn anything useful, and every
# client must hold at least a sliver of the model from the first round.
MIN_DENSITY = 0.01
#: ``capped-double``: the largest step, and the floor's step (the published ``-ic`` below 1).
CAPPED_STEP = 0.2
#: ``ladder``: a level counts as larger only when it exceeds the current density by more than this.
LADDER_TOLERANCE = 0.01


def start_density(
    capacity: float, start: float, ceiling: float, kind: CapacityKind = "memory"
) -> float:
    """``g0 = min(g_end, max(MIN_DENSITY, start * capacity))`` (see the module docstring)."""
    return min(end_density(capacity, ceiling, kind), max(MIN_DENSITY, start * capacity))


def end_density(capacity: float, ceiling: float, kind: CapacityKind = "memory") -> float:
    """``g_end``: ``ceiling`` for a bandwidth-limited client, ``min(ceiling, capacity)`` for a
    memory-limited one."""
    if kind not in CAPACITY_KINDS:
        raise ValueError(f"unknown capacity kind {kind!r}; expected one of {CAPACITY_KINDS}")
    return ceiling if kind == "bandwidth" else min(ceiling, capacity)


def restoration_budget(
    schedule: Schedule,
    t: float,
    capacity: float,
    start: float,
    ceiling: float,
    restore_rounds: int,
    factor: float = 2.0,
    kind: CapacityKind = "memory",
) -> float:
    """Density (fraction of ``d``) a client holds at time ``t`` on a fixed (``linear`` or ``step``)
    schedule.

    The ``patience`` schedule depends on the clients' progress, not on ``t`` alone: see
    :class:`PatienceSchedule`.

    Parameters
    ----------
    schedule : {"linear", "step"}
        Growth shape (see the module docstring).
    t : float
        Rounds elapsed since the start of training, ``>= 0`` (may be fractional).
    capacity : float
        Fraction of the global model the client reported, in (0, 1]: the start scale, and with
        ``kind = "memory"`` a hard upper bound.
    start : float
        Start density as a fraction of ``capacity``, in (0, 1].
    ceiling : float
        Density the schedule grows toward, in (0, 1] (clipped to ``capacity`` when ``kind =
        "memory"``).
    restore_rounds : int
        Rounds ``T`` (>= 1) after which the end density is reached.
    factor : float
        ``step`` only: growth factor per step, > 1.
    kind : {"memory", "bandwidth"}
        What the capacity limits (see the module docstring).

    Returns
    -------
    float
        Density in ``(0, g_end]``, non-decreasing in ``t``.
    """
    _check_budget_args(t, capacity, start, ceiling, restore_rounds, kind)
    end = end_density(capacity, ceiling, kind)
    g0 = start_density(capacity, start, ceiling, kind)
    progress = min(1.0, t / restore_rounds)
    if schedule == "linear":
        # Exactly ``end`` once restored: g0 + (end - g0) * 1.0 can round a hair off it.
        return end if progress >= 1.0 else min(end, g0 + (end - g0) * progress)
    if schedule == "step":
        return _step_budget(g0, end, progress, factor)
    raise ValueError(f"unknown fixed schedule {schedule!r}; expected one of {TIMED_SCHEDULES}")


def _check_budget_args(
    t: float,
    capacity: float,
    start: float,
    ceiling: float,
    restore_rounds: int,
    kind: str,
) -> None:
    """Refuse arguments of :func:`restoration_budget` outside their ranges (the schedule aside).

    Parameters
    ----------
    t : float
        Rounds elapsed since the start of training; must be ``>= 0``.
    capacity, start, ceiling : float
        The client's capacity, its start fraction and the growth ceiling; each must be in (0, 1].
    restore_rounds : int
        Rounds ``T`` until the end density; must be >= 1.
    kind : str
        What the capacity limits; must be one of :data:`CAPACITY_KINDS`.
    """
    if not 0 < capacity <= 1 or not 0 < start <= 1 or not 0 < ceiling <= 1:
        raise ValueError(
            f"capacity, start and ceiling must be in (0, 1], got {capacity}, {start}, {ceiling}"
        )
    if restore_rounds < 1:
        raise ValueError(f"restore_rounds must be >= 1, got {restore_rounds}")
    if not t >= 0:
        raise ValueError(f"t must be >= 0, got {t}")
    if kind not in CAPACITY_KINDS:
        raise ValueError(f"unknown capacity kind {kind!r}; expected one of {CAPACITY_KINDS}")


def _step_budget(g0: float, end: float, progress: float, factor: float) -> float:
    """Density of the ``step`` schedule: ``g0`` times ``factor`` per step done, at most ``end``.

    Parameters
    ----------
    g0 : float
        Start density.
    end : float
        End density.
    progress : float
        Fraction of the ``restore_rounds`` elapsed, in [0, 1].
    factor : float
        Growth factor per step; must be > 1.
    """
    if not factor > 1:
        raise ValueError(f"step factor must be > 1, got {factor}")
    if g0 >= end:
        return end
    steps = math.ceil(math.log(end / g0) / math.log(factor) - 1e-12)
    # A tiny epsilon keeps t = T (progress 1.0) at the last step despite float error.
    done = math.floor(steps * progress + 1e-9)
    return end if done >= steps else min(end, g0 * factor**done)


def random_priority(d: int, seed: int, client_key: str) -> NDArray[np.float64]:
    """Fixed random restoration order of one client: a score per position, higher restores first.

    Deterministic in ``(seed, client_key)`` (a stable hash, not Python's salted
    ``hash``), so every process and a restarted server derive the same order.

    Parameters
    ----------
    d : int
        Number of positions.
    seed : int
        Run seed.
    client_key : str
        The client's stable identity.
    """
    digest = hashlib.sha256(f"{seed}:{client_key}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.random(d)


def restore_mask(
    previous: NDArray[np.bool_] | None,
    k: int,
    scores: NDArray,
    forced: NDArray[np.bool_] | None = None,
) -> NDArray[np.bool_]:
    """Grow ``previous`` to ``k`` positions by adding the highest-scoring positions it lacks.

    The result contains ``previous`` and ``forced`` and has exactly
    ``max(k, |previous | forced|)`` positions (restoration never drops a
    position, so a smaller ``k`` than already held keeps the held set).

    Parameters
    ----------
    previous : NDArray[bool] or None
        The client's last mask (``None`` the first time), length ``d``.
    k : int
        Target number of positions, ``0 <= k <= d``.
    scores : NDArray
        Finite score per position (higher = restored earlier), length ``d``.
    forced : NDArray[bool], optional
        Positions held regardless (e.g. biases and the per-row guard).
    """
    scores = np.asarray(scores, dtype=np.float64)
    d = scores.shape[0]
    keep = np.zeros(d, dtype=bool)
    for extra in (previous, forced):
        if extra is not None:
            if extra.shape != (d,):
                raise ValueError(f"mask has shape {extra.shape}, expected ({d},)")
            keep |= extra
    return topk_mask(scores, max(k, int(keep.sum())), keep)


# ------------------------------------------------------------------------------------------------
# The published code's ranking: per-tensor magnitude core, one shared order by score / cost.


def position_costs(
    layout: ParamLayout, costs: Mapping[str, float] | None = None
) -> NDArray[np.float64]:
    """The cost per parameter ``c_l`` of every position: its tensor's entry of ``costs`` (default
    1).

    The published code divides each layer's scores by its measured seconds per parameter
    (``COMM_COEFFICIENT + COMP_COEFFICIENTS[l]`` of ``configs/<dataset>.py``).

    Parameters
    ----------
    layout : ParamLayout
        The flat layout.
    costs : Mapping[str, float], optional
        Cost per parameter by tensor name (finite, > 0); tensors not named cost 1.
    """
    costs = dict(costs or {})
    unknown = set(costs) - set(layout.names)
    if unknown:
        raise ValueError(f"costs name tensors {sorted(unknown)} that the layout does not have")
    bad = {n: c for n, c in costs.items() if not (math.isfinite(c) and c > 0)}
    if bad:
        raise ValueError(f"costs must be finite and > 0, got {bad}")
    out = np.ones(layout.size, dtype=np.float64)
    for t, start in zip(layout.tensors, layout.offsets[:-1].tolist()):
        if t.name in costs:
            out[start : start + t.size] = costs[t.name]
    return out


def core_size(n: int, min_density: float) -> int:
    """Weights of an ``n``-weight tensor in the magnitude core: ``n - min(int((1 - min_density) n),
    n - 1)``.

    ``process_layer`` keeps the weights at or above the ``int((1 - min_density) n)``-th smallest
    magnitude (at most ``n - 1`` dropped), so at least one weight per tensor.
    """
    if not 0 <= min_density <= 1:
        raise ValueError(f"min_density must be in [0, 1], got {min_density}")
    return n - min(int((1 - min_density) * n), n - 1) if n else 0


def magnitude_core(layout: ParamLayout, x: NDArray, min_density: float) -> NDArray[np.bool_]:
    """The largest-``|x|`` :func:`core_size` positions of every >=2-D tensor (ties: the lower
    index)."""
    x = np.asarray(x)
    core = np.zeros(layout.size, dtype=bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1].tolist()):
        if len(t.shape) < 2 or t.size == 0:
            continue
        span = slice(start, start + t.size)
        core[span] = topk_mask(np.abs(x[span]), core_size(t.size, min_density))
    return core


def shared_scores(
    x: NDArray, costs: NDArray[np.float64], previous: NDArray | None = None
) -> NDArray[np.float64]:
    """Ranking key of the shared order: ``|x_j| / c_j``, or ``|(x_j - previous_j) x_j| / c_j``
    (``delta``).

    ``previous = None`` gives the magnitude key, as ``accumulate_wg_square`` does without an old
    model.
    """
    xd = np.asarray(x, dtype=np.float64)
    if previous is None:
        return np.abs(xd) / costs
    return np.abs((xd - np.asarray(previous, dtype=np.float64)) * xd) / costs


def shared_mask(
    layout: ParamLayout, k: int, scores: NDArray, core: NDArray[np.bool_], x: NDArray
) -> NDArray[np.bool_]:
    """The first ``k`` positions of the shared order: 1-D tensors, then the core, then by
    ``scores``.

    The order is the same for every ``k``, so two clients ranked by the same ``scores`` and ``core``
    hold nested masks. A budget below the 1-D tensors plus the core holds the 1-D tensors and the
    core's largest ``|x|`` (the published code never goes below its core); a budget below the 1-D
    tensors holds exactly them.
    """
    vectors = layout.always_kept
    forced = vectors | core
    if k >= int(np.count_nonzero(forced)):
        return topk_mask(scores, k, forced)
    within = np.where(core & ~vectors, np.abs(np.asarray(x, dtype=np.float64)), -1.0)
    return topk_mask(within, max(k, int(np.count_nonzero(vectors))), vectors)


# ------------------------------------------------------------------------------------------------
# The published code's schedule: accuracy patience (``FedMapServer.GMR`` and ``EarlyStopping``).


def ladder_step(density: float, levels: Iterable[float]) -> float:
    """``get_ladder_next_density``: the smallest level above ``density + 0.01``, else the full
    model."""
    larger = [v for v in sorted({*levels, density}) if v > density + LADDER_TOLERANCE]
    return min(larger) if larger else 1.0


def capped_double_step(density: float) -> float:
    """The published step for ``-ic`` below 1: ``d + min(d, 0.2)`` (the full model once that reaches
    1).

    Written as the published condition (``d + min(0.7 d, 0.2) < 1``), which equals ``min(1, d +
    min(d, 0.2))``.
    """
    if density + min(density * 0.7, CAPPED_STEP) < 1.0:
        return density + min(density, CAPPED_STEP)
    return 1.0


def floor_step(floor: float, rule: str, levels: Iterable[float]) -> float:
    """The next floor: ``ladder`` as a client's step, ``capped-double`` ``+0.2`` (the full model
    once past 1)."""
    if rule == "ladder":
        return ladder_step(floor, levels)
    return floor + CAPPED_STEP if floor + CAPPED_STEP < 1.0 else 1.0


@dataclass
class EarlyStop:
    """One signal's counter of ``EarlyStopping`` (``delta = 0``): higher scores are better.

    Calling it with a score returns whether patience is exhausted: the score did not beat the best
    so far and ``counter >= patience`` non-improving scores have come in since the last improvement
    (or reset). The first score after a reset only sets the best.
    """

    patience: int
    best: float | None = None
    counter: int = 0

    def __call__(self, score: float) -> bool:
        if self.best is None:
            self.best, self.counter = score, 0
            return False
        if score <= self.best:
            self.counter += 1
            return self.counter >= self.patience
        self.best, self.counter = score, 0
        return False

    def restart(self) -> None:
        """Forget the best score (``best_score = None``); the counter stays."""
        self.best = None

    def reopen(self) -> None:
        """The next score counts as an improvement (``best_score = -1`` and ``counter = 0`` for
        accuracies)."""
        self.best, self.counter = -math.inf, 0


@dataclass
class _PatienceClient:
    start: float
    end: float
    density: float
    stop: EarlyStop
    wait: int = 0
    latest: float | None = None


@dataclass
class PatienceSchedule:
    """Client densities restored on patience, as ``FedMapServer.GMR`` does (``recover_trigger_mode =
    early``).

    Scores come in with :meth:`record` (higher is better; one per reply, tagged with its round);
    :meth:`advance` runs one check per completed round, in order:

    1. every client's wait is counted down;
    2. unless the floor's pause is on: each client's counter takes its latest score (possibly an
       earlier round's: a client that did not reply counts as not improving) and the floor's counter
       the round's weighted mean score (no reply this round: no count). The floor's first exhaustion
       only arms it; later ones raise the floor (``floor_step``), pause the checks for ``patience -
       1`` rounds and restart every best score. A client whose counter is exhausted and that is not
       waiting steps up (``ladder`` or ``capped-double``, at most its end density), waits ``2 *
       patience`` checks, and its and the floor's best scores restart; then every client below the
       floor is raised to it (at most its end density) and its and the floor's counters reopen.

    Parameters
    ----------
    patience : int
        Checks without improvement that exhaust a counter (>= 1).
    rule : {"ladder", "capped-double"}
        How a density steps up.
    floor : float
        Initial floor, in [0, 1] (the published ``min_density``).
    """

    patience: int
    rule: str
    floor: float
    clients: dict[str, _PatienceClient] = field(default_factory=dict)
    checked: int = 0
    pause: int = 0
    armed: bool = False
    pending: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if self.rule not in RESTORE_STEPS:
            raise ValueError(f"unknown restore step {self.rule!r}; expected one of {RESTORE_STEPS}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")
        self.floor_stop = EarlyStop(self.patience)

    def join(self, key: str, start: float, end: float) -> None:
        """(Re)start client ``key`` at density ``start``, never above ``end``."""
        if not 0 < start <= end <= 1:
            raise ValueError(f"need 0 < start <= end <= 1, got {start}, {end}")
        self.clients[key] = _PatienceClient(start, end, start, EarlyStop(self.patience))

    def density(self, key: str) -> float:
        """The current density of a joined client."""
        return self.clients[key].density

    def record(self, key: str, server_round: int, score: float, weight: float = 1.0) -> None:
        """One reply's score (higher is better) in round ``server_round`` (>= 1); ``weight`` for the
        round's mean."""
        if not math.isfinite(score) or not weight > 0:
            raise ValueError(f"score must be finite and weight > 0, got {score}, {weight}")
        if server_round > self.checked:  # a late reply of a round already checked is not counted
            self.pending.setdefault(int(server_round), []).append(
                (key, float(score), float(weight))
            )

    def advance(self, upto: int) -> None:
        """Run the checks of rounds ``checked + 1 .. upto`` (each a completed round)."""
        while self.checked < upto:
            self.checked += 1
            self._check(self.pending.pop(self.checked, []))

    def _levels(self) -> list[float]:
        return sorted({c.start for c in self.clients.values()})

    def _step(self, density: float) -> float:
        return (
            ladder_step(density, self._levels())
            if self.rule == "ladder"
            else capped_double_step(density)
        )

    def _check(self, scores: list[tuple[str, float, float]]) -> None:
        for key, score, _ in scores:
            if key in self.clients:
                self.clients[key].latest = score
        for c in self.clients.values():
            c.wait = max(0, c.wait - 1)
        if self.pause <= 0:
            weights = sum(w for _, _, w in scores)
            mean = sum(s * w for _, s, w in scores) / weights if scores else None
            self._gmr(mean)
        if self.pause > 0:
            self.pause -= 1

    def _gmr(self, mean: float | None) -> None:
        floor_out = self.floor_stop(mean) if mean is not None else False
        out = {key: c.stop(c.latest) for key, c in self.clients.items() if c.latest is not None}
        if not self.armed and self.floor_stop.counter >= self.patience:
            self.armed, self.floor_stop.counter, floor_out = True, 0, False
        if floor_out and self.armed and self.floor < 1.0:
            self.floor = floor_step(self.floor, self.rule, self._levels())
            self.pause = self.patience
            self.floor_stop.restart()
            for c in self.clients.values():
                c.stop.restart()
        for key, exhausted in out.items():
            c = self.clients[key]
            if exhausted and c.wait <= 0:
                c.density = min(c.end, self._step(c.density))
                c.wait = 2 * self.patience
                c.stop.restart()
                self.floor_stop.restart()
        for c in self.clients.values():
            raised = min(c.end, self.floor)
            if c.density < raised:
                c.density = raised
                c.stop.reopen()
                self.floor_stop.reopen()


@dataclass
class _ClientMask:
    capacity: float
    kind: str
    t: float
    mask: NDArray[np.bool_]


class RestorationMasks:
    """Growing submodel masks, one per client key.

    Parameters
    ----------
    layout : ParamLayout
        The global model's flat layout.
    schedule, start, ceiling, restore_rounds, factor
        Budget schedule (see :func:`common.submodels.restoration.restoration_budget`; ``patience``:
        :class:`PatienceSchedule`).
    rule : {"magnitude", "delta", "random", "fisher"}
        Which positions a client holds.
    seed : int
        Run seed (the ``random`` rule's per-client order derives from it).
    min_per_row : int
        Guard of :mod:`common.fisher.selection` (``random`` and ``fisher`` rules): positions every
        output unit keeps.
    patience : int
        ``patience`` schedule: checks without improvement before a client steps up.
    restore_step : {"ladder", "capped-double"}
        ``patience`` schedule: how a density steps up.
    min_density : float
        Magnitude core of the shared rules, and the ``patience`` schedule's initial floor, in [0,
        1].
    costs : Mapping[str, float], optional
        Shared rules: cost per parameter by tensor name (:func:`position_costs`; default 1 for all).
    """

    def __init__(
        self,
        layout: ParamLayout,
        schedule: str,
        start: float,
        ceiling: float,
        restore_rounds: int,
        factor: float,
        rule: str,
        seed: int,
        min_per_row: int,
        patience: int = 5,
        restore_step: str = "ladder",
        min_density: float = 0.02,
        costs: Mapping[str, float] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
        if rule not in RESTORE_RULES:
            raise ValueError(f"unknown rule {rule!r}; expected one of {RESTORE_RULES}")
        self.layout = layout
        self.schedule = schedule
        self.start = start
        self.ceiling = ceiling
        self.restore_rounds = restore_rounds
        self.factor = factor
        self.rule = rule
        self.seed = seed
        self.min_per_row = min_per_row
        self.min_density = min_density
        self.costs = position_costs(layout, costs)
        self.patience = PatienceSchedule(patience, restore_step, min_density)
        self.clients: dict[str, _ClientMask] = {}
        # Shared rules: (round, scores, core, x) of the current ranking, and the model of the one
        # before.
        self.ranking: (
            tuple[int, NDArray[np.float64], NDArray[np.bool_], NDArray[np.float32]] | None
        ) = None

    @property
    def shared(self) -> bool:
        """Whether the rule ranks every client by one order per round (``magnitude``, ``delta``)."""
        return self.rule in SHARED_RULES

    def density(self, t: float, capacity: float, kind: str = "memory") -> float:
        """Density at time ``t`` of a fixed schedule; the start density on the ``patience``
        schedule."""
        if self.schedule == "patience":
            return start_density(capacity, self.start, self.ceiling, kind)  # type: ignore[arg-type]
        return restoration_budget(
            self.schedule,  # type: ignore[arg-type]
            t,
            capacity,
            self.start,
            self.ceiling,
            self.restore_rounds,
            self.factor,
            kind,  # type: ignore[arg-type]
        )

    def record(self, key: str, server_round: int, score: float, weight: float = 1.0) -> None:
        """A reply's score for the ``patience`` schedule (higher is better), in round
        ``server_round`` >= 1."""
        self.patience.record(key, server_round, score, weight)

    def client_density(
        self, key: str | None, t: float, capacity: float, kind: str = "memory"
    ) -> float:
        """Density of client ``key`` at ``t``; on the ``patience`` schedule after the checks of
        rounds ``<= t``.

        A client new to the ``patience`` schedule (or whose capacity or kind changed) joins at its
        start density; ``key=None`` (a capacity level without a client) is at the start density.
        """
        if self.schedule != "patience":
            return self.density(t, capacity, kind)
        self.patience.advance(int(t))
        g0 = start_density(capacity, self.start, self.ceiling, kind)  # type: ignore[arg-type]
        if key is None:
            return g0
        entry, known = self.clients.get(key), self.patience.clients.get(key)
        if known is None or entry is None or entry.capacity != capacity or entry.kind != kind:
            self.patience.join(key, g0, end_density(capacity, self.ceiling, kind))  # type: ignore[arg-type]
        return self.patience.density(key)

    def _scores(
        self, key: str | None, x: NDArray, fisher: NDArray | None
    ) -> tuple[NDArray[np.float64], str]:
        if self.rule == "random":
            return random_priority(self.layout.size, self.seed, key or "capacity-level"), "random"
        if fisher is not None:
            return fisher_scores(fisher, x), "fisher"
        return magnitude_scores(x), "magnitude"  # no Fisher yet (first round): documented fallback

    def shared_ranking(self, t: float, x: NDArray) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
        """Scores and core of round ``int(t)``: ranked from ``x`` at the first request in that
        round, then kept.

        An earlier round than the current ranking's gets the current ranking (rankings only move
        forward).
        """
        r = int(t)
        if self.ranking is None or r > self.ranking[0]:
            previous = (
                self.ranking[3] if self.ranking is not None and self.rule == "delta" else None
            )
            x = np.asarray(x, dtype=np.float32)
            scores = shared_scores(x, self.costs, previous)
            self.ranking = (r, scores, magnitude_core(self.layout, x, self.min_density), x.copy())
        return self.ranking[1], self.ranking[2]

    def held_mask(self, capacity: float) -> NDArray[np.bool_] | None:
        """The current mask of a client of ``capacity`` (the smallest key, for determinism), if any.

        Central evaluation of a capacity level uses it: with per-client random
        priorities a fresh mask would be one no client ever trained. (Shared rules
        evaluate the held client's density in :meth:`mask` instead.)
        """
        keys = self.held_keys(capacity)
        return self.clients[keys[0]].mask if keys else None

    def held_keys(self, capacity: float) -> list[str]:
        """Keys of the clients of ``capacity``, sorted."""
        return sorted(k for k, c in self.clients.items() if c.capacity == capacity)

    def mask(
        self,
        key: str | None,
        t: float,
        capacity: float,
        x: NDArray,
        fisher: NDArray | None,
        kind: str = "memory",
    ) -> tuple[NDArray[np.bool_], str]:
        """The mask of client ``key`` at time ``t``.

        ``random`` and ``fisher``: it contains every earlier mask of that client. ``magnitude`` and
        ``delta``: the first ``k`` positions of round ``int(t)``'s shared order
        (:func:`shared_mask`), so the masks of one round nest across clients.

        ``key=None`` gives an un-remembered mask for a capacity level, used by central evaluation
        (shared rules: at the density of the level's first client, ``held``, if there is one).
        Asking again at the same or an earlier ``t`` returns the remembered mask unchanged. A client
        whose capacity changed (e.g. a restarted node with a smaller device) or capacity kind starts
        over, because its old mask may not fit any more.

        Parameters
        ----------
        key : str or None
            Stable client identity.
        t : float
            Rounds since the start of training (fractional in async mode).
        capacity : float
            The client's reported capacity, in (0, 1].
        x : NDArray
            Current global parameters (ranked by the ``magnitude``, ``delta`` and ``fisher`` rules).
        fisher : NDArray or None
            The client's Fisher estimate (``fisher`` rule), or ``None`` if none exists yet.
        kind : {"memory", "bandwidth"}
            What the client's capacity limits: ``memory`` caps the growth at ``capacity``.

        Returns
        -------
        tuple
            The mask and the rule that ranked it (``magnitude``, ``delta``, ``random``, ``fisher``),
            ``held`` for a level at a client's density, or ``kept`` when nothing changed.
        """
        prev = self.clients.get(key) if key is not None else None
        if prev is not None and (prev.capacity != capacity or prev.kind != kind):
            prev = None
        if prev is not None and t <= prev.t:
            return prev.mask, "kept"
        if self.shared:
            new, source = self._shared_rule_mask(key, t, capacity, x, kind)
        else:
            new, source = self._grown_mask(prev, key, t, capacity, x, fisher, kind)
        if key is not None:
            self.clients[key] = _ClientMask(capacity, kind, t, new)
        return new, source

    def _shared_rule_mask(
        self, key: str | None, t: float, capacity: float, x: NDArray, kind: str
    ) -> tuple[NDArray[np.bool_], str]:
        """:meth:`mask` under a shared rule: the first positions of round ``int(t)``'s shared order.

        Parameters
        ----------
        key : str or None
            Stable client identity; ``None`` for a capacity level (at the density of its first
            client, if it has one).
        t : float
            Rounds since the start of training.
        capacity : float
            The client's (or level's) capacity, in (0, 1].
        x : NDArray
            Current global parameters (ranked if round ``int(t)`` has no ranking yet).
        kind : {"memory", "bandwidth"}
            What the capacity limits.

        Returns
        -------
        tuple
            The mask and its source: the rule, or ``held`` for a level at a client's density.
        """
        source = self.rule
        if key is None:
            held = self.held_keys(capacity)
            if held:
                entry = self.clients[held[0]]
                density, source = self.client_density(held[0], t, capacity, entry.kind), "held"
            else:
                density = self.client_density(None, t, capacity, kind)
        else:
            density = self.client_density(key, t, capacity, kind)
        scores, core = self.shared_ranking(t, x)
        new = shared_mask(
            self.layout, budget(density, self.layout.size), scores, core, self.ranking[3]
        )
        return new, source

    def _grown_mask(
        self,
        prev: _ClientMask | None,
        key: str | None,
        t: float,
        capacity: float,
        x: NDArray,
        fisher: NDArray | None,
        kind: str,
    ) -> tuple[NDArray[np.bool_], str]:
        """:meth:`mask` under a per-client rule (``random``, ``fisher``): ``prev`` grown to the
        budget.

        Parameters
        ----------
        prev : _ClientMask or None
            The client's remembered mask, or ``None`` when it starts (over).
        key : str or None
            Stable client identity (``None``: a capacity level).
        t : float
            Rounds since the start of training.
        capacity : float
            The client's capacity, in (0, 1].
        x : NDArray
            Current global parameters.
        fisher : NDArray or None
            The client's Fisher estimate, or ``None`` if none exists yet.
        kind : {"memory", "bandwidth"}
            What the capacity limits.

        Returns
        -------
        tuple
            The mask and the rule that ranked it.
        """
        k = budget(self.client_density(key, t, capacity, kind), self.layout.size)
        scores, source = self._scores(key, x, fisher)
        if prev is None:
            forced = self.layout.always_kept | row_guard(scores, self.layout, self.min_per_row)
            new = restore_mask(None, k, scores, forced)
        else:
            # The first mask already holds the biases and a weight per row; re-guarding with
            # changed (Fisher) scores would add positions beyond the budget.
            new = restore_mask(prev.mask, k, scores)
        return new, source
