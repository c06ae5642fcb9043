"""The ServerApp: builds the global model and runs the run's method through the submodel
strategy."""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path

import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from common.config.parse import parse_run_config
from common.training.device import pick_device
from server.federation import build_federation
from server.persistence import (
    CHECKPOINT,
    MetricsLog,
    atomic_write,
    load_checkpoint,
    save_checkpoint,
    save_model,
)
from server.restart_log import last_recorded_round, note_resume
from server.resume_check import check_resume
from server.round_log import ROUNDS_JSONL, RoundLog
from server.tensorboard_log import TENSORBOARD_DIR, TensorBoardLog, check_tensorboard

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config."""
    cfg = parse_run_config(context.run_config)
    check_tensorboard(cfg)  # a missing optional package is refused before anything is built
    results = Path(cfg.results_dir).expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        # A missing or damaged checkpoint or metrics.json is refused, naming the file, before
        # anything is built; starting over instead would overwrite the earlier rounds' metrics.json.
        check_resume(results, cfg)
    federation = build_federation(cfg, pick_device("auto"))
    strategy, method, layout, x0 = (
        federation.strategy,
        federation.method,
        federation.strategy.layout,
        federation.x0,
    )
    checkpoint = results / CHECKPOINT
    done = None
    if cfg.resume:
        done, x0, state = load_checkpoint(checkpoint)
        if x0.shape != (layout.size,):
            raise ValueError(
                f"{checkpoint} holds a model of {x0.size} parameters, this run builds {layout.size}"
            )
        method.load_state(state)
        strategy.first_round = done + 1
        log(INFO, "resuming after round %d from %s", done, checkpoint)
    metrics = MetricsLog(
        results / "metrics.json",
        {
            **cfg.flat(),
            "upload_encoding": method.upload_encoding(cfg),
            "d": layout.size,
            "results_dir": str(results),
        },
        keep_until=done,
    )
    rounds = RoundLog(results / ROUNDS_JSONL, keep_until=done)  # one line per round, for `tail -f`
    if (
        done is not None
    ):  # how the run came to be resumed: the launcher's record stamped, or one of its own
        restart = note_resume(
            metrics.doc.setdefault("restarts", []), done, last_recorded_round(results), time.time()
        )
        rounds.note_restart(restart)
    tensorboard = (
        TensorBoardLog(results / TENSORBOARD_DIR, resume_after=done) if cfg.tensorboard else None
    )

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
        strategy.start(
            grid,
            strategy.to_arrays(x0),
            cfg.num_rounds,
            cfg.round_timeout,
            evaluate_fn=federation.evaluate_fn,
        )
    finally:
        if tensorboard is not None:
            tensorboard.close()
    final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(strategy.x).items()}
    save_model(results / "model.pt", final)
    state = method.state_bytes()
    if state:
        atomic_write(results / method.state_file, state)
    log(
        INFO,
        "saved %s%s",
        results / "model.pt",
        f" and {results / method.state_file}" if state else "",
    )
