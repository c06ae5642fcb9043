"""The ClientApp: answers QUERY (profile), TRAIN and EVALUATE messages."""

from __future__ import annotations

import time

import numpy as np
from flwr.app import (
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from client.capacity_probe import cached_probe
from client.device import pick_device
from client.local_data import LocalData, cache_dir, load_local_data
from client.replies import train_reply
from client.structured_handlers import evaluate_structured, train_structured
from client.training import evaluate, round_train_config, train_masked
from common import protocol as P
from common.config import NodeConfig, RunConfig, parse_node_config, parse_run_config
from common.fisher_codec import encode_fisher
from common.layout import ParamLayout
from common.models import build_model, load_flat, model_layout
from common.protocol import decode_submodel

app = ClientApp()


def _setup(context: Context) -> tuple[RunConfig, NodeConfig, LocalData]:
    run = parse_run_config(context.run_config)
    node = parse_node_config(context.node_config, run.capacity_mix)
    return run, node, load_local_data(run, node)


def _model(run: RunConfig, data: LocalData):
    model = build_model(run.model, data.train.num_classes, data.train.in_channels, run.seed)
    return model, model_layout(model)


def _submodel(msg: Message, layout: ParamLayout) -> tuple[np.ndarray, np.ndarray, ConfigRecord]:
    arrays = msg.content.array_records[P.SUBMODEL]
    cfg = msg.content.config_records[P.SUBMODEL_CONFIG]
    if int(cfg["d"]) != layout.size:
        raise ValueError(f"server model has d={cfg['d']} but this node builds d={layout.size}: run configs differ")
    params, mask = decode_submodel(
        arrays[P.VALUES].numpy(),
        str(cfg["mask-kind"]),
        arrays[P.MASK].numpy(),
        layout.size,
    )
    return params, mask, cfg


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report capacity, device and local example counts (or the configuration error)."""
    try:
        run, node, data = _setup(context)
        device = pick_device(node.device)
        probe = cached_probe(device, cache_dir()) if node.capacity is None else None
    except Exception as err:  # a misconfigured node reports why instead of failing silently
        return Message(
            RecordDict({P.PROFILE: ConfigRecord({"error": f"{type(err).__name__}: {err}"})}),
            reply_to=msg,
        )
    metrics = MetricRecord(
        {
            "capacity": probe.capacity if probe else node.capacity,
            "num-train-examples": len(data.train),
            "num-test-examples": len(data.test),
            **({"probe-memory-gib": probe.memory_gib, "probe-gflops": probe.gflops} if probe else {}),
        }
    )
    info = {"device": str(device), "client-key": node.key, "capacity-source": "auto" if probe else "node-config"}
    return Message(RecordDict({P.PROFILE: metrics, "device": ConfigRecord(info)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received submodel; reply with the update, the Fisher payload and metrics."""
    run, node, data = _setup(context)
    if run.method == "cahfp":
        return train_structured(msg, run, node, data)
    model, layout = _model(run, data)
    params, mask, cfg = _submodel(msg, layout)
    server_round = int(cfg["round"])
    fisher_batches = run.fisher_batches if run.upload_encoding != "none" else -1
    tcfg = round_train_config(run, node, server_round, fisher_batches)
    result = train_masked(model, layout, params, mask, data.train, tcfg, pick_device(node.device))
    time.sleep(node.bench_delay_s * run.local_epochs)  # test/benchmark knob: emulate a slower device
    delta = (result.params[mask] - params[mask]).astype(np.float32)
    arrays = {
        P.DELTA: delta,
        **encode_fisher(result.fisher, mask, layout, run.upload_encoding),
    }
    return train_reply(
        msg,
        arrays,
        result.num_examples,
        result.loss,
        result.train_seconds,
        result.fisher_seconds,
        server_round,
        str(cfg["mask-digest"]),
        run.upload_encoding,
    )


@app.evaluate()
def evaluate_submodel(msg: Message, context: Context) -> Message:
    """Evaluate the received submodel on the local test split."""
    run, node, data = _setup(context)
    if run.method == "cahfp":
        return evaluate_structured(msg, run, node, data)
    model, layout = _model(run, data)
    params, _, cfg = _submodel(msg, layout)
    load_flat(model, layout, params)
    loss, acc = evaluate(model, data.test, pick_device(node.device))
    content = RecordDict(
        {
            P.METRICS: MetricRecord({"num-examples": len(data.test), "eval-loss": loss, "eval-acc": acc}),
            P.META: ConfigRecord({"round": int(cfg["round"]), "mask-digest": str(cfg["mask-digest"])}),
        }
    )
    return Message(content, reply_to=msg)
