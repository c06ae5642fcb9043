"""The SuperLink's SQLite database held locked mid-run: under Flower's 5 s busy timeout the run goes
on; past it the run fails, ``fibos local`` names the database and the lock, replaces the SuperLink
and resumes the run (docs/design/reliability.md, "The SuperLink's database under load" and "What
heals by itself").

The lock is what a loaded machine does to the SuperLink's writes (a commit that cannot finish in
time), made
deterministic: another process holds the database file with ``BEGIN EXCLUSIVE`` from the end of
round 1.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.federation_progress import wait_for_round

pytestmark = pytest.mark.federation

REPO = Path(__file__).resolve().parents[1]


def _lock_after_round_one(results: Path, seconds: float, held: dict) -> None:
    """Once round 1 is recorded, hold the launch's SuperLink database exclusively for
    ``seconds``."""
    try:
        wait_for_round(results, 1, timeout=600)
        db = next((results.resolve() / ".flwr").rglob("state.db"))
        con = sqlite3.connect(db, timeout=30, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        held["db"] = db
        time.sleep(seconds)
        con.execute("COMMIT")
        con.close()
    except BaseException as err:  # noqa: BLE001 - reported by the test
        held["error"] = err


def _local_run_with_a_lock(
    tmp_path: Path, seconds: float
) -> tuple[subprocess.CompletedProcess[str], dict]:
    results = tmp_path / "run"
    held: dict = {}
    locker = threading.Thread(
        target=_lock_after_round_one, args=(results, seconds, held), daemon=True
    )
    locker.start()
    done = subprocess.run(
        [sys.executable, "-m", "cli.launcher", "--capacities", "1,1/2", "--rounds", "2",
         "--results", str(results), "--timeout", "600", "-c", "eval-every=0", "-c",
         "round-timeout=60"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    locker.join(timeout=60)
    assert "error" not in held, held
    assert "db" in held, f"round 1 never completed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, held


def test_a_lock_shorter_than_the_busy_timeout_is_waited_out(tmp_path: Path) -> None:
    done, _ = _local_run_with_a_lock(tmp_path, 2.0)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "run" / "model.pt").exists()


def test_a_lock_past_the_busy_timeout_is_named_and_the_run_heals(tmp_path: Path) -> None:
    done, held = _local_run_with_a_lock(tmp_path, 12.0)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "run" / "model.pt").exists()
    failed = f"the run failed (SuperLink lost: the SuperLink's database {held['db']} was locked"
    assert failed in done.stdout and "'database is locked'" in done.stdout, done.stdout[-3000:]
    restarts = json.loads((tmp_path / "run" / "metrics.json").read_text())["restarts"]
    assert len(restarts) == 1 and restarts[0]["fault"] == "superlink", restarts
    assert str(held["db"]) in restarts[0]["why"] and "resumed_at" in restarts[0]
    assert "Traceback" not in done.stderr, done.stderr


def test_the_in_memory_database_leaves_no_file_to_lock(tmp_path: Path) -> None:
    """``--superlink-database memory``: Flower's in-memory state, no SQLite file while it runs; the
    run finishes."""
    results = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.launcher", "--capacities", "1,1/2", "--rounds", "1",
         "--results", str(results), "--timeout", "600", "-c", "eval-every=0",
         "--superlink-database", "memory"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: set[str] = set()
    looked = 0
    while (
        proc.poll() is None
    ):  # the launch's Flower state is removed at its end: look while it runs
        seen.update(
            str(p) for p in tmp_path.rglob("*") if p.name.endswith((".db", ".db-wal", ".db-shm"))
        )
        looked += (results / ".flwr").is_dir()
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, out[-3000:]
    assert (results / "model.pt").exists() and looked > 10
    assert not seen, seen
