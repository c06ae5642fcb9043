"""A node's local train and test splits, derived deterministically from the run's seed and its partition.

The ClientApp caches the result on the node (:mod:`client.local_data`); analyses re-derive the same
splits (e.g. which classes each client held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.array_dataset import ArrayDataset
from common.datasets import load_run_dataset
from common.partitioning import partition_indices

if TYPE_CHECKING:
    from common.config import NodeConfig, RunConfig


@dataclass(frozen=True)
class LocalData:
    """A node's local splits.

    Parameters
    ----------
    train : ArrayDataset
        Local training split.
    test : ArrayDataset
        Local test split (the "local" accuracy is measured here).
    """

    train: ArrayDataset
    test: ArrayDataset


def derive_local_data(run: RunConfig, node: NodeConfig) -> LocalData:
    """Deterministically derive this node's splits from the run's seed and its partition id."""
    from sklearn.model_selection import train_test_split

    pool = load_run_dataset(run).train
    idx = partition_indices(
        pool.y,
        run.partitioner,
        node.num_partitions,
        node.partition_id,
        run.seed,
        run.dirichlet_alpha,
        run.classes_per_client,
        groups=pool.groups,
    )
    if idx.size < 2:
        raise ValueError(f"partition {node.partition_id} holds {idx.size} examples; at least 2 are needed")
    train_idx, test_idx = train_test_split(
        idx,
        test_size=run.local_test_fraction,
        random_state=run.seed + node.partition_id,
    )
    return LocalData(pool.subset(np.sort(train_idx)), pool.subset(np.sort(test_idx)))
