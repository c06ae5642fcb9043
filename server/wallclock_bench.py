"""Wall-clock comparison: time to a target accuracy with nodes of really different speeds.

Each variant (``method`` or ``method:gmr-mode``) runs on a real local deployment
(:class:`server.launcher.LocalFederation`: a SuperLink and one SuperNode process
per capacity), not the Simulation Engine, because asynchrony only shows when
nodes really run side by side. Node speeds differ through their capacities and
the test/benchmark knob ``bench-delay-s`` (extra seconds per local epoch).

Usage::

    python -m server.wallclock_bench --capacities 1,1/2,1/4,1/8 --delays 0,0,3,8 \\
        --variants fedgmr:sync,fedgmr:async,fedfibos --rounds 6 --target-acc 0.8 --out results/wallclock

Writes ``results.csv`` and ``summary.md`` (the table and the command) to ``--out``
and prints one line per round / applied update while running.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.config import parse_run_config
from common.time_to_accuracy import accuracy_curve, time_to_target
from server.launcher import parse_capacities, parse_overrides, run_local_federation


def variant_config(variant: str) -> dict[str, Any]:
    """``"fedgmr:async"`` -> ``{"method": "fedgmr", "gmr-mode": "async"}``; ``"fedfibos"`` -> its method."""
    method, _, mode = variant.partition(":")
    return {"method": method, **({"gmr-mode": mode} if mode else {})}


def wallclock_row(variant: str, metrics: dict[str, Any], target: float, wall: float) -> dict[str, Any]:
    """One results row: accuracy, training seconds and seconds to ``target`` accuracy.

    Parameters
    ----------
    variant : str
        The variant's label.
    metrics : dict
        The run's metrics.json.
    target : float
        Target accuracy (fraction).
    wall : float
        Seconds the whole run took, process start-up and discovery included.
    """
    seconds, acc = accuracy_curve(metrics["rounds"])
    records = [r for r in metrics["rounds"] if r["round"] > 0]
    applied = sum(c["status"] == "ok" for r in records for c in r["clients"])
    stale = [c["staleness"] for r in records for c in r["clients"] if c.get("staleness") is not None]
    reach = time_to_target(seconds, acc, target)
    return {
        "variant": variant,
        "final_acc": acc[-1],
        "best_acc": max(acc),
        "train_s": seconds[-1],
        "s_to_target": float("nan") if reach is None else reach,
        "updates_applied": applied,
        "mean_staleness": sum(stale) / len(stale) if stale else 0.0,
        "run_wall_s": wall,
    }


def table(rows: list[dict[str, Any]], target: float) -> str:
    """Markdown table of the rows."""
    head = ["variant", "final acc", "best acc", "training s", f"s to {target:g} acc", "updates", "mean staleness"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        reach = "not reached" if r["s_to_target"] != r["s_to_target"] else f"{r['s_to_target']:.1f}"
        lines.append(
            f"| {r['variant']} | {r['final_acc']:.4f} | {r['best_acc']:.4f} | {r['train_s']:.1f} | {reach} "
            f"| {r['updates_applied']} | {r['mean_staleness']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m server.wallclock_bench``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacities", type=parse_capacities, default=[1.0, 0.5, 0.25, 0.125])
    ap.add_argument("--delays", default="0,0,3,8", help="bench-delay-s per node: extra seconds per local epoch")
    ap.add_argument("--variants", default="fedgmr:sync,fedgmr:async,fedfibos", help="method or method:gmr-mode")
    ap.add_argument("--rounds", type=int, default=6, help="rounds (async: round equivalents = updates / nodes)")
    ap.add_argument("--target-acc", type=float, default=0.8)
    ap.add_argument("--run-config", "-c", default="", help="run-config overrides for every variant")
    ap.add_argument("--out", type=Path, default=Path("results/wallclock"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    args = ap.parse_args(argv)
    delays = [float(v) for v in args.delays.split(",") if v]
    if len(delays) != len(args.capacities):
        ap.error(f"--delays has {len(delays)} entries for {len(args.capacities)} capacities")
    extra = parse_overrides(args.run_config) if args.run_config else {}
    plan = []
    for variant in (v for v in args.variants.split(",") if v):
        cfg = {"eval-every": 0, **extra, **variant_config(variant), "num-rounds": args.rounds}
        parse_run_config(cfg)  # fail before the first run, naming the bad key
        plan.append((variant, cfg))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (variant, cfg) in enumerate(plan, 1):
        print(f"[run {i}/{len(plan)}] {variant}", flush=True)
        t0 = time.monotonic()
        metrics = run_local_federation(
            args.capacities,
            args.out / "runs" / variant.replace(":", "-"),
            cfg,
            timeout=args.timeout,
            echo=lambda line: print("    " + line, flush=True) if line.startswith("[") else None,
            delays=delays,
        )
        rows.append(wallclock_row(variant, metrics, args.target_acc, time.monotonic() - t0))
        print(f"[run {i}/{len(plan)}] {variant}: {rows[-1]}", flush=True)
        write(args.out, rows, args, argv)
    print()
    print(table(rows, args.target_acc))
    return 0


def write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """results.csv and summary.md for the rows so far (after every run: nothing lost)."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    (out / "summary.md").write_text(
        f"Command: `python -m server.wallclock_bench {command}`\n\n"
        f"Capacities {args.capacities}, bench-delay-s {args.delays}, {args.rounds} rounds (async: "
        f"{args.rounds} x nodes applied updates), real SuperLink + SuperNode processes.\n\n"
        f"{table(rows, args.target_acc)}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
