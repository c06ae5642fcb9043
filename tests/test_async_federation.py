"""A real multi-process ASYNC FedGMR federation: flower-superlink + 3 flower-supernode processes of
different speeds."""

from __future__ import annotations

import pytest

from benchmarks.time_to_accuracy import accuracy_curve, time_to_target
from cli.launcher import run_local_federation

pytestmark = pytest.mark.federation

CAPACITIES = (1.0, 0.25, 0.0625)
# bench-delay-s: seconds per local epoch, so the nodes finish out of step. The slow node's 24 s an
# update outweigh a ClientApp's start on a loaded machine (with 8 s, two CPU-bound processes beside
# the suite made every node's update take about as long, and each node sent four of the twelve).
DELAYS = (0.0, 1.0, 12.0)
ROUNDS = 4


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    results = tmp_path_factory.mktemp("async")
    lines: list[str] = []
    metrics = run_local_federation(
        CAPACITIES,
        results,
        {
            "method": "fedgmr",
            "gmr-mode": "async",
            # a fixed schedule, so the masks grow within these few updates
            "gmr-schedule": "linear",
            "gmr-restore-rounds": 2,
            # start below the capacity (the published start is at it), so there is room to grow
            "gmr-start": 0.25,
            "capacity-kind": "memory",  # capacities are hard caps here, checked below
            "num-rounds": ROUNDS,
            "eval-every": 0,
            "local-epochs": 2,
        },
        timeout=600,
        echo=lines.append,
        delays=DELAYS,
    )
    return results, metrics, lines


def test_updates_applied_asynchronously(federation):
    _, metrics, lines = federation
    records = metrics["rounds"]
    total = ROUNDS * len(CAPACITIES)
    assert records[0]["updates"] == 0 and records[-1]["updates"] == total
    applied = [c for r in records for c in r["clients"] if c["status"] == "ok"]
    assert len(applied) == total
    assert [c["version"] for c in applied] == list(range(1, total + 1))
    # asynchrony: some reply was trained on a model that others had changed meanwhile, and weighted
    # down
    assert max(c["staleness"] for c in applied) > 0
    assert any(c["weight"] < 1 for c in applied)
    # the fast node is not held back by the slow one: it contributes more updates
    per_node: dict[float, int] = {}
    for c in applied:
        per_node[c["capacity"]] = per_node.get(c["capacity"], 0) + 1
    assert per_node[1.0] > per_node.get(0.0625, 0), per_node
    assert (
        sum(line.startswith("[update") for line in lines) == total
    )  # one progress line per applied update


def test_masks_grow_and_respect_capacity(federation):
    _, metrics, _ = federation
    d = metrics["run"]["d"]
    by_node: dict[int, list[dict]] = {}
    for r in metrics["rounds"]:
        for c in r["clients"]:
            by_node.setdefault(c["node_id"], []).append(c)
    grew = False
    for entries in by_node.values():
        entries.sort(key=lambda c: c["dispatch"])
        sizes = [c["selected"] for c in entries]
        assert sizes == sorted(sizes), sizes  # restoration only adds
        assert all(s <= max(entries[0]["capacity"] * d + 1, 0.05 * d) for s in sizes)
        grew = grew or sizes[-1] > sizes[0]
    assert grew


def test_accuracy_and_wall_clock_recorded(federation):
    results, metrics, _ = federation
    seconds, acc = accuracy_curve(metrics["rounds"])
    assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] > 0
    assert acc[-1] > 0.3 and acc[-1] > acc[0], acc  # chance is 0.1 on ten digits
    assert time_to_target(seconds, acc, 0.3) is not None
    assert (results / "metrics.json").exists() and (results / "model.pt").exists()
