"""First-order MAML local steps (``meta-learning = "fomaml"``): the meta-gradient against a hand
computation, masks kept, the methods it wraps, and a federation that meta-trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.loop import TrainConfig, train_masked
from common.training.meta_learning import first_order_maml_backward
from tests.inprocess_grid import inprocess_federation

CPU = torch.device("cpu")


def _reference(model: nn.Module, x, y, lr: float, steps: int) -> list[torch.Tensor]:
    """FO-MAML by hand: adapt a copy of the weights on the first half, the second half's gradient
    there."""
    loss_fn = nn.CrossEntropyLoss()
    half = len(x) // 2
    w = [p.detach().clone().requires_grad_(True) for p in model.parameters()]

    def forward(weights, inputs):
        return torch.func.functional_call(
            model, dict(zip([n for n, _ in model.named_parameters()], weights)), inputs
        )

    for _ in range(steps):
        g = torch.autograd.grad(loss_fn(forward(w, x[:half]), y[:half]), w)
        w = [(wi - lr * gi).detach().requires_grad_(True) for wi, gi in zip(w, g)]
    return list(torch.autograd.grad(loss_fn(forward(w, x[half:]), y[half:]), w))


@pytest.mark.parametrize("steps", [1, 3])
def test_the_meta_gradient_is_the_query_gradient_at_the_adapted_weights(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    want = _reference(model, x, y, 0.3, steps)
    loss = first_order_maml_backward(model, nn.CrossEntropyLoss(), x, y, 0.3, steps)
    assert np.isfinite(loss)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_a_batch_of_one_adapts_and_scores_on_the_same_example():
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    x, y = torch.randn(1, 4), torch.tensor([1])
    first_order_maml_backward(model, nn.CrossEntropyLoss(), x, y, 0.5, 1)
    doubled = (
        torch.cat([x, x]),
        torch.cat([y, y]),
    )  # halves of one example each: the same computation
    want = _reference(model, *doubled, 0.5, 1)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def _digits(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n), 10)


def test_a_masked_submodel_meta_trains_only_where_it_is_held():
    model = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    mask = np.random.default_rng(0).random(layout.size) < 0.25
    cfg = TrainConfig(
        epochs=1, batch_size=16, lr=0.1, seed=2, meta_inner_lr=0.05, meta_inner_steps=2
    )
    result = train_masked(
        model, layout, x, mask, _digits(), cfg, torch.device("cpu"), measure_fisher=False
    )
    assert np.all(result.params[~mask] == 0)
    assert np.any(result.params[mask] != x[mask])
    plain = train_masked(
        build_model("cnn-bn", 10, 1, 0), layout, x, mask, _digits(), TrainConfig(1, 16, 0.1,
                                                                                 seed=2),
        torch.device("cpu"), measure_fisher=False,
    )  # fmt: skip
    assert not np.array_equal(plain.params, result.params)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"method": "cahfp"}, "cannot wrap method='cahfp'"),
        (
            {"method": "lora", "model": "hf", "model-path": "x", "dataset": "ag_news"},
            "meta-learning",
        ),
        ({"fisher-estimator": "path"}, 'fisher-estimator="path"'),
        ({"dp-epsilon": 8, "model": "cnn", "label-mask": False}, "meta-learning"),
        ({"meta-inner-lr": 0}, "meta-inner-lr"),
        ({"meta-inner-steps": 0}, "meta-inner-steps"),
    ],
)
def test_what_meta_learning_cannot_wrap_is_refused_naming_the_key(settings, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config({"meta-learning": "fomaml", **settings})


def test_meta_learning_wraps_the_element_wise_methods():
    for method in ("fedavg", "fedfibos", "fiarse", "heterofl", "fedrolex", "fedgmr"):
        assert (
            parse_run_config({"meta-learning": "fomaml", "method": method}).meta_learning
            == "fomaml"
        )


def test_a_two_round_federation_meta_trains_each_nodes_submodel(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run = {"num-rounds": 2, "local-epochs": 1, "eval-every": 2, "seed": 4, "adapt-steps": 5}
    finals = {}
    for meta in ("off", "fomaml"):
        fed = inprocess_federation({**run, "meta-learning": meta}, {31: 1.0, 32: 0.25, 33: 0.0625})
        fed.strategy.start(
            fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
        )
        last = fed.records[-1]
        assert 0 <= last["global"]["accuracy"] <= 1 and 0 <= last["local"]["adapted_accuracy"] <= 1
        assert all(c["status"] == "ok" for c in last["clients"])
        finals[meta] = fed.strategy.x.copy()
    assert not np.array_equal(
        finals["off"], finals["fomaml"]
    )  # the meta steps moved the model otherwise


def test_a_meta_learned_model_adapts_by_the_plain_inner_step_it_was_trained_for():
    """One adaptation step of a fomaml run is ``w - meta-inner-lr * grad`` on its minibatch: no
    momentum, no weight decay, not the run's own ``lr``; a run without meta-learning adapts with its
    own optimiser settings."""
    from common.config.node import parse_node_config
    from common.training.personalisation import adapt, adapt_config, adaptation_examples

    node = parse_node_config({"partition-id": 0, "num-partitions": 1, "capacity": 1.0})
    settings = {
        "lr": 0.1,
        "momentum": 0.9,
        "weight-decay": 0.01,
        "batch-size": 8,
        "label-mask": False,
    }
    plain = adapt_config(parse_run_config(settings), node, 3)
    assert (plain.lr, plain.momentum, plain.weight_decay) == (0.1, 0.9, 0.01)
    meta = parse_run_config({**settings, "meta-learning": "fomaml", "meta-inner-lr": 0.02})
    cfg = adapt_config(meta, node, 3)
    rng = np.random.default_rng(1)
    data = ArrayDataset(rng.random((20, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 20), 10)
    model = build_model("cnn", 10, 1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    batch = adaptation_examples(len(data), 1, cfg.batch_size, cfg.seed)
    loss = nn.CrossEntropyLoss()(
        model(torch.from_numpy(data.x[batch])), torch.from_numpy(data.y[batch])
    )
    grads = torch.autograd.grad(loss, list(model.parameters()))
    adapt(model, data, 1, cfg, CPU)
    for w0, g, w1 in zip(before, grads, model.parameters(), strict=True):
        torch.testing.assert_close(w1.detach(), w0 - 0.02 * g)
