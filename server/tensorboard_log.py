"""TensorBoard scalars of each round under ``<results-dir>/tensorboard/`` (run-config key
``tensorboard``).

Off by default: the ``tensorboard`` package is an extra (``pip install 'fibos-fl[tensorboard]'``),
and ``torch.utils.tensorboard`` is imported only when a run asks for it. :func:`check_tensorboard`
refuses ``tensorboard=true`` where the package is missing, before any process starts (the local
launcher) or before anything is built (the ServerApp), instead of failing after the first round.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config.schema import ConfigError

if TYPE_CHECKING:
    from common.config.run import RunConfig

TENSORBOARD_DIR = "tensorboard"
INSTALL_HINT = "pip install 'fibos-fl[tensorboard]'"


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (what ``torch.utils.tensorboard`` writes through) can be
    imported."""
    return importlib.util.find_spec("tensorboard") is not None


def check_tensorboard(cfg: RunConfig) -> None:
    """Refuse ``tensorboard=true`` when the ``tensorboard`` package is not installed here.

    Parameters
    ----------
    cfg : RunConfig
        The run config; nothing is checked when its ``tensorboard`` key is false.

    Raises
    ------
    ConfigError
        ``tensorboard=true`` and the package is missing; the message says how to install it.
    """
    if cfg.tensorboard and not tensorboard_available():
        raise ConfigError(
            f"tensorboard=true: the tensorboard package is not installed; {INSTALL_HINT}, or set "
            "tensorboard=false"
        )


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one round record (tag -> value); what the record lacks is left
    out.

    Parameters
    ----------
    record : dict
        A round record as ``SubmodelStrategy.on_round`` receives it (round 0 has no clients nor
        timings; a round without federated evaluation has no ``local``).

    Tags: ``global/accuracy``, ``global/loss``, ``local/accuracy``, ``bytes/down`` and ``bytes/up``
    (summed over the round's clients), ``time/round_seconds``, and ``per_capacity/<gamma>/accuracy``
    for each capacity level of the central evaluation (``global.per_capacity``); from the nodes' own
    test splits (``federated``): ``federated/accuracy`` and ``federated/loss`` (the full model, on
    the nodes that hold it) and ``federated/per_capacity/<gamma>/accuracy``.
    """
    out: dict[str, float] = {}
    g = record.get("global") or {}
    for key in ("accuracy", "loss"):
        if g.get(key) is not None:
            out[f"global/{key}"] = float(g[key])
    local = record.get("local") or {}
    if local.get("accuracy") is not None:
        out["local/accuracy"] = float(local["accuracy"])
    clients = record.get("clients") or []
    if clients:
        out["bytes/down"] = float(sum(c.get("bytes_down", 0) for c in clients))
        out["bytes/up"] = float(sum(c.get("bytes_up", 0) for c in clients))
    if record.get("round_seconds") is not None:
        out["time/round_seconds"] = float(record["round_seconds"])
    for gamma, level in (g.get("per_capacity") or {}).items():
        if level.get("accuracy") is not None:
            out[f"per_capacity/{gamma}/accuracy"] = float(level["accuracy"])
    federated = record.get("federated") or {}
    if federated.get("full_model"):
        out["federated/accuracy"] = float(federated["full_model"]["accuracy"])
        out["federated/loss"] = float(federated["full_model"]["loss"])
    for gamma, level in (federated.get("per_capacity") or {}).items():
        if level:
            out[f"federated/per_capacity/{gamma}/accuracy"] = float(level["accuracy"])
    return out


class TensorBoardLog:
    """Writes each round's scalars (:func:`round_scalars`) as TensorBoard events, at step = the
    round number.

    Parameters
    ----------
    folder : Path
        The event files' folder, ``<results-dir>/tensorboard`` (created if missing).
    resume_after : int, optional
        A resumed run's checkpoint round: events of later rounds already written by the interrupted
        run are hidden from TensorBoard (the writer's ``purge_step``), as ``metrics.json`` drops
        those rounds. ``None``: a fresh run.

    Each round's events are flushed to disk as the round ends, so ``tensorboard --logdir`` shows it
    at once.
    """

    def __init__(self, folder: Path, resume_after: int | None = None) -> None:
        from torch.utils.tensorboard import (
            SummaryWriter,
        )  # here: torch's tensorboard needs the optional package

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        purge = None if resume_after is None else resume_after + 1
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def append(self, record: dict[str, Any]) -> None:
        """Write the scalars of one round record and flush them.

        Parameters
        ----------
        record : dict
            A round record with its ``round`` number (the TensorBoard step).
        """
        step = int(record["round"])
        for tag, value in round_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
