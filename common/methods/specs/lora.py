"""The LoRA method's keys (``lora-*``) and its rules across keys; the method:
:mod:`common.methods.lora`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from common.config.schema import Schema
from common.methods.specs.fisher import FISHER_KEYS, MASK_GUARD_KEYS, FisherRankedSpec
from common.submodels.lora_ranks import LORA_AGGREGATIONS, LORA_ALLOCATIONS

if TYPE_CHECKING:
    from common.config.run import RunConfig


class LoRAOptions(Schema):
    """Keys of ``method = "lora"`` (prefix ``lora-``)."""

    max_rank: int = Field(
        8,
        ge=1,
        le=4096,
        description="rank of a capacity-1 client's adapters; a client of capacity `gamma` gets "
        "`ceil(gamma r)` per adapted layer (at least 1); at most the smaller dimension of every "
        "adapted layer",
    )
    alpha: float = Field(
        16.0,
        gt=0,
        le=1e6,
        description="LoRA alpha: every adapter is scaled by `alpha / lora-max-rank`, whatever its "
        "rank",
    )
    aggregation: Literal[LORA_AGGREGATIONS] = Field(  # type: ignore[valid-type]
        "svd",
        description="adapters of mixed ranks: `svd` = FlexLoRA (mean of the clients' products "
        "`B A`, truncated SVD back to factors, sorted by singular value); `zero-pad` = HetLoRA "
        "(factors padded to the largest rank, example-weighted mean over all clients); `holders` = "
        "per-entry mean over the clients that held it",
    )
    allocation: Literal[LORA_ALLOCATIONS] = Field(  # type: ignore[valid-type]
        "uniform",
        description="a client's rank per layer: `uniform` (the same in every layer) or `fisher` "
        "(the same total split across layers in proportion to each layer's Fisher mass on the "
        "client's data; uploads the Fisher of the factors in `fisher-encoding`)",
    )


class LoRASpec(FisherRankedSpec):
    """LoRA adapters of capacity-proportional rank on a frozen pretrained model."""

    name = "lora"
    meta_learning_wraps = (
        False  # its local training gathers gradient statistics (its reply's scores / moments)
    )
    summary = (
        "LoRA adapters of rank `ceil(gamma lora-max-rank)` per adapted layer (uniform, or split "
        "across layers by Fisher mass) on the frozen pretrained model of `model-path`, which is "
        "never sent; mixed ranks aggregated by FlexLoRA's SVD redistribution or HetLoRA's "
        "zero-padding"
    )
    options = LoRAOptions
    options_prefix = "lora-"
    # Its Fisher is of the adapters' factors, measured along training: no per-example bound, so no
    # `dp-*`; its SVD redistribution is not a per-position mean, so no `robust-*`.
    shared_key_groups = (FISHER_KEYS, MASK_GUARD_KEYS)
    implementation = "common.methods.lora:LoRA"
    #: Not per cluster: its nodes train adapters of different ranks, whose updates are not
    #: comparable signatures.
    clusters = False

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """Adapters need a pretrained model to adapt; their Fisher is measured along training
        only."""
        if run.model != "hf":
            raise ValueError(
                "method='lora' adapts a pretrained model: set model='hf' and model-path (not "
                f"{run.model!r})"
            )
        # Only the Fisher allocation measures anything; uniform ranks ignore the fisher-* keys like
        # fedavg does.
        estimator = run.options("fisher").estimator
        if cls.reads_fisher(run) and estimator != "path":
            raise ValueError(
                f"fisher-estimator={estimator!r}: lora-allocation='fisher' measures the Fisher of "
                "the adapters along local training (set fisher-estimator='path', and "
                "fisher-encoding='masked' to keep each layer's Fisher mass exact)"
            )

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Only the Fisher allocation reads the clients' Fisher."""
        return run.options(cls.name).allocation == "fisher"
