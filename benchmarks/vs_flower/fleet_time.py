"""Accuracy against time for a run, in one-machine seconds and in the emulated time of a fleet of
separate machines.

On one machine every node shares the same cores, so wall-clock seconds favour runs that train fewer
nodes. The emulated fleet time is what a round would take if each node had a processor of its own:
the slowest participating node's own compute (the CPU seconds its process spent training and
estimating the Fisher, which do not grow when other processes share the cores), plus its transfer at
its link speed, plus the server's seconds::

    round_s = max over nodes (cpu_s + 8 * (bytes_down + bytes_up) / (capacity * link_mbit * 1e6)) + server_s

``server_s`` is the server process's CPU seconds of the round's own work where the app records them
(both apps here do), like the nodes' figure.

A node's link is ``capacity x link_mbit`` Mbit/s: under the product's default capacity kind, a
node's capacity is the share of a full model its link carries in the time a capable node moves the
whole model. Process start-up and message polling are left out: they are the same on a fleet and on
one machine, and the one-machine seconds include them.

Pure functions on the ``metrics.json`` records of both apps (the product's rounds, and the stock
Flower app's of :mod:`benchmarks.vs_flower.stock_flower`), so the two are scored by the same rule.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeCost:
    """What one node spent in one exchange.

    Parameters
    ----------
    capacity : float
        The node's capacity (fraction of the full model, in (0, 1]); its link is ``capacity x
        link_mbit``.
    cpu_seconds : float
        CPU seconds of the node's training and Fisher estimation.
    bytes_down, bytes_up : int
        Bytes the node received and sent.
    """

    capacity: float
    cpu_seconds: float
    bytes_down: int
    bytes_up: int


@dataclass(frozen=True)
class Evaluation:
    """The global model's accuracy after a round, with the time spent to get there.

    Parameters
    ----------
    round : int
        The round (0: the initial model).
    accuracy : float
        Central test accuracy of the full global model, a fraction in [0, 1].
    wall_seconds : float
        Seconds since the run was submitted, on this machine (start-up included).
    fleet_seconds : float
        Emulated fleet seconds of every exchange up to this round (:func:`exchange_seconds`).
    """

    round: int
    accuracy: float
    wall_seconds: float
    fleet_seconds: float


def transfer_seconds(num_bytes: float, capacity: float, link_mbit: float) -> float:
    """Seconds to move ``num_bytes`` over a link of ``capacity x link_mbit`` Mbit/s."""
    if not 0 < capacity <= 1:
        raise ValueError(f"capacity {capacity}: expected a fraction in (0, 1]")
    if link_mbit <= 0:
        raise ValueError(f"link speed {link_mbit} Mbit/s: expected a positive number")
    return 8.0 * num_bytes / (capacity * link_mbit * 1e6)


def exchange_seconds(
    nodes: Sequence[NodeCost], server_seconds: float, link_mbit: float, beside: float = 0.0
) -> float:
    """Emulated seconds of one exchange: the slowest node's compute and transfer, plus the server's
    seconds.

    Parameters
    ----------
    nodes : Sequence[NodeCost]
        The nodes that replied (an exchange nobody answered costs the server's seconds only).
    server_seconds : float
        The server's own seconds in the exchange that the nodes wait for (building messages,
        aggregating, evaluating when it does so before the next exchange).
    link_mbit : float
        Link speed of a capacity-1 node, Mbit/s.
    beside : float
        The server's seconds of work done while the nodes compute (the previous round's central
        evaluation, when it overlaps this exchange): the exchange lasts at least that long.
    """
    slowest = max(
        (
            n.cpu_seconds + transfer_seconds(n.bytes_down + n.bytes_up, n.capacity, link_mbit)
            for n in nodes
        ),
        default=0.0,
    )
    return max(slowest, beside) + server_seconds


def server_seconds(record: Mapping[str, Any]) -> float:
    """The server's seconds of a round: its process's CPU seconds where the record has them, as the
    nodes' are (on one machine the wall-clock seconds include waiting for the cores the nodes'
    processes hold), else its wall-clock ``server_seconds``."""
    return float(record.get("server_cpu_seconds", record["server_seconds"]))


def _product_nodes(clients: Sequence[Mapping[str, Any]]) -> list[NodeCost]:
    nodes = []
    for c in clients:
        if c.get("status") != "ok":
            continue
        cpu = c.get("cpu_seconds")
        if (
            cpu is None
        ):  # a client that reports no CPU seconds: its own wall seconds of training and Fisher
            cpu = float(c.get("train_seconds") or 0.0) + float(c.get("fisher_seconds") or 0.0)
        nodes.append(
            NodeCost(float(c["capacity"]), float(cpu), int(c["bytes_down"]), int(c["bytes_up"]))
        )
    return nodes


def product_curve(
    records: Sequence[Mapping[str, Any]], submitted_at: float, link_mbit: float
) -> list[Evaluation]:
    """The product's evaluations from its metrics.json ``rounds``.

    Round 0's cost is the Fisher warm-up's exchange (its clients, when the run had one); every later
    round's is its clients that replied plus its ``server_seconds``, and at least the previous
    round's ``central_seconds`` when that evaluation ran while this round trained
    (``central_overlapped``). Records without a global accuracy add their cost only. When discovery
    carried round 1 too, the warm-up and round 1 are scored as two exchanges although they were one
    (an upper bound: each node's two steps are summed per step, not per node).

    Parameters
    ----------
    records : Sequence[Mapping]
        metrics.json's ``rounds`` (each with ``time``, the Unix time it was made).
    submitted_at : float
        Unix time the run was submitted.
    link_mbit : float
        Link speed of a capacity-1 node, Mbit/s.
    """
    out, fleet, beside = [], 0.0, 0.0
    for r in records:
        if r["round"] == 0:
            warmup = r.get("fisher_warmup") or {}
            fleet += exchange_seconds(_product_nodes(warmup.get("clients", [])), 0.0, link_mbit)
        else:
            fleet += exchange_seconds(
                _product_nodes(r["clients"]), server_seconds(r), link_mbit, beside
            )
            beside = (
                float(r.get("central_cpu_seconds", r.get("central_seconds", 0.0)))
                if r.get("central_overlapped")
                else 0.0
            )
        acc = (r.get("global") or {}).get("accuracy")
        if acc is not None:
            out.append(
                Evaluation(int(r["round"]), float(acc), float(r["time"]) - submitted_at, fleet)
            )
    return out


def stock_curve(
    records: Sequence[Mapping[str, Any]], submitted_at: float, link_mbit: float
) -> list[Evaluation]:
    """The stock Flower app's evaluations from its metrics.json ``rounds`` (one per round, round 0
    free).

    Each record's ``clients`` are the replies' metrics (``capacity``, ``cpu-seconds``,
    ``bytes-down``, ``bytes-up``), ``server_seconds`` its aggregation and evaluation.
    """
    out, fleet = [], 0.0
    for r in records:
        nodes = [
            NodeCost(
                float(c["capacity"]),
                float(c["cpu-seconds"]),
                int(c["bytes-down"]),
                int(c["bytes-up"]),
            )
            for c in r["clients"]
        ]
        if r["round"] > 0:
            fleet += exchange_seconds(nodes, server_seconds(r), link_mbit)
        out.append(
            Evaluation(
                int(r["round"]),
                float(r["global"]["accuracy"]),
                float(r["time"]) - submitted_at,
                fleet,
            )
        )
    return out


def startup_seconds(records: Sequence[Mapping[str, Any]], submitted_at: float) -> float:
    """Seconds from submission until the first round's training messages went out.

    Both apps make the initial model's record just before they send round 1, so its ``time`` is that
    moment; when the product's discovery carried round 1 (``round_one_pushed`` in that record), it
    is when the discovery messages went out.
    """
    first = records[0]
    return float(first.get("round_one_pushed", first["time"])) - submitted_at


def first_reaching(curve: Sequence[Evaluation], target: float) -> Evaluation | None:
    """The first evaluation at or above ``target`` accuracy (a fraction); ``None`` if none is."""
    return next((e for e in curve if e.accuracy >= target), None)
