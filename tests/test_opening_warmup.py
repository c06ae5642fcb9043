"""Discovery carrying the Fisher warm-up: one exchange fewer before round 1, the same Fisher, bad
openings refused.

With ``fisher-warmup`` and the ``global`` estimator, FedFIbOS's round-0 mask is magnitude top-k of
the initial model, which a node can compute itself: the QUERY then carries the initial model and
each node replies with its profile and its Fisher (``server.opening.Opening.discovery``). Checked
here in process against the separate warm-up exchange it replaces.
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

# The warm-up runs without a byte budget (under one it would send small nodes the whole model).
NO_BUDGET = {"fedfibos-byte-budget": 0}
RUN = {
    "num-rounds": 2,
    "local-epochs": 1,
    "eval-every": 0,
    "fisher-examples": 16,
    "fisher-every": 2,
    **NO_BUDGET,
}
NODES = {51: 1.0, 52: 0.25, 53: 0.0625}


def _run(monkeypatch, tmp_path, run_config=RUN, separate=False, round_one=True):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    if separate:
        monkeypatch.setattr(FedFIbOS, "opening", lambda self: "exchange")
    elif not round_one:
        monkeypatch.setattr(FedFIbOS, "opening", lambda self: "discovery")
    fed = inprocess_federation(run_config, NODES)
    fed.strategy.start(
        fed.grid,
        fed.strategy.to_arrays(fed.x0),
        run_config["num-rounds"],
        60.0,
        evaluate_fn=fed.evaluate_fn,
    )
    monkeypatch.undo()
    return fed


def _kinds(fed):
    return [
        (m.metadata.message_type, int(m.content.config_records["submodel-config"]["round"]))
        if m.metadata.message_type == "train"
        else (m.metadata.message_type, None)
        for m in fed.grid.handled
    ]


def test_discovery_carries_the_warm_up_and_round_one_and_gives_the_separate_exchanges_fisher_and_model(  # noqa: E501
    monkeypatch, tmp_path
):
    merged = _run(monkeypatch, tmp_path)
    assert merged.strategy.method.opening() == "discovery+round-one"  # the defaults
    warm_only = _run(monkeypatch, tmp_path, round_one=False)
    separate = _run(monkeypatch, tmp_path, separate=True)
    # Two exchanges fewer: no round-0 nor round-1 TRAIN messages, the QUERY carried them.
    assert _kinds(merged) == [("query", None)] * 3 + [("train", 2)] * 3
    assert _kinds(warm_only) == [("query", None)] * 3 + [("train", r) for r in (1, 1, 1, 2, 2, 2)]
    assert _kinds(separate) == [("query", None)] * 3 + [
        ("train", r) for r in (0, 0, 0, 1, 1, 1, 2, 2, 2)
    ]
    assert all("round-one" in m.content.config_records for m in merged.grid.handled[:3])
    assert not any("round-one" in m.content.config_records for m in warm_only.grid.handled[:3])
    warm = merged.records[0]["fisher_warmup"]
    assert (
        warm["replies"] == warm["sent"] == 3
        and warm["with_discovery"] is True
        and warm["with_round_one"]
    )
    assert [c["status"] for c in warm["clients"]] == ["ok"] * 3
    assert all(c["cpu_seconds"] > 0 and c["bytes_up"] > 0 for c in warm["clients"])
    assert merged.records[0]["round_one_pushed"] <= merged.records[0]["time"]
    assert "round_one_pushed" not in warm_only.records[0]
    assert separate.records[0]["fisher_warmup"]["replies"] == 3
    # The same Fisher state (held masks included), hence the same masks and the same model, to the
    # bit.
    for other in (warm_only, separate):
        assert merged.strategy.method.state_bytes() == other.strategy.method.state_bytes()
        assert merged.strategy.x.tobytes() == other.strategy.x.tobytes()
        for a, b in zip(merged.records[1:], other.records[1:]):
            assert a["global"] == b["global"]
            keep = (
                "mask_source",
                "selected",
                "status",
                "train_loss",
                "num_examples",
                "mask_overlap",
                "bytes_up",
            )
            assert [{k: c[k] for k in keep} for c in a["clients"]] == [
                {k: c[k] for k in keep} for c in b["clients"]
            ]
    first = merged.records[1]["clients"]
    assert [c["mask_source"] for c in first] == ["client"] * 3  # ranked by the warm-up
    assert all(c["bytes_down"] == 0 and c["bytes_up"] > 0 and c["cpu_seconds"] > 0 for c in first)
    assert [c["bytes_down"] > 0 for c in warm_only.records[1]["clients"]] == [True] * 3


def test_a_node_that_trains_no_round_one_with_discovery_is_sent_round_one(monkeypatch, tmp_path):
    real = FedFIbOS.round_one_received

    def failing(self, train, x, gamma, opening, warm_up):
        if gamma == 0.25:
            raise RuntimeError("out of memory")
        return real(self, train, x, gamma, opening, warm_up)

    monkeypatch.setattr(FedFIbOS, "round_one_received", failing)
    fed = _run(monkeypatch, tmp_path)
    reference = _run(monkeypatch, tmp_path)
    assert _kinds(fed) == [("query", None)] * 3 + [("train", 1)] + [("train", 2)] * 3
    assert fed.grid.handled[3].metadata.dst_node_id == 52
    first = {c["capacity"]: c for c in fed.records[1]["clients"]}
    assert [c["status"] for c in first.values()] == ["ok"] * 3
    assert (
        first[0.25]["bytes_down"] > 0
        and first[1.0]["bytes_down"] == first[0.0625]["bytes_down"] == 0
    )
    # Folded in the same order with the same updates: the model of the run where every node trained
    # with discovery.
    assert fed.strategy.x.tobytes() == reference.strategy.x.tobytes()


def test_a_tampered_round_one_reply_is_refused_and_leaves_the_round_as_without_it(
    monkeypatch, tmp_path
):
    from client import app as client_app

    real = client_app.opening_round_one

    def tampered(method, x0, capacity, opening, warm_up, run, node, data, run_id):
        records = real(method, x0, capacity, opening, warm_up, run, node, data, run_id)
        if capacity == 0.0625:
            delta = records["round-one-update"]["delta"].numpy()
            records["round-one-update"]["delta"] = type(records["round-one-update"]["delta"])(
                delta[:-1].copy()
            )
        return records

    monkeypatch.setattr(client_app, "opening_round_one", tampered)
    fed = _run(monkeypatch, tmp_path, {**RUN, "num-rounds": 1})
    first = {c["capacity"]: c for c in fed.records[1]["clients"]}
    assert first[1.0]["status"] == first[0.25]["status"] == "ok"
    assert first[0.0625]["status"].startswith("rejected")
    assert fed.records[1]["replies"] == 2

    def dropped(method, x0, capacity, opening, warm_up, run, node, data, run_id):
        records = real(method, x0, capacity, opening, warm_up, run, node, data, run_id)
        if capacity == 0.0625:  # the same round without that node's update: it never arrives
            return {"round-one-error": client_app.ConfigRecord({"round-one-error": "dropped"})}
        return records

    monkeypatch.setattr(client_app, "opening_round_one", dropped)
    monkeypatch.setattr(
        client_app, "train", lambda msg, context: (_ for _ in ()).throw(RuntimeError("offline"))
    )
    without = _run(monkeypatch, tmp_path, {**RUN, "num-rounds": 1})
    assert without.records[1]["replies"] == 2
    assert fed.strategy.x.tobytes() == without.strategy.x.tobytes()


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.sampled_from([1.0, 0.5, 0.25, 0.0625, 0.3]), min_size=1, max_size=4),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["fp32", "fp16"]),
    st.sampled_from([0, 1]),
)
def test_a_nodes_round_one_mask_is_the_servers_after_every_warm_up(
    gammas, seed, precision, min_per_row
):
    """The mask a node computes from its own warm-up is mask_for's at round 1, whatever the others
    uploaded."""
    from common.aggregation.masked import MaskedUpdate
    from common.methods.round_fold import Accepted
    from common.wire.validation import TrainReply

    cfg = parse_run_config({"fisher-precision": precision, "min-per-row": min_per_row, **NO_BUDGET})
    layout = ParamLayout.from_arrays(
        {
            "a.weight": np.zeros((6, 5), np.float32),
            "a.bias": np.zeros(6, np.float32),
            "b.weight": np.zeros((3, 6)),
        }
    )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(layout.size).astype(np.float32)
    server = create_method(cfg)
    server.start_server(layout)
    uploads = [
        (rng.random(layout.size) ** 3 * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
        for _ in gammas
    ]
    server.warm_up(
        [
            Accepted(
                i,
                f"c{i}",
                TrainReply(
                    MaskedUpdate(np.zeros(0, np.int32), np.zeros(0, np.float32), 10.0), f, {}
                ),
            )
            for i, f in enumerate(uploads)
        ],
        0,
    )
    for i, (gamma, fisher) in enumerate(zip(gammas, uploads)):
        want, source = server.mask_for(f"c{i}", 1, gamma, x)
        assert source == "client"
        np.testing.assert_array_equal(
            create_method(cfg).round_one_mask(layout, x, gamma, fisher), want
        )


def test_runs_that_cannot_train_round_one_with_discovery_send_it_alone(monkeypatch, tmp_path):
    # Round 1 would ask Fisher.
    assert create_method(parse_run_config({"fisher-every": 1, **NO_BUDGET})).opening() == (
        "discovery"
    )
    assert (
        create_method(parse_run_config({"fisher-estimator": "received", **NO_BUDGET})).opening()
        == "exchange"
    )
    sampled = _run(monkeypatch, tmp_path, {**RUN, "fraction-train": 0.7, "min-train-nodes": 1})
    assert not any("round-one" in m.content.config_records for m in sampled.grid.handled[:3])
    assert ("train", 1) in _kinds(sampled)


def test_a_node_whose_opening_mask_differs_is_refused_and_ranked_by_the_prior(
    monkeypatch, tmp_path
):
    real = FedFIbOS.opening_mask
    server_methods: list[FedFIbOS] = []

    def drifted(self, layout, x, gamma):
        mask = real(self, layout, x, gamma)
        if gamma < 1 and not any(
            self is m for m in server_methods
        ):  # a node computing another mask
            held, dropped = np.flatnonzero(mask)[0], np.flatnonzero(~mask)[0]
            mask = mask.copy()
            mask[held], mask[dropped] = False, True
        return mask

    monkeypatch.setattr(FedFIbOS, "opening_mask", drifted)
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed = inprocess_federation(RUN, NODES)
    server_methods.append(fed.strategy.method)
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    warm = fed.records[0]["fisher_warmup"]
    assert warm["replies"] == 1 and warm["sent"] == 3
    status = {c["capacity"]: c["status"] for c in warm["clients"]}
    assert status[1.0] == "ok"
    assert all("mask digest" in status[g] for g in (0.25, 0.0625))
    first = {c["capacity"]: c for c in fed.records[1]["clients"]}
    assert all(c["status"] == "ok" for c in first.values())  # they still train in round 1 ...
    assert (
        first[0.25]["mask_source"] == "prior" and first[0.25]["fisher_asked"]
    )  # ... and report their Fisher


def test_a_node_that_cannot_measure_the_opening_says_why_and_still_trains(monkeypatch, tmp_path):
    def broken(self, train, x, gamma):
        raise ValueError("the opening model holds float32[3], this node's model float32[7]")

    monkeypatch.setattr(FisherRankedMethod, "opening_received", broken)
    fed = _run(monkeypatch, tmp_path)
    warm = fed.records[0]["fisher_warmup"]
    assert warm["replies"] == 0 and warm["sent"] == 3
    assert all(
        c["status"]
        == "rejected: ValueError: the opening model holds float32[3], this node's model float32[7]"
        for c in warm["clients"]
    )
    assert [c["status"] for c in fed.records[1]["clients"]] == ["ok"] * 3
    assert fed.strategy.method.fisher.clients  # round 1 refreshed them


def test_the_opening_model_must_fit_the_nodes_model(monkeypatch, tmp_path):
    from common.data.datasets import load_run_dataset

    method = create_method(parse_run_config(NO_BUDGET))
    train = load_run_dataset(parse_run_config(NO_BUDGET)).train
    with pytest.raises(ValueError, match="opening model holds"):
        method.opening_received(train, np.zeros(5, np.float32), 0.5)


def test_runs_that_cannot_fold_the_warm_up_keep_its_own_exchange():
    def opening(run: dict) -> str:
        return create_method(parse_run_config(run)).opening()

    assert opening(NO_BUDGET) == "discovery+round-one"
    assert opening({}) == "none"  # the default byte budget: no warm-up
    assert opening({"fisher-estimator": "received", **NO_BUDGET}) == "exchange"
    assert opening({"fisher-estimator": "path", **NO_BUDGET}) == "none"
    assert opening({"fisher-warmup": False, **NO_BUDGET}) == "none"
    assert opening({"method": "fedgmr"}) == "none"
    assert opening({"method": "fiarse"}) == "none"


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([1.0, 0.5, 0.25, 0.0625, 0.3]),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0, 1, 2]),
    st.booleans(),
)
def test_the_opening_mask_is_round_0s_mask_of_a_fresh_state(gamma, seed, min_per_row, keep_vectors):
    cfg = parse_run_config({"min-per-row": min_per_row, "keep-vectors": keep_vectors, **NO_BUDGET})
    layout = ParamLayout.from_arrays(
        {
            "a.weight": np.zeros((6, 5), np.float32),
            "a.bias": np.zeros(6, np.float32),
            "b.weight": np.zeros((3, 6)),
        }
    )
    x = np.random.default_rng(seed).standard_normal(layout.size).astype(np.float32)
    method = create_method(cfg)
    method.start_server(layout)
    want, source = method.mask_for("some-client", 0, gamma, x)
    assert source == "magnitude"
    np.testing.assert_array_equal(method.opening_mask(layout, x, gamma), want)
