"""The ServerApp: builds the global model and runs :class:`FisherSubmodelStrategy`."""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO
from pathlib import Path

import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from client.device import pick_device
from common.config import parse_run_config
from common.datasets import load_dataset
from common.models import build_model, model_layout, trainable_arrays
from server.evaluation import CentralEvaluator
from server.persistence import MetricsLog, atomic_write, save_model
from server.strategy import FisherSubmodelStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config."""
    cfg = parse_run_config(context.run_config)
    results = Path(cfg.results_dir).expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    split = load_dataset(cfg.dataset, cfg.test_fraction, cfg.seed, cfg.data_path)
    model = build_model(cfg.model, split.train.num_classes, split.train.in_channels, cfg.seed)
    layout = model_layout(model)
    evaluator = CentralEvaluator(
        build_model(cfg.model, split.train.num_classes, split.train.in_channels, cfg.seed),
        layout,
        split.test,
        pick_device("auto"),
    )
    metrics = MetricsLog(
        results / "metrics.json",
        {**asdict(cfg), "d": layout.size, "results_dir": str(results)},
    )
    strategy = FisherSubmodelStrategy(cfg, layout, evaluate_fn=evaluator, on_round=metrics.append)
    log(INFO, "results -> %s", results)
    strategy.start(
        grid,
        strategy.to_arrays(layout.flatten(trainable_arrays(model))),
        cfg.num_rounds,
        cfg.round_timeout,
    )
    final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(strategy.x).items()}
    save_model(results / "model.pt", final)
    atomic_write(results / "fisher_state.npz", strategy.fisher.to_bytes())
    log(INFO, "saved %s and %s", results / "model.pt", results / "fisher_state.npz")
