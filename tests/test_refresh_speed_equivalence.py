"""The faster formulations of a refresh round's server steps give the previous formulations' results
to the bit.

Each test keeps the previous code (or the general path it replaced) as the reference and compares
bytes: the fused Fisher selection and the pruned top-k against a full partition of every score, the
gathers of the download and of ``fisher-at`` against boolean indexing, the mask's positions shared
by the download and its code, the Fisher decoded by positions against the mask, the running sums'
``np.add.at`` against gather, add and scatter, and the Fisher state's EMA folded into the
normalisation against the separate passes.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import common.aggregation.running_sums as sums_module
import common.fisher.selection as selection
import common.fisher.state as state_module
import common.wire.mask_codec as mask_codec
import common.wire.protocol as protocol
from common.aggregation.masked import MaskedUpdate
from common.aggregation.running_sums import HolderSum, ParticipantSum
from common.config.parse import parse_run_config
from common.fisher.codec import decode_fisher, encode_fisher
from common.fisher.selection import budget, select_mask, topk_mask
from common.fisher.state import PRECISIONS, FisherState, at_precision, mean64
from common.methods import create_method
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.mask_codec import ENCODINGS, encode_mask, mask_digest
from common.wire.validation import ReplyRecords, SentSubmodel


def _full_partition_mask(layout: ParamLayout, x, f, gamma, min_per_row, keep_vectors) -> np.ndarray:
    """The previous ``fisher`` selection: every score made and partitioned (the blockwise pass
    turned off)."""
    with mock.patch.object(selection, "_fisher_mask", return_value=None):
        return select_mask(layout, x, gamma, "fisher", f, min_per_row, keep_vectors)


_shapes = st.lists(
    st.one_of(st.tuples(st.integers(1, 6)), st.tuples(st.integers(1, 12), st.integers(1, 60))),
    min_size=1,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    shapes=_shapes,
    inert=st.lists(st.booleans(), min_size=5, max_size=5),
    m=st.integers(0, 3),
    keep=st.booleans(),
    gamma=st.one_of(st.floats(0.01, 0.3), st.floats(0.01, 1.0)),
    levels=st.sampled_from([2, 3, 1000]),
    seed=st.integers(0, 2**16),
    sample=st.sampled_from([2, 64, 1 << 20]),
)
def test_fused_fisher_selection_is_the_full_partition(
    shapes, inert, m, keep, gamma, levels, seed, sample
):
    """Few distinct values (ties in rows and at the threshold), inert tensors; samples of every
    score (the floor then always holds enough candidates) and tiny ones (floors that fall back to
    the general path)."""
    arrays = {f"t{i}": np.zeros(s) for i, s in enumerate(shapes)}
    layout = ParamLayout.from_arrays(arrays, frozenset(n for n, dead in zip(arrays, inert) if dead))
    rng = np.random.default_rng(seed)
    d = layout.size
    f = rng.integers(0, levels, size=d).astype(np.float32)
    x = rng.integers(-levels, levels + 1, size=d).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
        want = _full_partition_mask(layout, x, f, gamma, m, keep)
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        mp.setattr(selection, "PRUNE_SAMPLE", sample)
        mp.setattr(selection, "_FUSED_BLOCK", 7)  # rows longer than a block, blocks of several rows
        got = select_mask(layout, x, gamma, "fisher", f, m, keep)
    assert got.tobytes() == want.tobytes()


def test_fused_selection_applies_on_a_large_model_and_matches():
    """ResNet-sized rows and heavy-tailed values: the fused path itself (not its fallback) gives the
    mask."""
    shapes = [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (128,), (256, 128, 3, 3), (10, 256)]
    layout = ParamLayout.from_arrays({f"t{i}": np.zeros(s) for i, s in enumerate(shapes)})
    rng = np.random.default_rng(7)
    x = rng.standard_normal(layout.size).astype(np.float32)
    f = rng.lognormal(0, 2, layout.size).astype(np.float32)
    for gamma in (0.25, 0.0625, 0.015625):
        for m in (1, 2):
            k = budget(gamma, layout.size)
            fused = selection._fisher_mask(layout, x, f, k, m, True)
            assert fused is not None
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
                want = _full_partition_mask(layout, x, f, gamma, m, True)
            assert fused.tobytes() == want.tobytes()
            assert select_mask(layout, x, gamma, "fisher", f, m).tobytes() == want.tobytes()


def test_fused_selection_raises_as_the_general_path():
    layout = ParamLayout.from_arrays({"w": np.zeros((4, 30)), "b": np.zeros(4)})
    x = np.ones(layout.size, dtype=np.float32)
    f = np.ones(layout.size, dtype=np.float32)
    x[5] = np.inf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        with pytest.raises(ValueError, match="scores must be finite"):
            select_mask(layout, x, 0.25, "fisher", f)
        x[5] = 1.0
        f[7] = -1.0
        with pytest.raises(ValueError, match="fisher must be finite and non-negative"):
            select_mask(layout, x, 0.25, "fisher", f)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_value_that_is_not_finite_is_refused_after_the_float32_pass(bad):
    """Without guards the block is first tried on float32 products; a value of x that is not finite
    sends it to the float64 pass, which refuses it as the general path does (not a mask made of the
    rest)."""
    layout = ParamLayout.from_arrays({"w": np.zeros((40, 300)), "b": np.zeros(40)})
    rng = np.random.default_rng(0)
    x = rng.standard_normal(layout.size).astype(np.float32)
    f = (rng.random(layout.size) + 0.1).astype(np.float32)
    k = layout.size // 16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        mp.setattr(
            selection, "PRUNE_SAMPLE", 2000
        )  # every 6th position sampled: the bad one (5) is not
        assert (
            selection._fisher_mask(layout, x, f, k, 0, False) is not None
        )  # the fused path applies here
        x[5] = bad
        with pytest.raises(ValueError, match="scores must be finite"):
            selection._fisher_mask(layout, x, f, k, 0, False)
        with pytest.raises(ValueError, match="scores must be finite"):
            select_mask(layout, x, k / layout.size, "fisher", f, 0, False)


@settings(max_examples=300, deadline=None)
@given(
    d=st.integers(1, 2000),
    k_frac=st.one_of(st.floats(0.0, 0.3), st.floats(0.0, 1.0)),
    forced_frac=st.floats(0.0, 0.3),
    levels=st.sampled_from([2, 5, 10**6]),
    seed=st.integers(0, 2**16),
    sample=st.sampled_from([3, 50, 1 << 20]),
)
def test_pruned_topk_is_the_full_partition(d, k_frac, forced_frac, levels, seed, sample):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, size=d).astype(np.float64)
    forced = rng.random(d) < forced_frac
    k = int(round(k_frac * d))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
        want = topk_mask(scores, k, forced)
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        mp.setattr(selection, "PRUNE_SAMPLE", sample)
        got = topk_mask(scores, k, forced)
    assert got.tobytes() == want.tobytes()


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(0, 300),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([5, 64]),
)
def test_gathers_are_boolean_indexing(d, density, seed, block):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d).astype(np.float32)
    x[rng.random(d) < 0.05] = -0.0
    mask = rng.random(d) < density
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protocol, "_GATHER_BLOCK", block)
        assert P.selected_values(x, mask).tobytes() == x[mask].tobytes()
        assert P.outside_values(x, mask).tobytes() == x[~mask].tobytes()
        ENCODINGS.clear()
        payload = P.encode_submodel(x, mask)
    ENCODINGS.clear()
    kind, data = encode_mask(
        mask
    )  # the previous download: its own code of the mask, then boolean indexing
    assert (payload.mask_kind, payload.mask_data.tobytes()) == (kind, data.tobytes())
    assert payload.digest == mask_digest(kind, data)
    assert payload.values.tobytes() == x[mask].tobytes()
    assert P.outside_values(x.astype(np.float64), mask).tobytes() == x[~mask].tobytes()


@pytest.mark.parametrize("outside", [False, True])
def test_a_gather_of_every_position_is_a_copy_of_the_values(outside):
    """A capacity-1 download (or the outside of an empty mask) takes every value, in a buffer of its
    own."""
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    mask = np.full(x.size, not outside)
    got = P.outside_values(x, mask) if outside else P.selected_values(x, mask)
    assert got.tobytes() == x.tobytes() and got.dtype == np.float32
    assert not np.shares_memory(got, x)


def test_fisher_request_sends_the_values_outside_the_mask():
    run = parse_run_config(
        {"fisher-encoding": "masked", "fisher-estimator": "global", "fedfibos-byte-budget": 0}
    )
    method = create_method(run)
    layout = ParamLayout.from_arrays({"w": np.zeros((40, 50)), "b": np.zeros(40)})
    method.start_server(layout)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(layout.size).astype(np.float32)
    mask = rng.random(layout.size) < 0.3
    request = method.fisher_request("client-a", 1, x, mask)
    assert request is not None
    assert (
        request.arrays[P.VALUES].tobytes()
        == np.ascontiguousarray(x[~mask], dtype=np.float32).tobytes()
    )


@settings(max_examples=100, deadline=None)
@given(density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_masked_fisher_decoded_by_positions_is_decoded_by_mask(density, seed):
    layout = ParamLayout.from_arrays(
        {"w": np.zeros((6, 7)), "v": np.zeros(5), "c": np.zeros((3, 2, 2))}
    )
    rng = np.random.default_rng(seed)
    mask = rng.random(layout.size) < density
    fisher = rng.lognormal(0, 1, layout.size).astype(np.float32)
    payload = encode_fisher(fisher, mask, layout, "masked")
    want = decode_fisher(payload, mask, layout, "masked")
    sent = SentSubmodel(1, 2, mask, "digest", 10)
    got = decode_fisher(payload, None, layout, "masked", positions=sent.positions())
    assert got.tobytes() == want.tobytes()


def test_validate_decodes_the_fisher_as_from_the_mask():
    run = parse_run_config({"fisher-encoding": "masked"})
    method = create_method(run)
    layout = ParamLayout.from_arrays({"w": np.zeros((20, 30)), "b": np.zeros(20)})
    method.start_server(layout)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(layout.size).astype(np.float32)
    metrics = {"num-examples": 10, "train-loss": 1.0, "train-seconds": 1.0, "fisher-seconds": 0.1}
    for density in (0.02, 0.3, 1.0):
        mask = rng.random(layout.size) < density
        fisher = rng.lognormal(0, 1, layout.size).astype(np.float32)
        download = method.encode(x, mask)
        sent = SentSubmodel(1, 2, mask, download.digest, 10, True)
        arrays = {P.DELTA: rng.standard_normal(sent.kept).astype(np.float32)}
        arrays.update(encode_fisher(fisher, mask, layout, "masked"))
        reply = method.validate(
            ReplyRecords(arrays, metrics, {"round": 2, "mask-digest": sent.digest}), sent, x
        )
        want = decode_fisher(
            {n: a for n, a in arrays.items() if n != P.DELTA}, mask, layout, "masked"
        )
        assert reply.fisher.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("bad", "message"),
    [(np.nan, "NaN or Inf"), (np.inf, "NaN or Inf"), (-np.inf, "NaN or Inf"), (-1.0, "negative")],
)
def test_fisher_payload_checks_keep_their_reasons(bad, message):
    layout = ParamLayout.from_arrays({"w": np.zeros((4, 5))})
    mask = np.zeros(layout.size, dtype=bool)
    mask[:7] = True
    payload = encode_fisher(np.ones(layout.size, dtype=np.float32), mask, layout, "masked")
    inside = payload["fisher.inside"].copy()
    inside[3] = bad
    with pytest.raises(ValueError, match=message):
        decode_fisher({**payload, "fisher.inside": inside}, mask, layout, "masked")


def _previous_holder_add(num, den, update):
    """The previous :meth:`HolderSum.add`: gather, add and scatter back, a million entries at a
    time."""
    w, k = update.weight, update.indices.size
    for lo in range(0, k, 1 << 20):
        hi = min(lo + (1 << 20), k)
        scaled = np.multiply(update.delta[lo:hi], w, dtype=np.float64)
        if k == num.size:
            num[lo:hi] += scaled
            den[lo:hi] += w
        else:
            idx = update.indices[lo:hi].astype(np.intp)
            num[idx] += scaled
            den[idx] += w


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(1, 200),
    n=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([1, 3, 1 << 16]),
    index_type=st.sampled_from([np.int32, np.int64]),
)
def test_running_sums_add_as_gather_add_scatter(d, n, seed, block, index_type):
    rng = np.random.default_rng(seed)
    num, den = np.zeros(d), np.zeros(d)
    holder, participant = HolderSum(d), ParticipantSum(d)
    previous_participant = np.zeros(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sums_module, "ADD_BLOCK", block)
        for _ in range(n):
            held = np.ones(d, bool) if rng.random() < 0.3 else rng.random(d) < rng.random()
            delta = (rng.standard_normal(int(held.sum())) * 10.0 ** rng.integers(-6, 3)).astype(
                np.float32
            )
            delta[rng.random(delta.size) < 0.1] = -0.0
            delta.flags.writeable = False
            update = MaskedUpdate(
                np.flatnonzero(held).astype(index_type), delta, float(rng.integers(1, 5000))
            )
            _previous_holder_add(num, den, update)
            _previous_holder_add(previous_participant, np.zeros(d), update)
            holder.add(update)
            participant.add(update)
    assert holder.num.tobytes() == num.tobytes() and holder.den.tobytes() == den.tobytes()
    assert participant.num.tobytes() == previous_participant.tobytes()


def _previous_update(state: FisherState, key, fisher, weight, rnd) -> None:
    """The previous :meth:`FisherState.update`'s arithmetic: normalise in 2^20 blocks, then the EMA
    in place."""
    flat = np.asarray(fisher).reshape(-1)
    mean = mean64(flat)
    out = np.empty(flat.shape, dtype=np.float32)
    for start in range(0, flat.size, 1 << 20):
        w = flat[start : start + (1 << 20)].astype(np.float64)
        w /= mean
        out[start : start + (1 << 20)] = w
    old = state.clients.get(key)
    if old is not None and state.ema > 0:
        out *= np.float32(1 - state.ema)
        out += np.multiply(old.fisher, np.float32(state.ema), dtype=np.float32)
    state.clients[key] = state_module.ClientFisher(
        at_precision(out, state.precision), float(weight), rnd
    )


@settings(max_examples=100, deadline=None)
@given(
    d=st.integers(1, 300),
    ema=st.sampled_from([0.0, 0.3, 0.5]),
    precision=st.sampled_from(sorted(PRECISIONS)),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([1, 7, 1 << 16]),
)
def test_fisher_state_update_is_normalise_then_ema(d, ema, precision, seed, block):
    rng = np.random.default_rng(seed)
    state = FisherState(d, ema=ema, precision=precision)
    reference = FisherState(d, ema=ema, precision=precision)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_module, "_SCALE_BLOCK", block)
        for rnd in range(1, 4):
            fisher = (rng.lognormal(0, 3, d) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
            assert state.update("a", fisher, 10.0, rnd)
            _previous_update(reference, "a", fisher, 10.0, rnd)
            assert state.clients["a"].fisher.tobytes() == reference.clients["a"].fisher.tobytes()
            assert state.clients["a"].fisher.dtype == reference.clients["a"].fisher.dtype
    assert not state.update("a", np.zeros(d, dtype=np.float32), 10.0, 5)
    assert state.clients["a"].fisher.tobytes() == reference.clients["a"].fisher.tobytes()


@pytest.mark.parametrize("levels", [30, 300, 10**6])
@pytest.mark.parametrize("seed", range(4))
def test_fused_selection_with_ties_at_the_threshold(levels, seed):
    """Integer values: many positions share the threshold's score, so the ties go to the lower
    indices."""
    shapes = [(40, 90), (40,), (70, 120), (7, 3, 5)]
    layout = ParamLayout.from_arrays({f"t{i}": np.zeros(s) for i, s in enumerate(shapes)})
    rng = np.random.default_rng(seed)
    f = rng.integers(0, levels, size=layout.size).astype(np.float32)
    x = rng.integers(-levels, levels + 1, size=layout.size).astype(np.float32)
    applied = 0
    for gamma in (0.02, 0.1, 0.3, 0.45):
        for m in (0, 1, 3):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
                want = _full_partition_mask(layout, x, f, gamma, m, True)
                mp.setattr(selection, "PRUNE_MIN_FREE", 0)
                mp.setattr(selection, "_FUSED_BLOCK", 500)
                fused = selection._fisher_mask(layout, x, f, budget(gamma, layout.size), m, True)
                got = select_mask(layout, x, gamma, "fisher", f, m)
            applied += fused is not None
            assert fused is None or fused.tobytes() == want.tobytes()
            assert got.tobytes() == want.tobytes()
    assert applied


def _colliding_values(rng: np.random.Generator, d: int, exponents: list[int]) -> np.ndarray:
    """float32 values ``(1 + j 2^-23) 2^e``: products of two such differ in float64 and often tie in
    float32."""
    mantissa = 1.0 + rng.integers(0, 8, size=d) * 2.0**-23
    return (mantissa * 2.0 ** rng.choice(exponents, size=d)).astype(np.float32)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    gamma=st.sampled_from([0.01, 0.05, 0.2, 0.45]),
    f_exponents=st.sampled_from([[0], [0, 1], [-100, 0, 100], [-126, -120, 0]]),
    x_exponents=st.sampled_from([[0], [-1, 0], [-50, 0, 30], [-30, 0]]),
    block=st.sampled_from([7, 500, 1 << 16]),
    sample=st.sampled_from([2, 64, 1 << 20]),
)
def test_fused_selection_on_float32_rounded_products_is_the_float64_one(
    seed, gamma, f_exponents, x_exponents, block, sample
):
    """Without guards the candidates are found on float32 products: values whose float64 products
    differ but round to the same float32 (ties the float64 ranking does not have, some at the floor
    and the threshold), products beyond float32's range (their blocks go in float64) and below it
    (rounded to zero) give the mask of the float64 scores."""
    shapes = [(30, 40), (30,), (50, 61), (4, 3, 5, 5)]
    layout = ParamLayout.from_arrays({f"t{i}": np.zeros(s) for i, s in enumerate(shapes)})
    rng = np.random.default_rng(seed)
    f = _colliding_values(rng, layout.size, f_exponents)
    f[rng.random(layout.size) < 0.05] = 0.0
    x = _colliding_values(rng, layout.size, x_exponents) * rng.choice(
        [-1.0, 1.0], size=layout.size
    ).astype(np.float32)
    products = f.astype(np.float64) * np.abs(x.astype(np.float64))
    with np.errstate(over="ignore"):  # some products are beyond float32's range, as meant
        rounded = products.astype(np.float32)
    assert np.unique(rounded).size < np.unique(products).size  # the float32 ties exist
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
        want = _full_partition_mask(layout, x, f, gamma, 0, False)
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        mp.setattr(selection, "PRUNE_SAMPLE", sample)
        mp.setattr(selection, "_FUSED_BLOCK", block)
        fused = selection._fisher_mask(layout, x, f, budget(gamma, layout.size), 0, False)
        got = select_mask(layout, x, gamma, "fisher", f, 0, False)
    assert fused is None or fused.tobytes() == want.tobytes()
    assert got.tobytes() == want.tobytes()


def test_fused_selection_finds_candidates_on_float32_products_unless_a_guard_reads_the_scores():
    """The float32 pass is taken for the unguarded blocks of float32 values (and the mask is the
    float64 one); a guard's block, or float64 values, are scored in float64 only."""
    shapes = [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (10, 128)]
    layout = ParamLayout.from_arrays({f"t{i}": np.zeros(s) for i, s in enumerate(shapes)})
    rng = np.random.default_rng(3)
    x = rng.standard_normal(layout.size).astype(np.float32)
    f = rng.lognormal(0, 2, layout.size).astype(np.float32)
    k = budget(0.0625, layout.size)
    calls: list[int] = []  # sizes of the float32 products made
    real_multiply = np.multiply

    def counted(a, b, *args, **kwargs):
        out = kwargs.get("out")
        if out is not None and out.dtype == np.float32:
            calls.append(out.size)
        return real_multiply(a, b, *args, **kwargs)

    cases = (
        (0, False, x, layout.size),
        (1, False, x, 64),
        (0, True, x, layout.size - 64),
        (0, False, x.astype(np.float64), 0),
    )
    for m, keep, xs, rounded in cases:
        calls.clear()
        with mock.patch.object(selection.np, "multiply", counted):
            fused = selection._fisher_mask(layout, xs, f, k, m, keep)
        assert fused is not None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(selection, "PRUNE_MIN_FREE", 1 << 60)
            assert fused.tobytes() == _full_partition_mask(layout, xs, f, 0.0625, m, keep).tobytes()
        assert sum(calls) == rounded, (m, keep)


@pytest.mark.parametrize(
    ("floor", "k", "want"),
    [
        # The floor is P's score: Q rounds to the floor from below it and must not become a
        # candidate (the float64 block's R, tied with Q and at a lower index, would then lose to
        # it).
        (1 + 2.0**-22 + 2.0**-46, 3, [0, 1, 8]),
        # The floor is Q's score, exactly representable: the positions whose rounded product equals
        # it are candidates (P and Q), and P is the second largest.
        (1 + 2.0**-22, 2, [0, 8]),
    ],
)
def test_fused_selection_on_rounded_products_keeps_exactly_the_float64_candidates(floor, k, want):
    """Hand-made: a float64 block (one product beyond float32's range) beside a float32 one, at a
    given floor."""
    layout = ParamLayout.from_arrays({"a": np.zeros((2, 4)), "b": np.zeros((2, 4))})
    f = np.full(layout.size, 0.5, dtype=np.float32)
    x = np.full(layout.size, 0.5, dtype=np.float32)
    f[0], x[0] = 2.0**100, 2.0**30  # 2^130: block "a" is scored in float64
    f[1], x[1] = 1 + 2.0**-22, 1.0  # R: 1 + 2^-22
    f[8], x[8] = 1 + 2.0**-23, 1 + 2.0**-23  # P: 1 + 2^-22 + 2^-46, rounds to 1 + 2^-22 in float32
    f[9], x[9] = 1 + 2.0**-22, 1.0  # Q: 1 + 2^-22, R's score
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "PRUNE_MIN_FREE", 0)
        mp.setattr(selection, "_fisher_floor", lambda *_: floor)
        fused = selection._fisher_mask(layout, x, f, k, 0, False)
        got = select_mask(layout, x, k / layout.size, "fisher", f, 0, False)
    assert np.flatnonzero(got).tolist() == want
    assert fused is None or np.flatnonzero(fused).tolist() == want


def _previous_pack_fixed(values: np.ndarray, width: int) -> np.ndarray:
    """The previous bit packing of the Elias-Fano low bits: every value unpacked to bits, then
    packed."""
    dt = mask_codec._uint_dtype(width)
    as_bytes = values.astype(dt).view(np.uint8).reshape(values.size, dt.itemsize)
    return np.packbits(np.unpackbits(as_bytes, axis=1)[:, 8 * dt.itemsize - width :])


@settings(max_examples=200, deadline=None)
@given(count=st.integers(0, 70), width=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_fixed_width_packing_is_the_unpack_pack_one(count, width, seed):
    values = np.random.default_rng(seed).integers(0, 1 << width, size=count, dtype=np.int64)
    got = mask_codec._pack_fixed(values, width)
    assert got.dtype == np.uint8 and got.tobytes() == _previous_pack_fixed(values, width).tobytes()


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.1])
def test_elias_fano_codes_decode_to_their_masks(density):
    rng = np.random.default_rng(11)
    mask = rng.random(100_003) < density
    ENCODINGS.clear()
    kind, data = encode_mask(mask)
    assert mask_codec.decode_mask(kind, data, mask.size).tobytes() == mask.tobytes()


@settings(max_examples=200, deadline=None)
@given(d=st.integers(1, 70), flip=st.integers(-1, 69), padding=st.booleans())
def test_full_mask_positions_read_off_the_packed_bytes(d, flip, padding):
    """A mask said to be full: its positions, or the previous error (the unpacked bits counted)."""
    bits = np.ones(d, dtype=bool)
    if 0 <= flip < d:
        bits[flip] = False
    packed = np.packbits(bits)
    if padding and d % 8:
        packed[-1] |= 1  # a padding bit set: ignored, as unpacking the first d bits ignores it
    n = int(np.count_nonzero(np.unpackbits(packed, count=d)))
    if n == d:
        assert (
            mask_codec.packed_positions(packed, d, d).tobytes()
            == np.arange(d, dtype=np.int32).tobytes()
        )
    else:
        with pytest.raises(ValueError, match=f"holds {n} set positions, expected {d}"):
            mask_codec.packed_positions(packed, d, d)
