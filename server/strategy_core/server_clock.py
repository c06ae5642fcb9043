"""The server's own seconds of a round: wall-clock and CPU, while it works, not while it waits for
nodes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.grid_io import GridTime


@dataclass
class ServerClock:
    """Seconds of the server's own work, summed over the spans between :meth:`start` and
    :meth:`stop`.

    ``seconds`` is wall-clock, ``cpu_seconds`` this process's CPU time (all threads). Time a span
    spent in the grid or in work beside the nodes' (a :class:`~server.grid_io.GridTime`) is taken
    off with :meth:`exclude`.
    """

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    _since: tuple[float, float] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Begin a span of the server's work."""
        self._since = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        """End the span :meth:`start` began: add its seconds."""
        if self._since is None:
            raise RuntimeError("ServerClock.stop() without start()")
        wall, cpu = self._since
        self.seconds += time.perf_counter() - wall
        self.cpu_seconds += time.process_time() - cpu
        self._since = None

    def exclude(self, waited: GridTime) -> None:
        """Take off the seconds ``waited`` spent inside this clock's spans (in the grid, or beside
        the nodes)."""
        self.seconds -= waited.seconds
        self.cpu_seconds -= waited.cpu_seconds
