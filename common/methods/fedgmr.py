"""FedGMR: submodels that grow over training toward ``gmr-ceiling``, optionally aggregated asynchronously.

Each client starts from a fraction ``gmr-start`` of its capacity (1: the capacity itself) and grows until
``gmr-ceiling`` (the full model by default) when its capacity is a bandwidth limit, or until
``min(gmr-ceiling, capacity)`` when it is a memory limit (``capacity-kind`` in the node config, else
``capacity-kind``). By default the published code's rules: a client steps up once its training loss has
not improved for ``gmr-patience`` rounds (``gmr-schedule = "patience"``, steps ``gmr-restore-step``), and
holds a per-tensor magnitude core (``gmr-min-density``) plus the positions of largest ``|x|`` in one
ranking shared by every client, so the submodels of a round nest (``gmr-selection = "magnitude"``,
:mod:`common.submodels.restoration`). The paper's text (a fixed ``linear`` or ``step`` schedule, ``random``
restoration) and a Fisher ranking are options. ``gmr-mode = "async"`` applies each reply on arrival,
weighted by staleness and mask overlap (:func:`common.aggregation.asynchronous.apply_async_update`; the loop is
:mod:`server.async_strategy`). Details and measurements: ``docs/FEDGMR.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING, getLogger
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from common.aggregation.asynchronous import AsyncStep, apply_async_update
from common.aggregation.masked import MaskedUpdate
from common.config.capacity import CAPACITY_KINDS
from common.config.schema import Schema
from common.methods.base import Accepted
from common.methods.masked import FisherRankedMethod
from common.models.layout import ParamLayout
from common.submodels.restoration import RESTORE_RULES, RESTORE_STEPS, SCHEDULES, RestorationMasks

if TYPE_CHECKING:
    from common.config.run import RunConfig

logger = getLogger("flwr")


class FedGMROptions(Schema):
    """FedGMR's own run-config keys (``gmr-*``)."""

    schedule: Literal[SCHEDULES] = Field(  # type: ignore[valid-type]
        "patience",
        description="when submodels grow: patience (the published code: a client steps up by `gmr-restore-step` "
        "once its training loss has not improved for `gmr-patience` rounds), or the paper's text: linear, or "
        "step (multiplied by `gmr-step-factor` at even intervals), both reaching the ceiling after "
        "`gmr-restore-rounds`",
    )
    start: float = Field(
        1.0,
        gt=0,
        le=1,
        description="start density as a fraction of the node's capacity (1: the capacity, as the published "
        "code; at least 1 % of the model)",
    )
    ceiling: float = Field(
        1.0,
        gt=0,
        le=1,
        description="density the submodels grow toward; never above the capacity of a `memory`-kind node",
    )
    patience: int = Field(
        5,
        ge=1,
        le=1_000_000,
        description="patience schedule: rounds (async: round equivalents) without improvement before a "
        "client steps up; the round's mean loss raises a floor under every client the same way",
    )
    restore_step: Literal[RESTORE_STEPS] = Field(  # type: ignore[valid-type]
        "ladder",
        description="patience schedule: a step goes to the next larger start density among the clients, "
        "else the full model (ladder, the published runs), or from d to d + min(d, 0.2) (capped-double)",
    )
    min_density: float = Field(
        0.02,
        ge=0,
        le=1,
        description="magnitude and delta selection: share of every weight tensor's largest magnitudes each "
        "submodel holds (at least one weight); patience schedule: the floor's start",
    )
    restore_rounds: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="linear and step schedules: rounds (async: applied updates / nodes) until the ceiling",
    )
    step_factor: float = Field(2.0, gt=1, le=1000, description="growth factor per step of the step schedule")
    selection: Literal[RESTORE_RULES] = Field(  # type: ignore[valid-type]
        "magnitude",
        description="which positions a submodel holds: magnitude (the published code: a per-tensor magnitude "
        "core, then the largest `|x|` in one ranking shared by all clients), delta (the same ranked by "
        "`|dx x|`), random (the paper's text: seeded per client) or fisher (`F^2 x^2`)",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync (rounds), or async (apply each reply on arrival, re-dispatch at once)"
    )
    staleness_exponent: float = Field(0.5, ge=0, le=10, description="async weight `(1 + overlap * staleness)^(-a)`")
    max_staleness: int = Field(
        10, ge=0, le=1_000_000, description="async: replies more than this many applied updates old are dropped"
    )
    eval_updates: int = Field(
        0, ge=0, le=1_000_000, description="async: central evaluation every N applied updates; 0 = once per node count"
    )


class FedGMR(FisherRankedMethod):
    """Gradual model restoration (synchronous rounds, or asynchronous with :mod:`server.async_strategy`)."""

    name = "fedgmr"
    bench_variants = ("capacity-kind=memory",)  # capacity-limited, beside the published bandwidth kind
    summary = (
        "a submodel that grows over training from `gmr-start * gamma` toward `gmr-ceiling` (bandwidth-limited "
        "nodes) or `min(gmr-ceiling, gamma)` (memory-limited; `capacity-kind`), stepping up when its loss stops "
        "improving; a per-tensor magnitude core plus the largest `|x|` of one ranking shared by all clients "
        "(nested); `gmr-mode='async'` applies each reply on arrival, weighted by staleness and mask overlap "
        "(FedGMR, `docs/FEDGMR.md`)"
    )
    options = FedGMROptions
    options_prefix = "gmr-"

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: FedGMROptions = run.options(self.name)
        self.kinds: dict[str, str] = {}  # capacity kind by client key, as the nodes reported it

    def describe(self) -> str:
        """Method, the Fisher settings, the default capacity kind, the schedule and the selection rule."""
        o = self.opts
        return (
            f"{super().describe()} capacity-kind={self.run.capacity_kind} schedule={o.schedule} selection={o.selection}"
        )

    def node_joined(self, key: str, info: Mapping[str, Any]) -> None:
        """Record the node's ``capacity-kind`` (an unknown value is logged and the run's default used)."""
        kind = info.get("capacity-kind")
        if kind is None:
            self.kinds.pop(key, None)
        elif kind in CAPACITY_KINDS:
            self.kinds[key] = str(kind)
        else:
            logger.log(WARNING, "client %s reports capacity-kind=%r; using %s", key, kind, self.run.capacity_kind)
            self.kinds.pop(key, None)

    def capacity_kind(self, key: str | None) -> str:
        """What the capacity of client ``key`` limits: its own report, else the run's ``capacity-kind``."""
        return self.kinds.get(key, self.run.capacity_kind) if key is not None else self.run.capacity_kind

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Only with ``gmr-selection = "fisher"``."""
        return run.options(cls.name).selection == "fisher"

    @classmethod
    def auto_settings(cls, run: RunConfig) -> dict[str, Any]:
        """The asynchronous loop steps 0.5 of each weighted reply, its long-standing default (docs/FEDGMR.md)."""
        settings = super().auto_settings(run)
        return {**settings, "server_lr": 0.5} if run.options(cls.name).mode == "async" else settings

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """An asynchronous run has no rounds to resume from, nor rounds to sample clients for."""
        if run.options(cls.name).mode == "async" and run.resume:
            raise ValueError(
                "resume=true: the asynchronous FedGMR loop (gmr-mode='async') has no rounds to resume from"
            )
        if run.options(cls.name).mode == "async" and run.fraction_train < 1:
            raise ValueError(
                f"fraction-train={run.fraction_train}: the asynchronous FedGMR loop (gmr-mode='async') sends work "
                "to every node as soon as it is free; partial participation applies to synchronous rounds"
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
            self.restoration.record(accepted.key, fisher_round, -r.metrics["train-loss"], r.update.weight)

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The client's restoration mask at ``server_round - 1`` rounds since the start."""
        return self.mask_at(key, max(0.0, server_round - 1.0), gamma, x)

    def mask_at(self, key: str | None, t: float, gamma: float, x: NDArray[np.float32]) -> tuple[NDArray[np.bool_], str]:
        """The client's restoration mask at time ``t`` (rounds since the start; fractional when asynchronous).

        For a capacity level (``key=None``) the current mask of a client of that capacity (``held``; shared
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
            fisher = self.fisher.estimate(key, fisher_round) if known else self.fisher.global_prior()
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
        """One reply applied on arrival, weighted by staleness and overlap; ``TooStale`` beyond the limit."""
        o = self.opts
        return apply_async_update(
            x, last_changed, version, update, sent_version, self.run.server_lr, o.staleness_exponent, o.max_staleness
        )
