"""HeteroFL's spec, and the published elements it shares with FedRolex (``width-*``).

Their rules are HeteroFL's :meth:`HeteroFLSpec.check_run`.

What each element does in training and aggregation: :mod:`common.methods.heterofl` and
:mod:`common.methods.fedrolex` (whose spec, :mod:`common.methods.specs.fedrolex`, extends this one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from common.config.schema import KeyGroup, Schema
from common.methods.specs.channels import ChannelSpec
from common.methods.specs.privacy import PRIVACY_KEYS
from common.methods.specs.robust import ROBUST_KEYS

if TYPE_CHECKING:
    from common.config.run import RunConfig


class WidthOptions(Schema):
    """The published elements of the two width methods (``width-*``), each with the published
    default."""

    scaler: bool = Field(
        True,
        description="in local training divide each convolution's output by the submodel's width "
        "rate (published `scale: 1`); identity in evaluation",
    )
    scaler_linear: bool = Field(
        False,
        description="with the scaler, also divide the hidden linear layer's output (`fc1` of the "
        "CNNs, no norm after it) by the width rate; the published convolutional model scales its "
        "conv blocks only",
    )
    label_split: bool = Field(
        True,
        description="average each classifier row only over the nodes that hold its class (nodes "
        "report their classes)",
    )
    weighting: Literal["auto", "uniform", "examples", "avg"] = Field(
        "auto",
        description="aggregation weight of a node: uniform (HeteroFL's published `combine`: every "
        "node counts once), its training examples, or avg (FedRolex's published `--weighting avg`: "
        "hidden weights count once, classifier entries and 1-D tensors weigh their running update "
        "count, which grows with each node already added in the round; `fedrolex` only); `auto`: "
        "uniform for `heterofl`, avg for `fedrolex`",
    )
    roll: Literal["down", "up"] = Field(
        "down",
        description="`fedrolex`'s window direction: down (published "
        "`torch.roll(arange(c), t)[:k]`, t = round - 1: round 1 keeps the first channels, then the "
        "window moves one channel down each round) or up (starts `round mod c` channels in and "
        "moves up)",
    )


WIDTH_KEYS = KeyGroup("width", "width-", WidthOptions, "Width methods: published elements")


class HeteroFLSpec(ChannelSpec):
    """First-channels width submodels."""

    name = "heterofl"
    summary = (
        "the first `ceil(r c)` channels of every hidden layer, `r = sqrt(gamma)`, with HeteroFL's "
        "scaler, masked cross-entropy and label-split classifier aggregation"
    )
    shared_key_groups = (WIDTH_KEYS, PRIVACY_KEYS, ROBUST_KEYS)
    #: The aggregation weighting ``width-weighting = "auto"`` stands for.
    default_weighting: ClassVar[str] = "uniform"
    implementation = "common.methods.heterofl:HeteroFL"

    @classmethod
    def auto_settings(cls, run: RunConfig) -> dict[str, Any]:
        """The published local training clips each step's gradient at norm 1 and masks absent
        labels."""
        return {**super().auto_settings(run), "clip_grad_norm": 1.0, "label_mask": True}

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """``avg`` weighting is FedRolex's running update counts, which HeteroFL does not keep."""
        super().check_run(run)
        if run.options(WIDTH_KEYS.name).weighting == "avg" and cls.default_weighting != "avg":
            raise ValueError(
                f"width-weighting='avg' is FedRolex's running update counts, which {cls.name} does "
                "not keep (uniform or examples)"
            )
        if run.options(WIDTH_KEYS.name).label_split and run.options(PRIVACY_KEYS.name).enabled:
            raise ValueError(
                "width-label-split=true with dp-epsilon > 0: each node would upload which classes "
                "it holds, outside the privacy budget; set width-label-split = false"
            )
