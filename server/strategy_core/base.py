"""What the synchronous and the asynchronous strategy share: the global model, the Messages that
carry a node's submodel, the nodes' own evaluation and the server's central evaluation.

Everything that differs between methods is asked of the run's
:class:`~common.methods.contract.server_side.ServerMethod`; the nodes are the
:class:`~server.strategy_core.node_registry.NodeRegistry`'s. The two strategies differ in when they
send and how they fold replies in: rounds (:mod:`server.strategy`) or every reply on arrival
(:mod:`server.async_strategy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from numpy.typing import NDArray

from common.config.run import RunConfig
from common.methods import create_method
from common.methods.contract.payloads import Download
from common.methods.contract.server_side import ServerMethod
from common.methods.round_fold import RoundFold, WarmUpFold
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.validation import ReplyError, SentSubmodel, validate_evaluate_reply
from server.federated_evaluation import NodeEvaluation, federated_figures
from server.grid_io import exchange
from server.mask_stability import MaskHistory, per_capacity_means
from server.replies import expected_sent, reply_parts
from server.strategy_core.node_registry import NodeRegistry
from server.strategy_core.round_plan import EvaluatePlan, TrainPlan
from server.strategy_core.round_records import ClientRound

#: Flower's signature for central evaluation: ``(server_round, arrays) -> metrics`` (``accuracy``,
#: ``loss``).
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def array_record(arrays: Mapping[str, NDArray]) -> ArrayRecord:
    """Named numpy arrays as an ArrayRecord (each made contiguous, as Flower serialises it)."""
    return ArrayRecord({n: Array(np.ascontiguousarray(a)) for n, a in arrays.items()})


def local_figures(metrics: MetricRecord) -> dict[str, float]:
    """A round record's ``local``: the nodes' example-weighted accuracy and loss on their own test
    splits, and, with ``adapt-steps``, after adapting (``adapted_accuracy``, ``adapted_loss``)."""
    local = {"accuracy": metrics["eval-acc"], "loss": metrics["eval-loss"]}
    if P.ADAPTED_ACC in metrics:
        local["adapted_accuracy"] = metrics[P.ADAPTED_ACC]
        local["adapted_loss"] = metrics[P.ADAPTED_LOSS]
    return local


class SubmodelStrategyBase:
    """The global model as a flat vector, the nodes, and per-node submodel Messages (see the module
    docstring).

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration.
    layout : ParamLayout
        Flat layout of the global model.
    method : ServerMethod, optional
        The method (default: the one ``cfg.method`` names, from the registry).
    on_round : Callable, optional
        Called with each round's record (a JSON-ready dict,
        :mod:`server.strategy_core.round_records`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: ParamLayout,
        method: ServerMethod | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.method = method if method is not None else create_method(cfg)
        self.method.start_server(layout)
        self.on_round = on_round
        self.evaluate_fn: EvaluateFn | None = None
        self.registry = NodeRegistry(cfg, self.method)
        # The global model as of the last aggregation: what central evaluation and the level masks
        # read.
        self.x: NDArray[np.float32] = np.zeros(layout.size, dtype=np.float32)
        self.mask_history = MaskHistory(layout.size)

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "%s: %s d=%d", type(self).__name__, self.method.describe(), self.layout.size)

    # ------------------------------------------------------------ the model
    def open_fold(self, plan: TrainPlan, warm_up: bool = False) -> RoundFold:
        """The fold the replies to ``plan`` go into: the method's own
        (:meth:`~common.methods.contract.server_side.ServerMethod.round_fold`), or round 0's
        Fisher-only :class:`~common.methods.round_fold.WarmUpFold` with ``warm_up``."""
        args = (plan.x, plan.server_round, self.cfg.min_replies)
        return WarmUpFold(self.method, *args) if warm_up else self.method.round_fold(*args)

    def state_bytes(self) -> bytes:
        """What the run's checkpoint keeps besides the global model: the method's state."""
        return self.method.state_bytes()

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`state_bytes` from a resumed run's checkpoint."""
        self.method.load_state(data)

    def final_models(self) -> dict[str, NDArray[np.float32]]:
        """The models a finished run saves, by file name in its results folder."""
        return {"model.pt": self.x}

    def _flat(self, arrays: ArrayRecord) -> NDArray[np.float32]:
        return self.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})

    def to_arrays(self, flat: NDArray[np.float32]) -> ArrayRecord:
        """The flat vector as an ArrayRecord of named tensors."""
        return array_record(self.layout.unflatten(flat))

    def node_mask(
        self, node_id: int, server_round: int, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]:
        """The submodel mask of a discovered node for ``server_round`` of the global model ``x``
        (default: the current one), and the rule that chose it."""
        prof = self.registry.nodes[node_id]
        return self.method.mask_for(
            prof.key, server_round, prof.capacity, self.x if x is None else x
        )

    def level_mask(
        self, server_round: int, gamma: float, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]:
        """The submodel of capacity level ``gamma`` that central evaluation measures after
        ``server_round``, for the global model ``x`` of that round (default: the current one)."""
        return self.method.mask_for(None, server_round + 1, gamma, self.x if x is None else x)

    # ------------------------------------------------------------- messages
    def submodel_message(
        self,
        node_id: int,
        server_round: int,
        message_type: str,
        store: dict[int, SentSubmodel],
        mask_and_source: tuple[NDArray[np.bool_], str] | None = None,
        config: ConfigRecord | None = None,
        x: NDArray[np.float32] | None = None,
    ) -> tuple[Message, ClientRound]:
        """The Message carrying a node's submodel, and its bookkeeping entry; records what was sent
        in ``store``.

        Parameters
        ----------
        node_id : int
            Destination.
        server_round : int
            Written to the message's ``round`` (a dispatch number in asynchronous runs).
        message_type : str
            ``MessageType.TRAIN`` or ``MessageType.EVALUATE``.
        store : dict
            Where the :class:`SentSubmodel` is kept, to check the reply against.
        mask_and_source : tuple, optional
            The mask to send (default: :meth:`node_mask` for ``server_round``).
        config : ConfigRecord, optional
            Extra settings for the node (``train_config`` / ``evaluate_config`` of ``start``), sent
            as the ``config`` record when not empty.
        x : NDArray[float32], optional
            The global model the submodel is cut from (default: the current one).
        """
        x = self.x if x is None else x
        mask, source = (
            mask_and_source
            if mask_and_source is not None
            else self.node_mask(node_id, server_round, x)
        )
        download, records, fisher_asked = self._download_records(
            node_id, server_round, message_type, x, mask
        )
        round_config = self._submodel_config(download, server_round)
        info = self.note_sent(
            node_id,
            server_round,
            (mask, source),
            download,
            store,
            fisher_asked=fisher_asked,
            bytes_down=sum(r.count_bytes() for r in records.values()),
            fisher_at_bytes=records[P.FISHER_AT].count_bytes() if P.FISHER_AT in records else 0,
            train=message_type == MessageType.TRAIN,
        )
        content = RecordDict({**records, P.SUBMODEL_CONFIG: round_config})
        if config:
            content[P.CONFIG] = config
        return Message(content=content, dst_node_id=node_id, message_type=message_type), info

    def _download_records(
        self,
        node_id: int,
        server_round: int,
        message_type: str,
        x: NDArray[np.float32],
        mask: NDArray[np.bool_],
    ) -> tuple[Download, dict[str, ArrayRecord], bool]:
        """The method's encoding of a node's submodel, its records, and whether a TRAIN message
        asks the node for its Fisher (the global values it is asked at go in ``P.FISHER_AT``).

        Parameters
        ----------
        node_id : int
            Destination.
        server_round : int
            The round the submodel is for (a dispatch number in asynchronous runs).
        message_type : str
            ``MessageType.TRAIN`` or ``MessageType.EVALUATE``; only TRAIN may ask for Fisher.
        x : NDArray[float32]
            The global model the submodel is cut from.
        mask : NDArray[bool]
            The submodel's mask.
        """
        download = self.method.encode(x, mask)
        records = {name: array_record(arrays) for name, arrays in download.records.items()}
        request = None
        if message_type == MessageType.TRAIN:
            key = self.registry.nodes[node_id].key
            request = self.method.fisher_request(key, server_round, x, mask, download)
        if request is not None and request.arrays:
            records[P.FISHER_AT] = array_record(request.arrays)
        return download, records, request is not None

    def _submodel_config(self, download: Download, server_round: int) -> ConfigRecord:
        """The message's ``P.SUBMODEL_CONFIG`` record: the mask's kind and digest, the global
        model's size ``d`` and the round.

        Parameters
        ----------
        download : Download
            The method's encoding of the submodel (its mask kind and digest are sent).
        server_round : int
            Written as the record's ``round``.
        """
        return ConfigRecord(
            {
                "mask-kind": download.kind,
                "mask-digest": download.digest,
                "d": self.layout.size,
                "round": server_round,
            }
        )

    def note_sent(
        self,
        node_id: int,
        server_round: int,
        mask_and_source: tuple[NDArray[np.bool_], str],
        download: Download,
        store: dict[int, SentSubmodel],
        fisher_asked: bool,
        bytes_down: int,
        fisher_at_bytes: int = 0,
        train: bool = True,
    ) -> ClientRound:
        """Keep what a node was sent (its :class:`SentSubmodel` in ``store``) and return its round
        entry.

        Parameters
        ----------
        node_id, server_round : int
            The node, and the round the submodel is for.
        mask_and_source : tuple
            The mask sent and the rule that chose it.
        download : Download
            The method's encoding of the submodel (its digest is what the reply must echo).
        store : dict
            Where the :class:`SentSubmodel` is kept, to check the reply against.
        fisher_asked : bool
            Whether the node was asked for its Fisher (its reply must then carry it).
        bytes_down, fisher_at_bytes : int
            Bytes the node received for this submodel, and of them the global values sent for a
            Fisher refresh.
        train : bool
            A TRAIN submodel: the mask's overlap with the client's previous one and its positions
            per tensor are noted.
        """
        prof = self.registry.nodes[node_id]
        mask, source = mask_and_source
        store[node_id] = SentSubmodel(
            node_id, server_round, mask, download.digest, prof.num_train, fisher_asked
        )
        k = int(mask.sum())
        info = ClientRound(
            node_id=node_id,
            client_key=prof.key,
            capacity=prof.capacity,
            device=prof.device,
            mask_source=source,
            selected=k,
            density=k / self.layout.size,
            bytes_down=bytes_down,
            values_bytes=download.values_bytes,
            mask_bytes=download.mask_bytes,
            mask_kind=download.kind,
            capacity_source=prof.capacity_source,
            fisher_asked=fisher_asked,
            fisher_at_bytes=fisher_at_bytes,
        )
        if train:
            info.mask_overlap = self.mask_history.observe(prof.key, mask)
            info.layer_positions = self.layout.count_per_tensor(mask)
        return info

    # ------------------------------------------------- the nodes' evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> EvaluatePlan:
        """Each node evaluates the submodel it would train next on its local test split."""
        plan = EvaluatePlan(server_round)
        self.add_evaluate_messages(plan, self.tested_nodes(), self._flat(arrays), config)
        return plan

    def tested_nodes(self) -> list[int]:
        """The discovered nodes with a local test split, by node id."""
        nodes = self.registry.nodes
        return [nid for nid in sorted(nodes) if nodes[nid].num_test > 0]

    def add_evaluate_messages(
        self,
        plan: EvaluatePlan,
        node_ids: Iterable[int],
        x: NDArray[np.float32],
        config: ConfigRecord,
    ) -> None:
        """Add to ``plan`` the EVALUATE message of each of ``node_ids``, its submodel cut from
        ``x``."""
        for nid in node_ids:
            message, _ = self.submodel_message(
                nid, plan.server_round, MessageType.EVALUATE, plan.sent, config=config, x=x
            )
            plan.messages.append(message)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message], plan: EvaluatePlan
    ) -> MetricRecord | None:
        """Example-weighted local loss and accuracy over valid replies; the figures per capacity
        into ``plan``."""
        nodes = self.registry.nodes
        seen: dict[int, dict[str, float]] = {}
        for msg in replies:
            p = reply_parts(msg, None, P.METRICS, P.META)
            try:
                sent = expected_sent(p, plan.sent, seen)
                seen[p.node_id] = validate_evaluate_reply(
                    p.metrics,
                    p.meta,
                    sent,
                    nodes[p.node_id].num_test,
                    adapted=self.cfg.adapt_steps > 0,
                )
            except ReplyError as err:
                log(
                    WARNING,
                    "round %d: evaluation reply from node %d rejected: %s",
                    server_round,
                    p.node_id,
                    err,
                )
        if not seen:
            return None
        # Summed in the clients' key order, not in arrival order (nor by node id, which a new
        # federation draws afresh): the same replies give the same figures to the last bit.
        seen = {nid: seen[nid] for nid in sorted(seen, key=lambda nid: nodes[nid].key)}
        plan.federated = federated_figures(
            [
                NodeEvaluation(
                    nodes[nid].capacity,
                    plan.sent[nid].kept == plan.sent[nid].d,
                    int(m["num-examples"]),
                    m["eval-loss"],
                    m["eval-acc"],
                    m.get(P.ADAPTED_LOSS),
                    m.get(P.ADAPTED_ACC),
                )
                for nid, m in seen.items()
            ]
        )
        records = [RecordDict({P.METRICS: MetricRecord(m)}) for m in seen.values()]
        metrics = aggregate_metricrecords(records, "num-examples")
        metrics["num-examples"] = sum(m["num-examples"] for m in seen.values())
        metrics["replies"] = len(seen)
        return metrics

    def nodes_evaluate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        grid: Grid,
        timeout: float,
        config: ConfigRecord,
    ) -> tuple[MetricRecord | None, dict[str, Any] | None]:
        """The nodes' own evaluation of ``arrays``: their example-weighted metrics (``None`` when no
        node replied) and the figures per capacity level (a round record's ``federated``)."""
        plan = self.configure_evaluate(server_round, arrays, config, grid)
        replies = exchange(grid, list(plan), timeout, self.cfg.poll_interval)
        return self.aggregate_evaluate(server_round, replies, plan), plan.federated

    # ---------------------------------------------------- central evaluation
    def central_evaluation(
        self,
        server_round: int,
        trained: TrainPlan | None = None,
        x: NDArray[np.float32] | None = None,
        capacities: Iterable[float] | None = None,
    ) -> dict[str, Any]:
        """Full model and the submodel at every capacity level present, with ``evaluate_fn``.

        Parameters
        ----------
        server_round : int
            The round whose model is evaluated.
        trained : TrainPlan, optional
            The round's plan: also evaluate the submodel each of its clients trained
            (``trained_per_capacity``; one evaluation per distinct mask, so it runs on the rounds of
            the clients' own evaluation only).
        x : NDArray[float32], optional
            The round's global model (default: the current one).
        capacities : Iterable[float], optional
            The capacity levels to evaluate (default: every discovered node's).
        """
        if self.evaluate_fn is None:
            return {}
        x = self.x if x is None else x
        full = self.evaluate_fn(server_round, self.to_arrays(x))
        if full is None:
            return {}
        levels = {}
        for gamma in sorted(
            set(self.registry.capacities() if capacities is None else capacities), reverse=True
        ):
            mask, source = self.level_mask(server_round, gamma, x)
            sub = self.evaluate_fn(
                server_round, self.to_arrays(np.where(mask, x, 0).astype(np.float32))
            )
            if sub is None:
                continue
            levels[f"{gamma:g}"] = {
                "accuracy": sub["accuracy"],
                "loss": sub["loss"],
                "density": float(mask.mean()),
                "source": source,
            }
        out = {"accuracy": full["accuracy"], "loss": full["loss"], "per_capacity": levels}
        if trained is not None and server_round > 0:
            out["trained_per_capacity"] = self.evaluate_trained(server_round, full, trained, x)
        return out

    def evaluate_trained(
        self, server_round: int, full: Mapping[str, float], plan: TrainPlan, x: NDArray[np.float32]
    ) -> dict[str, dict[str, float]]:
        """The round's model ``x`` on each trained client's own mask, into its entry of ``plan``;
        the mean per capacity level.

        Clients sent the same mask (a width slice, a held level) are evaluated once; a full mask is
        the full model.
        """
        assert self.evaluate_fn is not None
        seen: dict[str, tuple[float, float]] = {}
        for node_id, info in plan.clients.items():
            sent = plan.sent.get(node_id)
            if sent is None:
                continue
            if sent.digest not in seen:
                if sent.kept == sent.d:
                    seen[sent.digest] = (float(full["accuracy"]), float(full["loss"]))
                else:
                    sub = self.evaluate_fn(
                        server_round, self.to_arrays(np.where(sent.mask, x, 0).astype(np.float32))
                    )
                    if sub is None:
                        continue
                    seen[sent.digest] = (float(sub["accuracy"]), float(sub["loss"]))
            info.submodel_accuracy, info.submodel_loss = seen[sent.digest]
        return per_capacity_means(
            [
                (c.capacity, c.submodel_accuracy, c.submodel_loss)
                for c in plan.clients.values()
                if c.submodel_accuracy is not None
            ]
        )
