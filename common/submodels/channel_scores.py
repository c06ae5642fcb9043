"""CA-HFP's curvature-aware channel scores and the per-group top-k channel selection.

The paper scores a weight by ``s_j = g_j * w_j + h_j * w_j^2``, a second-order
Taylor estimate of how much removing it perturbs the loss, where

* ``g_j``: mean minibatch gradient over the client's local training steps;
* ``h_j``: the diagonal empirical Fisher (mean squared minibatch gradient) over the
  same steps, the curvature proxy: it is the Gauss-Newton approximation of the
  Hessian's diagonal and costs one squared accumulation per step;
* ``w_j``: the weight the client received, i.e. where the expansion is taken.

A channel ``c`` is scored over the set ``R(c)`` of weights that disappear when it
is dropped (:func:`channel_sums`: its output rows in the tensors that produce it,
its input columns in the tensors that read it)::

    S_c = | sum_{j in R(c)} g_j * w_j | + sum_{j in R(c)} h_j * w_j^2

The magnitude of the first-order term is our choice: dropping ``c`` moves its
weights by ``-w``, so the first-order loss change is ``-sum g w``, and the paper's
``+ g w`` reads as a perturbation *size* whose sign follows a direction
convention. Taken literally with signs, ``g w`` is mostly negative for the channels
training is growing (the loss wants them larger), so keeping the highest signed
sum drops exactly the channels the model relies on: in a 4-round, 3-client digits
simulation the capacity-1/16 submodel stayed at chance (0.10 accuracy) with the
signed sum and reached 0.97 with the magnitude (0.97 too with the signed Taylor
change ``-sum g w + 1/2 sum h w^2``; docs/design/cahfp.md has the set-up).

A group (see :mod:`common.submodels.width`) is a set of channels that must be kept or dropped
together across tensors (a ResNet residual sum and its shortcut); a client of
capacity ``gamma`` keeps in every group the ``ceil(sqrt(gamma) * size)`` channels
of highest score (:func:`top_channels`), the width ratio HeteroFL and FedRolex use,
so every method holds about ``gamma * d`` parameters at the same capacity.

Who measures what (a structured client cannot see the channels it does not hold):

1. The client trains its physically smaller model, accumulates ``g`` and ``h`` of
   the parameters it holds from the training steps (no extra passes), and uploads
   one float per held channel: its score ``S_c`` over its weights in the small
   model (:func:`channel_scores` on the small layout). The upload is tiny
   (hundreds of floats against the submodel's ``gamma * d``).
2. The server keeps one score per channel (:class:`ChannelScoreState`). After a
   round, every channel held by at least one accepted client takes the example-
   weighted mean of those clients' scores; channels nobody held keep their last
   value.
3. Selection ranks channels that have never been measured first (ordered by the
   squared L2 norm of their weights), then the measured ones by score. In the first
   round nothing is measured, so the rule is the classic filter-norm criterion
   (``S_c`` with ``g = 0`` and ``h = 1``); afterwards a channel that no client
   has held yet is handed to the next clients so that it gets measured once, instead
   of being dropped forever on the strength of a weight norm that is not comparable
   with curvature scores. With a capacity-1 client every channel is measured in
   round 1.

Ties are broken by the lower channel index, so selection is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from common.models.layout import ParamLayout
from common.submodels.width import TensorChannels, group_sizes, kept_channels, width_ratio

# Per group, the kept channel indices in increasing order.
ChannelSelection = dict[str, NDArray[np.int64]]


def channel_scores(
    layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    grad: NDArray,
    curvature: NDArray,
    weights: NDArray,
) -> dict[str, NDArray[np.float64]]:
    """Curvature-aware score ``S_c = |sum g w| + sum h w^2`` of every channel (units of the training
    loss).

    Parameters
    ----------
    layout : ParamLayout
        Flat layout the arrays follow (full model, or a small model: scores per kept channel).
    graph : Mapping[str, TensorChannels]
        Channel graph of the model.
    grad : NDArray
        Mean minibatch gradient ``g`` of the loss w.r.t. each weight, flat.
    curvature : NDArray
        Diagonal curvature ``h`` of each weight (here the empirical Fisher), ``>= 0``, flat.
    weights : NDArray
        Weight values ``w`` at which ``g`` and ``h`` were measured, flat.
    """
    g, h, w = (np.asarray(a, dtype=np.float64) for a in (grad, curvature, weights))
    if not g.shape == h.shape == w.shape:
        raise ValueError(
            f"grad {g.shape}, curvature {h.shape} and weights {w.shape} differ in shape"
        )
    if np.any(h < 0):
        raise ValueError("curvature must be non-negative")
    first = channel_sums(layout, graph, g * w)
    second = channel_sums(layout, graph, h * w * w)
    return {group: np.abs(first[group]) + second[group] for group in first}


def channel_sums(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], values: NDArray
) -> dict[str, NDArray[np.float64]]:
    """Per group and channel, the sum of ``values`` over the positions dropping that channel
    removes.

    Those positions are the channel's output rows in every tensor whose
    ``out_group`` is the group and its input columns (``in_repeat`` consecutive
    ones) in every tensor whose ``in_group`` is the group; a weight that is both
    (a square tensor mapping a group to itself) is counted once.

    Parameters
    ----------
    layout : ParamLayout
        Flat layout ``values`` follows (the full model's, or a small model's: the
        sums are then per kept channel, in kept order).
    graph : Mapping[str, TensorChannels]
        Channel graph of the model.
    values : NDArray
        One value per flat position, length ``layout.size``.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (layout.size,):
        raise ValueError(f"values have shape {values.shape}, expected ({layout.size},)")
    sums = {g: np.zeros(n, dtype=np.float64) for g, n in group_sizes(layout, graph).items()}
    for name, v in layout.unflatten(values).items():
        spec = graph[name]
        rows = v.shape[0]
        if spec.out_group is not None:
            sums[spec.out_group] += v.reshape(rows, -1).sum(axis=1)
        if spec.in_group is None or v.ndim < 2:
            continue
        n_in = sums[spec.in_group].size
        if v.shape[1] != n_in * spec.in_repeat:
            raise ValueError(
                f"tensor {name!r}: {v.shape[1]} inputs, graph implies {n_in * spec.in_repeat}"
            )
        blocks = v.reshape(rows, n_in, spec.in_repeat, -1)
        sums[spec.in_group] += blocks.sum(axis=(0, 2, 3))
        if spec.in_group == spec.out_group:
            diag = np.arange(rows)
            sums[spec.in_group] -= blocks[diag, diag].sum(axis=(1, 2))
    return sums


def top_channels(
    priority: NDArray, k: int, first: NDArray[np.bool_] | None = None
) -> NDArray[np.int64]:
    """Indices (increasing) of the ``k`` channels ranked highest.

    Parameters
    ----------
    priority : NDArray
        One finite number per channel; higher ranks first.
    k : int
        How many to keep, ``1 <= k <= len(priority)``.
    first : NDArray[bool], optional
        Channels ranked before all others whatever their priority (``priority``
        still orders them among themselves). Ties go to the lower index.
    """
    priority = np.asarray(priority, dtype=np.float64)
    n = priority.size
    if not 1 <= k <= n:
        raise ValueError(f"cannot keep {k} of {n} channels")
    if not np.all(np.isfinite(priority)):
        raise ValueError("channel priorities must be finite")
    tier = (
        np.zeros(n, dtype=np.int8)
        if first is None
        else (~np.asarray(first, dtype=bool)).astype(np.int8)
    )
    order = np.lexsort((np.arange(n), -priority, tier))  # last key is the primary one
    return np.sort(order[:k]).astype(np.int64)


def kept_count(size: int, gamma: float) -> int:
    """Channels a client of capacity ``gamma`` keeps in a group of ``size`` (as HeteroFL's width
    rule)."""
    return int(kept_channels(size, width_ratio(gamma)).size)


@dataclass(frozen=True)
class ChannelReport:
    """The channel scores one accepted client reported.

    Parameters
    ----------
    selection : ChannelSelection
        The channels the client held.
    scores : Mapping[str, NDArray]
        Per group, one score per held channel, in ``selection`` order.
    weight : float
        Example count of the client (> 0).
    """

    selection: ChannelSelection
    scores: Mapping[str, NDArray]
    weight: float


@dataclass
class ChannelScoreState:
    """The server's per-channel curvature scores.

    Parameters
    ----------
    score : dict[str, NDArray[float64]]
        Per group, the last example-weighted mean score of each channel.
    measured : dict[str, NDArray[bool]]
        Per group, whether a channel was ever held by an accepted client.
    """

    score: dict[str, NDArray[np.float64]] = field(default_factory=dict)
    measured: dict[str, NDArray[np.bool_]] = field(default_factory=dict)

    @classmethod
    def empty(cls, sizes: Mapping[str, int]) -> ChannelScoreState:
        """A state where no channel has been measured (``sizes``: channels per group)."""
        return cls(
            {g: np.zeros(n, dtype=np.float64) for g, n in sizes.items()},
            {g: np.zeros(n, dtype=bool) for g, n in sizes.items()},
        )

    @property
    def any_measured(self) -> bool:
        """Whether at least one channel has a curvature score."""
        return any(m.any() for m in self.measured.values())

    def update(self, reports: Sequence[ChannelReport]) -> None:
        """Fold one round's reports in: held channels get the weighted mean, others are
        unchanged."""
        num = {g: np.zeros_like(s) for g, s in self.score.items()}
        den = {g: np.zeros_like(s) for g, s in self.score.items()}
        for r in reports:
            if not r.weight > 0:
                raise ValueError(f"report weight must be positive, got {r.weight}")
            for g, idx in r.selection.items():
                vals = np.asarray(r.scores[g], dtype=np.float64)
                if vals.shape != idx.shape or not np.all(np.isfinite(vals)):
                    raise ValueError(
                        f"group {g!r}: need {idx.size} finite scores, got {vals.shape}"
                    )
                num[g][idx] += r.weight * vals
                den[g][idx] += r.weight
        for g in self.score:
            held = den[g] > 0
            self.score[g][held] = num[g][held] / den[g][held]
            self.measured[g] |= held

    def select(self, fallback: Mapping[str, NDArray], gamma: float) -> ChannelSelection:
        """Channels a client of capacity ``gamma`` keeps, per group.

        Parameters
        ----------
        fallback : Mapping[str, NDArray]
            Per group, the priority of unmeasured channels (e.g. their squared weight norm).
        gamma : float
            Client capacity in (0, 1].
        """
        out = {}
        for g, score in self.score.items():
            unmeasured = ~self.measured[g]
            priority = np.where(unmeasured, np.asarray(fallback[g], dtype=np.float64), score)
            out[g] = top_channels(priority, kept_count(score.size, gamma), first=unmeasured)
        return out


def personal_state(own: ChannelScoreState | None, pooled: ChannelScoreState) -> ChannelScoreState:
    """The scores one client's channels are ranked by: its own where it measured them, else the
    pooled ones.

    A channel the client never held takes the pooled (all clients') score, as a client without its
    own Fisher takes the prior; a channel nobody measured stays unmeasured (ranked first, by weight
    norm). The pooled scores are first put on the client's scale, per group: multiplied by ``sum own
    / sum pooled`` over the channels the client measured. Without it a small client's scores, summed
    over the few weights its small model has per channel, are systematically below the pooled ones
    (which larger models report over more weights), so every channel it holds would be swapped for
    one it does not at the next round.

    Parameters
    ----------
    own : ChannelScoreState or None
        The client's own scores (``None``: it has reported none, or was evicted).
    pooled : ChannelScoreState
        The example-weighted scores of all clients.
    """
    if own is None:
        return pooled
    score, measured = {}, {}
    for g, pooled_score in pooled.score.items():
        mine = own.measured[g]
        both = mine & pooled.measured[g]
        ref = float(pooled_score[both].sum())
        scale = float(own.score[g][both].sum()) / ref if both.any() and ref > 0 else 1.0
        score[g] = np.where(mine, own.score[g], scale * pooled_score)
        measured[g] = mine | pooled.measured[g]
    return ChannelScoreState(score, measured)


def score_capacity(budget_mb: float, sizes: Mapping[str, int]) -> int:
    """How many clients' channel scores fit in ``budget_mb`` MiB (at least 1).

    A client's state is one float64 score and one bool per channel of every group.
    """
    per_client = 9 * sum(sizes.values())
    return max(1, int(budget_mb * 2**20 // max(per_client, 1)))


@dataclass
class ClientChannelScores:
    """Per-client channel scores on the server, at most ``max_clients`` of them.

    Each accepted client's report replaces the scores of the channels it held in *its own* state; a
    new client beyond ``max_clients`` evicts the one that reported least recently, which then ranks
    by the pooled scores again (:func:`personal_state`).

    Parameters
    ----------
    sizes : Mapping[str, int]
        Channels per group.
    max_clients : int
        Most client states kept (>= 1), e.g. :func:`score_capacity` of a memory budget.
    """

    sizes: Mapping[str, int]
    max_clients: int
    clients: dict[str, ChannelScoreState] = field(default_factory=dict)
    evictions: int = 0

    def __post_init__(self) -> None:
        if self.max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {self.max_clients}")

    def update(self, key: str, report: ChannelReport) -> None:
        """Fold one client's report into its own state (most recent last)."""
        state = self.clients.pop(key, None)
        if state is None:
            if len(self.clients) >= self.max_clients:
                del self.clients[
                    next(iter(self.clients))
                ]  # dicts keep insertion order: the least recent
                self.evictions += 1
            state = ChannelScoreState.empty(self.sizes)
        state.update([report])
        self.clients[key] = state

    def get(self, key: str) -> ChannelScoreState | None:
        """The client's own state, if kept."""
        return self.clients.get(key)

    def memory_bytes(self) -> int:
        """Bytes of the kept scores and flags."""
        return sum(
            a.nbytes
            for state in self.clients.values()
            for a in (*state.score.values(), *state.measured.values())
        )
