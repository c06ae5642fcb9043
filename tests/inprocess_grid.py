"""A Flower Grid that answers every message in this process with the project's ClientApp handlers.

No SuperLink, no SuperNodes, no subprocesses: each pushed message is handed to ``client.app``'s
query / train / evaluate handler with the destination node's Context, and the reply (or an error
reply, if the handler raises) is kept until pulled. Methods registered in the test process are
therefore visible to the "clients" too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.synthetic_grid import LocalGrid
from client import app as client_app

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from common.config.run import RunConfig
    from server.async_strategy import AsyncSubmodelStrategy
    from server.strategy import SubmodelStrategy
    from server.strategy_core.base import EvaluateFn

RUN_ID = 1
SERVER_NODE_ID = 1  # the SuperLink's own id as a message source


class InProcessGrid(LocalGrid):
    """Routes messages to ``client.app`` handlers.

    Parameters
    ----------
    node_configs : Mapping[int, Mapping[str, Any]]
        Node id -> that node's ``--node-config``.
    run_config : Mapping[str, Any]
        The run config every node's Context carries.
    """

    def __init__(
        self, node_configs: Mapping[int, Mapping[str, Any]], run_config: Mapping[str, Any]
    ) -> None:
        TaskIdentity.run_id = RUN_ID
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0
        self.contexts = {
            nid: Context(RUN_ID, nid, dict(cfg), RecordDict(), dict(run_config))
            for nid, cfg in node_configs.items()
        }
        self.replies: dict[str, Message] = {}
        self.handled: list[Message] = []  # every message answered, in order
        self._next = 0

    def get_node_ids(self) -> Iterable[int]:
        """Every node of the federation (all always connected)."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Answer each message at once; returns their ids."""
        ids = []
        for msg in messages:
            self._next += 1
            msg_id = f"m{self._next}"
            msg.metadata.__dict__["_message_id"] = msg_id
            self.replies[msg_id] = self._answer(msg)
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` (each returned once)."""
        return [self.replies.pop(mid) for mid in list(message_ids) if mid in self.replies]

    def _answer(self, msg: Message) -> Message:
        node_id = msg.metadata.dst_node_id
        handler = {
            MessageType.QUERY: client_app.query,
            MessageType.TRAIN: client_app.train,
            MessageType.EVALUATE: client_app.evaluate_submodel,
        }[msg.metadata.message_type]
        self.handled.append(msg)
        try:
            return handler(msg, self.contexts[node_id])
        except Exception as err:  # a crashing ClientApp answers with an error, as a SuperNode does
            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)


@dataclass
class InProcessFederation:
    """A strategy wired to an :class:`InProcessGrid` of nodes with given capacities, ready to
    ``start``."""

    cfg: RunConfig
    grid: InProcessGrid
    strategy: SubmodelStrategy | AsyncSubmodelStrategy
    records: list[dict[str, Any]]
    x0: NDArray[np.float32]
    evaluate_fn: EvaluateFn | None


def inprocess_federation(
    run_config: Mapping[str, Any],
    capacities: Mapping[int, float],
    node_configs: Mapping[int, Mapping[str, Any]] | None = None,
) -> InProcessFederation:
    """Nodes ``{node id: capacity}`` (partition ``i`` of ``len(capacities)``), the run's strategy
    and evaluator.

    ``node_configs``: each node's own ``--node-config`` instead (e.g. a ``data-path``;
    ``capacities`` then only names the node ids). Every round's record is appended to ``records``;
    ``x0`` is the run's initial flat model; ``evaluate_fn`` is ``None`` when the server holds no
    test set. The federation is the ServerApp's own (:func:`server.federation.build_federation`): an
    asynchronous method gets the asynchronous strategy.
    """
    from common.config.parse import parse_run_config
    from server.federation import build_federation

    cfg = parse_run_config(dict(run_config))
    nodes = node_configs or {
        nid: {"partition-id": i, "num-partitions": len(capacities), "capacity": g}
        for i, (nid, g) in enumerate(capacities.items())
    }
    grid = InProcessGrid(nodes, run_config)
    records: list[dict] = []
    federation = build_federation(cfg, "cpu", on_round=records.append)
    return InProcessFederation(
        cfg, grid, federation.strategy, records, federation.x0, federation.evaluate_fn
    )
