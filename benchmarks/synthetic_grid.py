"""The server benchmark's Flower Grid: nodes that answer at once with synthetic but valid replies.

The server benchmark (:mod:`benchmarks.server_bench`) drives the product's strategy
(:class:`server.strategy.SubmodelStrategy`) through this grid instead of a SuperLink: every node
answers a QUERY with its profile, as ``client.app.query`` does, and a TRAIN message with the reply a
node would send for the submodel it was sent (``client.replies.train_records``): the mask's digest
and the round echoed, one delta value per position sent, the Fisher payload in the run's
``fisher-encoding`` when the message asked for one (it carries ``fisher-at``), and the metrics the
server checks. No model is trained: the reply's values are synthetic (:class:`SyntheticRound`),
which the server's work does not depend on.

A TRAIN reply is built when the server pulls it, not when the message is pushed: the server pulls at
most :data:`server.grid_io.REPLY_WINDOW` replies ahead, so the replies of a round of hundreds of
clients never lie in memory together. Pushing and pulling are the grid's work, which the strategy's
own clock leaves out (:class:`server.grid_io.GridTime`); what can be made before the round (the
deltas, one per submodel size) is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from numpy.typing import NDArray

from common.fisher.codec import encode_fisher
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.mask_codec import decode_mask
from server.grid_io import request_stub

RUN_ID = 1
SERVER_NODE_ID = 1  # the SuperLink's own id as a message source
FIRST_NODE_ID = 1000  # client ``i`` is node ``FIRST_NODE_ID + i``
#: Training examples every node reports (its update's weight, and its ``num-examples``' bound).
EXAMPLES = 100


class SyntheticRound:
    """A model's data for the benchmark: global values, a pool of Fisher uploads, reply deltas.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    x : NDArray[float32]
        Global values (the model's initialisation).
    pool : int
        Distinct synthetic Fisher uploads; client ``i``'s estimate is number ``i % pool``, shifted
        (:meth:`estimate`).
    seed : int
        Seed of the synthetic data.
    """

    def __init__(self, layout: ParamLayout, x: NDArray[np.float32], pool: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.layout = layout
        self.x = x
        d = layout.size
        base = rng.lognormal(0.0, 2.0, d).astype(np.float32)
        self.uploads = [base * rng.lognormal(0.0, 0.5, d).astype(np.float32) for _ in range(pool)]
        self.rng = rng
        self._deltas: dict[int, NDArray[np.float32]] = {}

    def estimate(self, i: int) -> NDArray[np.float32]:
        """Client ``i``'s Fisher: upload ``i % pool`` rolled by ``i // pool`` positions.

        Every client's estimate, and so its Fisher-ranked mask, differs from every other's, as on a
        real fleet (with the pool alone, clients ``pool`` apart would be sent the same mask, whose
        code is then looked up instead of encoded).
        """
        upload = self.uploads[i % len(self.uploads)]
        return upload if i < len(self.uploads) else np.roll(upload, i // len(self.uploads))

    def delta(self, k: int) -> NDArray[np.float32]:
        """A delta of ``k`` values (shared by every reply of that size: the server's work does not
        depend on its content)."""
        if k not in self._deltas:
            self._deltas[k] = (self.rng.standard_normal(k) * 1e-3).astype(np.float32)
        return self._deltas[k]


def client_key(i: int) -> str:
    """Client ``i``'s stable key: the strategy folds replies in the keys' order, so in ``i``'s."""
    return f"client-{i:06d}"


@dataclass
class PendingTrain:
    """What a TRAIN reply needs of the message it answers, kept from the push until the pull.

    Parameters
    ----------
    stub : Message
        The message without its content (its metadata: the reply goes back to it).
    client : int
        The client's index.
    server_round : int
        The round the submodel was sent for (echoed).
    digest : str
        The mask's digest (echoed).
    kept : int
        Positions the submodel holds (values in the delta).
    mask_code : tuple of (str, NDArray) or None
        The mask as sent, its kind and code, when the message asked for a Fisher upload (the payload
        is cut by the mask); ``None`` otherwise.
    """

    stub: Message
    client: int
    server_round: int
    digest: str
    kept: int
    mask_code: tuple[str, NDArray] | None


class LocalGrid(Grid):
    """The ``Grid`` interface besides pushing and pulling, for nodes that answer in this process.

    A subclass gives ``get_node_ids``, ``push_messages`` and ``pull_messages`` (all the strategies
    use); :class:`SyntheticGrid` and the tests' in-process grid share the rest.
    """

    def set_run(self, run_id: int) -> None:
        """Messages created from now on belong to ``run_id``."""
        TaskIdentity.run_id = run_id

    @property
    def run(self) -> Run:
        """The run messages belong to."""
        return Run.create_empty(TaskIdentity.run_id)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message to ``dst_node_id`` (``group_id`` and ``ttl`` have no meaning in process)."""
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull everything (every reply is ready at once)."""
        return self.pull_messages(list(self.push_messages(messages)))


class SyntheticGrid(LocalGrid):
    """Nodes ``FIRST_NODE_ID + i`` of capacity ``capacities[i]``, answering in this process.

    Parameters
    ----------
    data : SyntheticRound
        The model's synthetic data: client ``i``'s Fisher upload is ``data.estimate(i)``, and a
        reply of ``k`` positions carries the delta ``data.delta(k)``.
    capacities : Sequence[float]
        Each client's capacity (what its QUERY reply reports).
    encoding : str
        The run's ``fisher-encoding`` (the method's ``upload_encoding``).
    """

    def __init__(self, data: SyntheticRound, capacities: Sequence[float], encoding: str) -> None:
        TaskIdentity.run_id = RUN_ID
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0
        self.data = data
        self.capacities = list(capacities)
        self.encoding = encoding
        self.ready: dict[str, Message] = {}  # replies made at the push (QUERY, refusals)
        self.pending: dict[str, PendingTrain] = {}  # TRAIN replies to make at the pull
        # One serialised delta per submodel size, shared by its replies (made once, not per reply).
        self.deltas: dict[int, Array] = {}
        self.trained = 0  # TRAIN replies made
        self._next = 0

    def get_node_ids(self) -> Iterable[int]:
        """Every node of the federation (all always connected)."""
        return [FIRST_NODE_ID + i for i in range(len(self.capacities))]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Keep what each message's reply needs (none of its content); returns their ids."""
        ids = []
        for msg in messages:
            self._next += 1
            msg_id = f"m{self._next}"
            msg.metadata.__dict__["_message_id"] = msg_id
            kind = msg.metadata.message_type
            if kind == MessageType.TRAIN:
                self.pending[msg_id] = self._pending(msg)
            elif kind == MessageType.QUERY:
                self.ready[msg_id] = self._profile(msg)
            else:  # the benchmark's rounds evaluate on the server only
                error = Error(code=0, reason=f"{kind} not answered")
                self.ready[msg_id] = Message(error, reply_to=msg)
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` (each returned once), TRAIN replies made now."""
        out = []
        for mid in message_ids:
            if mid in self.ready:
                out.append(self.ready.pop(mid))
            elif mid in self.pending:
                out.append(self._train_reply(self.pending.pop(mid)))
        return out

    def _pending(self, msg: Message) -> PendingTrain:
        """What the reply to the TRAIN message ``msg`` needs."""
        cfg = msg.content.config_records[P.SUBMODEL_CONFIG]
        submodel = msg.content.array_records[P.SUBMODEL]
        mask_code = None
        if P.FISHER_AT in msg.content.array_records:
            mask_code = (str(cfg["mask-kind"]), submodel[P.MASK].numpy())
        return PendingTrain(
            stub=request_stub(msg),
            client=msg.metadata.dst_node_id - FIRST_NODE_ID,
            server_round=int(cfg["round"]),
            digest=str(cfg["mask-digest"]),
            kept=int(submodel[P.VALUES].shape[0]),
            mask_code=mask_code,
        )

    def _profile(self, msg: Message) -> Message:
        """A node's QUERY reply: its capacity, example counts and client key (as
        ``client.app.query``)."""
        i = msg.metadata.dst_node_id - FIRST_NODE_ID
        profile = MetricRecord(
            {
                "capacity": self.capacities[i],
                "num-train-examples": EXAMPLES,
                "num-test-examples": 0,
            }
        )
        info = ConfigRecord(
            {
                "device": "cpu",
                "client-key": client_key(i),
                "capacity-source": "node-config",
            }
        )
        return Message(RecordDict({P.PROFILE: profile, "device": info}), reply_to=msg)

    def _train_reply(self, p: PendingTrain) -> Message:
        """The TRAIN reply of ``p``: its delta, its Fisher payload when asked, the metrics and the
        meta."""
        if p.kept not in self.deltas:
            self.deltas[p.kept] = Array(self.data.delta(p.kept))
        arrays = {P.DELTA: self.deltas[p.kept]}
        if p.mask_code is not None:
            d = self.data.layout.size
            mask = decode_mask(*p.mask_code, d)
            fisher = self.data.estimate(p.client)
            payload = encode_fisher(fisher, mask, self.data.layout, self.encoding)
            arrays.update({name: Array(np.ascontiguousarray(a)) for name, a in payload.items()})
        metrics = {
            "num-examples": EXAMPLES,
            "train-loss": 1.0,
            "train-seconds": 1.0,
            "fisher-seconds": 0.1 if p.mask_code is not None else 0.0,
        }
        meta = {"round": p.server_round, "mask-digest": p.digest}
        content = RecordDict(
            {
                P.UPDATE: ArrayRecord(arrays),
                P.METRICS: MetricRecord(metrics),
                P.META: ConfigRecord(meta),
            }
        )
        self.trained += 1
        return Message(content, reply_to=p.stub)
