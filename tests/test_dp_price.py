"""The price-of-DP table and plot read from bench results (:mod:`benchmarks.privacy.dp_price`)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from benchmarks.privacy.dp_price import main, plot_price, price_grid, price_table, split_budget

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench"


@pytest.mark.parametrize(
    ("method", "family", "epsilon"),
    [
        ("fedavg", "fedavg", math.inf),
        ("fedavg+dp-epsilon=8", "fedavg", 8.0),
        (
            "fedfibos+fedfibos-fisher-power=0+dp-epsilon=0.5",
            "fedfibos+fedfibos-fisher-power=0",
            0.5,
        ),
        ("fedavg+dp-epsilon=4+local-epochs=2", "fedavg+local-epochs=2", 4.0),
        ("fedfibos+fedfibos-fisher-power=0", "fedfibos+fedfibos-fisher-power=0", math.inf),
    ],
)
def test_a_label_splits_into_its_family_and_budget(method, family, epsilon):
    assert split_budget(method) == (family, epsilon)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("fedavg+dp-epsilon=0", "must be positive"),
        ("fedavg+dp-epsilon=-1", "must be positive"),
        ("fedavg+dp-epsilon=nan", "must be positive"),
        ("fedavg+dp-epsilon=eight", "not a number"),
        ("fedavg+dp-epsilon=8+dp-epsilon=4", "given 2 times"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_method(method, message):
    with pytest.raises(ValueError, match=message) as err:
        split_budget(method)
    assert method in str(err.value)


def _row(method: str, seed: int, acc: float, partition: str = "dirichlet:0.1") -> dict:
    return {
        "dataset": "digits",
        "partition": partition,
        "method": method,
        "seed": str(seed),
        "global_acc": str(acc),
    }


ROWS = [
    _row("fedavg", 0, 0.9),
    _row("fedavg", 1, 0.8),
    _row("fedavg+dp-epsilon=8", 0, 0.6),
    _row("fedavg+dp-epsilon=8", 1, 0.5),
    _row("fedavg+dp-epsilon=1", 0, 0.1),
    _row("fedfibos", 0, 0.7),  # never under DP: no price to show
]


def test_the_grid_keeps_families_with_a_budget_and_every_seed():
    grid = price_grid(ROWS)
    assert grid == {
        ("digits", "dirichlet:0.1"): {
            "fedavg": {math.inf: {0: 0.9, 1: 0.8}, 8.0: {0: 0.6, 1: 0.5}, 1.0: {0: 0.1}}
        }
    }


def test_a_tag_keeps_runs_that_differ_in_more_than_the_label_apart():
    rows = [dict(r, fisher_encoding="ranked") for r in ROWS[:3]] + [
        dict(r, fisher_encoding="masked") for r in ROWS[:3]
    ]
    grid = price_grid(rows, tag=lambda r: f" ({r['fisher_encoding']})")
    assert set(grid["digits", "dirichlet:0.1"]) == {"fedavg (ranked)", "fedavg (masked)"}
    with pytest.raises(ValueError, match="fedavg seed 0: given twice"):
        price_grid(rows)


def test_the_table_gives_each_seed_and_the_mean_no_dp_first():
    assert price_table(price_grid(ROWS)) == (
        "digits, dirichlet:0.1: full model on the server's test set, per seed (mean)\n\n"
        "| method | no DP | epsilon 8 | epsilon 1 |\n"
        "|---|---|---|---|\n"
        "| fedavg | 0.900 / 0.800 (0.850) | 0.600 / 0.500 (0.550) | 0.100 (0.100) |"
    )


def test_the_plot_is_a_png_with_a_panel_per_partition(tmp_path):
    rows = ROWS + [
        _row("fedavg", 0, 0.95, "dirichlet:0.5"),
        _row("fedavg+dp-epsilon=4", 0, 0.3, "dirichlet:0.5"),
    ]
    path = plot_price(price_grid(rows), tmp_path / "sub" / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_the_command_joins_several_results_files(tmp_path, capsys):
    a = _write_csv(tmp_path / "a.csv", ROWS[:3])
    b = _write_csv(tmp_path / "b.csv", [_row("fedavg+dp-epsilon=4", 0, 0.3)])
    assert main(["--results", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "dp_price.md").read_text()
    assert "| no DP | epsilon 8 | epsilon 4 |" in table
    assert "0.300 (0.300)" in capsys.readouterr().out
    assert (tmp_path / "out" / "accuracy_vs_epsilon.png").stat().st_size > 0


def test_the_command_refuses_results_without_a_budget(tmp_path):
    a = _write_csv(tmp_path / "a.csv", [_row("fedavg", 0, 0.9)])
    with pytest.raises(SystemExit) as err:
        main(["--results", str(a), "--out", str(tmp_path / "out")])
    assert err.value.code == 2
    assert not (tmp_path / "out").exists()


def test_the_command_names_a_missing_file_a_foreign_file_and_a_repeated_run(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(["--results", str(tmp_path / "nope.csv"), "--out", str(out)])
    assert "nope.csv: no such file" in capsys.readouterr().err
    foreign = _write_csv(tmp_path / "f.csv", [{"method": "fedavg+dp-epsilon=8", "seed": "0"}])
    with pytest.raises(SystemExit):
        main(["--results", str(foreign), "--out", str(out)])
    assert "no column 'dataset'" in capsys.readouterr().err
    a = _write_csv(tmp_path / "a.csv", ROWS[:3])
    with pytest.raises(SystemExit):
        main(["--results", str(a), str(a), "--out", str(out)])
    assert "seed 0: given twice" in capsys.readouterr().err
    assert not out.exists()


def test_the_documented_digits_table_reads_from_its_results_file():
    with open(DOCS / "dp-digits-dirichlet0.1-gn" / "results.csv", newline="") as f:
        grid = price_grid(list(csv.DictReader(f)))
    fedavg = grid["digits", "dirichlet:0.1"]["fedavg"]
    assert [round(fedavg[8.0][s], 3) for s in (0, 1, 2)] == [0.578, 0.667, 0.439]
    assert [round(fedavg[math.inf][s], 3) for s in (0, 1, 2)] == [0.944, 0.900, 0.872]
