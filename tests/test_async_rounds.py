"""The async loop's reply handling without a federation: valid replies applied, bad ones dropped
untouched."""

from __future__ import annotations

import numpy as np
import pytest

from common.config.parse import parse_run_config
from common.models.layout import ParamLayout
from common.wire.validation import SentSubmodel
from server.async_strategy import AsyncSubmodelStrategy, Dispatch
from server.replies import ReplyParts
from server.strategy_core.node_registry import NodeProfile
from server.strategy_core.round_records import ClientRound

LAYOUT = ParamLayout.from_arrays({"w": np.zeros((6, 10)), "b": np.zeros(6)})


@pytest.fixture
def loop():
    cfg = parse_run_config(
        {"method": "fedgmr", "gmr-mode": "async", "gmr-max-staleness": 3, "server-lr": 0.5}
    )
    strategy = AsyncSubmodelStrategy(cfg, LAYOUT)
    strategy.registry.nodes = {
        1: NodeProfile(1.0, "cpu", 50, 10, "a"),
        2: NodeProfile(0.5, "cpu", 50, 10, "b"),
    }
    strategy.x = np.random.default_rng(0).normal(size=LAYOUT.size).astype(np.float32)
    return strategy


def _dispatch(loop, node_id, seq):
    mask, source = loop.node_mask(node_id, seq)
    k = int(mask.sum())
    info = ClientRound(
        node_id,
        loop.registry.nodes[node_id].capacity,
        "cpu",
        source,
        k,
        k / LAYOUT.size,
        0,
        0,
        0,
        "bits",
    )
    return Dispatch(
        node_id, SentSubmodel(node_id, seq, mask, f"digest-{seq}", 50), loop.version, 0.0, info
    )


def _parts(d, delta=None, **meta):
    k = int(d.sent.mask.sum())
    return ReplyParts(
        node_id=d.node_id,
        arrays={"delta": np.full(k, 0.1, dtype=np.float32) if delta is None else delta},
        metrics={
            "num-examples": 50,
            "train-loss": 1.0,
            "train-seconds": 2.0,
            "fisher-seconds": 0.0,
        },
        meta={"round": d.sent.round, "mask-digest": d.sent.digest, **meta},
        nbytes=4 * k,
    )


def test_valid_reply_is_applied_on_its_mask_only(loop):
    d = _dispatch(loop, 2, 1)
    x0 = loop.x.copy()
    assert loop.apply_reply(_parts(d), d)
    m = d.sent.mask
    np.testing.assert_allclose(loop.x[m], x0[m] + np.float32(0.5 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(loop.x[~m], x0[~m])
    assert (
        loop.version == 1
        and loop.window[-1]["staleness"] == 0
        and loop.window[-1]["status"] == "ok"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"delta": "nan"},
        {"delta": "short"},
        {"round": 99},
        {"mask-digest": "other"},
        {"node": 1},
        {"error": "boom"},
    ],
)
def test_bad_reply_is_dropped_and_leaves_the_model_untouched(loop, bad):
    d = _dispatch(loop, 2, 1)
    k = int(d.sent.mask.sum())
    delta = None
    if bad.get("delta") == "nan":
        delta = np.full(k, np.nan, dtype=np.float32)
    elif bad.get("delta") == "short":
        delta = np.zeros(k - 1, dtype=np.float32)
    meta = {key: v for key, v in bad.items() if key in ("round", "mask-digest")}
    parts = _parts(d, delta, **meta)
    if "node" in bad:
        parts.node_id = bad["node"]
    if "error" in bad:
        parts.error = bad["error"]
    x0 = loop.x.copy()
    assert not loop.apply_reply(parts, d)
    np.testing.assert_array_equal(loop.x, x0)
    assert loop.version == 0 and loop.last_changed.max() == 0
    assert loop.window[-1]["status"].startswith("rejected: ")


def test_reply_beyond_the_staleness_bound_is_dropped(loop):
    late = _dispatch(loop, 2, 1)  # sent at version 0
    for seq in range(2, 6):  # four updates from node 1 arrive first
        d = _dispatch(loop, 1, seq)
        assert loop.apply_reply(_parts(d), d)
    x0 = loop.x.copy()
    assert not loop.apply_reply(_parts(late), late)
    assert "gmr-max-staleness=3" in loop.window[-1]["status"]
    np.testing.assert_array_equal(loop.x, x0)
    assert loop.version == 4
