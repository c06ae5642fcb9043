"""FIARSE's elements: threshold mask, masked or surrogate gradient, in-round re-masking,
non-zero-count aggregation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from common.aggregation.masked import MaskedUpdate
from common.aggregation.update_means import nonzero_mean_step
from common.config.parse import parse_run_config
from common.data.arrays import ArrayDataset
from common.methods import create_method
from common.methods.contract.payloads import Received
from common.methods.round_fold import Accepted
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.submodels.threshold import (
    ThresholdGate,
    ThresholdIndicator,
    attach_threshold_gates,
    detach_threshold_gates,
    gated_count,
    gated_names,
    gated_positions,
    received_threshold,
    surrogate_factor,
    threshold_for,
    threshold_mask,
)
from common.training.loop import TrainConfig
from common.wire import protocol as P
from common.wire.protocol import encode_submodel
from common.wire.validation import TrainReply


def test_indicator_backward_is_the_published_surrogate():
    s = torch.tensor([0.0, 0.05, 0.1, 0.2, 1.0, 3.0], requires_grad=True)
    theta = torch.tensor(0.1)
    out = ThresholdIndicator.apply(s, theta)
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    upstream = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5, 2.0])
    out.backward(upstream)
    expected = upstream * 2 * 0.1 / (s.detach() + 0.1) ** 2 * (s.detach() >= 0.1)
    assert torch.allclose(s.grad, expected)


def test_indicator_at_zero_threshold_gives_no_nan():
    s = torch.tensor([0.0, 0.5], requires_grad=True)
    ThresholdIndicator.apply(s, torch.tensor(0.0)).sum().backward()
    assert s.grad.tolist() == [0.0, 0.0]


@given(
    st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=1, max_size=40),
    st.floats(0.0, 1.0, width=32),
)
@settings(max_examples=60, deadline=None)
def test_gate_gradient_matches_closed_form(values, theta):
    """Autograd through ``w * 1[|w| >= theta]`` equals ``1[|w|>=theta] (1 + 2 theta |w| / (|w| +
    theta)^2)``."""
    w = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    upstream = torch.linspace(-1, 1, w.numel(), dtype=torch.float64)
    (ThresholdGate(theta, surrogate=True)(w) * upstream).sum().backward()
    expected = upstream.numpy() * surrogate_factor(np.array(values), float(np.float32(theta)))
    np.testing.assert_allclose(w.grad.numpy(), expected, rtol=1e-6, atol=1e-12)


def test_gate_without_surrogate_passes_the_effective_gradient_on_held_positions():
    w = torch.tensor([0.05, -0.2, 0.5], requires_grad=True)
    (ThresholdGate(0.1, surrogate=False)(w) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert w.grad.tolist() == [0.0, 2.0, 3.0]


class _PublishedBern(torch.autograd.Function):
    """FIARSE's ``model_utils.Bern`` as published: the forward returns a bool tensor; ``calls``
    counts backwards."""

    calls = 0

    @staticmethod
    def forward(ctx, scores, threshold):
        ctx.save_for_backward(scores, threshold)
        return scores >= threshold

    @staticmethod
    def backward(ctx, grad_output):
        _PublishedBern.calls += 1
        scores, threshold = ctx.saved_tensors
        grad = torch.nan_to_num(
            2 * threshold / torch.pow(scores + threshold, 2), nan=0.0, posinf=0.0, neginf=0.0
        )
        return grad_output * grad * (scores >= threshold), None


def _published_masked_linear(x, weight, bias, threshold):
    """FIARSE's ``MaskedLinear.forward`` with ``bern=True`` (the training path)."""
    weight_mask = _PublishedBern.apply(torch.abs(weight), threshold)
    bias_mask = _PublishedBern.apply(torch.abs(bias), threshold)
    return F.linear(x, weight * weight_mask, bias * bias_mask)


def test_default_gradient_is_the_published_codes_plain_masked_gradient():
    """The published ``Bern`` is never differentiated; the default gate gives its gradient, ``1[|w|
    >= theta] g``."""
    torch.manual_seed(0)
    x, target = torch.randn(16, 6), torch.randn(16, 4)
    w0, b0 = torch.randn(4, 6), torch.randn(4)
    theta = torch.tensor(0.6)

    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    _PublishedBern.calls = 0
    F.mse_loss(_published_masked_linear(x, w, b, theta), target).backward()
    assert (
        _PublishedBern.calls == 0
    )  # a bool output is not differentiable: autograd never calls backward
    held_w, held_b = w0.abs() >= theta, b0.abs() >= theta
    assert held_w.any() and (~held_w).any() and held_b.any() and (~held_b).any()

    # The plain masked gradient: the gradient of the effective weight, on the held positions only.
    eff_w, eff_b = (w0 * held_w).requires_grad_(), (b0 * held_b).requires_grad_()
    F.mse_loss(F.linear(x, eff_w, eff_b), target).backward()
    torch.testing.assert_close(w.grad, eff_w.grad * held_w, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, eff_b.grad * held_b, rtol=0, atol=0)

    # This product's default (``fiarse-surrogate``), through the gates the client attaches.
    surrogate = create_method(parse_run_config({"method": "fiarse"})).opts.surrogate
    lin = nn.Linear(6, 4)
    with torch.no_grad():
        lin.weight.copy_(w0)
        lin.bias.copy_(b0)
    gates = attach_threshold_gates(lin, ["weight", "bias"], float(theta), surrogate)
    F.mse_loss(lin(x), target).backward()
    grads = (lin.parametrizations.weight.original.grad, lin.parametrizations.bias.original.grad)
    detach_threshold_gates(gates)
    torch.testing.assert_close(grads[0], w.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1], b.grad, rtol=1e-6, atol=1e-7)

    # The paper's surrogate (``fiarse-surrogate = true``) is what a float-valued indicator would
    # give instead.
    on = create_method(
        parse_run_config({"method": "fiarse", "fiarse-surrogate": True})
    ).opts.surrogate
    lin_s = nn.Linear(6, 4)
    with torch.no_grad():
        lin_s.weight.copy_(w0)
        lin_s.bias.copy_(b0)
    attach_threshold_gates(lin_s, ["weight", "bias"], float(theta), on)
    F.mse_loss(lin_s(x), target).backward()
    expected = eff_w.grad.numpy() * surrogate_factor(w0.numpy(), float(theta))
    np.testing.assert_allclose(
        lin_s.parametrizations.weight.original.grad.numpy(), expected, rtol=1e-5, atol=1e-7
    )
    assert not torch.allclose(lin_s.parametrizations.weight.original.grad, w.grad)


def test_gated_names_skip_normalisation_layers():
    resnet = build_model("resnet18", 10, 3, 0)
    names = gated_names(resnet)
    assert "conv1.weight" in names and "fc.weight" in names and "fc.bias" in names
    assert "bn1.weight" not in names and "layer1.0.bn2.bias" not in names
    assert "layer2.0.downsample.0.weight" in names and "layer2.0.downsample.1.weight" not in names
    cnn = build_model("cnn", 10, 1, 0)
    assert gated_names(cnn) == set(model_layout(cnn).names)


@given(
    st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=2, max_size=60),
    st.floats(0.01, 1.0),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=80, deadline=None)
def test_threshold_mask_against_brute_force(values, gamma, seed):
    x = np.array(values, dtype=np.float32)
    gated = np.random.default_rng(seed).random(x.size) < 0.8
    if not gated.any():
        gated[0] = True
    theta = threshold_for(x, gated, gamma)
    k = max(1, int(gamma * gated.sum()))
    assert theta == sorted(np.abs(x[gated]), reverse=True)[k - 1]
    mask = threshold_mask(x, gated, theta)
    assert np.array_equal(mask, ~gated | (np.abs(x) >= theta))
    assert (mask & gated).sum() >= k  # ties at theta are all held, as the published `>=` does
    held = np.where(mask, x, 0).astype(np.float32)
    assert received_threshold(held, gated, mask) == theta


def test_gated_count_and_bad_capacity():
    assert (
        gated_count(0.25, 100) == 25 and gated_count(0.001, 100) == 1 and gated_count(1.0, 7) == 7
    )
    with pytest.raises(ValueError, match="gamma"):
        gated_count(0.0, 10)
    with pytest.raises(ValueError, match="gated"):
        gated_positions(model_layout(build_model("cnn", 10, 1, 0)), ["nope.weight"])


def test_mask_changes_inside_the_round():
    """A held weight pushed below theta leaves the forward pass at the next step and stops
    moving."""
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.3]]))
    gates = attach_threshold_gates(lin, ["weight"], theta=0.25, surrogate=True)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.tensor([[1.0, 1.0]])
    trace = []
    for _ in range(3):
        opt.zero_grad()
        lin(x).sum().backward()  # d/dw = +1 on the effective weight: SGD shrinks both weights
        opt.step()
        raw = lin.parametrizations.weight.original.detach().clone()
        trace.append((raw.tolist()[0], lin.weight.detach().tolist()[0]))
    # step 1: w1 = 0.3 - 0.1 * (1 + 2*0.25*0.3/0.55^2) = 0.1504...: below theta, gated out from step
    # 2 on
    assert trace[0][0][1] == pytest.approx(0.3 - 0.1 * (1 + 2 * 0.25 * 0.3 / 0.55**2))
    assert trace[0][1][1] == 0.0 and trace[1][0][1] == trace[0][0][1] == trace[2][0][1]
    assert trace[2][0][0] < trace[1][0][0] < trace[0][0][0] < 1.0  # the large weight keeps training
    detach_threshold_gates(gates)
    assert lin.weight.detach().tolist()[0][1] == pytest.approx(
        trace[0][0][1]
    )  # raw value, not zeroed


def test_nonzero_mean_against_brute_force():
    rng = np.random.default_rng(0)
    d = 30
    x = rng.normal(size=d).astype(np.float32)
    updates = []
    for _ in range(4):
        idx = np.sort(rng.choice(d, size=12, replace=False)).astype(np.int64)
        delta = rng.normal(size=12).astype(np.float32)
        delta[rng.random(12) < 0.3] = 0.0  # held but unmoved (e.g. dropped below theta at once)
        updates.append(MaskedUpdate(idx, delta, float(rng.integers(1, 50))))
    got = nonzero_mean_step(x, updates, server_lr=0.7)
    for j in range(d):
        moved = [
            u.delta[u.indices == j][0]
            for u in updates
            if j in u.indices and u.delta[u.indices == j][0] != 0
        ]
        expected = x[j] + 0.7 * (sum(moved) / len(moved)) if moved else x[j]
        assert got[j] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    untouched = np.setdiff1d(np.arange(d), np.concatenate([u.indices for u in updates]))
    assert np.array_equal(got[untouched], x[untouched])


def _digits(n: int = 64) -> ArrayDataset:
    rng = np.random.default_rng(1)
    return ArrayDataset(rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n), 10)


def test_fiarse_round_trip_server_mask_client_training_and_aggregation():
    run = parse_run_config({"method": "fiarse", "seed": 3})
    method = create_method(run)
    model = build_model(run.model, 10, 1, run.seed)
    layout = model_layout(model)
    method.start_server(layout)
    x = layout.flatten(trainable_arrays(model))
    mask, source = method.mask_for("a", 1, 0.25, x)
    assert source == "threshold" and mask.sum() == pytest.approx(0.25 * layout.size, abs=2)
    payload = encode_submodel(x, mask)
    records = {P.SUBMODEL: {P.VALUES: payload.values, P.MASK: payload.mask_data}}
    got = Received(records, payload.mask_kind, "", layout.size, 1)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.5, seed=0)
    update = method.client_train(got, _digits(), cfg, torch.device("cpu"))
    delta = update.arrays[P.DELTA]
    assert delta.shape == (mask.sum(),) and np.all(np.isfinite(delta)) and np.any(delta != 0)
    theta = threshold_for(x, method.gated, 0.25)
    trained = x[mask] + delta
    assert np.any(np.abs(trained) < theta)  # some held weights left the submodel during the round
    new = method.aggregate(x, [_accepted(mask, delta)], 1)
    assert np.array_equal(new[~mask], x[~mask])
    moved = delta != 0
    np.testing.assert_allclose(new[mask][moved], (x[mask] + delta)[moved], rtol=1e-6)


def _accepted(mask, delta):
    return Accepted(1, "a", TrainReply(MaskedUpdate(np.flatnonzero(mask), delta, 64.0), None, {}))
