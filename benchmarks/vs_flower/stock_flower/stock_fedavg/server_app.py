"""stock-fedavg: the ServerApp, as Flower's template writes it (FedAvg over every connected node).

Two additions, both for the benchmark: central evaluation on the product's test set after every
round (Flower's ``evaluate_fn``), and ``metrics.json`` in ``results-dir``: one record per evaluation
with its Unix time, each node's reply metrics of the round (CPU seconds, bytes) and the server's
seconds of aggregation and evaluation (wall-clock and CPU), for the emulated fleet time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from stock_fedavg.task import product_settings, server_model, test

app = ServerApp()


class TimedFedAvg(FedAvg):
    """Flower's FedAvg, keeping each round's reply metrics per node and timing its aggregation."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.replies: dict[
            int, list[dict[str, float]]
        ] = {}  # round -> each replying node's metrics
        self.aggregate_seconds: dict[int, float] = {}
        self.aggregate_cpu_seconds: dict[int, float] = {}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's aggregation, timed; the replies' metrics are kept."""
        replies = list(replies)
        t0, c0 = time.perf_counter(), time.process_time()
        out = super().aggregate_train(server_round, replies)
        self.aggregate_seconds[server_round] = time.perf_counter() - t0
        self.aggregate_cpu_seconds[server_round] = time.process_time() - c0
        self.replies[server_round] = [
            {k: float(v) for k, v in r.content["metrics"].items()}
            for r in replies
            if r.has_content()
        ]
        return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-rounds`` of FedAvg from the product's initial weights; write ``metrics.json``."""
    rc = context.run_config
    run = product_settings(rc)
    model, testset = server_model(run)
    strategy = TimedFedAvg(
        fraction_train=float(rc["fraction-train"]),
        fraction_evaluate=0.0,
        min_train_nodes=int(rc["min-nodes"]),
        min_available_nodes=int(rc["min-nodes"]),
    )
    records: list[dict[str, Any]] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        t0, c0 = time.perf_counter(), time.process_time()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(model, testset)
        records.append(
            {
                "round": server_round,
                "global": {"accuracy": acc, "loss": loss},
                "time": time.time(),
                "clients": strategy.replies.pop(server_round, []),
                "server_seconds": strategy.aggregate_seconds.get(server_round, 0.0)
                + time.perf_counter()
                - t0,
                "server_cpu_seconds": strategy.aggregate_cpu_seconds.get(server_round, 0.0)
                + time.process_time()
                - c0,
            }
        )
        log(
            INFO, "[round %d/%d] global acc %.4f", server_round, int(rc["num-rounds"]), acc
        )  # the launcher echoes it
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        train_config=ConfigRecord({"lr": float(rc["lr"])}),
        num_rounds=int(rc["num-rounds"]),
        evaluate_fn=evaluate_fn,
    )
    out = Path(str(rc["results-dir"])).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"config": dict(rc), "rounds": records}, indent=1))
