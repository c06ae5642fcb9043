"""Waiting for nodes and exchanging messages with them through Flower's Grid."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float, poll_interval: float) -> int:
    """Wait until ``min_nodes`` SuperNodes are connected, or ``timeout`` seconds; returns how many are.

    SuperNodes started together with the SuperLink (``docker compose up``)
    connect over several seconds; discovering too early would leave the late
    ones out of the first rounds.
    """
    deadline = time.monotonic() + timeout
    reported = -1
    while True:
        connected = len(grid.get_node_ids())
        if connected >= min_nodes:
            return connected
        if time.monotonic() >= deadline:
            log(
                WARNING,
                "only %d of min-nodes=%d nodes connected after %.0f s: starting with them",
                connected,
                min_nodes,
                timeout,
            )
            return connected
        if connected != reported:
            log(INFO, "waiting for nodes: %d of %d connected", connected, min_nodes)
            reported = connected
        time.sleep(max(poll_interval, 0.5))


def exchange(grid: Grid, messages: list[Message], timeout: float, poll_interval: float) -> list[Message]:
    """Push ``messages`` and pull replies every ``poll_interval`` s until all arrive or ``timeout`` s pass.

    Every reply comes back from the node it concerns: see :func:`attributed`.
    """
    if not messages:
        return []
    ids = list(grid.push_messages(messages))
    requests = {mid: msg for mid, msg in zip(ids, messages, strict=False) if mid}
    pending = set(requests)
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        got = list(grid.pull_messages(pending))
        replies.extend(attributed(m, requests.get(m.metadata.reply_to_message_id)) for m in got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if pending:
            time.sleep(poll_interval)
    if pending:
        log(
            WARNING,
            "%d of %d replies did not arrive within %.0f s",
            len(pending),
            len(messages),
            timeout,
        )
    return replies


@dataclass
class GridTime:
    """Seconds :func:`ordered_replies` spent between its caller's requests for the next reply: in the grid
    (pushing, pulling, waiting) and in its ``on_pushed``, work beside the nodes' that is not the caller's fold.

    ``seconds`` is wall-clock, ``cpu_seconds`` this process's CPU time (all threads) over the same spans.
    """

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    _since: tuple[float, float] = field(default=(0.0, 0.0), repr=False)

    def start(self) -> None:
        """Begin a span spent in the grid."""
        self._since = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        """End the span :meth:`start` began: add its seconds."""
        wall, cpu = self._since
        self.seconds += time.perf_counter() - wall
        self.cpu_seconds += time.process_time() - cpu


#: Replies pulled ahead of the one the fold waits for, at most: the rest stay on the SuperLink until their turn.
REPLY_WINDOW = 8


def ordered_replies(
    grid: Grid,
    messages: list[Message],
    timeout: float,
    poll_interval: float,
    window: int = REPLY_WINDOW,
    spent: GridTime | None = None,
    on_pushed: Callable[[], None] | None = None,
) -> Iterator[Message]:
    """Push ``messages``, then yield their replies in the order of ``messages``, each as soon as it can be.

    The caller folds each reply and drops it before asking for the next, so the server holds at most
    ``window`` replies at a time, whatever the number of messages: only the replies of the next ``window``
    messages still awaited are pulled; the others wait on the SuperLink (or the Simulation Engine's link
    state) until their turn. A message whose reply has not arrived ``timeout`` s after the push is skipped:
    after the deadline every remaining message is asked for once, in order, and what has arrived is yielded.
    The order is the messages', never the arrival order, so a fold of the replies repeats to the bit
    whatever order the nodes answered in. Every reply comes back from the node it concerns: see
    :func:`attributed`.

    Parameters
    ----------
    grid : Grid
        The ServerApp's grid.
    messages : list[Message]
        What to send, in the order the replies are wanted. Only their metadata is kept once they are pushed.
    timeout : float
        Seconds after the push after which a missing reply is not waited for.
    poll_interval : float
        Seconds between two pulls while the next reply has not arrived.
    window : int
        Replies pulled at most ahead of the next one wanted (>= 1).
    spent : GridTime, optional
        Receives the seconds spent here between the caller's requests for the next reply, ``on_pushed``'s
        included.
    on_pushed : Callable, optional
        Called once the messages are pushed, before any reply is pulled: work that overlaps the nodes' (its
        seconds are counted in ``spent``, not in the caller's).
    """
    if not messages:
        return
    clock = spent if spent is not None else GridTime()
    clock.start()
    ids = list(grid.push_messages(messages))
    # What a reply is matched against is the request's metadata: the pushed content (every node's submodel) can
    # go now, if the caller keeps no other reference to the list.
    order = [(mid, request_stub(msg)) for mid, msg in zip(ids, messages, strict=False) if mid]
    total = len(messages)
    del messages
    if on_pushed is not None:
        on_pushed()
    deadline = time.monotonic() + timeout
    arrived: dict[str, Message] = {}
    head = missing = 0
    while head < len(order):
        late = time.monotonic() >= deadline
        ahead = order[head : head + window]
        wanted = [mid for mid, _ in ahead if mid not in arrived]
        if wanted:
            requests = dict(ahead)
            for m in grid.pull_messages(wanted):
                mid = m.metadata.reply_to_message_id
                arrived[mid] = attributed(m, requests.get(mid))
        if late:  # each message of this window has now been asked for once since the deadline
            for mid, _ in ahead:
                reply = arrived.pop(mid, None)
                if reply is None:
                    missing += 1
                else:
                    clock.stop()
                    yield reply
                    clock.start()
            head += len(ahead)
            continue
        before = head
        while head < len(order) and order[head][0] in arrived:
            clock.stop()
            yield arrived.pop(order[head][0])
            clock.start()
            head += 1
        if head == before:
            time.sleep(poll_interval)
    clock.stop()
    if missing:
        log(WARNING, "%d of %d replies did not arrive within %.0f s", missing, total, timeout)


def request_stub(request: Message) -> Message:
    """``request`` without its content: the same metadata (message id, destination), for :func:`attributed`."""
    return Message(content=RecordDict(), metadata=copy.copy(request.metadata))


def attributed(reply: Message, request: Message | None) -> Message:
    """``reply`` as coming from the node ``request`` was sent to.

    An error reply that Flower generates itself (the SuperLink's "node unavailable" or "reply message
    unavailable") carries the SuperLink's own id as its source; rebuilt as the destination's error
    reply, it is logged against, and excludes, the node it concerns.
    """
    if request is None or reply.metadata.src_node_id == request.metadata.dst_node_id or not reply.has_error():
        return reply
    return Message(reply.error, reply_to=request)
