"""A federation with differential privacy on, as `fibos local` runs it: nodes spend their budget and
then stop."""

from __future__ import annotations

import pytest

from cli.launcher import run_local_federation

pytestmark = pytest.mark.federation

CAPACITIES = (1.0, 0.25, 0.0625)


def _spent_by_client(rounds: list[dict]) -> dict[str, list[float]]:
    spent: dict[str, list[float]] = {}
    for r in rounds[1:]:
        for c in r["clients"]:
            if c["dp_epsilon"] is not None:
                spent.setdefault(c["client_key"], []).append(c["dp_epsilon"])
    return spent


def test_fedfibos_learns_within_each_nodes_budget(tmp_path):
    lines: list[str] = []
    metrics = run_local_federation(
        CAPACITIES,
        tmp_path,
        {"num-rounds": 3, "eval-every": 0, "dp-epsilon": 8.0, "model": "cnn"},
        timeout=600,
        echo=lines.append,
    )
    rounds = metrics["rounds"]
    assert all(r["replies"] == len(CAPACITIES) for r in rounds[1:])
    acc = [r["global"]["accuracy"] for r in rounds]
    assert acc[-1] > acc[0] + 0.1, acc  # noised, but it learns
    spent = _spent_by_client(rounds)
    assert len(spent) == len(CAPACITIES)
    for values in spent.values():
        assert values == sorted(values) and 0 < values[0] and values[-1] <= 8.0, values
    assert any("epsilon spent up to" in line for line in lines if "[round 3/3]" in line)


def test_a_node_past_its_budget_uploads_nothing_and_the_run_goes_on(tmp_path):
    # z = 1 and local steps on 32 of a few hundred examples: a round or two fit in epsilon 3.7, four
    # do not.
    metrics = run_local_federation(
        CAPACITIES,
        tmp_path,
        {
            "num-rounds": 4,
            "eval-every": 0,
            "method": "fedavg",
            "model": "cnn",
            "local-epochs": 1,
            "dp-epsilon": 3.7,
            "dp-noise-multiplier": 1.0,
        },
        timeout=600,
        echo=lambda line: None,
    )
    rounds = metrics["rounds"]
    replies = [r["replies"] for r in rounds[1:]]
    assert replies[0] == 3 and replies[-1] == 0 and replies == sorted(replies, reverse=True), (
        replies
    )
    statuses = [c["status"] for c in rounds[-1]["clients"]]
    assert all("privacy budget is spent" in s for s in statuses), statuses
    for before, after in zip(rounds[1:], rounds[2:]):
        if after["replies"] == 0:  # no update: the model is untouched
            assert after["global"]["accuracy"] == before["global"]["accuracy"]
    for values in _spent_by_client(rounds).values():
        assert 1 <= len(values) < 4 and values[-1] <= 3.7
