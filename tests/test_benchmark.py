"""The benchmark command: a tiny matrix on the Simulation Engine, and its pure helpers."""

from __future__ import annotations

import argparse
import csv
import json
import math

import pytest

from benchmarks.benchmark import (
    LAST_ROUNDS,
    MethodSpec,
    Partition,
    default_methods,
    main,
    run_row,
    settings_differ,
    stored_folder,
    summarise,
)
from common.config.parse import default_run_config

pytestmark = pytest.mark.federation


def test_partition_specs():
    assert Partition.parse("iid").run_config() == {"partitioner": "iid"}
    assert Partition.parse("dirichlet:0.1").run_config() == {
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.1,
    }
    assert Partition.parse("pathological:2").run_config() == {
        "partitioner": "pathological",
        "classes-per-client": 2,
    }
    for bad in ("dirichlet", "shards:3", "iid:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            Partition.parse(bad)


def test_summary_is_mean_and_std_over_seeds():
    rows = [
        {
            "dataset": "digits",
            "partition": "iid",
            "method": "fiarse",
            "fisher_encoding": "none",
            "global_acc": acc,
            "local_acc": 0.5,
            "kib_down_per_client_round": 10.0,
            "kib_up_per_client_round": 5.0,
            "client_train_s": 1.0,
            "client_fisher_s": 0.0,
            "server_s_per_round": 0.1,
            "acc_cap_1": acc,
        }
        for acc in (0.8, 0.9)
    ]
    table = summarise(rows)
    assert "0.850 ± 0.071" in table and "| 2 |" in table


def test_row_gives_the_last_round_and_the_mean_of_the_last_rounds():
    run = {
        "method": "fedavg",
        "dataset": "digits",
        "partitioner": "iid",
        "seed": 0,
        "upload_encoding": "none",
    }
    client = {
        "status": "ok",
        "bytes_down": 10,
        "bytes_up": 5,
        "train_seconds": 0.1,
        "fisher_seconds": 0.0,
    }
    accs = [0.1, 0.5, 0.9, 0.6, 0.8, 0.7, 0.5]  # round 0 (before training), then rounds 1..6
    rounds = [
        {
            "round": i,
            "global": {"accuracy": a},
            "clients": [client] if i else [],
            "server_seconds": 0.0,
        }
        for i, a in enumerate(accs)
    ]
    row = run_row({"run": run, "rounds": rounds}, 1.0)
    assert row["global_acc"] == 0.5 and row["rounds"] == 6
    assert row["global_acc_last"] == pytest.approx(sum(accs[-LAST_ROUNDS:]) / LAST_ROUNDS)
    assert math.isnan(
        row["client_s_per_step"]
    )  # runs recorded before clients reported their examples
    short = run_row(
        {"run": run, "rounds": rounds[:3]}, 1.0
    )  # fewer rounds than LAST_ROUNDS: all of them
    assert short["global_acc_last"] == pytest.approx((0.5 + 0.9) / 2)
    assert f"last {LAST_ROUNDS} rounds" in summarise([row]) and "0.700 ± 0.000" in summarise([row])


def test_row_gives_traffic_per_capacity_and_seconds_per_step():
    run = {
        "method": "lora",
        "dataset": "digits",
        "partitioner": "iid",
        "seed": 0,
        "upload_encoding": "none",
    }
    run |= {"local_epochs": 2, "batch_size": 32}

    def client(capacity, down, up, seconds, examples, status="ok"):
        return {
            "capacity": capacity,
            "status": status,
            "bytes_down": down,
            "bytes_up": up,
            "train_seconds": seconds,
            "fisher_seconds": 0.0,
            "num_examples": examples,
        }

    clients = [
        client(1.0, 2048, 1024, 8.0, 64),
        client(0.25, 1024, 512, 3.0, 33),
        client(0.25, 3072, 0, None, 10, "lost"),
    ]
    rounds = [{"round": 0, "global": {"accuracy": 0.1}, "clients": [], "server_seconds": 0.0}]
    rounds += [{"round": 1, "global": {"accuracy": 0.5}, "clients": clients, "server_seconds": 0.0}]
    row = run_row({"run": run, "rounds": rounds}, 1.0)
    assert (row["kib_down_cap_1"], row["kib_up_cap_1"]) == (2.0, 1.0)
    # a lost reply still cost its download; its upload never came
    assert (row["kib_down_cap_0.25"], row["kib_up_cap_0.25"]) == (2.0, 0.5)
    # 2 epochs of ceil(64/32) = 2 steps in 8 s; 2 epochs of ceil(33/32) = 2 steps in 3 s
    assert row["client_s_per_step"] == pytest.approx((8.0 / 4 + 3.0 / 4) / 2)
    assert (row["s_per_step_cap_1"], row["s_per_step_cap_0.25"]) == (
        8.0 / 4,
        3.0 / 4,
    )  # per capacity too
    clients[0]["peak_rss_mib"], clients[1]["peak_rss_mib"] = 700.0, 650.0
    row = run_row({"run": run, "rounds": rounds}, 1.0)
    assert (row["peak_mib_cap_1"], row["peak_mib_cap_0.25"]) == (700.0, 650.0)


def test_bad_method_fails_before_any_run(tmp_path):
    from common.config.schema import ConfigError

    with pytest.raises(ConfigError, match="method"):
        main(["--methods", "fedsgd", "--datasets", "digits", "--out", str(tmp_path)])


def test_tiny_benchmark_runs_on_the_simulation_engine(tmp_path):
    out = tmp_path / "bench"
    args = [
        "--methods",
        "fedfibos,heterofl",
        "--datasets",
        "digits",
        "--partitions",
        "dirichlet:0.5",
    ]
    args += ["--seeds", "0", "--rounds", "2", "--clients-per-capacity", "1", "--out", str(out)]
    # a Fisher refresh every round, so that fedfibos measures (and uploads) in both rounds
    assert main(args + ["-c", "local-epochs=1", "-c", "fisher-every=1"]) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["method"] for r in rows] == ["fedfibos", "heterofl"]
    for r in rows:
        assert float(r["global_acc"]) > 0.2 and int(r["rounds"]) == 2
        assert float(r["kib_down_per_client_round"]) > 0
    fibos, hetero = rows
    assert (
        float(fibos["client_fisher_s"]) > 0 and float(hetero["client_fisher_s"]) == 0
    )  # only fedfibos estimates
    assert float(fibos["kib_up_per_client_round"]) > float(
        hetero["kib_up_per_client_round"]
    )  # Fisher upload
    summary = (out / "summary.md").read_text()
    assert summary.split("minus each method")[0].count("| digits |") == 2  # one row per method ...
    assert (
        "| digits | dirichlet:0.5 | heterofl | full model | 0 |" in summary
    )  # ... then the paired differences
    layers = list(
        csv.DictReader(open(out / "mask_layers.csv"))
    )  # where the submodels sit, per capacity
    assert {(r["method"], r["capacity"]) for r in layers} >= {
        ("fedfibos", "0.015625"),
        ("heterofl", "0.25"),
    }
    for r in layers:
        assert 0 < float(r["fc2.weight"]) <= 1280
    for png in ("accuracy_vs_round.png", "accuracy_vs_bytes.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # Re-tabulating finished runs starts no federation and gives the same rows.
    (out / "results.csv").unlink()
    assert (
        main(args + ["-c", "local-epochs=1", "-c", "fisher-every=1", "--reuse", "--existing-only"])
        == 0
    )
    again = list(csv.DictReader(open(out / "results.csv")))
    assert [r["global_acc"] for r in again] == [r["global_acc"] for r in rows]
    # The same command run again writes the same figures to the last digit (all but the measured
    # seconds).
    twice = tmp_path / "twice"
    assert main([*args[:-1], str(twice), "-c", "local-epochs=1", "-c", "fisher-every=1"]) == 0
    timed = ("_s", "_s_per_round", "_s_per_step", "peak_mib", "s_to_target_acc")
    for first, second in zip(rows, csv.DictReader(open(twice / "results.csv")), strict=True):
        same = {
            k: v
            for k, v in first.items()
            if not k.endswith(timed) and not k.startswith(("s_per_step", "peak_mib"))
        }
        assert {k: second[k] for k in same} == same


def test_every_run_config_flag_counts(tmp_path):
    """``-c`` repeats like ``flwr run -c``: an earlier override is not dropped by a later one."""
    from common.config.schema import ConfigError

    args = [
        "--methods",
        "fedfibos",
        "--datasets",
        "digits",
        "--out",
        str(tmp_path),
        "--existing-only",
        "--reuse",
    ]
    with pytest.raises(ConfigError, match="fisher-trim"):
        main(args + ["-c", "fisher-trim=0.9", "-c", "local-epochs=1"])


def test_reuse_only_takes_runs_with_the_same_settings():
    stored = {"method": "fedfibos", "local_epochs": 1, "lr": 0.1, "fisher_trim": 0.1, "seed": 0}
    assert settings_differ({"method": "fedfibos", "local-epochs": 1, "seed": 0}, stored) == ""
    diff = settings_differ({"method": "fedfibos", "local-epochs": 3, "fisher-trim": 0.45}, stored)
    assert (
        "local-epochs: 1 stored, 3 planned" in diff
        and "fisher-trim" in diff
        and "method" not in diff
    )


def test_a_run_stored_under_a_renamed_key_is_reused_under_the_new_name(tmp_path):
    legacy = tmp_path / "digits-iid-s0-fedgmr+gmr-capacity-kind=memory"
    legacy.mkdir()
    assert stored_folder(tmp_path, "digits-iid-s0-fedgmr+capacity-kind=memory") == legacy
    assert stored_folder(tmp_path, "digits-iid-s0-fedfibos") == tmp_path / "digits-iid-s0-fedfibos"
    stored = default_run_config().flat() | {"method": "fedgmr", "gmr_capacity_kind": "memory"}
    del stored["capacity_kind"]  # what a run stored before the key was renamed holds
    assert settings_differ({"method": "fedgmr", "capacity-kind": "memory"}, stored) == ""
    assert "capacity-kind" in settings_differ(
        {"method": "fedgmr", "capacity-kind": "bandwidth"}, stored
    )


def test_a_failed_run_does_not_stop_the_matrix(tmp_path, monkeypatch, capsys):
    import benchmarks.benchmark as bench

    started = []

    def broken(capacities, folder, cfg, **kwargs):
        started.append(cfg["method"])
        raise RuntimeError("the run did not finish (no model.pt)")

    monkeypatch.setattr(bench, "run_local_federation", broken)
    args = [
        "--methods",
        "fedfibos,fiarse",
        "--datasets",
        "digits",
        "--partitions",
        "iid",
        "--seeds",
        "0",
    ]
    assert main(args + ["--out", str(tmp_path)]) == 1
    assert started == ["fedfibos", "fiarse"]  # the second run still ran
    out = capsys.readouterr().out
    assert out.count("FAILED") == 2 and "2 run(s) failed" in out


def test_every_documented_benchmark_command_is_valid(tmp_path):
    """The commands `make bench-docs` runs parse and plan (configs validated) without starting a
    run."""
    import shlex
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "results" / "benchmarks.md"
    commands = [
        line.split() for line in doc.read_text().splitlines() if line.startswith("    fibos bench ")
    ]
    assert len(commands) >= 4  # one per current table
    for i, words in enumerate(commands):
        args = shlex.split(" ".join(words[2:]))
        out = args.index("--out")
        args[out + 1] = str(tmp_path / f"c{i}")  # plan into a scratch folder, run nothing
        assert main(args + ["--reuse", "--existing-only"]) == 0, words
        assert (tmp_path / f"c{i}" / "plan.json").exists()


@pytest.mark.parametrize(
    ("override", "flag"),
    [
        ("fisher-encoding=ranked", "--fisher-encodings"),
        ("num-rounds=3", "--rounds"),
        ("seed=4", "--seeds"),
    ],
)
def test_a_run_config_key_a_flag_sets_is_refused_naming_the_flag(tmp_path, capsys, override, flag):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--methods",
                "fedfibos",
                "--datasets",
                "digits",
                "-c",
                override,
                "--out",
                str(tmp_path),
            ]
        )
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_default_methods_leave_out_those_the_data_does_not_fit_and_named_ones_fail(
    tmp_path, capsys
):
    from common.config.schema import ConfigError

    plan_only = [
        "--datasets",
        "digits",
        "--partitions",
        "iid",
        "--seeds",
        "0",
        "--reuse",
        "--existing-only",
    ]
    assert main([*plan_only, "--out", str(tmp_path / "a")]) == 0
    planned = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert planned and not any(
        name.endswith("-lora") for name in planned
    )  # LoRA needs a pretrained text model
    assert (
        "lora left out on digits: method='lora' adapts a pretrained model"
        in capsys.readouterr().out
    )
    with pytest.raises(ConfigError, match="method='lora' adapts a pretrained model"):
        main([*plan_only, "--methods", "lora", "--out", str(tmp_path / "b")])


def test_a_method_spec_carries_its_own_keys_and_refuses_what_a_flag_sets():
    spec = MethodSpec.parse("fedfibos+fisher-every=1+fisher-estimator=received")
    assert (spec.name, spec.overrides) == (
        "fedfibos",
        {"fisher-every": 1, "fisher-estimator": "received"},
    )
    assert spec.label == "fedfibos+fisher-every=1+fisher-estimator=received"
    assert MethodSpec.parse("fedavg").overrides == {}
    for bad in ("+lr=1", "fedfibos+lr", "fedfibos+seed=3"):
        with pytest.raises(argparse.ArgumentTypeError):
            MethodSpec.parse(bad)
    methods = default_methods()
    assert (
        methods.index("fedgmr+capacity-kind=memory") == methods.index("fedgmr") + 1
    )  # FedGMR both ways


def test_a_variant_runs_as_a_row_of_its_own_with_its_keys(tmp_path, monkeypatch):
    import benchmarks.benchmark as bench

    seen = []

    def fake(capacities, folder, cfg, **kwargs):
        seen.append(cfg)
        raise RuntimeError("not run")

    monkeypatch.setattr(bench, "run_local_federation", fake)
    args = [
        "--methods",
        "fedfibos,fedfibos+fisher-every=1",
        "--datasets",
        "digits",
        "--partitions",
        "iid",
    ]
    main(args + ["--seeds", "0", "--out", str(tmp_path)])
    assert [c.get("fisher-every") for c in seen] == [None, 1]
    assert json.loads((tmp_path / "plan.json").read_text())[1].endswith("-fedfibos+fisher-every=1")


def test_row_gives_trained_submodels_overlap_and_whether_clients_stayed_within_capacity():
    run = {
        "method": "fedfibos",
        "dataset": "digits",
        "partitioner": "iid",
        "seed": 0,
        "upload_encoding": "ranked",
    }

    def client(capacity, density, overlap):
        return {"capacity": capacity, "density": density, "mask_overlap": overlap, "status": "ok"}

    base = {"bytes_down": 1, "bytes_up": 1, "train_seconds": 0.1, "fisher_seconds": 0.0}
    trained = {"1": {"accuracy": 0.9}, "0.25": {"accuracy": 0.6}}
    rounds = [{"round": 0, "global": {"accuracy": 0.1}, "clients": [], "server_seconds": 0.0}]
    rounds += [
        {
            "round": 1,
            "global": {"accuracy": 0.5, "trained_per_capacity": {"1": {"accuracy": 0.5}}},
            "clients": [base | client(1.0, 1.0, None), base | client(0.25, 0.25, None)],
            "server_seconds": 0.0,
        },
        {
            "round": 2,
            "global": {
                "accuracy": 0.9,
                "per_capacity": {"0.25": {"accuracy": 0.4}},
                "trained_per_capacity": trained,
            },
            "clients": [base | client(1.0, 1.0, 1.0), base | client(0.25, 0.26, 0.5)],
            "server_seconds": 0.0,
        },
        {
            "round": 3,
            "global": {"accuracy": 0.8},
            "clients": [base | client(0.25, 0.25, 1.0)],
            "server_seconds": 0.0,
        },
    ]
    row = run_row({"run": run, "rounds": rounds}, 1.0, label="fedfibos+fisher-every=1")
    assert row["method"] == "fedfibos+fisher-every=1"
    assert row["trained_cap_0.25"] == 0.6  # the last round that evaluated the clients' submodels
    assert row["overlap_cap_0.25"] == pytest.approx(0.75) and row["overlap_cap_1"] == 1.0
    assert row["overlap_min_cap_0.25"] == 0.5  # round 2's; round 3's is 1
    assert row["within_capacity"] is True
    rounds[-1]["clients"].append(base | client(0.25, 1.0, None))  # a client grown to the full model
    assert run_row({"run": run, "rounds": rounds}, 1.0)["within_capacity"] is False
    table = summarise([row | {"local_acc": 0.5, "client_train_s": 0.1, "client_fisher_s": 0.0}])
    assert "trained @0.25" in table and "overlap @0.25" in table and "min overlap @0.25" in table
    assert "@1 " not in table
    assert "| yes |" in table


def test_row_says_a_client_over_its_bytes_is_over_capacity_and_the_table_says_by_how_much():
    run = {
        "method": "fedfibos",
        "dataset": "digits",
        "partitioner": "iid",
        "seed": 0,
        "upload_encoding": "ranked",
    }
    d, small = 6400, 100  # capacity 1/64: 100 positions

    def client(key, capacity, selected, down, up, mask_bytes):
        return {
            "client_key": key,
            "capacity": capacity,
            "selected": selected,
            "density": selected / d,
            "bytes_down": down,
            "bytes_up": up,
            "mask_bytes": mask_bytes,
            "values_bytes": 4 * selected,
            "status": "ok",
            "train_seconds": 0.1,
            "fisher_seconds": 0.0,
        }

    share = 4 * small + 60
    rounds = [
        {"round": 0, "global": {"accuracy": 0.1}, "clients": [], "server_seconds": 0.0},
        *(
            {
                "round": r,
                "global": {"accuracy": 0.5},
                "clients": [
                    client("big", 1.0, d, 4 * d, 4 * d, 0),
                    client("tiny", 1 / 64, small, share, 4 * small, 60),
                ],
                "server_seconds": 0.0,
            }
            for r in (1, 2)
        ),
    ]
    rounds[2]["federated"] = {"per_capacity": {"0.015625": {"accuracy": 0.9}}}  # its own test split
    row = run_row({"run": run, "rounds": rounds}, 1.0)
    assert row["within_capacity"] is True
    assert row["bytes_ratio_cap_0.015625"] == pytest.approx(1.0)
    assert row["local_cap_0.015625"] == 0.9
    # a warm-up that sent the tiny client the whole model: (4d + 2 shares) / 2 shares
    rounds[0]["fisher_warmup"] = {"clients": [client("tiny", 1 / 64, small, 4 * d, 0, 0)]}
    row = run_row({"run": run, "rounds": rounds}, 1.0)
    assert row["within_capacity"] is False
    assert row["bytes_ratio_cap_0.015625"] == pytest.approx((4 * d + 2 * share) / (2 * share))
    table = summarise([row | {"local_acc": 0.5, "client_train_s": 0.1, "client_fisher_s": 0.0}])
    assert f"no ({(4 * d + 2 * share) / (2 * share):.1f}x bytes @0.015625)" in table
    assert "local @0.015625" in table and "0.900 ± 0.000" in table


def test_paired_differences_compare_the_product_seed_by_seed_with_each_method_within_capacity():
    from benchmarks.benchmark import paired_differences

    def row(method, seed, acc, small, within=True):
        return {
            "dataset": "digits",
            "partition": "dirichlet:0.1",
            "method": method,
            "seed": seed,
            "global_acc": acc,
            "trained_cap_0.015625": small,
            "within_capacity": within,
        }

    rows = [
        row("fedfibos", 0, 0.8, 0.5),
        row("fedfibos", 1, 0.7, 0.4),
        row("fedfibos", 2, 0.9, 0.3),
    ]
    rows += [
        row("fiarse", 0, 0.6, 0.6),
        row("fiarse", 1, 0.75, 0.5),
    ]  # seed 2 missing: compared on 0 and 1
    rows += [
        row("fedavg", s, 0.95, 0.95, within=False) for s in (0, 1, 2)
    ]  # over capacity: left out
    table = paired_differences(rows)
    assert (
        "| digits | dirichlet:0.1 | fiarse | full model | 0,1 | +0.200 / -0.050 | +0.075 | 1 of 2 |"
        in table
    )
    assert "| fiarse | trained @0.015625 | 0,1 | -0.100 / -0.100 | -0.100 | 0 of 2 |" in table
    assert "fedavg" not in table
    assert paired_differences([r for r in rows if r["method"] != "fedfibos"]) == ""


def test_the_headline_table_is_written_from_the_results_it_cites(tmp_path):
    from benchmarks.headline import headline_block

    fields = [
        "method",
        "seed",
        "global_acc",
        "trained_cap_0.015625",
        "within_capacity",
        "bytes_ratio_cap_0.015625",
    ]
    rows = [
        ("fedfibos", 0, 0.8, 0.5, True, 1.02),
        ("fedfibos", 1, 0.6, 0.3, True, 1.03),
        ("fiarse", 0, 0.7, 0.6, True, 1.08),
        ("fiarse", 1, 0.7, 0.6, True, 1.08),
        ("fedavg", 0, 0.9, "", False, 64.0),
        ("fedavg", 1, 0.95, "", False, 64.0),
    ]
    (tmp_path / "r").mkdir()
    with open(tmp_path / "r" / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows(rows)
    readme = "# x\n\n<!-- headline: r/results.csv -->\n| stale |\n|---|\n\nafter\n"
    out = headline_block(readme, tmp_path)
    assert out.startswith(
        "# x\n\n<!-- headline: r/results.csv -->\n| 2 seeds (0, 1) | fedfibos | fiarse | fedavg |"
    )
    assert "| full model, last round | 0.700 ± 0.141 | 0.700 ± 0.000 | 0.925 ± 0.035 |" in out
    assert (
        "| ≤ capacity (values and bytes; worst bytes / share) | yes (1.03x) | yes (1.08x) | no "
        "(64.0x bytes) |" in out
    )
    assert "| trained @1/64 | 0.400 ± 0.141 | 0.600 ± 0.000 | - |" in out
    assert "stale" not in out and out.endswith("\n\nafter\n")
    assert headline_block(out, tmp_path) == out  # rewriting changes nothing
