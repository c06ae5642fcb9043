"""The ClientApp: answers QUERY (profile), TRAIN and EVALUATE messages; the run's method does the
work."""

from __future__ import annotations

import time
from logging import ERROR, INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from numpy.typing import NDArray

from client.bench_attack import attacks, poisoned_data, poisoned_update
from client.capacity_probe import cached_probe
from client.local_data import LocalData, cache_dir, load_local_data
from client.privacy import charge_reply, check_budget, open_ledger, private_config
from client.replies import train_records, train_reply
from common.config.node import NodeConfig, parse_node_config
from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.methods import create_method
from common.methods.contract.client_side import ClientMethod
from common.methods.contract.payloads import LocalUpdate, Received
from common.methods.specs.privacy import PRIVACY_KEYS
from common.training.device import pick_device
from common.training.evaluation import evaluate
from common.training.loop import round_train_config
from common.training.peak_memory import PeakRSS
from common.training.personalisation import adapt_config
from common.wire import protocol as P

app = ClientApp()


def _setup(context: Context) -> tuple[RunConfig, NodeConfig, LocalData]:
    run = parse_run_config(context.run_config)
    node = parse_node_config(context.node_config, run.capacity_mix)
    return run, node, load_local_data(run, node)


def received(msg: Message) -> Received:
    """The method-independent view of a TRAIN / EVALUATE download."""
    cfg = msg.content.config_records[P.SUBMODEL_CONFIG]
    records = {
        name: {n: a.numpy() for n, a in record.items()}
        for name, record in msg.content.array_records.items()
    }
    return Received(
        records, str(cfg["mask-kind"]), str(cfg["mask-digest"]), int(cfg["d"]), int(cfg["round"])
    )


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report capacity, device and local example counts (or the configuration error)."""
    key: dict[
        str, str
    ] = {}  # the node's client key, once its node config is known: the server records who left
    try:
        run = parse_run_config(context.run_config)
        node = parse_node_config(context.node_config, run.capacity_mix)
        key["client-key"] = node.key
        data = load_local_data(run, node)
        device = pick_device(node.device)
        probe = cached_probe(device, cache_dir()) if node.capacity is None else None
    except Exception as err:  # a misconfigured node reports why instead of failing silently
        reason = f"{type(err).__name__}: {err}"
        # In the node's own log too: the server leaves this node out, and it would otherwise sit
        # idle silently.
        log(
            ERROR, "this node cannot take part in the run, the server will leave it out: %s", reason
        )
        return Message(
            RecordDict({P.PROFILE: ConfigRecord({"error": reason, **key})}), reply_to=msg
        )
    capacity = probe.capacity if probe else node.capacity
    metrics = MetricRecord(
        {
            "capacity": capacity,
            "num-train-examples": len(data.train),
            "num-test-examples": len(data.test),
            **(
                {"probe-memory-gib": probe.memory_gib, "probe-gflops": probe.gflops}
                if probe
                else {}
            ),
        }
    )
    info = {
        "device": str(device),
        "client-key": node.key,
        "capacity-source": "auto" if probe else "node-config",
    }
    if node.capacity_kind is not None:
        info["capacity-kind"] = node.capacity_kind
    if data.report is not None:  # the node's own data: what was read, and what was skipped and why
        info["data"] = data.report.summary()
        metrics["skipped-examples"] = sum(data.report.skipped.values())
        level = WARNING if data.report.skipped or data.report.notes else INFO
        log(level, "own data at %s: %s", node.data_path, data.report.summary())
    content = RecordDict({P.PROFILE: metrics, "device": ConfigRecord(info)})
    if P.OPENING in msg.content.array_records:
        for name, record in opening_warmup(
            msg, run, node, data, float(capacity), context.run_id
        ).items():
            content[name] = record
    return Message(content, reply_to=msg)


def measured_train(
    method: ClientMethod,
    got: Received,
    run: RunConfig,
    node: NodeConfig,
    data: LocalData,
    run_id: int,
) -> tuple[LocalUpdate, float | None, float, dict[str, float]]:
    """``method.client_train`` on ``got`` with the node's settings for ``got.round``, measured.

    Returns the update (under ``dp-epsilon``: trained with DP-SGD and charged to the node's ledger,
    which raises :class:`~common.privacy.accountant.BudgetSpent` when the budget is spent), the
    process's peak resident MiB while it ran (``None`` where that cannot be read), its CPU seconds
    (all threads) and the metrics the privacy ledger adds (none without ``dp-epsilon``).
    """
    cpu0 = time.process_time()
    cfg = round_train_config(run, node, got.round)
    ledger = open_ledger(run, node, run_id) if run.options(PRIVACY_KEYS.name).enabled else None
    if ledger is not None:
        cfg = private_config(cfg, method, run, len(data.train))
        check_budget(ledger, cfg, len(data.train))
    attacker = attacks(run, node)
    train = poisoned_data(run, data.train) if attacker else data.train
    with PeakRSS() as peak:
        update = method.client_train(got, train, cfg, pick_device(node.device))
    if attacker:
        update = poisoned_update(run, update)
    extra = (
        {}
        if ledger is None
        else charge_reply(ledger, update, method, run, node, cfg, len(data.train), run_id)
    )
    return update, peak.peak_mib if peak.peak_bytes else None, time.process_time() - cpu0, extra


def opening_warmup(
    msg: Message, run: RunConfig, node: NodeConfig, data: LocalData, capacity: float, run_id: int
) -> RecordDict:
    """The round-0 TRAIN reply's records for a QUERY carrying the initial model: the node's warm-up
    Fisher.

    The node builds the round-0 download it would have been sent (:meth:`opening_received`) and
    measures its Fisher there as a round-0 TRAIN message would have it do. When it cannot, it says
    why (``opening-error``) and the server ranks it by the prior until its first refresh. When the
    QUERY also asks for round 1 (``round-one``), :func:`opening_round_one` adds that round's reply.
    """
    try:
        method = create_method(run)
        x0 = msg.content.array_records[P.OPENING][P.VALUES].numpy()
        got = method.opening_received(data.train, x0, capacity)
        update, peak_mib, cpu_seconds, extra = measured_train(method, got, run, node, data, run_id)
    except (
        Exception
    ) as err:  # the profile still goes back: the node takes part, ranked by the prior at first
        reason = f"{type(err).__name__}: {err}"
        log(WARNING, "no warm-up Fisher from the discovery message: %s", reason)
        return RecordDict({P.OPENING_ERROR: ConfigRecord({P.OPENING_ERROR: reason})})
    records = train_records(update, 0, got.digest, peak_mib, cpu_seconds, extra)
    if P.ROUND_ONE in msg.content.config_records:
        records.update(
            opening_round_one(method, x0, capacity, got, update, run, node, data, run_id)
        )
    return records


def opening_round_one(
    method: ClientMethod,
    x0: NDArray[np.float32],
    capacity: float,
    opening: Received,
    warm_up: LocalUpdate,
    run: RunConfig,
    node: NodeConfig,
    data: LocalData,
    run_id: int,
) -> dict[str, ConfigRecord | ArrayRecord | MetricRecord]:
    """Round 1 trained in the discovery exchange: the records of its TRAIN reply, under the
    ``round-one-*`` names.

    The submodel is the one the server will rank by the warm-up Fisher just measured
    (:meth:`~common.methods.contract.client_side.ClientMethod.round_one_received`); when it cannot
    be built or trained, the reason (``round-one-error``), and the server leaves the node out of
    round 1.
    """
    try:
        got = method.round_one_received(data.train, x0, capacity, opening, warm_up)
        update, peak_mib, cpu_seconds, extra = measured_train(method, got, run, node, data, run_id)
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        log(WARNING, "round 1 not trained with the discovery message: %s", reason)
        return {P.ROUND_ONE_ERROR: ConfigRecord({P.ROUND_ONE_ERROR: reason})}
    time.sleep(
        node.bench_delay_s * run.local_epochs
    )  # test/benchmark knob: emulate a slower device
    one = train_records(update, 1, got.digest, peak_mib, cpu_seconds, extra)
    return {
        P.ROUND_ONE_UPDATE: one[P.UPDATE],
        P.ROUND_ONE_METRICS: one[P.METRICS],
        P.ROUND_ONE_META: one[P.META],
    }


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received submodel with the run's method; reply with its update and metrics."""
    run, node, data = _setup(context)
    got = received(msg)
    update, peak_mib, cpu_seconds, extra = measured_train(
        create_method(run), got, run, node, data, context.run_id
    )
    time.sleep(
        node.bench_delay_s * run.local_epochs
    )  # test/benchmark knob: emulate a slower device
    return train_reply(msg, update, got.round, got.digest, peak_mib, cpu_seconds, extra)


@app.evaluate()
def evaluate_submodel(msg: Message, context: Context) -> Message:
    """Evaluate the received submodel on the local test split; with ``adapt-steps``, also after
    adapting it."""
    run, node, data = _setup(context)
    got = received(msg)
    method, device = create_method(run), pick_device(node.device)
    loss, acc = evaluate(method.client_model(got, data.train), data.test, device)
    metrics = {"num-examples": len(data.test), "eval-loss": loss, "eval-acc": acc}
    if run.adapt_steps > 0:
        cfg = adapt_config(run, node, got.round)
        adapted = method.client_adapt(got, data.train, run.adapt_steps, cfg, device)
        metrics[P.ADAPTED_LOSS], metrics[P.ADAPTED_ACC] = evaluate(adapted, data.test, device)
    content = RecordDict(
        {
            P.METRICS: MetricRecord(metrics),
            P.META: ConfigRecord({"round": got.round, "mask-digest": got.digest}),
        }
    )
    return Message(content, reply_to=msg)
