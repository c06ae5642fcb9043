"""The ``ranked`` Fisher upload: the largest entries model-wide in the bytes of ``masked``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.codec import decode_fisher, encode_fisher, expected_names, ranked_count
from common.fisher.selection import select_mask, topk_mask
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.wire.mask_codec import encode_mask, mask_kind

SMALL = {"c.w": (6, 2, 2), "c.b": (6,), "f.w": (4, 7), "f.b": (4,)}


def _nbytes(payload) -> int:
    return sum(a.nbytes for a in payload.values())


def _set_cost(order: np.ndarray, m: int) -> int:
    mask = np.zeros(order.size, dtype=bool)
    mask[order[:m]] = True
    return int(encode_mask(mask)[1].nbytes) + m


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 3000), budget=st.integers(0, 4000), seed=st.integers(0, 10**6))
def test_ranked_count_is_the_largest_m_that_fits(d, budget, seed):
    order = np.random.default_rng(seed).permutation(d)
    m = ranked_count(d, budget)
    fits = [mm for mm in range(d + 1) if _set_cost(order, mm) <= budget]
    assert m == max(fits)


@settings(max_examples=80, deadline=None)
@given(
    d=st.integers(1, 400),
    m=st.integers(0, 420),
    levels=st.integers(1, 6),
    seed=st.integers(0, 10**6),
)
def test_ranked_set_is_the_head_of_a_stable_descending_sort(d, m, levels, seed):
    values = np.random.default_rng(seed).integers(0, levels, d).astype(np.float64)  # many ties
    want = np.zeros(d, dtype=bool)
    want[np.argsort(-values, kind="stable")[:m]] = True
    np.testing.assert_array_equal(
        topk_mask(values, min(m, d)), want
    )  # the selection ranked encodes with


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 5000), seed=st.integers(0, 10**6))
def test_mask_kind_is_what_encode_mask_writes(d, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random(d) < rng.choice([0.0, 0.01, 0.2, 0.7, 1.0])
    kind, data = encode_mask(mask)
    assert mask_kind(d, int(mask.sum())) == (kind, data.nbytes)


@pytest.fixture(scope="module")
def cnn():
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    fisher = np.random.default_rng(0).lognormal(0, 2, layout.size).astype(np.float32)
    return layout, x, fisher


@pytest.mark.parametrize("gamma", [1.0, 1 / 4, 1 / 16, 1 / 64])
def test_ranked_fits_the_bytes_of_masked_and_sends_the_largest_values(cnn, gamma):
    layout, x, fisher = cnn
    mask = select_mask(layout, x, gamma, "magnitude")
    ranked = encode_fisher(fisher, mask, layout, "ranked")
    masked = encode_fisher(fisher, mask, layout, "masked")
    assert set(ranked) == expected_names("ranked")
    assert _nbytes(ranked) <= _nbytes(masked)
    out = decode_fisher(ranked, mask, layout, "ranked")
    m = ranked["fisher.setlog8"].size
    order = np.argsort(-fisher.astype(np.float64), kind="stable")
    sent = np.zeros(layout.size, dtype=bool)
    sent[order[:m]] = True
    assert m > int(mask.sum()) or gamma == 1.0  # more positions than masked's exact inside values
    # 8-bit log codes over the sent range: relative error at most half a step
    lo, hi = np.log(fisher[sent].min()), np.log(fisher[sent].max())
    step = (hi - lo) / 253
    np.testing.assert_allclose(np.log(out[sent]), np.log(fisher[sent]), atol=step / 2 + 1e-5)
    # unsent: their row's mean over unsent positions, never above the smallest sent value
    rows = layout.row_ids
    for r in np.unique(rows[~sent]):
        here = (~sent) & (rows == r)
        want = min(float(fisher[here].astype(np.float64).mean()), float(out[sent].min()))
        np.testing.assert_allclose(out[here], want, rtol=1e-6)


def test_ranked_keeps_the_ranking_the_row_means_of_masked_lose():
    """A client whose large Fisher lies outside its mask: masked hides it in a row mean, ranked
    sends it."""
    layout = ParamLayout.from_arrays({n: np.zeros(s) for n, s in SMALL.items()})
    d = layout.size
    fisher = np.full(d, 1e-3)
    mask = np.zeros(d, dtype=bool)
    mask[:10] = True
    hot = np.array([30, 41, 50])  # outside the mask, in rows that also hold cold positions
    fisher[hot] = 5.0
    ranked = decode_fisher(encode_fisher(fisher, mask, layout, "ranked"), mask, layout, "ranked")
    masked = decode_fisher(encode_fisher(fisher, mask, layout, "masked"), mask, layout, "masked")
    top3 = np.argsort(-ranked, kind="stable")[:3]
    assert sorted(top3.tolist()) == hot.tolist()
    assert sorted(np.argsort(-masked, kind="stable")[:3].tolist()) != hot.tolist()


def _valid():
    layout = ParamLayout.from_arrays({n: np.zeros(s) for n, s in SMALL.items()})
    rng = np.random.default_rng(1)
    fisher = rng.exponential(size=layout.size)
    mask = rng.random(layout.size) < 0.3
    return layout, mask, dict(encode_fisher(fisher, mask, layout, "ranked"))


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("fisher.setkind", np.array([9], np.uint8), "mask kind"),
        ("fisher.setkind", np.array([1, 1], np.uint8), "setkind"),
        ("fisher.set", np.zeros(3, np.float32), "mask"),
        ("fisher.setlog8", np.zeros(1, np.uint8), "setlog8"),
        ("fisher.rowmean", "negative", "negative"),
        ("fisher.rowmean", "nan", "NaN"),
        ("fisher.log8range", np.array([1.0, 0.0], np.float32), "low <= high"),
    ],
)
def test_a_malformed_ranked_payload_is_rejected_with_its_reason(name, value, match):
    layout, mask, payload = _valid()
    if isinstance(value, str):  # a row-mean vector of the right length with one bad entry
        bad = payload[name].copy()
        bad[0] = -1.0 if value == "negative" else np.nan
        value = bad
    payload[name] = value
    with pytest.raises(ValueError, match=match):
        decode_fisher(payload, mask, layout, "ranked")


def test_a_ranked_payload_without_its_position_set_is_rejected():
    layout, mask, payload = _valid()
    del payload["fisher.set"]
    with pytest.raises(ValueError, match="fisher.set"):
        decode_fisher(payload, mask, layout, "ranked")
