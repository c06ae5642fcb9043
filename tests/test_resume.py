"""Durable server state: SIGKILL the ServerApp mid-run, resume, and end with the uninterrupted
result."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from cli.launcher import LocalFederation
from server.persistence import CHECKPOINT, load_checkpoint
from tests.federation_progress import wait_for_round

pytestmark = pytest.mark.federation

CONFIG = {"num-rounds": 4, "eval-every": 0, "local-epochs": 1}


def _checkpointed_round(out: Path) -> int:
    try:
        return load_checkpoint(out / CHECKPOINT)[0]
    except (OSError, ValueError, KeyError):
        return 0


def test_killed_serverapp_resumes_to_the_uninterrupted_model(tmp_path):
    with LocalFederation((1.0, 0.25), tmp_path / "federation", echo=lambda line: None) as fed:
        reference = fed.run(CONFIG, tmp_path / "reference", timeout=600)
        out = tmp_path / "interrupted"
        failure: list[BaseException] = []

        def first_attempt() -> None:
            try:
                fed.run(CONFIG, out, timeout=600)
            except BaseException as err:  # the kill makes this run fail; that is the point
                failure.append(err)

        thread = threading.Thread(target=first_attempt)
        thread.start()
        wait_for_round(out, 2)
        # metrics.json is written just before the checkpoint: kill once the checkpoint holds round 2
        # too
        deadline = time.monotonic() + 120
        while _checkpointed_round(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = fed.serverapp_processes()
        assert pids, "no ServerApp process to kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        thread.join(timeout=300)
        assert not thread.is_alive() and failure, "the interrupted run should fail"
        done, _, _ = load_checkpoint(out / CHECKPOINT)
        assert 2 <= done < CONFIG["num-rounds"]
        resumed = fed.run({**CONFIG, "resume": True}, out, timeout=600)

    assert [r["round"] for r in resumed["rounds"]] == list(range(CONFIG["num-rounds"] + 1))
    ref_model = torch.load(tmp_path / "reference" / "model.pt")
    got_model = torch.load(out / "model.pt")
    # Node ids differ between runs of the same federation only in name; training seeds depend on the
    # partition and the round, and aggregation sums in node order, so the result is bit-identical.
    assert all(torch.equal(ref_model[k], got_model[k]) for k in ref_model)
    accuracy = [r["global"]["accuracy"] for r in reference["rounds"]]
    assert [r["global"]["accuracy"] for r in resumed["rounds"]] == accuracy
