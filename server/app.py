"""The ServerApp: builds the global model and runs the run's method through the submodel strategy."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from numpy.typing import NDArray

from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.data.datasets import load_server_data
from common.methods import create_method
from common.methods.base import Method
from common.models.architectures import build_run_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.training.device import pick_device
from common.training.evaluation import CentralEvaluator
from server.async_strategy import AsyncSubmodelStrategy
from server.persistence import CHECKPOINT, MetricsLog, atomic_write, load_checkpoint, save_checkpoint, save_model
from server.resume_check import check_resume
from server.round_log import ROUNDS_JSONL, RoundLog
from server.strategy import EvaluateFn, SubmodelStrategy
from server.tensorboard_log import TENSORBOARD_DIR, TensorBoardLog, check_tensorboard

app = ServerApp()


def central_evaluate_fn(evaluator: CentralEvaluator) -> EvaluateFn:
    """Flower's ``evaluate_fn`` over the server's test set: accuracy and loss of the arrays given."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        flat = evaluator.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})
        loss, acc = evaluator(flat)
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate_fn


def global_model(
    cfg: RunConfig, method: Method, device: str
) -> tuple[NDArray[np.float32], ParamLayout, EvaluateFn | None]:
    """The run's initial global model (flat), its layout, and central evaluation on the server's test set.

    The evaluation is ``None`` when the server holds no test set (the nodes' own data without
    ``test-data-path``): the run's global figures then come from the nodes' evaluation rounds.
    """
    data = load_server_data(cfg)
    model = method.federated_model(build_run_model(cfg, data.num_classes, data.in_channels))
    layout = model_layout(model)
    x0 = layout.flatten(trainable_arrays(model))
    if data.test is None:
        log(INFO, "no server test set: the global figures come from the nodes' evaluation (eval-every)")
        return x0, layout, None
    evaluator = CentralEvaluator(
        method.federated_model(build_run_model(cfg, data.num_classes, data.in_channels)), layout, data.test, device
    )
    return x0, layout, central_evaluate_fn(evaluator)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config."""
    cfg = parse_run_config(context.run_config)
    check_tensorboard(cfg)  # a missing optional package is refused before anything is built
    results = Path(cfg.results_dir).expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        # A missing or damaged checkpoint or metrics.json is refused, naming the file, before anything is built;
        # starting over instead would overwrite the earlier rounds' metrics.json.
        check_resume(results, cfg)
    method = create_method(cfg)
    x0, layout, evaluate_fn = global_model(cfg, method, pick_device("auto"))
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
        {**cfg.flat(), "upload_encoding": method.upload_encoding(cfg), "d": layout.size, "results_dir": str(results)},
        keep_until=done,
    )
    rounds = RoundLog(results / ROUNDS_JSONL, keep_until=done)  # one line per round, for `tail -f`
    tensorboard = TensorBoardLog(results / TENSORBOARD_DIR, resume_after=done) if cfg.tensorboard else None

    def after_round(record: dict) -> None:
        metrics.append(record)
        rounds.append(record)
        if tensorboard is not None:
            tensorboard.append(record)
        rnd = record["round"]
        if rnd > 0 and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.num_rounds):
            save_checkpoint(checkpoint, rnd, strategy.x, method.state_bytes())

    strategy.on_round = after_round
    log(INFO, "results -> %s", results)
    try:
        strategy.start(grid, strategy.to_arrays(x0), cfg.num_rounds, cfg.round_timeout, evaluate_fn=evaluate_fn)
    finally:
        if tensorboard is not None:
            tensorboard.close()
    final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(strategy.x).items()}
    save_model(results / "model.pt", final)
    state = method.state_bytes()
    if state:
        atomic_write(results / method.state_file, state)
    log(INFO, "saved %s%s", results / "model.pt", f" and {results / method.state_file}" if state else "")
