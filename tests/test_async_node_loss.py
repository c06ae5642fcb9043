"""Async FedGMR with a SuperNode killed mid-run and restarted: the loop does not hang, the node
trains again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cli.launcher import LocalFederation
from tests.federation_progress import wait_for_round

pytestmark = pytest.mark.federation

ROUNDS = 5
CAPACITIES = (1.0, 0.25, 0.0625)
SLOW = 15.0  # bench-delay-s of the node that is killed


def _wait_until_training(log: Path, timeout: float = 300.0) -> None:
    """Return a few seconds after the SuperNode received a train message it has not answered yet."""
    start = log.read_text().count("Receiving: train")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if text.count("Receiving: train") > start and text.rfind("Receiving: train") > text.rfind(
            "Sending: train"
        ):
            time.sleep(3.0)  # inside the handler now; it holds the message at least SLOW seconds
            return
        time.sleep(0.2)
    raise AssertionError(f"node 2 received no new train message within {timeout:.0f} s")


def test_killed_node_does_not_stall_the_async_loop(tmp_path):
    out = tmp_path / "run"
    result: dict = {}
    # node 2 holds each message for at least SLOW seconds, so it can be killed with one in flight
    with LocalFederation(
        CAPACITIES, tmp_path / "federation", echo=lambda line: None, delays=(0, 0, SLOW)
    ) as fed:
        config = {
            "method": "fedgmr",
            "gmr-mode": "async",
            "num-rounds": ROUNDS,
            "gmr-restore-rounds": 2,
            "eval-every": 0,
            "local-epochs": 1,
            "round-timeout": 90.0,
        }
        thread = threading.Thread(target=lambda: result.update(fed.run(config, out, timeout=900)))
        thread.start()
        wait_for_round(out, 1)
        _wait_until_training(fed.logs / "supernode-2.log")
        fed.kill_node(2)
        wait_for_round(out, 2)
        fed.delays[2] = (
            0.0  # it comes back at full speed, so it can take part in the remaining updates
        )
        fed.start_node(2)
        thread.join(timeout=900)
    assert result, "the run did not finish"
    records = result["rounds"]
    assert records[-1]["updates"] == ROUNDS * len(CAPACITIES)
    small = [c for r in records for c in r["clients"] if c["capacity"] == 0.0625]
    applied = sorted((c for c in small if c["status"] == "ok"), key=lambda c: c["dispatch"])
    assert len({c["node_id"] for c in applied}) == 2, (
        "the restarted node (a new node id) never trained again"
    )
    # The dead node's in-flight message did not hold the run up (it finished above). If the
    # SuperLink declared the node gone before the end, that message is recorded as lost, never as
    # anything else.
    ended = ("ok", "no reply: node left", "rejected: node returned an error")
    assert all(c["status"].startswith(ended) for c in small), [c["status"] for c in small]
    for node_id in {c["node_id"] for c in applied}:
        sizes = [c["selected"] for c in applied if c["node_id"] == node_id]
        assert sizes == sorted(sizes)  # restoration only adds
    assert all(r["global"]["accuracy"] > 0 for r in records)
