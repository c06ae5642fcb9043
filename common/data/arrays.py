"""The in-memory dataset type every loader returns and every training loop reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class ArrayDataset:
    """Images and labels held in memory.

    Parameters
    ----------
    x : NDArray
        Images ``(n, channels, height, width)``: float32 in [0, 1], or uint8 in
        [0, 255] (scaled per batch); or int64 token ids ``(n, length)`` for text.
    y : NDArray[int64]
        Class labels, shape ``(n,)``.
    num_classes : int
        Number of classes.
    groups : NDArray[int64], optional
        Natural partition key per example (e.g. FEMNIST's writer).
    """

    x: NDArray
    y: NDArray[np.int64]
    num_classes: int
    groups: NDArray[np.int64] | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def in_channels(self) -> int:
        """Image channels."""
        return int(self.x.shape[1])

    def subset(self, indices: NDArray[np.int64]) -> ArrayDataset:
        """The examples at ``indices``."""
        groups = None if self.groups is None else self.groups[indices]
        return ArrayDataset(self.x[indices], self.y[indices], self.num_classes, groups)


@dataclass(frozen=True)
class SplitDataset:
    """A dataset split into the federation's training pool and the server's test set."""

    train: ArrayDataset
    test: ArrayDataset
