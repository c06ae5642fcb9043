"""What ``resume=true`` reads, checked before anything starts: the checkpoint, ``metrics.json``, and
that they fit.

A resume continues a run from ``<results-dir>/checkpoint.npz`` and keeps the rounds of
``metrics.json`` up to the checkpoint's. A damaged file would otherwise surface only once the whole
federation is up, as an exception naming neither file, and a missing checkpoint would start the run
over and overwrite ``metrics.json``. The launcher calls :func:`check_resume` before it starts any
process; the ServerApp calls it again before it reads anything (a run submitted through the Control
API has no launcher in front of it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config.schema import ConfigError
from server.persistence import CHECKPOINT, check_checkpoint

if TYPE_CHECKING:
    from common.config.run import RunConfig

METRICS = "metrics.json"
#: Run settings that decide what the checkpoint's vector and state mean: a resume must keep them.
KEPT_ON_RESUME = ("method", "dataset", "model", "cluster_by")


class ResumeError(ConfigError):
    """``resume=true`` cannot continue from the files in the results folder; the message names the
    file."""


def check_resume(results: Path, cfg: RunConfig) -> int:
    """The round a resume of ``cfg`` in ``results`` continues after; refuses what it could not
    continue from.

    Parameters
    ----------
    results : Path
        The run's results folder (``results-dir``), holding ``checkpoint.npz`` and ``metrics.json``.
    cfg : RunConfig
        The run config of the resumed run.

    Raises
    ------
    ResumeError
        The checkpoint or ``metrics.json`` is missing, unreadable, or inconsistent with the other or
        with ``cfg``; the message names the file, what is wrong and how to go on.
    """
    checkpoint, metrics = results / CHECKPOINT, results / METRICS
    afresh = (
        f"to start afresh, launch without resume=true (this overwrites {metrics}) or with another "
        "results folder"
    )
    if not checkpoint.exists():
        raise ResumeError(
            f"resume=true: {checkpoint} does not exist, so there is nothing to resume; {afresh}"
        )
    try:
        done, parameters = check_checkpoint(checkpoint)
    except ValueError as err:
        raise ResumeError(f"resume=true: {err}; nothing can be resumed from it: {afresh}") from None
    if done > cfg.num_rounds:
        raise ResumeError(
            f"resume=true: {checkpoint} holds round {done}, beyond num-rounds={cfg.num_rounds}; "
            f"give num-rounds={done} or more"
        )
    run, last = _read_metrics(metrics, afresh)
    if last < done:
        raise ResumeError(
            f"resume=true: {metrics} records rounds up to {last}, but {checkpoint} holds round "
            f"{done}: they are not of the same run; {afresh}"
        )
    if "d" in run and run["d"] != parameters:
        raise ResumeError(
            f"resume=true: {checkpoint} holds a model of {parameters} parameters, {metrics} one of "
            f"{run['d']}: they are not of the same run; {afresh}"
        )
    for key in KEPT_ON_RESUME:
        if key in run and run[key] != getattr(cfg, key):
            flag = key.replace("_", "-")
            raise ResumeError(
                f"resume=true: {flag}={getattr(cfg, key)!r}, but the run in {results} has "
                f"{flag}={run[key]!r} ({metrics}); resume with {flag}={run[key]!r}, or {afresh}"
            )
    return done


def _read_metrics(path: Path, afresh: str) -> tuple[dict[str, Any], int]:
    """``(run settings, last recorded round)`` of the ``metrics.json`` at ``path``, or
    :class:`ResumeError`."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResumeError(
            f"resume=true: {path} does not exist, so the resumed run would lack the rounds already "
            f"done; restore it, or {afresh}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResumeError(
            f"resume=true: {path} is unreadable ({type(err).__name__}: {err}); {afresh}"
        ) from None
    rounds = doc.get("rounds") if isinstance(doc, dict) else None
    run = doc.get("run") if isinstance(doc, dict) else None
    if not isinstance(run, dict) or not isinstance(rounds, list):
        raise ResumeError(
            f"resume=true: {path} is not a metrics.json of this app (no 'run' and 'rounds'); "
            f"{afresh}"
        )
    numbers = [r.get("round") for r in rounds if isinstance(r, dict)]
    if len(numbers) != len(rounds) or not all(isinstance(n, int) for n in numbers):
        raise ResumeError(
            f"resume=true: {path} has a round record without a round number; {afresh}"
        )
    return run, max(numbers, default=-1)
