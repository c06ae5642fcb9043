"""The server benchmark: its helpers, and one small run end to end (the numbers are not checked, only their shape)."""

from __future__ import annotations

import inspect
import json
import math

import pytest

from benchmarks.server_bench import (
    STEPS,
    capacities_for,
    main,
    mask_entropy_bytes,
    per_client_rows,
    per_client_table,
    round_memory,
    scaling_lines,
    table,
)
from common.config.parse import parse_run_config


def test_mask_entropy_bytes():
    assert mask_entropy_bytes(0, 10) == 0 and mask_entropy_bytes(10, 10) == 0
    assert mask_entropy_bytes(4, 8) == pytest.approx(1.0)  # H(1/2) = 1 bit per position, 8 positions
    assert mask_entropy_bytes(1, 64) == pytest.approx(64 * -(math.log2(1 / 64) / 64 + 63 / 64 * math.log2(63 / 64)) / 8)


def test_capacities_cycle():
    assert capacities_for(5, [1.0, 0.25]) == [1.0, 0.25, 1.0, 0.25, 1.0]


def test_round_memory_grows_with_the_clients_only_by_their_packed_masks():
    # d = 100 at capacities 1 and 1/4: 13 bytes of packed mask a client; the running sum (16 bytes per position),
    # one reply unpacked (9 per position) with 100 kept (8 bytes each: int32 index, delta); both estimates stored
    # in fp32 with their held masks (13 bytes each) plus 12 bytes per position, and the checkpoint's copy of the
    # estimates and held masks.
    two = round_memory(100, [1.0, 0.25], 2, parse_run_config({}))
    assert two == {"sent": 26.0, "fold": 3300.0, "fisher_state": 2026.0, "checkpoint": 826.0}
    many = round_memory(100, [1.0, 0.25], 2000, parse_run_config({}))
    assert many["sent"] == 26_000.0 and many["fold"] == two["fold"]
    small = parse_run_config(
        {"fisher-memory-mb": 1.0, "fisher-precision": "fp16"}
    )  # a budget of 3 estimates (the floor)
    assert round_memory(2**18, [1.0], 10, small)["fisher_state"] == 3 * 2**18 * 2 + 12 * 2**18 + 3 * 2**15


def test_a_round_the_memory_cannot_hold_is_refused_before_it_runs_with_its_figure(tmp_path):
    with pytest.raises(SystemExit, match=r"refused before any round: .*\n.*cnn x 3: needs ~\d+\.\d GiB \(process"):
        main(["--models", "cnn", "--clients", "3", "--max-memory-gb", "0.01", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_tables_and_scaling_line():
    steps = {key: 1.0 for key, _ in STEPS}
    rows = [
        {
            "model": "m",
            "clients": n,
            "project": steps,
            "anchor": {**steps, "validate": None},
            "round_project": 2.0 * n,
            "round_anchor": float(n),
        }
        for n in (10, 20)
    ] + [{"model": "m", "clients": 400, "skipped": "too big"}]
    text = table(rows)
    assert "| m | 10 | validate + decode replies | 1.000 | - | - |" in text
    assert "| m | 20 | **whole round** | 40.00 | 20.00 | 2.0 |" in text
    assert "skipped: too big" in text
    assert scaling_lines(rows) == ["m: server seconds per round = 0.000 + 2.0000 x clients (largest deviation 0%)"]
    earlier = [{**rows[0], "project": {**steps, "select": 4.0}, "round_project": 30.0}]
    beside = table(rows, earlier)
    assert "| m | 10 | select client masks | 1.000 | 1.000 | 1.0 | 4.000 | 4.0 |" in beside
    assert "| m | 10 | **whole round** | 20.00 | 10.00 | 2.0 | 30.00 | 3.0 |" in beside
    assert "| m | 20 | select client masks | 1.000 | 1.000 | 1.0 | - | - |" in beside  # not measured before


def test_per_client_rows_divide_by_the_clients_and_take_slopes_between_counts():
    def row(n, kind, total, cpu, work, work_cpu):
        return {
            "model": "m",
            "clients": n,
            "round": kind,
            "round_project": total,
            "round_anchor": total / 2,
            "round_cpu": cpu,
            "per_client_seconds": work,
            "per_client_cpu_seconds": work_cpu,
        }

    rows = [
        row(50, "held", 20.0, 10.0, 10.0, 5.0),
        row(10, "held", 4.0, 2.0, 2.0, 1.0),
        row(10, "refresh", 9.0, 6.0, 5.0, 3.0),
        {"model": "m", "clients": 500, "round": "held", "skipped": "too big"},
    ]
    got = per_client_rows(rows)
    assert got == [
        {
            "model": "m",
            "round": "held",
            "clients": 10,
            "work": 0.2,
            "work_cpu": 0.1,
            "slope": None,
            "slope_cpu": None,
            "ratio": 2.0,
        },
        {
            "model": "m",
            "round": "held",
            "clients": 50,
            "work": 0.2,
            "work_cpu": 0.1,
            "slope": (20.0 - 4.0) / 40,
            "slope_cpu": (10.0 - 2.0) / 40,
            "ratio": 2.0,
        },
        {
            "model": "m",
            "round": "refresh",
            "clients": 10,
            "work": 0.5,
            "work_cpu": 0.3,
            "slope": None,
            "slope_cpu": None,
            "ratio": 2.0,
        },
    ]
    text = per_client_table(rows)
    assert "| m | held | 50 | 0.200 | 0.100 | 0.400 | 0.200 | 2.0 |" in text
    assert "| m | refresh | 10 | 0.500 | 0.300 | - | - | 2.0 |" in text


def test_table_and_lines_name_the_round_kind():
    steps = {key: 1.0 for key, _ in STEPS}
    rows = [
        {
            "model": "m",
            "clients": n,
            "round": kind,
            "project": steps,
            "anchor": {**steps, "validate": None},
            "round_project": (2.0 if kind == "held" else 3.0) * n,
            "round_anchor": float(n),
        }
        for kind in ("refresh", "held")
        for n in (10, 20)
    ]
    earlier = [{**rows[0], "round_project": 40.0}]
    del earlier[0]["round"]  # an earlier run's rows have no kind: refresh rounds
    text = table(rows, earlier)
    assert "| m | 10 | held | **whole round** | 20.00 | 10.00 | 2.0 | - | - |" in text
    assert "| m | 10 | refresh | **whole round** | 30.00 | 10.00 | 3.0 | 40.00 | 4.0 |" in text
    assert [line.split(" = ")[0] for line in scaling_lines(rows)] == [
        "m, refresh round: server seconds per round",
        "m, held round: server seconds per round",
    ]
    assert [line.split(" + ")[1] for line in scaling_lines(rows)] == [
        "3.0000 x clients (largest deviation 0%)",
        "2.0000 x clients (largest deviation 0%)",
    ]


def test_small_run_writes_json_and_plot(tmp_path):
    assert main(["--models", "cnn", "--clients", "2,4", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "server_bench.json").read_text())
    assert [(r["round"], r["clients"]) for r in doc["rounds"]] == [
        ("refresh", 2),
        ("refresh", 4),
        ("held", 2),
        ("held", 4),
    ]
    for r in doc["rounds"]:
        assert set(r["project"]) == set(r["cpu"]) == {key for key, _ in STEPS}
        assert all(v >= 0 for v in r["project"].values())
        assert 0 <= r["per_client_seconds"] <= r["round_project"] and 0 <= r["per_client_cpu_seconds"]
    held = [r for r in doc["rounds"] if r["round"] == "held"]
    assert all(r["project"]["fisher"] == 0.0 and r["anchor"]["fisher"] is None for r in held)  # no uploads
    assert [(r["round"], r["clients"]) for r in doc["per_client"]] == [
        ("refresh", 2),
        ("refresh", 4),
        ("held", 2),
        ("held", 4),
    ]
    assert all(row["ratio"] <= 1.1 for row in doc["downloads"]["cnn"])
    assert all(0 < r["peak_rss_gib"] <= r["estimate_gib"] for r in doc["rounds"])
    assert (tmp_path / "server_bench.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_bench.json", "server_bench.png"]


class _Ticks:
    """A clock that advances one second at every reading (wall and CPU alike)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("kind", ["held", "refresh"])
def test_a_levels_prior_mask_is_the_rounds_work_and_the_prior_is_cached_when_the_round_starts(
    tmp_path, monkeypatch, kind
):
    import types

    from benchmarks import server_bench
    from common.fisher.state import FisherState
    from common.models.architectures import build_model, model_layout, trainable_arrays

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    data = server_bench.SyntheticRound(layout, layout.flatten(trainable_arrays(model)), 2, 0)
    cfg = parse_run_config({"fisher-memory-mb": 1})  # three estimates of the CNN (151,306 values): clients 0-4 evicted
    priors = []
    real_prior = FisherState.global_prior

    def counted(state):
        priors.append(state._prior is None)  # True: the prior had to be computed (the sort), not read
        return real_prior(state)

    monkeypatch.setattr(FisherState, "global_prior", counted)
    monkeypatch.setattr(server_bench, "time", types.SimpleNamespace(perf_counter=_Ticks(), process_time=_Ticks()))
    t = server_bench.run_round(data, cfg, 8, [1.0, 0.25], tmp_path, kind)
    # Every lap between two readings is one second: each of the 8 clients has its select, encode, validate and
    # sum lap (and a Fisher fold lap in a refresh round); the two levels' prior-ranked masks (clients 0 and 1,
    # the first of each level beyond the budget) are the round's, not a client's.
    per_client_laps = 8 * (5 if kind == "refresh" else 4)
    assert t.project["select"] == 8
    assert t.extra["per_client_seconds"] == t.extra["per_client_cpu_seconds"] == per_client_laps - 2
    # The evicted clients were ranked by the prior the previous round's end left cached.
    assert priors and not any(priors[1:3])


@pytest.mark.parametrize("guards", [{}, {"min-per-row": 2, "keep-vectors": True}])
def test_the_rounds_masks_are_ranked_with_the_runs_guards(tmp_path, monkeypatch, guards):
    """Every Fisher-ranked mask the benchmark makes (clients', levels', central evaluation's) takes the run's
    ``min-per-row`` and ``keep-vectors``, defaults included, as the method does."""
    from benchmarks import server_bench
    from common.fisher import selection
    from common.models.architectures import build_model, model_layout, trainable_arrays

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    data = server_bench.SyntheticRound(layout, layout.flatten(trainable_arrays(model)), 2, 0)
    cfg = parse_run_config({"fisher-memory-mb": 1, **guards})
    method_guards = cfg.options("mask-guards")
    want = (method_guards.min_per_row, method_guards.keep_vectors)
    seen = []
    real = selection.select_mask

    def spied(layout, x, gamma, rule, fisher=None, *args, **kwargs):
        bound = inspect.signature(real).bind(layout, x, gamma, rule, fisher, *args, **kwargs)
        bound.apply_defaults()
        seen.append((bound.arguments["min_per_row"], bound.arguments["keep_vectors"]))
        return real(layout, x, gamma, rule, fisher, *args, **kwargs)

    monkeypatch.setattr(server_bench, "select_mask", spied)
    for kind in ("held", "refresh"):
        (tmp_path / kind).mkdir()
        server_bench.run_round(data, cfg, 8, [1.0, 0.25], tmp_path / kind, kind)
    assert seen and set(seen) == {want}


def test_a_refresh_rounds_masks_are_every_clients_own_and_encoded_afresh_in_each_repeat(tmp_path):
    """Clients a pool apart get estimates of their own, so no Fisher-ranked mask's code is looked up in a refresh
    round, in its first run or a repeat; a held round finds the held masks' codes the previous round left."""
    from benchmarks import server_bench
    from common.models.architectures import build_model, model_layout, trainable_arrays
    from common.wire.mask_codec import ENCODINGS

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    data = server_bench.SyntheticRound(layout, layout.flatten(trainable_arrays(model)), 2, 0)
    assert all(data.estimate(i).tobytes() != data.estimate(j).tobytes() for i in range(6) for j in range(i))
    cfg = parse_run_config({})  # every client's estimate stored: all masks ranked by their own
    levels = [1 / 16, 1 / 64]  # codes kept by content (indices, Elias-Fano)
    for repeat in range(2):
        server_bench.run_round(data, cfg, 8, levels, tmp_path, "refresh")
        assert ENCODINGS.hits == 0, repeat
    server_bench.run_round(data, cfg, 8, levels, tmp_path, "held")
    assert ENCODINGS.hits == 8
