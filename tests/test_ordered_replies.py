"""``ordered_replies``: replies in the messages' order whatever the arrival order, a bounded window,
the deadline."""

from __future__ import annotations

import itertools
import time

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from server.grid_io import GridTime, ordered_replies


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Messages are created as a ServerApp of run 1 creates them."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0, raising=False)


class ScrambledGrid:
    """A grid whose reply to message ``i`` becomes available at pull number ``arrival[i]``
    (``None``: never)."""

    def __init__(self, arrival: list[int | None]) -> None:
        self.arrival = arrival
        self.pulls = 0
        self.ids: list[str] = []
        self.replies: dict[str, Message] = {}
        self.due: dict[str, int | None] = {}
        self.handed: list[str] = []  # ids pulled, in order
        self.asked: list[list[str]] = []

    def push_messages(self, messages):
        for i, msg in enumerate(messages):
            mid = f"m{i}"
            msg.metadata.__dict__["_message_id"] = mid
            self.replies[mid] = Message(RecordDict({"c": ConfigRecord({"i": i})}), reply_to=msg)
            self.due[mid] = self.arrival[i]
            self.ids.append(mid)
        return list(self.ids)

    def pull_messages(self, message_ids):
        self.pulls += 1
        wanted = list(message_ids)
        self.asked.append(wanted)
        out = []
        for mid in wanted:
            due = self.due.get(mid)
            if mid in self.replies and due is not None and due <= self.pulls:
                out.append(self.replies.pop(mid))
                self.handed.append(mid)
        return out


def _messages(n):
    return [
        Message(RecordDict({"c": ConfigRecord({"i": i})}), dst_node_id=i + 1, message_type="train")
        for i in range(n)
    ]


def _index(reply):
    return int(reply.content.config_records["c"]["i"])


@pytest.mark.parametrize("seed", range(5))
def test_replies_come_in_message_order_and_at_most_a_window_is_held(seed):
    n, window = 23, 4
    arrival = [1 + (i * 7 + seed * 5) % 17 for i in range(n)]  # a scrambled arrival order
    grid = ScrambledGrid(arrival)
    got, held = [], 0
    for reply in ordered_replies(grid, _messages(n), timeout=60, poll_interval=0, window=window):
        got.append(_index(reply))
        held = max(
            held, len(grid.handed) - len(got) + 1
        )  # pulled but not yet passed on, this one included
    assert got == list(range(n))
    assert held <= window
    assert all(len(a) <= window for a in grid.asked)


def test_a_missing_reply_is_skipped_after_the_deadline_and_the_rest_still_comes(caplog):
    arrival = [1, None, 1, 2, None, 1]
    grid = ScrambledGrid(arrival)
    spent = GridTime()
    replies = ordered_replies(
        grid, _messages(6), timeout=0.2, poll_interval=0.01, window=2, spent=spent
    )
    assert [_index(r) for r in replies] == [0, 2, 3, 5]
    assert "2 of 6 replies did not arrive" in caplog.text
    assert spent.seconds >= 0.2  # the wait counts as the grid's, not the caller's


def test_nothing_to_send_yields_nothing():
    assert list(ordered_replies(ScrambledGrid([]), [], timeout=1, poll_interval=0)) == []


def test_the_caller_sets_the_pace():
    """Nothing beyond the window is pulled before the caller asks for the next reply."""
    grid = ScrambledGrid([1] * 10)
    stream = ordered_replies(grid, _messages(10), timeout=60, poll_interval=0, window=3)
    first = list(itertools.islice(stream, 1))
    assert [_index(r) for r in first] == [0]
    assert grid.handed == ["m0", "m1", "m2"]


def test_on_pushed_seconds_are_counted_in_spent():
    """``on_pushed`` is work beside the nodes', not the caller's: its seconds go to ``spent``."""
    pause = 0.2
    spent = GridTime()
    replies = ordered_replies(
        ScrambledGrid([1, 1]),
        _messages(2),
        timeout=60,
        poll_interval=0,
        spent=spent,
        on_pushed=lambda: time.sleep(pause),
    )
    assert [_index(r) for r in replies] == [0, 1]
    assert spent.seconds >= pause
