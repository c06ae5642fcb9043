"""The processes of one launch: started in sessions of their own, found by an environment marker,
stopped together.

Flower's daemons start ``flower-superexec`` / ``flwr-serverapp`` / ``flwr-clientapp`` in sessions of
their own, which a process-group signal misses. Every process a launch starts carries a marker entry
in its environment, and so does everything they spawn: ``/proc`` finds them all, and nothing of
another launch.

A launcher that dies without stopping them (SIGKILL, the OOM killer, a closed terminal) would leave
its federation running and writing into its folder. So a :class:`ProcessGroup` starts a guard first:
this file run as a script, in a session of its own, reading a pipe that only the launcher holds.
When the launcher dies, however it dies, the kernel closes the pipe and the guard stops every
process carrying the marker. A launcher that stops its group itself says so on the pipe first, and
the guard exits touching nothing.

Only the standard library is imported, so the guard starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: What the launcher writes to the guard's pipe once it has stopped the group itself.
RELEASE = "release"


def pids_with_env(match: Callable[[list[bytes]], bool]) -> list[int]:
    """PIDs of live processes (other than this one) whose environment entries satisfy ``match``
    (Linux ``/proc``).

    Every process the launcher starts carries marker entries in its environment, and so does
    everything Flower spawns from it, even in sessions of its own; this finds them all. Elsewhere
    than Linux: none.
    """
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return []
    found = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if match([e for e in (entry / "environ").read_bytes().split(b"\0") if e]):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop_pids(
    find: Callable[[], list[int]], grace: float, reap: Callable[[], None] = lambda: None
) -> None:
    """SIGTERM every PID ``find()`` returns, SIGKILL what is still found after ``grace`` s."""
    for pid in find():
        signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap()
        if not find():
            return
        time.sleep(0.2)
    for pid in find():
        signal_pid(pid, signal.SIGKILL)


def signal_pid(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``; one that is gone already (or not ours) is no error."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessGroup:
    """Processes started in their own sessions, stopped together with every descendant.

    Stopping signals every process that carries ``marker`` in its environment, and nothing else.
    Should the process holding this group die before :meth:`stop`, the guard (see the module's
    docstring) does it.

    Parameters
    ----------
    marker : str
        An ``KEY=value`` environment entry unique to this group.
    guard_log : Path, optional
        Where the guard says what it stopped, should this process die first (written only then).
    """

    def __init__(self, marker: str, guard_log: Path | None = None) -> None:
        if "=" not in marker or marker.endswith("="):
            raise ValueError(f"the marker must be a KEY=value environment entry, got {marker!r}")
        self.marker = marker.encode()
        self.guard_log = guard_log
        self.procs: list[subprocess.Popen] = []
        self.guard: subprocess.Popen | None = None

    def start(self, args: Sequence[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        """Start ``args`` with stdout and stderr in ``log_path``."""
        self._start_guard()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                list(args),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        self._tell_guard(str(proc.pid))
        return proc

    def _start_guard(self) -> None:
        if self.guard is not None:
            return
        cmd = [sys.executable, "-I", str(Path(__file__).resolve()), self.marker.decode()]
        if self.guard_log is not None:
            cmd.append(str(self.guard_log))
        # A session of its own: a Ctrl-C or hang-up meant for the launcher must not end the guard
        # too.
        self.guard = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def _tell_guard(self, line: str, last: bool = False) -> None:
        """Write ``line`` to the guard's pipe (``last``: then close it)."""
        if self.guard is None or self.guard.stdin is None:
            return
        try:
            self.guard.stdin.write(line + "\n")
            self.guard.stdin.flush()
            if last:
                self.guard.stdin.close()
        except OSError:  # a dead guard must not fail the run; only the safety net is gone
            pass

    def members(self) -> list[int]:
        """PIDs of live processes that carry the marker (Linux ``/proc``; elsewhere the direct
        children)."""
        if not Path("/proc").is_dir():
            return [p.pid for p in self.procs if p.poll() is None]
        return pids_with_env(lambda entries: self.marker in entries)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM everything (newest first), then SIGKILL what is left after ``grace`` s; then let
        the guard go."""
        for proc in reversed(self.procs):
            signal_group(proc, signal.SIGTERM)

        def reap() -> None:  # our direct children must not linger as zombies
            for proc in self.procs:
                proc.poll()

        stop_pids(self.members, grace, reap)
        for proc in self.procs:
            signal_group(proc, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self._release_guard()

    def _release_guard(self) -> None:
        if self.guard is None:
            return
        self._tell_guard(RELEASE, last=True)
        try:
            self.guard.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.guard.kill()
            self.guard.wait()
        self.guard = None


def guard(
    marker: bytes, pipe: Iterable[str], grace: float = 10.0, log: Path | None = None
) -> list[int]:
    """Read the launcher's pipe to its end; unless it said :data:`RELEASE`, stop the group.

    Parameters
    ----------
    marker : bytes
        The group's ``KEY=value`` environment entry.
    pipe : Iterable[str]
        The lines the launcher writes: the PID of each process it starts, then :data:`RELEASE` when
        it has stopped them itself. Its end without :data:`RELEASE` means the launcher died.
    grace : float
        Seconds between SIGTERM and SIGKILL.
    log : Path, optional
        Where to say what is stopped (appended, before it is stopped; nothing when nothing is left).

    Returns
    -------
    list[int]
        The PIDs that were signalled (none after a release).
    """
    started: list[int] = []
    for line in pipe:
        word = line.strip()
        if word == RELEASE:
            return []
        if word.isdigit():
            started.append(int(word))
    searchable = Path("/proc").is_dir()

    def find() -> list[int]:
        if searchable:
            return pids_with_env(lambda entries: marker in entries)
        return [
            pid for pid in started if _alive(pid)
        ]  # nothing to search by marker: what the launcher started

    found = find()
    if found and log is not None:
        with open(log, "a") as out:
            out.write(
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} the launcher died without "
                f"stopping its processes; stopping PIDs {', '.join(map(str, found))} "
                f"({marker.decode()})\n"
            )
    stop_pids(find, grace)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: Sequence[str]) -> int:
    """The guard: ``process_group.py MARKER [LOG]``, with the launcher's pipe on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end may make the guard act
    guard(argv[0].encode(), sys.stdin, log=Path(argv[1]) if len(argv) > 1 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
