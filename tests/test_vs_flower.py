"""`fibos bench-vs-flower` end to end: the product and the stock Flower FedAvg app on real SuperNode
processes.

One round on two nodes (capacities 1 and 1/4): the stock app must run under Flower as its template
would (the comparison's baseline is otherwise never exercised), report what the fleet time needs,
and the table must come out; ``--reuse`` then runs nothing again.
"""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks.vs_flower.comparison import main

pytestmark = pytest.mark.federation


def test_the_product_and_stock_flower_run_side_by_side_and_are_tabulated(tmp_path, capsys):
    out = tmp_path / "vs"
    argv = [
        "--capacities",
        "1,1/4",
        "--rounds",
        "1",
        "--repeats",
        "1",
        "--targets",
        "0.3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["variant"] for r in rows] == ["product", "stock-capable", "stock-all"]
    for r in rows:
        assert 0 < float(r["startup_s"]) < float(r["wall_s"])
        assert float(r["fleet_s"]) > 0 and float(r["final_acc"]) > 0.3
    assert (out / "vs_flower.png").stat().st_size > 10_000
    summary = (out / "summary.md").read_text()
    assert "fibos bench-vs-flower --capacities 1,1/4" in summary and "| stock-all | 1 |" in summary

    product = json.loads((out / "runs" / "product-1" / "metrics.json").read_text())["rounds"]
    assert all(c["cpu_seconds"] > 0 for c in product[1]["clients"])
    d = json.loads((out / "runs" / "product-1" / "metrics.json").read_text())["run"]["d"]
    for variant, nodes in (("stock-capable", {1.0}), ("stock-all", {1.0, 0.25})):
        stock = json.loads((out / "runs" / f"{variant}-1" / "metrics.json").read_text())["rounds"]
        assert [r["round"] for r in stock] == [0, 1]
        assert (
            stock[0]["global"]["accuracy"] == product[0]["global"]["accuracy"]
        )  # the same initial weights
        replies = stock[1]["clients"]
        assert {c["capacity"] for c in replies} == nodes
        assert all(
            c["cpu-seconds"] > 0 and c["bytes-down"] == c["bytes-up"] == 4 * d for c in replies
        )

    capsys.readouterr()
    assert main([*argv, "--reuse"]) == 0
    assert capsys.readouterr().out.count("reused") == 3
    assert list(csv.DictReader(open(out / "results.csv"))) == rows
