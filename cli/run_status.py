"""A run's status as the SuperLink records it, read through the Control API (``flwr ls --run-id``).

``flwr run --stream`` ends when its log stream ends, and a stream can break while the run goes on (a
busy SuperLink, a lost connection): its end says nothing about how the run ended. Whoever follows a
run asks the SuperLink instead, and follows the run again while it is still going.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

#: ``flwr run``'s line naming the run it submitted.
RUN_STARTED = re.compile(r"Successfully started run (\d+)")
#: Statuses of a run that has not ended (Flower's ``Status``).
UNFINISHED = ("pending", "starting", "running")


@dataclass(frozen=True)
class RunStatus:
    """What the SuperLink says of one run.

    Parameters
    ----------
    status : str
        ``pending``, ``starting``, ``running``, or ``finished:<completed|failed|stopped>``;
        ``unknown`` when the SuperLink could not be asked.
    details : str
        Flower's status details (e.g. the error of a failed run), or why the status is unknown.
    """

    status: str
    details: str = ""

    @property
    def finished(self) -> bool:
        """The run has ended (whichever way)."""
        return self.status.startswith("finished")

    @property
    def unfinished(self) -> bool:
        """The run is still pending, starting or running."""
        return self.status in UNFINISHED

    @property
    def succeeded(self) -> bool:
        """The run ended and completed."""
        return self.status == "finished:completed"


def parse_run_status(text: str, run_id: int) -> RunStatus:
    """The status of ``run_id`` in ``flwr ls --format json`` output (``unknown`` when it is not
    there)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return RunStatus("unknown", f"flwr ls printed no JSON: {text.strip()[-300:]!r}")
    if not isinstance(doc, dict) or not doc.get("success", False):
        why = doc.get("error-message", "") if isinstance(doc, dict) else ""
        return RunStatus("unknown", f"the SuperLink did not answer: {why or text.strip()[-300:]}")
    for run in doc.get("runs", []):
        if str(run.get("run-id")) == str(run_id):
            return RunStatus(
                str(run.get("status", "unknown")), str(run.get("status-details") or "")
            )
    return RunStatus("unknown", f"run {run_id} is not among the SuperLink's runs")


def run_status(
    env: dict[str, str], connection: str, run_id: int, timeout: float = 60.0
) -> RunStatus:
    """Ask the SuperLink (``flwr ls <connection> --run-id <run_id> --format json``) how run
    ``run_id`` stands.

    Parameters
    ----------
    env : dict
        The environment ``flwr`` runs in (its ``FLWR_HOME`` holds the connection).
    connection : str
        The SuperLink connection's name.
    run_id : int
        The run.
    timeout : float
        Seconds the question may take.
    """
    cmd = ["flwr", "ls", connection, "--run-id", str(run_id), "--format", "json"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return RunStatus("unknown", f"{' '.join(cmd)}: {err}")
    return parse_run_status(done.stdout, run_id)
