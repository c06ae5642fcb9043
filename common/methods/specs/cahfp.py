"""CA-HFP's keys (``cahfp-*``); the method: :mod:`common.methods.cahfp`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.schema import Schema
from common.methods.specs.channels import ChannelSpec


class CAHFPOptions(Schema):
    """CA-HFP's own run-config keys (``cahfp-*``)."""

    scores: Literal["client", "pooled"] = Field(
        "client",
        description="whose channel scores rank a client's channels: client (its own, per-client "
        "masks) or pooled (one example-weighted state for all clients)",
    )
    aggregation: Literal["fedavg", "holders"] = Field(
        "fedavg",
        description="fedavg: FedAvg over the reconstructed models (`x + sum_k p_k M_k delta_k`, "
        "`sum p_k = 1`); holders: mean over the clients that held each position",
    )
    score_memory_mb: float = Field(
        64.0,
        ge=0.001,
        le=10_000_000,
        description="budget for per-client channel scores; beyond it the least recent client is "
        "evicted and ranks by the pooled scores",
    )


class CAHFPSpec(ChannelSpec):
    """Curvature-aware structured pruning with physically smaller client models."""

    name = "cahfp"
    meta_learning_wraps = (
        False  # its local training gathers gradient statistics (its reply's scores / moments)
    )
    summary = (
        "CA-HFP: a physically smaller model, the top `ceil(r c)` channels of each channel group by "
        "the client's own curvature score `|sum g w| + sum h w^2`, `r = sqrt(gamma)`; "
        "reconstructed into the full shape on the server, then FedAvg over the reconstructed "
        "models (`docs/design/cahfp.md`)"
    )
    options = CAHFPOptions
    options_prefix = "cahfp-"
    implementation = "common.methods.cahfp:CAHFP"
    #: Not per cluster: its replies are small models, not updates at positions of the global
    #: vector, so they give no signature.
    clusters = False
