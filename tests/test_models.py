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


@pytest.mark.parametrize("name,own", [("cnn-gn", True), ("cnn", True), ("cnn-bn", False)])
def test_an_examples_training_output_depends_on_itself_alone_exactly_for_the_per_example_models(
    name, own
):
    """What ``dp-epsilon`` needs of a model: in training mode, one example gives the same output
    alone as inside a minibatch of other examples (GroupNorm's statistics are the example's own,
    BatchNorm's the minibatch's)."""
    from common.models.catalog import BATCH_STATISTICS_MODELS

    model = build_model(name, 10, 1, 0).train()
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together, alone = model(x)[:1], model(x[:1])
        alone_in_other_company = model(torch.cat([x[:1], 3 * x[1:]]))[:1]
    same = torch.allclose(together, alone_in_other_company, atol=1e-5)
    assert same is own and (name in BATCH_STATISTICS_MODELS) is not own
    if own:
        assert torch.allclose(together, alone, atol=1e-5)


def test_the_groupnorm_cnn_shares_the_batchnorm_cnns_layout_and_starts_as_an_identity_norm():
    gn, bn = build_model("cnn-gn", 10, 1, 3), build_model("cnn-bn", 10, 1, 3)
    assert model_layout(gn).names == model_layout(bn).names
    assert isinstance(gn.bn1, torch.nn.GroupNorm) and gn.bn1.num_groups == 1
    assert torch.equal(gn.bn2.weight, torch.ones(64)) and torch.equal(gn.bn2.bias, torch.zeros(64))
    assert list(gn.buffers()) == []
    # the same seed draws the same convolutions and linear layers
    assert torch.equal(gn.conv1.weight, bn.conv1.weight) and torch.equal(gn.fc2.bias, bn.fc2.bias)
