"""Discovery carrying the Fisher warm-up: one exchange fewer before round 1, the same Fisher, bad openings refused.

With ``fisher-warmup`` and the ``global`` estimator, FedFIbOS's round-0 mask is magnitude top-k of the initial
model, which a node can compute itself: the QUERY then carries the initial model and each node replies with its
profile and its Fisher (``SubmodelStrategy.opening_discovery``). Checked here in process against the separate
warm-up exchange it replaces.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config.parse import parse_run_config
from common.methods import create_method
from common.methods.fedfibos import FedFIbOS
from common.methods.masked import FisherRankedMethod
from common.models.layout import ParamLayout
from tests.inprocess_grid import inprocess_federation

RUN = {"num-rounds": 2, "local-epochs": 1, "eval-every": 0, "fisher-examples": 16, "fisher-every": 2}
NODES = {51: 1.0, 52: 0.25, 53: 0.0625}


def _run(monkeypatch, tmp_path, run_config=RUN, separate=False):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    if separate:
        monkeypatch.setattr(FedFIbOS, "warmup_in_discovery", lambda self: False)
    fed = inprocess_federation(run_config, NODES)
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), run_config["num-rounds"], 60.0, evaluate_fn=fed.evaluate_fn
    )
    return fed


def _kinds(fed):
    return [
        (m.metadata.message_type, int(m.content.config_records["submodel-config"]["round"]))
        if m.metadata.message_type == "train"
        else (m.metadata.message_type, None)
        for m in fed.grid.handled
    ]


def test_discovery_carries_the_warm_up_and_gives_the_separate_exchanges_fisher_and_model(monkeypatch, tmp_path):
    merged = _run(monkeypatch, tmp_path)
    assert merged.strategy.method.warmup_in_discovery()  # the defaults this test is about
    separate = _run(monkeypatch, tmp_path, separate=True)
    # One exchange fewer: no round-0 TRAIN messages, the QUERY carried them.
    assert _kinds(merged) == [("query", None)] * 3 + [("train", r) for r in (1, 1, 1, 2, 2, 2)]
    assert _kinds(separate) == [("query", None)] * 3 + [("train", r) for r in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    warm = merged.records[0]["fisher_warmup"]
    assert warm["replies"] == warm["sent"] == 3 and warm["with_discovery"] is True
    assert [c["status"] for c in warm["clients"]] == ["ok"] * 3
    assert all(c["cpu_seconds"] > 0 and c["bytes_up"] > 0 for c in warm["clients"])
    assert separate.records[0]["fisher_warmup"]["replies"] == 3
    # The same Fisher state, hence the same masks and the same model, to the bit.
    assert merged.strategy.method.fisher.to_bytes() == separate.strategy.method.fisher.to_bytes()
    assert merged.strategy.x.tobytes() == separate.strategy.x.tobytes()
    for a, b in zip(merged.records[1:], separate.records[1:]):
        assert a["global"] == b["global"]
        assert [c["mask_source"] for c in a["clients"]] == [c["mask_source"] for c in b["clients"]]
    assert [c["mask_source"] for c in merged.records[1]["clients"]] == ["client"] * 3  # ranked by the warm-up


def test_a_node_whose_opening_mask_differs_is_refused_and_ranked_by_the_prior(monkeypatch, tmp_path):
    real = FedFIbOS.opening_mask
    server_methods: list[FedFIbOS] = []

    def drifted(self, layout, x, gamma):
        mask = real(self, layout, x, gamma)
        if gamma < 1 and not any(self is m for m in server_methods):  # a node computing another mask
            held, dropped = np.flatnonzero(mask)[0], np.flatnonzero(~mask)[0]
            mask = mask.copy()
            mask[held], mask[dropped] = False, True
        return mask

    monkeypatch.setattr(FedFIbOS, "opening_mask", drifted)
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed = inprocess_federation(RUN, NODES)
    server_methods.append(fed.strategy.method)
    fed.strategy.start(fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn)
    warm = fed.records[0]["fisher_warmup"]
    assert warm["replies"] == 1 and warm["sent"] == 3
    status = {c["capacity"]: c["status"] for c in warm["clients"]}
    assert status[1.0] == "ok"
    assert all("mask digest" in status[g] for g in (0.25, 0.0625))
    first = {c["capacity"]: c for c in fed.records[1]["clients"]}
    assert all(c["status"] == "ok" for c in first.values())  # they still train in round 1 ...
    assert first[0.25]["mask_source"] == "prior" and first[0.25]["fisher_asked"]  # ... and report their Fisher


def test_a_node_that_cannot_measure_the_opening_says_why_and_still_trains(monkeypatch, tmp_path):
    def broken(self, train, x, gamma):
        raise ValueError("the opening model holds float32[3], this node's model float32[7]")

    monkeypatch.setattr(FisherRankedMethod, "opening_received", broken)
    fed = _run(monkeypatch, tmp_path)
    warm = fed.records[0]["fisher_warmup"]
    assert warm["replies"] == 0 and warm["sent"] == 3
    assert all(
        c["status"] == "rejected: ValueError: the opening model holds float32[3], this node's model float32[7]"
        for c in warm["clients"]
    )
    assert [c["status"] for c in fed.records[1]["clients"]] == ["ok"] * 3
    assert fed.strategy.method.fisher.clients  # round 1 refreshed them


def test_the_opening_model_must_fit_the_nodes_model(monkeypatch, tmp_path):
    from common.data.datasets import load_run_dataset

    method = create_method(parse_run_config({}))
    train = load_run_dataset(parse_run_config({})).train
    with pytest.raises(ValueError, match="opening model holds"):
        method.opening_received(train, np.zeros(5, np.float32), 0.5)


def test_runs_that_cannot_fold_the_warm_up_keep_its_own_exchange():
    assert not create_method(parse_run_config({"fisher-estimator": "received"})).warmup_in_discovery()
    assert not create_method(parse_run_config({"fisher-warmup": False})).warmup_in_discovery()
    assert not create_method(parse_run_config({"method": "fedgmr"})).warmup_in_discovery()
    assert not create_method(parse_run_config({"method": "fiarse"})).warmup_in_discovery()


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([1.0, 0.5, 0.25, 0.0625, 0.3]),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0, 1, 2]),
    st.booleans(),
)
def test_the_opening_mask_is_round_0s_mask_of_a_fresh_state(gamma, seed, min_per_row, keep_vectors):
    cfg = parse_run_config({"min-per-row": min_per_row, "keep-vectors": keep_vectors})
    layout = ParamLayout.from_arrays(
        {"a.weight": np.zeros((6, 5), np.float32), "a.bias": np.zeros(6, np.float32), "b.weight": np.zeros((3, 6))}
    )
    x = np.random.default_rng(seed).standard_normal(layout.size).astype(np.float32)
    method = create_method(cfg)
    method.start_server(layout)
    want, source = method.mask_for("some-client", 0, gamma, x)
    assert source == "magnitude"
    np.testing.assert_array_equal(method.opening_mask(layout, x, gamma), want)
