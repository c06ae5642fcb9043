"""``rounds.jsonl``: one JSON line per round, appended and flushed to disk as the round ends (``tail
-f`` it).

``metrics.json`` is rewritten whole after every round, which suits a reader that wants the finished
run; ``rounds.jsonl`` is for watching one: each round record (the dict ``SubmodelStrategy.on_round``
receives, round 0 included) is appended as one line, flushed and ``fsync``'ed before the round is
reported done, so a server killed with SIGKILL leaves every finished round readable. Only the line
being written when the process died can be torn; :func:`read_rounds` skips it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from server.persistence import atomic_write, fsync_dir

ROUNDS_JSONL = "rounds.jsonl"


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The round records of the ``rounds.jsonl`` at ``path``, in file order (``[]`` when it does not
    exist).

    Parameters
    ----------
    path : Path
        The file to read.

    A line that is not a JSON object (the torn last line of a killed run) is skipped.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


class RoundLog:
    """Appends round records to ``rounds.jsonl``, one JSON line each, durable once :meth:`append`
    returns.

    Nothing is written until the first :meth:`append` (like :class:`server.persistence.MetricsLog`),
    so a run that fails before its first round leaves an earlier run's file as it was.

    Parameters
    ----------
    path : Path
        The file, ``<results-dir>/rounds.jsonl`` (next to ``metrics.json``).
    keep_until : int, optional
        ``None``: a fresh run; the first append starts the file over. A round number (a resumed
        run's checkpoint round): the lines of rounds up to and including it are kept and later ones
        dropped, the file being rewritten atomically on the first append, then appended to as usual.
    """

    def __init__(self, path: Path, keep_until: int | None = None) -> None:
        self.path = path
        self.keep_until = keep_until
        #: Records the first append writes before its own (a resume's kept rounds); ``None`` once
        #: written.
        self._pending: list[dict[str, Any]] | None = None
        if keep_until is not None:
            self._pending = [r for r in read_rounds(path) if _round_of(r) <= keep_until]
        self._started = False

    def note_restart(self, record: dict[str, Any]) -> None:
        """Keep ``{"restart": record}`` among a resumed run's kept lines, in place of the line of
        the same ``attempt`` (the launcher's, now stamped by the ServerApp) or after the kept
        rounds; written with them on the first :meth:`append`.
        """
        if self._pending is None:
            raise RuntimeError(
                "a restart is noted only by a resumed run, before its first round is appended"
            )
        for i, kept in enumerate(self._pending):
            if (
                isinstance(kept.get("restart"), dict)
                and kept["restart"].get("attempt") == record["attempt"]
            ):
                self._pending[i] = {"restart": record}
                return
        self._pending.append({"restart": record})

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line at the end of the file and flush it to disk (``fsync``).

        Parameters
        ----------
        record : dict
            A JSON-ready round record with a ``round`` number.
        """
        line = _line(record)
        if not self._started:
            self._start()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def _start(self) -> None:
        """Begin the file: atomically rewritten with the kept rounds (resume), or emptied (fresh
        run)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._pending is not None:
            atomic_write(self.path, "".join(_line(r) for r in self._pending).encode())
            self._pending = None
        else:
            with open(self.path, "w", encoding="utf-8") as f:
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(
                self.path.parent
            )  # the (new) file's name is durable before any line is reported written
        self._started = True


def _line(record: dict[str, Any]) -> str:
    """One record as one line of JSON (``json.dumps`` escapes any newline inside strings)."""
    return json.dumps(record) + "\n"


def _round_of(record: dict[str, Any]) -> int:
    """The record's round number; a record without one sorts after every kept round (so it is
    dropped).

    A launcher's restart record (``{"restart": ...}``) belongs after the round its run resumed from.
    """
    restart = record.get("restart")
    if isinstance(restart, dict) and isinstance(restart.get("resumed_from_round"), int):
        return restart["resumed_from_round"]
    rnd = record.get("round")
    return rnd if isinstance(rnd, int) else 1 << 62
