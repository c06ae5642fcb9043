"""Wall-clock comparison: time to a target accuracy with nodes of really different speeds.

Each variant (``method`` or ``method:gmr-mode``) runs on a real local deployment
(:class:`cli.launcher.LocalFederation`: a SuperLink and one SuperNode process
per capacity), not the Simulation Engine, because asynchrony only shows when
nodes really run side by side. Node speeds differ through their capacities and
the test/benchmark knob ``bench-delay-s`` (extra seconds per local epoch).

Usage::

    fibos bench-wallclock --capacities 1,1/2,1/4,1/8 --delays 0,0,3,8 \\
        --variants fedgmr:sync,fedgmr:async,fedfibos --rounds 6 --target-acc 0.6,0.7,0.8 --out results/wallclock

Writes ``results.csv`` and ``summary.md`` (the table and the command) to ``--out``
and prints one line per round / applied update while running.
"""  # noqa: E501

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy import accuracy_curve, time_to_target
from cli.launcher import parse_capacities, parse_overrides, run_local_federation
from common.config.parse import parse_run_config


def variant_config(variant: str) -> dict[str, Any]:
    """``"fedgmr:async"`` -> ``{"method": "fedgmr", "gmr-mode": "async"}``; ``"fedfibos"`` -> its
    method."""
    method, _, mode = variant.partition(":")
    return {"method": method, **({"gmr-mode": mode} if mode else {})}


def wallclock_row(
    variant: str, metrics: dict[str, Any], targets: Sequence[float], wall: float
) -> dict[str, Any]:
    """One results row: accuracy, training seconds and seconds to each target accuracy.

    Parameters
    ----------
    variant : str
        The variant's label.
    metrics : dict
        The run's metrics.json.
    targets : Sequence[float]
        Target accuracies (fractions); column ``s_to_<target>`` each (NaN = not reached).
    wall : float
        Seconds the whole run took, process start-up and discovery included (NaN if unknown).
    """
    seconds, acc = accuracy_curve(metrics["rounds"])
    records = [r for r in metrics["rounds"] if r["round"] > 0]
    applied = sum(c["status"] == "ok" for r in records for c in r["clients"])
    stale = [
        c["staleness"] for r in records for c in r["clients"] if c.get("staleness") is not None
    ]
    row: dict[str, Any] = {
        "variant": variant,
        "final_acc": acc[-1],
        "best_acc": max(acc),
        "train_s": seconds[-1],
        "updates_applied": applied,
        "mean_staleness": sum(stale) / len(stale) if stale else 0.0,
        "run_wall_s": wall,
    }
    for target in targets:
        reach = time_to_target(seconds, acc, target)
        row[f"s_to_{target:g}"] = float("nan") if reach is None else reach
    return row


def table(rows: list[dict[str, Any]], targets: Sequence[float]) -> str:
    """Markdown table of the rows."""
    head = ["variant", "final acc", "best acc", "training s", "updates", "mean staleness"]
    head += [f"s to {t:g} acc" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["variant"],
            f"{r['final_acc']:.4f}",
            f"{r['best_acc']:.4f}",
            f"{r['train_s']:.1f}",
            str(r["updates_applied"]),
            f"{r['mean_staleness']:.2f}",
        ]
        for t in targets:
            v = r[f"s_to_{t:g}"]
            cells.append("not reached" if v != v else f"{v:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos bench-wallclock``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--capacities", type=parse_capacities, default=[1.0, 0.5, 0.25, 0.125])
    ap.add_argument(
        "--delays", default="0,0,3,8", help="bench-delay-s per node: extra seconds per local epoch"
    )
    ap.add_argument(
        "--variants", default="fedgmr:sync,fedgmr:async,fedfibos", help="method or method:gmr-mode"
    )
    ap.add_argument(
        "--rounds", type=int, default=6, help="rounds (async: round equivalents = updates / nodes)"
    )
    ap.add_argument("--target-acc", default="0.6,0.7,0.8", help="comma-separated target accuracies")
    ap.add_argument(
        "--tabulate", action="store_true", help="only re-tabulate the finished runs in --out/runs"
    )
    ap.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="run-config overrides for every variant (repeatable)",
    )
    ap.add_argument("--out", type=Path, default=Path("results/wallclock"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    args = ap.parse_args(argv)
    targets = [float(t) for t in args.target_acc.split(",") if t]
    delays = [float(v) for v in args.delays.split(",") if v]
    if len(delays) != len(args.capacities):
        ap.error(f"--delays has {len(delays)} entries for {len(args.capacities)} capacities")
    extra = parse_overrides(args.run_config)
    plan = []
    for variant in (v for v in args.variants.split(",") if v):
        cfg = {"eval-every": 0, **extra, **variant_config(variant), "num-rounds": args.rounds}
        parse_run_config(cfg)  # fail before the first run, naming the bad key
        plan.append((variant, cfg))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (variant, cfg) in enumerate(plan, 1):
        folder = args.out / "runs" / variant.replace(":", "-")
        if args.tabulate:
            if (folder / "model.pt").exists():
                metrics = json.loads((folder / "metrics.json").read_text())
                rows.append(wallclock_row(variant, metrics, targets, float("nan")))
            continue
        print(f"[run {i}/{len(plan)}] {variant}", flush=True)
        t0 = time.monotonic()
        metrics = run_local_federation(
            args.capacities,
            folder,
            cfg,
            timeout=args.timeout,
            echo=lambda line: print("    " + line, flush=True) if line.startswith("[") else None,
            delays=delays,
        )
        rows.append(wallclock_row(variant, metrics, targets, time.monotonic() - t0))
        print(f"[run {i}/{len(plan)}] {variant}: {rows[-1]}", flush=True)
        write(args.out, rows, args, argv, targets)
    if not rows:
        print("no finished runs")
        return 1
    write(args.out, rows, args, argv, targets)
    print()
    print(table(rows, targets))
    return 0


def write(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    targets: Sequence[float],
) -> None:
    """results.csv and summary.md for the rows so far (after every run: nothing lost)."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    (out / "summary.md").write_text(
        f"Command: `fibos bench-wallclock {command}`\n\n"
        f"Capacities {args.capacities}, bench-delay-s {args.delays}, {args.rounds} rounds (async: "
        f"{args.rounds} x nodes applied updates), real SuperLink + SuperNode processes.\n\n"
        f"{table(rows, targets)}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
