"""A malicious node, for measuring robust aggregation (``bench-attack``; a test and benchmark knob).

The nodes of partitions ``0, N, 2N, ...`` (``bench-attack-every = N``) attack every round they
train:

* ``scale:F``: they upload ``F`` times their honest update (``F = -1``: the sign flipped; ``F =
  10``: a boosted update that drags every position it holds);
* ``labels:C``: they train on their examples all labelled ``C``, pulling the model toward predicting
  ``C`` (a targeted attack whose update looks like an honest one).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from common.config.node import NodeConfig
from common.config.run import RunConfig
from common.data.arrays import ArrayDataset
from common.methods.contract.payloads import LocalUpdate
from common.wire import protocol as P


def attacks(run: RunConfig, node: NodeConfig) -> bool:
    """Whether this node attacks in this run."""
    return (
        bool(run.bench_attack)
        and node.partition_id is not None
        and node.partition_id % run.bench_attack_every == 0
    )


def poisoned_data(run: RunConfig, train: ArrayDataset) -> ArrayDataset:
    """``labels:C``: the training split with every label set to ``C``; otherwise ``train``
    itself."""
    kind, _, value = run.bench_attack.partition(":")
    if kind != "labels":
        return train
    target = int(value)
    if not 0 <= target < train.num_classes:
        raise ValueError(
            f"bench-attack={run.bench_attack!r}: class {target} outside [0, {train.num_classes})"
        )
    return replace(train, y=np.full_like(train.y, target))


def poisoned_update(run: RunConfig, update: LocalUpdate) -> LocalUpdate:
    """``scale:F``: the update's delta times ``F``; otherwise ``update`` itself."""
    kind, _, value = run.bench_attack.partition(":")
    if kind != "scale" or P.DELTA not in update.arrays:
        return update
    arrays = dict(update.arrays)
    arrays[P.DELTA] = (arrays[P.DELTA] * np.float32(float(value))).astype(np.float32)
    return replace(update, arrays=arrays)
