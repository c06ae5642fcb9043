"""Atomic writes of the run's outputs: metrics.json, the model and the Fisher state.

Every file is written to a temporary name in the same folder and renamed over
the old one, so a reader (or a crash) never sees a torn file.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsLog:
    """``metrics.json``: a JSON object with the run's settings and one record per round.

    Parameters
    ----------
    path : Path
        Where to write.
    run : dict
        Run settings stored next to the rounds.
    """

    def __init__(self, path: Path, run: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"run": run, "rounds": []}

    def append(self, record: dict[str, Any]) -> None:
        """Add a round record and rewrite the file."""
        self.doc["rounds"].append(record)
        atomic_write(self.path, json.dumps(self.doc, indent=1).encode())


def save_model(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save a ``state_dict`` atomically (``torch.load(path)`` reads it back)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    atomic_write(path, buf.getvalue())
