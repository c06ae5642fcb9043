"""Waiting for nodes and exchanging messages with them through Flower's Grid."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float, poll_interval: float) -> int:
    """Wait until ``min_nodes`` SuperNodes are connected, or ``timeout`` seconds; returns how many
    are.

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


def exchange(
    grid: Grid, messages: list[Message], timeout: float, poll_interval: float
) -> list[Message]:
    """Push ``messages`` and pull replies every ``poll_interval`` s until all arrive or ``timeout``
    s pass.

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
    """Seconds :func:`ordered_replies` spent between its caller's requests for the next reply: in
    the grid (pushing, pulling, waiting) and in its ``on_pushed``, work beside the nodes' that is
    not the caller's fold.

    ``seconds`` is wall-clock, ``cpu_seconds`` this process's CPU time (all threads) over the same
    spans.
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


#: Replies pulled ahead of the one the fold waits for, at most: the rest stay on the SuperLink until
#: their turn.
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
    """Push ``messages``, then yield their replies in the order of ``messages``, each as soon as it
    can be.

    The caller folds each reply and drops it before asking for the next, so the server holds at most
    ``window`` replies at a time, whatever the number of messages: only the replies of the next
    ``window`` messages still awaited are pulled; the others wait on the SuperLink (or the
    Simulation Engine's link state) until their turn. A message whose reply has not arrived
    ``timeout`` s after the push is skipped: after the deadline every remaining message is asked for
    once, in order, and what has arrived is yielded. The order is the messages', never the arrival
    order, so a fold of the replies repeats to the bit whatever order the nodes answered in. Every
    reply comes back from the node it concerns: see :func:`attributed`.

    Parameters
    ----------
    grid : Grid
        The ServerApp's grid.
    messages : list[Message]
        What to send, in the order the replies are wanted. Only their metadata is kept once they are
        pushed.
    timeout : float
        Seconds after the push after which a missing reply is not waited for.
    poll_interval : float
        Seconds between two pulls while the next reply has not arrived.
    window : int
        Replies pulled at most ahead of the next one wanted (>= 1).
    spent : GridTime, optional
        Receives the seconds spent here between the caller's requests for the next reply,
        ``on_pushed``'s included.
    on_pushed : Callable, optional
        Called once the messages are pushed, before any reply is pulled: work that overlaps the
        nodes' (its seconds are counted in ``spent``, not in the caller's).
    """
    if not messages:
        return
    clock = spent if spent is not None else GridTime()
    clock.start()
    order = _push(grid, messages)
    total = len(messages)
    # The pushed content (every node's submodel) can go now, if the caller keeps no other reference
    # to the list: replies are matched against the stubs in ``order``.
    del messages
    yield from _pull_in_order(grid, order, total, timeout, poll_interval, window, clock, on_pushed)


def _push(grid: Grid, messages: list[Message]) -> list[tuple[str, Message]]:
    """Push ``messages``; ``(message id, request stub)`` of each one the grid accepted, in order.

    Parameters
    ----------
    grid : Grid
        The ServerApp's grid.
    messages : list[Message]
        What to send.
    """
    ids = list(grid.push_messages(messages))
    # A reply is matched against its request's metadata (:func:`request_stub`), not its content.
    return [(mid, request_stub(msg)) for mid, msg in zip(ids, messages, strict=False) if mid]


def _pull_in_order(
    grid: Grid,
    order: list[tuple[str, Message]],
    total: int,
    timeout: float,
    poll_interval: float,
    window: int,
    clock: GridTime,
    on_pushed: Callable[[], None] | None,
) -> Iterator[Message]:
    """:func:`ordered_replies` once pushed: the replies to ``order``, in order, timed by ``clock``.

    Parameters
    ----------
    grid : Grid
        The ServerApp's grid.
    order : list[tuple[str, Message]]
        ``(message id, request stub)`` of every pushed message, in the order the replies are wanted.
    total : int
        Messages the caller asked to send (for the warning about missing replies).
    timeout, poll_interval : float
        Seconds after the push after which a missing reply is not waited for, and between two pulls.
    window : int
        Replies pulled at most ahead of the next one wanted.
    clock : GridTime
        Running (started) on entry; stopped while a reply is with the caller, and at the end.
    on_pushed : Callable, optional
        Called first, before any reply is pulled.
    """
    if on_pushed is not None:
        on_pushed()
    deadline = time.monotonic() + timeout
    arrived: dict[str, Message] = {}
    head = missing = 0
    while head < len(order):
        late = time.monotonic() >= deadline
        ahead = order[head : head + window]
        _pull_window(grid, ahead, arrived)
        if late:  # each message of this window has now been asked for once since the deadline
            missing += yield from _last_call(ahead, arrived, clock)
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


def _pull_window(grid: Grid, ahead: list[tuple[str, Message]], arrived: dict[str, Message]) -> None:
    """Pull the replies of ``ahead`` not yet in ``arrived`` into it, each attributed to its request.

    Parameters
    ----------
    grid : Grid
        The ServerApp's grid.
    ahead : list[tuple[str, Message]]
        ``(message id, request stub)`` of the window's messages.
    arrived : dict[str, Message]
        Replies pulled and not yet yielded, by the id of the message they answer; filled in place.
    """
    wanted = [mid for mid, _ in ahead if mid not in arrived]
    if wanted:
        requests = dict(ahead)
        for m in grid.pull_messages(wanted):
            mid = m.metadata.reply_to_message_id
            arrived[mid] = attributed(m, requests.get(mid))


def _last_call(
    ahead: list[tuple[str, Message]],
    arrived: dict[str, Message],
    clock: GridTime,
) -> Generator[Message, None, int]:
    """After the deadline: yield what of ``ahead`` has arrived, in order; return how many had not.

    Parameters
    ----------
    ahead : list[tuple[str, Message]]
        ``(message id, request stub)`` of the window's messages, each asked for once since the
        deadline.
    arrived : dict[str, Message]
        Replies pulled and not yet yielded; those of ``ahead`` are taken out.
    clock : GridTime
        Stopped while a reply is with the caller.
    """
    missing = 0
    for mid, _ in ahead:
        reply = arrived.pop(mid, None)
        if reply is None:
            missing += 1
        else:
            clock.stop()
            yield reply
            clock.start()
    return missing


def request_stub(request: Message) -> Message:
    """``request`` without its content: the same metadata (message id, destination), for
    :func:`attributed`."""
    return Message(content=RecordDict(), metadata=copy.copy(request.metadata))


def attributed(reply: Message, request: Message | None) -> Message:
    """``reply`` as coming from the node ``request`` was sent to.

    An error reply that Flower generates itself (the SuperLink's "node unavailable" or "reply
    message unavailable") carries the SuperLink's own id as its source; rebuilt as the destination's
    error reply, it is logged against, and excludes, the node it concerns.
    """
    if (
        request is None
        or reply.metadata.src_node_id == request.metadata.dst_node_id
        or not reply.has_error()
    ):
        return reply
    return Message(reply.error, reply_to=request)
