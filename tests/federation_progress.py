"""Watching a running federation from its metrics.json (shared by the multi-process tests)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def completed_rounds(results: Path) -> list[dict]:
    """Round records written so far (empty while metrics.json does not exist yet)."""
    try:
        return json.loads((results / "metrics.json").read_text())["rounds"]
    except (OSError, ValueError, KeyError):
        return []


def wait_for_round(results: Path, rnd: int, timeout: float = 300) -> None:
    """Block until round ``rnd`` (or a later one) is recorded; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["round"] >= rnd for r in completed_rounds(results)):
            return
        time.sleep(0.2)
    raise AssertionError(f"round {rnd} never completed")
