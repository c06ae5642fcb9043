"""stock-fedavg: the model, the data, local training and evaluation (the ``task.py`` of Flower's
PyTorch template).

The template builds its own CNN and partitions with flwr-datasets; here the network, the partition
of each node and the server's test set come from the product's ``common`` package, so a comparison
of the two runs compares what the federation does, not two models or two splits. Local training is
the template's plain loop (SGD with momentum, cross-entropy, shuffled minibatches), with the run
config's hyperparameters.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.data.arrays import ArrayDataset
from common.data.datasets import load_server_data
from common.data.local_split import derive_local_data
from common.models.architectures import build_run_model
from common.training.evaluation import evaluate
from common.training.loop import as_input

# The product's run-config keys this app shares: the data split and the model (initial weights from
# `seed`).
SHARED_KEYS = (
    "dataset",
    "model",
    "partitioner",
    "dirichlet-alpha",
    "classes-per-client",
    "test-fraction",
    "local-test-fraction",
    "seed",
)


def product_settings(run_config: Mapping[str, Any]) -> RunConfig:
    """The product's validated run configuration for this app's shared keys (the rest at the
    product's defaults)."""
    return parse_run_config({key: run_config[key] for key in SHARED_KEYS})


def net(run: RunConfig, num_classes: int, in_channels: int) -> nn.Module:
    """The network, at the product's initial weights for ``seed``."""
    return build_run_model(run, num_classes, in_channels)


def server_model(run: RunConfig) -> tuple[nn.Module, ArrayDataset]:
    """The initial global model and the server's test set."""
    data = load_server_data(run)
    if data.test is None:
        raise ValueError(f"dataset={run.dataset!r} leaves the server no test set")
    return net(run, data.num_classes, data.in_channels), data.test


def load_data(run: RunConfig, node_config: Mapping[str, Any]) -> tuple[ArrayDataset, ArrayDataset]:
    """This node's training and local test split: partition ``partition-id`` of
    ``num-partitions``."""
    local = derive_local_data(run, parse_node_config(node_config))
    return local.train, local.test


def train(
    model: nn.Module,
    data: ArrayDataset,
    epochs: int,
    lr: float,
    momentum: float,
    batch_size: int,
    seed: int,
) -> tuple[float, float]:
    """Train ``model`` in place; returns the mean training loss and the CPU seconds it took.

    Parameters
    ----------
    model : nn.Module
        The model, loaded with the round's global weights.
    data : ArrayDataset
        The node's training split.
    epochs : int
        Local epochs.
    lr, momentum : float
        SGD's learning rate and momentum.
    batch_size : int
        Examples per minibatch.
    seed : int
        Seeds the minibatch order.
    """
    cpu0 = time.process_time()
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    criterion = nn.CrossEntropyLoss()
    model.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            optimizer.zero_grad()
            loss = criterion(model(as_input(x[idx])), y[idx])
            loss.backward()
            optimizer.step()
            total += float(loss)
            batches += 1
    return total / max(batches, 1), time.process_time() - cpu0


def test(model: nn.Module, data: ArrayDataset) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``data`` (the product's evaluation, so both runs score
    alike)."""
    return evaluate(model, data, torch.device("cpu"))
