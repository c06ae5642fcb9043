"""Bounded Fisher memory: fp16 storage and eviction of the stalest clients to the prior."""

from __future__ import annotations

import numpy as np
import pytest

from common.fisher.state import FisherState, fisher_capacity

D = 1000


def _uploads(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.lognormal(0, 2, D) for _ in range(n)]


def test_capacity_from_budget():
    assert fisher_capacity(1, 2**18, "fp32") == 3  # floor of 3 keeps a trimmed prior possible
    assert (
        fisher_capacity(1024, 11_173_962, "fp16") == 42
    )  # ResNet-18: 22 MB per client, 134 MB fixed
    assert fisher_capacity(1024, 11_173_962, "fp32") == 21


def test_memory_stays_within_the_client_limit_and_stalest_are_evicted():
    s = FisherState(D, max_clients=5, precision="fp16", trim=0.1)
    for i, f in enumerate(_uploads(50)):
        s.update(f"c{i}", f, 10, round=i)
    assert len(s.clients) == 5 and s.evictions == 45
    assert set(s.clients) == {f"c{i}" for i in range(45, 50)}  # the most recent stay
    assert s.memory_bytes() <= 5 * D * 2 + D * 8 + D * 4
    assert s.estimate("c0", 60) is not None and np.array_equal(
        s.estimate("c0", 60), s.global_prior()
    )


def test_eviction_keeps_the_weighted_prior_exact():
    ups = _uploads(6, seed=1)
    bounded, reference = FisherState(D, max_clients=3), FisherState(D)
    for i, f in enumerate(ups):
        bounded.update(i, f, i + 1, round=i)
    for i, f in enumerate(ups[3:], start=3):
        reference.update(i, f, i + 1, round=i)
    np.testing.assert_allclose(bounded.global_prior(), reference.global_prior(), rtol=1e-6)


def test_fp16_storage_changes_rankings_little():
    ups = _uploads(4, seed=2)
    f16, f32 = FisherState(D, precision="fp16"), FisherState(D, precision="fp32")
    for i, f in enumerate(ups):
        f16.update(i, f, 1, 1)
        f32.update(i, f, 1, 1)
    k = D // 10
    top16 = set(np.argsort(-f16.estimate(0, 2))[:k])
    top32 = set(np.argsort(-f32.estimate(0, 2))[:k])
    assert len(top16 ^ top32) <= 0.02 * D
    assert f16.memory_bytes() < f32.memory_bytes()


def test_bounded_state_round_trips():
    s = FisherState(D, max_clients=2, precision="fp16", trim=0.2)
    for i, f in enumerate(_uploads(4)):
        s.update(i, f, 1, i)
    back = FisherState.from_bytes(s.to_bytes())
    assert back.max_clients == 2 and back.precision == "fp16" and back.evictions == 2
    assert all(np.array_equal(back.clients[k].fisher, s.clients[k].fisher) for k in s.clients)
    with pytest.raises(ValueError):
        FisherState(D, precision="fp8")
