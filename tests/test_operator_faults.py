"""Operator-facing faults on a real local federation (flower-superlink + flower-supernode
processes).

Two launches on one folder, a SuperLink crash and its resume, a misconfigured SuperNode, a SIGKILLed
one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli.launcher import LocalFederation
from tests.federation_progress import checkpointed_round, wait_for_round, wait_until

pytestmark = pytest.mark.federation

ROOT = Path(__file__).resolve().parents[1]
QUICK = {"eval-every": 0, "local-epochs": 1}


def test_misconfigured_node_says_why_and_a_killed_node_leaves_no_children(tmp_path):
    lines: list[str] = []
    result: dict = {}
    # SuperNode 1 sleeps 120 s in its ClientApp after training (bench-delay-s): it is killed
    # meanwhile.
    with LocalFederation((1.0, 0.5), tmp_path, echo=lines.append, delays=(0, 120)) as fed:
        fed.start_node(2, "partition-id=2 num-partitions=3 capacity=2.0")
        # no warm-up: the TRAIN message the node is killed on is round 1's; 60 s for node 0's reply
        # while another test's federation shares the two cores
        config = {
            **QUICK,
            "num-rounds": 1,
            "min-nodes": 3,
            "round-timeout": 60.0,
            "fisher-warmup": False,
        }
        thread = threading.Thread(
            target=lambda: result.update(fed.run(config, tmp_path, timeout=600))
        )
        thread.start()

        # Killed from outside (a crash, the OOM killer) while its flwr-clientapp works on a TRAIN
        # message: Flower's detached children (executor, ClientApp) would run on; they are stopped
        # within seconds.
        assert wait_until(
            lambda: "Receiving: train message" in (fed.logs / "supernode-1.log").read_text(), 300
        )
        assert wait_until(lambda: len(fed.node_processes(1)) >= 3, 60), fed.node_processes(1)
        os.kill(fed.nodes[1].pid, signal.SIGKILL)
        assert wait_until(lambda: fed.node_processes(1) == [], 15), fed.node_processes(1)
        assert any(line.startswith("SuperNode 1 exited (code -9)") for line in lines), lines
        assert fed.node_processes(0), "the other nodes are left alone"
        thread.join(timeout=600)

        # The server recorded why it left the misconfigured node out ...
        out = [o for r in result["rounds"] for o in r["nodes_out"]]
        assert len(out) == 1 and out[0]["event"] == "excluded", out
        assert "capacity=2.0" in out[0]["reason"]
        # ... and the node's own log says it too, instead of only "Sent successfully".
        node_log = (fed.logs / "supernode-2.log").read_text()
        assert "cannot take part" in node_log and "capacity=2.0" in node_log
    # Node ids are random, so the records are matched by capacity: node 0 (1.0) replied, node 1
    # (0.5) was killed: no reply within the round's timeout, or, once its heartbeat has lapsed (2 x
    # 30 s), the SuperLink's error.
    status = {c["capacity"]: c["status"] for c in result["rounds"][1]["clients"]}
    assert status[1.0] == "ok"
    assert status[0.5] == "no reply" or (
        status[0.5].startswith("rejected: node returned an error")
        and "Node Unavailable" in status[0.5]
    ), status


def test_a_second_launcher_on_the_same_folder_is_refused_and_the_first_is_unaffected(tmp_path):
    folder = tmp_path / "run"
    result: dict = {}
    with LocalFederation((1.0,), folder, echo=lambda line: None) as fed:
        config = {**QUICK, "num-rounds": 2}
        thread = threading.Thread(
            target=lambda: result.update(fed.run(config, folder, timeout=600))
        )
        thread.start()
        wait_for_round(folder, 1)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "cli.launcher",
                "--capacities",
                "1",
                "--rounds",
                "2",
                "--results",
                str(folder),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        thread.join(timeout=600)
    assert second.returncode == 1
    assert f"{folder} is in use by another run (launcher PID {os.getpid()}" in second.stderr, (
        second.stderr
    )
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert all(
        r["replies"] == r["sent"] == 1 for r in result["rounds"][1:]
    )  # nobody else's node trained
    assert (
        len([p for p in (folder / "logs").iterdir() if p.name != "latest"]) == 1
    )  # the second started nothing


def test_superlink_crash_then_resume_keeps_every_launchs_logs(tmp_path):
    """SIGKILL the SuperLink mid-run; relaunching with resume=true finishes the run, and no log is
    lost."""
    config = {**QUICK, "num-rounds": 3}
    lines: list[str] = []
    failure: list[BaseException] = []
    with LocalFederation((1.0, 0.25), tmp_path, echo=lines.append) as fed:
        first_logs = fed.logs

        def attempt() -> None:
            try:
                fed.run(config, tmp_path, timeout=600)
            except RuntimeError as err:
                failure.append(err)

        thread = threading.Thread(target=attempt)
        thread.start()
        wait_for_round(tmp_path, 1)
        # A resume refuses a folder without a checkpoint: kill once round 1's (written after
        # metrics.json) is there.
        assert wait_until(lambda: checkpointed_round(tmp_path) >= 1, 60)
        os.kill(fed.group.procs[0].pid, signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive() and failure, "the run must fail with its SuperLink"
    assert "Connection to the SuperLink is unavailable" in str(failure[0]), failure[0]
    assert any(line.startswith("the SuperLink exited (code -9)") for line in lines), lines

    with LocalFederation((1.0, 0.25), tmp_path, echo=lambda line: None) as fed:
        resumed = fed.run({**config, "resume": True}, tmp_path, timeout=600)
        second_logs = fed.logs
    assert [r["round"] for r in resumed["rounds"]] == [0, 1, 2, 3]
    assert first_logs != second_logs
    assert (tmp_path / "logs" / "latest").resolve() == second_logs
    crashed = (first_logs / "serverapp.log").read_text()
    assert (
        "Successfully started run" in crashed
        and "Connection to the SuperLink is unavailable" in crashed
    )
    assert (first_logs / "superlink.log").stat().st_size > 0
    assert all((first_logs / f"supernode-{i}.log").stat().st_size > 0 for i in (0, 1))
    assert "resuming after round" in (second_logs / "serverapp.log").read_text()
