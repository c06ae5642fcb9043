"""Watching a running federation from its metrics.json (shared by the multi-process tests)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
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


def wait_until(condition: Callable[[], object], timeout: float, poll: float = 0.1) -> bool:
    """Whether ``condition()`` became true within ``timeout`` s (polled every ``poll`` s, and once
    at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return bool(condition())


def checkpointed_round(results: Path) -> int:
    """The round of the checkpoint in ``results`` once it is whole enough to load; 0 while there is
    none."""
    from server.persistence import CHECKPOINT, check_checkpoint

    try:
        return check_checkpoint(results / CHECKPOINT)[0]
    except (OSError, ValueError):
        return 0
