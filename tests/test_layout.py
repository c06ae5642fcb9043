"""ParamLayout: the one flat index space that masks, Fisher vectors and payloads share."""

from __future__ import annotations

import numpy as np
import pytest

from common.models.layout import ParamLayout, TensorSpec

SHAPES = {
    "conv.weight": (4, 2, 3, 3),
    "conv.bias": (4,),
    "fc.weight": (3, 5),
    "fc.bias": (3,),
    "scale": (),
}


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _layout():
    return ParamLayout.from_arrays(_arrays())


def test_tensor_spec_size_and_rows():
    assert TensorSpec("w", (4, 2, 3, 3)).size == 72
    assert TensorSpec("w", (4, 2, 3, 3)).rows == 4
    assert TensorSpec("w", (3, 5)).rows == 3
    assert TensorSpec("b", (7,)).rows == 1
    assert TensorSpec("b", (7,)).size == 7
    assert TensorSpec("s", ()).size == 1
    assert TensorSpec("s", ()).rows == 1


def test_from_arrays_keeps_order_and_shapes():
    layout = _layout()
    assert layout.names == list(SHAPES)
    assert [t.shape for t in layout.tensors] == list(SHAPES.values())


def test_offsets_and_size():
    layout = _layout()
    sizes = [int(np.prod(s, dtype=np.int64)) for s in SHAPES.values()]
    expected = np.concatenate([[0], np.cumsum(sizes)])
    np.testing.assert_array_equal(layout.offsets, expected)
    assert layout.offsets.dtype == np.int64
    assert layout.size == sum(sizes) == 72 + 4 + 15 + 3 + 1


def test_row_ids_match_brute_force():
    layout = _layout()
    expected = []
    base = 0
    for shape in SHAPES.values():
        if len(shape) >= 2:
            per_row = int(np.prod(shape[1:], dtype=np.int64))
            for r in range(shape[0]):
                expected += [base + r] * per_row
            base += shape[0]
        else:
            expected += [base] * int(np.prod(shape, dtype=np.int64))
            base += 1
    np.testing.assert_array_equal(layout.row_ids, expected)
    assert layout.row_ids.shape == (layout.size,)
    assert layout.num_rows == base == 4 + 1 + 3 + 1 + 1
    # rows are non-decreasing and every row id in [0, num_rows) is used
    assert np.all(np.diff(layout.row_ids) >= 0)
    np.testing.assert_array_equal(np.unique(layout.row_ids), np.arange(layout.num_rows))


def test_row_ids_follow_row_major_flattening():
    """Row ``r`` of a >=2-D tensor is ``a[r].reshape(-1)`` in the flat vector."""
    layout = _layout()
    arrays = _arrays(3)
    flat = layout.flatten(arrays)
    conv_rows = layout.row_ids[:72]
    for r in range(4):
        np.testing.assert_array_equal(
            flat[:72][conv_rows == r], arrays["conv.weight"][r].reshape(-1)
        )


def test_always_kept_marks_exactly_the_1d_and_scalar_tensors():
    layout = _layout()
    expected = np.zeros(layout.size, dtype=bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if len(t.shape) < 2:
            expected[start : start + t.size] = True
    np.testing.assert_array_equal(layout.always_kept, expected)
    assert layout.always_kept.sum() == 4 + 3 + 1
    assert not layout.always_kept[:72].any()


def test_flatten_unflatten_round_trip():
    layout = _layout()
    arrays = _arrays(1)
    flat = layout.flatten(arrays)
    assert flat.dtype == np.float32
    assert flat.shape == (layout.size,)
    np.testing.assert_array_equal(flat, np.concatenate([a.reshape(-1) for a in arrays.values()]))
    back = layout.unflatten(flat)
    assert list(back) == list(arrays)
    for name, a in arrays.items():
        assert back[name].shape == a.shape
        np.testing.assert_array_equal(back[name], a)
    np.testing.assert_array_equal(layout.flatten(back), flat)


def test_unflatten_returns_views():
    layout = _layout()
    flat = layout.flatten(_arrays(2))
    back = layout.unflatten(flat)
    back["fc.bias"][1] = 123.0
    assert flat[layout.offsets[3] + 1] == 123.0


def test_flatten_casts_to_float32_and_accepts_other_dtypes():
    layout = _layout()
    arrays = {n: np.ones(s, dtype=np.float64) for n, s in SHAPES.items()}
    flat = layout.flatten(arrays)
    assert flat.dtype == np.float32
    np.testing.assert_array_equal(flat, np.ones(layout.size, dtype=np.float32))


def test_flatten_ignores_extra_tensors():
    layout = _layout()
    arrays = _arrays(4)
    extra = dict(arrays, unused=np.zeros(3, dtype=np.float32))
    np.testing.assert_array_equal(layout.flatten(extra), layout.flatten(arrays))


def test_flatten_missing_tensor_raises():
    layout = _layout()
    arrays = _arrays()
    del arrays["fc.weight"]
    with pytest.raises(ValueError, match="fc.weight"):
        layout.flatten(arrays)


@pytest.mark.parametrize("bad_shape", [(5, 3), (15,), (3, 5, 1), (3, 4)])
def test_flatten_misshapen_tensor_raises(bad_shape):
    layout = _layout()
    arrays = _arrays()
    arrays["fc.weight"] = np.zeros(bad_shape, dtype=np.float32)
    with pytest.raises(ValueError, match="fc.weight"):
        layout.flatten(arrays)


@pytest.mark.parametrize(
    "bad", [lambda d: np.zeros(d - 1), lambda d: np.zeros(d + 1), lambda d: np.zeros((1, d))]
)
def test_unflatten_wrong_shape_raises(bad):
    layout = _layout()
    with pytest.raises(ValueError):
        layout.unflatten(bad(layout.size))


def test_empty_layout():
    layout = ParamLayout.from_arrays({})
    assert layout.size == 0
    assert layout.num_rows == 0
    assert layout.row_ids.shape == (0,)
    assert layout.always_kept.shape == (0,)
    assert layout.flatten({}).shape == (0,)
    assert layout.unflatten(np.zeros(0, dtype=np.float32)) == {}
