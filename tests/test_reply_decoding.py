"""Replies decoded without copies: positions from the packed mask (int32), the delta a read-only
view, and encodings of masks met again looked up by content."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import common.wire.mask_codec as codec
from common.config.parse import parse_run_config
from common.fisher.held_masks import HeldMasks
from common.methods import create_method
from common.wire import protocol as P
from common.wire.mask_codec import (
    EncodingCache,
    decode_mask,
    encode_elias_fano,
    encode_mask,
    index_dtype,
    mask_kind,
    packed_positions,
    position_dtype,
)
from common.wire.validation import ReplyRecords, SentSubmodel, validate_train_reply


@st.composite
def _masks(draw):
    d = draw(st.integers(1, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 0.99, 1.0]))
    return rng.random(d) < density


@settings(max_examples=200, deadline=None)
@given(mask=_masks(), block=st.sampled_from([1 << 17, 1, 3]))
def test_packed_positions_are_flatnonzero_of_the_unpacked_mask(mask, block):
    d, kept = mask.size, int(mask.sum())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            codec, "_POSITIONS_BLOCK", block
        )  # blocks of 8 and 24 bits: every boundary crossed
        got = packed_positions(np.packbits(mask), d, kept)
    assert got.dtype == np.int32
    assert np.array_equal(got, np.flatnonzero(mask))


def test_packed_positions_ignore_padding_and_refuse_another_count():
    mask = np.array([1, 0, 1], dtype=bool)
    packed = np.packbits(mask) | np.uint8(0b00011111)  # set padding bits after the 3 positions
    assert packed_positions(packed, 3, 2).tolist() == [0, 2]
    with pytest.raises(ValueError, match="expected 3"):
        packed_positions(np.packbits(mask), 3, 3)  # declared full, is not
    with pytest.raises(ValueError, match="more than 1 set positions"):
        packed_positions(np.packbits(mask), 3, 1)
    with pytest.raises(ValueError, match="holds 2 set positions, expected 3"):
        packed_positions(
            np.packbits(np.array([1, 0, 1, 0], dtype=bool)), 4, 3
        )  # fewer than declared
    with pytest.raises(ValueError, match="uint8"):
        packed_positions(np.packbits(mask).astype(np.int16), 3, 2)


def test_position_dtype_is_int32_while_every_index_fits():
    assert position_dtype(2**31) == np.int32  # indices up to 2^31 - 1
    assert position_dtype(2**31 + 1) == np.int64
    assert position_dtype(11_173_962) == np.int32


def _reply(delta: np.ndarray, sent: SentSubmodel) -> ReplyRecords:
    metrics = {"num-examples": 10, "train-loss": 1.0, "train-seconds": 1.0, "fisher-seconds": 0.0}
    return ReplyRecords(
        {P.DELTA: delta}, metrics, {"round": sent.round, "mask-digest": sent.digest}
    )


class _Layout:
    """Only what validate_train_reply reads of a layout: its size."""

    def __init__(self, d: int) -> None:
        self.size = d


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_validated_update_is_the_received_delta_read_only_with_int32_positions(density):
    rng = np.random.default_rng(1)
    d = 1000
    mask = rng.random(d) < density
    sent = SentSubmodel(7, 3, mask, "digest", 100, fisher=False)
    delta = rng.standard_normal(int(mask.sum())).astype(np.float32)
    reply, payload = validate_train_reply(_reply(delta, sent), sent, _Layout(d))
    u = reply.update
    assert payload == {}
    assert u.indices.dtype == np.int32 and np.array_equal(u.indices, np.flatnonzero(mask))
    assert np.shares_memory(u.delta, delta) or delta.size == 0  # no copy of the received delta
    assert (
        not u.delta.flags.writeable and delta.flags.writeable
    )  # the view is read-only, the buffer unchanged
    if delta.size:
        with pytest.raises(ValueError, match="read-only"):
            u.delta[0] = 1.0
    assert u.weight == 10.0


def test_a_read_only_received_delta_is_accepted_as_is():
    """A reply's arrays may be views on the received bytes (read-only): validation copies
    nothing."""
    mask = np.array([True, False, True, True])
    sent = SentSubmodel(1, 2, mask, "digest", 100, fisher=False)
    raw = np.array([0.5, -1.0, 2.0], dtype=np.float32).tobytes()
    delta = np.frombuffer(raw, dtype=np.float32)
    reply, _ = validate_train_reply(_reply(delta, sent), sent, _Layout(4))
    assert reply.update.delta.tolist() == [0.5, -1.0, 2.0] and np.shares_memory(
        reply.update.delta, delta
    )


def test_fedfibos_folds_a_validated_reply_to_the_same_bits_as_int64_positions_and_a_copied_delta():
    from common.aggregation.masked import MaskedUpdate
    from common.aggregation.running_sums import ParticipantSum

    rng = np.random.default_rng(5)
    d = 5000
    x = rng.standard_normal(d).astype(np.float32)
    plain, decoded = ParticipantSum(d), ParticipantSum(d)
    for density in (1.0, 0.25, 0.0625, 0.01):
        mask = rng.random(d) < density
        sent = SentSubmodel(1, 2, mask, "digest", 100, fisher=False)
        delta = (rng.standard_normal(int(mask.sum())) * 1e-3).astype(np.float32)
        reply, _ = validate_train_reply(_reply(delta, sent), sent, _Layout(d))
        decoded.add(reply.update)
        plain.add(MaskedUpdate(np.flatnonzero(mask).astype(np.int64), delta.copy(), 10.0))
    assert plain.apply(x).tobytes() == decoded.apply(x).tobytes()


@settings(max_examples=100, deadline=None)
@given(mask=_masks())
def test_encode_mask_met_again_is_the_fresh_encoding_read_only(mask):
    d, k = mask.size, int(mask.sum())
    kind, expected_size = mask_kind(d, k)
    if kind == "indices":
        fresh = np.flatnonzero(mask).astype(index_dtype(d))
    elif kind == "elias-fano":
        fresh = encode_elias_fano(np.flatnonzero(mask), d)
    else:
        fresh = None
    first = encode_mask(mask)
    again = encode_mask(mask.copy())  # another array of the same content
    for got_kind, data in (first, again):
        assert got_kind == kind and data.nbytes == expected_size
        assert np.array_equal(decode_mask(kind, data, d), mask)
        if fresh is not None:
            assert data.dtype == fresh.dtype and np.array_equal(data, fresh)
            assert not data.flags.writeable  # shared between callers


def test_encoding_cache_is_keyed_by_content_and_bounded(monkeypatch):
    cache = EncodingCache(limit=100)
    monkeypatch.setattr(codec, "ENCODINGS", cache)
    d = 4096
    mask = np.zeros(d, dtype=bool)
    mask[[3, 50, 700]] = True
    kind, data = encode_mask(mask)
    assert kind == "indices" and len(cache) == 1 and cache.hits == 0
    assert encode_mask(mask)[1] is data and cache.hits == 1  # met again: the same array
    mask[50] = False
    mask[51] = True  # a changed mask is another key
    kind2, data2 = encode_mask(mask)
    assert data2.tolist() == [3, 51, 700] and len(cache) == 2
    for i in range(40):  # 6 bytes each (uint16 indices): the oldest are dropped beyond 100 bytes
        m = np.zeros(d, dtype=bool)
        m[[i, 1000 + i, 2000 + i]] = True
        encode_mask(m)
    assert cache.nbytes <= 100 and len(cache) == 100 // 6
    big = EncodingCache(limit=4)
    big.put(
        (1, "indices", b"k"), np.arange(10, dtype=np.uint16)
    )  # larger than the whole cache: not kept
    assert len(big) == 0


def test_held_masks_hand_out_a_fresh_writable_mask_and_their_packed_bits():
    held = HeldMasks(20)
    mask = np.zeros(20, dtype=bool)
    mask[[1, 7, 19]] = True
    held.put("a", 4, 0.25, mask)
    got = held.get("a", 4, 0.25)
    assert got.dtype == np.bool_ and np.array_equal(got, mask) and got.flags.writeable
    got[0] = True  # the caller's own array: the held mask is unchanged
    assert np.array_equal(held.get("a", 4, 0.25), mask)
    assert held.get("a", 5, 0.25) is None and held.get("a", 4, 0.5) is None
    assert np.array_equal(held.packed("a"), np.packbits(mask)) and held.packed("b") is None


def test_fedfibos_validates_a_reply_without_fisher_to_int32_positions():
    method = create_method(parse_run_config({}))
    from common.models.architectures import build_model, model_layout

    layout = model_layout(build_model("cnn", 10, 1, 0))
    method.start_server(layout)
    d = layout.size
    rng = np.random.default_rng(3)
    mask = rng.random(d) < 0.1
    sent = SentSubmodel(1, 2, mask, "digest", 100, fisher=False)
    delta = rng.standard_normal(int(mask.sum())).astype(np.float32)
    reply = method.validate(_reply(delta, sent), sent, np.zeros(d, dtype=np.float32))
    assert reply.fisher is None and reply.update.indices.dtype == np.int32
    assert np.array_equal(reply.update.indices, np.flatnonzero(mask)) and np.shares_memory(
        reply.update.delta, delta
    )


def _array(a: np.ndarray, version: tuple[int, int] | None = None, pickle: bool = False):
    import io

    from flwr.app import Array

    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, version=version, allow_pickle=pickle)
    return Array(
        dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=buf.getvalue()
    )


@pytest.mark.parametrize(
    "a",
    [
        np.arange(7, dtype=np.float32),
        np.zeros(0, dtype=np.float32),
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.array([1, 0, 1], dtype=np.uint8),
        np.array(3.5, dtype=np.float32),
        np.arange(5, dtype=">f4"),
    ],
)
def test_array_view_is_what_numpy_loads_viewed_on_the_received_bytes(a):
    from flwr.app import Array

    from server.replies import array_view

    arr = Array(a)
    view, loaded = array_view(arr), arr.numpy()
    assert (
        view.dtype == loaded.dtype and view.shape == loaded.shape and np.array_equal(view, loaded)
    )
    assert not view.flags.writeable
    if a.size:
        assert np.shares_memory(view, np.frombuffer(arr.data, dtype=np.uint8))  # no copy
    v2 = array_view(_array(a, version=(2, 0)))
    assert np.array_equal(v2, loaded) and v2.dtype == loaded.dtype
    v3 = array_view(_array(a, version=(3, 0)))  # any other header version: Flower's own reader
    assert np.array_equal(v3, loaded) and v3.dtype == loaded.dtype


def test_array_view_refuses_a_wrong_length_and_object_arrays():
    from flwr.app import Array

    from server.replies import array_view

    good = Array(np.arange(4, dtype=np.float32))
    for data in (good.data[:-1], good.data + b"\0"):
        with pytest.raises(ValueError, match="needs 16 bytes"):
            array_view(Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=data))
    with pytest.raises(ValueError, match="object"):
        array_view(_array(np.array([{"a": 1}], dtype=object), pickle=True))


def test_reply_parts_hand_the_validator_views_of_the_message():
    from flwr.app import Array, ArrayRecord

    from server.replies import record_arrays

    delta = np.arange(6, dtype=np.float32)
    record = ArrayRecord(
        {P.DELTA: Array(delta), "fisher.rowmean": Array(np.ones(2, dtype=np.float32))}
    )
    arrays = record_arrays(record)
    assert set(arrays) == {P.DELTA, "fisher.rowmean"} and np.array_equal(arrays[P.DELTA], delta)
    assert all(not a.flags.writeable for a in arrays.values())


@settings(max_examples=100, deadline=None)
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 9)),
            st.tuples(st.integers(1, 6), st.integers(1, 7)),
            st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
)
def test_row_filled_fisher_decodes_to_the_bits_of_the_row_id_gather(shapes, seed, density):
    """The masked and ranked Fisher decoders fill rows by repetition: the same bits as gathering by
    row id."""
    from common.fisher.codec import decode_fisher, encode_fisher
    from common.models.layout import ParamLayout, TensorSpec

    layout = ParamLayout(tuple(TensorSpec(f"t{i}", s) for i, s in enumerate(shapes)))
    rng = np.random.default_rng(seed)
    d = layout.size
    fisher = rng.lognormal(0.0, 2.0, d).astype(np.float32)
    mask = rng.random(d) < density
    payload = encode_fisher(fisher, mask, layout, "masked")
    expected = payload["fisher.rowmean"][layout.row_ids].astype(np.float32)
    expected[mask] = payload["fisher.inside"]
    assert decode_fisher(payload, mask, layout, "masked").tobytes() == expected.tobytes()
    if mask.any():
        ranked = encode_fisher(fisher, mask, layout, "ranked")
        top = decode_mask(
            codec.MASK_KINDS[int(ranked["fisher.setkind"][0])], ranked["fisher.set"], d
        )
        lo, hi = (float(v) for v in ranked["fisher.log8range"])
        from common.fisher.codec import _unlog8

        sent = _unlog8(ranked["fisher.setlog8"], lo, hi)
        want = ranked["fisher.rowmean"][layout.row_ids].astype(np.float32)
        if sent.size:
            np.minimum(want, sent.min(), out=want)
        want[top] = sent
        assert decode_fisher(ranked, mask, layout, "ranked").tobytes() == want.tobytes()
