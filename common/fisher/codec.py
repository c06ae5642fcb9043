"""Uplink encodings of a client's diagonal Fisher estimate.

Every mode turns a flat Fisher vector ``F`` (length ``d``) into named arrays and
back. Sizes, for ``k`` kept positions and ``R`` output rows:

===========  ================================================  ===================
mode         what is sent                                      bytes
===========  ================================================  ===================
``masked``   exact fp32 ``F`` inside the mask + fp32 mean of    ``4k + 4R``
             ``F`` over the unkept positions of each row
``topm``     the ``m = k`` largest entries (index + fp32) +     ``k*(4+idx) + 4``
             the mean of the rest
``log8``     every entry, 8-bit log-quantised                   ``d + 8``
``dense``    every entry, exact fp32                            ``4d``
``ranked``   the ``m`` largest entries over the whole model     at most ``4k + 4R``
             (position set as a compact mask + 8-bit log
             values) + per-row mean of the rest, ``m`` as
             large as fits the bytes of ``masked``
===========  ================================================  ===================

``masked``, ``topm`` and ``ranked`` scale with ``gamma``; ``dense`` is exact everywhere.
``masked`` spends its bytes on the positions the client already holds, so outside
them the server sees only a row mean: a small client's next mask is then chosen
almost by magnitude. ``ranked`` spends the same bytes on the largest Fisher values
wherever they are, which is what the top-k of ``F_j^2 x_j^2`` needs; the rest of a
row is decoded as its mean, capped at the smallest sent value (every unsent entry
is at most that).
``none`` sends nothing (methods that do not rank by Fisher).
Decoders validate shapes, dtypes, finiteness and non-negativity and raise
``ValueError`` with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.fisher.selection import topk_mask
from common.models.layout import ParamLayout
from common.wire.mask_codec import MASK_KINDS, decode_mask, encode_mask, index_dtype, mask_kind

FisherEncoding = Literal["masked", "topm", "log8", "dense", "ranked"]
FISHER_ENCODINGS: tuple[str, ...] = ("masked", "topm", "log8", "dense", "ranked")
UPLOAD_ENCODINGS: tuple[str, ...] = (*FISHER_ENCODINGS, "none")
_LOG8_LEVELS = 254  # codes 1..254 carry values; 0 is an exact zero


def _row_means(
    values: NDArray[np.float64], rows: NDArray[np.int64], num_rows: int
) -> NDArray[np.float64]:
    total = np.bincount(rows, weights=values, minlength=num_rows)
    count = np.bincount(rows, minlength=num_rows)
    return np.divide(total, count, out=np.zeros(num_rows), where=count > 0)


def _log8(values: NDArray[np.float64]) -> tuple[NDArray[np.uint8], float, float]:
    """8-bit log codes of non-negative values (0 = exact zero) and the (low, high) log range."""
    codes = np.zeros(values.size, dtype=np.uint8)
    pos = values > 0
    if not pos.any():
        return codes, 0.0, 0.0
    # float32 logs: their error (1e-7 relative) is far below one code step, at half the time of
    # float64
    logs = np.log(values[pos].astype(np.float32))
    lo, hi = float(logs.min()), float(logs.max())
    span = hi - lo if hi > lo else 1.0
    steps = np.rint((logs - np.float32(lo)) * np.float32((_LOG8_LEVELS - 1) / span))
    codes[pos] = (np.clip(steps, 0, _LOG8_LEVELS - 1) + 1).astype(np.uint8)
    return codes, lo, hi


def _unlog8(codes: NDArray[np.uint8], lo: float, hi: float) -> NDArray[np.float32]:
    span = hi - lo if hi > lo else 1.0
    out = np.zeros(codes.size, dtype=np.float32)
    nz = codes > 0
    out[nz] = np.exp(lo + (codes[nz].astype(np.float64) - 1) / (_LOG8_LEVELS - 1) * span).astype(
        np.float32
    )
    if not np.all(np.isfinite(out)):
        raise ValueError("fisher log8 codes decode to non-finite values")
    return out


def ranked_count(d: int, budget_bytes: int) -> int:
    """Largest ``m`` whose ``ranked`` position set (compact mask) plus ``m`` value bytes fit
    ``budget_bytes``.

    Parameters
    ----------
    d : int
        Model size (positions).
    budget_bytes : int
        Bytes available for the position set and the 8-bit values.

    The set's size depends only on ``m`` and ``d`` (:func:`common.wire.mask_codec.mask_kind`) and is
    non-decreasing in ``m`` (every value adds a byte), so the count is found by bisection on it.
    """

    def cost(m: int) -> int:
        return mask_kind(d, m)[1] + m

    lo, hi = 0, d  # cost(lo) fits; find the largest m that fits
    if cost(hi) <= budget_bytes:
        return d
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


#: Bytes of a ``ranked`` payload besides its position set and values: the set's kind (1) and the log
#: range (8).
_RANKED_FIXED = 1 + 8


def payload_bytes(mode: str, k: int, d: int, num_rows: int) -> int:
    """The bytes of a Fisher payload of ``mode`` for a mask of ``k`` of ``d`` positions (at most,
    for ``ranked`` without a cap).

    Parameters
    ----------
    mode : str
        The encoding (:data:`UPLOAD_ENCODINGS`).
    k, d, num_rows : int
        Positions in the client's mask, in the model, and the model's output rows.
    """
    if mode == "none":
        return 0
    if mode == "dense":
        return 4 * d
    if mode == "log8":
        return d + 8
    if mode == "masked":
        return 4 * k + 4 * num_rows
    if mode == "topm":
        return k * (4 + np.dtype(index_dtype(d)).itemsize) + 4
    if mode == "ranked":
        return max(
            4 * k + 4 * num_rows, ranked_floor(d, num_rows)
        )  # one value is sent whatever the mask
    raise ValueError(f"unknown fisher encoding {mode!r}; expected one of {UPLOAD_ENCODINGS}")


def encode_fisher(
    fisher: NDArray,
    mask: NDArray[np.bool_],
    layout: ParamLayout,
    mode: FisherEncoding,
    max_bytes: int | None = None,
) -> dict[str, NDArray]:
    """Encode a flat Fisher vector.

    Parameters
    ----------
    fisher : NDArray
        Flat, finite, non-negative diagonal Fisher, length ``d``.
    mask : NDArray[bool]
        The client's submodel mask (which positions were trained).
    layout : ParamLayout
        The model layout (rows for the ``masked`` summary).
    mode : {"masked", "topm", "log8", "dense", "ranked"}
        Encoding (see module docstring).
    max_bytes : int, optional
        ``ranked`` only: the payload takes at most this many bytes in all (fewer of the largest
        values are sent); at least :func:`ranked_floor` bytes. Default: the bytes of ``masked``.
    """
    if mode == "none":
        return {}
    f = np.asarray(fisher, dtype=np.float64)
    if mode == "dense":
        return {"fisher.dense": f.astype(np.float32)}
    if mode == "masked":
        return _encode_masked(f, mask, layout)
    if mode == "topm":
        return _encode_topm(f, mask)
    if mode == "log8":
        codes, lo, hi = _log8(f)
        return {
            "fisher.log8": codes,
            "fisher.log8range": np.array([lo, hi], dtype=np.float32),
        }
    if mode == "ranked":
        return _encode_ranked(f, mask, layout, max_bytes)
    raise ValueError(f"unknown fisher encoding {mode!r}; expected one of {FISHER_ENCODINGS}")


def _encode_masked(
    f: NDArray[np.float64],
    mask: NDArray[np.bool_],
    layout: ParamLayout,
) -> dict[str, NDArray]:
    """The ``masked`` payload: ``f`` inside the mask, exactly, and each row's mean outside it.

    Parameters
    ----------
    f : NDArray[float64]
        Flat, finite, non-negative diagonal Fisher, length ``d``.
    mask : NDArray[bool]
        The client's submodel mask.
    layout : ParamLayout
        The model layout (its rows).
    """
    out_rows = layout.row_ids[~mask]
    means = _row_means(f[~mask], out_rows, layout.num_rows)
    return {
        "fisher.inside": f[mask].astype(np.float32),
        "fisher.rowmean": means.astype(np.float32),
    }


def _encode_topm(f: NDArray[np.float64], mask: NDArray[np.bool_]) -> dict[str, NDArray]:
    """The ``topm`` payload: the ``m`` largest entries (``m``: the mask's size), the rest's mean.

    Parameters
    ----------
    f : NDArray[float64]
        Flat, finite, non-negative diagonal Fisher, length ``d``.
    mask : NDArray[bool]
        The client's submodel mask (only its number of positions is read).
    """
    m = int(mask.sum())
    top = np.sort(np.argpartition(-f, m - 1)[:m]) if 0 < m < f.size else np.arange(min(m, f.size))
    rest = np.ones(f.size, dtype=bool)
    rest[top] = False
    rest_mean = float(f[rest].mean()) if rest.any() else 0.0
    return {
        "fisher.topidx": top.astype(index_dtype(f.size)),
        "fisher.topval": f[top].astype(np.float32),
        "fisher.rest": np.array([rest_mean], dtype=np.float32),
    }


def _encode_ranked(
    f: NDArray[np.float64], mask: NDArray[np.bool_], layout: ParamLayout, max_bytes: int | None
) -> dict[str, NDArray]:
    """The ``ranked`` payload: the largest entries of the whole model, each row's mean of the rest.

    Parameters
    ----------
    f : NDArray[float64]
        Flat, finite, non-negative diagonal Fisher, length ``d``.
    mask : NDArray[bool]
        The client's submodel mask (its number of positions sets the default byte budget).
    layout : ParamLayout
        The model layout (its rows).
    max_bytes : int, optional
        The payload takes at most this many bytes in all, at least :func:`ranked_floor`; ``None``:
        the bytes of ``masked``.
    """
    k = int(np.count_nonzero(mask))
    room = 4 * k - _RANKED_FIXED  # the row means cost what masked's row means cost
    if max_bytes is not None:
        floor = ranked_floor(layout.size, layout.num_rows)
        if max_bytes < floor:
            raise ValueError(f"a ranked Fisher payload needs {floor} bytes, {max_bytes} allowed")
        room = min(room, max_bytes - _RANKED_FIXED - 4 * layout.num_rows)
    top = topk_mask(f, max(1, ranked_count(f.size, room)))  # ties to the lower index
    kind, data = encode_mask(top)
    codes, lo, hi = _log8(f[top])
    rowmean = _row_means(f[~top], layout.row_ids[~top], layout.num_rows)
    return {
        "fisher.setkind": np.array([MASK_KINDS.index(kind)], dtype=np.uint8),
        "fisher.set": data,
        "fisher.setlog8": codes,
        "fisher.log8range": np.array([lo, hi], dtype=np.float32),
        "fisher.rowmean": rowmean.astype(np.float32),
    }


def ranked_floor(d: int, num_rows: int) -> int:
    """The fewest bytes a ``ranked`` payload of a model of ``d`` positions and ``num_rows`` output
    rows can take: its row means, fixed fields and one value with its position."""
    return _RANKED_FIXED + 4 * num_rows + 1 + int(mask_kind(d, 1)[1])


def _per_position(rowmean: NDArray[np.float32], layout: ParamLayout) -> NDArray[np.float32]:
    """Each row's value at every position of the row (a new float32 array of length ``d``).

    A row's positions are contiguous (:attr:`ParamLayout.row_ids` is non-decreasing in runs of each
    tensor's row length), so this is ``np.repeat`` of the row values, the same values as
    ``rowmean[layout.row_ids]`` without reading a length-``d`` int64 index.
    """
    lengths = [np.full(t.rows, t.size // t.rows, dtype=np.int64) for t in layout.tensors]
    counts = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return np.repeat(np.asarray(rowmean, dtype=np.float32), counts)


def _expect(
    payload: Mapping[str, NDArray],
    name: str,
    dtype: np.dtype | str,
    length: int | None,
    nonneg: bool = True,
) -> NDArray:
    if name not in payload:
        raise ValueError(f"missing fisher array {name!r}")
    a = np.asarray(payload[name])
    if a.dtype != np.dtype(dtype) or a.ndim != 1 or (length is not None and a.shape[0] != length):
        want = f"{np.dtype(dtype)}[{'n' if length is None else length}]"
        raise ValueError(f"fisher array {name!r} must be {want}, got {a.dtype}{list(a.shape)}")
    if a.dtype.kind == "f" and a.size:
        # Two reductions and no temporary of the array's length: NaN makes both extremes NaN, an
        # infinity one of them; once every value is finite, the smallest is negative exactly when
        # some value is.
        lo, hi = a.min(), a.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise ValueError(f"fisher array {name!r} has NaN or Inf")
        if nonneg and lo < 0:
            raise ValueError(f"fisher array {name!r} has negative values")
    return a


def expected_names(mode: str) -> frozenset[str]:
    """Array names a payload of ``mode`` carries."""
    names = {
        "dense": {"fisher.dense"},
        "masked": {"fisher.inside", "fisher.rowmean"},
        "topm": {"fisher.topidx", "fisher.topval", "fisher.rest"},
        "log8": {"fisher.log8", "fisher.log8range"},
        "ranked": {
            "fisher.setkind",
            "fisher.set",
            "fisher.setlog8",
            "fisher.log8range",
            "fisher.rowmean",
        },
        "none": set(),
    }
    if mode not in names:
        raise ValueError(f"unknown fisher encoding {mode!r}; expected one of {FISHER_ENCODINGS}")
    return frozenset(names[mode])


def decode_fisher(
    payload: Mapping[str, NDArray],
    mask: NDArray[np.bool_] | None,
    layout: ParamLayout,
    mode: str,
    positions: NDArray[np.signedinteger] | None = None,
) -> NDArray[np.float32] | None:
    """Decode and validate a Fisher payload into a flat float32 vector of length ``d``
    (``None`` for mode ``none``).

    Parameters
    ----------
    payload : Mapping[str, NDArray]
        The payload's arrays by name.
    mask : NDArray[bool] or None
        The client's submodel mask (read by ``masked`` only); ``None`` when ``positions`` is given.
    layout : ParamLayout
        The model layout.
    mode : str
        The encoding (:data:`UPLOAD_ENCODINGS`).
    positions : NDArray[int], optional
        The mask's set positions, strictly increasing and below ``d`` (as
        :meth:`common.wire.validation.SentSubmodel.positions` gives them): ``masked`` then reads
        them instead of the mask, which a server keeps packed, and the result is the same.
    """
    d = layout.size
    extra = set(payload) - expected_names(mode)
    if extra:
        raise ValueError(f"unexpected fisher arrays {sorted(extra)} for encoding {mode!r}")
    if mode == "none":
        return None
    if mode == "dense":
        return _expect(payload, "fisher.dense", np.float32, d).copy()
    if mode == "masked":
        return _decode_masked(payload, mask, layout, positions)
    if mode == "topm":
        return _decode_topm(payload, d)
    lo, hi = (float(v) for v in _expect(payload, "fisher.log8range", np.float32, 2, nonneg=False))
    if hi < lo:
        raise ValueError("fisher.log8range must be (low, high) with low <= high")
    if mode == "ranked":
        return _decode_ranked(payload, layout, lo, hi)
    return _unlog8(_expect(payload, "fisher.log8", np.uint8, d), lo, hi)


def _decode_masked(
    payload: Mapping[str, NDArray],
    mask: NDArray[np.bool_] | None,
    layout: ParamLayout,
    positions: NDArray[np.signedinteger] | None,
) -> NDArray[np.float32]:
    """Decode a ``masked`` payload: the sent values inside the mask, each row's mean outside it.

    Parameters
    ----------
    payload : Mapping[str, NDArray]
        The payload's arrays by name.
    mask : NDArray[bool] or None
        The client's submodel mask; ``None`` when ``positions`` is given.
    layout : ParamLayout
        The model layout.
    positions : NDArray[int] or None
        The mask's set positions, strictly increasing and below ``d``, read instead of the mask.
    """
    if positions is None:
        if mask is None:
            raise ValueError("the masked encoding needs the mask or its positions")
        k = int(np.count_nonzero(mask))
    else:
        k = int(positions.size)
    inside = _expect(payload, "fisher.inside", np.float32, k)
    rowmean = _expect(payload, "fisher.rowmean", np.float32, layout.num_rows)
    if k == layout.size:  # every position sent: the row means (of no position) are not used
        return inside.copy()
    out = _per_position(rowmean, layout)
    # Positions: faster than a boolean scatter below capacity 1 (cast once: int32 ones are cast per
    # use).
    at = np.flatnonzero(mask) if positions is None else positions.astype(np.intp, copy=False)
    out[at] = inside
    return out


def _decode_topm(payload: Mapping[str, NDArray], d: int) -> NDArray[np.float32]:
    """Decode a ``topm`` payload: the sent entries at their positions, the rest's mean elsewhere.

    Parameters
    ----------
    payload : Mapping[str, NDArray]
        The payload's arrays by name.
    d : int
        Model size (positions).
    """
    idx = _expect(payload, "fisher.topidx", index_dtype(d), None).astype(np.int64)
    if idx.size and (idx[-1] >= d or np.any(np.diff(idx) <= 0)):
        raise ValueError("fisher.topidx must be strictly increasing and below d")
    val = _expect(payload, "fisher.topval", np.float32, idx.size)
    rest = _expect(payload, "fisher.rest", np.float32, 1)
    out = np.full(d, rest[0], dtype=np.float32)
    out[idx] = val
    return out


def _decode_ranked(
    payload: Mapping[str, NDArray],
    layout: ParamLayout,
    lo: float,
    hi: float,
) -> NDArray[np.float32]:
    """Decode a ``ranked`` payload: the sent values at their positions, each row's mean elsewhere.

    A row's mean is capped at the smallest sent value, since every unsent entry is at most that.

    Parameters
    ----------
    payload : Mapping[str, NDArray]
        The payload's arrays by name.
    layout : ParamLayout
        The model layout.
    lo, hi : float
        The log range of the 8-bit values (``fisher.log8range``, checked ``lo <= hi``).
    """
    d = layout.size
    kind_code = _expect(payload, "fisher.setkind", np.uint8, 1)[0]
    if kind_code >= len(MASK_KINDS):
        raise ValueError(f"fisher.setkind {kind_code} is not a mask kind")
    if "fisher.set" not in payload:
        raise ValueError("missing fisher array 'fisher.set'")
    top = decode_mask(MASK_KINDS[kind_code], np.asarray(payload["fisher.set"]), d)
    m = int(np.count_nonzero(top))
    sent = _unlog8(_expect(payload, "fisher.setlog8", np.uint8, m), lo, hi)
    rowmean = _expect(payload, "fisher.rowmean", np.float32, layout.num_rows)
    out = _per_position(rowmean, layout)
    if m:
        np.minimum(out, sent.min(), out=out)  # the sent values are the largest ones
    out[top] = sent
    return out
