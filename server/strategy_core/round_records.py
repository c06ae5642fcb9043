"""What metrics.json keeps of each round (and rounds.jsonl, TensorBoard read): the records and their
progress lines.

A record is a JSON-ready dict: the synchronous rounds' (:func:`round_record`, with round 0's
:func:`opening_record` before them) and the asynchronous evaluations' (:func:`async_record`). Each
client of a round has a :class:`ClientRound` entry. :func:`progress_line` is the one log line per
record, :func:`update_line` the line per applied asynchronous update.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log

from common.wire.validation import TrainReply
from server.federated_evaluation import NODES_SOURCE, global_figures


@dataclass
class ClientRound:
    """Per-client bookkeeping of one round (one entry of ``clients`` in metrics.json)."""

    node_id: int
    capacity: float
    device: str
    mask_source: str
    selected: int
    density: float
    bytes_down: int
    values_bytes: int
    mask_bytes: int
    mask_kind: str
    bytes_up: int = 0
    status: str = "no reply"
    train_loss: float | None = None
    train_seconds: float | None = None
    fisher_seconds: float | None = None
    peak_rss_mib: float | None = None  # the client process's peak resident memory while it trained
    cpu_seconds: float | None = None  # the client process's CPU seconds of training and Fisher
    num_examples: int | None = None
    dp_epsilon: float | None = (
        None  # the node's privacy budget spent so far (its ledger, after this reply)
    )
    dp_noise_multiplier: float | None = (
        None  # the noise multiplier its DP-SGD steps and Fisher used
    )
    capacity_source: str = "node-config"
    client_key: str = (
        ""  # the node's stable client key (survives a SuperNode restart, unlike the node id)
    )
    fisher_asked: bool = False  # the message asked for the node's Fisher
    fisher_at_bytes: int = (
        0  # bytes of the global values outside the mask sent for a Fisher refresh
    )
    mask_overlap: float | None = (
        None  # Jaccard overlap with this client's previous TRAIN mask (None: first)
    )
    layer_positions: dict[str, int] | None = None  # held positions per tensor (TRAIN messages)
    submodel_accuracy: float | None = (
        None  # the round's global model on this client's mask, server test set
    )
    submodel_loss: float | None = None


def note_accepted(info: ClientRound | None, bytes_up: int, reply: TrainReply) -> None:
    """Note an accepted TRAIN reply in its client's entry (``None``: a reply without one, nothing to
    note).

    Parameters
    ----------
    info : ClientRound or None
        The client's entry of the round.
    bytes_up : int
        Bytes of the reply's update arrays (the upload).
    reply : TrainReply
        The validated reply, whose metrics are copied.
    """
    if info is None:
        return
    info.status = "ok"
    info.bytes_up = bytes_up
    info.train_loss = reply.metrics["train-loss"]
    info.train_seconds = reply.metrics["train-seconds"]
    info.fisher_seconds = reply.metrics["fisher-seconds"]
    info.peak_rss_mib = reply.metrics.get("peak-rss-mib")
    info.cpu_seconds = reply.metrics.get("cpu-seconds")
    info.num_examples = int(reply.metrics["num-examples"])
    info.dp_epsilon = reply.metrics.get("dp-epsilon")
    info.dp_noise_multiplier = reply.metrics.get("dp-noise-multiplier")


def opening_record(
    central: dict[str, Any],
    nodes_in: list[dict[str, Any]],
    nodes_out: list[dict[str, Any]],
    warmup: dict[str, Any] | None,
) -> dict[str, Any]:
    """Round 0 of a synchronous run: the initial model's central evaluation, before any training.

    Parameters
    ----------
    central : dict
        The central evaluation (``global``).
    nodes_in, nodes_out : list of dict
        The nodes discovered, and those left out, at the start.
    warmup : dict or None
        The Fisher warm-up's counts and its clients' entries (``fisher_warmup``; left out when the
        run has none).

    ``time`` is the Unix time the record was made (also in every round's record): with the
    submission's time it gives the seconds a run took to reach an accuracy, start-up included.
    """
    record = {
        "round": 0,
        "global": central,
        "clients": [],
        "nodes_in": nodes_in,
        "nodes_out": nodes_out,
        "time": time.time(),
    }
    return {**record, "fisher_warmup": warmup} if warmup else record


def round_record(
    server_round: int,
    *,
    central: dict[str, Any],
    local: dict[str, float] | None,
    federated: dict[str, Any] | None,
    clients: Mapping[int, ClientRound],
    eligible: int,
    nodes_in: list[dict[str, Any]],
    nodes_out: list[dict[str, Any]],
    server_seconds: float,
    round_seconds: float,
    method_entries: Mapping[str, Any],
    trained_at: float | None = None,
) -> dict[str, Any]:
    """One synchronous round.

    Parameters
    ----------
    server_round : int
        The round (``round``).
    central : dict
        The central evaluation after aggregation (``global``; empty without a server test set).
    local : dict or None
        The nodes' example-weighted accuracy and loss on their own test splits (``local``; ``None``
        on a round without client evaluation).
    federated : dict or None
        The node-measured figures of that evaluation (``federated``).
    clients : Mapping[int, ClientRound]
        The entry of every client sent a TRAIN message (``clients``; ``replies`` counts the ``ok``
        ones).
    eligible : int
        Nodes that could train this round (``eligible``; more than ``sent`` under
        ``fraction-train``).
    nodes_in, nodes_out : list of dict
        Nodes discovered, and nodes left out or departed, since the previous record.
    server_seconds : float
        Seconds the server spent building messages, aggregating and evaluating centrally.
    round_seconds : float
        Wall-clock seconds of the whole round, node refresh and client evaluation included.
    method_entries : Mapping[str, Any]
        The method's own entries
        (:meth:`~common.methods.contract.server_side.ServerMethod.round_entries`), last.
    trained_at : float, optional
        Unix time the round's model was aggregated (``time``; default: now). Its record may be made
        later: its central evaluation can run while the next round trains.
    """
    return {
        "round": server_round,
        **_evaluation_entries(central, local, federated),
        **_client_entries(clients, eligible),
        "nodes_in": nodes_in,
        "nodes_out": nodes_out,
        "server_seconds": server_seconds,
        "round_seconds": round_seconds,
        "time": time.time() if trained_at is None else trained_at,
        **method_entries,
    }


def async_record(
    evaluation: int,
    *,
    updates: int,
    wall_seconds: float,
    central: dict[str, Any],
    local: dict[str, float] | None,
    federated: dict[str, Any] | None,
    window: list[dict[str, Any]],
    nodes_in: list[dict[str, Any]],
    nodes_out: list[dict[str, Any]],
    server_seconds: float,
    round_seconds: float,
) -> dict[str, Any]:
    """One evaluation of an asynchronous run, with every reply handled since the previous one.

    Parameters
    ----------
    evaluation : int
        The evaluation's number (``round``; 0: the initial model).
    updates : int
        Updates applied so far (the model's version).
    wall_seconds : float
        Seconds since training started.
    central : dict
        The central evaluation (``global``).
    local : dict or None
        The nodes' own evaluation (the last record only).
    federated : dict or None
        The node-measured figures of that evaluation.
    window : list of dict
        Each reply handled (or message given up) since the previous record: its :class:`ClientRound`
        entry with the dispatch, and for an applied update its staleness, overlap, weight and
        version (``clients``).
    nodes_in, nodes_out : list of dict
        Nodes discovered, and nodes left out or departed, since the previous record.
    server_seconds : float
        Seconds the server spent building messages, applying updates and evaluating since the
        previous record.
    round_seconds : float
        Wall-clock seconds since the previous record.
    """
    applied = [c for c in window if c["status"] == "ok"]
    return {
        "round": evaluation,
        "mode": "async",
        "updates": updates,
        "wall_seconds": wall_seconds,
        **_evaluation_entries(central, local, federated),
        "replies": len(applied),
        "sent": len(window),
        "clients": window,
        "nodes_in": nodes_in,
        "nodes_out": nodes_out,
        **_staleness_entries(applied),
        "server_seconds": server_seconds,
        "round_seconds": round_seconds,
    }


def _evaluation_entries(
    central: dict[str, Any], local: dict[str, float] | None, federated: dict[str, Any] | None
) -> dict[str, Any]:
    """A record's evaluations, in the order both kinds of record keep them: ``global``, ``local``,
    ``federated``.

    Parameters
    ----------
    central : dict
        The central evaluation on the server's test set (``global``).
    local : dict or None
        The nodes' example-weighted accuracy and loss on their own test splits (``local``; ``None``
        when the record has no client evaluation).
    federated : dict or None
        The node-measured figures of that evaluation (``federated``).
    """
    return {"global": central, "local": local, "federated": federated}


def _client_entries(clients: Mapping[int, ClientRound], eligible: int) -> dict[str, Any]:
    """A synchronous round's ``replies`` (the ``ok`` entries), ``sent``, ``eligible`` and
    ``clients``.

    Parameters
    ----------
    clients : Mapping[int, ClientRound]
        The entry of every client sent a TRAIN message.
    eligible : int
        Nodes that could train this round.
    """
    return {
        "replies": sum(c.status == "ok" for c in clients.values()),
        "sent": len(clients),
        "eligible": eligible,
        "clients": [asdict(c) for c in clients.values()],
    }


def _staleness_entries(applied: list[dict[str, Any]]) -> dict[str, Any]:
    """An asynchronous record's ``staleness_max`` and ``staleness_mean`` (0 when none applied).

    Parameters
    ----------
    applied : list of dict
        The window's entries of the updates applied since the previous record.
    """
    return {
        "staleness_max": max((c["staleness"] for c in applied), default=0),
        "staleness_mean": float(np.mean([c["staleness"] for c in applied])) if applied else 0.0,
    }


def progress_line(
    record: dict[str, Any], num_rounds: int, earlier_seconds: Iterable[float] = ()
) -> str:
    """One human-readable line per round, ending with an estimate of the time left.

    Parameters
    ----------
    record : dict
        The round's record (what ``on_round`` receives).
    num_rounds : int
        The last round of the run.
    earlier_seconds : Iterable[float]
        ``round_seconds`` of the rounds this process ran before this one. The time left is the mean
        over them and this round, times the rounds still to run (``~N s left``; left out after the
        last round, and while no round time has been measured).
    """
    g = global_figures(record) or {}
    on_nodes = g.get("source") == NODES_SOURCE  # no server test set: the nodes' own test splits
    acc, loss = (float("nan") if g.get(k) is None else g[k] for k in ("accuracy", "loss"))
    levels = " ".join(f"{k}:{v['accuracy']:.3f}" for k, v in (g.get("per_capacity") or {}).items())
    local = record.get("local")
    own = ((record.get("federated") or {}).get("per_capacity") or {}).items()
    adapted = " ".join(
        f"{k}:{v['accuracy']:.3f}->{v['adapted_accuracy']:.3f}"
        for k, v in own
        if v and "adapted_accuracy" in v
    )
    down = sum(c["bytes_down"] for c in record["clients"]) / 1024
    up = sum(c["bytes_up"] for c in record["clients"]) / 1024
    spent = [c["dp_epsilon"] for c in record["clients"] if c.get("dp_epsilon") is not None]
    seconds = [*earlier_seconds, record["round_seconds"]]
    mean, remaining = sum(seconds) / len(seconds), num_rounds - record["round"]
    return (
        f"[round {record['round']}/{num_rounds}] {'on nodes: ' if on_nodes else ''}"
        f"global acc {acc:.4f} loss {loss:.4f} | per capacity {levels or '-'}"
        + (f" | local acc {local['accuracy']:.4f}" if local else "")
        + (f" | adapted {adapted}" if adapted else "")
        + f" | replies {record['replies']}/{record['sent']} | down {down:.1f} KiB up {up:.1f} KiB"
        + (f" | epsilon spent up to {max(spent):.2f}" if spent else "")
        + f" | {record['round_seconds']:.1f} s"
        + (f" | ~{mean * remaining:.0f} s left" if remaining > 0 and mean > 0 else "")
    )


class RoundProgress:
    """Logs each synchronous round's :func:`progress_line`, its time left estimated from the rounds
    so far.

    Parameters
    ----------
    num_rounds : int
        The last round of the run.
    """

    def __init__(self, num_rounds: int) -> None:
        self.num_rounds = num_rounds
        self.seconds: list[float] = []  # round_seconds of the rounds logged so far

    def log(self, record: dict[str, Any]) -> None:
        """Log the round's line, then count its time toward the next estimate."""
        log(INFO, "%s", progress_line(record, self.num_rounds, self.seconds))
        self.seconds.append(record["round_seconds"])


def update_line(entry: dict[str, Any], applied: int, total: int, seconds: float) -> str:
    """One progress line per applied asynchronous update.

    Parameters
    ----------
    entry : dict
        The update's entry of the window (:func:`async_record`'s ``clients``).
    applied, total : int
        Updates applied so far, and the run's total.
    seconds : float
        Wall-clock seconds since training started.
    """
    return (
        f"[update {applied}/{total}] node {entry['node_id']} capacity {entry['capacity']:g} "
        f"density {entry['density']:.3f} staleness {entry['staleness']} overlap "
        f"{entry['overlap']:.2f} weight {entry['weight']:.3f} | {seconds:.1f} s"
    )
