"""A launcher killed outright leaves nothing running: its process group's guard stops what it
started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cli.process_group import RELEASE, ProcessGroup, guard, pids_with_env, stop_pids
from tests.federation_progress import wait_until

pytestmark = pytest.mark.federation

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = "import time; time.sleep(600)"
# A daemon that starts a child in a session of its own, as Flower's SuperLink and SuperNodes do.
DAEMON = (
    f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], "
    f"start_new_session=True); {SLEEPER}"
)
# A launcher: a process group with that daemon and a plain child; it sleeps until killed.
LAUNCHER = """
import os, sys, time
from pathlib import Path
from cli.process_group import ProcessGroup
marker, folder = sys.argv[1], Path(sys.argv[2])
key, value = marker.split("=", 1)
group = ProcessGroup(marker, guard_log=folder / "guard.log")
env = {**os.environ, key: value}
group.start([sys.executable, "-c", sys.argv[3]], folder / "daemon.log", env)
group.start([sys.executable, "-c", sys.argv[4]], folder / "child.log", env)
print("started", flush=True)
time.sleep(600)
"""


@pytest.fixture
def marker():
    """A marker unique to the test; whatever still carries it at the end is killed."""
    entry = f"FIBOS_TEST_GROUP={uuid.uuid4().hex}"
    yield entry
    stop_pids(lambda: _carrying(entry), grace=0.0)


def _carrying(marker: str) -> list[int]:
    return pids_with_env(lambda entries: marker.encode() in entries)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _sleeper(marker: str) -> subprocess.Popen:
    """A process carrying ``marker``, returned once ``/proc`` shows it.

    ``Popen`` returns when the exec has begun, but the kernel sets up the new program's environment
    a moment later; until then ``/proc/<pid>/environ`` reads empty. On a loaded machine a scan in
    that moment missed the marker (the guard's later passes find such a process; the first one is
    what these tests check).
    """
    key, value = marker.split("=", 1)
    child = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], env={**os.environ, key: value}, start_new_session=True
    )
    assert wait_until(lambda: child.pid in _carrying(marker), 30), "the sleeper never showed"
    return child


def test_a_sigkilled_launchers_processes_are_stopped_by_its_guard(
    tmp_path: Path, marker: str
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, marker, str(tmp_path), DAEMON, SLEEPER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout.readline().strip() == "started"
        assert wait_until(lambda: len(_carrying(marker)) == 3, 30), _carrying(
            marker
        )  # daemon, its child, child
        launcher.kill()
        launcher.wait()
        assert wait_until(lambda: _carrying(marker) == [], 20), (
            f"still running: {_carrying(marker)}"
        )
    finally:
        launcher.kill()
        launcher.wait()
    assert (
        "the launcher died without stopping its processes; stopping PIDs"
        in (tmp_path / "guard.log").read_text()
    )


def test_a_group_stopped_by_its_launcher_lets_its_guard_go(tmp_path: Path, marker: str) -> None:
    key, value = marker.split("=", 1)
    group = ProcessGroup(marker, guard_log=tmp_path / "guard.log")
    group.start([sys.executable, "-c", SLEEPER], tmp_path / "child.log", {**os.environ, key: value})
    watcher = group.guard
    assert watcher is not None and watcher.poll() is None
    group.stop(grace=5.0)
    assert watcher.returncode == 0 and group.guard is None
    assert _carrying(marker) == []
    assert not (tmp_path / "guard.log").exists()  # it had nothing to do


def test_the_guard_acts_only_when_the_pipe_ends_without_a_release(marker: str) -> None:
    child = _sleeper(marker)
    try:
        assert guard(marker.encode(), [f"{child.pid}\n", f"{RELEASE}\n"]) == []
        assert child.poll() is None  # released: nothing touched
        assert guard(marker.encode(), [f"{child.pid}\n"], grace=5.0) == [child.pid]
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_a_sigkilled_fibos_local_leaves_no_federation_running(tmp_path: Path) -> None:
    """The whole federation (SuperLink, SuperNodes, Flower's detached children, ``flwr run``) ends
    with it."""
    results = tmp_path / "run"
    launch = subprocess.Popen(
        [sys.executable, "-m", "cli.fibos", "local", "--capacities", "1,1/4", "--rounds", "50"]
        + ["--results", str(results), "-c", "eval-every=0 local-epochs=1"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prefix = f"FLWR_HOME={results.resolve() / '.flwr'}{os.sep}".encode()

    def federation() -> list[int]:
        return pids_with_env(lambda entries: any(e.startswith(prefix) for e in entries))

    def running(program: bytes) -> bool:
        return any(program in _cmdline(pid) for pid in federation())

    try:
        # Killed once Flower's detached children work too: the ServerApp, and a ClientApp on a node.
        assert wait_until(lambda: running(b"flwr-serverapp") and running(b"flwr-clientapp"), 300), (
            federation()
        )
        assert len(federation()) >= 6, federation()  # and the SuperLink, two SuperNodes, flwr run
        launch.kill()
        launch.wait()
        assert wait_until(lambda: federation() == [], 30), f"still running: {federation()}"
    finally:
        launch.kill()
        launch.wait()
        stop_pids(federation, grace=0.0)
    assert "the launcher died" in (results / "logs" / "latest" / "guard.log").read_text()
