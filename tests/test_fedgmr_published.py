"""FedGMR as its published code computes it: the shared magnitude ranking with its core, the
patience schedule.

Published code:
machengjie321/ICML2026-Breaking-the-Capacity-Bottleneck-in-Model-Heterogeneous-FL-via-Gradual-
Model-Restoration, commit 965eeb8 (``control/sub_algorithm.py``: ``process_layer``,
``sub_architecture_search_fast``; ``bases/fl/simulation_real/Prune_Recover_FL_fiarse.py``:
``EarlyStopping``, ``FedMapServer.GMR``). ``docs/design/fidelity-elementwise.md`` maps each element
to these tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.aggregation.masked import MaskedUpdate
from common.config.parse import parse_run_config
from common.fisher.selection import budget
from common.methods import create_method, method_class
from common.methods.round_fold import Accepted
from common.models.layout import ParamLayout
from common.submodels.restoration import (
    EarlyStop,
    PatienceSchedule,
    RestorationMasks,
    capped_double_step,
    core_size,
    ladder_step,
    magnitude_core,
    position_costs,
    shared_mask,
    shared_scores,
)
from common.wire.validation import TrainReply

LAYOUT = ParamLayout.from_arrays(
    {
        "w1": np.zeros((6, 5)),
        "b1": np.zeros(6),
        "w2": np.zeros((3, 6)),
        "b2": np.zeros(3),
        "w3": np.zeros((2, 3)),
    }
)
COSTS = {
    "w1": 2.0,
    "w2": 0.5,
    "w3": 1.25,
}  # seconds per parameter of each layer (the published coefficients)


def brute_force_mask(layout, x, k, costs, min_density, previous=None):
    """The published selection spelled out: per-layer magnitude core, then the top of score /
    cost."""
    vectors, core, cost = set(), set(), {}
    for t, start in zip(layout.tensors, layout.offsets[:-1].tolist()):
        idx = list(range(start, start + t.size))
        if len(t.shape) < 2:
            vectors |= set(idx)
            continue
        for j in idx:
            cost[j] = costs.get(t.name, 1.0)
        # process_layer: drop the weights below the int((1 - min_density) n)-th smallest magnitude
        # (<= n - 1)
        ranked = sorted(np.abs(x[idx]))
        dropped = min(int((1 - min_density) * len(idx)), len(idx) - 1)
        threshold = ranked[dropped]
        core |= {j for j in idx if abs(x[j]) >= threshold}
    if previous is None:
        score = {j: abs(float(x[j])) / cost[j] for j in cost}
    else:  # accumulate_wg_square: |(w - w_old) * w|
        score = {j: abs((float(x[j]) - float(previous[j])) * float(x[j])) / cost[j] for j in cost}
    rest = sorted((j for j in cost if j not in core), key=lambda j: -score[j])
    held = vectors | core
    held |= set(rest[: max(0, k - len(held))])
    mask = np.zeros(layout.size, dtype=bool)
    mask[sorted(held)] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_density", [0.02, 0.2, 0.5])
def test_shared_selection_is_the_published_score_with_its_core(seed, min_density):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=LAYOUT.size).astype(np.float32)
    previous = x + rng.normal(scale=0.1, size=LAYOUT.size).astype(np.float32)
    costs = position_costs(LAYOUT, COSTS)
    core = magnitude_core(LAYOUT, x, min_density)
    forced = int((LAYOUT.always_kept | core).sum())
    for prev in (None, previous):
        scores = shared_scores(x, costs, prev)
        for k in range(forced, LAYOUT.size + 1):
            got = shared_mask(LAYOUT, k, scores, core, x)
            assert np.array_equal(got, brute_force_mask(LAYOUT, x, k, COSTS, min_density, prev)), (
                k,
                prev is None,
            )


def test_core_size_keeps_at_least_one_weight_per_tensor():
    assert [core_size(n, 0.02) for n in (1, 10, 50, 51, 100, 1000)] == [1, 1, 1, 2, 2, 20]
    assert core_size(10, 0.0) == 1 and core_size(10, 1.0) == 10 and core_size(0, 0.5) == 0
    with pytest.raises(ValueError, match="min_density"):
        core_size(10, 1.5)


def test_position_costs_refuse_bad_values():
    assert position_costs(LAYOUT).tolist() == [1.0] * LAYOUT.size
    with pytest.raises(ValueError, match="not have"):
        position_costs(LAYOUT, {"w9": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        position_costs(LAYOUT, {"w1": 0.0})


def test_restoration_masks_rank_by_the_published_score_per_round():
    """Through RestorationMasks: round 0 ranks the start model, round 1 the model then (``delta``:
    its change)."""
    rng = np.random.default_rng(3)
    x0 = rng.normal(size=LAYOUT.size).astype(np.float32)
    x1 = (x0 + rng.normal(scale=0.3, size=LAYOUT.size)).astype(np.float32)
    d = LAYOUT.size
    for rule in ("magnitude", "delta"):
        masks = RestorationMasks(
            LAYOUT, "linear", 1.0, 1.0, 10, 2.0, rule, 0, 1, min_density=0.2, costs=COSTS
        )
        for t, x, prev in ((0.0, x0, None), (1.0, x1, x0 if rule == "delta" else None)):
            for key, k in (("a", 24), ("b", 40), ("c", 55)):
                mask, source = masks.mask(key, t, k / d, x, None)
                assert source == rule
                expect = brute_force_mask(LAYOUT, x, budget(k / d, d), COSTS, 0.2, prev)
                assert np.array_equal(mask, expect), (rule, t, key)
        # the same round asks again: the ranking of round 1 is kept, even when the model moved
        # meanwhile
        again, _ = masks.mask("d", 1.5, 40 / d, x1 * 3 - x0, None)
        assert np.array_equal(again, masks.clients["b"].mask)


def test_a_budget_below_the_core_holds_the_largest_core_positions():
    x = np.random.default_rng(0).normal(size=LAYOUT.size).astype(np.float32)
    core = magnitude_core(LAYOUT, x, 0.5)
    scores = shared_scores(x, position_costs(LAYOUT))
    vectors = int(LAYOUT.always_kept.sum())
    masks = [shared_mask(LAYOUT, k, scores, core, x) for k in range(0, LAYOUT.size + 1)]
    for k, m in enumerate(masks):
        assert m.sum() == max(k, vectors) and np.all(m[LAYOUT.always_kept])
        if k <= int((core | LAYOUT.always_kept).sum()):
            assert not np.any(m & ~core & ~LAYOUT.always_kept)  # nothing outside the core yet
    assert all(np.all(b[a]) for a, b in zip(masks, masks[1:]))  # one order for every budget


def _cnn():
    from common.models.architectures import build_model, model_layout, trainable_arrays

    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    return layout, layout.flatten(trainable_arrays(model))


def _reply(loss: float, weight: float = 10.0) -> TrainReply:
    update = MaskedUpdate(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float32), weight)
    return TrainReply(update, None, {"train-loss": loss, "num-examples": weight})


def test_defaults_are_the_published_reading():
    run = parse_run_config({"method": "fedgmr"})
    o = run.options("fedgmr")
    assert (o.schedule, o.selection, o.restore_step) == ("patience", "magnitude", "ladder")
    assert (o.start, o.patience, o.min_density) == (1.0, 5, 0.02)
    assert (
        method_class("fedgmr").upload_encoding(run) == "none"
    )  # the magnitude ranking reads no Fisher
    custom = parse_run_config(
        {
            "method": "fedgmr",
            "gmr-patience": 3,
            "gmr-restore-step": "capped-double",
            "gmr-min-density": 0.1,
        }
    ).options("fedgmr")
    assert (custom.patience, custom.restore_step, custom.min_density) == (3, "capped-double", 0.1)


def test_submodels_nest_across_clients_of_one_round():
    layout, x = _cnn()
    method = create_method(parse_run_config({"method": "fedgmr"}))
    method.start_server(layout)
    capacities = {"k1": 1.0, "k4": 0.25, "k16": 0.0625, "k64": 1 / 64}
    rng = np.random.default_rng(0)
    for rnd in (1, 2, 3):
        masks = {k: method.mask_for(k, rnd, c, x)[0] for k, c in capacities.items()}
        order = sorted(capacities, key=capacities.get)
        for small, big in zip(order, order[1:]):
            assert np.all(masks[big][masks[small]]), (rnd, small, big)  # nested
        core = layout.always_kept | magnitude_core(layout, x, 0.02)
        for k, c in capacities.items():
            # its own density (start = its capacity), exactly; from the first check on at least the
            # floor (gmr-min-density 0.02, lifting 1/64); a budget below the core holds part of it
            g = c if rnd == 1 else max(c, 0.02)
            assert masks[k].sum() == budget(g, layout.size)
            assert np.all(masks[k][core]) == (budget(g, layout.size) >= core.sum())
        level, source = method.mask_for(
            None, rnd, 0.25, x
        )  # central evaluation: the submodel k4 holds
        assert source == "held" and np.array_equal(level, masks["k4"])
        x = (x + rng.normal(scale=0.05, size=x.size)).astype(
            np.float32
        )  # the next round ranks the new model


def test_patience_steps_by_min_d_02_only_after_the_patience_is_exhausted():
    p = PatienceSchedule(3, "capped-double", 0.0)
    p.join("stalled", 0.05, 1.0)
    p.join("learning", 0.5, 1.0)
    seen = {}
    for r in range(1, 30):
        p.record("stalled", r, -1.0)  # the same loss every round: never an improvement
        p.record("learning", r, float(r))  # better every round, and so is the round's mean
        p.advance(r)
        seen[r] = p.density("stalled")
        assert p.density("learning") == 0.5 and p.floor == 0.0
    # first score sets the best, 3 more without improvement exhaust the patience: the step comes at
    # round 4; then 2 * 3 rounds of waiting (the counter restarted at the step), so the next at 10,
    # 16, 22, 28
    steps = [r for r in range(2, 30) if seen[r] != seen[r - 1]]
    assert steps == [4, 10, 16, 22, 28]
    assert [seen[r] for r in (3, 4, 10, 16, 22, 28)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.4, 0.6, 0.8]
    )
    for d in (0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.79, 0.8, 0.81, 0.95, 1.0):
        assert capped_double_step(d) == pytest.approx(min(1.0, d + min(d, 0.2)))


def test_an_improvement_restarts_the_count():
    p = PatienceSchedule(3, "capped-double", 0.0)
    p.join("a", 0.1, 1.0)
    p.join("b", 0.5, 1.0)
    losses = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # improves at round 4, after two rounds without
    for r, loss in enumerate(losses, start=1):
        p.record("a", r, -loss)
        p.record("b", r, float(r))
        p.advance(r)
        assert p.density("a") == (0.2 if r == 7 else 0.1), r


def test_the_ladder_climbs_the_clients_start_densities_and_the_floor_lifts_everyone():
    assert ladder_step(0.05, [0.05, 0.25, 1.0]) == 0.25 and ladder_step(0.25, [0.05, 0.25]) == 1.0
    assert (
        ladder_step(0.02, [0.025, 0.05]) == 0.05
    )  # within 0.01 of the current density: not a step
    p = PatienceSchedule(2, "ladder", 0.02)
    p.join("a", 0.05, 1.0)
    p.join("b", 0.25, 1.0)
    history = []
    for r in range(1, 16):
        for key in ("a", "b"):
            p.record(key, r, -1.0)
        p.advance(r)
        history.append((p.density("a"), p.density("b"), p.floor))
    assert history[1] == (0.05, 0.25, 0.02)
    # round 3: both exhausted, each climbs one level; the floor's first exhaustion only arms it
    assert history[2] == (0.25, 1.0, 0.02) and p.armed
    # round 6: the floor climbs 0.02 -> 0.05 and pauses the checks of round 7; a waits (2 * 2
    # rounds) until 10
    assert history[5] == (0.25, 1.0, 0.05) and history[6] == history[5]
    assert history[9] == (1.0, 1.0, 0.25)
    assert history[13] == (1.0, 1.0, 1.0)


def test_the_floor_raises_a_waiting_client_and_pauses_the_checks():
    p = PatienceSchedule(2, "capped-double", 0.02)
    p.join("a", 0.05, 1.0)
    got = []
    for r in range(1, 12):
        p.record("a", r, -1.0)
        p.advance(r)
        got.append((round(p.density("a"), 6), round(p.floor, 6), p.pause))
    assert got[2] == (0.1, 0.02, 0)  # round 3: a steps 0.05 -> 0.1, the floor is armed
    assert got[5] == (
        0.22,
        0.22,
        1,
    )  # round 6: the floor steps 0.02 -> 0.22 and lifts a (still waiting)
    assert got[6][:2] == (0.22, 0.22) and got[9] == (0.42, 0.42, 1)


def test_memory_clients_never_pass_their_capacity():
    p = PatienceSchedule(1, "capped-double", 0.5)
    p.join("m", 0.1, 0.25)
    for r in range(1, 10):
        p.record("m", r, -1.0)
        p.advance(r)
        assert p.density("m") <= 0.25
    assert p.density("m") == 0.25


def test_early_stop_counts_as_the_published_counter():
    stop = EarlyStop(2)
    assert [stop(s) for s in (0.5, 0.5, 0.4, 0.6, 0.6, 0.6, 0.6)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        True,
    ]
    stop.restart()
    assert stop(0.1) is False and stop.best == 0.1
    stop.reopen()
    assert stop(-5.0) is False and stop.counter == 0


def test_the_method_steps_a_stalled_client_on_its_training_loss():
    """Sync rounds through FedGMR: replies' losses in, masks out; the masks of a round still
    nest."""
    layout, x = _cnn()
    run = {"method": "fedgmr", "gmr-patience": 2, "gmr-restore-step": "capped-double"}
    method = create_method(parse_run_config(run))
    method.start_server(layout)
    capacities = {"slow": 0.0625, "fast": 0.25}
    sizes = []
    for rnd in range(1, 9):
        masks = {k: method.mask_for(k, rnd, c, x)[0] for k, c in capacities.items()}
        if masks["slow"].sum() <= masks["fast"].sum():
            assert np.all(masks["fast"][masks["slow"]])
        sizes.append(int(masks["slow"].sum()))
        method.observe(Accepted(1, "slow", _reply(1.0)), rnd)  # stalled
        method.observe(
            Accepted(2, "fast", _reply(1.0 / rnd)), rnd
        )  # still learning: the mean improves too
    d = layout.size
    # round 1 trains at 1/16; the check after round 3 exhausts a patience of 2, so round 4 holds 1/8
    assert sizes[:3] == [budget(0.0625, d)] * 3 and sizes[3] == budget(0.125, d)
    # then 2 * 2 rounds of waiting: the next step after round 7, held from round 8 on
    assert sizes[4:7] == [budget(0.125, d)] * 3 and sizes[7] == budget(0.25, d)
    warmup = create_method(parse_run_config(run))
    warmup.start_server(layout)
    warmup.observe(
        Accepted(1, "slow", _reply(1.0)), 0
    )  # a Fisher warm-up reply is not a training round
    assert warmup.restoration.patience.pending == {}


def test_async_round_equivalents_run_one_check_each():
    layout, x = _cnn()
    method = create_method(
        parse_run_config({"method": "fedgmr", "gmr-mode": "async", "gmr-patience": 1})
    )
    method.start_server(layout)
    first, _ = method.mask_at("n", 0.0, 0.0625, x)
    for clock in (0.0, 0.5, 1.0, 1.5):  # two replies per round equivalent, tagged int(clock) + 1
        method.observe(Accepted(1, "n", _reply(1.0)), int(clock) + 1)
    same, source = method.mask_at(
        "n", 1.0, 0.0625, x
    )  # round 1 checked: the best is set, no step yet
    assert same.sum() == first.sum()
    grown, _ = method.mask_at("n", 2.5, 0.0625, x)  # round 2 checked: a patience of 1 is exhausted
    assert method.restoration.patience.checked == 2
    # the ladder has no larger start density than this only client's: the step goes to the full
    # model
    assert grown.all() and source == "magnitude"
