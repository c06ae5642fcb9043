"""Peak resident memory of this process while a block of code runs (a client's local training).

A device's limit is its physical memory, so the figure reported is the process's resident set size
(RSS): Python, torch, the model, the optimiser state and the activations together. It is sampled by
a daemon thread rather than read from ``getrusage``: ``ru_maxrss`` is the peak over the process's
whole life, and a simulation worker process trains clients of every capacity one after another, so
only a peak taken inside the block belongs to the client that ran in it.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType

try:  # POSIX only; without it (Windows) and without /proc, no peak is reported
    import resource
except ImportError:  # pragma: no cover - platform dependent
    resource = None  # type: ignore[assignment]

_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int | None:
    """Resident set size of this process now, in bytes (``None`` where ``/proc`` is not
    available)."""
    try:
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def lifetime_peak_rss_bytes() -> int:
    """The process's peak RSS over its whole life, in bytes (``ru_maxrss``: KiB on Linux, bytes on
    macOS; 0 where the platform has no ``resource`` module)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class PeakRSS:
    """Context manager: the largest RSS seen while its block runs.

    Parameters
    ----------
    interval_s : float
        Seconds between samples. An allocation that lives for less than this may be missed; a
        training step's activations live for the whole backward pass, far longer than the default 5
        ms.

    Where ``/proc/self/statm`` does not exist (macOS), :attr:`peak_bytes` falls back to the
    process's lifetime peak, which is an upper bound on the block's.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = current_rss_bytes() is not None

    def _sample(self) -> None:
        rss = current_rss_bytes()
        if rss is not None and rss > self._peak:
            self._peak = rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRSS:
        if self._proc:
            self._sample()
            self._thread = threading.Thread(target=self._loop, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()  # the block's last state, in case it ended between two samples
        else:
            self._peak = lifetime_peak_rss_bytes()

    @property
    def peak_bytes(self) -> int:
        """Peak RSS in bytes seen while the block ran (valid after the block)."""
        return self._peak

    @property
    def peak_mib(self) -> float:
        """Peak RSS in MiB (2**20 bytes)."""
        return self._peak / 2**20
