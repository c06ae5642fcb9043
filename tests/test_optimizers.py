"""The ``optimizer`` key: SGD or AdamW for every method's local training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.training.catalog import OPTIMIZERS
from common.training.loop import TrainConfig, round_train_config, train_loop
from common.training.optimizers import make_optimizer

CPU = torch.device("cpu")


def _data(n: int = 16) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(
        rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64), 3
    )


def _full_batch_gradient(model: nn.Module, data: ArrayDataset) -> list[torch.Tensor]:
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(torch.from_numpy(data.x)), torch.from_numpy(data.y))
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_first_adamw_step_is_lr_times_the_gradient_sign():
    """Adam's first bias-corrected step is ``lr * g / (|g| + eps)``: ``lr`` times the sign, entry by
    entry."""
    data = _data()
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    start = [p.detach().clone() for p in model.parameters()]
    grads = _full_batch_gradient(model, data)
    train_loop(
        model, data, TrainConfig(epochs=1, batch_size=len(data), lr=0.01, optimizer="adamw"), CPU
    )
    for p, p0, g in zip(model.parameters(), start, grads):
        expected = p0 - 0.01 * g / (g.abs() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def test_sgd_step_is_lr_times_the_gradient():
    data = _data()
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    start = [p.detach().clone() for p in model.parameters()]
    grads = _full_batch_gradient(model, data)
    train_loop(model, data, TrainConfig(epochs=1, batch_size=len(data), lr=0.5, momentum=0.9), CPU)
    for p, p0, g in zip(model.parameters(), start, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.5 * g, rtol=0, atol=1e-6)


def test_make_optimizer_kinds_and_settings():
    params = [nn.Parameter(torch.zeros(3))]
    sgd = make_optimizer(params, "sgd", 0.1, momentum=0.9, weight_decay=1e-3)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["weight_decay"] == 1e-3
    adamw = make_optimizer(params, "adamw", 1e-3, momentum=0.5, weight_decay=0.01)
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["betas"] == (0.9, 0.999) and adamw.defaults["weight_decay"] == 0.01
    with pytest.raises(ValueError, match="optimizer='adam'"):
        make_optimizer(params, "adam", 0.1)
    assert OPTIMIZERS == ("sgd", "adamw")


def test_optimizer_key_reaches_local_training_and_bad_values_fail_naming_it():
    node = NodeConfig(partition_id=0, num_partitions=1, capacity=1.0)
    assert round_train_config(parse_run_config({}), node, 1).optimizer == "sgd"
    assert (
        round_train_config(parse_run_config({"optimizer": "adamw"}), node, 1).optimizer == "adamw"
    )
    with pytest.raises(ConfigError, match="optimizer"):
        parse_run_config({"optimizer": "adam"})
