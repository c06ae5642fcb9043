"""The SuperLink's database under stalled writes: which settings let a run finish.

Each case is one short local federation (``fibos local``'s :class:`LocalFederation`: 2 SuperNodes on
digits) whose SuperLink keeps its state in a SQLite file or in memory. A stalled write is made
deterministic: from the end of round 1 another process holds the database file with ``BEGIN
EXCLUSIVE`` for ``--locks`` seconds (what a loaded machine or a slow disk does to the SuperLink's
commits; Flower's SQLite busy timeout is 5 s and cannot be changed). ``--load N`` adds N
busy-looping processes for the whole run. One line per case: outcome, why, wall seconds, and how
often the SuperLink logged "database is locked".

Usage::

    python -m benchmarks.superlink_load --out /tmp/superlink-load --databases file,memory --locks 0,3,6,12
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

from cli.launcher import DATABASE_LOCKED, MEMORY_DATABASE, LocalFederation


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _round_recorded(results: Path, rnd: int, timeout: float) -> None:
    """Block until ``results/metrics.json`` records round ``rnd``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(
                r["round"] >= rnd
                for r in json.loads((results / "metrics.json").read_text())["rounds"]
            ):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"round {rnd} was not recorded within {timeout:.0f} s")


def _hold_lock(results: Path, db: Path, seconds: float, note: dict) -> None:
    """Once round 1 is recorded in ``results``, hold the SuperLink's SQLite file ``db`` exclusively
    for ``seconds``."""
    try:
        _round_recorded(results, 1, timeout=900)
        con = sqlite3.connect(db, timeout=60, isolation_level=None)
        t0 = time.monotonic()
        con.execute("BEGIN EXCLUSIVE")
        note["waited"] = time.monotonic() - t0
        time.sleep(seconds)
        con.execute("COMMIT")
        con.close()
    except Exception as err:  # noqa: BLE001 - part of the result line
        note["lock_error"] = repr(err)


def run_case(out: Path, database: str, lock: float, rounds: int, load: int) -> dict:
    """One federation run; returns its result line as a dict."""
    home = out / f"{database.replace('/', '_')}-lock{lock:g}-load{load}"
    results = home / "run"
    db = None if database == "file" else database
    if database not in ("file", MEMORY_DATABASE):
        db = str(Path(database).expanduser().resolve() / f"state-{time.monotonic_ns()}.db")
    stop = multiprocessing.Event()
    spinners = [
        multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)
    ]
    for p in spinners:
        p.start()
    note: dict = {}
    t0 = time.monotonic()
    try:
        with LocalFederation((1.0, 0.5), home, echo=lambda line: None, database=db) as fed:
            locker = None
            if lock > 0 and database != MEMORY_DATABASE:
                where = Path(fed.database_path)
                locker = threading.Thread(
                    target=_hold_lock, args=(results, where, lock, note), daemon=True
                )
                locker.start()
            try:
                fed.run(
                    {"num-rounds": rounds, "eval-every": 0, "round-timeout": 60.0},
                    results,
                    timeout=900,
                )
                outcome, why = "finished", ""
            except (RuntimeError, TimeoutError) as err:
                # The launcher's own explanation (the database named) comes first; Flower's error is
                # the cause.
                named = err.__cause__ is not None
                outcome = "failed, database named" if named else "failed"
                why = str(err.__cause__ or err).splitlines()[0][:200]
            log = (fed.logs / "superlink.log").read_text(errors="replace")
            if locker is not None:
                locker.join(timeout=120)
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)
        if db is not None and db != MEMORY_DATABASE:  # a file this case made in the given folder
            for suffix in ("", "-wal", "-shm"):
                Path(db + suffix).unlink(missing_ok=True)
    return {
        "database": database,
        "lock_s": lock if database != MEMORY_DATABASE else None,
        "load": load,
        "outcome": outcome,
        "wall_s": round(time.monotonic() - t0, 1),
        "locked_lines": log.count(DATABASE_LOCKED),
        "why": why or note.get("lock_error", ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs")
    parser.add_argument(
        "--databases",
        default="file,memory",
        help="comma-separated: file (the launcher's default, under --out), memory, or a folder for "
        "the SQLite file (e.g. /dev/shm for a RAM disk)",
    )
    parser.add_argument(
        "--locks", default="0,3,6,12", help="comma-separated seconds the database is held locked"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--load", type=int, default=0, help="busy-looping processes beside the federation"
    )
    args = parser.parse_args(argv)
    locks = [float(v) for v in args.locks.split(",") if v.strip()]
    print("| database | lock s | load | outcome | wall s | 'database is locked' lines | why |")
    print("|---|---|---|---|---|---|---|")
    for database in (d.strip() for d in args.databases.split(",") if d.strip()):
        for lock in [0.0] if database == MEMORY_DATABASE else locks:
            row = run_case(args.out, database, lock, args.rounds, args.load)
            lock_cell = "n/a" if row["lock_s"] is None else f"{row['lock_s']:g}"
            print(
                f"| {row['database']} | {lock_cell} | {row['load']} | {row['outcome']} | "
                f"{row['wall_s']} | {row['locked_lines']} | {row['why']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
