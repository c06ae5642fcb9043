"""The published alternatives to the holder mean, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.aggregation.masked import MaskedUpdate
from common.aggregation.update_means import participant_mean_step


def _updates(seed: int, d: int, n: int) -> list[MaskedUpdate]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        idx = np.sort(rng.choice(d, size=int(rng.integers(0, d + 1)), replace=False)).astype(
            np.int64
        )
        out.append(
            MaskedUpdate(
                idx, rng.normal(size=idx.size).astype(np.float32), float(rng.integers(1, 100))
            )
        )
    return out


@given(st.integers(0, 2**31 - 1), st.integers(1, 25), st.integers(1, 6), st.floats(0.1, 2.0))
@settings(max_examples=60, deadline=None)
def test_participant_mean_is_fedavg_over_reconstructed_models(seed, d, n, lr):
    """``x + lr * sum_k p_k (w_k - x)`` where ``w_k`` is x with the client's held positions
    replaced."""
    x = np.random.default_rng(seed + 1).normal(size=d).astype(np.float32)
    updates = _updates(seed, d, n)
    total = sum(u.weight for u in updates)
    fedavg = np.zeros(d)
    for u in updates:
        rebuilt = x.astype(np.float64).copy()
        rebuilt[u.indices] += u.delta
        fedavg += u.weight / total * rebuilt
    expected = x + lr * (fedavg - x)
    np.testing.assert_allclose(
        participant_mean_step(x, updates, lr), expected, rtol=1e-5, atol=1e-6
    )


def test_participant_mean_dilutes_a_position_few_clients_held():
    x = np.zeros(3, dtype=np.float32)
    updates = [
        MaskedUpdate(np.array([0, 1]), np.array([1.0, 1.0], np.float32), 1.0),
        MaskedUpdate(np.array([0]), np.array([1.0], np.float32), 3.0),
    ]
    assert participant_mean_step(x, updates).tolist() == [1.0, 0.25, 0.0]


def test_bad_updates_are_refused():
    x = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="positive"):
        participant_mean_step(x, [MaskedUpdate(np.array([0]), np.array([1.0], np.float32), 0.0)])
    with pytest.raises(ValueError, match="outside"):
        participant_mean_step(x, [MaskedUpdate(np.array([3]), np.array([1.0], np.float32), 1.0)])
