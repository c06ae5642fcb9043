"""Discovery waits ``discovery-timeout``, not a round's ``round-timeout``: a node's first reply
starts its ClientApp, which on a loaded machine can take far longer than a round's reply."""

from __future__ import annotations

import time

import pytest
from flwr.app import MessageType

from tests.inprocess_grid import InProcessGrid, inprocess_federation

COLD_START_S = 1.5  # each node's first reply comes this late


class ColdStartGrid(InProcessGrid):
    """Holds every discovery (QUERY) reply back until ``COLD_START_S`` after it was pushed."""

    def __init__(self, node_configs, run_config) -> None:
        super().__init__(node_configs, run_config)
        self.held: dict[str, float] = {}  # message id -> when its reply may be pulled

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for msg_id, msg in zip(ids, messages, strict=True):
            if msg.metadata.message_type == MessageType.QUERY:
                self.held[msg_id] = time.monotonic() + COLD_START_S
        return ids

    def pull_messages(self, message_ids):
        now = time.monotonic()
        ready = [m for m in message_ids if self.held.get(m, 0.0) <= now]
        return super().pull_messages(ready)


def _cold_federation(settings: dict) -> tuple:
    run = {"num-rounds": 1, "local-epochs": 1, "eval-every": 0, "poll-interval": 0.1, **settings}
    fed = inprocess_federation(run, {41: 1.0, 42: 0.25})
    nodes = {nid: context.node_config for nid, context in fed.grid.contexts.items()}
    return fed, ColdStartGrid(nodes, run)


@pytest.mark.parametrize("method", ["fedavg", "fedfibos"])
def test_a_cold_start_longer_than_a_round_timeout_is_waited_for(tmp_path, monkeypatch, method):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed, grid = _cold_federation({"method": method, "round-timeout": 0.5})
    fed.strategy.start(grid, fed.strategy.to_arrays(fed.x0), 1, 0.5)
    clients = fed.records[-1]["clients"]
    assert {c["node_id"] for c in clients} == {41, 42}
    assert all(c["status"] == "ok" for c in clients)


def test_a_cold_start_longer_than_discovery_timeout_stops_the_run_saying_why(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed, grid = _cold_federation({"method": "fedavg", "discovery-timeout": 0.5})
    with pytest.raises(RuntimeError, match="no usable node answered discovery"):
        fed.strategy.start(grid, fed.strategy.to_arrays(fed.x0), 1, 60.0)
