"""The synchronous strategy with one model per cluster of nodes (``cluster-by``, ACFL).

Every step of a round is the synchronous strategy's own, run once per cluster with that cluster's
method and model bound in place of the strategy's (:meth:`ClusteredStrategy.bound`): the TRAIN
messages of each cluster's nodes are cut from its model, the replies are folded into it, and the
central and node evaluations measure each node on its cluster's model. Until a node is placed it
trains the first cluster, and a fold of the first cluster keeps each unplaced node's signature
(:class:`SignatureTap`); after the round, those nodes are placed
(:mod:`server.clustering.cluster_set`). A round record's ``clusters`` says who is where; its
global figures are the clusters' models on the server's test set, weighted by the nodes in each.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from common.methods import create_method
from common.methods.round_fold import Accepted, RoundFold
from server.clustering.cluster_set import ClusterSet
from server.mask_stability import per_capacity_means
from server.replies import ReplyParts
from server.strategy import SubmodelStrategy, TrainedRound
from server.strategy_core.round_plan import EvaluatePlan, TrainPlan


@dataclass
class ClusteredPlan(TrainPlan):
    """A round's TRAIN messages over several clusters: the merged view, and each cluster's own plan
    (its model and what its nodes were sent), by cluster."""

    parts: dict[int, TrainPlan] = field(default_factory=dict)


class SignatureTap:
    """A round fold that hands each accepted reply to the clusters (which keep an unplaced client's
    signature) before folding it."""

    def __init__(self, fold: RoundFold, clusters: ClusterSet, warm_up: bool) -> None:
        self.fold, self.clusters, self.warm_up = fold, clusters, warm_up

    @property
    def count(self) -> int:
        """Replies added so far."""
        return self.fold.count

    def add(self, accepted: Accepted) -> None:
        """Keep the signature, then fold the reply in."""
        self.clusters.capture(accepted, self.warm_up)
        self.fold.add(accepted)

    def finish(self) -> NDArray[np.float32]:
        """The folded model."""
        return self.fold.finish()

    def discard(self) -> None:
        """The round did not count: neither its model nor its signatures."""
        self.clusters.drop_pending()
        self.fold.discard()


class ClusteredStrategy(SubmodelStrategy):
    """:class:`~server.strategy.SubmodelStrategy` with one model, and one copy of the method, per
    cluster of nodes.

    Parameters
    ----------
    As :class:`~server.strategy.SubmodelStrategy`; the run's ``cluster-*`` keys shape the clusters.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clusters = ClusterSet(self.cfg, self.layout, lambda: create_method(self.cfg))
        # Each trained round's cluster models and weights, until its central evaluation, and the
        # record entry that evaluation completes.
        self.trained: dict[int, tuple[list[tuple[int, NDArray[np.float32], int]], dict]] = {}

    @contextmanager
    def bound(self, c: int) -> Iterator[None]:
        """Cluster ``c``'s method and model in place of the strategy's while inside (the first
        cluster's are the strategy's own); what is folded into the model stays with the cluster."""
        cluster = self.clusters.clusters[c]
        if cluster.method is None:
            yield
            return
        saved = self.method, self.x
        self.method, self.x = cluster.method, cluster.x
        try:
            yield
        finally:
            cluster.x = self.x
            self.method, self.x = saved

    def by_cluster(self, node_ids: Iterable[int]) -> dict[int, list[int]]:
        """``node_ids`` grouped by the cluster each trains in, in cluster order."""
        groups: dict[int, list[int]] = {}
        for nid in node_ids:
            groups.setdefault(self.clusters.cluster_of(self.registry.nodes[nid].key), []).append(
                nid
            )
        return dict(sorted(groups.items()))

    # ------------------------------------------------------------------- train
    def plan_train(
        self,
        server_round: int,
        x: NDArray[np.float32],
        node_ids: Iterable[int],
        config: ConfigRecord | None = None,
    ) -> TrainPlan:
        """One cluster: as the synchronous strategy. Several: each cluster's nodes get its model
        (``x`` is the first cluster's), its part of the plan in cluster order."""
        if len(self.clusters.clusters) == 1:
            return super().plan_train(server_round, x, node_ids, config)
        plan = ClusteredPlan(server_round, x)
        for c, ids in self.by_cluster(node_ids).items():
            with self.bound(c):
                part = super().plan_train(server_round, self.x, ids, config)
            plan.parts[c] = part
            plan.messages += part.take_messages()
            plan.sent.update(part.sent)
            plan.clients.update(part.clients)
        return plan

    def open_fold(self, plan: TrainPlan, warm_up: bool = False) -> RoundFold:
        """The method's fold, tapped for the signatures of clients not placed yet."""
        return SignatureTap(super().open_fold(plan, warm_up), self.clusters, warm_up)

    def fold_train_replies(
        self, plan: TrainPlan, parts: Iterable[ReplyParts], warm_up: bool = False
    ) -> list[dict[str, float]]:
        """Each cluster's replies folded into its model (they come in the plan's cluster order),
        then the clients whose signatures came in placed (after round 1, for the warm-up's)."""
        if not isinstance(plan, ClusteredPlan):
            accepted = super().fold_train_replies(plan, parts, warm_up)
        else:
            accepted, done = [], set()
            nodes = self.registry.nodes

            def cluster(p: ReplyParts) -> int:
                return self.clusters.cluster_of(nodes[p.node_id].key) if p.node_id in nodes else -1

            for c, group in groupby(parts, key=cluster):
                if c not in plan.parts:
                    for p in group:
                        log(
                            WARNING,
                            "round %d: reply from node %d, which was sent nothing, rejected",
                            plan.server_round,
                            p.node_id,
                        )
                    continue
                if c in done:  # the grid yields replies in the order of the plan's messages
                    raise RuntimeError(f"round {plan.server_round}: replies out of cluster order")
                done.add(c)
                with self.bound(c):
                    accepted += super().fold_train_replies(plan.parts[c], group, warm_up)
        if not warm_up:
            # A warm-up's signatures (its Fisher) wait for round 1's fold: round 1 may have been
            # planned with the warm-up (discovery carries both), before any node could be placed.
            levels = {n.key: n.capacity for n in self.registry.nodes.values()}
            self.clusters.place_pending(self.method, self.x, levels)
        return accepted

    def run_round(self, grid: Grid, server_round: int, *args: Any, **kwargs: Any) -> TrainedRound:
        """The round, then its clusters as they stand: the record's ``clusters`` entry and the
        models its central evaluation measures."""
        done = super().run_round(grid, server_round, *args, **kwargs)
        entry = self.clusters.record(n.key for n in self.registry.nodes.values())
        weights = [c.members for c in self.clusters.clusters]
        weights[0] += len(entry["unplaced"])
        models = [
            (c, self.x if cl.x is None else cl.x, weights[c])
            for c, cl in enumerate(self.clusters.clusters)
        ]
        done.method_entries["clusters"] = entry
        self.trained[server_round] = (models, entry)
        return done

    # --------------------------------------------------------------- evaluate
    def central_evaluation(
        self,
        server_round: int,
        trained: TrainPlan | None = None,
        x: NDArray[np.float32] | None = None,
        capacities: Iterable[float] | None = None,
    ) -> dict[str, Any]:
        """Each cluster's model as the synchronous strategy evaluates one; the global figures
        weighted by the nodes in each cluster, each cluster's in the record's ``clusters``."""
        models, entry = self.trained.pop(server_round, ([], {}))
        if len(models) < 2:
            return super().central_evaluation(server_round, trained, x, capacities)
        parts = trained.parts if isinstance(trained, ClusteredPlan) else {0: trained}
        capacities = list(capacities) if capacities is not None else None
        results = []
        for c, xc, weight in models:
            with self.bound(c):
                r = super().central_evaluation(server_round, parts.get(c), xc, capacities)
            if r:
                results.append((weight, r))
        if not results:
            return {}
        entry["accuracy"] = [r["accuracy"] for _, r in results]
        out = weighted_figures(results)
        if trained is not None and server_round > 0:
            out["trained_per_capacity"] = per_capacity_means(
                (ci.capacity, ci.submodel_accuracy, ci.submodel_loss)
                for ci in trained.clients.values()
                if ci.submodel_accuracy is not None
            )
        return out

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> EvaluatePlan:
        """Each node evaluates the submodel it would train next, cut from its cluster's model."""
        if len(self.clusters.clusters) == 1:
            return super().configure_evaluate(server_round, arrays, config, grid)
        plan = EvaluatePlan(server_round)
        for c, ids in self.by_cluster(self.tested_nodes()).items():
            with self.bound(c):
                self.add_evaluate_messages(plan, ids, self.x, config)
        return plan

    # -------------------------------------------------------------- checkpoint
    def state_bytes(self) -> bytes:
        """The first cluster's method state and every other cluster's model and state."""
        return self.clusters.state_bytes(self.method)

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`state_bytes`."""
        self.clusters.load_state(data, self.method)

    def final_models(self) -> dict[str, NDArray[np.float32]]:
        """The first cluster's model as ``model.pt``, every other's as ``model-cluster-<c>.pt``."""
        others = {
            f"model-cluster-{c}.pt": cluster.x
            for c, cluster in enumerate(self.clusters.clusters)
            if cluster.x is not None
        }
        return {"model.pt": self.x, **others}


def weighted_figures(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Central figures of several models as one: each model's accuracy and loss (overall and per
    capacity level) weighted by its nodes."""

    def mean(values: list[tuple[int, float]]) -> float:
        return float(sum(w * v for w, v in values) / (sum(w for w, _ in values) or 1))

    levels: dict[str, dict[str, Any]] = {}
    for level in sorted({lv for _, r in results for lv in r.get("per_capacity", {})}):
        have = [(w, r["per_capacity"][level]) for w, r in results if level in r["per_capacity"]]
        levels[level] = {
            "accuracy": mean([(w, v["accuracy"]) for w, v in have]),
            "loss": mean([(w, v["loss"]) for w, v in have]),
            "density": mean([(w, v["density"]) for w, v in have]),
            "source": have[0][1]["source"],
        }
    return {
        "accuracy": mean([(w, r["accuracy"]) for w, r in results]),
        "loss": mean([(w, r["loss"]) for w, r in results]),
        "per_capacity": levels,
    }
