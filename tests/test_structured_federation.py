"""CA-HFP end to end: a real SuperLink and three SuperNodes training physically smaller models."""

from __future__ import annotations

import pytest

from cli.launcher import run_local_federation
from tests.test_smoke_federation import _processes_with_env

pytestmark = pytest.mark.federation

CAPACITIES = (1.0, 0.25, 0.0625)
ROUNDS = 2


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    results = tmp_path_factory.mktemp("cahfp")
    metrics = run_local_federation(
        CAPACITIES,
        results,
        {"method": "cahfp", "num-rounds": ROUNDS, "eval-every": ROUNDS, "local-epochs": 2},
        timeout=600,
    )
    return results, metrics


def test_structured_federation_learns_with_small_models(federation):
    _, metrics = federation
    rounds = metrics["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1))
    assert all(r["replies"] == len(CAPACITIES) for r in rounds[1:])
    acc = [r["global"]["accuracy"] for r in rounds]
    assert acc[-1] > 0.5 and acc[-1] > acc[0] + 0.3, acc
    assert rounds[-1]["local"]["accuracy"] > 0.4
    assert set(rounds[-1]["global"]["per_capacity"]) == {f"{c:g}" for c in CAPACITIES}


def test_downloads_are_small_models_chosen_by_norm_then_own_curvature(federation):
    _, metrics = federation
    d = metrics["run"]["d"]
    for r in metrics["rounds"][1:]:
        clients = sorted(r["clients"], key=lambda c: -c["capacity"])
        assert all(c["mask_kind"] == "channels" for c in clients)
        assert all(
            c["mask_source"] == ("norm" if r["round"] == 1 else "client") for c in clients
        )  # own scores
        for c in clients:
            assert c["values_bytes"] == 4 * c["selected"]
            assert c["mask_bytes"] < 1024  # channel indices, not a mask over d positions
            assert c["capacity"] * 0.7 <= c["selected"] / d <= c["capacity"] * 1.3 + 1e-9
            # upload = trained small model + one float per held channel (+ record overhead)
            assert c["values_bytes"] < c["bytes_up"] <= c["values_bytes"] + 4 * 400 + 4096
        down = [c["bytes_down"] for c in clients]
        assert down == sorted(down, reverse=True) and len(set(down)) == len(down)


def test_no_process_left_behind(federation):
    results, _ = federation
    assert _processes_with_env(f"FLWR_HOME={results.resolve() / '.flwr'}") == []
