"""Nodes left out or gone: each round's metrics.json record names them and says why; Flower's own
error replies are attributed to the node they concern, not to the SuperLink that wrote them."""

from __future__ import annotations

import numpy as np
from flwr.app import Error, Message, MessageType, RecordDict

from common.config.parse import parse_run_config
from common.models.architectures import build_model, model_layout, trainable_arrays
from server.strategy import SubmodelStrategy
from tests.inprocess_grid import SERVER_NODE_ID, InProcessGrid

UNAVAILABLE = "Node Unavailable"  # what the SuperLink answers for a node it no longer hears from


class ChangingGrid(InProcessGrid):
    """Nodes in ``departed`` are no longer connected; messages to nodes in ``unreachable`` get the
    SuperLink's own error reply (source: the SuperLink's id), as Flower sends for an unavailable
    node."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.departed: set[int] = set()
        self.unreachable: dict[
            int, set[str]
        ] = {}  # node -> message types answered by the SuperLink

    def get_node_ids(self):
        return [nid for nid in self.contexts if nid not in self.departed]

    def _answer(self, msg: Message) -> Message:
        if msg.metadata.message_type in self.unreachable.get(msg.metadata.dst_node_id, set()):
            as_superlink = Message(
                RecordDict(), dst_node_id=SERVER_NODE_ID, message_type=msg.metadata.message_type
            )
            as_superlink.metadata.__dict__["_message_id"] = msg.metadata.message_id
            return Message(Error(code=3, reason=UNAVAILABLE), reply_to=as_superlink)
        return super()._answer(msg)


def test_excluded_departed_and_unavailable_nodes_are_recorded_with_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    # No byte budget: the discovery message carries round 1 (the warm-up with discovery), which node
    # 15 answers.
    run_config = {
        "num-rounds": 3,
        "local-epochs": 1,
        "eval-every": 0,
        "seed": 1,
        "fedfibos-byte-budget": 0,
    }
    cfg = parse_run_config(run_config)
    nodes = {
        11: {"partition-id": 0, "num-partitions": 5, "capacity": 1.0},
        12: {"partition-id": 1, "num-partitions": 5, "capacity": 0.25, "client-id": "edge-12"},
        13: {"partition-id": 2, "num-partitions": 5, "capacity": 2.0},  # misconfigured
        14: {"partition-id": 3, "num-partitions": 5, "capacity": 0.5},  # unreachable at discovery
        15: {"partition-id": 4, "num-partitions": 5, "capacity": 0.5},  # unreachable when training
    }
    grid = ChangingGrid(nodes, run_config)
    grid.unreachable = {14: {MessageType.QUERY}, 15: {MessageType.TRAIN}}
    model = build_model(cfg.model, 10, 1, cfg.seed)
    layout = model_layout(model)
    records: list[dict] = []

    strategy = SubmodelStrategy(cfg, layout, on_round=records.append)
    trained_round = strategy.run_round

    def run_round(grid_, server_round, *args, **kwargs):
        done = trained_round(grid_, server_round, *args, **kwargs)
        if server_round == 1:
            grid.departed.add(
                12
            )  # leaves after round 1 (its record is made later, once round 2 is out)
        return done

    strategy.run_round = run_round
    strategy.start(
        grid, strategy.to_arrays(layout.flatten(trainable_arrays(model))), cfg.num_rounds, 30.0
    )

    assert [r["round"] for r in records] == [1, 2, 3]  # no evaluate_fn: no round-0 record
    first = {(o["node_id"], o["event"]): o for o in records[0]["nodes_out"]}
    assert set(first) == {(13, "excluded"), (14, "excluded")}
    assert "capacity=2.0" in first[13, "excluded"]["reason"]
    assert UNAVAILABLE in first[14, "excluded"]["reason"]
    assert strategy.registry.excluded == {13, 14}  # never the SuperLink's id
    assert records[1]["nodes_out"] == [
        {
            "node_id": 12,
            "client_key": "edge-12",
            "event": "departed",
            "reason": "no longer connected to the SuperLink",
        }
    ]
    assert records[2]["nodes_out"] == []

    keys = {c["node_id"]: c["client_key"] for r in records for c in r["clients"]}
    assert keys == {11: "partition-0", 12: "edge-12", 15: "partition-4"}
    for r in records:
        status = {c["node_id"]: c["status"] for c in r["clients"]}
        # Round 1 reached node 15 with discovery (a QUERY, which it answers); from round 2 on, TRAIN
        # messages.
        assert status[15] == (
            "ok" if r["round"] == 1 else f"rejected: node returned an error: {UNAVAILABLE}"
        )
        assert status[11] == "ok"
    assert [sorted(c["node_id"] for c in r["clients"]) for r in records] == [
        [11, 12, 15],
        [11, 15],
        [11, 15],
    ]
    assert np.isfinite(strategy.x).all()
