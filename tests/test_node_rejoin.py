"""A SuperNode killed mid-run and restarted rejoins, and is selected again with its Fisher state."""

from __future__ import annotations

import threading

import pytest

from cli.launcher import LocalFederation
from tests.federation_progress import wait_for_round

pytestmark = pytest.mark.federation

ROUNDS = 7


def test_killed_supernode_rejoins_with_its_fisher_state(tmp_path):
    out = tmp_path / "run"
    result: dict = {}
    with LocalFederation(
        (1.0, 0.25, 0.0625), tmp_path / "federation", echo=lambda line: None
    ) as fed:
        # 60 s: the rejoined node's replies start fresh ClientApp processes, and with two test
        # workers on two cores they took just over 30 s, so it was never seen training again. No
        # byte budget: the small node must have measured its own Fisher for a rejoin to carry it.
        config = {
            "num-rounds": ROUNDS,
            "eval-every": 0,
            "local-epochs": 1,
            "round-timeout": 60.0,
            "fedfibos-byte-budget": 0,
        }
        thread = threading.Thread(target=lambda: result.update(fed.run(config, out, timeout=900)))
        thread.start()
        wait_for_round(out, 2)
        fed.kill_node(2)
        wait_for_round(out, 3)
        fed.start_node(2)
        thread.join(timeout=900)
    assert result, "the run did not finish"
    rounds = [r for r in result["rounds"] if r["round"] > 0]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    small = [[c for c in r["clients"] if c["capacity"] == 0.0625] for r in rounds]
    first_id = small[0][0]["node_id"]
    later = [c for cs in small[3:] for c in cs if c["status"] == "ok"]
    assert later, "the restarted node never trained again"
    rejoined = later[-1]
    assert rejoined["node_id"] != first_id  # a new node id ...
    # ... but its own Fisher estimate ranks its submodel (``held``: the mask that estimate gave
    # before)
    assert rejoined["mask_source"] in ("client", "held")
    assert all(r["global"]["accuracy"] > 0 for r in rounds)
