"""A node's local train and test splits, derived deterministically from the run's seed and its
partition.

The ClientApp caches the result on the node (:mod:`client.local_data`); analyses re-derive the same
splits (e.g. which classes each client held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset
from common.data.catalog import HUB_DATASET_NAMES, NODE_DATASET, TEXT_DATASETS
from common.data.datasets import load_run_dataset, node_input_spec, text_encoder
from common.data.group_shift import shift_partition
from common.data.hub import load_hub_partition
from common.data.node_data import NodeDataError, NodeDataReport, read_node_data
from common.data.partitioning import partition_indices

if TYPE_CHECKING:
    from common.config.node import NodeConfig
    from common.config.run import RunConfig


@dataclass(frozen=True)
class LocalData:
    """A node's local splits.

    Parameters
    ----------
    train : ArrayDataset
        Local training split.
    test : ArrayDataset
        Local test split (the "local" accuracy is measured here).
    report : NodeDataReport, optional
        What reading the node's own data found (``dataset = "node"``); ``None`` for a partition.
    """

    train: ArrayDataset
    test: ArrayDataset
    report: NodeDataReport | None = None


def derive_local_data(run: RunConfig, node: NodeConfig) -> LocalData:
    """Deterministically derive this node's splits: its partition of the shared pool, or its own
    data."""
    if run.dataset == NODE_DATASET:
        return node_local_data(run, node)
    if node.partition_id is None or node.num_partitions is None:
        raise NodeDataError(
            f"the run's dataset={run.dataset!r} is shared by the nodes: this node's node-config "
            "needs partition-id "
            f'and num-partitions (its data-path={node.data_path!r} is read in dataset = "node" '
            "runs)"
        )
    num_partitions, partition_id = node.num_partitions, node.partition_id

    def select(labels: NDArray[np.int64], groups: NDArray[np.int64] | None) -> NDArray[np.int64]:
        return partition_indices(
            labels,
            run.partitioner,
            num_partitions,
            partition_id,
            run.seed,
            run.dirichlet_alpha,
            run.classes_per_client,
            groups=groups,
        )

    if (
        run.dataset in HUB_DATASET_NAMES
    ):  # only this node's partition is decoded, not the whole pool
        encode = text_encoder(run) if run.dataset in TEXT_DATASETS else None
        part = load_hub_partition(
            run.dataset, run.test_fraction, run.seed, select, run.data_path, encode
        )
    else:
        pool = load_run_dataset(run).train
        part = pool.subset(select(pool.y, pool.groups))
    part = shift_partition(part, run.group_shift, partition_id, run.node_groups, run.seed)
    if len(part) < 2:
        raise ValueError(
            f"partition {partition_id} holds {len(part)} examples; at least 2 are needed"
        )
    return LocalData(*split_off_test(part, run, node))


def split_off_test(
    data: ArrayDataset, run: RunConfig, node: NodeConfig
) -> tuple[ArrayDataset, ArrayDataset]:
    """``data`` as ``(train, test)``: ``local-test-fraction`` held out, seeded by the run and the
    node's stream.

    Each part keeps ``data``'s order. At least 2 examples are needed (one each side).
    """
    from sklearn.model_selection import train_test_split

    train_pos, test_pos = train_test_split(
        np.arange(len(data)), test_size=run.local_test_fraction, random_state=run.seed + node.stream
    )
    return data.subset(np.sort(train_pos)), data.subset(np.sort(test_pos))


def node_local_data(run: RunConfig, node: NodeConfig) -> LocalData:
    """The node's own data (``data-path``), split into train and test unless it names its own test
    part.

    Raises :class:`~common.data.node_data.NodeDataError` (the node cannot take part) for a node
    without data-path, unreadable data, or fewer training examples than one batch.
    """
    if not node.data_path:
        raise NodeDataError(
            'dataset = "node": this node\'s node-config has no data-path (the folder of its own '
            "data), e.g. "
            "--node-config 'data-path=\"/data\" capacity=0.25'"
        )
    data = read_node_data(
        node.data_path, run.class_names, node_input_spec(run), node.label_column, node.input_column
    )
    train, test = data.train, data.test
    if test is None:
        if len(train) < 2:
            raise NodeDataError(
                f"data-path {node.data_path!r}: {len(train)} example; at least 2 are needed"
            )
        train, test = split_off_test(train, run, node)
    if len(train) < run.batch_size:
        raise NodeDataError(
            f"data-path {node.data_path!r}: {len(train)} training examples, fewer than one batch "
            f"(batch-size={run.batch_size})"
        )
    return LocalData(train, test, data.report)
