"""The server benchmark: its helpers, the rounds it times (the product's strategy's, over a
synthetic grid), and one small run end to end (the numbers are not checked, only their shape)."""

from __future__ import annotations

import inspect
import json
import math
import time
import types
from functools import partial

import numpy as np
import pytest

from benchmarks import server_bench, step_clock
from benchmarks.server_bench import (
    GROWS_WITH_CLIENTS,
    STEPS,
    capacities_for,
    grows_with_clients,
    main,
    mask_entropy_bytes,
    per_client_rows,
    per_client_table,
    round_memory,
    scaling_lines,
    table,
)
from common.config.parse import parse_run_config

#: The steps the strategy's own clock measures of ``run_round`` (the other steps follow it).
INSIDE_THE_STRATEGY = (
    "select",
    "encode",
    "validate",
    "aggregate",
    "fisher",
    "prior",
    "influence",
    "rest",
)


def _cnn_data(pool: int = 2) -> server_bench.SyntheticRound:
    """The CNN's synthetic data (151,306 values)."""
    from common.models.architectures import build_model, model_layout, trainable_arrays

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    return server_bench.SyntheticRound(layout, layout.flatten(trainable_arrays(model)), pool, 0)


def test_mask_entropy_bytes():
    assert mask_entropy_bytes(0, 10) == 0 and mask_entropy_bytes(10, 10) == 0
    assert mask_entropy_bytes(4, 8) == pytest.approx(
        1.0
    )  # H(1/2) = 1 bit per position, 8 positions
    assert mask_entropy_bytes(1, 64) == pytest.approx(
        64 * -(math.log2(1 / 64) / 64 + 63 / 64 * math.log2(63 / 64)) / 8
    )


def test_capacities_cycle():
    assert capacities_for(5, [1.0, 0.25]) == [1.0, 0.25, 1.0, 0.25, 1.0]


def test_round_memory_holds_every_message_of_the_round_and_the_parts_that_grow_with_the_clients():
    # d = 100 at capacities 1 and 1/4 (100 and 25 kept): 13 bytes of packed mask a client, kept for
    # this round and the previous one, and in the mask history. A refresh round's messages carry the
    # kept values and the 75 outside the 1/4 mask, each with its mask code and 4096 bytes of
    # overhead; the grid keeps each mask code and makes one Fisher payload (40 bytes per position).
    # Eight replies pulled ahead (delta, Fisher inside, one mean per row: at most d rows); the
    # running sum and one reply unpacked (3300); seven model copies and two level masks; both
    # estimates stored in fp32 with their held masks, 12 bytes per position, and the checkpoint's.
    cfg = parse_run_config({})
    two = round_memory(100, [1.0, 0.25], 2, cfg, "refresh")
    assert two == {
        "sent": 52.0,
        "mask_history": 26.0,
        "messages": 4 * 125 + 4 * 75 + 2 * (13 + 4096.0),
        "grid": 2 * (13 + 4096) + 40 * 100.0,
        "replies": 8 * (400 + 800 + 4096.0),
        "fold": 3300.0,
        "model": 3000.0,
        "fisher_state": 2026.0,
        "checkpoint": 826.0,
    }
    held = round_memory(100, [1.0, 0.25], 2, cfg, "held", rows=10)
    assert held["messages"] == 4 * 125 + 2 * (13 + 4096) and held["grid"] == 2 * 4096
    assert held["replies"] == 8 * (400 + 4096)  # the update only
    ten_rows = round_memory(100, [1.0, 0.25], 2, cfg, "refresh", rows=10)
    assert ten_rows["replies"] == 8 * (400 + 440 + 4096)
    many = round_memory(100, [1.0, 0.25], 2000, cfg, "refresh")
    assert many["sent"] == 52_000.0 and many["mask_history"] == 26_000.0
    four = round_memory(100, [1.0, 0.25], 4, cfg, "refresh")
    # Linear in the clients (the levels are cycled: every two clients add the same).
    assert all(many[k] - two[k] == 999 * (four[k] - two[k]) for k in GROWS_WITH_CLIENTS)
    growing = ("sent", "mask_history", "messages", "grid")
    assert grows_with_clients(two) == sum(two[k] for k in growing)
    assert all(many[k] == two[k] for k in ("replies", "fold", "model"))  # bounded by the model
    small = parse_run_config(
        {"fisher-memory-mb": 1.0, "fisher-precision": "fp16"}
    )  # a budget of 3 estimates (the floor)
    assert (
        round_memory(2**18, [1.0], 10, small)["fisher_state"]
        == 3 * 2**18 * 2 + 12 * 2**18 + 3 * 2**15
    )


def test_a_round_the_memory_cannot_hold_is_refused_before_it_runs_with_its_figure(tmp_path):
    pattern = r"refused before any round: .*\n.*cnn x 3, refresh round: needs ~\d+\.\d GiB \("
    with pytest.raises(SystemExit, match=pattern):
        main(
            [
                "--models",
                "cnn",
                "--clients",
                "3",
                "--max-memory-gb",
                "0.01",
                "--out",
                str(tmp_path / "out"),
            ]
        )
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
    assert scaling_lines(rows) == [
        "m: server seconds per round = 0.000 + 2.0000 x clients (largest deviation 0%)"
    ]
    earlier = [{**rows[0], "project": {**steps, "select": 4.0}, "round_project": 30.0}]
    beside = table(rows, earlier)
    assert "| m | 10 | select client masks | 1.000 | 1.000 | 1.0 | 4.000 | 4.0 |" in beside
    assert "| m | 10 | **whole round** | 20.00 | 10.00 | 2.0 | 30.00 | 3.0 |" in beside
    assert (
        "| m | 20 | select client masks | 1.000 | 1.000 | 1.0 | - | - |" in beside
    )  # not measured before


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
        assert set(r["project"]) == set(r["cpu"]) == set(r["anchor"]) == {key for key, _ in STEPS}
        assert all(v >= 0 for v in r["project"].values())
        assert all(r["anchor"][key] is None for key in ("validate", "influence", "rest"))
        assert (
            0 <= r["per_client_seconds"] <= r["round_project"] and 0 <= r["per_client_cpu_seconds"]
        )
        # The steps of run_round are the strategy's own seconds of it, split: together never more.
        inside = sum(r["project"][key] for key in INSIDE_THE_STRATEGY)
        assert 0 < r["strategy_seconds"] and inside <= r["strategy_seconds"] + 1e-3
        after = r["project"]["eval_masks"] + r["project"]["checkpoint"]
        assert r["round_project"] == pytest.approx(inside + after)
        assert 0 <= r["checkpoint_written_mb"] <= r["checkpoint_mb"]
    refresh = [r for r in doc["rounds"] if r["round"] == "refresh"]
    assert all(r["project"]["fisher"] > 0 and r["anchor"]["fisher"] is not None for r in refresh)
    held = [r for r in doc["rounds"] if r["round"] == "held"]
    assert all(
        r["project"]["fisher"] == 0.0 and r["anchor"]["fisher"] is None for r in held
    )  # no uploads
    # The checkpoint is incremental: a held round changes no estimate and no held mask, so it
    # writes no state.
    assert all(r["checkpoint_written_mb"] > 0 for r in refresh)
    assert all(r["checkpoint_written_mb"] == 0 for r in held)
    assert [(r["round"], r["clients"]) for r in doc["per_client"]] == [
        ("refresh", 2),
        ("refresh", 4),
        ("held", 2),
        ("held", 4),
    ]
    assert doc["settings"]["bench"] == server_bench.BENCH_SETTINGS
    assert all(row["ratio"] <= 1.1 for row in doc["downloads"]["cnn"])
    assert all(0 < r["peak_rss_gib"] <= r["estimate_gib"] for r in doc["rounds"])
    assert (tmp_path / "server_bench.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_bench.json", "server_bench.png"]


@pytest.mark.parametrize("kind", ["refresh", "held"])
def test_the_benchmark_round_is_the_strategys_own(tmp_path, monkeypatch, kind):
    """Every round the benchmark plays goes through SubmodelStrategy's configure_train,
    aggregate_train and its fold; every synthetic reply is accepted; and the model and the method's
    state after the timed round equal what an untimed SubmodelStrategy computes, driven through
    Flower's configure_train / aggregate_train over the same grid: the timing changes nothing."""
    from flwr.app import ConfigRecord

    from benchmarks.synthetic_grid import EXAMPLES, SyntheticGrid
    from server.strategy import SubmodelStrategy

    calls = {"configure_train": [], "aggregate_train": [], "fold_train_replies": []}
    for name in calls:
        real = getattr(SubmodelStrategy, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name].append(self)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(SubmodelStrategy, name, counted)
    data, n, levels = _cnn_data(), 6, [1.0, 0.25, 1 / 16]
    run = parse_run_config({"fisher-memory-mb": 1})  # three estimates: clients 0-2 evicted
    cfg = server_bench.bench_config(run, kind)
    fed = server_bench.bench_federation(data, cfg, n, levels, tmp_path)
    method = fed.strategy.method
    anchors = server_bench.Anchors(data, method, n)
    timed = server_bench.play(fed, kind, partial(server_bench.instrument, fed, anchors))
    rounds = server_bench.TIMED_ROUND[kind]
    assert {name: len(seen) for name, seen in calls.items()} == dict.fromkeys(calls, rounds)
    assert all(s is fed.strategy for seen in calls.values() for s in seen)
    assert fed.grid.trained == n * rounds
    trained = fed.result.train_metrics_clientapp
    assert all(trained[r]["num-examples"] == n * EXAMPLES for r in range(1, rounds + 1))
    assert {c.status for c in timed.done.plan.clients.values()} == {"ok"}
    assert fed.clock.project["select"] > 0 and fed.clock.project["validate"] > 0
    # The patches are undone.
    assert not {"mask_for", "encode", "validate", "round_fold", "observe"} & set(vars(method))
    assert not {"submodel_message", "level_mask"} & set(vars(fed.strategy))

    monkeypatch.undo()
    ref = SubmodelStrategy(cfg, data.layout)
    grid = SyntheticGrid(data, capacities_for(n, levels), ref.method.upload_encoding(cfg))
    ref.registry.join(grid, 60.0)
    arrays = ref.to_arrays(data.x)
    for server_round in range(1, rounds + 1):
        plan = ref.configure_train(server_round, arrays, ConfigRecord(), grid)
        replies = grid.send_and_receive(plan.take_messages())
        arrays, _ = ref.aggregate_train(server_round, replies, plan)
    assert ref.x.tobytes() == fed.strategy.x.tobytes()
    assert ref.method.state_bytes() == method.state_bytes()
    assert not np.array_equal(ref.x, data.x)  # the rounds moved the model


#: Seconds each ranking of a capacity level's mask is made to take.
SLOW = 0.5


@pytest.mark.parametrize("kind", ["held", "refresh"])
def test_a_levels_prior_mask_is_the_rounds_work_and_the_prior_is_cached_when_the_round_starts(
    tmp_path, monkeypatch, kind
):
    """fisher-memory-mb = 1 holds three CNN estimates: of 8 clients, 5 are ranked by the prior, one
    mask per capacity level. Ranking a level's mask (made slow here) counts in the round's "select"
    step, not in the per-client constant; the prior those clients are ranked by is the one the
    previous round's end left cached; and central evaluation ranks each level again for the round's
    new model."""
    from common.fisher.level_masks import LevelMasks
    from common.fisher.state import FisherState
    from server.strategy import SubmodelStrategy

    ranked, priors, configuring = [], [], []
    real_get, real_prior = LevelMasks.get, FisherState.global_prior
    real_configure = SubmodelStrategy.configure_train

    def slow_get(self, x, token, gamma, compute):
        def slow():
            time.sleep(SLOW)
            ranked.append(gamma)
            return compute()

        return real_get(self, x, token, gamma, slow)

    def counted_prior(state):
        if configuring:
            # True: the prior had to be computed (the sort), not read.
            priors.append((configuring[-1], state._prior is None))
        return real_prior(state)

    def configure(self, server_round, *args):
        configuring.append(server_round)
        try:
            return real_configure(self, server_round, *args)
        finally:
            configuring.pop()

    monkeypatch.setattr(LevelMasks, "get", slow_get)
    monkeypatch.setattr(FisherState, "global_prior", counted_prior)
    monkeypatch.setattr(SubmodelStrategy, "configure_train", configure)
    cfg = parse_run_config({"fisher-memory-mb": 1})
    t = server_bench.run_round(_cnn_data(), cfg, 8, [1.0, 0.25], tmp_path, kind)
    # The two levels' masks of the clients ranked by the prior.
    assert t.project["select"] >= 2 * SLOW
    assert t.extra["per_client_seconds"] < SLOW
    assert t.project["eval_masks"] >= 2 * SLOW
    last = server_bench.TIMED_ROUND[kind]
    timed = [computed for server_round, computed in priors if server_round == last]
    assert timed and not any(timed)


@pytest.mark.parametrize("guards", [{}, {"min-per-row": 2, "keep-vectors": True}])
def test_the_rounds_masks_are_ranked_with_the_runs_guards(tmp_path, monkeypatch, guards):
    """Every Fisher-ranked mask of the benchmark's rounds (the method's, for clients, levels and
    central evaluation) and of its download table takes the run's ``min-per-row`` and
    ``keep-vectors``, defaults included: the benchmark's own settings leave the run's guards as they
    are."""
    from common.fisher import selection
    from common.methods import fedfibos

    data = _cnn_data()
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

    monkeypatch.setattr(fedfibos, "select_mask", spied)
    monkeypatch.setattr(server_bench, "select_mask", spied)
    for kind in ("held", "refresh"):
        (tmp_path / kind).mkdir()
        server_bench.run_round(data, cfg, 8, [1.0, 0.25], tmp_path / kind, kind)
    rounds = len(seen)
    server_bench.download_rows(data, cfg, [1.0, 0.25])
    assert rounds and len(seen) > rounds and set(seen) == {want}


def test_a_refresh_rounds_masks_are_every_clients_own_and_encoded_afresh_in_each_repeat(tmp_path):
    """Clients a pool apart get estimates of their own, so the refresh round looks up no
    Fisher-ranked mask's code, in its first run or a repeat; a held round finds the held masks'
    codes the round before it left."""
    data = _cnn_data()
    assert all(
        data.estimate(i).tobytes() != data.estimate(j).tobytes() for i in range(6) for j in range(i)
    )
    cfg = parse_run_config({})  # every client's estimate stored: all masks ranked by their own
    levels = [1 / 16, 1 / 64]  # codes kept by content (indices, Elias-Fano)
    for repeat in range(2):
        t = server_bench.run_round(data, cfg, 8, levels, tmp_path, "refresh")
        assert t.extra["mask_code_hits"] == 0, repeat
    held = server_bench.run_round(data, cfg, 8, levels, tmp_path, "held")
    assert held.extra["mask_code_hits"] == 8


class _Ticks:
    """A clock that advances one second at every reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_step_clock_credits_each_span_its_own_seconds(monkeypatch):
    """A call inside another counts for its own step only, an absorbing span keeps its calls'
    seconds, a paused block counts for none, and an anchor's seconds are kept apart: the steps add
    up to the time spent in them."""
    ticks = types.SimpleNamespace(perf_counter=_Ticks(), process_time=_Ticks())
    monkeypatch.setattr(step_clock, "time", ticks)
    clock = step_clock.StepClock()
    inner = clock.wrap(lambda: None, "inner")
    # outer reads 1; inner 2-3; the anchor 4-5; the paused block 6-7; outer ends at 8.
    with clock.step("outer", per_client=False):
        inner()
        clock.anchor("outer", lambda: None)
        with clock.paused():
            inner()  # absorbed by the paused block: no span of its own
    with clock.step("level", absorbs=True):  # 9-10: the inner call opens no span, reads no clock
        inner()
    assert clock.project == {"inner": 1.0, "outer": 7.0 - 1.0 - 1.0 - 1.0, "level": 1.0}
    assert clock.anchors == {"outer": 1.0} and clock.aside == [1.0, 1.0]
    assert clock.per_client == [2.0, 2.0]  # inner and level, not outer
    patches, obj = step_clock.Patches(), types.SimpleNamespace(f=1)
    patches.set(obj, "f", 2)
    patches.set(obj, "g", 3)
    patches.undo()
    assert vars(obj) == {"f": 1}
