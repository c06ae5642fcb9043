"""The structured-vs-masked cost benchmark runs end to end and measures what it claims."""

from __future__ import annotations

import json

import pytest

from benchmarks.structured_bench import main

pytestmark = pytest.mark.federation


def test_structured_bench_writes_results_and_structured_costs_less(tmp_path):
    out = tmp_path / "sb"
    args = [
        "--models",
        "cnn",
        "--gammas",
        "1,1/4",
        "--cnn-examples",
        "96",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    rows = {(r["gamma"], r["variant"]): r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {
        ("1", "structured"),
        ("1", "masked"),
        ("1/4", "structured"),
        ("1/4", "masked"),
    }
    full_s, full_m = rows[("1", "structured")], rows[("1", "masked")]
    assert full_s["params_allocated"] == full_m["params_allocated"] == full_m["params_held"]
    assert full_s["train_gflops_per_sample"] == full_m["train_gflops_per_sample"]
    small_s, small_m = rows[("1/4", "structured")], rows[("1/4", "masked")]
    assert (
        small_m["params_allocated"] == full_m["params_allocated"]
    )  # a masked client allocates everything
    assert small_s["params_allocated"] == small_s["params_held"] < 0.4 * full_s["params_held"]
    assert small_s["train_gflops_per_sample"] < 0.4 * small_m["train_gflops_per_sample"]
    assert (
        small_m["train_gflops_per_sample"] == full_m["train_gflops_per_sample"]
    )  # masks save no FLOPs
    assert all(r["train_mib"] >= 0 and r["s_per_epoch"] > 0 for r in rows.values())
    assert "| cnn | 1/4 |" in (out / "table.md").read_text()
    assert (out / "structured_vs_masked.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.csv").read_text().startswith("model,data,gamma,variant")
