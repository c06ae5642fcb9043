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

import numpy as np
import torch
from numpy.typing import NDArray


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

    def __init__(self, path: Path, run: dict[str, Any], keep_until: int | None = None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"run": run, "rounds": []}
        if keep_until is not None and path.exists():  # resuming: keep the completed rounds
            self.doc["rounds"] = [r for r in json.loads(path.read_text())["rounds"] if r["round"] <= keep_until]

    def append(self, record: dict[str, Any]) -> None:
        """Add a round record and rewrite the file."""
        self.doc["rounds"].append(record)
        atomic_write(self.path, json.dumps(self.doc, indent=1).encode())


CHECKPOINT = "checkpoint.npz"


def save_checkpoint(path: Path, server_round: int, x: NDArray[np.float32], fisher_state: bytes) -> None:
    """Everything a resumed run needs after ``server_round``: the global vector and the Fisher state.

    The server draws no random numbers (selection is deterministic and client
    seeds derive from the run seed and the round), so no RNG state is needed.
    """
    buf = io.BytesIO()
    np.savez(buf, round=np.array(server_round), x=x, fisher_state=np.frombuffer(fisher_state, dtype=np.uint8))
    atomic_write(path, buf.getvalue())


def load_checkpoint(path: Path) -> tuple[int, NDArray[np.float32], bytes]:
    """``(round, x, fisher_state_bytes)`` from :func:`save_checkpoint`."""
    with np.load(path) as z:
        return int(z["round"]), z["x"].astype(np.float32), z["fisher_state"].tobytes()


def save_model(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save a ``state_dict`` atomically (``torch.load(path)`` reads it back)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    atomic_write(path, buf.getvalue())
