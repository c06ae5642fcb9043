"""``fibos bench-fisher-cost``: the rows it writes and the flags it refuses."""

from __future__ import annotations

import csv

import pytest

from benchmarks.fisher_cost_bench import main


def test_cost_rows_relate_estimate_and_encoding_to_training(tmp_path, capsys):
    out = tmp_path / "cost"
    argv = [
        "--dataset",
        "digits",
        "--models",
        "cnn",
        "--capacities",
        "1/4,1/16",
        "--local-epochs",
        "1",
    ]
    assert main([*argv, "--repeat", "1", "--out", str(out)]) == 0
    with open(out / "fisher_cost.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["estimator"], float(r["capacity"])) for r in rows] == [
        ("global", 0.25),
        ("received", 0.25),
        ("path", 0.25),
        ("global", 0.0625),
        ("received", 0.0625),
        ("path", 0.0625),
    ]
    for r in rows:
        train, estimate, encode = (
            float(r[k]) for k in ("train_seconds", "estimate_seconds", "encode_seconds")
        )
        assert train > 0 and estimate >= 0 and encode > 0
        assert float(r["overhead"]) == pytest.approx((estimate + encode) / train)
        assert r["encoding"] == "ranked" and int(r["examples"]) > 32
    assert (out / "fisher_cost.png").stat().st_size > 0 and (out / "fisher_cost.json").exists()
    assert "| digits | cnn | received | ranked | 0.25 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--estimators", "exact"), ("--encoding", "zip"), ("--fisher-examples", "0")],
)
def test_bad_flags_fail_naming_the_flag(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([flag, value, "--out", str(tmp_path)])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
