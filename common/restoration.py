"""FedGMR gradual model restoration: how large each client's submodel is over time, and what it adds.

A client of capacity ``c`` (the fraction of the global model it reported) starts
small and its submodel *grows*; it never shrinks. How far depends on what the
capacity limits (``capacity-kind``):

* ``bandwidth`` (FedGMR's setting: slow links, not small memories): the submodel
  grows toward ``ceiling`` (the full model by default), whatever ``c`` is;
* ``memory``: ``c`` is a hard cap, the submodel grows toward ``min(ceiling, c)``.

Semantics chosen here (the paper gives the idea but no formula):

* start density ``g0 = min(g_end, max(MIN_DENSITY, start * c))``, end density
  ``g_end = ceiling`` (bandwidth) or ``min(ceiling, c)`` (memory);
* the clock ``t >= 0`` counts rounds since the start (sync: ``round - 1``;
  async: applied updates divided by the number of nodes, a fractional
  "round equivalent");
* ``linear``: ``g(t) = g0 + (g_end - g0) * min(1, t / T)`` with ``T`` =
  ``restore_rounds``;
* ``step``: the density is multiplied by ``factor`` at ``n`` evenly spaced
  moments, ``n = ceil(log(g_end / g0) / log(factor))`` steps spread over ``T``
  rounds: ``g(t) = min(g_end, g0 * factor ** floor(n * min(t, T) / T))``.

Both reach ``g_end`` exactly at ``t = T`` and stay there.

Which parameters are restored next is a *rule* over a per-position score; the
new mask always contains the previous one (restoration only adds):

* ``random``: a fixed, seeded random priority per (run seed, client) -- the
  paper's random un-masking, deterministic so a restarted server re-derives it;
* ``fisher``: ``F_j^2 x_j^2`` as in :mod:`common.selection` (FedFIbOS ranking),
  using the server's current Fisher estimate for that client.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.layout import ParamLayout
from common.selection import budget, fisher_scores, magnitude_scores, row_guard, topk_mask

Schedule = Literal["linear", "step"]
SCHEDULES: tuple[str, ...] = ("linear", "step")
CapacityKind = Literal["bandwidth", "memory"]
CAPACITY_KINDS: tuple[str, ...] = ("bandwidth", "memory")
RESTORE_RULES: tuple[str, ...] = ("random", "fisher")

# Smallest start density: below ~1 % a CNN submodel cannot learn anything useful, and every
# client must hold at least a sliver of the model from the first round.
MIN_DENSITY = 0.01


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
    """Density (fraction of ``d``) a client holds at time ``t``.

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
        Density the schedule grows toward, in (0, 1] (clipped to ``capacity`` when ``kind = "memory"``).
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
    if not 0 < capacity <= 1 or not 0 < start <= 1 or not 0 < ceiling <= 1:
        raise ValueError(f"capacity, start and ceiling must be in (0, 1], got {capacity}, {start}, {ceiling}")
    if restore_rounds < 1:
        raise ValueError(f"restore_rounds must be >= 1, got {restore_rounds}")
    if not t >= 0:
        raise ValueError(f"t must be >= 0, got {t}")
    if kind not in CAPACITY_KINDS:
        raise ValueError(f"unknown capacity kind {kind!r}; expected one of {CAPACITY_KINDS}")
    end = ceiling if kind == "bandwidth" else min(ceiling, capacity)
    g0 = min(end, max(MIN_DENSITY, start * capacity))
    progress = min(1.0, t / restore_rounds)
    if schedule == "linear":
        # Exactly ``end`` once restored: g0 + (end - g0) * 1.0 can round a hair off it.
        return end if progress >= 1.0 else min(end, g0 + (end - g0) * progress)
    if schedule == "step":
        if not factor > 1:
            raise ValueError(f"step factor must be > 1, got {factor}")
        if g0 >= end:
            return end
        steps = math.ceil(math.log(end / g0) / math.log(factor) - 1e-12)
        # A tiny epsilon keeps t = T (progress 1.0) at the last step despite float error.
        done = math.floor(steps * progress + 1e-9)
        return end if done >= steps else min(end, g0 * factor**done)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


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
        Budget schedule (see :func:`common.restoration.restoration_budget`).
    rule : {"random", "fisher"}
        Which positions are restored next.
    seed : int
        Run seed (the ``random`` rule's per-client order derives from it).
    min_per_row : int
        Guard of :mod:`common.selection`: positions every output unit keeps.
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
    ) -> None:
        self.layout = layout
        self.schedule = schedule
        self.start = start
        self.ceiling = ceiling
        self.restore_rounds = restore_rounds
        self.factor = factor
        self.rule = rule
        self.seed = seed
        self.min_per_row = min_per_row
        self.clients: dict[str, _ClientMask] = {}

    def density(self, t: float, capacity: float, kind: str = "memory") -> float:
        """Scheduled density at time ``t`` (rounds since the start) for a client of ``capacity`` and ``kind``."""
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

    def _scores(self, key: str | None, x: NDArray, fisher: NDArray | None) -> tuple[NDArray[np.float64], str]:
        if self.rule == "random":
            return random_priority(self.layout.size, self.seed, key or "capacity-level"), "random"
        if fisher is not None:
            return fisher_scores(fisher, x), "fisher"
        return magnitude_scores(x), "magnitude"  # no Fisher yet (first round): documented fallback

    def held_mask(self, capacity: float) -> NDArray[np.bool_] | None:
        """The current mask of a client of ``capacity`` (the smallest key, for determinism), if any.

        Central evaluation of a capacity level uses it: with per-client random
        priorities a fresh mask would be one no client ever trained.
        """
        keys = sorted(k for k, c in self.clients.items() if c.capacity == capacity)
        return self.clients[keys[0]].mask if keys else None

    def mask(
        self,
        key: str | None,
        t: float,
        capacity: float,
        x: NDArray,
        fisher: NDArray | None,
        kind: str = "memory",
    ) -> tuple[NDArray[np.bool_], str]:
        """The mask of client ``key`` at time ``t``, containing every earlier mask of that client.

        ``key=None`` gives a fresh (un-remembered) mask for a capacity level, used
        by central evaluation. Asking again at the same or an earlier ``t`` returns
        the remembered mask unchanged. A client whose capacity changed (e.g. a
        restarted node with a smaller device) or capacity kind starts over, because
        its old mask may not fit any more.

        Parameters
        ----------
        key : str or None
            Stable client identity.
        t : float
            Rounds since the start of training (fractional in async mode).
        capacity : float
            The client's reported capacity, in (0, 1].
        x : NDArray
            Current global parameters (the ``fisher`` rule ranks by ``F^2 x^2``).
        fisher : NDArray or None
            The client's Fisher estimate (``fisher`` rule), or ``None`` if none exists yet.
        kind : {"memory", "bandwidth"}
            What the client's capacity limits: ``memory`` caps the growth at ``capacity``.

        Returns
        -------
        tuple
            The mask and the rule that ranked the added positions (``random``,
            ``fisher`` or ``magnitude``), or ``kept`` when nothing changed.
        """
        prev = self.clients.get(key) if key is not None else None
        if prev is not None and (prev.capacity != capacity or prev.kind != kind):
            prev = None
        if prev is not None and t <= prev.t:
            return prev.mask, "kept"
        k = budget(self.density(t, capacity, kind), self.layout.size)
        scores, source = self._scores(key, x, fisher)
        if prev is None:
            forced = self.layout.always_kept | row_guard(scores, self.layout, self.min_per_row)
            new = restore_mask(None, k, scores, forced)
        else:
            # The first mask already holds the biases and a weight per row; re-guarding with
            # changed (Fisher) scores would add positions beyond the budget.
            new = restore_mask(prev.mask, k, scores)
        if key is not None:
            self.clients[key] = _ClientMask(capacity, kind, t, new)
        return new, source
