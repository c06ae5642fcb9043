"""The per-class report that explains where label-skewed federations lose classes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from benchmarks.class_coverage import (
    ClassCoverage,
    class_coverage,
    coverage_lines,
    coverage_table,
    dead_units,
    main,
    run_coverage,
    tier_name,
)
from common.config.parse import parse_run_config
from common.models.architectures import build_model


def test_recall_and_largest_holder_per_class():
    pred = np.array([0, 0, 1, 2, 2, 0])
    y = np.array([0, 0, 1, 1, 2, 2])
    clients = [np.array([0, 1]), np.array([1]), np.array([0, 0])]
    rows = class_coverage(pred, y, clients, [0.25, 1.0, 0.0625], 4)
    assert rows[:3] == [
        ClassCoverage(0, 1.0, 0.25, 2),
        ClassCoverage(1, 0.5, 1.0, 2),
        ClassCoverage(2, 0.5, 0.0, 0),
    ]
    assert rows[3].label == 3 and math.isnan(rows[3].recall) and rows[3].holders == 0
    lines = coverage_lines("run", 0.5, rows)
    assert lines[0] == "run: global acc 0.500"
    assert "classes [1] (largest holder at capacity 1): recall 0.50" in lines[1]
    assert "held by no client" in lines[-1]
    with pytest.raises(ValueError, match="capacities"):
        class_coverage(pred, y, clients, [1.0], 4)


def test_runs_of_one_method_pool_their_class_pairs_per_tier():
    seed0 = [
        ClassCoverage(0, 1.0, 1.0, 1),
        ClassCoverage(1, 0.0, 0.25, 1),
        ClassCoverage(2, float("nan"), 0.25, 1),
    ]
    seed1 = [
        ClassCoverage(0, 0.5, 1.0, 2),
        ClassCoverage(1, 0.5, 0.25, 1),
        ClassCoverage(2, 0.0, 0.0, 0),
    ]
    other = [ClassCoverage(0, 0.25, 0.0625, 1)]
    table = coverage_table(
        [("fedfibos", 0.4, seed0), ("fiarse", 0.2, other), ("fedfibos", 0.6, seed1)]
    )
    assert (
        table[0]
        == "| method | at capacity 1 | at capacity 1/4 | at capacity 1/16 | held by no client | "
        "global acc |"
    )
    # (1.0 + 0.5) / 2 pairs at capacity 1; the NaN recall (no test example) is not a pair
    assert table[2] == "| fedfibos | 0.75 (2) | 0.25 (2) | - | 0.00 (1) | 0.500 |"
    assert table[3] == "| fiarse | - | - | 0.25 (1) | - | 0.200 |"
    assert [tier_name(t) for t in (1.0, 0.015625, 0.3, 0.0)] == [
        "at capacity 1",
        "at capacity 1/64",
        "at capacity 0.3",
        "held by no client",
    ]


def test_dead_units_are_the_hidden_channels_that_never_fire():
    model = build_model("cnn", 10, 1, 0).eval()
    x = torch.rand(16, 1, 8, 8)
    alive = dead_units(model, x)
    assert set(alive) == {"conv1", "conv2", "fc1"}  # the classifier fc2 is not a hidden layer
    assert [t for _, t in alive.values()] == [32, 64, 128]
    with torch.no_grad():
        dead_before = model.conv2(torch.relu(model.conv1(x))).amax(dim=(0, 2, 3)) <= 0
        model.conv2.bias[:5] = -1e6  # five conv2 channels can never be positive
        model.fc1.bias[
            :
        ] = -1e6  # every fc1 unit dead: the model answers one class whatever it sees
    dead = dead_units(model, x)
    assert dead["conv2"] == (5 + int(dead_before[5:].sum()), 64) and dead["fc1"] == (128, 128)
    assert alive["conv2"][0] == int(dead_before.sum())
    assert dead["conv1"] == alive["conv1"]
    assert len(set(model(x).argmax(1).tolist())) == 1
    # brute force on conv1: a channel is dead iff its output is <= 0 at every input and position
    with torch.no_grad():
        brute = int((model.conv1(x).amax(dim=(0, 2, 3)) <= 0).sum())
    assert dead["conv1"][0] == brute


def test_a_run_folder_is_evaluated_like_the_server_does(tmp_path, capsys):
    run = parse_run_config({"dataset": "digits", "partitioner": "pathological", "seed": 3}).flat()
    run["capacity_mix"] = "1.0,0.25,0.0625"
    (tmp_path / "metrics.json").write_text(json.dumps({"run": run, "rounds": []}))
    torch.save(build_model("cnn", 10, 1, 0).state_dict(), tmp_path / "model.pt")
    method, accuracy, rows, dead = run_coverage(tmp_path)
    assert method == "fedfibos"
    assert dead["fc1"][1] == 128
    assert len(rows) == 10 and 0.0 <= accuracy <= 1.0
    assert sum(r.holders for r in rows) == 6  # three clients, two classes each
    assert {r.top_capacity for r in rows if r.holders} <= {0.0625, 0.25, 1.0}
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path.name}: global acc {accuracy:.3f}")
    assert "dead units (never positive on the first 1000 test examples): conv1 " in out
    assert main([str(tmp_path), str(tmp_path)]) == 0
    assert "| fedfibos | " in capsys.readouterr().out.split("| method |")[1]
