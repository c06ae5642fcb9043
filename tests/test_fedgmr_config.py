"""FedGMR run-config keys and the bench-delay-s node knob: defaults, validation naming the key."""

from __future__ import annotations

import pytest

from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.methods import method_class, registry


def test_fedgmr_is_a_method_with_validated_keys():
    assert "fedgmr" in registry()
    cfg = parse_run_config(
        {
            "method": "fedgmr",
            "gmr-schedule": "step",
            "gmr-start": 0.1,
            "gmr-ceiling": 0.8,
            "gmr-restore-rounds": 6,
            "gmr-step-factor": 3,
            "gmr-selection": "fisher",
            "gmr-mode": "async",
            "gmr-staleness-exponent": 1,
            "gmr-max-staleness": 4,
            "server-lr": 0.7,
            "gmr-eval-updates": 5,
        }
    )
    gmr = cfg.options("fedgmr")
    assert (gmr.schedule, gmr.mode, gmr.selection, gmr.max_staleness) == (
        "step",
        "async",
        "fisher",
        4,
    )
    assert gmr.step_factor == 3.0 and cfg.server_lr == 0.7


def test_server_lr_auto_is_half_for_the_async_loop_and_one_otherwise():
    assert parse_run_config({"method": "fedgmr", "gmr-mode": "async"}).server_lr == 0.5
    assert parse_run_config({"method": "fedgmr"}).server_lr == 1.0
    assert (
        parse_run_config({"method": "fedfibos", "gmr-mode": "async"}).server_lr == 1.0
    )  # not FedGMR's loop


def test_clients_upload_fisher_only_when_a_rule_reads_it():
    gmr = method_class("fedgmr")
    assert gmr.upload_encoding(parse_run_config({"method": "fedgmr"})) == "none"
    assert (
        gmr.upload_encoding(parse_run_config({"method": "fedgmr", "gmr-selection": "fisher"}))
        == "ranked"
    )


@pytest.mark.parametrize(
    "key,value",
    [
        ("gmr-schedule", "cosine"),
        ("gmr-start", 0),
        ("gmr-start", 1.5),
        ("gmr-ceiling", 0),
        ("gmr-ceiling", 2),
        ("gmr-restore-rounds", 0),
        ("gmr-restore-rounds", 2.5),
        ("gmr-step-factor", 1.0),
        ("gmr-selection", "topk"),
        ("gmr-schedule", "early"),
        ("gmr-patience", 0),
        ("gmr-patience", 2.5),
        ("gmr-restore-step", "double"),
        ("gmr-min-density", -0.1),
        ("gmr-min-density", 1.5),
        ("gmr-mode", "semi"),
        ("gmr-staleness-exponent", -0.5),
        ("gmr-max-staleness", -1),
        ("gmr-max-staleness", 1.5),
        ("server-lr", 0),
        ("gmr-eval-updates", -1),
    ],
)
def test_bad_fedgmr_value_names_key(key, value):
    with pytest.raises(ConfigError, match=key):
        parse_run_config({"method": "fedgmr", key: value})


def test_async_mode_cannot_resume():
    with pytest.raises(ConfigError, match="resume"):
        parse_run_config({"method": "fedgmr", "gmr-mode": "async", "resume": True})
    assert parse_run_config({"method": "fedgmr", "gmr-mode": "sync", "resume": True}).resume


def test_bench_delay_node_knob():
    base = {"partition-id": 0, "num-partitions": 2, "capacity": 0.5}
    assert parse_node_config(base).bench_delay_s == 0.0
    assert parse_node_config({**base, "bench-delay-s": 2.5}).bench_delay_s == 2.5
    for bad in (-1, "slow", float("inf")):
        with pytest.raises(ConfigError, match="bench-delay-s"):
            parse_node_config({**base, "bench-delay-s": bad})


def test_capacity_kind_node_key_and_run_default():
    base = {"partition-id": 0, "num-partitions": 2, "capacity": 0.25}
    assert parse_node_config(base).capacity_kind is None  # the run's capacity-kind decides
    for kind in ("bandwidth", "memory"):
        assert parse_node_config({**base, "capacity-kind": kind}).capacity_kind == kind
    for bad in ("disk", 1, ""):
        with pytest.raises(ConfigError, match="capacity-kind"):
            parse_node_config({**base, "capacity-kind": bad})
    assert parse_run_config({"method": "fedgmr"}).capacity_kind == "bandwidth"
    with pytest.raises(ConfigError, match="capacity-kind"):
        parse_run_config({"method": "fedgmr", "capacity-kind": "disk"})


def test_restoration_grows_past_capacity_only_for_bandwidth_nodes():
    from common.methods import create_method
    from common.models.architectures import build_model, model_layout, trainable_arrays

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    run = {
        "method": "fedgmr",
        "gmr-schedule": "linear",
        "gmr-selection": "random",
        "gmr-start": 0.25,
    }
    method = create_method(parse_run_config({**run, "gmr-restore-rounds": 4}))
    method.start_server(layout)
    method.node_joined("mem", {"capacity-kind": "memory"})
    method.node_joined("bw", {"capacity-kind": "bandwidth"})
    method.node_joined("default", {})
    method.node_joined("odd", {"capacity-kind": "disk"})  # logged, the run's default used
    keys = ("mem", "bw", "default", "odd")
    density = {
        k: [float(method.mask_for(k, r, 0.25, x)[0].mean()) for r in (1, 3, 5, 9)] for k in keys
    }
    assert (
        0.24 < density["mem"][-1] < 0.27
    )  # capped at the capacity (plus the guards' few positions)
    for key in ("bw", "default", "odd"):
        assert (
            density[key][-1] == 1.0 and density[key][0] == density["mem"][0]
        )  # same start, grows to full
        assert all(b >= a for a, b in zip(density[key], density[key][1:]))
    method.node_joined("mem", {})  # the node restarted without the key: the default applies again
    assert method.capacity_kind("mem") == "bandwidth"
    memory_run = create_method(parse_run_config({"method": "fedgmr", "capacity-kind": "memory"}))
    assert (
        memory_run.capacity_kind("anyone") == "memory"
        and memory_run.capacity_kind(None) == "memory"
    )


def test_the_discovery_reply_carries_the_node_capacity_kind():
    from flwr.app import Message, MessageType, RecordDict

    from tests.inprocess_grid import InProcessGrid

    node = {"partition-id": 0, "num-partitions": 2, "capacity": 0.25, "device": "cpu"}
    run = {"method": "fedgmr", "dataset": "digits"}
    grid = InProcessGrid(
        {1: {**node, "capacity-kind": "memory"}, 2: node, 3: {**node, "capacity-kind": "disk"}}, run
    )
    msgs = [
        Message(content=RecordDict(), dst_node_id=n, message_type=MessageType.QUERY)
        for n in (1, 2, 3)
    ]
    replies = {m.metadata.src_node_id: m.content for m in grid.send_and_receive(msgs)}
    assert replies[1].config_records["device"]["capacity-kind"] == "memory"
    assert "capacity-kind" not in replies[2].config_records["device"]
    assert "capacity-kind" in replies[3].config_records["profile"]["error"]


def test_discovery_hands_each_node_capacity_kind_to_the_method():
    from common.models.architectures import build_model, model_layout
    from server.strategy import SubmodelStrategy
    from tests.inprocess_grid import InProcessGrid

    node = {"num-partitions": 2, "capacity": 0.25, "device": "cpu"}
    run = {"method": "fedgmr", "dataset": "digits", "capacity-kind": "bandwidth"}
    grid = InProcessGrid(
        {1: {**node, "partition-id": 0, "capacity-kind": "memory"}, 2: {**node, "partition-id": 1}},
        run,
    )
    strategy = SubmodelStrategy(parse_run_config(run), model_layout(build_model("cnn", 10, 1, 0)))
    strategy.registry.discover(grid, 30.0)
    kinds = {nid: strategy.method.capacity_kind(strategy.registry.nodes[nid].key) for nid in (1, 2)}
    assert kinds == {1: "memory", 2: "bandwidth"}
