"""Per-example Fisher at the received weights, against one backward pass per example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.data.arrays import ArrayDataset
from common.fisher.estimation import example_indices, per_example_fisher
from common.models.architectures import build_model, load_flat, model_layout, trainable_arrays
from common.training.accumulators import effective_tensors
from common.training.loop import attach_masks, local_classes, local_logits


def _data(n: int, channels: int, side: int, classes: int, seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, channels, side, side), dtype=np.uint8)
    return ArrayDataset(x, rng.integers(0, classes, size=n).astype(np.int64), classes)


def _brute_force(model, layout, params, mask, data, indices, present) -> np.ndarray:
    """Square of each example's gradient of the effective tensors, one backward pass each,
    averaged."""
    load_flat(model, layout, np.where(mask, params, 0).astype(np.float32))
    attach_masks(model, layout, mask)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    if norms:
        # A training step's batch statistics over the whole sample, then held fixed for each
        # example.
        seen = {}
        hooks = [
            m.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, a[0].detach()))
            for m in norms
        ]
        model.train()
        with torch.no_grad():
            model(torch.from_numpy(data.x[indices]).float() / 255.0)
        for h in hooks:
            h.remove()
        for m in norms:
            m.running_mean = seen[m].mean((0, 2, 3))
            m.running_var = seen[m].var((0, 2, 3), unbiased=False)
        model.eval()
    else:
        model.train()
    total = np.zeros(layout.size)
    for i in indices:
        xi = torch.from_numpy(data.x[i : i + 1]).float() / 255.0
        out = model(xi)
        tensors = effective_tensors(model, layout)
        for t in tensors:
            if not t.is_leaf:
                t.retain_grad()
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(
            local_logits(out, present), torch.from_numpy(data.y[i : i + 1])
        )
        loss.backward()
        total += np.concatenate([t.grad.detach().numpy().reshape(-1) ** 2 for t in tensors])
    return total / len(indices)


@pytest.mark.parametrize("vectorise", [False, True])
@pytest.mark.parametrize(
    ("name", "channels", "side", "label_mask"), [("cnn", 1, 8, False), ("cnn", 1, 8, True)]
)
def test_estimate_equals_one_backward_pass_per_example(name, channels, side, label_mask, vectorise):
    model = build_model(name, 10, channels, seed=1)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    mask = np.random.default_rng(2).random(layout.size) < 0.3
    data = _data(40, channels, side, 10, seed=3)
    indices = example_indices(len(data), 25, seed=4)
    present = local_classes(torch.from_numpy(data.y), 10, label_mask)
    got = per_example_fisher(
        build_model(name, 10, channels, seed=1),
        layout,
        params,
        mask,
        data,
        indices,
        present,
        torch.device("cpu"),
        7,
        vectorise=vectorise,
    )
    want = _brute_force(
        build_model(name, 10, channels, seed=1), layout, params, mask, data, indices, present
    )
    assert got.shape == (layout.size,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-10)
    assert (
        np.count_nonzero(got[~mask]) > 0
    )  # positions the client does not hold get their Fisher too


@pytest.mark.parametrize(
    "vectorise", [False, True]
)  # one backward pass per example / vmap over chunks
@pytest.mark.parametrize(
    ("name", "channels", "side", "n"), [("cnn-bn", 1, 28, 9), ("resnet18", 3, 32, 3)]
)
def test_a_batch_norm_model_is_estimated_per_example_in_eval_mode(
    name, channels, side, n, vectorise
):
    model = build_model(name, 10, channels, seed=0)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    mask = np.random.default_rng(1).random(layout.size) < 0.5
    data = _data(n, channels, side, 10, seed=5)
    indices = np.arange(n)
    # chunks of 2 (and of 1 for ResNet-18, by the byte bound): no example's statistics mix with
    # another's
    got = per_example_fisher(
        model, layout, params, mask, data, indices, None, torch.device("cpu"), 2, 40.0, vectorise
    )
    want = _brute_force(
        build_model(name, 10, channels, seed=0), layout, params, mask, data, indices, None
    )
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-9)
    assert model.training  # the caller's mode is restored
    assert all(
        m.running_mean is None for m in model.modules() if isinstance(m, nn.BatchNorm2d)
    )  # static again


def test_a_one_by_one_feature_map_does_not_need_a_batch_of_one():
    """ResNet-18 on 8x8 inputs ends in 1x1 maps: an example normalised by its own statistics fails
    there."""
    model = build_model("resnet18", 10, 1, seed=0)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    data = _data(4, 1, 8, 10, seed=2)
    mask = np.ones(layout.size, dtype=bool)
    got = per_example_fisher(
        model, layout, params, mask, data, np.arange(4), None, torch.device("cpu")
    )
    assert np.isfinite(got).all() and got.max() > 0
    # Each example's share depends on that example only (and the fixed statistics): one chunk or
    # four agree.
    again = per_example_fisher(
        model, layout, params, mask, data, np.arange(4), None, torch.device("cpu"), 1, 512.0, True
    )
    np.testing.assert_allclose(got, again, rtol=1e-3, atol=1e-9)


def test_a_transformer_is_estimated_one_example_at_a_time(tmp_path):
    """transformers' mask helpers defeat vmap: the loop must give the mean of the one-example
    estimates."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from common.config.parse import parse_run_config
    from common.data.datasets import load_run_dataset
    from common.models.architectures import build_run_model
    from tests.tiny_text import news_dataset, tiny_bert, tiny_text_run

    run = parse_run_config(
        tiny_text_run(str(tiny_bert(tmp_path / "b")), str(news_dataset(tmp_path / "n")))
    )
    train = load_run_dataset(run).train.subset(np.arange(6))
    model = build_run_model(run, 4, 1)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    mask = np.random.default_rng(0).random(layout.size) < 0.4
    cpu = torch.device("cpu")
    got = per_example_fisher(model, layout, params, mask, train, np.arange(6), None, cpu, chunk=4)
    singles = [
        per_example_fisher(model, layout, params, mask, train, np.array([i]), None, cpu)
        for i in range(6)
    ]
    np.testing.assert_allclose(got, np.mean(singles, axis=0), rtol=1e-5, atol=1e-12)
    assert got[~mask].any()


def test_example_indices_bound_and_determinism():
    assert example_indices(10, 0, 1).tolist() == list(range(10))
    assert example_indices(10, 50, 1).tolist() == list(range(10))
    a = example_indices(1000, 64, 7)
    assert len(a) == 64 and len(set(a.tolist())) == 64 and np.all(np.diff(a) > 0)
    assert a.tolist() == example_indices(1000, 64, 7).tolist()
    assert a.tolist() != example_indices(1000, 64, 8).tolist()


def test_no_examples_is_an_error():
    model = build_model("cnn", 10, 1, seed=0)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    with pytest.raises(ValueError, match="no examples"):
        per_example_fisher(
            model,
            layout,
            params,
            np.ones(layout.size, bool),
            _data(4, 1, 8, 10, 0),
            np.array([], np.int64),
            None,
            torch.device("cpu"),
        )


def test_round_zero_of_the_warm_up_takes_no_local_step():
    from common.config.node import parse_node_config
    from common.config.parse import parse_run_config
    from common.training.loop import round_train_config

    run = parse_run_config({"local-epochs": 3})
    node = parse_node_config({"partition-id": 0, "num-partitions": 2, "capacity": 1.0}, "")
    assert round_train_config(run, node, 0).epochs == 0
    assert round_train_config(run, node, 1).epochs == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"fisher-every": 0}, "fisher-every"),
        ({"fisher-ema": 1.0}, "fisher-ema"),
        ({"fisher-estimator": "exact"}, "fisher-estimator"),
        ({"fisher-examples": -1}, "fisher-examples"),
    ],
)
def test_bad_fisher_settings_fail_naming_the_key(override, message):
    from common.config.parse import parse_run_config
    from common.config.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_run_config(override)


def test_a_warm_up_ranks_round_one_by_fisher_and_leaves_the_model_alone(tmp_path, monkeypatch):
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run_config = {
        "num-rounds": 1,
        "local-epochs": 1,
        "eval-every": 0,
        "fisher-estimator": "received",
        "fisher-examples": 16,
        "fisher-encoding": "ranked",
        "fisher-warmup": True,
        # the warm-up sends every node the whole model: beyond a byte budget
        "fedfibos-byte-budget": 0,
    }
    fed = inprocess_federation(run_config, {41: 1.0, 42: 0.25, 43: 0.0625})
    strategy, records, x0 = fed.strategy, fed.records, fed.x0
    seen: list[np.ndarray] = []
    real_warm_up = strategy.method.warm_up
    monkeypatch.setattr(
        strategy.method,
        "warm_up",
        lambda accepted, rnd: (seen.append(strategy.x.copy()), real_warm_up(accepted, rnd)),
    )
    strategy.start(fed.grid, strategy.to_arrays(x0), 1, 60.0, evaluate_fn=fed.evaluate_fn)
    assert np.array_equal(seen[0], x0)  # the warm-up replies did not move the model
    assert records[0]["fisher_warmup"]["replies"] == 3
    train = [m for m in fed.grid.handled if m.metadata.message_type == "train"]
    assert [int(m.content.config_records["submodel-config"]["round"]) for m in train] == [
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    assert {c["mask_source"] for c in records[1]["clients"]} == {"client"}  # not magnitude
