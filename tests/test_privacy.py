"""Differential privacy of a node's uploads: the mechanisms, the accountant, the node's ledger and
the settings."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from client.privacy import (
    charge_reply,
    check_budget,
    ledger_path,
    open_ledger,
    private_config,
    save_ledger,
)
from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.fisher.estimation import per_example_fisher
from common.methods import create_method
from common.methods.contract.payloads import LocalUpdate
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.privacy.accountant import (
    ORDERS,
    BudgetSpent,
    PrivacyLedger,
    calibrate_multiplier,
    epsilon_spent,
)
from common.privacy.mechanism import fisher_noise_std, privatise_fisher
from common.privacy.private_sgd import private_gradient
from common.privacy.releases import fisher_uploads, node_releases
from common.training.loop import TrainConfig, round_train_config, train_loop
from common.wire import protocol as P

DELTA = 1e-5


# ----------------------------------------------------------------- the accountant
def test_one_gaussian_mechanism_spends_the_hand_computed_epsilon():
    # One Gaussian mechanism of multiplier z over all the data: RDP a / (2 z^2) at order a,
    # converted by eps = min_a [ rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1) ].
    z = 1.0
    a = np.array(ORDERS)
    by_hand = np.min(a / (2 * z**2) + np.log((a - 1) / a) - (np.log(DELTA) + np.log(a)) / (a - 1))
    assert epsilon_spent(z, ((1.0, 1),), DELTA) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand == pytest.approx(4.7285, abs=1e-4)
    # k mechanisms of multiplier z compose to one of multiplier z / sqrt(k)
    assert epsilon_spent(2.0, ((1.0, 4),), DELTA) == pytest.approx(
        epsilon_spent(1.0, ((1.0, 1),), DELTA), rel=1e-9
    )


def test_a_sampled_step_costs_less_than_a_full_one_and_nothing_costs_nothing():
    full = epsilon_spent(1.0, ((1.0, 10),), DELTA)
    sampled = epsilon_spent(1.0, ((0.1, 10),), DELTA)
    assert 0 < sampled < full
    assert epsilon_spent(1.0, ((0.1, 0), (1.0, 0)), DELTA) == 0.0


@pytest.mark.parametrize("target", [1.0, 4.0, 8.0])
def test_the_calibrated_multiplier_is_the_smallest_that_fits(target):
    releases = node_releases(480, 32, 2, 20, fisher_uploads(20, 5, True))
    z = calibrate_multiplier(target, DELTA, releases)
    assert epsilon_spent(z, releases, DELTA) <= target
    assert epsilon_spent(z - 2e-3, releases, DELTA) > target


def test_node_releases_count_steps_and_fisher_uploads():
    assert node_releases(100, 32, 2, 3, 4) == ((0.32, 3 * 2 * 4), (1.0, 4))
    assert node_releases(10, 32, 1, 1, 0) == ((1.0, 1), (1.0, 0))
    assert fisher_uploads(20, 5, True) == 5
    assert fisher_uploads(20, 3, False) == 7


def test_the_ledger_refuses_a_release_past_its_target_and_keeps_what_it_had():
    ledger = PrivacyLedger(3.0, DELTA)
    spent = ledger.charge(2.0, ((1.0, 1),))
    assert spent == pytest.approx(ledger.spent())
    before = (list(ledger.rdp), ledger.releases)
    assert ledger.check(2.0, ((0.1, 1),)) > spent  # a check records nothing
    assert (ledger.rdp, ledger.releases) == before
    with pytest.raises(BudgetSpent, match="dp-epsilon=3"):
        ledger.charge(2.0, ((1.0, 5),))
    assert (ledger.rdp, ledger.releases) == before
    assert PrivacyLedger.from_dict(json.loads(json.dumps(ledger.as_dict()))) == ledger
    with pytest.raises(ValueError):
        PrivacyLedger.from_dict({"target_epsilon": 1, "delta": 1e-5, "rdp": [0.1], "releases": 1})


# ----------------------------------------------------------------- the mechanisms
def test_fisher_noise_has_the_gaussian_mechanism_scale():
    assert fisher_noise_std(1.5, 2.0, 30) == pytest.approx(1.5 * 4.0 / 30)
    zeros = np.zeros(200_000, dtype=np.float32)
    noisy = privatise_fisher(zeros, 1.5, 2.0, 30, seed=7)
    # half the draws are negative and set to 0; the others are |N(0, s^2)|, of mean s sqrt(2 / pi)
    s = 1.5 * 4.0 / 30
    assert (noisy >= 0).all()
    assert np.mean(noisy == 0) == pytest.approx(0.5, abs=0.01)
    assert noisy[noisy > 0].mean() == pytest.approx(s * math.sqrt(2 / math.pi), rel=0.02)
    assert np.array_equal(
        noisy, privatise_fisher(zeros, 1.5, 2.0, 30, seed=7)
    )  # a rerun repeats it


def _data(n: int, seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 1, 8, 8), dtype=np.uint8)
    return ArrayDataset(x, rng.integers(0, 10, size=n).astype(np.int64), 10)


@settings(max_examples=15, deadline=None)
@given(clip=st.floats(1e-3, 10.0), seed=st.integers(0, 2**16))
def test_one_example_adds_at_most_clip_squared_to_the_fisher(clip, seed):
    model = build_model("cnn", 10, 1, seed=seed % 7)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    data = _data(4, seed)
    whole = np.ones(layout.size, dtype=bool)
    for i in range(len(data)):
        one = np.array([i])
        f = per_example_fisher(
            model, layout, params, whole, data, one, None, torch.device("cpu"), clip_norm=clip
        )
        raw = per_example_fisher(model, layout, params, whole, data, one, None, torch.device("cpu"))
        assert f.sum() <= clip**2 * (
            1 + 1e-4
        )  # L1 of one clipped squared gradient, hence its L2 too
        # clipping only scales an example's squared gradient down, by (clip / norm)^2
        assert np.allclose(f, raw * min(1.0, clip**2 / float(raw.sum())), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("name", ["cnn", "cnn-bn", "cnn-gn"])
def test_the_vectorised_fisher_clips_as_the_loop_does(name):
    model = build_model(name, 10, 1, seed=1)
    layout = model_layout(model)
    params = layout.flatten(trainable_arrays(model))
    data, idx, whole = _data(12, 3), np.arange(12), np.ones(layout.size, dtype=bool)
    cpu = torch.device("cpu")
    out = [
        per_example_fisher(
            model, layout, params, whole, data, idx, None, cpu, chunk=5, vectorise=v, clip_norm=0.05
        )
        for v in (False, True)
    ]
    assert np.allclose(out[0], out[1], rtol=1e-4, atol=1e-10)
    raw = per_example_fisher(model, layout, params, whole, data, idx, None, cpu)
    assert out[0].sum() < raw.sum() and out[0].sum() <= 0.05**2 * (1 + 1e-4)


@settings(max_examples=20, deadline=None)
@given(clip=st.floats(1e-3, 5.0), scale=st.floats(0.1, 100.0), seed=st.integers(0, 2**16))
def test_a_private_step_bounds_each_example_by_the_clip(clip, scale, seed):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(5, 3) * scale)
    x = torch.randn(6, 3)

    def loss_of(i: int) -> torch.Tensor:
        return (w @ x[i]).square().sum()

    private_gradient([w], loss_of, 1, clip, 0.0, torch.Generator().manual_seed(0))
    assert float(w.grad.norm()) <= clip * (1 + 1e-5)
    # replacing one of six examples moves the summed gradient by at most 2 clip
    private_gradient([w], loss_of, 6, clip, 0.0, torch.Generator().manual_seed(0))
    with_all = w.grad * 6
    private_gradient(
        [w],
        lambda i: loss_of(i) if i < 5 else (w @ torch.zeros(3)).sum(),
        6,
        clip,
        0.0,
        torch.Generator(),
    )
    assert float((with_all - w.grad * 6).norm()) <= 2 * clip * (1 + 1e-5)


def test_a_private_step_adds_noise_of_z_times_clip_on_the_sum():
    w = torch.nn.Parameter(torch.zeros(100_000))
    private_gradient([w], lambda i: (w * 0).sum(), 4, 2.0, 1.5, torch.Generator().manual_seed(3))
    assert float(w.grad.std()) == pytest.approx(1.5 * 2.0 / 4, rel=0.02)


def test_dp_sgd_without_noise_and_clipping_is_plain_sgd():
    data = _data(50, 1)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.05, seed=3)
    runs = []
    for dp in (False, True):
        model = build_model("cnn", 10, 1, seed=0)
        private = (
            TrainConfig(**{**cfg.__dict__, "dp_grad_clip": 1e9, "dp_noise_multiplier": 0.0})
            if dp
            else cfg
        )
        train_loop(model, data, private, torch.device("cpu"))
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.allclose(runs[0], runs[1], atol=1e-5)


def test_a_private_round_repeats_to_the_bit():
    data = _data(40, 2)
    cfg = TrainConfig(
        epochs=1, batch_size=8, lr=0.05, seed=5, dp_grad_clip=1.0, dp_noise_multiplier=1.1
    )
    out = []
    for _ in range(2):
        model = build_model("cnn", 10, 1, seed=0)
        train_loop(model, data, cfg, torch.device("cpu"))
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(out[0], out[1])


# ----------------------------------------------------------------- settings
def test_privacy_settings_parse():
    run = parse_run_config({"dp-epsilon": 4.0, "model": "cnn", "dp-noise-multiplier": 1.2})
    opts = run.options("privacy")
    assert opts.enabled and opts.epsilon == 4.0 and opts.noise_multiplier == 1.2
    assert not parse_run_config({}).options("privacy").enabled


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"dp-epsilon": -1.0}, "dp-epsilon"),
        ({"dp-delta": 0.0}, "dp-delta"),
        ({"dp-delta": 1.0}, "dp-delta"),
        ({"dp-noise-multiplier": -0.5}, "dp-noise-multiplier"),
        ({"dp-fisher-clip": 0.0}, "dp-fisher-clip"),
        ({"dp-grad-clip": -1.0}, "dp-grad-clip"),
        ({"dp-epsilon": 4.0, "model": "cnn", "dp-noise-multiplier": 0.0}, "dp-noise-multiplier"),
        (
            {"dp-epsilon": 4.0, "model": "cnn-bn"},
            "model",
        ),  # it normalises by the minibatch's statistics
        ({"dp-epsilon": 4.0, "model": "cnn", "method": "cahfp"}, "method"),
        ({"dp-epsilon": 4.0, "model": "cnn", "fisher-estimator": "path"}, "fisher-estimator"),
        ({"dp-epsilon": 4.0, "model": "cnn", "method": "heterofl"}, "width-label-split"),
        ({"dp-epsilon": 4.0, "model": "cnn", "label-mask": True}, "label-mask"),
        (
            {"dp-epsilon": 4.0, "model": "cnn", "method": "heterofl", "width-label-split": False},
            "label-mask",
        ),
    ],
)
def test_bad_privacy_settings_are_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(raw)


@pytest.mark.parametrize("method", ["fedfibos", "fedavg", "fiarse"])
def test_the_groupnorm_cnn_takes_differential_privacy(method):
    """Its statistics are each example's own, so clipping an example's gradient bounds it."""
    run = parse_run_config({"dp-epsilon": 4.0, "model": "cnn-gn", "method": method})
    assert run.model == "cnn-gn"


# ----------------------------------------------------------------- the node
def _node_setup(tmp_path, monkeypatch, **extra):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run = parse_run_config(
        {
            "dp-epsilon": 3.0,
            "model": "cnn",
            "method": "fedavg",
            "results-dir": str(tmp_path / "r"),
            **extra,
        }
    )
    node = parse_node_config({"partition-id": 0, "num-partitions": 2, "capacity": 1.0})
    return run, node, create_method(run)


def _update() -> LocalUpdate:
    return LocalUpdate({P.DELTA: np.zeros(3, dtype=np.float32)}, 10, 0.1, 0.1, 0.0)


def test_a_node_refuses_a_reply_past_its_budget_and_keeps_its_ledger_across_a_resume(
    tmp_path, monkeypatch
):
    run, node, method = _node_setup(
        tmp_path, monkeypatch, **{"dp-noise-multiplier": 1.0, "local-epochs": 1}
    )
    cfg = private_config(round_train_config(run, node, 1), method, run, 480)
    assert cfg.dp_noise_multiplier == 1.0 and cfg.dp_grad_clip == 1.0
    # 15 steps on 32 of 480 examples at z = 1 spend 2.85; a second round's would take the node to
    # 3.45
    first = charge_reply(
        open_ledger(run, node, 7), _update(), method, run, node, cfg, 480, run_id=7
    )["dp-epsilon"]
    assert first == pytest.approx(epsilon_spent(1.0, node_releases(480, 32, 1, 1, 0), DELTA))
    with pytest.raises(BudgetSpent, match="privacy budget is spent"):
        charge_reply(open_ledger(run, node, 7), _update(), method, run, node, cfg, 480, run_id=7)
    with pytest.raises(BudgetSpent):  # and the next round is refused before it trains
        check_budget(open_ledger(run, node, 7), cfg, 480)
    check_budget(
        open_ledger(run, node, 7), replace(cfg, epochs=0), 480
    )  # no step: nothing to refuse
    # a resumed run (a new Flower run id) goes on from the ledger; a new run starts a new one
    resumed = run.model_copy(update={"resume": True})
    assert open_ledger(resumed, node, run_id=8).spent() == pytest.approx(first)
    assert open_ledger(run, node, run_id=9).spent() == 0.0


def test_a_damaged_ledger_is_refused_not_reset(tmp_path, monkeypatch):
    run, node, _ = _node_setup(tmp_path, monkeypatch)
    save_ledger(PrivacyLedger(3.0, DELTA), run, node, run_id=1)
    ledger_path(run, node).write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        open_ledger(run, node, run_id=1)


def test_the_auto_multiplier_lets_a_node_train_every_round_within_its_budget(tmp_path, monkeypatch):
    run, node, method = _node_setup(tmp_path, monkeypatch, **{"num-rounds": 4, "local-epochs": 1})
    for rnd in range(1, 5):
        cfg = private_config(round_train_config(run, node, rnd), method, run, 300)
        out = charge_reply(
            open_ledger(run, node, 3), _update(), method, run, node, cfg, 300, run_id=3
        )
    assert 2.9 < out["dp-epsilon"] <= 3.0


def test_the_model_without_batch_statistics_is_not_normalised_across_examples():
    model = build_model("cnn", 10, 1, seed=0)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
