"""The published elements of HeteroFL and FedRolex: scaler, static BatchNorm, masked cross-entropy,
label split."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.update_means import update_count_mean_step
from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.data.datasets import load_dataset
from common.methods import create_method
from common.methods.contract.payloads import Received
from common.methods.fedrolex import count_weighted_positions
from common.methods.heterofl import HeteroFL
from common.methods.round_fold import Accepted
from common.models.architectures import (
    ScaledBatchNorm2d,
    Scaler,
    build_model,
    load_flat,
    model_layout,
    set_scaler_rate,
    trainable_arrays,
)
from common.models.layout import ParamLayout, TensorSpec
from common.models.structured import build_structured_model
from common.submodels.channel_slicing import selection_of_mask, slice_arrays
from common.submodels.label_split import (
    CLASSES,
    check_class_flags,
    class_of_position,
    num_outputs,
    output_layer,
    restrict_to_classes,
)
from common.submodels.width import channel_graph, held_width, width_mask, width_ratio
from common.training.loop import TrainConfig, round_train_config, train_masked
from common.wire import protocol as P
from common.wire.validation import ReplyError, ReplyRecords, SentSubmodel, TrainReply

CPU = torch.device("cpu")
RATES = [1.0, 0.5, 0.25, 0.125]


# ------------------------------------------------------------------ scaler
@pytest.mark.parametrize("rate", RATES)
def test_scaler_divides_by_the_rate_in_training_only(rate):
    x = torch.randn(3, 4, 5, 5)
    s = Scaler()
    s.rate = rate
    assert torch.equal(s.train()(x), x / rate)
    assert torch.equal(s.eval()(x), x)


@pytest.mark.parametrize("rate", RATES)
def test_scaled_batchnorm_is_norm_of_scaled_input(rate):
    x = torch.randn(6, 4, 3, 3) * 3 + 1
    bn = ScaledBatchNorm2d(4, track_running_stats=False)
    ref = nn.BatchNorm2d(4, track_running_stats=False)
    with torch.no_grad():
        for p, q in zip(bn.parameters(), ref.parameters()):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    bn.rate = rate
    assert torch.equal(bn.train()(x), ref.train()(x / rate))
    assert torch.equal(bn.eval()(x), ref.eval()(x))


@pytest.mark.parametrize(
    "name,convs,linear", [("cnn-bn", 2, 1), ("cnn", 2, 1), ("resnet18", 20, 0)]
)
def test_every_convolution_has_a_scaler_and_the_hidden_linear_one_is_optional(name, convs, linear):
    model = build_model(name, 10, 3 if name == "resnet18" else 1, 0)
    scalers = [m for m in model.modules() if isinstance(m, (Scaler, ScaledBatchNorm2d))]
    assert set_scaler_rate(model, 0.25) == convs  # ResNet-18: one before each of its 20 norms
    assert sorted(m.rate for m in scalers) == [0.25] * convs + [1.0] * linear
    assert set_scaler_rate(model, 0.25, hidden_linear=True) == convs + linear
    assert all(m.rate == 0.25 for m in scalers)
    with pytest.raises(ValueError, match="rate"):
        set_scaler_rate(model, 0.0)


@pytest.mark.parametrize("model_name", ["cnn-bn", "cnn"])
def test_hidden_linear_output_is_not_divided_by_the_rate_unless_asked(model_name, monkeypatch):
    """The published conv model scales its conv blocks only: by default ``fc1`` (no norm after it)
    is unscaled."""
    import common.methods.heterofl as heterofl

    real = heterofl.train_masked
    models = []

    def spy(model, *args, **kwargs):
        models.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(heterofl, "train_masked", spy)
    for scaler_linear, fc1_rate in ((False, 1.0), (True, 0.25)):
        key = "width-scaler-linear"
        r = _round(
            parse_run_config({"method": "heterofl", "model": model_name, key: scaler_linear}),
            1 / 16,
        )
        r.method.client_train(
            r.received, r.data, TrainConfig(epochs=1, batch_size=16, lr=0.05), CPU
        )
        model, seen = models.pop(), {}
        for name in ("conv1", "scale1", "fc1"):
            getattr(model, name).register_forward_hook(
                lambda m, i, o, name=name, seen=seen: seen.setdefault(name, o)
            )
        model.fc2.register_forward_pre_hook(lambda m, i, seen=seen: seen.setdefault("fc2-in", i[0]))
        with torch.no_grad():
            model.train()(torch.rand(8, 1, 8, 8))
        assert torch.allclose(
            seen["scale1"], seen["conv1"] / 0.25
        )  # conv blocks: divided by the rate
        assert torch.allclose(seen["fc2-in"], torch.relu(seen["fc1"] / fc1_rate))


def test_scaler_leaves_an_unscaled_model_bit_identical():
    """Rate 1 (every non-width method) computes exactly what the model without scalers computed."""
    model = build_model("cnn", 10, 1, 0).train()
    x = torch.randn(5, 1, 8, 8)
    ref = torch.relu(model.conv2(torch.relu(model.conv1(x))))
    ref = model.fc2(torch.relu(model.fc1(torch.flatten(model.pool(ref), 1))))
    assert torch.equal(model(x), ref)


@pytest.mark.parametrize("model_name", ["cnn-bn", "cnn-gn", "cnn", "resnet18"])
@pytest.mark.parametrize("gamma", [1, 1 / 4, 1 / 16, 1 / 64])
def test_client_rate_is_the_width_ratio(model_name, gamma):
    """The rate a client reads off its mask is ``sqrt(gamma)`` for the benchmark's capacities."""
    model = build_model(model_name, 10, 3 if model_name == "resnet18" else 1, 0)
    layout = model_layout(model)
    graph = channel_graph(model_name, layout)
    for roll in (0, 5):
        assert held_width(
            layout, graph, width_mask(layout, graph, width_ratio(gamma), roll)
        ) == math.sqrt(gamma)


def test_client_rate_for_an_uneven_ratio_is_the_smallest_kept_share():
    model = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(model)
    graph = channel_graph("cnn-bn", layout)
    r = width_ratio(1 / 8)
    expected = min(math.ceil(r * c) / c for c in (32, 64, 128))
    assert held_width(layout, graph, width_mask(layout, graph, r)) == expected
    assert r < expected < r + 1 / 128


def test_heterofl_client_trains_with_the_scaler_and_evaluates_without(monkeypatch):
    """The client sets the scaler to its width before training; the evaluated model is unscaled."""
    run = parse_run_config({"method": "heterofl", "model": "cnn-bn"})
    r = _round(run, gamma=1 / 16)
    seen = []
    import common.methods.heterofl as heterofl

    real = heterofl.train_masked

    def spy(model, *args, **kwargs):
        seen.append(sorted({m.rate for m in model.modules() if isinstance(m, Scaler)}))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(heterofl, "train_masked", spy)
    r.method.client_train(r.received, r.data, TrainConfig(epochs=1, batch_size=16, lr=0.05), CPU)
    assert seen == [[0.25, 1.0]]  # the convolutions' scalers; the hidden linear layer's stays at 1
    evaluated = r.method.client_model(r.received, r.data)
    assert {m.rate for m in evaluated.modules() if isinstance(m, Scaler)} == {1.0}

    off = parse_run_config({"method": "heterofl", "model": "cnn-bn", "width-scaler": False})
    r = _round(off, gamma=1 / 16)
    seen.clear()
    r.method.client_train(r.received, r.data, TrainConfig(epochs=1, batch_size=16, lr=0.05), CPU)
    assert seen == [[1.0]]


# ------------------------------------------------------------- static BatchNorm
@pytest.mark.parametrize("name", ["cnn-bn", "resnet18"])
def test_static_batchnorm_keeps_no_running_statistics(name):
    model = build_model(name, 10, 3 if name == "resnet18" else 1, 0)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(not m.track_running_stats and m.running_mean is None for m in norms)
    assert not any("running" in k or "num_batches" in k for k in model.state_dict())


def test_static_batchnorm_normalises_with_the_batch_it_sees():
    """Evaluation uses the batch's own statistics: no state carries over from training batches."""
    model = build_model("cnn-bn", 10, 1, 0)
    x = torch.rand(16, 1, 8, 8)
    with torch.no_grad():
        before = model.eval()(x)
        model.train()(torch.rand(64, 1, 8, 8) * 10)  # a training pass of very different data
        after = model.eval()(x)
        train_mode = model.train()(x)
    assert torch.equal(before, after)
    assert torch.allclose(before, train_mode, atol=1e-6)  # scaler rate 1: train and eval agree
    inner = nn.Sequential(model.conv1, model.bn1).eval()
    with torch.no_grad():
        h = inner(x)
    mean, var = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=False)
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-5)
    assert torch.allclose(var, var.new_full(var.shape, 1.0), atol=1e-3)


@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.125])
@pytest.mark.parametrize("training", [True, False])
def test_bn_width_submodel_equals_physically_smaller_network(ratio, training):
    """Masked full-shape cnn-bn == narrower cnn-bn with the kept channels (norms of unheld channels
    inert)."""
    model = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(model)
    graph = channel_graph("cnn-bn", layout)
    rng = np.random.default_rng(0)
    x = layout.flatten(trainable_arrays(model)) + rng.normal(0, 0.1, layout.size).astype(np.float32)
    mask = width_mask(layout, graph, ratio, roll=3)
    full = build_model("cnn-bn", 10, 1, 0)
    load_flat(full, layout, np.where(mask, x, 0).astype(np.float32))
    small = build_structured_model(
        build_model("cnn-bn", 10, 1, 0),
        slice_arrays(layout, graph, selection_of_mask(layout, graph, mask), layout.unflatten(x)),
    )
    for m in (full, small):
        set_scaler_rate(m, held_width(layout, graph, mask))
        m.train(training)
    inputs = torch.rand(12, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(full(inputs), small(inputs), atol=1e-5)


# ---------------------------------------------------------------- label split
def test_output_layer_is_the_classifier():
    for name, ch, head in [("cnn-bn", 1, "fc2"), ("cnn", 1, "fc2"), ("resnet18", 3, "fc")]:
        layout = model_layout(build_model(name, 7, ch, 0))
        assert output_layer(layout) == (f"{head}.weight", f"{head}.bias")
        assert num_outputs(layout) == 7
        cls = class_of_position(layout)
        named = layout.unflatten(cls)
        assert np.array_equal(named[f"{head}.bias"], np.arange(7))
        assert np.array_equal(
            named[f"{head}.weight"],
            np.repeat(np.arange(7)[:, None], layout.unflatten(cls)[f"{head}.weight"].shape[1], 1),
        )
        assert (cls >= 0).sum() == named[f"{head}.weight"].size + 7


def _brute_force(x, updates, held, position_class, server_lr):
    """Per position: mean over the clients that hold it and (for a classifier row) hold its
    class."""
    out = x.copy()
    for j in range(x.size):
        num = den = 0.0
        for u, h in zip(updates, held):
            where = np.flatnonzero(u.indices == j)
            c = position_class[j]
            if where.size and (c < 0 or h[c]):
                num += u.weight * float(u.delta[where[0]])
                den += u.weight
        if den > 0:
            out[j] = np.float32(float(x[j]) + server_lr * num / den)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_label_split_aggregation_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    # A toy layout: a hidden weight (3x2), then a classifier of 4 classes (4x3 weight, 4 bias).
    layout = ParamLayout(
        (
            TensorSpec("h.weight", (3, 2)),
            TensorSpec("out.weight", (4, 3)),
            TensorSpec("out.bias", (4,)),
        )
    )
    cls = class_of_position(layout)
    x = rng.normal(size=layout.size).astype(np.float32)
    updates, held = [], []
    for _ in range(rng.integers(1, 5)):
        idx = np.flatnonzero(rng.random(layout.size) < 0.7)
        updates.append(
            MaskedUpdate(
                idx, rng.normal(size=idx.size).astype(np.float32), float(rng.integers(1, 4))
            )
        )
        h = rng.random(4) < 0.5
        h[rng.integers(4)] = True
        held.append(h)
    got = aggregate_masked(x, [restrict_to_classes(u, cls, h) for u, h in zip(updates, held)], 0.7)
    assert np.allclose(got, _brute_force(x, updates, held, cls, 0.7), rtol=0, atol=1e-6)


def test_label_split_rows_average_only_over_holders():
    """Class 0 held by A and B, class 1 by C only, class 2 by nobody: rows 0, 1 and 2 as written."""
    layout = ParamLayout((TensorSpec("out.weight", (3, 2)), TensorSpec("out.bias", (3,))))
    cls = class_of_position(layout)
    x = np.zeros(layout.size, dtype=np.float32)
    every = np.arange(layout.size)
    dA, dB, dC = (np.full(layout.size, v, dtype=np.float32) for v in (1.0, 3.0, 10.0))
    held = [np.array([1, 0, 0], bool), np.array([1, 0, 0], bool), np.array([0, 1, 0], bool)]
    ups = [
        restrict_to_classes(MaskedUpdate(every, d, 1.0), cls, h) for d, h in zip((dA, dB, dC), held)
    ]
    new = layout.unflatten(aggregate_masked(x, ups))
    assert np.all(new["out.weight"][0] == 2.0) and new["out.bias"][0] == 2.0
    assert np.all(new["out.weight"][1] == 10.0) and new["out.bias"][1] == 10.0
    assert np.all(new["out.weight"][2] == 0.0) and new["out.bias"][2] == 0.0
    # Without the split every client counts for every row: the absent classes dilute each mean.
    plain = layout.unflatten(
        aggregate_masked(x, [MaskedUpdate(every, d, 1.0) for d in (dA, dB, dC)])
    )
    assert np.all(plain["out.weight"] == 14.0 / 3)


def test_class_flags_are_checked():
    assert check_class_flags(np.array([0, 1, 1], np.uint8), 3).tolist() == [False, True, True]
    for bad, why in [
        (np.array([0, 1], np.uint8), "uint8"),
        (np.array([0, 1, 1], np.int64), "uint8"),
        (np.array([0, 2, 1], np.uint8), "0 and 1"),
        (np.zeros(3, np.uint8), "no class"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_class_flags(bad, 3)


# ------------------------------------------------------- FedRolex aggregation
def _published_combine(layout, x, clients, tmp_counts):
    """FedRolex's ``ResnetServerRoll.combine`` with ``--weighting avg``, restated over a flat
    layout.

    ``clients``: ``(held, local)`` in the order the server adds them: the flat positions taken from
    the client (classifier rows cut to its classes) and its trained parameters, full shape.
    ``tmp_counts``: the server's per-tensor counts. Returns the new flat parameters and counts.
    """
    classifier, _ = output_layer(layout)
    new = {k: v.astype(np.float64) for k, v in layout.unflatten(x).items()}
    cpy = {
        k: v.copy() for k, v in tmp_counts.items()
    }  # tmp_counts_cpy = copy.deepcopy(self.tmp_counts)
    counts = tmp_counts  # self.tmp_counts
    for k, v in layout.unflatten(x).items():
        tmp_v, count = np.zeros(v.shape), np.zeros(v.shape)
        for held, local in clients:
            h, lv = layout.unflatten(held)[k], layout.unflatten(local)[k].astype(np.float64)
            K = (
                np.ones(v.shape) if v.ndim > 1 and k != classifier else counts[k]
            )  # avg: K = 1 on hidden weights
            tmp_v[h] += K[h] * lv[h]
            count[h] += K[h]
            cpy[k][h] += 1
        new[k][count > 0] = tmp_v[count > 0] / count[count > 0]
        counts = cpy  # self.tmp_counts = tmp_counts_cpy, inside the loop over tensors
    return layout.flatten(new), cpy


def _rolex_round(rng, layout, x, clients=4):
    """Random held positions (classifier rows cut to random classes) and trained parameters of a few
    clients."""
    cls = class_of_position(layout)
    out = []
    for _ in range(clients):
        held = rng.random(layout.size) < 0.6
        classes = rng.random(num_outputs(layout)) < 0.6
        held &= (cls < 0) | classes[np.maximum(cls, 0)]
        out.append((held, (x + rng.normal(size=x.size)).astype(np.float32)))
    return out


TOY_LAYOUTS = {
    "hidden-first": (
        TensorSpec("h.weight", (3, 2)),
        TensorSpec("h.bias", (3,)),
        TensorSpec("n.weight", (3,)),
        TensorSpec("out.weight", (4, 3)),
        TensorSpec("out.bias", (4,)),
    ),
    "norm-first": (
        TensorSpec("n.weight", (2,)),
        TensorSpec("h.weight", (3, 2)),
        TensorSpec("out.weight", (4, 3)),
    ),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("toy", sorted(TOY_LAYOUTS))
def test_fedrolex_avg_weighting_matches_the_published_combine(toy, seed):
    """Three rounds of :func:`update_count_mean_step` == the published loop, counts carried between
    rounds."""
    rng = np.random.default_rng(seed)
    layout = ParamLayout(TOY_LAYOUTS[toy])
    counted, fixed = count_weighted_positions(layout)
    classifier, _ = output_layer(layout)
    expected_counted = np.concatenate(
        [np.full(t.size, len(t.shape) == 1 or t.name == classifier) for t in layout.tensors]
    )
    assert np.array_equal(counted, np.flatnonzero(expected_counted))
    x = rng.normal(size=layout.size).astype(np.float32)
    pub_x, pub_counts = x, {t.name: np.ones(t.shape) for t in layout.tensors}
    counts = np.ones(counted.size, dtype=np.int64)
    for _ in range(3):
        clients = _rolex_round(rng, layout, x)
        updates = [
            MaskedUpdate(np.flatnonzero(h), (lv[h] - x[h]).astype(np.float32), 9.0)
            for h, lv in clients
        ]
        x, counts = update_count_mean_step(x, updates, counted, counts, fixed)
        pub_x, pub_counts = _published_combine(layout, pub_x, clients, pub_counts)
        np.testing.assert_allclose(x, pub_x, rtol=0, atol=1e-5)
        assert np.array_equal(counts, layout.flatten(pub_counts)[counted].astype(np.int64))
    # The count weights matter: the count-weighted positions differ from the holder mean.
    holders = aggregate_masked(x, [MaskedUpdate(u.indices, u.delta, 1.0) for u in updates])
    assert not np.allclose(
        update_count_mean_step(x, updates, counted, counts, fixed)[0][counted], holders[counted]
    )


def test_fedrolex_server_aggregates_as_published_and_keeps_its_counts():
    """The method's default aggregation over two rounds == the published loop; the counts survive a
    checkpoint."""
    rng = np.random.default_rng(5)
    run = parse_run_config({"method": "fedrolex", "model": "cnn-bn"})
    method = create_method(run)
    model = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(model)
    method.start_server(layout)
    x = layout.flatten(trainable_arrays(model))
    pub_x, pub_counts = x, {t.name: np.ones(t.shape) for t in layout.tensors}
    cls = class_of_position(layout)
    for rnd in (1, 2):
        clients, accepted = [], []
        for i, gamma in enumerate((1.0, 1 / 4, 1 / 16)):
            mask, _ = method.mask_for(str(i), rnd, gamma, x)
            classes = rng.random(10) < 0.5
            classes[i] = True
            held = mask & ((cls < 0) | classes[np.maximum(cls, 0)])
            local = (x + rng.normal(0, 0.1, x.size)).astype(np.float32)
            clients.append((held, local))
            update = MaskedUpdate(
                np.flatnonzero(held), (local[held] - x[held]).astype(np.float32), 1.0
            )
            accepted.append(Accepted(i, str(i), TrainReply(update, None, {})))
        x = method.aggregate(x, accepted, rnd)
        pub_x, pub_counts = _published_combine(layout, pub_x, clients, pub_counts)
        np.testing.assert_allclose(x, pub_x, rtol=0, atol=1e-5)
    restored = create_method(run)
    restored.start_server(layout)
    restored.load_state(method.state_bytes())
    assert np.array_equal(
        restored.counts, layout.flatten(pub_counts)[restored.counted].astype(np.int64)
    )
    assert restored.counts.max() > 1
    uniform = create_method(parse_run_config({"method": "fedrolex", "width-weighting": "uniform"}))
    assert uniform.state_bytes() == b""


# ------------------------------------------------------ the method, end to end
def _two_class_client(n: int = 64) -> ArrayDataset:
    data = load_dataset("digits", 0.2, 0).train
    keep = np.flatnonzero(np.isin(data.y, [3, 7]))[:n]
    return ArrayDataset(data.x[keep], data.y[keep], 10)


@dataclass
class Round:
    """One client's round: the method (server and client side), what it was sent, its data."""

    method: HeteroFL
    received: Received
    data: ArrayDataset
    x: np.ndarray
    mask: np.ndarray

    def sent(self) -> SentSubmodel:
        return SentSubmodel(1, 3, self.mask, self.received.digest, len(self.data))


META = {"round": 3}


def _round(run, gamma) -> Round:
    data = _two_class_client()
    method = create_method(run)
    model = build_model(run.model, 10, 1, run.seed)
    layout = model_layout(model)
    method.start_server(layout)
    x = layout.flatten(trainable_arrays(model))
    mask, _ = method.mask_for("c", 3, gamma, x)
    down = method.encode(x, mask)
    return Round(
        method, Received(down.records, down.kind, down.digest, layout.size, 3), data, x, mask
    )


def _metrics(upd) -> dict[str, float]:
    return {
        "num-examples": upd.num_examples,
        "train-loss": upd.loss,
        "train-seconds": 1.0,
        "fisher-seconds": 0.0,
    }


@pytest.mark.parametrize("name", ["heterofl", "fedrolex"])
def test_reply_carries_classes_and_the_server_cuts_the_classifier_to_them(name):
    run = parse_run_config({"method": name, "model": "cnn-bn", "momentum": 0.0})
    r = _round(run, gamma=1 / 4)
    cfg = TrainConfig(
        epochs=1, batch_size=16, lr=0.05, label_mask=run.label_mask
    )  # the run's: `auto` = on
    upd = r.method.client_train(r.received, r.data, cfg, CPU)
    assert upd.arrays[CLASSES].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    cls = class_of_position(r.method.layout)
    sent_idx = np.flatnonzero(r.mask)
    absent_rows = (cls[sent_idx] >= 0) & ~np.isin(cls[sent_idx], [3, 7])
    # Masked cross-entropy (on by default): absent classes' rows are not trained at all.
    assert np.all(upd.arrays[P.DELTA][absent_rows] == 0) and np.any(
        upd.arrays[P.DELTA][~absent_rows] != 0
    )
    meta = META | {"mask-digest": r.received.digest}
    reply = r.method.validate(ReplyRecords(upd.arrays, _metrics(upd), meta), r.sent(), r.x)
    kept = cls[reply.update.indices]
    assert set(np.unique(kept[kept >= 0])) == {3, 7}
    assert reply.update.weight == 1.0  # published weighting: every client counts once
    assert reply.update.indices.size == sent_idx.size - absent_rows.sum()
    missing = {k: v for k, v in upd.arrays.items() if k != CLASSES}
    with pytest.raises(ReplyError, match="classes"):
        r.method.validate(ReplyRecords(missing, _metrics(upd), meta), r.sent(), r.x)
    with pytest.raises(ReplyError, match="no class"):
        r.method.validate(
            ReplyRecords(missing | {CLASSES: np.zeros(10, np.uint8)}, _metrics(upd), meta),
            r.sent(),
            r.x,
        )


def test_published_elements_can_be_switched_off():
    run = parse_run_config(
        {
            "method": "heterofl",
            "model": "cnn-bn",
            "momentum": 0.0,
            "label-mask": False,
            "width-label-split": False,
            "width-weighting": "examples",
        }
    )
    r = _round(run, gamma=1 / 4)
    upd = r.method.client_train(
        r.received, r.data, TrainConfig(epochs=1, batch_size=16, lr=0.05), CPU
    )
    assert CLASSES not in upd.arrays
    cls = class_of_position(r.method.layout)[np.flatnonzero(r.mask)]
    assert np.any(
        upd.arrays[P.DELTA][(cls >= 0) & ~np.isin(cls, [3, 7])] != 0
    )  # absent classes pushed down
    meta = META | {"mask-digest": r.received.digest}
    reply = r.method.validate(ReplyRecords(upd.arrays, _metrics(upd), meta), r.sent(), r.x)
    assert reply.update.indices.size == r.mask.sum() and reply.update.weight == len(r.data)


def test_width_keys_are_shared_by_both_width_methods_with_their_published_defaults():
    width = parse_run_config({"method": "fedrolex", "width-scaler": False}).options("width")
    assert width.scaler is False
    heterofl, fedrolex = (
        create_method(parse_run_config({"method": m})) for m in ("heterofl", "fedrolex")
    )
    o = heterofl.opts
    assert (o.scaler, o.scaler_linear, o.label_split, o.roll) == (True, False, True, "down")
    assert (heterofl.weighting, fedrolex.weighting) == (
        "uniform",
        "avg",
    )  # width-weighting = "auto"
    for run in (
        heterofl.run,
        fedrolex.run,
    ):  # the common keys' `auto`: the published local training
        assert (run.label_mask, run.clip_grad_norm) == (True, 1.0)
    with pytest.raises(ConfigError, match="width-weighting"):
        parse_run_config(
            {"method": "heterofl", "width-weighting": "avg"}
        )  # HeteroFL counts every holder once
    assert (
        create_method(
            parse_run_config({"method": "fedrolex", "width-weighting": "uniform"})
        ).weighting
        == "uniform"
    )
    with pytest.raises(ConfigError, match="width-roll"):
        parse_run_config({"width-roll": "left"})
    with pytest.raises(ConfigError, match="width-weighting"):
        parse_run_config({"width-weighting": "median"})
    with pytest.raises(ConfigError, match="width-label-split"):
        parse_run_config({"width-label-split": "yes"})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("heterofl-clip-grad", "clip-grad-norm"),
        ("fedrolex-label-mask", "label-mask"),
        ("heterofl-scaler", "width-scaler"),
        ("fedrolex-roll", "width-roll"),
        ("gmr-server-lr", "server-lr"),
        ("gmr-capacity-kind", "capacity-kind"),
    ],
)
def test_a_merged_key_is_refused_naming_the_key_that_replaced_it(old, new):
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        parse_run_config({old: 1.0})


@pytest.mark.parametrize("clip", [0.01, 0.0])
def test_gradient_clipping_bounds_a_step(clip):
    """One full-batch SGD step without momentum moves the weights by ``lr * min(|g|, clip)``."""
    data = _two_class_client(32)
    model = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    mask = np.ones(layout.size, dtype=bool)
    cfg = TrainConfig(epochs=1, batch_size=len(data), lr=0.1, clip_grad_norm=clip)
    step = np.linalg.norm(
        train_masked(build_model("cnn-bn", 10, 1, 0), layout, x, mask, data, cfg, CPU).params - x
    )
    if clip:
        assert step == pytest.approx(0.1 * clip, rel=1e-3)
    else:
        assert step > 0.1 * 0.01 * 10  # the raw gradient is far above the clip above


def test_clip_keys_reach_local_training(monkeypatch):
    """``clip-grad-norm`` clips any method's local steps; ``auto`` is 1 for the width methods, 0 for
    the others."""
    node = NodeConfig(partition_id=0, num_partitions=1, capacity=1.0)
    assert (
        round_train_config(parse_run_config({"clip-grad-norm": 0.5}), node, 1).clip_grad_norm == 0.5
    )
    assert round_train_config(parse_run_config({}), node, 1).clip_grad_norm == 0.0
    assert (
        round_train_config(parse_run_config({"method": "heterofl"}), node, 1).clip_grad_norm == 1.0
    )
    with pytest.raises(ConfigError, match="clip-grad-norm"):
        parse_run_config({"clip-grad-norm": -1.0})
    run = parse_run_config({"method": "heterofl", "model": "cnn-bn", "clip-grad-norm": 0.5})
    r = _round(run, gamma=1 / 4)
    import common.methods.heterofl as heterofl

    seen = []
    real = heterofl.train_masked

    def spy(model, layout, params, mask, data, cfg, *args, **kwargs):
        seen.append(cfg.clip_grad_norm)
        return real(model, layout, params, mask, data, cfg, *args, **kwargs)

    monkeypatch.setattr(heterofl, "train_masked", spy)
    r.method.client_train(r.received, r.data, round_train_config(run, node, 1), CPU)
    assert seen == [0.5]  # one key: the run's setting, never overridden by the method
