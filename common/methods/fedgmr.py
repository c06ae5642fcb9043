"""FedGMR: submodels that grow over training toward ``gmr-ceiling``, optionally aggregated
asynchronously.

Each client starts from a fraction ``gmr-start`` of its capacity (1: the capacity itself) and grows
until ``gmr-ceiling`` (the full model by default) when its capacity is a bandwidth limit, or until
``min(gmr-ceiling, capacity)`` when it is a memory limit (``capacity-kind`` in the node config, else
``capacity-kind``). By default the published code's rules: a client steps up once its training loss
has not improved for ``gmr-patience`` rounds (``gmr-schedule = "patience"``, steps
``gmr-restore-step``), and holds a per-tensor magnitude core (``gmr-min-density``) plus the
positions of largest ``|x|`` in one ranking shared by every client, so the submodels of a round nest
(``gmr-selection = "magnitude"``, :mod:`common.submodels.restoration`). The paper's text (a fixed
``linear`` or ``step`` schedule, ``random`` restoration) and a Fisher ranking are options.
``gmr-mode = "async"`` applies each reply on arrival, weighted by staleness and mask overlap
(:func:`common.aggregation.asynchronous.apply_async_update`; the loop is
:mod:`server.async_strategy`). Details and measurements: ``docs/design/fedgmr.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING, getLogger
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from common.aggregation.asynchronous import AsyncStep, apply_async_update
from common.aggregation.masked import MaskedUpdate
from common.config.capacity import CAPACITY_KINDS
from common.methods.masked import FisherRankedMethod
from common.methods.round_fold import Accepted
from common.methods.specs.fedgmr import FedGMROptions, FedGMRSpec
from common.models.layout import ParamLayout
from common.submodels.restoration import RestorationMasks

if TYPE_CHECKING:
    from common.config.run import RunConfig

logger = getLogger("flwr")


class FedGMR(FedGMRSpec, FisherRankedMethod):
    """Gradual model restoration (synchronous rounds, or asynchronous with
    :mod:`server.async_strategy`)."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: FedGMROptions = run.options(self.name)
        self.kinds: dict[str, str] = {}  # capacity kind by client key, as the nodes reported it

    def describe(self) -> str:
        """Method, the Fisher settings, the default capacity kind, the schedule and the selection
        rule."""
        o = self.opts
        return (
            f"{super().describe()} capacity-kind={self.run.capacity_kind} schedule={o.schedule} "
            f"selection={o.selection}"
        )

    def node_joined(self, key: str, info: Mapping[str, Any]) -> None:
        """Record the node's ``capacity-kind`` (an unknown value is logged and the run's default
        used)."""
        kind = info.get("capacity-kind")
        if kind is None:
            self.kinds.pop(key, None)
        elif kind in CAPACITY_KINDS:
            self.kinds[key] = str(kind)
        else:
            logger.log(
                WARNING,
                "client %s reports capacity-kind=%r; using %s",
                key,
                kind,
                self.run.capacity_kind,
            )
            self.kinds.pop(key, None)

    def capacity_kind(self, key: str | None) -> str:
        """What the capacity of client ``key`` limits: its own report, else the run's
        ``capacity-kind``."""
        return (
            self.kinds.get(key, self.run.capacity_kind)
            if key is not None
            else self.run.capacity_kind
        )

    @property
    def asynchronous(self) -> bool:
        """``gmr-mode = "async"``."""
        return self.opts.mode == "async"

    def start_server(self, layout: ParamLayout) -> None:
        """Fisher state and the per-client restoration masks."""
        super().start_server(layout)
        o = self.opts
        self.restoration = RestorationMasks(
            layout,
            o.schedule,
            o.start,
            o.ceiling,
            o.restore_rounds,
            o.step_factor,
            o.selection,
            self.run.seed,
            self.guards.min_per_row,
            o.patience,
            o.restore_step,
            o.min_density,
        )

    def observe(self, accepted: Accepted, fisher_round: int) -> None:
        """Fisher (``fisher`` rule), and the reply's training loss for the ``patience`` schedule.

        The score is ``-train-loss`` (the mean loss of the client's local training), weighted by the
        reply's examples in the round's mean; round 0 (a Fisher warm-up) is not a training round.
        """
        super().observe(accepted, fisher_round)
        if fisher_round >= 1:
            r = accepted.reply
            self.restoration.record(
                accepted.key, fisher_round, -r.metrics["train-loss"], r.update.weight
            )

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The client's restoration mask at ``server_round - 1`` rounds since the start."""
        return self.mask_at(key, max(0.0, server_round - 1.0), gamma, x)

    def mask_at(
        self, key: str | None, t: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The client's restoration mask at time ``t`` (rounds since the start; fractional when
        asynchronous).

        For a capacity level (``key=None``) the current mask of a client of that capacity (``held``;
        shared
        rankings: that client's density under the current ranking), so central evaluation measures a
        submodel some client trains; a fresh one if there is none.
        """
        if key is None and not self.restoration.shared:
            held = self.restoration.held_mask(gamma)
            if held is not None:
                return held, "held"
        fisher = None
        if self.opts.selection == "fisher":
            fisher_round = int(t) + 1
            known = key is not None and key in self.fisher.clients
            fisher = (
                self.fisher.estimate(key, fisher_round) if known else self.fisher.global_prior()
            )
        return self.restoration.mask(key, t, gamma, x, fisher, self.capacity_kind(key))

    def eval_updates(self) -> int:
        """``gmr-eval-updates``."""
        return self.opts.eval_updates

    def apply_async(
        self,
        x: NDArray[np.float32],
        last_changed: NDArray[np.int64],
        version: int,
        update: MaskedUpdate,
        sent_version: int,
    ) -> AsyncStep:
        """One reply applied on arrival, weighted by staleness and overlap; ``TooStale`` beyond the
        limit."""
        o = self.opts
        return apply_async_update(
            x,
            last_changed,
            version,
            update,
            sent_version,
            self.run.server_lr,
            o.staleness_exponent,
            o.max_staleness,
        )
