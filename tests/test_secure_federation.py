"""TLS with the project's own certificates and SuperNode authentication, on real processes."""

from __future__ import annotations

import sys

import pytest

from cli.launcher import LocalFederation, free_port

pytestmark = pytest.mark.federation

CAPACITIES = (1.0, 0.25, 0.5)
UNREGISTERED = 2


def test_registered_nodes_train_and_an_unregistered_one_is_refused(tmp_path):
    lines: list[str] = []
    with LocalFederation(
        CAPACITIES,
        tmp_path / "federation",
        echo=lines.append,
        secure=True,
        unregistered=[UNREGISTERED],
    ) as fed:
        # A real client joins with the documented one-command path (key pair, registration,
        # SuperNode), taking the partition the refused node would have had.
        address = f"127.0.0.1:{fed.link_port}"
        join = [sys.executable, "-m", "cli.join", "--name", "lab-node", "--superlink", address]
        join += ["--root-certificates", str(fed.certs / "ca.crt"), "--control-api", address]
        join += ["--partition-id", str(UNREGISTERED), "--num-partitions", str(len(CAPACITIES))]
        join += [
            "--capacity",
            "0.125",
            "--keys",
            str(tmp_path / "keys"),
            "--runtime-port",
            str(free_port()),
        ]
        fed.group.start(join, fed.logs / "join.log", {**fed.env, "OMP_NUM_THREADS": "1"})
        metrics = fed.run(
            {"num-rounds": 2, "eval-every": 0, "local-epochs": 3, "min-nodes": 3},
            tmp_path / "run",
            timeout=600,
        )
        link_log = (fed.logs / "superlink.log").read_text()
        join_log = (fed.logs / "join.log").read_text()
    assert "registered node-0" in lines and "registered node-1" in lines
    assert "lab-node: registered" in join_log and (tmp_path / "keys" / "lab-node.pub").exists()
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    assert len(rounds) == 2
    for (
        r
    ) in rounds:  # exactly the registered nodes took part (two started here, one joined), all valid
        assert sorted(c["capacity"] for c in r["clients"]) == [0.125, 0.25, 1.0]
        assert r["replies"] == 3
    assert rounds[-1]["global"]["accuracy"] > 0.3
    # The SuperLink refused the unregistered key (HTTP 412 on activation), over TLS.
    assert "No SuperNode found with the given public key" in link_log
    assert '"POST /v1/fleet/activate-node HTTP/1.1" 412' in link_log
