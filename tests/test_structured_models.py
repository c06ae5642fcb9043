"""Physically smaller models, slicing and reconstruction (CA-HFP)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.architectures import build_model, load_flat, model_layout, trainable_arrays
from common.models.structured import build_structured_model, skeleton_layout
from common.submodels.channel_slicing import (
    channels_digest,
    check_selection,
    decode_channels,
    encode_channels,
    reconstruct,
    selection_mask,
    selection_of_mask,
    slice_arrays,
    sliced_layout,
    sliced_shapes,
)
from common.submodels.width import channel_graph, group_sizes, width_mask

MODELS = {"cnn": (1, 8), "resnet18": (3, 32)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def full(request):
    name = request.param
    model = build_model(name, 10, MODELS[name][0], 0)
    layout = model_layout(model)
    return name, model, layout, channel_graph(name, layout), layout.flatten(trainable_arrays(model))


def _random_selection(sizes, fraction, seed):
    rng = np.random.default_rng(seed)
    return {
        g: np.sort(rng.choice(n, max(1, round(fraction * n)), replace=False))
        for g, n in sizes.items()
    }


@pytest.mark.parametrize("fraction,seed", [(0.25, 0), (0.5, 1), (1 / 16, 2)])
def test_small_model_computes_what_the_zeroed_full_model_computes(full, fraction, seed):
    """Dropped channels (and their BatchNorm weight and bias) zeroed in the full model = the small
    model."""
    name, _, layout, graph, x = full
    selection = _random_selection(group_sizes(layout, graph), fraction, seed)
    mask = selection_mask(layout, graph, selection)
    zeroed = build_model(name, 10, MODELS[name][0], 0)
    load_flat(zeroed, layout, np.where(mask, x, 0).astype(np.float32))
    with torch.device("meta"):
        skeleton = build_model(name, 10, MODELS[name][0], 0)
    small = build_structured_model(
        skeleton, slice_arrays(layout, graph, selection, layout.unflatten(x))
    )
    assert sum(p.numel() for p in small.parameters()) == int(mask.sum())
    inp = torch.randn(
        5,
        MODELS[name][0],
        MODELS[name][1],
        MODELS[name][1],
        generator=torch.Generator().manual_seed(3),
    )
    zeroed.eval(), small.eval()
    with torch.no_grad():
        torch.testing.assert_close(small(inp), zeroed(inp), rtol=1e-4, atol=1e-5)


def test_small_model_has_the_gradient_of_the_zeroed_full_model_at_held_positions():
    name = "cnn"
    zeroed = build_model(name, 10, 1, 0)
    layout = model_layout(zeroed)
    graph = channel_graph(name, layout)
    x = layout.flatten(trainable_arrays(zeroed))
    selection = _random_selection(group_sizes(layout, graph), 0.5, 4)
    mask = selection_mask(layout, graph, selection)
    zeroed = build_model(name, 10, 1, 0)
    load_flat(zeroed, layout, np.where(mask, x, 0).astype(np.float32))
    small = build_structured_model(
        zeroed, slice_arrays(layout, graph, selection, layout.unflatten(x))
    )
    inp, target = torch.randn(8, 1, 8, 8), torch.arange(8) % 10
    for m in (zeroed, small):
        torch.nn.functional.cross_entropy(m(inp), target).backward()
    full_grad = np.concatenate([p.grad.numpy().reshape(-1) for p in zeroed.parameters()])
    small_grad = np.concatenate([p.grad.numpy().reshape(-1) for p in small.parameters()])
    np.testing.assert_allclose(small_grad, full_grad[mask], rtol=1e-4, atol=1e-6)


def test_slicing_lists_the_held_positions_in_order_and_reconstruction_round_trips(full):
    _, _, layout, graph, x = full
    selection = _random_selection(group_sizes(layout, graph), 0.3, 5)
    small = slice_arrays(layout, graph, selection, layout.unflatten(x))
    shapes = sliced_shapes(layout, graph, selection)
    assert {n: a.shape for n, a in small.items()} == shapes
    assert sliced_layout(layout, graph, selection).names == layout.names
    mask = selection_mask(layout, graph, selection)
    assert np.array_equal(np.concatenate([a.reshape(-1) for a in small.values()]), x[mask])
    assert sliced_layout(layout, graph, selection).size == int(mask.sum())
    other = (
        np.random.default_rng(6).normal(size=layout.size).astype(np.float32)
    )  # a "current global model"
    rebuilt, held = reconstruct(layout, graph, selection, small, other)
    assert np.array_equal(held, mask)
    assert np.array_equal(rebuilt[mask], x[mask]) and np.array_equal(rebuilt[~mask], other[~mask])
    back = selection_of_mask(layout, graph, mask)
    assert all(np.array_equal(back[g], selection[g]) for g in selection)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fraction=st.floats(0.01, 1.0))
def test_cnn_round_trip_for_any_selection(seed, fraction):
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    graph = channel_graph("cnn", layout)
    x = np.random.default_rng(seed).normal(size=layout.size).astype(np.float32)
    g = np.random.default_rng(seed + 1).normal(size=layout.size).astype(np.float32)
    selection = _random_selection(group_sizes(layout, graph), fraction, seed)
    small = slice_arrays(layout, graph, selection, layout.unflatten(x))
    rebuilt, mask = reconstruct(layout, graph, selection, small, g)
    assert np.array_equal(rebuilt, np.where(mask, x, g))
    assert mask.sum() == sum(a.size for a in small.values())


def test_width_mask_is_the_selection_mask_of_the_first_channels(full):
    _, _, layout, graph, _ = full
    sizes = group_sizes(layout, graph)
    first = {g: np.arange(max(1, n // 2)) for g, n in sizes.items()}
    assert np.array_equal(selection_mask(layout, graph, first), width_mask(layout, graph, 0.5))


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda s: {k: v for k, v in list(s.items())[1:]}, "groups"),
        (lambda s: {**s, next(iter(s)): np.array([], dtype=np.int64)}, "non-empty"),
        (lambda s: {**s, next(iter(s)): np.array([1, 0])}, "increasing"),
        (lambda s: {**s, next(iter(s)): np.array([0, 0])}, "increasing"),
        (lambda s: {**s, next(iter(s)): np.array([10_000])}, "increasing"),
        (lambda s: {**s, next(iter(s)): np.array([0.0, 1.0])}, "integer"),
    ],
)
def test_bad_selections_are_refused_naming_the_group(full, bad, match):
    _, _, layout, graph, _ = full
    sizes = group_sizes(layout, graph)
    with pytest.raises(ValueError, match=match):
        check_selection(bad({g: np.arange(n) for g, n in sizes.items()}), sizes)


def test_small_arrays_with_wrong_shapes_are_refused(full):
    _, _, layout, graph, x = full
    selection = _random_selection(group_sizes(layout, graph), 0.5, 7)
    small = slice_arrays(layout, graph, selection, layout.unflatten(x))
    name = layout.names[0]
    for bad, match in (
        ({**small, name: small[name][:-1]}, name),
        ({**small, name: small[name].astype(np.float64)}, name),
        ({k: v for k, v in small.items() if k != name}, "missing"),
        ({**small, "extra.weight": np.zeros(2, np.float32)}, "unexpected"),
        ({**small, name: np.full_like(small[name], np.nan)}, "NaN"),
    ):
        with pytest.raises(ValueError, match=match):
            reconstruct(layout, graph, selection, bad, x)


def test_a_non_channel_mask_is_not_mistaken_for_a_selection(full):
    _, _, layout, graph, _ = full
    mask = width_mask(layout, graph, 0.5)
    mask[np.flatnonzero(mask)[3]] = False  # one weight missing inside a kept channel
    with pytest.raises(ValueError, match="channel submodel"):
        selection_of_mask(layout, graph, mask)


def test_skeleton_on_meta_device_allocates_nothing_and_gives_the_layout():
    with torch.device("meta"):
        skeleton = build_model("resnet18", 10, 3, 0)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton_layout(skeleton) == model_layout(build_model("resnet18", 10, 3, 0))


def test_builder_refuses_unknown_layers_and_missing_arrays():
    net = torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3))
    with pytest.raises(TypeError, match="Conv1d"):
        build_structured_model(net, {n: p.detach().numpy() for n, p in net.named_parameters()})
    cnn = build_model("cnn", 10, 1, 0)
    arrays = trainable_arrays(cnn)
    arrays.pop("fc2.bias")
    with pytest.raises(ValueError, match="fc2.bias"):
        build_structured_model(cnn, arrays)


def test_channel_indices_travel_in_the_narrowest_dtype_and_decode_strictly(full):
    _, _, layout, graph, _ = full
    sizes = group_sizes(layout, graph)
    selection = _random_selection(sizes, 0.5, 8)
    wire = encode_channels(selection, sizes)
    assert all(
        a.dtype == np.uint8 if sizes[g] <= 256 else a.dtype == np.uint16 for g, a in wire.items()
    )
    back = decode_channels(wire, sizes)
    assert all(np.array_equal(back[g], selection[g]) for g in sizes)
    g0 = next(iter(sizes))
    with pytest.raises(ValueError, match=g0):
        decode_channels({**wire, g0: wire[g0].astype(np.int64)}, sizes)
    assert channels_digest(wire) != channels_digest({**wire, g0: wire[g0][:-1]})
