"""Split the federation's training pool across clients with flwr-datasets partitioners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from common.data.catalog import PARTITIONERS

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner


def make_partitioner(
    kind: str,
    num_partitions: int,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
) -> Partitioner:
    """A flwr-datasets partitioner over a ``label`` column.

    Parameters
    ----------
    kind : {"iid", "dirichlet", "pathological"}
        ``iid``: uniform shards; ``dirichlet``: label proportions ~ Dir(alpha) per
        client; ``pathological``: each client sees ``classes_per_client`` labels.
    num_partitions : int
        Number of clients.
    seed : int
        Partitioning seed.
    alpha : float
        Dirichlet concentration (smaller = more skewed).
    classes_per_client : int
        Labels per client for ``pathological``.
    """
    # Imported on use: `datasets` costs seconds, paid by every client process otherwise.
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    if kind == "natural":  # one client per natural group (e.g. FEMNIST writer)
        return NaturalIdPartitioner("group")

    if kind == "iid":
        return IidPartitioner(num_partitions)
    if kind == "dirichlet":
        return DirichletPartitioner(
            num_partitions,
            "label",
            alpha,
            min_partition_size=2,
            self_balancing=True,
            seed=seed,
        )
    if kind == "pathological":
        # first-deterministic: client i's first class is i mod classes, so every class is held once
        # there are at least as many clients as classes; below that, classes the random draws miss
        # stay unheld (flwr-datasets warns).
        return PathologicalPartitioner(
            num_partitions,
            "label",
            classes_per_client,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    raise ValueError(f"unknown partitioner {kind!r}; expected one of {PARTITIONERS}")


def partition_indices(
    labels: NDArray[np.int64],
    kind: str,
    num_partitions: int,
    partition_id: int,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    groups: NDArray[np.int64] | None = None,
) -> NDArray[np.int64]:
    """Indices (into ``labels``) of one client's partition, sorted.

    Every node computes the same partitioning from the same seed, so no
    coordination is needed. The pool is shuffled by ``seed`` first because the
    IID partitioner shards contiguously.

    Parameters
    ----------
    labels : NDArray[int64]
        Labels of the training pool.
    kind, num_partitions, seed, alpha, classes_per_client
        As in :func:`make_partitioner`.
    partition_id : int
        This client's partition, in ``[0, num_partitions)``.
    groups : NDArray[int64], optional
        Natural group per example; required by ``natural``, whose partitions are
        the groups in order of first appearance (``num_partitions`` must equal
        the number of groups).
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    n = labels.shape[0]
    if num_partitions > n:
        raise ValueError(f"num-partitions {num_partitions} exceeds the {n} training examples")
    order = np.random.default_rng(seed).permutation(n)
    from datasets import Dataset

    partitioner = make_partitioner(kind, num_partitions, seed, alpha, classes_per_client)
    columns = {"label": labels[order].tolist(), "pos": order.tolist()}
    if kind == "natural":
        if groups is None:
            raise ValueError(
                "partitioner 'natural' needs a dataset with natural groups (e.g. femnist writers)"
            )
        count = len(np.unique(groups))
        if count != num_partitions:
            raise ValueError(
                f"partitioner 'natural': the data has {count} groups but "
                f"num-partitions={num_partitions}"
            )
        order = np.arange(n)  # groups, not a shuffle, define the partitions
        columns = {"label": labels.tolist(), "pos": order.tolist(), "group": groups.tolist()}
    partitioner.dataset = Dataset.from_dict(columns)
    part = partitioner.load_partition(partition_id)
    return np.sort(np.asarray(part["pos"], dtype=np.int64))
