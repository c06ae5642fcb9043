"""What ``fibos local`` does when part of a run dies: how often it restarts, how long it waits, what
it records.

A failed run whose results folder holds a checkpoint is resubmitted with ``resume=true`` (after a
fresh SuperLink when the SuperLink died); a SuperNode that exits while the run is live is started
again. Both are bounded (:class:`RestartPolicy`) and wait longer after each try. Each run restart is
recorded where the run's other records are: a ``restarts`` list in ``metrics.json`` and one
``{"restart": ...}`` line in ``rounds.jsonl``, so a reader of either sees when the run was
interrupted, why, and which rounds were done again (:mod:`server.restart_log` makes the records; the
resumed ServerApp stamps them with when it resumed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.persistence import atomic_write
from server.round_log import ROUNDS_JSONL

METRICS = "metrics.json"


@dataclass(frozen=True)
class RestartPolicy:
    """How many times something is started again, and the waits between tries.

    Parameters
    ----------
    attempts : int
        Restarts allowed (0: none; the first failure is final).
    backoff_s : float
        Seconds before the first restart; each later one waits twice as long as the one before.
    max_backoff_s : float
        The longest wait, in seconds.
    """

    attempts: int = 3
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"restart attempts must be 0 or more, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(
                f"restart back-off must be 0 s or more, got {self.backoff_s} and "
                f"{self.max_backoff_s}"
            )

    def wait_s(self, done: int) -> float:
        """Seconds to wait before restart number ``done + 1`` (``done`` restarts already made)."""
        return min(self.max_backoff_s, self.backoff_s * 2.0**done)


def record_restart(results_dir: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to the ``restarts`` of ``metrics.json`` and as a line of ``rounds.jsonl``
    (durably).

    Called between two attempts, while no ServerApp writes either file. The resumed run keeps both
    records: its ``metrics.json`` carries ``restarts`` over, and its ``rounds.jsonl`` keeps a
    restart line with the rounds up to the one it resumed from.
    """
    metrics_path = results_dir / METRICS
    doc = json.loads(metrics_path.read_text())
    doc.setdefault("restarts", []).append(record)
    atomic_write(metrics_path, json.dumps(doc, indent=1).encode())
    rounds = results_dir / ROUNDS_JSONL
    torn = rounds.exists() and rounds.stat().st_size > 0 and not rounds.read_bytes().endswith(b"\n")
    with open(rounds, "a", encoding="utf-8") as f:
        # After a line torn by the kill, start a line of its own (read_rounds skips the torn one).
        f.write(
            ("\n" if torn else "") + json.dumps({"restart": record}, separators=(",", ":")) + "\n"
        )
        f.flush()
        os.fsync(f.fileno())
