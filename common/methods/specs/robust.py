"""The run-config keys of robust aggregation (``robust-*``), shared by the element-wise methods.

What each rule computes: :mod:`common.aggregation.robust`. A rule other than ``mean`` replaces the
method's own mean (the holder mean, FIARSE's non-zero-count mean, FedRolex's count weights) and
buffers the round's updates, since a per-position median needs all of them at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from common.aggregation.robust import ROBUST_RULES
from common.config.schema import KeyGroup, Schema

if TYPE_CHECKING:
    from common.config.run import RunConfig


class RobustOptions(Schema):
    """Keys ``robust-*``: how the server bounds what one node's update can do."""

    aggregation: Literal[("mean", *ROBUST_RULES)] = Field(  # type: ignore[valid-type]
        "mean",
        description="`mean`: the method's own mean; `trimmed`: per position, a trimmed mean of the "
        "deltas of the nodes that hold it (`robust-trim` cut at each end; 0.5 = the median); "
        "`norm-clip`: every update scaled down to `robust-clip-factor` times the round's median "
        "update norm, then the holder mean (docs/design/privacy.md)",
    )
    trim: float = Field(
        0.2,
        ge=0,
        le=0.5,
        description='`robust-aggregation = "trimmed"`: share cut at each end of a position\'s '
        "holders",
    )
    clip_factor: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description='`robust-aggregation = "norm-clip"`: the largest update norm, in multiples of '
        "the round's median",
    )

    @property
    def active(self) -> bool:
        """Whether a robust rule replaces the method's own mean."""
        return self.aggregation != "mean"


ROBUST_KEYS = KeyGroup(
    "robust", "robust-", RobustOptions, "Robust aggregation against malicious updates"
)


def check_robust(run: RunConfig, owns_keys: bool, covered: list[str]) -> None:
    """Refuse a robust rule with a method whose updates it cannot aggregate, naming the key."""
    opts: RobustOptions = run.options(ROBUST_KEYS.name)
    if opts.active and not owns_keys:
        raise ValueError(
            f"robust-aggregation={opts.aggregation!r} is set, but method={run.method!r} does not "
            "aggregate masked "
            f'deltas (robust rules cover: {", ".join(covered)}); set robust-aggregation = "mean"'
        )
