"""FedGMR's keys (``gmr-*``) and its rules across keys; the method: :mod:`common.methods.fedgmr`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from common.config.schema import Schema
from common.methods.specs.fisher import FisherRankedSpec
from common.submodels.restoration import RESTORE_RULES, RESTORE_STEPS, SCHEDULES

if TYPE_CHECKING:
    from common.config.run import RunConfig


class FedGMROptions(Schema):
    """FedGMR's own run-config keys (``gmr-*``)."""

    schedule: Literal[SCHEDULES] = Field(  # type: ignore[valid-type]
        "patience",
        description="when submodels grow: patience (the published code: a client steps up by "
        "`gmr-restore-step` once its training loss has not improved for `gmr-patience` rounds), or "
        "the paper's text: linear, or step (multiplied by `gmr-step-factor` at even intervals), "
        "both reaching the ceiling after `gmr-restore-rounds`",
    )
    start: float = Field(
        1.0,
        gt=0,
        le=1,
        description="start density as a fraction of the node's capacity (1: the capacity, as the "
        "published code; at least 1 % of the model)",
    )
    ceiling: float = Field(
        1.0,
        gt=0,
        le=1,
        description="density the submodels grow toward; never above the capacity of a "
        "`memory`-kind node",
    )
    patience: int = Field(
        5,
        ge=1,
        le=1_000_000,
        description="patience schedule: rounds (async: round equivalents) without improvement "
        "before a client steps up; the round's mean loss raises a floor under every client the "
        "same way",
    )
    restore_step: Literal[RESTORE_STEPS] = Field(  # type: ignore[valid-type]
        "ladder",
        description="patience schedule: a step goes to the next larger start density among the "
        "clients, else the full model (ladder, the published runs), or from d to d + min(d, 0.2) "
        "(capped-double)",
    )
    min_density: float = Field(
        0.02,
        ge=0,
        le=1,
        description="magnitude and delta selection: share of every weight tensor's largest "
        "magnitudes each submodel holds (at least one weight); patience schedule: the floor's "
        "start",
    )
    restore_rounds: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="linear and step schedules: rounds (async: applied updates / nodes) until the "
        "ceiling",
    )
    step_factor: float = Field(
        2.0, gt=1, le=1000, description="growth factor per step of the step schedule"
    )
    selection: Literal[RESTORE_RULES] = Field(  # type: ignore[valid-type]
        "magnitude",
        description="which positions a submodel holds: magnitude (the published code: a per-tensor "
        "magnitude core, then the largest `|x|` in one ranking shared by all clients), delta (the "
        "same ranked by `|dx x|`), random (the paper's text: seeded per client) or fisher "
        "(`F^2 x^2`)",
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync (rounds), or async (apply each reply on arrival, re-dispatch at once)",
    )
    staleness_exponent: float = Field(
        0.5, ge=0, le=10, description="async weight `(1 + overlap * staleness)^(-a)`"
    )
    max_staleness: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description="async: replies more than this many applied updates old are dropped",
    )
    eval_updates: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="async: central evaluation every N applied updates; 0 = once per node count",
    )


class FedGMRSpec(FisherRankedSpec):
    """Gradual model restoration (synchronous rounds, or asynchronous with
    :mod:`server.async_strategy`)."""

    name = "fedgmr"
    bench_variants = (
        "capacity-kind=memory",
    )  # capacity-limited, beside the published bandwidth kind
    summary = (
        "a submodel that grows over training from `gmr-start * gamma` toward `gmr-ceiling` "
        "(bandwidth-limited nodes) or `min(gmr-ceiling, gamma)` (memory-limited; `capacity-kind`), "
        "stepping up when its loss stops improving; a per-tensor magnitude core plus the largest "
        "`|x|` of one ranking shared by all clients (nested); `gmr-mode='async'` applies each "
        "reply on arrival, weighted by staleness and mask overlap (FedGMR, `docs/design/fedgmr.md`)"
    )
    options = FedGMROptions
    options_prefix = "gmr-"
    implementation = "common.methods.fedgmr:FedGMR"
    #: Not per cluster: each node's capacity kind, told at discovery, is not in the checkpoint
    #: state a cluster's copy is made from (and its asynchronous loop has no rounds to cluster).
    clusters = False

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Only with ``gmr-selection = "fisher"``."""
        return run.options(cls.name).selection == "fisher"

    @classmethod
    def auto_settings(cls, run: RunConfig) -> dict[str, Any]:
        """The asynchronous loop steps 0.5 of each weighted reply, its long-standing default
        (docs/design/fedgmr.md)."""
        settings = super().auto_settings(run)
        return {**settings, "server_lr": 0.5} if run.options(cls.name).mode == "async" else settings

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """An asynchronous run has no rounds to resume from, nor rounds to sample clients for."""
        if run.options(cls.name).mode == "async" and run.resume:
            raise ValueError(
                "resume=true: the asynchronous FedGMR loop (gmr-mode='async') has no rounds to "
                "resume from"
            )
        if run.options(cls.name).mode == "async" and run.fraction_train < 1:
            raise ValueError(
                f"fraction-train={run.fraction_train}: the asynchronous FedGMR loop "
                "(gmr-mode='async') sends work to every node as soon as it is free; partial "
                "participation applies to synchronous rounds"
            )
