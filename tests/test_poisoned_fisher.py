"""One poisoning client in ten: its Fisher upload barely moves the other clients' masks."""

from __future__ import annotations

import pytest

from benchmarks.poisoning_bench import (
    certified_share,
    federation_state,
    fisher_world,
    mask_change,
    shaped_attack,
)
from common.fisher.selection import select_mask

ATTACKER = 9  # the last of the ten clients


@pytest.fixture(scope="module")
def world():
    return fisher_world(10)  # heavy-tailed uploads sharing a structure, per-client noise


def _state(clients, attacker_upload, trim):
    return federation_state([*clients[:ATTACKER], attacker_upload], trim)


def _worst_change(layout, x, gamma, poisoned, honest):
    """Largest share of mask entries that differ, over a new client and fresh / stale honest
    clients."""
    worst = 0.0
    for client, rnd in ((None, 2), (0, 2), (3, 5)):
        a = poisoned.global_prior() if client is None else poisoned.estimate(client, rnd)
        b = honest.global_prior() if client is None else honest.estimate(client, rnd)
        diff = select_mask(layout, x, gamma, "fisher", a) != select_mask(
            layout, x, gamma, "fisher", b
        )
        worst = max(worst, float(diff.mean()))
    return worst


@pytest.mark.parametrize("trim", [0.0, 0.1])
@pytest.mark.parametrize("scale", [1e6, 1e-6])
def test_scaled_fisher_changes_no_mask(world, trim, scale):
    layout, x, clients = world
    honest = _state(clients, clients[ATTACKER], trim)
    poisoned = _state(clients, clients[ATTACKER] * scale, trim)
    for gamma in (0.25, 0.0625):
        assert _worst_change(layout, x, gamma, poisoned, honest) == 0.0


def test_shaped_attack_is_contained_by_the_trimmed_prior(world):
    """All mass on the 10% of positions just below the selection threshold of the prior (a strong
    attack)."""
    layout, x, clients = world
    gamma = 0.25
    honest_plain, honest_trim = (
        _state(clients, clients[ATTACKER], 0.0),
        _state(clients, clients[ATTACKER], 0.1),
    )
    attack = shaped_attack(layout, x, gamma, honest_trim.global_prior(), 0.1)
    plain = _worst_change(layout, x, gamma, _state(clients, attack, 0.0), honest_plain)
    trimmed = _worst_change(layout, x, gamma, _state(clients, attack, 0.1), honest_trim)
    # Measured: about 17% of entries flip with the plain mean, under 3% with the default trim.
    assert plain > 0.10
    assert trimmed < 0.03
    assert trimmed < plain / 5


def test_one_clients_reach_shrinks_as_the_federation_grows():
    """The attacker's share is one order statistic of n: measured under 1% from 30 clients,
    certified from 100."""
    measured, certified = {}, {}
    for n in (10, 30, 100):
        layout, x, clients = fisher_world(n)
        honest = federation_state(clients, 0.1)
        attack = shaped_attack(layout, x, 0.25, honest.global_prior(), 0.1)
        poisoned = federation_state([*clients[:-1], attack], 0.1)
        measured[n] = mask_change(layout, x, 0.25, poisoned, honest, 3)
        certified[n] = certified_share(layout, x, 0.25, honest, 3)
        assert measured[n] <= certified[n]
    assert measured[10] > 0.02 and measured[30] < 0.01 and certified[100] < 0.01
    assert certified[10] > certified[30] > certified[100]
