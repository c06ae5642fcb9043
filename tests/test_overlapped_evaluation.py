"""A round's central evaluation runs once the next round's messages are out, on that round's own
model.

The server evaluates the full model and every capacity level after each round; on a fleet that would
delay the next round by as much. ``SubmodelStrategy.start`` instead makes a round's record once the
next round's TRAIN messages are pushed (the last round, and rounds of the nodes' own evaluation, at
once). Checked in process: the record is made after the next round's push, its accuracy is its own
round's model's, and the figures are those of evaluating at once.
"""

from __future__ import annotations

import time

import numpy as np

from server.strategy import SubmodelStrategy
from tests.inprocess_grid import inprocess_federation

# No byte budget: round 1 comes with discovery (the warm-up's message), as the counts below expect.
RUN = {
    "num-rounds": 3,
    "local-epochs": 1,
    "eval-every": 0,
    "fisher-examples": 16,
    "fedfibos-byte-budget": 0,
}
NODES = {51: 1.0, 52: 0.25, 53: 0.0625}


def _run(monkeypatch, tmp_path, run_config=RUN):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed = inprocess_federation(run_config, NODES)
    models: dict[int, np.ndarray] = {}  # each round's aggregated model
    pushed_before_record: dict[int, int] = {}  # TRAIN messages pushed when each record was made
    real_fold = SubmodelStrategy.fold_train_replies

    def fold(self, plan, parts, warm_up=False):
        out = real_fold(self, plan, parts, warm_up)
        if not warm_up:
            models[plan.server_round] = self.x.copy()
        return out

    monkeypatch.setattr(SubmodelStrategy, "fold_train_replies", fold)
    records = fed.records

    def on_round(record):
        pushed_before_record[record["round"]] = sum(
            m.metadata.message_type == "train" for m in fed.grid.handled
        )
        records.append(record)

    fed.strategy.on_round = on_round
    fed.strategy.start(
        fed.grid,
        fed.strategy.to_arrays(fed.x0),
        run_config["num-rounds"],
        60.0,
        evaluate_fn=fed.evaluate_fn,
    )
    return fed, models, pushed_before_record


def test_a_rounds_record_is_made_after_the_next_push_from_its_own_model(monkeypatch, tmp_path):
    fed, models, pushed = _run(monkeypatch, tmp_path)
    rounds = {r["round"]: r for r in fed.records}
    assert [r["round"] for r in fed.records] == [0, 1, 2, 3]
    # Round 1 came with discovery: its record waits for round 2's three messages, round 2's for
    # round 3's.
    assert pushed[1] == 3 and pushed[2] == 6 and pushed[3] == 6
    assert [rounds[r]["central_overlapped"] for r in (1, 2, 3)] == [True, True, False]
    assert all(
        rounds[r]["central_seconds"] > 0 and rounds[r]["central_cpu_seconds"] > 0 for r in (1, 2, 3)
    )
    assert all(rounds[r]["server_cpu_seconds"] > 0 for r in (1, 2, 3))
    # Rounds 1 and 2 were evaluated beside the next round: not in their server's seconds; round 3 at
    # once.
    assert rounds[3]["server_cpu_seconds"] >= rounds[3]["central_cpu_seconds"]
    for rnd in (1, 2, 3):
        full = fed.evaluate_fn(rnd, fed.strategy.to_arrays(models[rnd]))
        assert rounds[rnd]["global"]["accuracy"] == full["accuracy"]
        assert rounds[rnd]["global"]["loss"] == full["loss"]
    assert (
        models[2].tobytes() != models[3].tobytes()
    )  # the record of round 2 did not see round 3's model
    assert rounds[1]["time"] < rounds[2]["time"] < rounds[3]["time"]


def test_rounds_of_the_nodes_own_evaluation_are_evaluated_at_once(monkeypatch, tmp_path):
    fed, _, pushed = _run(monkeypatch, tmp_path, {**RUN, "eval-every": 2, "num-rounds": 3})
    rounds = {r["round"]: r for r in fed.records}
    assert rounds[2]["central_overlapped"] is False and rounds[2]["local"] is not None
    assert pushed[2] == 3  # made before round 3's messages went out (only round 2's were sent)
    assert "trained_per_capacity" in rounds[2]["global"]
    assert rounds[1]["central_overlapped"] is True


def test_an_evaluation_beside_the_next_round_is_not_that_rounds_server_work(monkeypatch, tmp_path):
    """Round ``r``'s evaluation runs while round ``r + 1``'s nodes train: it is ``r``'s
    ``central_seconds``, never ``r + 1``'s server seconds (which a fleet's time adds in full, beside
    the nodes' training)."""
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed = inprocess_federation(RUN, NODES)
    burn = 0.3  # CPU seconds each central evaluation call spends besides the evaluation itself

    def slow_evaluate(server_round, arrays):
        start = time.process_time()
        while time.process_time() - start < burn:
            pass
        return fed.evaluate_fn(server_round, arrays)

    fed.strategy.on_round = fed.records.append
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), RUN["num-rounds"], 60.0, evaluate_fn=slow_evaluate
    )
    rounds = {r["round"]: r for r in fed.records}
    assert [rounds[r]["central_overlapped"] for r in (1, 2, 3)] == [True, True, False]
    # Rounds 2 and 3 pushed while the round before them was evaluated (one call per capacity level
    # and the full model, each burning 0.3 s); their own server work is far below one such call.
    assert all(rounds[r - 1]["central_cpu_seconds"] >= 4 * burn for r in (2, 3))
    assert rounds[2]["server_cpu_seconds"] < burn and rounds[2]["server_seconds"] < burn
    # Round 3, the last, is evaluated at once: that evaluation is its server's work, round 2's is
    # not.
    assert rounds[3]["central_cpu_seconds"] >= 4 * burn
    assert 0 < rounds[3]["server_cpu_seconds"] - rounds[3]["central_cpu_seconds"] < burn
    assert 0 < rounds[3]["server_seconds"] - rounds[3]["central_seconds"] < burn
