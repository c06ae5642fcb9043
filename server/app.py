"""The ServerApp: builds the global model and runs the run's method through the submodel strategy."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from common.config import parse_run_config
from common.datasets import load_run_dataset
from common.device import pick_device
from common.evaluation import CentralEvaluator
from common.methods import create_method
from common.models import build_run_model, model_layout, trainable_arrays
from server.async_strategy import AsyncSubmodelStrategy
from server.persistence import CHECKPOINT, MetricsLog, atomic_write, load_checkpoint, save_checkpoint, save_model
from server.resume_check import check_resume
from server.strategy import EvaluateFn, SubmodelStrategy

app = ServerApp()


def central_evaluate_fn(evaluator: CentralEvaluator) -> EvaluateFn:
    """Flower's ``evaluate_fn`` over the server's test set: accuracy and loss of the arrays given."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        flat = evaluator.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})
        loss, acc = evaluator(flat)
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate_fn


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config."""
    cfg = parse_run_config(context.run_config)
    results = Path(cfg.results_dir).expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        # A missing or damaged checkpoint or metrics.json is refused, naming the file, before anything is built;
        # starting over instead would overwrite the earlier rounds' metrics.json.
        check_resume(results, cfg)
    split = load_run_dataset(cfg)
    method = create_method(cfg)
    model = method.federated_model(build_run_model(cfg, split.train.num_classes, split.train.in_channels))
    layout = model_layout(model)
    evaluator = CentralEvaluator(
        method.federated_model(build_run_model(cfg, split.train.num_classes, split.train.in_channels)),
        layout,
        split.test,
        pick_device("auto"),
    )
    x0 = layout.flatten(trainable_arrays(model))
    strategy_class = AsyncSubmodelStrategy if method.asynchronous else SubmodelStrategy
    strategy = strategy_class(cfg, layout, method)
    checkpoint = results / CHECKPOINT
    done = None
    if cfg.resume:
        done, x0, state = load_checkpoint(checkpoint)
        if x0.shape != (layout.size,):
            raise ValueError(f"{checkpoint} holds a model of {x0.size} parameters, this run builds {layout.size}")
        method.load_state(state)
        strategy.first_round = done + 1
        log(INFO, "resuming after round %d from %s", done, checkpoint)
    metrics = MetricsLog(
        results / "metrics.json",
        {**cfg.flat(), "upload_encoding": cfg.upload_encoding, "d": layout.size, "results_dir": str(results)},
        keep_until=done,
    )

    def after_round(record: dict) -> None:
        metrics.append(record)
        rnd = record["round"]
        if rnd > 0 and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.num_rounds):
            save_checkpoint(checkpoint, rnd, strategy.x, method.state_bytes())

    strategy.on_round = after_round
    log(INFO, "results -> %s", results)
    strategy.start(
        grid, strategy.to_arrays(x0), cfg.num_rounds, cfg.round_timeout, evaluate_fn=central_evaluate_fn(evaluator)
    )
    final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(strategy.x).items()}
    save_model(results / "model.pt", final)
    state = method.state_bytes()
    if state:
        atomic_write(results / method.state_file, state)
    log(INFO, "saved %s%s", results / "model.pt", f" and {results / method.state_file}" if state else "")
