"""Waiting for nodes and exchanging messages with them through Flower's Grid."""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.app import Message
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


def attributed(reply: Message, request: Message | None) -> Message:
    """``reply`` as coming from the node ``request`` was sent to.

    An error reply that Flower generates itself (the SuperLink's "node unavailable" or "reply message
    unavailable") carries the SuperLink's own id as its source; rebuilt as the destination's error
    reply, it is logged against, and excludes, the node it concerns.
    """
    if request is None or reply.metadata.src_node_id == request.metadata.dst_node_id or not reply.has_error():
        return reply
    return Message(reply.error, reply_to=request)
