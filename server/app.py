"""The ServerApp: builds the global model and runs the run's method through the submodel
strategy."""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from numpy.typing import NDArray

from common.config.parse import parse_run_config
from common.training.device import pick_device
from server.federation import Federation, build_federation
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
    strategy, x0 = federation.strategy, federation.x0
    checkpoint = results / CHECKPOINT
    done = None
    if cfg.resume:
        done, x0 = _resume(checkpoint, federation)
    metrics, rounds, tensorboard = _open_logs(results, federation, done)

    def after_round(record: dict) -> None:
        metrics.append(record)
        rounds.append(record)
        if tensorboard is not None:
            tensorboard.append(record)
        rnd = record["round"]
        if rnd > 0 and (rnd % cfg.checkpoint_every == 0 or rnd == cfg.num_rounds):
            save_checkpoint(checkpoint, rnd, strategy.x, strategy.state_bytes())

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
    _save_final(results, federation)


def _resume(checkpoint: Path, federation: Federation) -> tuple[int, NDArray[np.float32]]:
    """Restore a resumed run's method state and first round from its checkpoint.

    Parameters
    ----------
    checkpoint : Path
        The run's checkpoint file, already checked by ``check_resume``.
    federation : Federation
        The freshly built federation: its method takes the checkpoint's state and its strategy
        starts at the round after the checkpoint's.

    Returns
    -------
    tuple[int, NDArray[float32]]
        The last round the checkpoint holds, and the global model (flat) after it.
    """
    strategy, layout = federation.strategy, federation.strategy.layout
    done, x0, state = load_checkpoint(checkpoint)
    if x0.shape != (layout.size,):
        raise ValueError(
            f"{checkpoint} holds a model of {x0.size} parameters, this run builds {layout.size}"
        )
    strategy.load_state(state)
    strategy.first_round = done + 1
    log(INFO, "resuming after round %d from %s", done, checkpoint)
    return done, x0


def _open_logs(
    results: Path, federation: Federation, done: int | None
) -> tuple[MetricsLog, RoundLog, TensorBoardLog | None]:
    """The run's per-round logs, keeping a resumed run's earlier rounds and noting its restart.

    Parameters
    ----------
    results : Path
        The run's results folder (resolved, already created).
    federation : Federation
        The built federation: its config, method and layout are written in ``metrics.json``.
    done : int or None
        The last round a resumed run's checkpoint holds; ``None`` when the run starts afresh.

    Returns
    -------
    tuple[MetricsLog, RoundLog, TensorBoardLog or None]
        ``metrics.json``, ``rounds.jsonl`` and, when the config asks for it, the TensorBoard log.
    """
    cfg, method, layout = federation.cfg, federation.method, federation.strategy.layout
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
    # How the run came to be resumed: the launcher's record stamped, or one of its own.
    if done is not None:
        restart = note_resume(
            metrics.doc.setdefault("restarts", []), done, last_recorded_round(results), time.time()
        )
        rounds.note_restart(restart)
    tensorboard = (
        TensorBoardLog(results / TENSORBOARD_DIR, resume_after=done) if cfg.tensorboard else None
    )
    return metrics, rounds, tensorboard


def _save_final(results: Path, federation: Federation) -> None:
    """Save the final global model (every cluster's, in a clustered run) and, when the method keeps
    any, its state.

    Parameters
    ----------
    results : Path
        The run's results folder: ``model.pt`` (``model-cluster-<c>.pt`` for the other clusters)
        and the method's ``state_file`` go there.
    federation : Federation
        The federation whose strategy has finished its rounds.
    """
    strategy, method, layout = federation.strategy, federation.method, federation.strategy.layout
    for name, x in strategy.final_models().items():
        final = {n: torch.from_numpy(v.copy()) for n, v in layout.unflatten(x).items()}
        save_model(results / name, final)
    state = method.state_bytes()
    if state:
        atomic_write(results / method.state_file, state)
    log(
        INFO,
        "saved %s%s",
        results / "model.pt",
        f" and {results / method.state_file}" if state else "",
    )
