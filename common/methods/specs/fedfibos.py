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
        description="holders: example-weighted mean over the clients that held each position; "
        "participants: `sum_n w_n M_j delta_j / sum_n w_n` over all the round's clients, so a "
        "position few clients held moves by their share",
    )
    byte_budget: float = Field(
        1.05,
        ge=0,
        le=1000,
        description="a client's bytes down, and its bytes up, over the rounds it trains, at most "
        "this multiple of its submodels' bytes (values and mask); a Fisher refresh (the rest of "
        "the model down, the Fisher up) is sent only when it fits, the Fisher payload capped to "
        "what is left, and a client that cannot afford one is ranked by the prior of those that "
        "could. The warm-up, which sends every node the whole model before its capacity is known, "
        "is then not run. 1.05 leaves room for message headers within the 1.1x that counts as "
        "within capacity; 0 = no limit, the definition as first built: every client is sent the "
        "rest of the model every `fisher-every` rounds and the warm-up (a 1/64 client then moves "
        "about 10x its share, docs/design/fisher.md)",
    )
    fisher_power: float = Field(
        1.0,
        ge=0,
        le=4,
        description="rank by `F^a x^2` with this `a`: 2 = the definition's `F^2 x^2` (the gradient "
        "mismatch), 1 = `F x^2` (the second-order loss change; under the byte budget it gave the "
        "small clients better submodels on seeds no reported table uses, docs/design/fisher.md), 0 "
        "= magnitude alone: no node is asked for a Fisher (what `dp-epsilon` can afford, "
        "docs/design/privacy.md)",
    )
    hold_prior_masks: bool = Field(
        False,
        description="a client ranked by the prior keeps its mask until the prior changes (the next "
        "upload of a client that could afford a refresh), as a client ranked by its own estimate "
        "keeps its mask until its next refresh; false: a prior-ranked mask follows the global "
        "values every round",
    )


class FedFIbOSSpec(FisherRankedSpec):
    """Fisher-ranked element-wise submodels (this product's method)."""

    name = "fedfibos"
    summary = (
        "top-`ceil(gamma d)` of `F_j x_j^2` (`fedfibos-fisher-power = 2`: the definition's "
        "`F_j^2 x_j^2`), `F` the client's Fisher measured at the current global model (refreshed "
        "every `fisher-every` rounds where its byte budget affords the rest of the model, the mask "
        "held in between; a client that cannot afford it is ranked by the pooled Fisher of those "
        "that can; this product's method)"
    )
    options = FedFIbOSOptions
    options_prefix = "fedfibos-"
    implementation = "common.methods.fedfibos:FedFIbOS"

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Unless ``fedfibos-fisher-power = 0``: ``F^0 x^2`` is magnitude alone, so nothing a node
        measures enters its mask, and it is asked for no Fisher (no warm-up, no refreshes: no
        bytes, no seconds and, under ``dp-epsilon``, no share of the privacy budget spent on it)."""
        opts = run.options(cls.name)
        return opts is None or opts.fisher_power > 0
