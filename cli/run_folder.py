"""A launcher's run folder: held by one launch at a time, with a log folder of its own per launch.

Two launchers on one folder would share its outputs (``metrics.json``, ``model.pt``, the checkpoint)
and each would overwrite the other's; so the folder is locked (``fcntl.flock`` on
``.fibos-run.lock``, which the kernel releases when the holder dies, however it dies) and the lock
file names its holder. Each launch writes its logs to ``logs/<launch id>/`` and points
``logs/latest`` at it, so no launch, resumes included, overwrites an earlier one's logs.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

LOCK_FILE = ".fibos-run.lock"


class RunFolderBusy(RuntimeError):
    """The run folder is held by another launch, or processes of an earlier launch still run in
    it."""


class RunFolderLock:
    """Exclusive hold on a run folder for this process.

    Parameters
    ----------
    folder : Path
        The run folder (created if missing).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the folder, or raise :class:`RunFolderBusy` naming the process that holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.read(fd, 4096))
            os.close(fd)
            raise RunFolderBusy(
                f"{self.folder} is in use by another run ({holder}); wait for it to end, stop it, "
                "or give this run another results folder"
            ) from None
        os.ftruncate(fd, 0)
        holder = {
            "pid": os.getpid(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "argv": sys.argv,
        }
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the folder up (the lock file stays: removing it could let two launches lock two
        inodes)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe_holder(raw: bytes) -> str:
    try:
        holder = json.loads(raw)
        return (
            f"launcher PID {holder['pid']}, started {holder['started']}: {' '.join(holder['argv'])}"
        )
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def launch_id() -> str:
    """A name for this launch, sortable by start time: ``20261201T004612Z-<pid>``."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"


def new_log_folder(logs: Path, name: str) -> Path:
    """Create ``logs/<name>/`` and point ``logs/latest`` at it (a relative symlink, replaced
    atomically)."""
    folder = logs / name
    folder.mkdir(parents=True, exist_ok=False)
    tmp = logs / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name, target_is_directory=True)
    os.replace(tmp, logs / "latest")
    return folder
