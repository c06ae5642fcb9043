"""Benchmark: server memory for the Fisher state of many clients, and what bounding it costs in
masks.

Feeds ``--clients`` uploads (synthetic heavy-tailed Fisher vectors of the
model's size) into a :class:`common.fisher.state.FisherState` with a memory
budget, printing resident memory as it goes; then reports how much the
bounded state changes masks: fp16 storage vs exact, and an evicted client
(ranked by the prior) vs its own estimate.

Usage::

    fibos bench-fisher-memory --clients 10000 --model resnet18 --budget-mb 1024 --precision fp16
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Sequence

import numpy as np

from common.fisher.selection import select_mask
from common.fisher.state import FisherState, fisher_capacity
from common.models.architectures import build_model, model_layout, trainable_arrays


def rss_mib() -> float:
    """Current resident memory of this process (MiB), from /proc when available."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--model", default="resnet18", choices=("cnn", "resnet18"))
    ap.add_argument("--budget-mb", type=float, default=1024.0, help="fisher-memory-mb")
    ap.add_argument("--precision", default="fp16", choices=("fp32", "fp16"))
    ap.add_argument("--trim", type=float, default=0.1)
    ap.add_argument("--pool", type=int, default=4, help="distinct synthetic uploads cycled through")
    ap.add_argument(
        "--gamma", type=float, default=0.25, help="capacity used for the mask comparison"
    )
    args = ap.parse_args(argv)

    model = build_model(args.model, 10, 3 if args.model == "resnet18" else 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    del model
    d = layout.size
    limit = fisher_capacity(args.budget_mb, d, args.precision)
    rng = np.random.default_rng(0)
    base = rng.lognormal(0, 2, d).astype(np.float32)
    pool = [base * rng.lognormal(0, 0.5, d).astype(np.float32) for _ in range(args.pool)]
    start_rss = rss_mib()
    print(
        f"d={d:,} budget={args.budget_mb:g} MiB precision={args.precision} -> at most {limit} "
        "client estimates"
    )
    print(
        f"resident memory before any upload: {start_rss:.0f} MiB (model vector + {args.pool} "
        "synthetic uploads)"
    )
    state = FisherState(d, trim=args.trim, max_clients=limit, precision=args.precision)
    t0 = time.perf_counter()
    peak = start_rss
    step = max(1, args.clients // 10)
    for i in range(args.clients):
        state.update(f"client-{i}", pool[i % args.pool], 100, round=i)
        if (i + 1) % step == 0 or i + 1 == args.clients:
            peak = max(peak, rss_mib())
            print(
                f"  {i + 1:>6} uploads: {len(state.clients)} kept, {state.evictions} evicted, "
                f"state {state.memory_bytes() / 2**20:.0f} MiB, resident {rss_mib():.0f} MiB, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    prior = state.global_prior()
    peak = max(peak, rss_mib())
    last = f"client-{args.clients - 1}"
    own_exact = pool[(args.clients - 1) % args.pool]
    m_exact = select_mask(layout, x, args.gamma, "fisher", own_exact)
    m_stored = select_mask(layout, x, args.gamma, "fisher", state.estimate(last, args.clients))
    m_prior = select_mask(layout, x, args.gamma, "fisher", prior)
    print()
    print(
        "| clients | d | precision | budget MiB | kept | evicted | state MiB | peak resident MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.clients:,} | {d:,} | {args.precision} | {args.budget_mb:g} | "
        f"{len(state.clients)} | {state.evictions:,} | {state.memory_bytes() / 2**20:.0f} | "
        f"{peak:.0f} |"
    )
    print()
    print(f"mask entries changed at gamma={args.gamma:g}:")
    print(
        f"  stored ({args.precision}) vs exact estimate of a kept client: "
        f"{np.mean(m_stored != m_exact):.4%}"
    )
    print(
        "  prior (as an evicted client gets) vs that client's own estimate: "
        f"{np.mean(m_prior != m_exact):.4%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
