"""The server's Fisher state: normalisation, the example-weighted prior, staleness, EMA,
checkpoints."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.state import PRIOR_BLOCK, FisherState, mean64

D = 16
BIG_IDS = [0, 1, 2**32, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1]


def _fisher(rng, d=D, zeros=0.2):
    return (rng.exponential(size=d) * (rng.random(d) >= zeros)).astype(np.float32) + np.float32(
        1e-3
    )


def _norm(f):
    f = np.asarray(f, dtype=np.float64)
    return f / f.mean()


def _brute_prior(latest):
    """latest: {client: (normalised fisher, weight)} -> example-weighted mean."""
    num = sum(w * f.astype(np.float64) for f, w in latest.values())
    den = sum(w for _, w in latest.values())
    return num / den


# ---------------------------------------------------------------------------
# normalisation


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1.0, 3.7, 1e6, 1e30])
def test_normalise_to_mean_one(scale):
    rng = np.random.default_rng(0)
    f = _fisher(rng) * np.float32(scale)
    n = FisherState.normalise(f)
    assert n is not None
    assert n.dtype == np.float32
    assert np.mean(n, dtype=np.float64) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(n, _norm(f), rtol=1e-6)


@pytest.mark.parametrize(
    "f",
    [
        np.zeros(D),
        np.zeros(D, dtype=np.float32),
        np.full(D, np.nan),
        np.r_[np.zeros(D - 1), np.inf],
        -np.ones(D),
    ],
)
def test_normalise_uninformative_is_none(f):
    assert FisherState.normalise(f) is None


def test_all_zero_upload_returns_false_and_changes_nothing():
    s = FisherState(D)
    assert s.update(7, np.zeros(D, dtype=np.float32), 10.0, 1) is False
    assert s.clients == {}
    assert s.global_prior() is None
    assert s.estimate(7, 2) is None

    rng = np.random.default_rng(1)
    f = _fisher(rng)
    assert s.update(7, f, 10.0, 1) is True
    prior = s.global_prior().copy()
    before = s.clients[7]
    stored = before.fisher.copy()
    blob = s.to_bytes()
    assert s.update(7, np.zeros(D, dtype=np.float32), 50.0, 3) is False
    assert s.update(8, np.zeros(D, dtype=np.float32), 50.0, 3) is False
    assert set(s.clients) == {7}
    assert s.clients[7].round == 1 and s.clients[7].weight == 10.0
    np.testing.assert_array_equal(s.clients[7].fisher, stored)
    np.testing.assert_array_equal(s.global_prior(), prior)
    assert s.to_bytes() == blob


def test_update_wrong_shape_raises():
    s = FisherState(D)
    with pytest.raises(ValueError):
        s.update(1, np.ones(D + 1), 1.0, 0)
    with pytest.raises(ValueError):
        s.update(1, np.ones((1, D)), 1.0, 0)
    assert s.clients == {}


def test_stored_estimate_is_normalised():
    rng = np.random.default_rng(2)
    s = FisherState(D)
    f = _fisher(rng) * np.float32(42.0)
    s.update(3, f, 5.0, 4)
    c = s.clients[3]
    assert c.fisher.dtype == np.float32
    assert c.weight == 5.0 and c.round == 4
    np.testing.assert_allclose(c.fisher, _norm(f), rtol=1e-6)
    assert np.mean(c.fisher, dtype=np.float64) == pytest.approx(1.0, rel=1e-6)


# ---------------------------------------------------------------------------
# global prior


def test_mean64_sums_blocks_pairwise_in_order():
    """The documented summation, to the bit: float64 blocks of PRIOR_BLOCK summed pairwise, then in
    order."""
    rng = np.random.default_rng(14)
    for f in (
        _fisher(rng, d=3_000_001),
        rng.lognormal(0, 3, 1000).astype(np.float16),
        rng.lognormal(0, 3, 77),
    ):
        total = 0.0
        for start in range(0, f.size, PRIOR_BLOCK):
            total += float(np.add.reduce(f[start : start + PRIOR_BLOCK].astype(np.float64)))
        assert mean64(f) == total / f.size
        assert mean64(f) == pytest.approx(float(np.mean(f, dtype=np.float64)), rel=1e-14)
    assert np.isnan(mean64(np.zeros(0, dtype=np.float32)))


def test_normalise_divides_in_float64_and_rounds_once():
    """Bit-equal to dividing each value by the float64 mean in float64, then rounding to float32."""
    rng = np.random.default_rng(12)
    for f in (
        _fisher(rng, d=3_000_001),
        rng.lognormal(0, 3, 1000).astype(np.float16),
        rng.lognormal(0, 3, 77),
    ):
        want = (f.astype(np.float64) / mean64(f)).astype(np.float32)
        assert FisherState.normalise(f).tobytes() == want.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 6), st.floats(0.5, 500.0), st.integers(0, 2**31 - 1)),
        min_size=1,
        max_size=12,
    ),
    cap=st.one_of(st.none(), st.integers(1, 4)),
    fp16=st.booleans(),
)
def test_mean_prior_is_the_float64_sum_over_the_stored_estimates_to_the_bit(plan, cap, fp16):
    """After any uploads, replacements and evictions: sum ``w * f`` in float64 in stored order, /
    total, fp32."""
    s = FisherState(D, trim=0.0, max_clients=cap, precision="fp16" if fp16 else "fp32")
    for rnd, (client, w, seed) in enumerate(plan):
        s.update(client, _fisher(np.random.default_rng(seed)), w, rnd)
    stored = list(s.clients.values())
    total = sum(c.weight for c in stored)
    acc = stored[0].fisher.astype(np.float64) * stored[0].weight
    for c in stored[1:]:
        acc += c.fisher.astype(np.float64) * c.weight
    want = np.maximum(acc / total, 0).astype(np.float32)
    assert s.global_prior().tobytes() == want.tobytes()
    restored = FisherState.from_bytes(s.to_bytes())
    assert restored.global_prior().tobytes() == want.tobytes()


def test_state_written_with_a_running_sum_still_loads():
    """A checkpoint of the earlier layout (running sum and total weight stored) restores; the prior
    is recomputed."""
    rng = np.random.default_rng(13)
    s = FisherState(D, trim=0.0)
    for c in range(3):
        s.update(c, _fisher(rng), 10.0 + c, 1)
    with np.load(io.BytesIO(s.to_bytes())) as z:
        arrays = {name: z[name] for name in z.files}
    assert "sum" not in arrays
    buf = io.BytesIO()
    np.savez(buf, **arrays, sum=np.full(D, 123.0), weight=np.array(1.0))
    t = FisherState.from_bytes(buf.getvalue())
    assert t.global_prior().tobytes() == s.global_prior().tobytes()
    assert t.to_bytes() == s.to_bytes()


def test_prior_before_any_upload_is_none():
    assert FisherState(D).global_prior() is None


def test_prior_is_example_weighted_mean_with_replacements():
    rng = np.random.default_rng(3)
    s = FisherState(D)
    latest = {}
    plan = [
        (1, 10.0, 1),
        (2, 30.0, 1),
        (2**64 - 1, 5.0, 2),
        (1, 20.0, 3),  # replacement, new weight
        (3, 1.0, 3),
        (2, 30.0, 4),  # replacement, same weight
        (2**64 - 1, 100.0, 5),
    ]
    for client, w, r in plan:
        f = _fisher(rng) * np.float32(rng.uniform(0.01, 100))
        assert s.update(client, f, w, r)
        latest[client] = (_norm(f), w)
        np.testing.assert_allclose(s.global_prior(), _brute_prior(latest), rtol=1e-5, atol=1e-6)
        assert s.global_prior().dtype == np.float32
    assert set(s.clients) == set(latest)
    for c, (f, w) in latest.items():
        np.testing.assert_allclose(s.clients[c].fisher, f, rtol=1e-6)
        assert s.clients[c].weight == w


def test_prior_weights_matter():
    s = FisherState(2)
    s.update(1, np.array([2.0, 0.0]), 3.0, 0)  # normalised [2, 0]
    s.update(2, np.array([0.0, 2.0]), 1.0, 0)  # normalised [0, 2]
    np.testing.assert_allclose(s.global_prior(), [1.5, 0.5])


@settings(max_examples=40, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 4), st.integers(1, 1000), st.floats(1e-3, 1e3)),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_prior_hypothesis(plan, seed):
    rng = np.random.default_rng(seed)
    s = FisherState(D)
    latest = {}
    for r, (client, w, scale) in enumerate(plan):
        f = _fisher(rng) * np.float32(scale)
        s.update(client, f, float(w), r)
        latest[client] = (_norm(f), float(w))
    np.testing.assert_allclose(s.global_prior(), _brute_prior(latest), rtol=1e-4, atol=1e-5)


def test_scaled_client_yields_same_estimate_and_prior():
    rng = np.random.default_rng(4)
    f = _fisher(rng)
    other = _fisher(rng)
    a, b = FisherState(D), FisherState(D)
    a.update(1, f, 10.0, 1)
    b.update(1, f * np.float32(1e6), 10.0, 1)
    np.testing.assert_allclose(b.clients[1].fisher, a.clients[1].fisher, rtol=1e-6)
    a.update(2, other, 10.0, 1)
    b.update(2, other, 10.0, 1)
    np.testing.assert_allclose(b.global_prior(), a.global_prior(), rtol=1e-6)
    # the huge client does not dominate: the prior is the plain mean of two mean-1 vectors
    np.testing.assert_allclose(b.global_prior(), (_norm(f) + _norm(other)) / 2, rtol=1e-5)


# ---------------------------------------------------------------------------
# staleness


@pytest.mark.parametrize("decay", [0.0, 0.3, 0.7, 1.0])
def test_staleness_blending(decay):
    rng = np.random.default_rng(5)
    s = FisherState(D, staleness_decay=decay)
    fa, fb = _fisher(rng), _fisher(rng)
    s.update(1, fa, 10.0, 3)
    s.update(2, fb, 30.0, 5)
    prior = s.global_prior().astype(np.float64)
    own = s.clients[1].fisher.astype(np.float64)
    for t in (0, 2, 3, 4):  # round after measurement or earlier: fully trusted
        np.testing.assert_array_equal(s.estimate(1, t), s.clients[1].fisher)
    for t in (5, 6, 8, 20):
        trust = decay ** (t - 3 - 1)
        want = trust * own + (1 - trust) * prior
        got = s.estimate(1, t)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # never measured: the prior
    np.testing.assert_array_equal(s.estimate(99, 6), s.global_prior())


def test_staleness_drifts_monotonically_toward_prior():
    rng = np.random.default_rng(6)
    s = FisherState(D, staleness_decay=0.7)
    s.update(1, _fisher(rng), 1.0, 0)
    s.update(2, _fisher(rng), 1.0, 0)
    prior = s.global_prior()
    dist = [np.abs(s.estimate(1, t) - prior).sum() for t in range(1, 12)]
    assert all(a > b for a, b in zip(dist, dist[1:]))
    assert dist[-1] < 0.05 * dist[0]


def test_single_client_estimate_is_own_even_when_stale():
    """With only one client the prior is that client's estimate, so blending changes nothing."""
    rng = np.random.default_rng(7)
    s = FisherState(D, staleness_decay=0.5)
    s.update(1, _fisher(rng), 1.0, 0)
    np.testing.assert_allclose(s.estimate(1, 10), s.clients[1].fisher, rtol=1e-6)


# ---------------------------------------------------------------------------
# EMA


@pytest.mark.parametrize("ema", [0.0, 0.25, 0.9])
def test_ema_mixing(ema):
    rng = np.random.default_rng(8)
    s = FisherState(D, ema=ema)
    f1, f2, f3 = _fisher(rng), _fisher(rng), _fisher(rng)
    s.update(1, f1, 10.0, 1)
    s.update(1, f2, 20.0, 2)
    want = ema * _norm(f1) + (1 - ema) * _norm(f2)
    np.testing.assert_allclose(s.clients[1].fisher, want, rtol=1e-6)
    assert s.clients[1].weight == 20.0 and s.clients[1].round == 2
    s.update(1, f3, 5.0, 4)
    want = ema * want + (1 - ema) * _norm(f3)
    np.testing.assert_allclose(s.clients[1].fisher, want, rtol=1e-5)
    # the prior uses the mixed estimate with the latest weight
    s.update(2, f1, 15.0, 4)
    np.testing.assert_allclose(s.global_prior(), (5.0 * want + 15.0 * _norm(f1)) / 20.0, rtol=1e-5)


def test_ema_first_upload_is_not_mixed():
    rng = np.random.default_rng(9)
    s = FisherState(D, ema=0.5)
    f = _fisher(rng)
    s.update(1, f, 1.0, 0)
    np.testing.assert_allclose(s.clients[1].fisher, _norm(f), rtol=1e-6)


# ---------------------------------------------------------------------------
# checkpoints


def _filled_state(ids, rng, decay=0.6, ema=0.2):
    s = FisherState(D, staleness_decay=decay, ema=ema)
    for r, c in enumerate(ids):
        s.update(c, _fisher(rng), float(rng.integers(1, 500)), r)
    for c in ids[:3]:  # replacements
        s.update(c, _fisher(rng), float(rng.integers(1, 500)), len(ids) + 1)
    return s


def _assert_same(a, b):
    assert b.d == a.d
    assert b.staleness_decay == a.staleness_decay
    assert b.ema == a.ema
    assert set(b.clients) == set(a.clients)
    assert all(type(c) is int for c in b.clients)
    for c in a.clients:
        assert b.clients[c].fisher.dtype == np.float32
        np.testing.assert_array_equal(b.clients[c].fisher, a.clients[c].fisher)
        assert b.clients[c].weight == a.clients[c].weight
        assert b.clients[c].round == a.clients[c].round
        assert type(b.clients[c].round) is int
        assert type(b.clients[c].weight) is float


def test_to_bytes_from_bytes_round_trip_with_uint64_node_ids():
    rng = np.random.default_rng(10)
    s = _filled_state(BIG_IDS, rng)
    blob = s.to_bytes()
    assert isinstance(blob, bytes)
    t = FisherState.from_bytes(blob)
    _assert_same(s, t)
    assert 2**64 - 1 in t.clients and 2**63 in t.clients and 0 in t.clients
    np.testing.assert_allclose(t.global_prior(), s.global_prior(), rtol=1e-6, atol=1e-7)
    for c in BIG_IDS + [12345]:
        np.testing.assert_allclose(t.estimate(c, 30), s.estimate(c, 30), rtol=1e-6, atol=1e-7)
    # serialising the restored state gives the same bytes
    assert t.to_bytes() == blob


def test_restored_state_keeps_working():
    rng = np.random.default_rng(11)
    ids = [5, 2**64 - 1, 2**63 + 5]
    s = _filled_state(ids, rng, ema=0.0)
    t = FisherState.from_bytes(s.to_bytes())
    f = _fisher(rng)
    s.update(2**64 - 1, f, 77.0, 50)
    t.update(2**64 - 1, f, 77.0, 50)
    _assert_same(s, t)
    latest = {c: (s.clients[c].fisher, s.clients[c].weight) for c in s.clients}
    np.testing.assert_allclose(t.global_prior(), _brute_prior(latest), rtol=1e-5)


def test_empty_state_round_trip():
    s = FisherState(D, staleness_decay=0.9, ema=0.1)
    t = FisherState.from_bytes(s.to_bytes())
    _assert_same(s, t)
    assert t.global_prior() is None
    assert t.estimate(1, 1) is None
    t.update(2**64 - 1, np.ones(D), 1.0, 0)
    np.testing.assert_array_equal(t.global_prior(), np.ones(D, dtype=np.float32))


def test_serialised_rows_stay_in_place_and_the_mean_prior_resumes_to_the_bit():
    """Only the uploading client's row (and the small arrays) change; restore gives the same prior
    bits."""
    rng = np.random.default_rng(5)
    s = FisherState(D, trim=0.0, max_clients=3)
    for client, rnd in (
        (1, 1),
        (2, 1),
        (3, 1),
        (1, 2),
        (4, 3),
        (2, 4),
    ):  # re-uploads and an eviction
        s.update(client, _fisher(rng), float(rng.integers(1, 50)), rnd)
    before = s.to_bytes()
    s.update(4, _fisher(rng), 7.0, 5)  # a re-upload: stored are 1, 4 and 2
    after = s.to_bytes()
    row = D * 4
    start = before.find(s.clients[1].fisher.tobytes()) - s._slots[1] * row  # where the rows begin
    assert start > 0 and len(before) == len(after)
    a, b = (np.frombuffer(blob, np.uint8)[start : start + 3 * row] for blob in (before, after))
    changed = np.flatnonzero(a != b)
    assert changed.size and set(changed // row) == {s._slots[4]}  # only client 4 row changed
    t = FisherState.from_bytes(after)
    assert t.to_bytes() == after
    assert t.global_prior().tobytes() == s.global_prior().tobytes()
    u, v = s, t
    for state in (u, v):
        state.update(9, _fisher(np.random.default_rng(1)), 3.0, 6)  # evicts the same client in both
    assert u.to_bytes() == v.to_bytes()


def test_extra_members_follow_the_state_in_one_archive():
    """A method's own arrays ride in the state's archive: the estimates stay in place, both read
    back."""
    rng = np.random.default_rng(11)
    s = FisherState(D, trim=0.0)
    for client in (1, 2):
        s.update(client, _fisher(rng), 5.0, 1)
    held = {
        "held_bits": rng.integers(0, 256, size=(2, (D + 7) // 8), dtype=np.uint8),
        "held_d": np.array(D),
    }
    plain, joined = s.to_bytes(), s.to_bytes(extra=held)
    rows_end = plain.find(
        b"slots.npy"
    )  # the estimates keep their offsets (incremental checkpoints rely on it)
    assert rows_end > 0 and joined[:rows_end] == plain[:rows_end]
    with np.load(io.BytesIO(joined), allow_pickle=False) as z:
        assert z["held_bits"].tobytes() == held["held_bits"].tobytes() and int(z["held_d"]) == D
    assert FisherState.from_bytes(joined).to_bytes() == plain
    with pytest.raises(ValueError, match=r"\['weights'\] would overwrite"):
        s.to_bytes(extra={"weights": np.zeros(2)})
