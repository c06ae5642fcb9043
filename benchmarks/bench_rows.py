"""Benchmark rows (dataclasses) written as JSON and CSV side by side, the form every bench table
reads."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def write_rows(rows: Sequence[Any], out: Path, stem: str) -> tuple[Path, Path]:
    """Write dataclass ``rows`` to ``out/<stem>.json`` and ``out/<stem>.csv`` (one column per
    field).

    Parameters
    ----------
    rows : Sequence
        Dataclass instances of one type; must not be empty.
    out : Path
        Folder (created).
    stem : str
        File name without the extension.
    """
    if not rows:
        raise ValueError("no rows to write")
    out.mkdir(parents=True, exist_ok=True)
    dicts = [asdict(r) for r in rows]
    json_path, csv_path = out / f"{stem}.json", out / f"{stem}.csv"
    json_path.write_text(json.dumps(dicts, indent=1))
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)
    return json_path, csv_path
