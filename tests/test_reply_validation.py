"""Every kind of malformed TRAIN reply is rejected and leaves the global state bit-identical."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.data.datasets import load_dataset
from common.data.partitioning import partition_indices
from common.fisher.codec import encode_fisher
from common.methods import create_method
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.loop import TrainConfig, train_masked
from common.wire import protocol as P
from common.wire.validation import SentSubmodel, validate_evaluate_reply, validate_profile
from server.replies import ReplyParts
from server.strategy import SubmodelStrategy
from server.strategy_core.node_registry import NodeProfile
from server.strategy_core.round_plan import TrainPlan
from server.strategy_core.round_records import ClientRound

ROUND = 3
GOOD, OTHER = 11, 2**63 + 5  # Flower node ids are unsigned 64-bit


def _setup():
    cfg = parse_run_config({"fisher-encoding": "masked"})
    pool = load_dataset("digits", 0.2, 0).train
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    strategy = SubmodelStrategy(cfg, layout)
    strategy.x = layout.flatten(trainable_arrays(model))
    plan = TrainPlan(ROUND, strategy.x)
    replies = {}
    for node_id, gamma, part in ((GOOD, 0.25, 0), (OTHER, 0.5, 1)):
        data = pool.subset(partition_indices(pool.y, "iid", 2, part, 0))
        strategy.registry.nodes[node_id] = NodeProfile(
            gamma, "cpu", len(data), 10, f"partition-{part}"
        )
        mask, _ = strategy.node_mask(node_id, ROUND)
        from common.wire.protocol import encode_submodel

        payload = encode_submodel(strategy.x, mask)
        plan.sent[node_id] = SentSubmodel(node_id, ROUND, mask, payload.digest, len(data))
        plan.clients[node_id] = ClientRound(
            node_id, gamma, "cpu", "magnitude", int(mask.sum()), 0.0, 0, 0, 0, ""
        )
        res = train_masked(
            build_model("cnn", 10, 1, 0),
            layout,
            np.where(mask, strategy.x, 0),
            mask,
            data,
            TrainConfig(1, 32, 0.1, 0.9),
            torch.device("cpu"),
        )
        arrays = {P.DELTA: (res.params - strategy.x)[mask].astype(np.float32)}
        arrays.update(encode_fisher(res.fisher, mask, layout, "masked"))
        replies[node_id] = ReplyParts(
            node_id=node_id,
            arrays=arrays,
            metrics={
                "num-examples": len(data),
                "train-loss": 1.0,
                "train-seconds": 0.5,
                "fisher-seconds": 0.01,
            },
            meta={"round": ROUND, "mask-digest": payload.digest},
        )
    return strategy, plan, replies


@pytest.fixture(scope="module")
def base():
    return _setup()


def _mutate_arrays(fn):
    def apply(r: ReplyParts) -> ReplyParts:
        fn(r.arrays)
        return r

    return apply


def _set(record: str, key: str, value):
    def apply(r: ReplyParts) -> ReplyParts:
        getattr(r, record)[key] = value
        return r

    return apply


def _drop(attr: str):
    def apply(r: ReplyParts) -> ReplyParts:
        setattr(r, attr, None)
        return r

    return apply


def _poison(name: str, index: int, value: float):
    def fn(a):
        a[name] = a[name].copy()
        a[name][index] = value

    return _mutate_arrays(fn)


CATALOGUE = {
    "node error": lambda r: ReplyParts(r.node_id, error="node returned an error: boom"),
    "undecodable payload": lambda r: ReplyParts(r.node_id, error="undecodable reply: ValueError"),
    "missing update record": _drop("arrays"),
    "missing metrics record": _drop("metrics"),
    "missing meta record": _drop("meta"),
    "round not sent": _set("meta", "round", ROUND - 1),
    "mask not sent": _set("meta", "mask-digest", "0123456789abcdef"),
    "wrong array name": _mutate_arrays(lambda a: a.update({"weights": a.pop(P.DELTA)})),
    "extra array": _mutate_arrays(lambda a: a.update({"extra": np.zeros(3, np.float32)})),
    "delta count differs from mask": _mutate_arrays(lambda a: a.update({P.DELTA: a[P.DELTA][:-1]})),
    "delta dtype": _mutate_arrays(lambda a: a.update({P.DELTA: a[P.DELTA].astype(np.float64)})),
    "delta shape": _mutate_arrays(lambda a: a.update({P.DELTA: a[P.DELTA].reshape(1, -1)})),
    "delta NaN": _poison(P.DELTA, 0, np.nan),
    "delta Inf": _poison(P.DELTA, -1, np.inf),
    "fisher negative": _poison("fisher.inside", 1, -1.0),
    "fisher NaN": _poison("fisher.rowmean", 0, np.nan),
    "fisher Inf": _poison("fisher.inside", 0, np.inf),
    "fisher wrong length": _mutate_arrays(
        lambda a: a.update({"fisher.rowmean": a["fisher.rowmean"][:-2]})
    ),
    "fisher missing": _mutate_arrays(lambda a: a.pop("fisher.inside")),
    "oversized payload": _mutate_arrays(
        lambda a: a.update({P.DELTA: np.zeros(5_000_000, np.float32)})
    ),
    "zero examples": _set("metrics", "num-examples", 0),
    "negative examples": _set("metrics", "num-examples", -5),
    "absurd examples": _set("metrics", "num-examples", 10**9),
    "fractional examples": _set("metrics", "num-examples", 10.5),
    "NaN examples": _set("metrics", "num-examples", float("nan")),
    "missing examples": lambda r: (r.metrics.pop("num-examples"), r)[1],
    "NaN loss": _set("metrics", "train-loss", float("nan")),
    "negative seconds": _set("metrics", "train-seconds", -1.0),
    "negative peak memory": _set("metrics", "peak-rss-mib", -3.0),
    "NaN peak memory": _set("metrics", "peak-rss-mib", float("nan")),
    "negative CPU seconds": _set("metrics", "cpu-seconds", -0.5),
    "infinite CPU seconds": _set("metrics", "cpu-seconds", float("inf")),
    "reply from node that was not sent": lambda r: ReplyParts(999, r.arrays, r.metrics, r.meta),
}


def _state(strategy):
    return strategy.x.copy(), strategy.method.fisher.to_bytes()


def _run(base, replies):
    strategy, plan, _ = base
    s, p = copy.deepcopy((strategy, plan))
    accepted = s.apply_train_replies(p, replies)
    return s, p, accepted


@pytest.mark.parametrize("kind", sorted(CATALOGUE))
def test_malformed_reply_is_rejected_and_changes_nothing(base, kind):
    strategy, plan, replies = base
    good = replies[OTHER]
    bad = CATALOGUE[kind](copy.deepcopy(replies[GOOD]))
    clean, _, accepted_clean = _run(base, [good])
    dirty, dirty_plan, accepted_dirty = _run(base, [good, bad])
    assert len(accepted_clean) == len(accepted_dirty) == 1
    x_clean, f_clean = _state(clean)
    x_dirty, f_dirty = _state(dirty)
    assert x_clean.tobytes() == x_dirty.tobytes()
    assert f_clean == f_dirty
    if bad.node_id == GOOD:
        assert dirty_plan.clients[GOOD].status.startswith("rejected")


def test_bad_reply_alone_leaves_model_untouched(base):
    strategy, plan, replies = base
    bad = CATALOGUE["delta NaN"](copy.deepcopy(replies[GOOD]))
    s, _, accepted = _run(base, [bad])
    assert accepted == []
    assert s.x.tobytes() == strategy.x.tobytes()
    assert s.method.fisher.clients == {}


def test_duplicate_reply_counts_once(base):
    _, _, replies = base
    once, _, _ = _run(base, [replies[GOOD], replies[OTHER]])
    twice, _, accepted = _run(base, [replies[GOOD], replies[OTHER], copy.deepcopy(replies[GOOD])])
    assert len(accepted) == 2
    assert once.x.tobytes() == twice.x.tobytes()


def test_valid_replies_change_only_held_positions(base):
    strategy, plan, replies = base
    s, _, accepted = _run(base, list(replies.values()))
    assert len(accepted) == 2
    held = plan.sent[GOOD].mask | plan.sent[OTHER].mask
    assert np.array_equal(s.x[~held], strategy.x[~held])
    assert not np.array_equal(s.x[held], strategy.x[held])
    assert set(s.method.fisher.clients) == {
        "partition-0",
        "partition-1",
    }  # keyed by the stable client key


def test_evaluate_and_profile_validation():
    sent = SentSubmodel(1, 2, np.ones(4, bool), "abc", 100)
    ok = validate_evaluate_reply(
        {"num-examples": 10, "eval-loss": 0.5, "eval-acc": 0.9},
        {"round": 2, "mask-digest": "abc"},
        sent,
        10,
    )
    assert ok["eval-acc"] == 0.9
    from common.wire.validation import ReplyError

    for metrics in (
        {"num-examples": 11, "eval-loss": 0.5, "eval-acc": 0.9},
        {"num-examples": 10, "eval-loss": 0.5, "eval-acc": 1.5},
        {"num-examples": 10, "eval-loss": float("nan"), "eval-acc": 0.5},
    ):
        with pytest.raises(ReplyError):
            validate_evaluate_reply(metrics, {"round": 2, "mask-digest": "abc"}, sent, 10)
    assert validate_profile(
        {"capacity": 0.5, "num-train-examples": 10, "num-test-examples": 3}, None
    ) == (0.5, 10, 3)
    for metrics, err in (
        ({"capacity": 0.0, "num-train-examples": 10, "num-test-examples": 3}, None),
        ({"capacity": 1.5, "num-train-examples": 10, "num-test-examples": 3}, None),
        ({"capacity": 0.5, "num-train-examples": 0, "num-test-examples": 3}, None),
        (None, "ConfigError: capacity='1/2': expected a number"),
    ):
        with pytest.raises(ReplyError):
            validate_profile(metrics, err)


def test_node_config_shape_mismatch_is_reported():
    from common.config.node import parse_node_config
    from common.config.schema import ConfigError

    with pytest.raises(ConfigError, match="capacity"):
        parse_node_config({"partition-id": 0, "num-partitions": 2, "capacity": "1/2"})
    assert parse_node_config({"partition-id": 1, "num-partitions": 2, "capacity": 1}) == NodeConfig(
        partition_id=1, num_partitions=2, capacity=1.0
    )


def test_methods_without_fisher_upload_none_and_reject_a_fisher_payload(base):
    strategy, plan, replies = base
    s, p = copy.deepcopy((strategy, plan))
    s.cfg = parse_run_config({"method": "fiarse"})
    s.method = create_method(s.cfg)
    s.method.start_server(s.layout)
    assert s.method.upload_encoding(s.cfg) == "none"
    lean = copy.deepcopy(replies[GOOD])
    lean.arrays = {P.DELTA: lean.arrays[P.DELTA]}
    heavy = copy.deepcopy(replies[OTHER])  # still carries fisher.* arrays: rejected
    accepted = s.apply_train_replies(p, [lean, heavy])
    assert len(accepted) == 1 and p.clients[GOOD].status != "rejected"
    assert s.method.state_bytes() == b""  # magnitude ranking keeps no Fisher
    assert p.clients[OTHER].status.startswith("rejected")


def test_round_below_min_replies_is_skipped_and_changes_nothing(base):
    strategy, plan, replies = base
    s, p = copy.deepcopy((strategy, plan))
    s.cfg = parse_run_config({"min-replies": 3})
    accepted = s.apply_train_replies(p, list(copy.deepcopy(replies).values()))
    assert accepted == []
    assert s.x.tobytes() == strategy.x.tobytes() and s.method.fisher.clients == {}
    assert all(p.clients[n].status.startswith("skipped") for n in (GOOD, OTHER))


def test_replies_fold_in_client_key_order_whatever_the_node_ids(base):
    """Node ids are drawn anew each run; the clients' keys are stable, so the fold order (and
    FedRolex's order-dependent count weights) repeats from run to run."""
    strategy, plan, replies = base
    assert strategy.registry.in_key_order([OTHER, GOOD]) == [
        GOOD,
        OTHER,
    ]  # partition-0, partition-1
    s, p = copy.deepcopy((strategy, plan))
    s.registry.nodes[GOOD] = dataclasses.replace(s.registry.nodes[GOOD], key="partition-9")
    assert s.registry.in_key_order([GOOD, OTHER]) == [OTHER, GOOD]
    assert s.registry.in_key_order([999, GOOD, OTHER]) == [
        OTHER,
        GOOD,
        999,
    ]  # a node never discovered comes last
    folded = []
    s.method.round_fold = lambda x, rnd, least: _Recorder(folded)
    s.apply_train_replies(p, [copy.deepcopy(replies[GOOD]), copy.deepcopy(replies[OTHER])])
    assert folded == ["partition-1", "partition-9"]


class _Recorder:
    """A fold that records the client keys it is given, in order."""

    def __init__(self, keys):
        self.keys, self.count = keys, 0

    def add(self, accepted):
        self.keys.append(accepted.key)

    def finish(self):
        return np.zeros(1, np.float32)

    def discard(self):
        pass
