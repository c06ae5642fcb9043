"""Wire codecs: submodel masks, submodel payloads and the uplink Fisher encodings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.codec import FISHER_ENCODINGS, decode_fisher, encode_fisher, expected_names
from common.fisher.selection import budget, select_mask
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.wire.mask_codec import (
    decode_mask,
    elias_fano_bytes,
    elias_fano_low_bits,
    encode_elias_fano,
    encode_mask,
    index_dtype,
    mask_digest,
)
from common.wire.protocol import decode_submodel, encode_submodel

# ---------------------------------------------------------------------------
# masks


def _expected_kind_and_bytes(mask):
    """The smallest encoding; among equal sizes indices, then bits, then elias-fano."""
    d, k = mask.size, int(mask.sum())
    if k == d:
        return "full", 0
    sizes = [("indices", k * index_dtype(d).itemsize), ("bits", (d + 7) // 8)]
    if k > 0:
        sizes.append(("elias-fano", elias_fano_bytes(d, k)))
    return min(sizes, key=lambda kind_bytes: kind_bytes[1])


def _check_round_trip(mask):
    kind, data = encode_mask(mask)
    want_kind, want_bytes = _expected_kind_and_bytes(mask)
    assert kind == want_kind
    assert data.nbytes == want_bytes
    back = decode_mask(kind, data, mask.size)
    assert back.dtype == bool
    np.testing.assert_array_equal(back, mask)
    return kind, data


@settings(max_examples=150, deadline=None)
@given(
    d=st.one_of(st.integers(0, 40), st.integers(250, 270), st.integers(65530, 65545)),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_mask_round_trip_hypothesis(d, density, seed):
    rng = np.random.default_rng(seed)
    _check_round_trip(rng.random(d) < density)


@pytest.mark.parametrize("d", [1, 7, 8, 9, 255, 256, 257, 1000, 65536, 65537, 100_000])
def test_mask_round_trip_edge_masks(d):
    kind, data = _check_round_trip(np.zeros(d, dtype=bool))
    assert kind == "indices" and data.size == 0
    kind, data = _check_round_trip(np.ones(d, dtype=bool))
    assert kind == "full" and data.nbytes == 0
    for j in {0, d // 2, d - 1}:
        single = np.zeros(d, dtype=bool)
        single[j] = True
        _check_round_trip(single)
        if d > 1:
            assert _check_round_trip(~single)[0] == "bits"


def test_empty_model_mask():
    kind, data = encode_mask(np.zeros(0, dtype=bool))
    assert kind == "full"
    assert decode_mask(kind, data, 0).shape == (0,)


@pytest.mark.parametrize(
    ("d", "dtype"),
    [
        (1, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (65536, np.uint16),
        (65537, np.uint32),
        (2**32, np.uint32),
    ],
)
def test_index_dtype_is_narrowest(d, dtype):
    assert index_dtype(d) == np.dtype(dtype)


def test_index_dtype_large():
    assert index_dtype(2**32 + 1) == np.dtype(np.uint64)


def test_mask_bytes_scale_with_gamma():
    d = 151_306
    rng = np.random.default_rng(0)
    sizes = {}
    for gamma in (1 / 128, 1 / 64, 1 / 16, 1 / 4, 1 / 2):
        k = math.ceil(gamma * d)
        mask = np.zeros(d, dtype=bool)
        mask[rng.choice(d, size=k, replace=False)] = True
        kind, data = encode_mask(mask)
        sizes[gamma] = (kind, data.nbytes)
    # sparse: Elias-Fano, about k (2 + log2(d / k)) bits, so bytes shrink with gamma
    for gamma in (1 / 128, 1 / 64, 1 / 16):
        k = math.ceil(gamma * d)
        assert sizes[gamma] == ("elias-fano", elias_fano_bytes(d, k))
        assert sizes[gamma][1] <= 8 + k * (2 + math.log2(d / k)) / 8 + 2
    assert sizes[1 / 128][1] < sizes[1 / 64][1] < sizes[1 / 16][1]
    # dense: bits, capped at ceil(d / 8) whatever gamma
    for gamma in (1 / 4, 1 / 2):
        assert sizes[gamma] == ("bits", (d + 7) // 8)
    assert all(nb <= (d + 7) // 8 for _, nb in sizes.values())


def test_decode_mask_unknown_kind():
    with pytest.raises(ValueError):
        decode_mask("rle", np.zeros(1, dtype=np.uint8), 8)


def test_decode_full_with_data_rejected():
    with pytest.raises(ValueError):
        decode_mask("full", np.zeros(1, dtype=np.uint8), 8)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(2, dtype=np.uint16),  # wrong dtype
        np.zeros(2, dtype=np.int8),
        np.zeros(2, dtype=np.float32),
        np.zeros(1, dtype=np.uint8),  # too short (d = 10 needs 2 bytes)
        np.zeros(3, dtype=np.uint8),  # too long
        np.zeros((2, 1), dtype=np.uint8),  # wrong ndim
    ],
)
def test_decode_bits_rejects_wrong_dtype_or_length(data):
    with pytest.raises(ValueError):
        decode_mask("bits", data, 10)


@pytest.mark.parametrize("pad", [0b0000_0001, 0b0000_0010, 0b0000_0100, 0b0000_0111])
def test_decode_bits_rejects_set_padding_bits(pad):
    # d = 5: the low 3 bits of the single byte are padding (packbits is MSB-first)
    ok = np.array([0b1010_1000], dtype=np.uint8)
    np.testing.assert_array_equal(decode_mask("bits", ok, 5), [True, False, True, False, True])
    with pytest.raises(ValueError, match="padding"):
        decode_mask("bits", ok | np.uint8(pad), 5)


@pytest.mark.parametrize(
    "idx",
    [
        [3, 1],  # unsorted
        [1, 5, 4],
        [2, 2],  # duplicate
        [0, 10],  # out of range (d = 10)
        [10],
        [255],
    ],
)
def test_decode_indices_rejects_bad_indices(idx):
    with pytest.raises(ValueError):
        decode_mask("indices", np.array(idx, dtype=np.uint8), 10)


@pytest.mark.parametrize(
    "data",
    [np.array([1, 2], dtype=np.int64), np.array([1.0, 2.0]), np.array([[1, 2]], dtype=np.uint8)],
)
def test_decode_indices_rejects_non_unsigned_or_2d(data):
    with pytest.raises(ValueError):
        decode_mask("indices", data, 10)


@pytest.mark.parametrize("idx", [[2**64 - 1], [2**63], [2**64 - 5, 2**64 - 3], [3, 2**64 - 1]])
def test_decode_indices_rejects_huge_uint64_indices(idx):
    """uint64 indices >= 2**63 wrap to negative int64 and must still be rejected as out of range."""
    with pytest.raises(ValueError):
        decode_mask("indices", np.array(idx, dtype=np.uint64), 10)


def test_decode_submodel_rejects_wrapped_uint64_index():
    """A single index 2**64 - 1 would otherwise land on position d - 1 (it wraps to -1)."""
    with pytest.raises(ValueError):
        decode_submodel(
            np.ones(1, dtype=np.float32), "indices", np.array([2**64 - 1], dtype=np.uint64), 10
        )


def test_decode_indices_requires_the_canonical_dtype():
    # The encoder always uses the narrowest dtype for d; anything else is a malformed reply.
    np.testing.assert_array_equal(
        np.flatnonzero(decode_mask("indices", np.array([1, 4], np.uint8), 10)), [1, 4]
    )
    with pytest.raises(ValueError, match="uint8"):
        decode_mask("indices", np.array([1, 4], dtype=np.uint32), 10)


def test_mask_digest_stable_and_distinct():
    rng = np.random.default_rng(1)
    masks = [rng.random(500) < p for p in (0.01, 0.3, 0.3, 0.9)] + [np.ones(500, dtype=bool)]
    digests = [mask_digest(*encode_mask(m)) for m in masks]
    assert digests == [mask_digest(*encode_mask(m.copy())) for m in masks]
    assert len(set(digests)) == len(digests)
    assert all(isinstance(dg, str) and len(dg) == 16 for dg in digests)


# ---------------------------------------------------------------------------
# submodel payload


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 600),
    density=st.sampled_from([0.0, 0.01, 0.2, 0.7, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_submodel_round_trip(d, density, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d).astype(np.float32)
    mask = rng.random(d) < density
    p = encode_submodel(x, mask)
    assert p.values.dtype == np.float32
    np.testing.assert_array_equal(p.values, x[mask])
    assert p.digest == mask_digest(p.mask_kind, p.mask_data)
    assert p.nbytes == p.values.nbytes + p.mask_data.nbytes
    dense, back = decode_submodel(p.values, p.mask_kind, p.mask_data, d)
    np.testing.assert_array_equal(back, mask)
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense[mask], x[mask])
    np.testing.assert_array_equal(dense[~mask], 0.0)


def test_submodel_digest_stable_and_mask_dependent():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(300).astype(np.float32)
    m1 = rng.random(300) < 0.3
    m2 = m1.copy()
    m2[np.flatnonzero(~m1)[0]] = True
    a, b = encode_submodel(x, m1), encode_submodel(x.copy(), m1.copy())
    assert a.digest == b.digest
    assert encode_submodel(x, m2).digest != a.digest
    # the digest is over the mask only: other values, same mask -> same digest
    assert encode_submodel(x + 1, m1).digest == a.digest


def test_submodel_bytes_scale_with_gamma():
    d = 100_000
    x = np.ones(d, dtype=np.float32)
    rng = np.random.default_rng(0)
    sizes = []
    for gamma in (1 / 16, 1 / 4, 1 / 2, 1.0):
        k = math.ceil(gamma * d)
        mask = np.zeros(d, dtype=bool)
        mask[rng.choice(d, size=k, replace=False)] = True
        sizes.append(encode_submodel(x, mask).nbytes)
    assert sizes == sorted(sizes)
    assert sizes[0] < 0.2 * sizes[-1]


def _payload():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(50).astype(np.float32)
    mask = rng.random(50) < 0.4
    return encode_submodel(x, mask), int(mask.sum())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda v: v[:-1],
        lambda v: np.concatenate([v, v[:1]]),
        lambda v: v.astype(np.float64),
        lambda v: v.astype(np.float16),
        lambda v: v.reshape(1, -1),
        lambda v: np.where(np.arange(v.size) == 0, np.float32(np.nan), v).astype(np.float32),
        lambda v: np.where(np.arange(v.size) == 1, np.float32(np.inf), v).astype(np.float32),
        lambda v: np.where(np.arange(v.size) == 1, np.float32(-np.inf), v).astype(np.float32),
    ],
)
def test_decode_submodel_rejects_bad_values(mutate):
    p, _ = _payload()
    with pytest.raises(ValueError):
        decode_submodel(mutate(p.values), p.mask_kind, p.mask_data, 50)


def test_decode_submodel_rejects_bad_mask():
    p, _ = _payload()
    with pytest.raises(ValueError):
        decode_submodel(p.values, "bogus", p.mask_data, 50)
    with pytest.raises(ValueError):
        decode_submodel(p.values, p.mask_kind, p.mask_data, 40)


# ---------------------------------------------------------------------------
# Fisher encodings

SMALL = {"c.w": (6, 2, 2), "c.b": (6,), "f.w": (4, 7), "f.b": (4,)}


def _small_case(seed=0, gamma=0.3, zeros=0.2):
    rng = np.random.default_rng(seed)
    layout = ParamLayout.from_arrays({n: np.zeros(s) for n, s in SMALL.items()})
    d = layout.size
    fisher = rng.exponential(size=d) * (rng.random(d) >= zeros)
    x = rng.standard_normal(d)
    mask = select_mask(layout, x, gamma, "fisher", fisher, 1)
    return layout, fisher, mask


@pytest.mark.parametrize("seed", range(5))
def test_fisher_dense_round_trips_exactly(seed):
    layout, fisher, mask = _small_case(seed)
    f32 = fisher.astype(np.float32)
    payload = encode_fisher(f32, mask, layout, "dense")
    assert set(payload) == expected_names("dense")
    out = decode_fisher(payload, mask, layout, "dense")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, f32)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [0.05, 0.3, 0.7, 1.0])
def test_fisher_masked_exact_inside_row_mean_outside(seed, gamma):
    layout, fisher, mask = _small_case(seed, gamma)
    f32 = fisher.astype(np.float32)
    payload = encode_fisher(f32, mask, layout, "masked")
    assert set(payload) == expected_names("masked")
    assert payload["fisher.inside"].shape == (int(mask.sum()),)
    assert payload["fisher.rowmean"].shape == (layout.num_rows,)
    out = decode_fisher(payload, mask, layout, "masked")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[mask], f32[mask])
    for r in range(layout.num_rows):
        outside = (layout.row_ids == r) & ~mask
        if outside.any():
            want = np.float32(np.mean(f32[outside].astype(np.float64)))
            np.testing.assert_allclose(out[outside], want, rtol=1e-6)
            assert np.all(out[outside] == out[outside][0])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [0.05, 0.3, 1.0])
def test_fisher_topm_exact_at_top_positions(seed, gamma):
    layout, fisher, mask = _small_case(seed, gamma)
    f32 = fisher.astype(np.float32)
    m = int(mask.sum())
    payload = encode_fisher(f32, mask, layout, "topm")
    assert set(payload) == expected_names("topm")
    idx = payload["fisher.topidx"].astype(np.int64)
    assert idx.size == m
    assert np.all(np.diff(idx) > 0)
    # the kept positions carry the m largest values
    np.testing.assert_array_equal(np.sort(f32[idx]), np.sort(f32)[f32.size - m :])
    out = decode_fisher(payload, mask, layout, "topm")
    np.testing.assert_array_equal(out[idx], f32[idx])
    rest = np.ones(f32.size, dtype=bool)
    rest[idx] = False
    if rest.any():
        np.testing.assert_allclose(out[rest], np.mean(f32[rest].astype(np.float64)), rtol=1e-6)


def test_fisher_topm_with_empty_mask():
    layout, fisher, _ = _small_case(0)
    mask = np.zeros(layout.size, dtype=bool)
    out = decode_fisher(encode_fisher(fisher, mask, layout, "topm"), mask, layout, "topm")
    np.testing.assert_allclose(out, np.mean(fisher), rtol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_fisher_log8_relative_error_and_zeros(seed):
    layout, _, mask = _small_case(seed)
    rng = np.random.default_rng(100 + seed)
    d = layout.size
    # positive values over six decades, some exact zeros
    fisher = (10.0 ** rng.uniform(-4, 2, size=d)) * (rng.random(d) >= 0.25)
    f32 = fisher.astype(np.float32)
    payload = encode_fisher(f32, mask, layout, "log8")
    assert set(payload) == expected_names("log8")
    assert payload["fisher.log8"].dtype == np.uint8
    assert payload["fisher.log8"].nbytes == d
    out = decode_fisher(payload, mask, layout, "log8")
    zero = f32 == 0
    np.testing.assert_array_equal(out[zero], 0.0)
    assert np.all(out[~zero] > 0)
    pos = f32[~zero].astype(np.float64)
    span = np.log(pos.max()) - np.log(pos.min())
    bound = math.expm1(span / 253 / 2) + 1e-5  # half a quantisation step in log space
    rel = np.abs(out[~zero] - pos) / pos
    assert rel.max() <= bound
    assert rel.max() < 0.05
    # the extremes are (almost) exact
    np.testing.assert_allclose(out[np.argmax(f32)], pos.max(), rtol=1e-5)
    np.testing.assert_allclose(out[np.argmin(np.where(zero, np.inf, f32))], pos.min(), rtol=1e-5)


@pytest.mark.parametrize(
    "fisher",
    [
        lambda d: np.zeros(d),
        lambda d: np.full(d, 2.5),
        lambda d: np.r_[np.zeros(d - 1), 3.0],
        lambda d: np.full(d, 1e-30),
    ],
)
def test_fisher_log8_degenerate_vectors(fisher):
    layout, _, mask = _small_case(0)
    f32 = fisher(layout.size).astype(np.float32)
    out = decode_fisher(encode_fisher(f32, mask, layout, "log8"), mask, layout, "log8")
    np.testing.assert_allclose(out, f32, rtol=1e-5)
    np.testing.assert_array_equal(out == 0, f32 == 0)


def _nbytes(payload):
    return sum(a.nbytes for a in payload.values())


@pytest.fixture(scope="module")
def cnn():
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    rng = np.random.default_rng(0)
    fisher = rng.exponential(size=layout.size).astype(np.float32)
    return layout, x, fisher


def test_fisher_payload_sizes_scale_with_gamma(cnn):
    layout, x, fisher = cnn
    sizes = {}
    for gamma in (1 / 16, 1 / 2):
        mask = select_mask(layout, x, gamma, "fisher", fisher, 1)
        sizes[gamma] = {
            mode: _nbytes(encode_fisher(fisher, mask, layout, mode)) for mode in FISHER_ENCODINGS
        }
        k = int(mask.sum())
        assert sizes[gamma]["masked"] == 4 * k + 4 * layout.num_rows
        assert sizes[gamma]["topm"] == k * (4 + index_dtype(layout.size).itemsize) + 4
        assert sizes[gamma]["dense"] == 4 * layout.size
        assert sizes[gamma]["log8"] == layout.size + 8
    for mode in ("masked", "topm"):
        assert sizes[1 / 16][mode] < 0.2 * sizes[1 / 2][mode]
    for mode in ("dense", "log8"):
        assert sizes[1 / 16][mode] == sizes[1 / 2][mode]


@pytest.mark.parametrize("gamma", [1.0, 1 / 2, 1 / 4, 1 / 16])
def test_default_masked_payload_within_twice_update_bytes(cnn, gamma):
    layout, x, fisher = cnn
    mask = select_mask(layout, x, gamma, "fisher", fisher, 1)
    assert int(mask.sum()) >= budget(gamma, layout.size)
    update_bytes = np.zeros(int(mask.sum()), dtype=np.float32).nbytes
    payload = encode_fisher(fisher, mask, layout, "masked")
    assert _nbytes(payload) <= 2 * update_bytes
    out = decode_fisher(payload, mask, layout, "masked")
    np.testing.assert_array_equal(out[mask], fisher[mask])


# --- decode_fisher validation


def _valid(mode):
    layout, fisher, mask = _small_case(1, 0.3)
    return layout, mask, {n: a.copy() for n, a in encode_fisher(fisher, mask, layout, mode).items()}


FLOAT_ARRAYS = [
    ("dense", "fisher.dense"),
    ("masked", "fisher.inside"),
    ("masked", "fisher.rowmean"),
    ("topm", "fisher.topval"),
    ("topm", "fisher.rest"),
]


@pytest.mark.parametrize("mode", FISHER_ENCODINGS)
def test_decode_fisher_accepts_valid_payload(mode):
    layout, mask, payload = _valid(mode)
    out = decode_fisher(payload, mask, layout, mode)
    assert out.shape == (layout.size,)
    assert out.dtype == np.float32
    assert np.all(np.isfinite(out)) and np.all(out >= 0)


@pytest.mark.parametrize("mode", FISHER_ENCODINGS)
def test_decode_fisher_rejects_missing_array(mode):
    layout, mask, payload = _valid(mode)
    for name in expected_names(mode):
        broken = {n: a for n, a in payload.items() if n != name}
        with pytest.raises(ValueError, match="missing"):
            decode_fisher(broken, mask, layout, mode)


@pytest.mark.parametrize("mode", FISHER_ENCODINGS)
def test_decode_fisher_rejects_extra_array(mode):
    layout, mask, payload = _valid(mode)
    payload["fisher.extra"] = np.zeros(1, dtype=np.float32)
    with pytest.raises(ValueError, match="unexpected"):
        decode_fisher(payload, mask, layout, mode)


@pytest.mark.parametrize("mode", ["masked", "topm", "log8"])
def test_decode_fisher_rejects_arrays_of_other_modes(mode):
    layout, mask, payload = _valid(mode)
    payload["fisher.dense"] = np.zeros(layout.size, dtype=np.float32)
    with pytest.raises(ValueError):
        decode_fisher(payload, mask, layout, mode)


@pytest.mark.parametrize(
    ("mode", "name", "dtype"),
    [
        ("dense", "fisher.dense", np.float64),
        ("dense", "fisher.dense", np.float16),
        ("masked", "fisher.inside", np.float64),
        ("masked", "fisher.rowmean", np.int32),
        ("topm", "fisher.topval", np.float64),
        ("topm", "fisher.rest", np.float64),
        ("topm", "fisher.topidx", np.int64),
        ("topm", "fisher.topidx", np.uint32),
        ("log8", "fisher.log8", np.int8),
        ("log8", "fisher.log8", np.uint16),
        ("log8", "fisher.log8range", np.float64),
    ],
)
def test_decode_fisher_rejects_wrong_dtype(mode, name, dtype):
    layout, mask, payload = _valid(mode)
    payload[name] = payload[name].astype(dtype)
    with pytest.raises(ValueError):
        decode_fisher(payload, mask, layout, mode)


@pytest.mark.parametrize(
    ("mode", "name"),
    [
        ("dense", "fisher.dense"),
        ("masked", "fisher.inside"),
        ("masked", "fisher.rowmean"),
        ("topm", "fisher.topval"),
        ("topm", "fisher.rest"),
        ("log8", "fisher.log8"),
        ("log8", "fisher.log8range"),
    ],
)
@pytest.mark.parametrize("change", ["short", "long", "2d"])
def test_decode_fisher_rejects_wrong_length(mode, name, change):
    layout, mask, payload = _valid(mode)
    a = payload[name]
    if change == "short":
        payload[name] = a[:-1]
    elif change == "long":
        payload[name] = np.concatenate([a, a[:1]])
    else:
        payload[name] = a.reshape(1, -1)
    with pytest.raises(ValueError):
        decode_fisher(payload, mask, layout, mode)


@pytest.mark.parametrize(("mode", "name"), FLOAT_ARRAYS + [("log8", "fisher.log8range")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_decode_fisher_rejects_non_finite(mode, name, bad):
    layout, mask, payload = _valid(mode)
    payload[name][0] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        decode_fisher(payload, mask, layout, mode)


@pytest.mark.parametrize(("mode", "name"), FLOAT_ARRAYS)
def test_decode_fisher_rejects_negative(mode, name):
    layout, mask, payload = _valid(mode)
    payload[name][0] = -1e-6
    with pytest.raises(ValueError, match="negative"):
        decode_fisher(payload, mask, layout, mode)


def test_decode_fisher_log8range_may_be_negative():
    layout, mask, payload = _valid("log8")
    assert payload["fisher.log8range"][0] < 0  # small values have negative logs
    decode_fisher(payload, mask, layout, "log8")


def test_decode_fisher_rejects_log8range_low_above_high():
    layout, mask, payload = _valid("log8")
    lo, hi = payload["fisher.log8range"]
    payload["fisher.log8range"] = np.array([hi, lo], dtype=np.float32)
    with pytest.raises(ValueError, match="low"):
        decode_fisher(payload, mask, layout, "log8")


def test_decode_fisher_rejects_log8_overflow():
    layout, mask, payload = _valid("log8")
    payload["fisher.log8range"] = np.array([0.0, 200.0], dtype=np.float32)
    payload["fisher.log8"][0] = 254
    with np.errstate(over="ignore"), pytest.raises(ValueError):
        decode_fisher(payload, mask, layout, "log8")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda i, d: i[::-1],  # unsorted
        lambda i, d: np.r_[i[:1], i[:1], i[2:]],  # duplicate
        lambda i, d: np.r_[i[:-1], d],  # last index == d
        lambda i, d: np.r_[i[:-1], d + 3],
    ],
)
def test_decode_fisher_rejects_bad_topidx(mutate):
    layout, mask, payload = _valid("topm")
    idx = payload["fisher.topidx"]
    assert idx.size >= 3
    payload["fisher.topidx"] = mutate(idx.astype(np.int64), layout.size).astype(idx.dtype)
    with pytest.raises(ValueError):
        decode_fisher(payload, mask, layout, "topm")


def test_decode_fisher_rejects_unknown_mode():
    layout, mask, payload = _valid("dense")
    with pytest.raises(ValueError, match="unknown"):
        decode_fisher(payload, mask, layout, "fp16")
    with pytest.raises(ValueError, match="unknown"):
        decode_fisher({}, mask, layout, "fp16")
    with pytest.raises(ValueError, match="unknown"):
        encode_fisher(np.ones(layout.size), mask, layout, "fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown"):
        expected_names("fp16")


def test_decode_fisher_does_not_alias_payload():
    layout, mask, payload = _valid("dense")
    out = decode_fisher(payload, mask, layout, "dense")
    out[:] = 123.0
    assert not np.any(payload["fisher.dense"] == 123.0)
    layout, mask, payload = _valid("masked")
    before = payload["fisher.inside"].copy()
    out = decode_fisher(payload, mask, layout, "masked")
    out[:] = 123.0
    np.testing.assert_array_equal(payload["fisher.inside"], before)


# ---------------------------------------------------------------------------
# Elias-Fano masks


def _log2_binomial(d, k):
    return (math.lgamma(d + 1) - math.lgamma(k + 1) - math.lgamma(d - k + 1)) / math.log(2)


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(2, 5000),
    k_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_elias_fano_round_trip_and_size(d, k_frac, seed):
    rng = np.random.default_rng(seed)
    k = min(max(int(k_frac * d), 1), d - 1)
    mask = np.zeros(d, dtype=bool)
    mask[rng.choice(d, size=k, replace=False)] = True
    data = encode_elias_fano(np.flatnonzero(mask), d)
    assert data.dtype == np.uint8 and data.nbytes == elias_fano_bytes(d, k)
    np.testing.assert_array_equal(decode_mask("elias-fano", data, d), mask)
    # within the header, byte rounding and about two bits per kept position of the mask's entropy
    assert 8 * data.nbytes <= _log2_binomial(d, k) + 2 * k + 8 * 10


@pytest.mark.parametrize("gamma", [1 / 4, 1 / 16, 1 / 64, 1 / 256])
def test_download_near_information_limit_on_a_large_model(gamma):
    """Values plus mask within 1.1x of 4k + log2 C(d, k) / 8 bytes at every capacity down to 1/64
    and below."""
    d = 1_000_003
    k = math.ceil(gamma * d)
    mask = np.zeros(d, dtype=bool)
    mask[np.random.default_rng(1).choice(d, size=k, replace=False)] = True
    _, data = encode_mask(mask)
    assert (4 * k + data.nbytes) <= 1.1 * (4 * k + _log2_binomial(d, k) / 8)


def _ef(idx, d):
    return encode_elias_fano(np.array(idx), d)


@pytest.mark.parametrize(
    ("data", "d", "why"),
    [
        (np.zeros(3, dtype=np.uint8), 100, "at least"),
        (_ef([1, 5, 9], 100).astype(np.uint16), 100, "uint8"),
        (_ef([1, 5, 9], 100)[:-1], 100, "bytes"),
        (np.concatenate([_ef([1, 5, 9], 100), [0]]).astype(np.uint8), 100, "bytes"),
        (np.concatenate([np.array([0] * 8, np.uint8), _ef([1, 5, 9], 100)[8:]]), 100, "k=0"),
        (
            np.concatenate([np.array([200] + [0] * 7, np.uint8), _ef([1, 5, 9], 100)[8:]]),
            100,
            "k=200",
        ),
    ],
)
def test_elias_fano_rejects_malformed_data(data, d, why):
    with pytest.raises(ValueError, match=why):
        decode_mask("elias-fano", data, d)


def test_elias_fano_rejects_padding_extra_high_bits_and_disorder():
    d = 100
    good = _ef([3, 40, 41, 90], d)
    padded = good.copy()
    padded[-1] |= 1  # the last byte holds padding after the high bits
    with pytest.raises(ValueError, match="padding"):
        decode_mask("elias-fano", padded, d)
    low = elias_fano_low_bits(d, 4)
    extra = good.copy()
    extra[8 + (4 * low + 7) // 8] |= 0b0100_0000  # one more high part than declared
    with pytest.raises(ValueError, match="high parts"):
        decode_mask("elias-fano", extra, d)
    # equal high parts with decreasing low bits: 41 then 40 is not increasing
    swapped = _ef([3, 40, 41, 90], d)
    lows = np.unpackbits(swapped[8 : 8 + (4 * low + 7) // 8])
    lows[low : 2 * low], lows[2 * low : 3 * low] = (
        lows[2 * low : 3 * low].copy(),
        lows[low : 2 * low].copy(),
    )
    swapped[8 : 8 + (4 * low + 7) // 8] = np.packbits(lows)
    with pytest.raises(ValueError, match="strictly increasing"):
        decode_mask("elias-fano", swapped, d)
