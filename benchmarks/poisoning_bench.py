"""Benchmark: how far one poisoning client among n (default ten) moves the other clients' masks, per
Fisher prior.

The world of ``tests/test_poisoned_fisher.py``: the small CNN's parameter
vector, n clients with heavy-tailed Fisher uploads sharing a structure
(lognormal base x per-client lognormal noise). Client 9 attacks with a
*shaped* upload: all its mass on the ``fraction`` of positions ranked just
below the selection threshold of the honest prior (an attacker that knows the
prior), nothing elsewhere. For each prior (``fisher-trim``) the table reports
the largest share of mask entries that differ from the same federation with
client 9 honest, over a new client (prior only) and a stale client (own
estimate blended with the prior), and the same figure when client 9 merely
uploads an uninformative (flat) Fisher, the floor any defence that keeps the
attacker's honest contribution out of reach must pay, and the certified bound
(:mod:`common.fisher.prior_influence`): the share of positions one client can reach
at all, whatever it uploads (none for the plain mean).

Usage::

    fibos bench-poisoning --gamma 0.25
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from common.fisher.prior_influence import contested_positions
from common.fisher.selection import fisher_scores, select_mask
from common.fisher.state import FisherState
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout

STALE_ROUND = 5  # the stale client last reported in round 1: trust 0.7^3 in its own estimate


def fisher_world(clients: int, seed: int = 0) -> tuple[ParamLayout, NDArray, list[NDArray]]:
    """The small CNN's layout and parameters, and ``clients`` heavy-tailed Fisher uploads sharing a
    structure."""
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0, 2, layout.size)
    return layout, x, [base * rng.lognormal(0, 0.5, layout.size) for _ in range(clients)]


def shaped_attack(
    layout: ParamLayout, x: NDArray, gamma: float, prior: NDArray, fraction: float
) -> NDArray:
    """An upload with all its mass on the ``fraction`` of positions ranked just below the prior's
    threshold."""
    kept = select_mask(layout, x, gamma, "fisher", prior)
    below = np.flatnonzero(~kept & ~layout.always_kept)
    ranked = below[np.argsort(-fisher_scores(prior, x)[below])]
    attack = np.full(layout.size, 1e-12)
    attack[ranked[: int(layout.size * fraction)]] = 1.0
    return attack


def federation_state(uploads: Sequence[NDArray], trim: float) -> FisherState:
    """The server's Fisher state after every client uploaded once (round 1, equal weights)."""
    state = FisherState(len(uploads[0]), staleness_decay=0.7, trim=trim)
    for i, upload in enumerate(uploads):
        state.update(i, upload, 100, 1)
    return state


def mask_change(
    layout: ParamLayout,
    x: NDArray,
    gamma: float,
    poisoned: FisherState,
    honest: FisherState,
    stale: int,
) -> float:
    """Largest share of entries whose mask differs: a new client, and client ``stale`` at a later
    round."""
    worst = 0.0
    for a, b in (
        (poisoned.global_prior(), honest.global_prior()),
        (poisoned.estimate(stale, STALE_ROUND), honest.estimate(stale, STALE_ROUND)),
    ):
        diff = select_mask(layout, x, gamma, "fisher", a) != select_mask(
            layout, x, gamma, "fisher", b
        )
        worst = max(worst, float(diff.mean()))
    return worst


def certified_share(
    layout: ParamLayout, x: NDArray, gamma: float, honest: FisherState, stale: int
) -> float | None:
    """Share of contested positions (worst of a new and a stale client); ``None`` for an unbounded
    prior."""
    worst = 0.0
    for client, rnd in ((None, 2), (stale, STALE_ROUND)):
        interval = honest.estimate_interval(client, rnd)
        if interval is None:
            return None
        worst = max(worst, float(contested_positions(layout, x, gamma, *interval).mean()))
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos bench-poisoning``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gamma", type=float, default=0.25, help="capacity whose masks are compared")
    ap.add_argument(
        "--trims", default="0,0.1,0.2,0.45", help="fisher-trim values (priors) to compare"
    )
    ap.add_argument(
        "--fractions", default="0.02,0.05,0.1,0.2", help="shares of positions the attacker targets"
    )
    ap.add_argument(
        "--clients", type=int, default=10, help="clients in the federation, the last one attacks"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.clients < 3:
        ap.error("--clients must be at least 3 (a trimmed prior needs three)")
    layout, x, clients = fisher_world(args.clients, args.seed)
    fractions = [float(f) for f in args.fractions.split(",")]
    head = [
        "fisher-trim",
        *[f"shaped {f:.0%}" for f in fractions],
        "flat upload (floor)",
        "certified bound",
    ]
    print(
        f"mask entries changed at gamma={args.gamma:g}, one attacker in {args.clients}"
        " (worst of a new and a stale client)"
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for trim in (float(t) for t in args.trims.split(",")):
        honest = federation_state(clients, trim)
        cells = []
        for fraction in fractions:
            attack = shaped_attack(layout, x, args.gamma, honest.global_prior(), fraction)
            cells.append(
                mask_change(
                    layout,
                    x,
                    args.gamma,
                    federation_state([*clients[:-1], attack], trim),
                    honest,
                    3,
                )
            )
        flat_state = federation_state([*clients[:-1], np.ones(layout.size)], trim)
        flat = mask_change(layout, x, args.gamma, flat_state, honest, 3)
        bound = certified_share(layout, x, args.gamma, honest, 3)
        cert = "unbounded" if bound is None else f"{bound:.2%}"
        print(
            f"| {trim:g} | " + " | ".join(f"{c:.2%}" for c in [*cells, flat]) + f" | {cert} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
