"""A capacity in bytes: the ledger, the capped Fisher upload, ``F^a x^2`` and a budgeted
federation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config.parse import parse_run_config
from common.fisher.codec import FISHER_ENCODINGS, encode_fisher, payload_bytes, ranked_floor
from common.fisher.selection import budget, powered, select_mask
from common.methods import create_method
from common.methods.round_fold import Accepted
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.byte_budget import BYTES_SLACK, ByteLedger, byte_ratios
from common.wire.validation import TrainReply

LAYOUT = ParamLayout.from_arrays(
    {"w": np.zeros((40, 50)), "b": np.zeros(40), "c": np.zeros((6, 5))}
)


# ---------------------------------------------------------------- the ledger
def test_the_ledger_allows_the_budget_times_the_shares_of_the_rounds_trained() -> None:
    ledger = ByteLedger(1.1)
    assert ledger.room("a") == (0, 0)  # nothing trained yet: nothing beyond a submodel
    ledger.charge_round("a", share=1000)
    assert ledger.room("a") == (100, 1100)
    ledger.charge("a", up=1000)
    ledger.charge_round("a", share=1000)
    assert ledger.room("a") == (200, 1200)
    ledger.charge("a", down=250)
    assert ledger.room("a") == (-50, 1200)  # over: nothing more until later rounds pay it back
    assert ledger.room("b") == (0, 0)


def test_the_ledger_refuses_a_budget_or_bytes_below_zero() -> None:
    with pytest.raises(ValueError, match="positive"):
        ByteLedger(0)
    ledger = ByteLedger(1.05)
    with pytest.raises(ValueError, match="non-negative"):
        ledger.charge_round("a", share=-1)
    with pytest.raises(ValueError, match="non-negative"):
        ledger.charge("a", up=-3)


def test_the_ledger_survives_its_arrays() -> None:
    ledger = ByteLedger(1.05)
    ledger.charge_round("node-1", 400)
    ledger.charge("node-1", down=20)
    ledger.charge("node-2", down=7, up=9)
    buf = io.BytesIO()
    np.savez(buf, **ledger.arrays())
    with np.load(io.BytesIO(buf.getvalue())) as z:
        back = ByteLedger.from_arrays(z, 1.05)
    assert back.budget == 1.05
    assert back.clients == ledger.clients
    empty = ByteLedger(2.0)
    buf = io.BytesIO()
    np.savez(buf, **empty.arrays())
    with np.load(io.BytesIO(buf.getvalue())) as z:
        assert ByteLedger.from_arrays(z, 2.0).clients == {}


def test_byte_ratios_sum_a_clients_bytes_over_its_shares_and_count_an_opening_as_bytes_only() -> (
    None
):
    d = 1000
    k = budget(0.25, d)
    entries = [
        {
            "client_key": "a",
            "node_id": 1,
            "capacity": 0.25,
            "bytes_down": 4 * d,
            "mask_bytes": 0,
            "train": False,
        },
        {
            "client_key": "a",
            "node_id": 1,
            "capacity": 0.25,
            "bytes_down": 4 * k + 50,
            "bytes_up": 4 * k,
            "mask_bytes": 50,
        },
        {
            "client_key": "a",
            "node_id": 1,
            "capacity": 0.25,
            "bytes_down": 4 * k + 50,
            "bytes_up": 4 * k,
            "mask_bytes": 50,
        },
        {"node_id": 2, "capacity": 1.0, "bytes_down": 4 * d, "bytes_up": 4 * d, "mask_bytes": 0},
    ]
    ratios = byte_ratios(entries, d)
    share = 2 * (4 * k + 50)
    assert ratios["a"] == pytest.approx(((4 * d + share) / share, 8 * k / share, 0.25))
    assert ratios["2"] == (1.0, 1.0, 1.0)


# ---------------------------------------------------------------- the capped Fisher upload
@pytest.mark.parametrize("mode", FISHER_ENCODINGS)
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_payload_bytes_is_what_each_encoding_sends(mode: str, density: float) -> None:
    rng = np.random.default_rng(1)
    mask = rng.random(LAYOUT.size) < density
    fisher = rng.lognormal(0, 1, LAYOUT.size).astype(np.float32)
    sent = sum(a.nbytes for a in encode_fisher(fisher, mask, LAYOUT, mode).values())
    k = int(mask.sum())
    if mode == "ranked":
        assert sent <= payload_bytes(mode, k, LAYOUT.size, LAYOUT.num_rows)
    else:
        assert sent == payload_bytes(mode, k, LAYOUT.size, LAYOUT.num_rows)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(0, 6000), seed=st.integers(0, 2**16))
def test_a_ranked_payload_keeps_within_its_cap_and_sends_the_largest_values(
    cap: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    mask = rng.random(LAYOUT.size) < 0.4
    fisher = rng.lognormal(0, 2, LAYOUT.size).astype(np.float32)
    if cap < ranked_floor(LAYOUT.size, LAYOUT.num_rows):
        with pytest.raises(ValueError, match="needs"):
            encode_fisher(fisher, mask, LAYOUT, "ranked", max_bytes=cap)
        return
    payload = encode_fisher(fisher, mask, LAYOUT, "ranked", max_bytes=cap)
    assert sum(a.nbytes for a in payload.values()) <= cap
    assert payload["fisher.setlog8"].size >= 1
    uncapped = encode_fisher(fisher, mask, LAYOUT, "ranked")
    assert payload["fisher.setlog8"].size <= uncapped["fisher.setlog8"].size


# ---------------------------------------------------------------- F^a x^2
@settings(max_examples=60, deadline=None)
@given(
    power=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
    seed=st.integers(0, 2**16),
    gamma=st.floats(0.01, 0.9),
)
def test_powered_fisher_ranks_as_f_to_the_power_times_x_squared(
    power: float, seed: int, gamma: float
) -> None:
    layout = ParamLayout.from_arrays({"w": np.zeros((9, 11))})
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(layout.size).astype(np.float32)
    fisher = rng.lognormal(0, 1.5, layout.size).astype(np.float32)
    mask = select_mask(
        layout, x, gamma, "fisher", powered(fisher, power), min_per_row=0, keep_vectors=False
    )
    score = fisher.astype(np.float64) ** power * x.astype(np.float64) ** 2
    k = budget(gamma, layout.size)
    assert mask.sum() == k
    # brute force: no position left out scores above one kept (up to float32 rounding of the power)
    assert score[~mask].max(initial=0) <= score[mask].min() * (1 + 1e-5)


def test_power_two_is_the_estimate_itself_and_a_negative_power_is_refused() -> None:
    f = np.arange(5, dtype=np.float32)
    assert powered(f, 2.0) is f
    assert np.array_equal(powered(f, 0.0), np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="power"):
        powered(f, -1.0)


# ---------------------------------------------------------------- the method's gate
def _budgeted(budget_multiple: float = 1.05):
    method = create_method(
        parse_run_config({"fedfibos-byte-budget": budget_multiple, "fisher-every": 2})
    )
    method.start_server(LAYOUT)
    return method


def test_a_refresh_goes_only_to_a_client_that_can_afford_the_rest_of_the_model() -> None:
    method = _budgeted()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    full = np.ones(LAYOUT.size, dtype=bool)
    small = select_mask(LAYOUT, x, 1 / 16, "magnitude", min_per_row=0, keep_vectors=False)
    # capacity 1: nothing outside its mask, so its refresh costs only the Fisher upload, capped to
    # what is left
    request = method.fisher_request("big", 1, x, full)
    assert request is not None
    cap = int(request.arrays[P.FISHER_BYTES][0])
    share = 4 * LAYOUT.size
    assert cap == int(1.05 * share) - share  # the room up after this round's update
    # 1/16: the rest of the model is 15x its share, never affordable at 1.05
    for rnd in range(1, 30):
        assert method.fisher_request("small", rnd, x, small) is None
    down, _ = method.ledger.room("small")
    assert down >= 0
    # the earlier behaviour: no budget, every due client is sent the rest of the model
    free = create_method(parse_run_config({"fisher-every": 2, "fedfibos-byte-budget": 0}))
    free.start_server(LAYOUT)
    assert free.fisher_request("small", 1, x, small) is not None


def test_without_a_budget_the_warm_up_runs_and_with_one_it_does_not() -> None:
    assert create_method(parse_run_config({"fedfibos-byte-budget": 0})).opening() != "none"
    assert create_method(parse_run_config({})).opening() == "none"  # the default budget


def test_a_fisher_larger_than_its_cap_is_not_folded_in_and_its_bytes_count(caplog) -> None:
    from common.aggregation.masked import MaskedUpdate

    method = _budgeted()
    x = np.ones(LAYOUT.size, dtype=np.float32)
    full = np.ones(LAYOUT.size, dtype=bool)
    cap = int(method.fisher_request("big", 1, x, full).arrays[P.FISHER_BYTES][0])
    update = MaskedUpdate(
        np.arange(LAYOUT.size, dtype=np.int32), np.zeros(LAYOUT.size, dtype=np.float32), 10.0
    )
    fisher = np.ones(LAYOUT.size, dtype=np.float32)
    reply = TrainReply(update, fisher, {}, fisher_bytes=cap + 1)
    method.observe(Accepted(7, "big", reply), 1)
    assert "big" not in method.fisher.clients
    assert "were allowed" in caplog.text
    assert method.ledger.entry("big").up == 4 * LAYOUT.size + cap + 1
    # within its cap, the next refresh's Fisher is folded in
    method.fisher_request("big", 3, x, full)
    method.observe(Accepted(7, "big", TrainReply(update, fisher, {}, fisher_bytes=10)), 3)
    assert "big" in method.fisher.clients


def test_the_ledger_travels_with_the_methods_state() -> None:
    method = _budgeted()
    x = np.ones(LAYOUT.size, dtype=np.float32)
    method.fisher_request("big", 1, x, np.ones(LAYOUT.size, dtype=bool))
    restored = _budgeted()
    restored.load_state(method.state_bytes())
    assert restored.ledger.clients == method.ledger.clients


def _upload(method, key: str, rnd: int, fisher: np.ndarray) -> None:
    """A capacity-1 client's refresh, requested and folded in at round ``rnd``."""
    from common.aggregation.masked import MaskedUpdate

    x = np.ones(LAYOUT.size, dtype=np.float32)
    full = np.ones(LAYOUT.size, dtype=bool)
    method.fisher_request(key, rnd, x, full)
    update = MaskedUpdate(
        np.arange(LAYOUT.size, dtype=np.int32), np.zeros(LAYOUT.size, dtype=np.float32), 10.0
    )
    method.observe(Accepted(7, key, TrainReply(update, fisher, {}, fisher_bytes=10)), rnd)
    assert key in method.fisher.clients


@pytest.mark.parametrize("hold", [False, True])
def test_a_prior_ranked_mask_is_held_until_the_prior_changes_when_asked(hold: bool) -> None:
    method = create_method(parse_run_config({"fisher-every": 2, "fedfibos-hold-prior-masks": hold}))
    method.start_server(LAYOUT)
    rng = np.random.default_rng(1)
    _upload(method, "big", 1, rng.gamma(1.0, size=LAYOUT.size).astype(np.float32))
    x2, x3 = (rng.standard_normal(LAYOUT.size).astype(np.float32) for _ in range(2))
    first, source = method.mask_for("small", 2, 1 / 4, x2)
    assert source == "prior"
    second, source = method.mask_for(
        "small", 3, 1 / 4, x3
    )  # the global values moved, the prior did not
    fresh = method.mask_for(None, 3, 1 / 4, x3)[
        0
    ]  # what a client with no key (central evaluation) is given
    assert not np.array_equal(first, fresh)
    if hold:
        assert source == "held" and np.array_equal(second, first)
    else:
        assert source == "prior" and np.array_equal(second, fresh)
    # A resumed run holds the same mask; a new upload changes the prior, and the mask with it.
    restored = create_method(
        parse_run_config({"fisher-every": 2, "fedfibos-hold-prior-masks": hold})
    )
    restored.start_server(LAYOUT)
    restored.load_state(method.state_bytes())
    assert np.array_equal(restored.mask_for("small", 3, 1 / 4, x3)[0], second)
    _upload(method, "big", 4, rng.gamma(1.0, size=LAYOUT.size).astype(np.float32))
    after, source = method.mask_for("small", 5, 1 / 4, x3)
    assert source == "prior" and np.array_equal(after, method.mask_for(None, 5, 1 / 4, x3)[0])


# ---------------------------------------------------------------- a budgeted federation
def test_a_budgeted_federation_keeps_every_client_within_its_bytes(tmp_path, monkeypatch) -> None:
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    caps = {51: 1.0, 52: 0.25, 53: 0.0625}
    config = {
        "num-rounds": 4,
        "local-epochs": 1,
        "eval-every": 0,
        "fisher-examples": 8,
        "fisher-every": 2,
    }

    fed = inprocess_federation(config, caps)  # the default budget
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 4, 60.0, evaluate_fn=fed.evaluate_fn
    )
    records = fed.records
    entries = [c for r in records if r["round"] > 0 for c in r["clients"]]
    ratios = byte_ratios(entries, fed.strategy.layout.size)
    assert set(ratios) == {fed.strategy.registry.nodes[n].key for n in caps}
    assert "fisher_warmup" not in records[0]
    for down, up, _ in ratios.values():
        assert down <= BYTES_SLACK and up <= BYTES_SLACK
    sources = {c["capacity"]: c["mask_source"] for c in records[-1]["clients"]}
    assert sources[0.25] == sources[0.0625] == "prior"  # ranked by the full client's Fisher
    asked = {
        (r["round"], c["capacity"]) for r in records[1:] for c in r["clients"] if c["fisher_asked"]
    }
    assert (1, 1.0) in asked and all(g == 1.0 for _, g in asked)


# ---------------------------------------------------------------- the refresh options benchmark
def test_the_int8_copy_of_the_rest_is_within_half_a_step_and_counts_a_byte_a_position() -> None:
    from benchmarks.ranking.refresh_options import int8_rest

    rng = np.random.default_rng(5)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    mask = rng.random(LAYOUT.size) < 0.2
    mask[:2000] = True  # all of "w" is held: that tensor sends nothing
    rough, nbytes = int8_rest(x, mask, LAYOUT)
    assert np.array_equal(rough[mask], x[mask])
    assert nbytes == int((~mask).sum()) + 4 * 2  # "b" and "c" send a scale each
    bounds = LAYOUT.offsets.tolist()
    for start, stop in zip(bounds[1:-1], bounds[2:]):
        outside = ~mask[start:stop]
        step = np.abs(x[start:stop][outside]).max() / 127
        assert np.abs(rough[start:stop][outside] - x[start:stop][outside]).max() <= step / 2 + 1e-7
