"""`fibos ranking-rules`: submodels of one global model under each ranking rule."""

from __future__ import annotations

import csv
import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.ranking.ranking_rules import (
    main,
    pooled_fisher,
    rule_scores,
    run_rankings,
    submodel_accuracy,
)
from common.config.parse import parse_run_config
from common.data.datasets import load_dataset
from common.fisher.selection import budget
from common.models.architectures import build_run_model, load_flat, model_layout, trainable_arrays
from common.training.evaluation import evaluate

positive = st.floats(1e-6, 1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(positive, st.floats(-10, 10, allow_nan=False)), min_size=2, max_size=30))
def test_each_rule_orders_positions_as_its_formula(pairs):
    fisher = np.array([f for f, _ in pairs], dtype=np.float32)
    x = np.array([v for _, v in pairs], dtype=np.float32)
    f64, x64 = fisher.astype(np.float64), x.astype(np.float64)
    formulas = {"fisher": f64**2 * x64**2, "obd": f64 * x64**2, "magnitude": np.abs(x64)}
    for rule, brute in formulas.items():
        scores = rule_scores(rule, x, fisher)
        # same order: every pair the formula separates clearly, the scores separate the same way
        i, j = np.triu_indices(len(x), 1)
        clear = np.abs(brute[i] - brute[j]) > 1e-9 * np.maximum(brute[i], brute[j])
        assert np.all(
            np.sign(scores[i] - scores[j])[clear] == np.sign(brute[i] - brute[j])[clear]
        ), rule


def test_a_fisher_rule_without_a_fisher_and_an_unknown_rule_are_refused():
    x = np.ones(3, dtype=np.float32)
    with pytest.raises(ValueError, match="'obd' needs a Fisher"):
        rule_scores("obd", x, None)
    with pytest.raises(ValueError, match="unknown rule 'taylor'"):
        rule_scores("taylor", x, x)


def test_the_pooled_fisher_is_the_examples_weighted_mean():
    a, b = np.array([1.0, 0.0, 4.0]), np.array([3.0, 2.0, 0.0])
    np.testing.assert_allclose(pooled_fisher([a, b], [1, 3]), (a + 3 * b) / 4)
    with pytest.raises(ValueError, match="positive"):
        pooled_fisher([a, b], [1, 0])
    with pytest.raises(ValueError, match="one weight per estimate"):
        pooled_fisher([a], [1, 2])


def test_a_submodel_is_the_top_k_by_the_scores_and_zero_elsewhere():
    run = parse_run_config({"dataset": "digits"})
    test = load_dataset("digits", run.test_fraction, 0).test
    model = build_run_model(run, test.num_classes, 1)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    rng = np.random.default_rng(0)
    scores = rng.random(x.size)
    got = submodel_accuracy(model, layout, x, scores, Fraction(1, 16), test, torch.device("cpu"))
    keep = np.argsort(-scores)[: budget(Fraction(1, 16), x.size)]
    brute = np.zeros_like(x)
    brute[keep] = x[keep]
    load_flat(model, layout, brute)
    assert got == evaluate(model, test, torch.device("cpu"))[1]


def test_a_finished_run_folder_is_reported_per_rule_and_capacity(tmp_path, capsys):
    run = parse_run_config(
        {"dataset": "digits", "partitioner": "dirichlet", "seed": 1, "fisher-examples": 8}
    ).flat()
    run["capacity_mix"] = "1.0,0.25"
    (tmp_path / "metrics.json").write_text(json.dumps({"run": run, "rounds": []}))
    model = build_run_model(parse_run_config({"dataset": "digits"}), 10, 1)
    torch.save(model.state_dict(), tmp_path / "model.pt")

    found = run_rankings(
        tmp_path, [Fraction(1, 4), Fraction(1)], ["fisher", "client-fisher", "magnitude"]
    )
    assert found.method == "fedfibos"
    # capacity 1 keeps every position: the full model's accuracy whatever the rule
    assert {found.by_rule[r, Fraction(1)] for r in ("fisher", "client-fisher", "magnitude")} == {
        found.accuracy
    }
    assert all(0.0 <= v <= 1.0 for v in found.by_rule.values())

    out = tmp_path / "rules.csv"
    assert (
        main([str(tmp_path), "--capacities", "1/4", "--rules", "magnitude,obd", "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "| fedfibos | 1 | " in printed and "`obd`" in printed
    rows = list(csv.DictReader(out.open()))
    assert [(r["rule"], r["capacity"]) for r in rows] == [("magnitude", "1/4"), ("obd", "1/4")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacities", "2"], "--capacities: capacity '2' is not in (0, 1]"),
        (["--rules", "fisher,taylor"], "--rules: unknown taylor"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, capsys, args, message):
    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as done:
        main([str(tmp_path), *args])
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_a_folder_without_a_model_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "not a finished run folder" in capsys.readouterr().err
