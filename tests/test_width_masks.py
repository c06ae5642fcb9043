"""HeteroFL / FedRolex width submodels and the per-method mask dispatch of the strategy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.methods import create_method
from common.models.architectures import build_model, load_flat, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.submodels.label_split import output_layer
from common.submodels.width import (
    SMALL_CNN_GRAPH,
    channel_graph,
    kept_channels,
    width_mask,
    width_ratio,
)
from server.strategy import SubmodelStrategy
from server.strategy_core.node_registry import NodeProfile

GRAPH = SMALL_CNN_GRAPH


@pytest.fixture(scope="module")
def cnn():
    model = build_model("cnn", 10, 1, 0)
    return model, model_layout(model)


def _named(layout: ParamLayout, mask: np.ndarray) -> dict[str, np.ndarray]:
    return {n: m.copy() for n, m in layout.unflatten(mask).items()}


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25, 0.125])
def test_heterofl_keeps_first_channels_and_all_classifier_outputs(cnn, ratio):
    _, layout = cnn
    m = _named(layout, width_mask(layout, GRAPH, ratio))
    c1, c2, f1 = (math.ceil(ratio * n) for n in (32, 64, 128))
    assert m["conv1.weight"][:c1].all() and not m["conv1.weight"][c1:].any()
    assert m["conv1.bias"].sum() == c1
    assert m["conv2.weight"][:c2, :c1].all() and m["conv2.weight"].sum() == c2 * c1 * 9
    cols = np.repeat(np.arange(64) < c2, 16)
    assert np.array_equal(m["fc1.weight"], np.outer(np.arange(128) < f1, cols))
    assert m["fc2.weight"][:, :f1].all() and m["fc2.weight"].sum() == 10 * f1
    assert m["fc2.bias"].all()


def test_width_submodel_equals_physically_smaller_network(cnn):
    """The masked full-shape model computes what a narrower CNN with the kept channels computes."""
    model, layout = cnn
    x = layout.flatten(trainable_arrays(model))
    mask = width_mask(layout, GRAPH, 0.5)
    full = build_model("cnn", 10, 1, 0)
    load_flat(full, layout, np.where(mask, x, 0).astype(np.float32))
    small = build_model("cnn", 10, 1, 0)
    small.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
    small.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
    small.fc1 = torch.nn.Linear(32 * 16, 64)
    small.fc2 = torch.nn.Linear(64, 10)
    named = layout.unflatten(x)
    with torch.no_grad():
        small.conv1.weight.copy_(torch.from_numpy(named["conv1.weight"][:16]))
        small.conv1.bias.copy_(torch.from_numpy(named["conv1.bias"][:16]))
        small.conv2.weight.copy_(torch.from_numpy(named["conv2.weight"][:32, :16]))
        small.conv2.bias.copy_(torch.from_numpy(named["conv2.bias"][:32]))
        small.fc1.weight.copy_(torch.from_numpy(named["fc1.weight"][:64, : 32 * 16]))
        small.fc1.bias.copy_(torch.from_numpy(named["fc1.bias"][:64]))
        small.fc2.weight.copy_(torch.from_numpy(named["fc2.weight"][:, :64]))
        small.fc2.bias.copy_(torch.from_numpy(named["fc2.bias"]))
    inp = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(full(inp), small(inp), rtol=1e-5, atol=1e-5)


def test_fedrolex_window_rolls_and_covers_every_channel(cnn):
    _, layout = cnn
    assert np.array_equal(kept_channels(8, 0.25, 7), [7, 0])
    rows_covered = np.zeros(layout.num_rows, dtype=bool)
    for rnd in range(128):
        m = width_mask(layout, GRAPH, 0.25, roll=rnd)
        assert m.sum() == width_mask(layout, GRAPH, 0.25).sum()  # same size every round
        rows_covered[np.unique(layout.row_ids[m])] = True
    assert (
        rows_covered.all()
    )  # every output unit of every layer is trained by small clients at some point
    assert not np.array_equal(
        width_mask(layout, GRAPH, 0.25, 1), width_mask(layout, GRAPH, 0.25, 2)
    )


def _published_window(c: int, k: int, t: int) -> set[int]:
    """FedRolex's ``ResnetServerRoll.split_model`` (``overlap`` None), ``t`` its round counter (0
    first)."""
    roll = t % c
    return set(torch.roll(torch.arange(c), roll, -1)[:k].tolist())


@pytest.mark.parametrize("model_name", ["cnn", "resnet18"])
@pytest.mark.parametrize("gamma", [1 / 4, 1 / 16])
def test_fedrolex_window_is_the_published_roll(model_name, gamma):
    """Server round ``n`` keeps the published window of round ``n - 1``: round 1 is HeteroFL's
    slice, then down."""
    model = build_model(model_name, 10, 3 if model_name == "resnet18" else 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    rolex = create_method(parse_run_config({"method": "fedrolex", "model": model_name}))
    hetero = create_method(parse_run_config({"method": "heterofl", "model": model_name}))
    up = create_method(
        parse_run_config({"method": "fedrolex", "model": model_name, "width-roll": "up"})
    )
    for m in (rolex, hetero, up):
        m.start_server(layout)
    assert np.array_equal(rolex.mask_for("a", 1, gamma, x)[0], hetero.mask_for("a", 1, gamma, x)[0])
    r = math.sqrt(gamma)
    for server_round in [1, 2, 3, 7, 33, 70] if model_name == "cnn" else [1, 2, 65]:
        named = _named(layout, rolex.mask_for("a", server_round, gamma, x)[0])
        named_up = _named(layout, up.mask_for("a", server_round, gamma, x)[0])
        for t in layout.tensors:
            if len(t.shape) < 2 or t.name == output_layer(layout)[0]:
                continue  # 1-D tensors follow their layer; the classifier keeps every class
            c = t.shape[0]
            rows = set(np.flatnonzero(named[t.name].reshape(c, -1).any(axis=1)).tolist())
            assert rows == _published_window(c, math.ceil(r * c), server_round - 1), (
                t.name,
                server_round,
            )
            rows_up = set(np.flatnonzero(named_up[t.name].reshape(c, -1).any(axis=1)).tolist())
            assert rows_up == set(
                kept_channels(c, r, server_round % c).tolist()
            )  # the other reading


def test_width_ratio_gives_about_gamma_of_the_parameters(cnn):
    _, layout = cnn
    for gamma in (1.0, 0.25, 0.0625):
        density = width_mask(layout, GRAPH, width_ratio(gamma)).mean()
        assert gamma * 0.8 <= density <= gamma * 1.3, (gamma, density)
    with pytest.raises(ValueError):
        width_ratio(0)


def test_structured_methods_need_a_channel_graph(monkeypatch):
    import common.submodels.width

    monkeypatch.setattr(common.submodels.width, "WIDTH_MODELS", ("cnn",))
    with pytest.raises(ConfigError, match="channel graph"):
        parse_run_config({"method": "heterofl", "model": "resnet18"})
    with pytest.raises(ValueError, match="no channel graph"):
        channel_graph("vit", ParamLayout(()))


def test_resnet18_width_submodel_ties_residual_channels_and_matches_a_narrow_forward():
    """Masked ResNet-18: dropped channels stay exactly zero through every residual block."""
    model = build_model("resnet18", 10, 3, 0)
    layout = model_layout(model)
    mask = width_mask(layout, channel_graph("resnet18", layout), 0.5, roll=3)
    named = _named(layout, mask)
    block_out = named["layer2.0.conv2.weight"].reshape(128, -1).any(axis=1)
    shortcut_out = named["layer2.0.downsample.0.weight"].reshape(128, -1).any(axis=1)
    assert np.array_equal(block_out, shortcut_out) and block_out.sum() == 64
    assert named["conv1.weight"][:, :, 0, 0].any(axis=0).all()  # every image channel is read
    assert named["fc.weight"].any(axis=1).all() and named["fc.bias"].all()  # every class is scored
    assert 0.2 < mask.mean() < 0.3
    x = layout.flatten(trainable_arrays(model))
    load_flat(model, layout, np.where(mask, x, 0).astype(np.float32))
    feats = {}
    model.layer3.register_forward_hook(lambda m, i, o: feats.setdefault("layer3", o))
    model(torch.randn(2, 3, 32, 32))
    dropped = ~named["layer3.0.conv2.weight"].reshape(256, -1).any(axis=1)
    assert dropped.sum() == 128 and torch.all(feats["layer3"][:, torch.from_numpy(dropped)] == 0)


@pytest.mark.parametrize(
    "method,source",
    [("heterofl", "width"), ("fedrolex", "width"), ("fedavg", "full"), ("fiarse", "threshold")],
)
def test_strategy_dispatches_mask_by_method(cnn, method, source):
    model, layout = cnn
    s = SubmodelStrategy(parse_run_config({"method": method}), layout)
    s.x = layout.flatten(trainable_arrays(model))
    s.registry.nodes = {1: NodeProfile(1.0, "cpu", 10, 2), 2: NodeProfile(0.25, "cpu", 10, 2)}
    mask, got = s.node_mask(2, 3)
    assert got == source
    assert mask.mean() == (1.0 if method == "fedavg" else pytest.approx(0.25, abs=0.07))
    assert s.registry.participants() == [1, 2]


def test_fedavg_drop_trains_only_full_capacity_nodes(cnn):
    _, layout = cnn
    s = SubmodelStrategy(parse_run_config({"method": "fedavg-drop"}), layout)
    s.registry.nodes = {
        5: NodeProfile(0.5, "cpu", 10, 2),
        7: NodeProfile(1.0, "cpu", 10, 2),
        9: NodeProfile(1.0, "cpu", 1, 1),
    }
    assert s.registry.participants() == [7, 9]
    assert s.node_mask(5, 1)[0].all()
