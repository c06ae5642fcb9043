"""Model builders: shapes, determinism, static BatchNorm, flat round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.models.architectures import build_model, load_flat, model_layout, trainable_arrays


@pytest.mark.parametrize("size", [8, 28])
def test_small_cnn_handles_8x8_and_28x28(size):
    model = build_model("cnn", 10, 1, 0)
    assert model(torch.zeros(2, 1, size, size)).shape == (2, 10)


def test_resnet18_for_32x32_has_static_batchnorm():
    model = build_model("resnet18", 100, 3, 0)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    assert list(model.buffers()) == []  # no running statistics to aggregate or leak
    layout = model_layout(model)
    assert 11_000_000 < layout.size < 11_300_000


def test_same_seed_same_weights_and_flat_round_trip():
    a, b = build_model("cnn", 10, 1, 5), build_model("cnn", 10, 1, 5)
    layout = model_layout(a)
    xa, xb = layout.flatten(trainable_arrays(a)), layout.flatten(trainable_arrays(b))
    assert np.array_equal(xa, xb)
    assert not np.array_equal(xa, layout.flatten(trainable_arrays(build_model("cnn", 10, 1, 6))))
    c = build_model("cnn", 10, 1, 9)
    load_flat(c, layout, xa)
    assert np.array_equal(layout.flatten(trainable_arrays(c)), xa)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vit", 10, 3, 0)
