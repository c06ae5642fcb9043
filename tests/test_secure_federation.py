"""TLS with the project's own certificates and SuperNode authentication, on real processes."""

from __future__ import annotations

from server.launcher import LocalFederation

CAPACITIES = (1.0, 0.25, 0.5)
UNREGISTERED = 2


def test_registered_nodes_train_and_an_unregistered_one_is_refused(tmp_path):
    lines: list[str] = []
    with LocalFederation(
        CAPACITIES, tmp_path / "federation", echo=lines.append, secure=True, unregistered=[UNREGISTERED]
    ) as fed:
        metrics = fed.run({"num-rounds": 2, "eval-every": 0, "local-epochs": 1}, tmp_path / "run", timeout=600)
        link_log = (fed.logs / "superlink.log").read_text()
    assert "registered node-0" in lines and "registered node-1" in lines
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    assert len(rounds) == 2
    for r in rounds:  # exactly the two registered nodes took part, both with valid replies
        assert sorted(c["capacity"] for c in r["clients"]) == [0.25, 1.0]
        assert r["replies"] == 2
    assert rounds[-1]["global"]["accuracy"] > 0.3
    # The SuperLink refused the unregistered key (HTTP 412 on activation), over TLS.
    assert "No SuperNode found with the given public key" in link_log
    assert '"POST /v1/fleet/activate-node HTTP/1.1" 412' in link_log
