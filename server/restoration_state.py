"""Per-client FedGMR restoration state on the server: each client's current, only-growing mask.

The budget and the nesting rule are the pure functions of
:mod:`common.restoration`; this class only remembers the last mask per client
key (stable across SuperNode restarts) so the next one can contain it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.config import RunConfig
from common.layout import ParamLayout
from common.restoration import random_priority, restoration_budget, restore_mask
from common.selection import budget, fisher_scores, magnitude_scores, row_guard


@dataclass
class _ClientMask:
    capacity: float
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

    @classmethod
    def from_config(cls, cfg: RunConfig, layout: ParamLayout) -> RestorationMasks:
        """The restoration state a run's ``gmr-*`` keys describe."""
        return cls(
            layout,
            cfg.gmr_schedule,
            cfg.gmr_start,
            cfg.gmr_ceiling,
            cfg.gmr_restore_rounds,
            cfg.gmr_step_factor,
            cfg.gmr_selection,
            cfg.seed,
            cfg.min_per_row,
        )

    def density(self, t: float, capacity: float) -> float:
        """Scheduled density at time ``t`` (rounds since the start) for a client of ``capacity``."""
        return restoration_budget(
            self.schedule, t, capacity, self.start, self.ceiling, self.restore_rounds, self.factor
        )  # type: ignore[arg-type]

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
        self, key: str | None, t: float, capacity: float, x: NDArray, fisher: NDArray | None
    ) -> tuple[NDArray[np.bool_], str]:
        """The mask of client ``key`` at time ``t``, containing every earlier mask of that client.

        ``key=None`` gives a fresh (un-remembered) mask for a capacity level, used
        by central evaluation. Asking again at the same or an earlier ``t`` returns
        the remembered mask unchanged. A client whose capacity changed (e.g. a
        restarted node with a smaller device) starts over, because its old mask
        may not fit any more.

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

        Returns
        -------
        tuple
            The mask and the rule that ranked the added positions (``random``,
            ``fisher`` or ``magnitude``), or ``kept`` when nothing changed.
        """
        prev = self.clients.get(key) if key is not None else None
        if prev is not None and prev.capacity != capacity:
            prev = None
        if prev is not None and t <= prev.t:
            return prev.mask, "kept"
        k = budget(self.density(t, capacity), self.layout.size)
        scores, source = self._scores(key, x, fisher)
        if prev is None:
            forced = self.layout.always_kept | row_guard(scores, self.layout, self.min_per_row)
            new = restore_mask(None, k, scores, forced)
        else:
            # The first mask already holds the biases and a weight per row; re-guarding with
            # changed (Fisher) scores would add positions beyond the budget.
            new = restore_mask(prev.mask, k, scores)
        if key is not None:
            self.clients[key] = _ClientMask(capacity, t, new)
        return new, source
