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
from server.async_rounds import AsyncFedGMR
from server.evaluation import CentralEvaluator
from server.fisher_state import FisherState
from server.persistence import CHECKPOINT, MetricsLog, atomic_write, load_checkpoint, save_checkpoint, save_model
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
    x0 = layout.flatten(trainable_arrays(model))
    strategy = FisherSubmodelStrategy(cfg, layout, evaluate_fn=evaluator)
    checkpoint = results / CHECKPOINT
    done = None
    if cfg.resume and checkpoint.exists():
        done, x0, fisher = load_checkpoint(checkpoint)
        if x0.shape != (layout.size,):
            raise ValueError(f"{checkpoint} holds a model of {x0.size} parameters, this run builds {layout.size}")
        strategy.fisher = FisherState.from_bytes(fisher)
        strategy.first_round = done + 1
        log(INFO, "resuming after round %d from %s", done, checkpoint)
    elif cfg.resume:
        log(INFO, "resume=true but %s does not exist: starting from round 1", checkpoint)
    metrics = MetricsLog(
        results / "metrics.json",
        {**asdict(cfg), "d": layout.size, "results_dir": str(results)},
        keep_until=done,
    )

    def after_round(record: dict) -> None:
        metrics.append(record)
        if record["round"] > 0:
            save_checkpoint(checkpoint, record["round"], strategy.x, strategy.fisher.to_bytes())

    strategy.on_round = after_round
    log(INFO, "results -> %s", results)
    if cfg.method == "fedgmr" and cfg.gmr_mode == "async":
        async_run = AsyncFedGMR(strategy, grid, after_round)
        async_run.run(x0, cfg.num_rounds, cfg.round_timeout)
    else:
        strategy.start(grid, strategy.to_arrays(x0), cfg.num_rounds, cfg.round_timeout)
    final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(strategy.x).items()}
    save_model(results / "model.pt", final)
    atomic_write(results / "fisher_state.npz", strategy.fisher.to_bytes())
    log(INFO, "saved %s and %s", results / "model.pt", results / "fisher_state.npz")
