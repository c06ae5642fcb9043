"""FIARSE's keys (``fiarse-*``); the method: :mod:`common.methods.fiarse`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.schema import Schema
from common.methods.contract.spec import MethodSpec
from common.methods.specs.privacy import PRIVACY_KEYS
from common.methods.specs.robust import ROBUST_KEYS


class FIARSEOptions(Schema):
    """FIARSE's own run-config keys (``fiarse-*``)."""

    surrogate: bool = Field(
        False,
        description="train through the threshold with the surrogate gradient "
        "`2 theta / (|w| + theta)^2` (the paper's text); false: the plain masked gradient "
        "`1[|w| >= theta] g` (the published code, whose bool-valued `Bern` autograd never "
        "differentiates)",
    )
    aggregation: Literal["nonzero", "holders"] = Field(
        "nonzero",
        description="nonzero: `sum delta / count(delta != 0)`, unweighted; holders: "
        "example-weighted mean over holders",
    )


class FIARSESpec(MethodSpec):
    """Threshold submodels, in-round re-masking, non-zero-count aggregation."""

    name = "fiarse"
    summary = (
        "every weight with `|x_j| >= theta`, `theta` the `floor(gamma n)`-th largest magnitude; "
        "the mask follows the weights inside the round (FIARSE's threshold rule)"
    )
    options = FIARSEOptions
    options_prefix = "fiarse-"
    shared_key_groups = (PRIVACY_KEYS, ROBUST_KEYS)
    implementation = "common.methods.fiarse:FIARSE"
