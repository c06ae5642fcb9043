"""Time-to-accuracy: wall-clock seconds until a run's global test accuracy first reaches a target.

Works on the records of ``metrics.json`` from both loops: synchronous rounds
(seconds = cumulative ``round_seconds``) and the asynchronous FedGMR loop
(each record carries ``wall_seconds`` since training started).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def time_to_target(
    seconds: Sequence[float], accuracy: Sequence[float], target: float
) -> float | None:
    """First time at which ``accuracy >= target``; ``None`` if it never does.

    Parameters
    ----------
    seconds : Sequence[float]
        Wall-clock seconds since training started, one per evaluation, non-decreasing.
    accuracy : Sequence[float]
        Accuracy (fraction in [0, 1]) measured at those times.
    target : float
        Target accuracy, a fraction in [0, 1].
    """
    if len(seconds) != len(accuracy):
        raise ValueError(f"{len(seconds)} times but {len(accuracy)} accuracies")
    if any(b < a for a, b in zip(seconds, seconds[1:])):
        raise ValueError("seconds must be non-decreasing")
    for s, acc in zip(seconds, accuracy):
        if acc >= target:
            return float(s)
    return None


def accuracy_curve(records: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """``(seconds, accuracy)`` of the full global model from metrics.json records.

    A record with ``wall_seconds`` (the async loop) uses it; otherwise seconds
    accumulate ``round_seconds`` (round 0, the start evaluation, is at 0 s).
    Records without a global accuracy are skipped.
    """
    seconds, accuracy = [], []
    elapsed = 0.0
    for r in records:
        elapsed = (
            float(r["wall_seconds"])
            if "wall_seconds" in r
            else elapsed + float(r.get("round_seconds", 0.0))
        )
        g = r.get("global") or {}
        if "accuracy" in g:
            seconds.append(elapsed)
            accuracy.append(float(g["accuracy"]))
    return seconds, accuracy
