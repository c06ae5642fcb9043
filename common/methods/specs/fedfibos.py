"""FedFIbOS's keys (``fedfibos-*``, besides the shared ``fisher-*`` keys and mask guards).

The method: :mod:`common.methods.fedfibos`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from common.config.schema import Schema
from common.methods.specs.fisher import FisherRankedSpec

if TYPE_CHECKING:
    from common.config.run import RunConfig


class FedFIbOSOptions(Schema):
    """FedFIbOS's own run-config keys (``fedfibos-*``)."""

    aggregation: Literal["holders", "participants"] = Field(
        "participants",
        description="holders: example-weighted mean over the clients that held each position; participants: "
        "`sum_n w_n M_j delta_j / sum_n w_n` over all the round's clients, so a position few clients held "
        "moves by their share",
    )


class FedFIbOSSpec(FisherRankedSpec):
    """Fisher-ranked element-wise submodels (this product's method)."""

    name = "fedfibos"
    summary = (
        "top-`ceil(gamma d)` of `F_j^2 x_j^2`, `F` the client's Fisher measured at the current global model "
        "(refreshed every `fisher-every` rounds, the mask held in between; this product's method)"
    )
    options = FedFIbOSOptions
    options_prefix = "fedfibos-"
    implementation = "common.methods.fedfibos:FedFIbOS"

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Always: the mask is ranked by the client's Fisher."""
        return True
