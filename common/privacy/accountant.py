"""A node's privacy ledger: the Gaussian mechanisms it has released, composed with Opacus' RDP
accountant.

Under ``dp-epsilon`` a node releases two kinds of Gaussian mechanism of one noise multiplier ``z``:
each Fisher upload, over its examples (:mod:`common.privacy.mechanism`), and each local DP-SGD step,
over a minibatch (:mod:`common.privacy.private_sgd`); the update it uploads is a function of those
steps. A mechanism over all the examples has Rényi divergence ``a / (2 z^2)`` at order ``a``; a step
on a sampled share of them less (Opacus' bound for the subsampled Gaussian). Releases compose by
adding the curves, and a curve converts to ``(epsilon, delta)`` by Opacus' conversion
(:func:`opacus.accountants.analysis.rdp.get_privacy_spent`). The ledger keeps the curve, not a
count, so releases of different multipliers (a run resumed with other settings) compose correctly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from common.privacy.releases import Releases

#: Rényi orders the ledger tracks (Opacus' default grid).
ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def gaussian_rdp(noise_multiplier: float, releases: Releases) -> list[float]:
    """The RDP curve over :data:`ORDERS` of ``releases``, every mechanism of multiplier
    ``noise_multiplier``.

    A sampled mechanism is credited with Opacus' bound for Poisson subsampling at its rate (the
    usual account of DP-SGD, whose minibatches here are a shuffled partition of the examples).
    """
    if not noise_multiplier > 0:
        raise ValueError(
            f"noise_multiplier={noise_multiplier!r} must be > 0 to spend a finite epsilon"
        )
    total = [0.0] * len(ORDERS)
    for rate, count in releases:
        if not 0 < rate <= 1 or count < 0:
            raise ValueError(
                f"release (sample rate {rate}, count {count}) is not a rate in (0, 1] and a count "
                ">= 0"
            )
        if count:
            curve = compute_rdp(
                q=rate, noise_multiplier=noise_multiplier, steps=count, orders=list(ORDERS)
            )
            total = [a + float(b) for a, b in zip(total, curve, strict=True)]
    return total


def epsilon_of(rdp: list[float], delta: float) -> float:
    """The epsilon an RDP curve over :data:`ORDERS` spends at ``delta`` (0 for a curve of zeros)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} is outside (0, 1)")
    if not any(rdp):
        return 0.0
    eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)
    return float(eps)


def epsilon_spent(noise_multiplier: float, releases: Releases, delta: float) -> float:
    """Epsilon of ``releases`` of one multiplier, at ``delta``."""
    return epsilon_of(gaussian_rdp(noise_multiplier, releases), delta)


@lru_cache(maxsize=256)  # every round of a node asks for the same multiplier
def calibrate_multiplier(
    target_epsilon: float, delta: float, releases: Releases, tolerance: float = 1e-3
) -> float:
    """The smallest noise multiplier (to ``tolerance``) whose ``releases`` spend at most
    ``target_epsilon``.

    Bisection on :func:`epsilon_spent`, which falls as the multiplier grows.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon={target_epsilon!r} must be > 0")
    if not any(count for _, count in releases):
        raise ValueError("no releases to calibrate the noise for")
    lo, hi = 0.0, 1.0
    while epsilon_spent(hi, releases, delta) > target_epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        if epsilon_spent(mid, releases, delta) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


class BudgetSpent(RuntimeError):
    """A release would take a node past its target epsilon: the node stops uploading."""


@dataclass
class PrivacyLedger:
    """What one node has released in one run, as an RDP curve, against its target ``(epsilon,
    delta)``.

    Parameters
    ----------
    target_epsilon : float
        The node's budget (> 0).
    delta : float
        The run's delta, in (0, 1).
    rdp : list[float]
        The composed curve over :data:`ORDERS` (zeros: nothing released).
    releases : int
        Mechanisms charged so far (DP-SGD steps and Fisher uploads).
    """

    target_epsilon: float
    delta: float
    rdp: list[float] = field(default_factory=lambda: [0.0] * len(ORDERS))
    releases: int = 0

    def spent(self) -> float:
        """Epsilon spent so far."""
        return epsilon_of(self.rdp, self.delta)

    def _after(self, noise_multiplier: float, releases: Releases) -> tuple[list[float], float]:
        """The curve and the epsilon once ``releases`` are added; :class:`BudgetSpent` past the
        target."""
        more = gaussian_rdp(noise_multiplier, releases)
        rdp = [a + b for a, b in zip(self.rdp, more, strict=True)]
        eps = epsilon_of(rdp, self.delta)
        if eps > self.target_epsilon * (1 + 1e-9):
            raise BudgetSpent(
                f"this node's privacy budget is spent: its {self.releases} releases so far cost "
                f"epsilon {self.spent():.3f}, this reply's would take it to {eps:.3f} > "
                f"dp-epsilon={self.target_epsilon:g} (delta {self.delta:g}); it uploads nothing "
                "more in this run"
            )
        return rdp, eps

    def check(self, noise_multiplier: float, releases: Releases) -> float:
        """The epsilon ``releases`` would bring the node to, recording nothing; :class:`BudgetSpent`
        past the target."""
        return self._after(noise_multiplier, releases)[1]

    def charge(self, noise_multiplier: float, releases: Releases) -> float:
        """Record ``releases`` mechanisms and return the epsilon spent; :class:`BudgetSpent`
        (nothing recorded) when that would exceed the target."""
        self.rdp, eps = self._after(noise_multiplier, releases)
        self.releases += sum(count for _, count in releases)
        return eps

    def as_dict(self) -> dict[str, Any]:
        """The ledger as a JSON-ready dict (for the node's file)."""
        return {
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "rdp": self.rdp,
            "releases": self.releases,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PrivacyLedger:
        """Read :meth:`as_dict`; ``ValueError`` when it is not a ledger over :data:`ORDERS`."""
        rdp = [float(v) for v in doc["rdp"]]
        if len(rdp) != len(ORDERS) or any(not v >= 0 for v in rdp):
            raise ValueError("not a privacy ledger over this accountant's orders")
        return cls(float(doc["target_epsilon"]), float(doc["delta"]), rdp, int(doc["releases"]))
