"""What a curious server can read from one node's upload: which classes the node holds, and in what
shares.

Both attacks look at the classifier, the last layer, whose row ``c`` (weights and bias) serves class
``c`` alone:

* **From a Fisher upload.** The Fisher of the classifier's row ``c`` is the mean over the node's
  examples of ``(p_c - y_c)^2 h^2``: for an example of class ``c`` it is ``(1 - p_c)^2 h^2``, for
  the others ``p_c^2 h^2``. While the model is not yet sure of its classes the first term dominates,
  so the rows of the classes the node holds carry the most mass, in proportion to how many examples
  of each it holds. The attack scores each class by its row's mean Fisher, splits the scores at
  their largest gap on a log scale (held above it), and reads the shares from the scores.
* **From an update.** One SGD step moves row ``c`` by ``-lr sum (p_c - y_c) h``: with non-negative
  features (ReLU) the row rises for a class the node holds and falls for one it does not. The attack
  scores each class by the mean of its row's update over the positions the node held, calls a class
  held when that is positive, and reads the shares from the positive scores.

A server that holds labelled data of its own (its test set) can do better than read the classifier:
a node's Fisher is the mean of its examples' squared gradients, so it is the mixture ``sum_c q_c
F_c`` of the per-class Fisher ``F_c`` the server measures on its own examples of each class, with
``q`` the node's class shares; and one epoch's update points along ``-sum_c q_c g_c``, the per-class
mean gradients. :func:`mixture_shares` solves for ``q`` by non-negative least squares over the
positions the upload carries (the *signature* attacks).

All functions are pure, on flat numpy arrays in the model's
:class:`~common.models.layout.ParamLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls

from common.models.layout import ParamLayout


@dataclass(frozen=True)
class Classifier:
    """Where the classifier's rows lie in the flat parameter vector.

    Parameters
    ----------
    weight : slice
        The flat span of the classifier's weight, ``num_classes`` rows of ``fan_in`` values each.
    bias : slice or None
        The flat span of its bias (``num_classes`` values), or None when it has none.
    num_classes : int
        Rows of the classifier.
    """

    weight: slice
    bias: slice | None
    num_classes: int

    def rows(self, flat: NDArray, default: float = 0.0) -> NDArray[np.float64]:
        """``flat``'s classifier as a ``(num_classes, fan_in + 1)`` array, the bias (or ``default``)
        last."""
        weight = np.asarray(flat[self.weight], dtype=np.float64).reshape(self.num_classes, -1)
        if self.bias is None:
            bias = np.full((self.num_classes, 1), default)
        else:
            bias = np.asarray(flat[self.bias], dtype=np.float64).reshape(self.num_classes, 1)
        return np.concatenate([weight, bias], axis=1)


def find_classifier(layout: ParamLayout, num_classes: int) -> Classifier:
    """The last 2-D tensor with ``num_classes`` rows, and the 1-D tensor of that length right after
    it.

    Raises
    ------
    ValueError
        When the layout has no such tensor (the model has no classifier of that width).
    """
    offsets = layout.offsets
    for i in range(len(layout.tensors) - 1, -1, -1):
        spec = layout.tensors[i]
        if len(spec.shape) == 2 and spec.shape[0] == num_classes:
            weight = slice(int(offsets[i]), int(offsets[i]) + spec.size)
            bias = None
            if i + 1 < len(layout.tensors) and layout.tensors[i + 1].shape == (num_classes,):
                start = int(offsets[i + 1])
                bias = slice(start, start + num_classes)
            return Classifier(weight, bias, num_classes)
    raise ValueError(
        f"no classifier with {num_classes} rows in the layout ({', '.join(layout.names)})"
    )


def fisher_scores(fisher: NDArray, classifier: Classifier) -> NDArray[np.float64]:
    """Per class, the mean Fisher over its classifier row (weights and bias)."""
    return classifier.rows(fisher).mean(axis=1)


def update_scores(
    update: NDArray, held: NDArray[np.bool_], classifier: Classifier
) -> NDArray[np.float64]:
    """Per class, the mean update over the positions of its classifier row that the node held (0
    where none)."""
    held_rows = classifier.rows(held.astype(np.float64))
    counts = held_rows.sum(axis=1)
    sums = (classifier.rows(update) * held_rows).sum(axis=1)
    return np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)


def split_at_largest_gap(scores: NDArray, floor: float = 1e-12) -> NDArray[np.bool_]:
    """The classes above the largest gap between consecutive sorted ``log(scores)``: at least one,
    at most all.

    When every score is equal (no gap), every class is called held.
    """
    logs = np.log(np.maximum(np.asarray(scores, dtype=np.float64), floor))
    order = np.sort(logs)
    if order.size < 2 or order[-1] == order[0]:
        return np.ones(logs.size, dtype=bool)
    gaps = np.diff(order)
    cut = order[int(np.argmax(gaps))]
    return logs > cut


def held_from_fisher(scores: NDArray) -> NDArray[np.bool_]:
    """The classes a Fisher upload says the node holds (:func:`split_at_largest_gap`)."""
    return split_at_largest_gap(scores)


def held_from_update(scores: NDArray) -> NDArray[np.bool_]:
    """The classes an update says the node holds: those whose row rose. None rose: the largest."""
    held = np.asarray(scores) > 0
    if not held.any():
        held[int(np.argmax(scores))] = True
    return held


def shares(scores: NDArray, held: NDArray[np.bool_]) -> NDArray[np.float64]:
    """Inferred class shares: the held classes' positive scores, normalised to sum to 1."""
    weights = np.where(held, np.maximum(np.asarray(scores, dtype=np.float64), 0.0), 0.0)
    total = weights.sum()
    if total <= 0:
        weights = held.astype(np.float64)
        total = weights.sum()
    return weights / total


def mixture_shares(
    upload: NDArray, signatures: NDArray, positions: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """The class shares ``q >= 0``, summing to 1, whose mixture ``q @ signatures`` best fits
    ``upload``.

    Parameters
    ----------
    upload : NDArray
        What the node sent, flat (a Fisher, or the negated update: both are non-negative mixtures).
    signatures : NDArray
        ``(num_classes, d)``: what one example of each class contributes (the server's per-class
        Fisher, or per-class mean gradient), at the same model.
    positions : NDArray[bool]
        The positions the upload carries (a node's mask); the others are not fitted.

    Each position is scaled by the norm of its column of ``signatures`` so that large-valued layers
    do not drown the rest. With no signal (every fitted coefficient 0) the shares are uniform.
    """
    a = np.asarray(signatures, dtype=np.float64)[:, positions].T
    b = np.asarray(upload, dtype=np.float64)[positions]
    scale = np.linalg.norm(a, axis=1)
    keep = scale > 0
    coef, _ = nnls(a[keep] / scale[keep, None], b[keep] / scale[keep], maxiter=50 * a.shape[1])
    total = coef.sum()
    return coef / total if total > 0 else np.full(a.shape[1], 1.0 / a.shape[1])


def held_from_shares(q: NDArray, min_share: float) -> NDArray[np.bool_]:
    """The classes whose inferred share is at least ``min_share`` (the largest one always)."""
    held = np.asarray(q) >= min_share
    held[int(np.argmax(q))] = True
    return held


@dataclass(frozen=True)
class LeakScore:
    """How well one attack read a set of nodes, against chance.

    Parameters
    ----------
    membership : float
        Share of (node, class) pairs whose held / not held the attack called right.
    membership_chance : float
        The same for the best guess that reads no upload: for each class, "held" when most nodes
        hold it.
    exact : float
        Share of nodes whose whole set of classes the attack called right.
    exact_chance : float
        The same for that guess.
    share_error : float
        Mean total-variation distance between the inferred and the true class shares (0 = exact, 1 =
        disjoint).
    share_error_chance : float
        The same for the guess that every node holds the classes in the pool's proportions.
    """

    membership: float
    membership_chance: float
    exact: float
    exact_chance: float
    share_error: float
    share_error_chance: float


def score_attack(
    inferred: NDArray[np.bool_],
    inferred_shares: NDArray,
    true_counts: NDArray,
    min_share: float = 0.0,
) -> LeakScore:
    """Score an attack over nodes: ``inferred`` and ``inferred_shares`` are ``(nodes, classes)``, as
    is ``true_counts`` (each node's examples per class). A node holds a class when the class is more
    than ``min_share`` of its examples (0: any example at all)."""
    counts = np.asarray(true_counts, dtype=np.float64)
    true_shares = counts / counts.sum(axis=1, keepdims=True)
    truth = true_shares > min_share
    guess = np.broadcast_to(truth.mean(axis=0) > 0.5, truth.shape)
    pool = counts.sum(axis=0) / counts.sum()

    def tv(a: NDArray, b: NDArray) -> float:
        return float(0.5 * np.abs(a - b).sum(axis=1).mean())

    return LeakScore(
        membership=float((inferred == truth).mean()),
        membership_chance=float((guess == truth).mean()),
        exact=float((inferred == truth).all(axis=1).mean()),
        exact_chance=float((guess == truth).all(axis=1).mean()),
        share_error=tv(np.asarray(inferred_shares, dtype=np.float64), true_shares),
        share_error_chance=tv(np.broadcast_to(pool, true_shares.shape), true_shares),
    )
