"""The run-config keys the Fisher-ranked methods share, owned by them rather than by the common
schema.

``fisher-*``: how clients measure and upload their diagonal Fisher and how the server keeps it
(:mod:`common.fisher`); ``min-per-row`` and ``keep-vectors``: the guards of a Fisher-ranked mask. A
method that ranks by Fisher subclasses :class:`FisherRankedSpec`, which lists both groups.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.schema import KeyGroup, Schema
from common.fisher.codec import FISHER_ENCODINGS
from common.methods.contract.spec import MethodSpec
from common.methods.specs.privacy import PRIVACY_KEYS
from common.methods.specs.robust import ROBUST_KEYS


class FisherOptions(Schema):
    """Keys ``fisher-*``: the clients' Fisher estimate, its upload, and the server's state of it."""

    encoding: Literal[FISHER_ENCODINGS] = Field(  # type: ignore[valid-type]
        "ranked",
        description="uplink Fisher payload (methods that rank by Fisher): `ranked` sends the "
        "largest values over the whole model in the bytes `masked` would take "
        "(`docs/design/fisher.md`)",
    )
    estimator: Literal["global", "received", "path"] = Field(
        "global",
        description="where clients measure the Fisher a mask is ranked by: `global` averages "
        "squared per-example gradients at the full current global model (the definition; a client "
        "due for a refresh is also sent the values outside its mask, counted in its bytes down); "
        "`received` at the submodel it received, zeros included (masks then chase the layers they "
        "starve); `path` squares the minibatch gradients of local training (no extra cost)",
    )
    every: int = Field(
        5,
        ge=1,
        le=100_000,
        description='`fisher-estimator = "global"`: a client measures its Fisher again once its '
        "estimate is this "
        "many rounds old, and keeps its mask in between (1 = every round it trains)",
    )
    examples: int = Field(
        32,
        ge=0,
        le=1_000_000,
        description="examples in a per-example Fisher estimate (0 = all local examples)",
    )
    warmup: bool = Field(
        True,
        description="before round 1, every node that trains returns its Fisher at the initial "
        "model (no training), so round 1 is ranked by Fisher instead of by magnitude (with "
        "`global` it costs each node one download of the model; `fedfibos` with `global` sends it "
        "with the discovery message, so it costs no exchange of its own, the others one exchange); "
        "applies to methods that rank by Fisher with the `global` or `received` estimator, and to "
        "`fedfibos` only with `fedfibos-byte-budget = 0` (the whole model is beyond a small node's "
        "bytes)",
    )
    batches: int = Field(
        0, ge=0, le=1_000_000, description="training steps in the Fisher estimate (0 = all)"
    )
    ema: float = Field(
        0.5,
        ge=0,
        le=0.99,
        description="weight of a client's previous Fisher when it reports again (0 = the new "
        "estimate alone; 0.5 steadies a small client's mask across refreshes and raised its "
        "submodels, docs/design/fisher.md)",
    )
    staleness_decay: float = Field(
        0.7,
        ge=0,
        le=1,
        description="per-round trust in an aging client estimate (rest from the prior)",
    )
    trim: float = Field(
        0.1,
        ge=0,
        le=0.45,
        description="global prior = per-position trimmed mean over clients (share cut at each end, "
        "at least one once three clients reported); 0 = example-weighted mean, which one client "
        "can move without bound; 0.45 = the median, the smallest reach for one poisoning client",
    )
    precision: Literal["fp32", "fp16"] = Field(
        "fp32", description="storage of per-client Fisher on the server (fp16 halves it)"
    )
    memory_mb: float = Field(
        4096.0,
        ge=1,
        le=10_000_000,
        description="budget for per-client Fisher; beyond it the stalest clients are evicted and "
        "use the prior",
    )


class MaskGuardOptions(Schema):
    """Keys ``min-per-row``, ``keep-vectors``: positions a Fisher-ranked mask keeps whatever their
    score."""

    min_per_row: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="guard of Fisher-ranked masks: weights kept per output unit (0 = none, the "
        "definition's top-k; 1 moved nothing beyond the spread between seeds, "
        "docs/design/fisher.md)",
    )
    keep_vectors: bool = Field(
        False,
        description="guard of Fisher-ranked masks: every 1-D tensor that can learn (biases, norm "
        "scales) is kept and counted in the budget; `false` (the definition) ranks them like any "
        "weight. Biases that feed a BatchNorm cannot learn and are never selected below capacity 1",
    )


FISHER_KEYS = KeyGroup(
    "fisher", "fisher-", FisherOptions, "Fisher-ranked methods: the clients' Fisher"
)
MASK_GUARD_KEYS = KeyGroup(
    "mask-guards", "", MaskGuardOptions, "Fisher-ranked methods: guards of the mask"
)


class FisherRankedSpec(MethodSpec):
    """A method that keeps per-client Fisher on the server: it owns the ``fisher-*`` keys and the
    mask guards."""

    shared_key_groups = (FISHER_KEYS, MASK_GUARD_KEYS, PRIVACY_KEYS, ROBUST_KEYS)
