"""``benchmarks.bench_rows.write_rows``: the JSON and the CSV hold the same rows."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass

import pytest

from benchmarks.bench_rows import write_rows


@dataclass(frozen=True)
class _Row:
    name: str
    value: float


def test_json_and_csv_hold_the_rows_in_order(tmp_path):
    rows = [_Row("a", 0.5), _Row("b", 1.25)]
    json_path, csv_path = write_rows(rows, tmp_path / "out", "t")
    assert json.loads(json_path.read_text()) == [
        {"name": "a", "value": 0.5},
        {"name": "b", "value": 1.25},
    ]
    with open(csv_path) as f:
        assert [(r["name"], float(r["value"])) for r in csv.DictReader(f)] == [
            ("a", 0.5),
            ("b", 1.25),
        ]


def test_no_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        write_rows([], tmp_path, "t")
