"""The wall-clock comparison's pure helpers (benchmarks/wallclock_bench.py) and the
seconds-to-target column."""

from __future__ import annotations

import math

from benchmarks.benchmark import run_row
from benchmarks.wallclock_bench import table, variant_config, wallclock_row


def _client(status="ok", staleness=None):
    c = {
        "status": status,
        "bytes_down": 100,
        "bytes_up": 50,
        "train_seconds": 1.0,
        "fisher_seconds": 0.0,
    }
    return c if staleness is None else {**c, "staleness": staleness}


ASYNC = {
    "run": {
        "method": "fedgmr",
        "dataset": "digits",
        "partitioner": "iid",
        "seed": 0,
        "fisher_encoding": "masked",
    },
    "rounds": [
        {
            "round": 0,
            "wall_seconds": 0.0,
            "global": {"accuracy": 0.1},
            "clients": [],
            "server_seconds": 0.0,
        },
        {
            "round": 1,
            "wall_seconds": 9.0,
            "global": {"accuracy": 0.7},
            "clients": [_client(staleness=0), _client(staleness=2), _client("rejected: x")],
            "server_seconds": 0.5,
        },
        {
            "round": 2,
            "wall_seconds": 15.0,
            "global": {"accuracy": 0.85},
            "clients": [_client(staleness=1)],
            "server_seconds": 0.5,
        },
    ],
}


def test_variant_config():
    assert variant_config("fedgmr:async") == {"method": "fedgmr", "gmr-mode": "async"}
    assert variant_config("fedfibos") == {"method": "fedfibos"}


def test_wallclock_row_and_table():
    row = wallclock_row("fedgmr:async", ASYNC, [0.6, 0.8, 0.9], 40.0)
    assert (row["s_to_0.6"], row["s_to_0.8"], row["train_s"]) == (9.0, 15.0, 15.0)
    assert math.isnan(row["s_to_0.9"])
    assert row["updates_applied"] == 3 and row["mean_staleness"] == 1.0
    assert row["final_acc"] == 0.85 and row["best_acc"] == 0.85
    text = table([row], [0.6, 0.8, 0.9])
    assert "| fedgmr:async | 0.8500 | 0.8500 | 15.0 | 3 | 1.00 | 9.0 | 15.0 | not reached |" in text


def test_benchmark_row_has_seconds_to_target():
    assert run_row(ASYNC, 40.0, target_acc=0.6)["s_to_target_acc"] == 9.0
    assert math.isnan(run_row(ASYNC, 40.0, target_acc=0.99)["s_to_target_acc"])
