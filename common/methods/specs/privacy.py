"""The run-config keys of differential privacy (``dp-*``), shared by the methods whose uploads it
covers.

A method is covered when its reply is the delta of the positions the node trains with the one local
training loop (every element-wise method: the loop's steps then run DP-SGD) and, where it reads a
Fisher, that Fisher is a per-example estimate (``fisher-estimator`` ``global`` or ``received``).
:func:`check_privacy` refuses the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from common.config.schema import KeyGroup, Schema
from common.models.catalog import BATCH_STATISTICS_MODELS, MODELS
from common.privacy.releases import fisher_uploads, node_releases

if TYPE_CHECKING:
    from common.config.run import RunConfig


class PrivacyOptions(Schema):
    """Keys ``dp-*``: the Gaussian mechanism on every upload of a node, and each node's budget."""

    epsilon: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="each node's privacy budget over the run (0 = off): local steps run DP-SGD "
        "(each example's gradient clipped, Gaussian noise on the sum), the Fisher's per-example "
        "gradients are clipped and its sum noised, an accountant adds up what they spend, and a "
        "node that would go past it uploads nothing more (docs/design/privacy.md)",
    )
    delta: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="the delta of each node's (epsilon, delta) guarantee; below 1 / examples",
    )
    noise_multiplier: Annotated[float, Field(ge=0, le=1e4)] | Literal["auto"] = Field(
        "auto",
        description="noise standard deviation in units of the clipping bound, in every DP-SGD step "
        "and Fisher upload; `auto` = the smallest with which a node that trains every round stays "
        "within `dp-epsilon` (each node's own, from its example count)",
    )
    fisher_clip: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="L2 bound on one example's gradient before it enters the Fisher",
    )
    grad_clip: float = Field(
        1.0, gt=0, le=1e6, description="L2 bound on one example's gradient in a local DP-SGD step"
    )

    @property
    def enabled(self) -> bool:
        """Whether uploads are privatised."""
        return self.epsilon > 0


PRIVACY_KEYS = KeyGroup(
    "privacy", "dp-", PrivacyOptions, "Differential privacy of the nodes' uploads"
)


def check_privacy(run: RunConfig, owns_keys: bool, reads_fisher: bool, covered: list[str]) -> None:
    """Refuse ``dp-epsilon`` with a method or Fisher estimator it does not cover, naming the keys.

    Parameters
    ----------
    run : RunConfig
        The run's configuration.
    owns_keys : bool
        Whether the run's method owns the ``dp-*`` keys (it is covered).
    reads_fisher : bool
        Whether the run's server reads the nodes' Fisher.
    covered : list[str]
        The methods that own them (for the message).
    """
    opts: PrivacyOptions = run.options(PRIVACY_KEYS.name)
    if not opts.enabled:
        return
    if not owns_keys:
        raise ValueError(
            f"dp-epsilon={opts.epsilon:g} is set, but method={run.method!r} uploads what the "
            f"Gaussian mechanism here does not cover (covered: {', '.join(covered)}); set "
            "dp-epsilon = 0 or another method"
        )
    if reads_fisher and run.options("fisher").estimator == "path":
        raise ValueError(
            f'dp-epsilon={opts.epsilon:g} is set with fisher-estimator="path": a Fisher squared '
            'from minibatch gradients has no per-example bound; use fisher-estimator="global" or '
            '"received"'
        )
    if run.label_mask is True:
        raise ValueError(
            f"dp-epsilon={opts.epsilon:g} is set with label-mask=true: the set of classes a node "
            "holds then shapes every example's gradient, so one example of a new class changes "
            "them all; set label-mask = false"
        )
    if run.model in BATCH_STATISTICS_MODELS:
        raise ValueError(
            f"dp-epsilon={opts.epsilon:g} is set with model={run.model!r}, whose norms use the "
            "statistics of the whole minibatch, so one example's gradient depends on the others "
            "and clipping it bounds nothing; use a model without them "
            f"({', '.join(m for m in MODELS if m not in BATCH_STATISTICS_MODELS)})"
        )
    if opts.noise_multiplier == 0:
        raise ValueError(
            "dp-noise-multiplier=0 with dp-epsilon > 0: noise of 0 spends an infinite epsilon"
        )
    if run.meta_learning != "off":
        raise ValueError(
            f"dp-epsilon={opts.epsilon:g} is set with meta-learning={run.meta_learning!r}: a meta "
            "step's per-example gradients are not clipped; set meta-learning = off"
        )
    if run.adapt_steps > 0:
        raise ValueError(
            f"dp-epsilon={opts.epsilon:g} is set with adapt-steps={run.adapt_steps}: the accuracy "
            "after adapting on the training split is a release the privacy ledger does not count; "
            "set adapt-steps = 0"
        )


def node_noise_multiplier(run: RunConfig, reads_fisher: bool, num_examples: int) -> float:
    """A node's noise multiplier: ``dp-noise-multiplier``, or for ``auto`` the one calibrated to its
    budget.

    ``auto`` plans for a node of ``num_examples`` training examples that trains every round and
    uploads its Fisher as often as the method may ask
    (:func:`~common.privacy.accountant.node_releases`), so the node fits its budget whatever it is
    asked.
    """
    opts: PrivacyOptions = run.options(PRIVACY_KEYS.name)
    if opts.noise_multiplier != "auto":
        return float(opts.noise_multiplier)
    uploads = 0
    if reads_fisher:
        fisher = run.options("fisher")
        every = fisher.every if fisher.estimator == "global" else 1
        uploads = fisher_uploads(run.num_rounds, every, fisher.warmup)
    releases = node_releases(
        num_examples, run.batch_size, run.local_epochs, run.num_rounds, uploads
    )
    from common.privacy.accountant import (
        calibrate_multiplier,
    )  # Opacus loads torch: only where a node trains

    return calibrate_multiplier(opts.epsilon, opts.delta, releases)
