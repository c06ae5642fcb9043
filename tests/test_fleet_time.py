"""Emulated fleet time and the stock-Flower comparison's pure parts (benchmarks/fleet_time.py,
benchmarks/flower_comparison.py), and the stock app's sameness: same initial weights, same
partitions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.vs_flower.comparison import PartitionNodes, run_row, stock_run_config, table
from benchmarks.vs_flower.fleet_time import (
    Evaluation,
    NodeCost,
    exchange_seconds,
    first_reaching,
    product_curve,
    server_seconds,
    startup_seconds,
    stock_curve,
    transfer_seconds,
)
from benchmarks.vs_flower.stock_flower.stock_fedavg.task import (
    load_data,
    product_settings,
    server_model,
    train,
)
from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.data.local_split import derive_local_data
from common.methods import create_method
from common.training.loop import as_input
from server.federation import global_model


def test_transfer_seconds_is_bits_over_the_nodes_share_of_the_link():
    assert transfer_seconds(1_000_000, 1.0, 8.0) == pytest.approx(1.0)
    assert transfer_seconds(1_000_000, 0.25, 8.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="capacity"):
        transfer_seconds(1, 0.0, 8.0)
    with pytest.raises(ValueError, match="link speed"):
        transfer_seconds(1, 1.0, 0.0)


node_costs = st.builds(
    NodeCost,
    capacity=st.sampled_from([1.0, 0.5, 0.25, 0.0625]),
    cpu_seconds=st.floats(0, 100),
    bytes_down=st.integers(0, 10**8),
    bytes_up=st.integers(0, 10**8),
)


@given(st.lists(node_costs, max_size=8), st.floats(0, 10), st.floats(1, 1000))
def test_an_exchange_takes_its_slowest_node_plus_the_server(nodes, server, link):
    want = server + max(
        (
            n.cpu_seconds + 8 * (n.bytes_down + n.bytes_up) / (n.capacity * link * 1e6)
            for n in nodes
        ),
        default=0.0,
    )
    assert exchange_seconds(nodes, server, link) == pytest.approx(want)
    # Adding a node never makes the exchange shorter.
    extra = NodeCost(1.0, 0.0, 0, 0)
    assert exchange_seconds([*nodes, extra], server, link) >= exchange_seconds(nodes, server, link)


def _client(capacity, cpu, down, up, status="ok", **more):
    return {
        "capacity": capacity,
        "cpu_seconds": cpu,
        "bytes_down": down,
        "bytes_up": up,
        "status": status,
        **more,
    }


PRODUCT = [
    {
        "round": 0,
        "time": 1030.0,
        "global": {"accuracy": 0.1},
        "clients": [],
        "fisher_warmup": {
            "clients": [_client(1.0, 2.0, 1_000_000, 0), _client(0.25, 1.0, 250_000, 0)]
        },
    },
    {
        "round": 1,
        "time": 1050.0,
        "global": {"accuracy": 0.8},
        "server_seconds": 0.5,
        "clients": [
            _client(1.0, 3.0, 1_000_000, 1_000_000),
            _client(0.25, 1.0, 250_000, 250_000),
            _client(0.5, 99.0, 1, 1, status="no reply"),  # never waited on for its compute
        ],
    },
    {
        "round": 2,
        "time": 1070.0,
        "global": {"accuracy": 0.92},
        "server_seconds": 0.5,
        # An older client without CPU seconds: its wall seconds of training and Fisher stand in.
        "clients": [{**_client(1.0, None, 0, 0), "train_seconds": 4.0, "fisher_seconds": 1.0}],
    },
]


def test_product_curve_counts_the_warm_up_and_only_the_replies():
    curve = product_curve(PRODUCT, submitted_at=1000.0, link_mbit=8.0)
    # round 0: slowest of (2 + 1 s) and (1 + 0.25 MB at 2 Mbit/s = 1 s) -> 3 s round 1: slowest of
    # (3 + 2 MB at 8 Mbit/s = 2 s) and (1 + 0.5 MB at 2 Mbit/s = 2 s) -> 5 s, + 0.5 server round 2:
    # 4 + 1 s, + 0.5 server
    assert curve == [
        Evaluation(0, 0.1, 30.0, pytest.approx(3.0)),
        Evaluation(1, 0.8, 50.0, pytest.approx(8.5)),
        Evaluation(2, 0.92, 70.0, pytest.approx(14.0)),
    ]
    assert first_reaching(curve, 0.9).round == 2
    assert first_reaching(curve, 0.8).round == 1
    assert first_reaching(curve, 0.95) is None


def test_an_overlapped_central_evaluation_counts_only_where_it_outlasts_the_next_rounds_nodes():
    overlapped = [dict(r) for r in PRODUCT]
    overlapped[1] = {**overlapped[1], "central_seconds": 9.0, "central_overlapped": True}
    curve = product_curve(overlapped, submitted_at=1000.0, link_mbit=8.0)
    # round 2's node takes 5 s, round 1's evaluation 9 s beside it: the round lasts 9 s, + 0.5
    # server
    assert curve[2].fleet_seconds == pytest.approx(8.5 + 9.0 + 0.5)
    overlapped[1]["central_seconds"] = 2.0  # shorter than the node: costs nothing
    assert product_curve(overlapped, 1000.0, 8.0)[2].fleet_seconds == pytest.approx(14.0)
    overlapped[1]["central_overlapped"] = (
        False  # evaluated at once: already in its round's server seconds
    )
    overlapped[1]["central_seconds"] = 9.0
    assert product_curve(overlapped, 1000.0, 8.0)[2].fleet_seconds == pytest.approx(14.0)


def test_the_servers_cpu_seconds_stand_for_its_wall_clock_ones_where_recorded():
    cpu = [dict(r) for r in PRODUCT]
    cpu[1] = {
        **cpu[1],
        "server_cpu_seconds": 0.1,
    }  # 0.5 s wall-clock on the shared machine, 0.1 s of CPU
    assert product_curve(cpu, 1000.0, 8.0)[1].fleet_seconds == pytest.approx(8.1)
    assert server_seconds({"server_seconds": 0.5}) == 0.5
    assert server_seconds({"server_seconds": 0.5, "server_cpu_seconds": 0.2}) == 0.2


def test_startup_is_when_the_first_rounds_messages_went_out():
    assert (
        startup_seconds(PRODUCT, 1000.0) == 30.0
    )  # the initial record, made just before round 1 is sent
    assert (
        startup_seconds([{**PRODUCT[0], "round_one_pushed": 1012.5}, *PRODUCT[1:]], 1000.0) == 12.5
    )
    curve = product_curve(PRODUCT, 1000.0, 8.0)
    assert run_row("product", 1, curve, [0.9], startup=12.5)["startup_s"] == 12.5


def test_stock_curve_scores_the_stock_apps_reply_metrics_by_the_same_rule():
    def reply(capacity, cpu, nbytes):
        return {"capacity": capacity, "cpu-seconds": cpu, "bytes-down": nbytes, "bytes-up": nbytes}

    records = [
        {
            "round": 0,
            "time": 1010.0,
            "global": {"accuracy": 0.1},
            "clients": [],
            "server_seconds": 0.2,
        },
        {
            "round": 1,
            "time": 1040.0,
            "global": {"accuracy": 0.9},
            "clients": [reply(1.0, 3.0, 1_000_000), reply(0.25, 2.0, 1_000_000)],
            "server_seconds": 0.25,
        },
    ]
    curve = stock_curve(records, submitted_at=1000.0, link_mbit=8.0)
    # The capacity-1/4 node moves the full model both ways at 2 Mbit/s: 2 + 8 s.
    assert curve == [Evaluation(0, 0.1, 10.0, 0.0), Evaluation(1, 0.9, 40.0, pytest.approx(10.25))]


def test_rows_and_table_say_never_when_a_target_is_not_reached():
    curve = [Evaluation(0, 0.1, 20.0, 0.0), Evaluation(1, 0.91, 50.0, 6.0)]
    row = run_row("product", 1, curve, [0.9, 0.95])
    assert row["startup_s"] == 20.0 and row["rounds_to_0.9"] == 1 and row["fleet_s_to_0.9"] == 6.0
    assert math.isnan(row["rounds_to_0.95"])
    other = run_row(
        "product", 2, [Evaluation(0, 0.1, 30.0, 0.0), Evaluation(1, 0.96, 70.0, 8.0)], [0.9, 0.95]
    )
    text = table([row, other], [0.9, 0.95])
    assert (
        "| product | 2 | 25.0 | 0.9350 | 1 | 60.0 | 7.0 | 1 (1 of 2 runs) | 70.0 (1 of 2 runs) | "
        "8.0 (1 of 2 runs) |" in text
    )
    assert "not reached" in table([row], [0.95])


def test_stock_run_config_takes_the_product_runs_data_model_and_training():
    cfg = parse_run_config(
        {"partitioner": "dirichlet", "dirichlet-alpha": 0.1, "seed": 7, "lr": 0.05}
    )
    rc = stock_run_config(cfg, 4, 2, Path("/tmp/x"))
    assert rc["partitioner"] == "dirichlet" and rc["dirichlet-alpha"] == 0.1 and rc["seed"] == 7
    assert rc["lr"] == 0.05 and rc["num-rounds"] == 4 and rc["min-nodes"] == 2
    assert product_settings(rc).partitioner == "dirichlet"


def test_partition_nodes_keep_their_partition_of_the_whole_fleet(tmp_path):
    fed = PartitionNodes([1.0, 0.5, 1.0], [0, 2], tmp_path, echo=lambda _: None)
    assert fed.node_config(1) == "partition-id=2 num-partitions=3 capacity=1.0"
    with pytest.raises(ValueError):
        PartitionNodes([1.0], [], tmp_path, echo=lambda _: None)


def test_the_stock_app_starts_from_the_products_weights_and_partitions():
    rc = {"dataset": "digits", "model": "cnn", "partitioner": "iid", "dirichlet-alpha": 0.5}
    rc |= {"classes-per-client": 2, "test-fraction": 0.2, "local-test-fraction": 0.2, "seed": 42}
    run = product_settings(rc)
    model, testset = server_model(run)
    cfg = parse_run_config({})  # the product's defaults: the same model, data and seed
    x0, layout, _ = global_model(cfg, create_method(cfg), "cpu")
    stock = layout.flatten(
        {k: v.numpy() for k, v in model.state_dict().items() if k in layout.names}
    )
    np.testing.assert_array_equal(stock, x0)
    node = {"partition-id": 3, "num-partitions": 6, "capacity": 0.25}
    train_set, _ = load_data(run, node)
    want = derive_local_data(cfg, parse_node_config(node))
    np.testing.assert_array_equal(train_set.x, want.train.x)
    np.testing.assert_array_equal(train_set.y, want.train.y)
    with torch.no_grad():
        loss_before = float(
            torch.nn.functional.cross_entropy(
                model(as_input(torch.from_numpy(train_set.x))), torch.from_numpy(train_set.y)
            )
        )
    loss, cpu = train(model, train_set, epochs=2, lr=0.1, momentum=0.9, batch_size=32, seed=0)
    assert cpu > 0 and loss < loss_before
