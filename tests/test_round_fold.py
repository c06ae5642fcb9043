"""Every method's round fold gives its batch aggregate (model and state) to the bit; min-replies
commits nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from common.aggregation.masked import MaskedUpdate
from common.config.parse import parse_run_config
from common.methods import create_method
from common.methods.round_fold import Accepted, BufferedFold, IncrementalFold, WarmUpFold
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.wire.validation import TrainReply

ROUND = 2
CAPACITIES = (1.0, 0.25, 0.0625, 0.25, 1.0)

#: Every synchronous element-wise method, with the settings that change its mean.
INCREMENTAL = [
    {"method": "fedfibos"},
    {"method": "fedfibos", "fedfibos-aggregation": "holders"},
    {
        "method": "fedfibos",
        "fisher-ema": 0.5,
        "fisher-memory-mb": 1.5,
    },  # evictions and blends inside the round
    {"method": "fedavg"},
    {"method": "fedavg-drop"},
    {"method": "heterofl"},
    {"method": "fedrolex"},
    {"method": "fedrolex", "width-weighting": "uniform"},
    {"method": "fiarse"},
    {"method": "fiarse", "fiarse-aggregation": "holders"},
    {"method": "fedgmr"},
]


@pytest.fixture(scope="module")
def model():
    m = build_model("cnn-bn", 10, 1, 0)
    layout = model_layout(m)
    return layout, layout.flatten(trainable_arrays(m))


def _method(raw, layout):
    method = create_method(parse_run_config({"model": "cnn-bn", **raw}))
    method.start_server(layout)
    return method


def _replies(method, layout, x, seed=0):
    """One reply per client on the mask the method gives it, with a Fisher when the method reads
    one."""
    rng = np.random.default_rng(seed)
    reads = method.upload_encoding(method.run) != "none"
    out = []
    for i, gamma in enumerate(CAPACITIES):
        key = f"client-{i}"
        mask, _ = method.mask_for(key, ROUND, gamma, x)
        idx = np.flatnonzero(mask).astype(np.int64)
        delta = (rng.standard_normal(idx.size) * 1e-2).astype(np.float32)
        fisher = rng.lognormal(0, 2, layout.size).astype(np.float32) if reads else None
        metrics = {"num-examples": float(50 + 10 * i), "train-loss": 1.0 / (1 + i)}
        out.append(
            Accepted(
                100 + i, key, TrainReply(MaskedUpdate(idx, delta, 50.0 + 10 * i), fisher, metrics)
            )
        )
    return out


def _batch_and_fold(raw, model, min_replies=1):
    layout, x = model
    base = _method(raw, layout)
    base.warm_up(
        _replies(base, layout, x, seed=1)[::2], ROUND - 1
    )  # earlier estimates: blends and evictions
    replies = _replies(base, layout, x)
    batch, folded = copy.deepcopy(base), copy.deepcopy(base)
    expected = batch.aggregate(x, replies, ROUND)
    fold = folded.round_fold(x, ROUND, min_replies)
    for a in replies:
        fold.add(a)
    return base, batch, folded, expected, fold, x


@pytest.mark.parametrize(
    "raw", INCREMENTAL, ids=lambda r: "+".join(f"{k}={v}" for k, v in r.items())
)
def test_the_fold_is_the_batch_aggregate_to_the_bit(raw, model):
    _, batch, folded, expected, fold, x = _batch_and_fold(raw, model)
    assert isinstance(fold, IncrementalFold)
    before = x.copy()
    new = fold.finish()
    assert new.tobytes() == expected.tobytes()
    assert folded.state_bytes() == batch.state_bytes()  # Fisher state, FedRolex counts, held masks
    assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize("raw", INCREMENTAL[:3] + [{"method": "fedgmr"}], ids=str)
def test_a_round_below_min_replies_leaves_the_state_untouched(raw, model):
    base, _, folded, _, fold, _ = _batch_and_fold(raw, model, min_replies=len(CAPACITIES) + 1)
    fold.discard()
    assert folded.state_bytes() == base.state_bytes()
    if hasattr(base, "fisher"):
        assert list(folded.fisher.clients) == list(base.fisher.clients)
    with pytest.raises(ValueError, match="min-replies"):
        fold.finish()


def test_the_state_waits_for_min_replies_then_takes_the_held_replies_in_order(model):
    layout, x = model
    method = _method({"method": "fedfibos"}, layout)
    replies = _replies(method, layout, x)
    fold = method.round_fold(x, ROUND, 3)
    fold.add(replies[0])
    fold.add(replies[1])
    assert method.fisher.clients == {}  # the round might still be skipped
    fold.add(replies[2])
    assert list(method.fisher.clients) == ["client-0", "client-1", "client-2"]


def test_a_refused_update_is_as_if_it_never_came(model):
    layout, x = model
    method = _method({"method": "fedfibos"}, layout)
    replies = _replies(method, layout, x)
    clean, dirty = copy.deepcopy(method), copy.deepcopy(method)
    bad = Accepted(
        7,
        "bad",
        TrainReply(MaskedUpdate(np.array([layout.size]), np.ones(1, np.float32), 1.0), None, {}),
    )
    fold_clean, fold_dirty = clean.round_fold(x, ROUND, 1), dirty.round_fold(x, ROUND, 1)
    for a in replies:
        fold_clean.add(a)
    for a in replies[:2] + [bad] + replies[2:]:
        try:
            fold_dirty.add(a)
        except ValueError:
            assert a is bad
    assert fold_clean.finish().tobytes() == fold_dirty.finish().tobytes()
    assert clean.state_bytes() == dirty.state_bytes()


def test_cahfp_buffers_and_its_fold_is_its_aggregate(model):
    layout, x = model
    method = _method({"method": "cahfp"}, layout)
    assert isinstance(method.round_fold(x, ROUND, 1), BufferedFold)


def test_a_subclass_that_changes_only_the_mean_is_buffered(model):
    layout, x = model
    method = _method({"method": "fedavg"}, layout)
    method.mean_step = lambda x, updates: x  # an instance attribute: the class's rule still folds
    assert isinstance(method.round_fold(x, ROUND, 1), IncrementalFold)

    class Halved(type(method)):
        def mean_step(self, x, updates):
            return x * 0.5

    halved = Halved(method.run)
    halved.start_server(layout)
    assert isinstance(halved.round_fold(x, ROUND, 1), BufferedFold)


def test_warm_up_fold_observes_each_reply_and_keeps_the_model(model):
    layout, x = model
    method = _method({"method": "fedfibos"}, layout)
    replies = _replies(method, layout, x)
    batch = copy.deepcopy(method)
    batch.warm_up(replies, 0)
    fold = WarmUpFold(method, x, 0, 2)
    for a in replies:
        fold.add(a)
    assert fold.finish() is x
    assert method.state_bytes() == batch.state_bytes()
