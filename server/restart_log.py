"""Restart records: how a run came to be resumed, kept in ``metrics.json`` (``restarts``) and
``rounds.jsonl``.

Two writers share one shape. The launcher (``fibos local``) knows what failed and writes its record
between two attempts (:func:`restart_record`, ``cli.restarts``); the resumed ServerApp then marks
that record with the time it resumed (:func:`note_resume`). A run resumed by anyone else (an
operator's ``resume=true``, the compose stack's ``submit``) leaves no launcher record, so the
ServerApp writes one itself, with what it knows.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.round_log import ROUNDS_JSONL, read_rounds

#: ``why`` of a record the ServerApp writes for a resume no launcher recorded.
RESUBMITTED = (
    "resubmitted with resume=true (by an operator, or by the compose stack's submit after a "
    "failure)"
)


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds")


def last_recorded_round(results_dir: Path) -> int:
    """The last round ``rounds.jsonl`` in ``results_dir`` records as finished (0 when none)."""
    rounds = [
        r["round"]
        for r in read_rounds(results_dir / ROUNDS_JSONL)
        if isinstance(r.get("round"), int)
    ]
    return max(rounds, default=0)


def restart_record(
    attempt: int,
    fault: str,
    why: str,
    resumed_from: int,
    last_finished: int,
    failed_at: float | None,
) -> dict[str, Any]:
    """One run restart, as ``metrics.json`` and ``rounds.jsonl`` keep it.

    Parameters
    ----------
    attempt : int
        Its number in the run (1 for the first restart).
    fault : {"serverapp", "superlink", "unknown"}
        What died: the run alone, or the SuperLink with it; ``unknown`` when the resume was not the
        launcher's.
    why : str
        The failure as the launcher saw it (its first line).
    resumed_from : int
        The checkpoint's round: the resumed run starts with the round after it.
    last_finished : int
        The last round recorded as finished before the failure; rounds after ``resumed_from`` up to
        it, and the round that was in flight, are done again.
    failed_at : float, optional
        When the failure was seen (Unix seconds); ``None`` when unknown.
    """
    return {
        "attempt": attempt,
        "fault": fault,
        "why": why,
        "failed_at": None if failed_at is None else _iso(failed_at),
        "resumed_from_round": resumed_from,
        "rounds_redone": max(0, last_finished - resumed_from) + 1,
    }


def note_resume(
    restarts: list[dict[str, Any]], resumed_from: int, last_finished: int, now: float
) -> dict[str, Any]:
    """The record of the resume starting now, stamped ``resumed_at``: the launcher's, or a new one
    (appended).

    Parameters
    ----------
    restarts : list[dict]
        The run's ``restarts`` so far (``metrics.json``), changed in place.
    resumed_from : int
        The checkpoint's round.
    last_finished : int
        The last round recorded before this resume (:func:`last_recorded_round`).
    now : float
        Unix seconds.
    """
    last = restarts[-1] if restarts else None
    if (
        last is not None
        and last.get("resumed_from_round") == resumed_from
        and "resumed_at" not in last
    ):
        last["resumed_at"] = _iso(now)
        return last
    record = restart_record(
        len(restarts) + 1, "unknown", RESUBMITTED, resumed_from, last_finished, None
    )
    record["resumed_at"] = _iso(now)
    restarts.append(record)
    return record
