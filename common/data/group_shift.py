"""A fleet with true groups: the partitions fall into groups, and each group sees its data shifted.

Partition ``p`` of a run with ``node-groups = G`` belongs to group ``p mod G``. Group ``g`` sees
every example turned by ``g`` quarter turns (``rotate``: the same digits, another orientation) or
with its labels renamed by a permutation of its own (``permute-labels``: the same images, another
meaning; group 0 keeps the dataset's labels). One shared model cannot serve such groups at once,
which is what a personalised or clustered federation is measured on. The server's test set mixes
the groups: example ``i`` is shifted as group ``i mod G``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset

#: The ways a group can see its data (``group-shift``).
GroupShift = Literal["rotate", "permute-labels"]


def group_of(partition_id: int, groups: int) -> int:
    """The group of partition ``partition_id`` in a fleet of ``groups`` groups (``>= 1``)."""
    if groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    return partition_id % groups


def label_permutation(num_classes: int, group: int, seed: int) -> NDArray[np.int64]:
    """Group ``group``'s renaming of the labels: ``new = perm[old]``; the identity for group 0.

    Parameters
    ----------
    num_classes : int
        Classes of the dataset.
    group : int
        The group (``>= 0``).
    seed : int
        The run's seed: the same run gives each group the same permutation on every node.
    """
    if group == 0:
        return np.arange(num_classes, dtype=np.int64)
    rng = np.random.default_rng([seed, group, num_classes])
    return rng.permutation(num_classes).astype(np.int64)


def shift_examples(
    data: ArrayDataset, kind: GroupShift, groups_of_examples: NDArray[np.int64], seed: int
) -> ArrayDataset:
    """``data`` with example ``i`` shifted as group ``groups_of_examples[i]`` sees it.

    Parameters
    ----------
    data : ArrayDataset
        Images ``(n, channels, height, width)`` for ``rotate`` (square); any examples for
        ``permute-labels``.
    kind : {"rotate", "permute-labels"}
        The shift (module docstring).
    groups_of_examples : NDArray[int64]
        Each example's group, shape ``(n,)``.
    seed : int
        The run's seed (the label permutations).
    """
    if groups_of_examples.shape != (len(data),):
        raise ValueError(f"{groups_of_examples.shape[0]} groups given for {len(data)} examples")
    x, y = data.x, data.y
    if kind == "rotate":
        if x.ndim != 4 or x.shape[-1] != x.shape[-2]:
            raise ValueError(f"group-shift='rotate' needs square images, not inputs {x.shape[1:]}")
        if groups_of_examples.max(initial=0) > 3:
            raise ValueError("group-shift='rotate' has four groups: 0, 1, 2 or 3 quarter turns")
        x = x.copy()
        for g in np.unique(groups_of_examples):
            at = groups_of_examples == g
            x[at] = np.rot90(x[at], k=int(g), axes=(-2, -1))
    elif kind == "permute-labels":
        y = y.copy()
        for g in np.unique(groups_of_examples):
            at = groups_of_examples == g
            y[at] = label_permutation(data.num_classes, int(g), seed)[data.y[at]]
    else:
        raise ValueError(f"unknown group-shift {kind!r}; expected rotate or permute-labels")
    return ArrayDataset(np.ascontiguousarray(x), y, data.num_classes, data.groups)


def shift_partition(
    data: ArrayDataset, kind: GroupShift, partition_id: int, groups: int, seed: int
) -> ArrayDataset:
    """A partition's examples as its group sees them (unchanged with one group)."""
    if groups == 1:
        return data
    group = group_of(partition_id, groups)
    return shift_examples(data, kind, np.full(len(data), group, dtype=np.int64), seed)


def shift_test_set(data: ArrayDataset, kind: GroupShift, groups: int, seed: int) -> ArrayDataset:
    """The server's test set with the groups mixed: example ``i`` as group ``i mod groups`` sees
    it (unchanged with one group)."""
    if groups == 1:
        return data
    return shift_examples(data, kind, np.arange(len(data), dtype=np.int64) % groups, seed)
