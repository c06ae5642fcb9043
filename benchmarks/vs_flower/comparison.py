"""Time to accuracy against stock Flower, on the same SuperNodes, model, data and initial weights.

Three variants, each on a real local deployment (a SuperLink and one SuperNode process per node, the
Deployment Engine), run in turn and repeated, the repetitions interleaved so that a change in the
machine's load falls on all three alike:

* ``product``: the product's run as configured (its default method unless ``-c`` says otherwise) on
  every node;
* ``stock-capable``: a stock Flower FedAvg app (:mod:`benchmarks.vs_flower.stock_flower`, the shape
  ``flwr new`` generates) on the nodes that can hold the full model (capacity 1): what an operator
  can do today;
* ``stock-all``: the same app on every node, ignoring capacity (a ceiling: real small devices may
  not hold the full model).

Each node keeps its partition (``partition-id`` of all the nodes) in every variant. For each target
accuracy the command prints the rounds, the seconds on this machine from submission, and the
emulated fleet seconds (:mod:`benchmarks.vs_flower.fleet_time`) to reach it, and the start-up:
seconds from submission until the initial model's record, when the first round's messages go out.

Usage::

    fibos bench-vs-flower --capacities 1,1/2,1/4,1/4,1/8,1/16 --rounds 10 --repeats 2 \\
        --targets 0.9,0.95 --out results/vs-flower

Writes ``runs/<variant>-<k>/`` (each run's folder: metrics.json, logs), ``results.csv`` (one row per
run), ``summary.md`` (the table and the command) and ``vs_flower.png`` (accuracy against rounds,
one-machine seconds and fleet seconds) to ``--out``; ``--reuse`` keeps finished runs, so an
interrupted command resumes.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.vs_flower.fleet_time import (
    Evaluation,
    first_reaching,
    product_curve,
    startup_seconds,
    stock_curve,
)
from cli.app_bundle import stage_app
from cli.launcher import (
    LocalFederation,
    check_run_config,
    parse_capacities,
    parse_overrides,
    run_federation_command,
    toml_overrides,
)
from common.config.run import RunConfig

STOCK_APP = Path(__file__).resolve().parent / "stock_flower"
VARIANTS = ("product", "stock-capable", "stock-all")
SUBMITTED = "submitted.json"


class PartitionNodes(LocalFederation):
    """A local federation of some of a fleet's nodes, each keeping its partition of the whole
    fleet's data.

    Parameters
    ----------
    capacities : Sequence[float]
        The whole fleet's capacities; node ``i`` holds partition ``i`` of ``len(capacities)``.
    keep : Sequence[int]
        The nodes started (indices into ``capacities``).
    home : Path
        The federation's folder (Flower state, logs).
    echo : callable
        Where progress lines go.
    """

    def __init__(
        self, capacities: Sequence[float], keep: Sequence[int], home: Path, echo: Callable
    ) -> None:
        if not keep:
            raise ValueError("no node to start")
        super().__init__([capacities[i] for i in keep], home, echo=echo)
        self.partitions = list(keep)
        self.num_partitions = len(capacities)

    def node_config(self, i: int) -> str:
        """Node ``i``'s ``--node-config``: its partition of the whole fleet, and its capacity."""
        return (
            f"partition-id={self.partitions[i]} num-partitions={self.num_partitions} "
            f"capacity={self.capacities[i]!r}"
        )


def stock_run_config(
    cfg: RunConfig, num_rounds: int, min_nodes: int, results_dir: Path
) -> dict[str, object]:
    """The stock app's run config: the product run's data, model, seed and local training
    hyperparameters."""
    from benchmarks.vs_flower.stock_flower.stock_fedavg.task import SHARED_KEYS

    flat = cfg.flat()
    shared = {key: flat[key.replace("-", "_")] for key in SHARED_KEYS}
    return {
        **shared,
        "num-rounds": num_rounds,
        "min-nodes": min_nodes,
        "local-epochs": cfg.local_epochs,
        "batch-size": cfg.batch_size,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "results-dir": str(results_dir.resolve()),
    }


def run_stock(federation: LocalFederation, run_config: dict[str, object], timeout: float) -> None:
    """Submit the stock app to ``federation`` and follow it to its end (its true final status)."""
    staged = stage_app(STOCK_APP, federation.flwr_home / "stock-app")
    cmd = [str(Path(sys.executable).parent / "flwr"), "run", str(staged), "local", "--stream"]
    cmd += ["-c", toml_overrides(run_config)]
    federation.echo("$ " + " ".join(cmd))
    run_federation_command(
        cmd, federation.env, federation.logs / "serverapp.log", timeout, federation.echo, "local"
    )


def run_variant(
    variant: str,
    capacities: Sequence[float],
    product_config: dict[str, object],
    cfg: RunConfig,
    folder: Path,
    timeout: float,
    echo: Callable[[str], None],
) -> tuple[dict[str, Any], float]:
    """Run one variant in ``folder``; returns its metrics.json and the Unix time it was
    submitted."""
    if variant == "product":
        federation: LocalFederation = LocalFederation(capacities, folder, echo=echo)
        federation.run_overrides(product_config, folder)
        with federation:
            submitted = time.time()
            metrics = federation.run(product_config, folder, timeout=timeout)
    else:
        keep = (
            [i for i, c in enumerate(capacities) if c >= 1.0]
            if variant == "stock-capable"
            else range(len(capacities))
        )
        keep = list(keep)
        federation = PartitionNodes(capacities, keep, folder, echo)
        run_config = stock_run_config(cfg, cfg.num_rounds, len(keep), folder)
        with federation:
            submitted = time.time()
            run_stock(federation, run_config, timeout)
        metrics = json.loads((folder / "metrics.json").read_text())
    (folder / SUBMITTED).write_text(json.dumps({"submitted_at": submitted}))
    return metrics, submitted


def curve_of(
    variant: str, metrics: dict[str, Any], submitted: float, link_mbit: float
) -> list[Evaluation]:
    """The run's evaluations scored by :mod:`benchmarks.vs_flower.fleet_time`."""
    if variant == "product":
        return product_curve(metrics["rounds"], submitted, link_mbit)
    return stock_curve(metrics["rounds"], submitted, link_mbit)


def run_row(
    variant: str,
    repeat: int,
    curve: Sequence[Evaluation],
    targets: Sequence[float],
    startup: float | None = None,
) -> dict[str, Any]:
    """One results row: start-up, final accuracy, and rounds / seconds / fleet seconds to each
    target (NaN: never).

    ``startup``: seconds from submission until the first round's messages went out (default: the
    initial evaluation's, :func:`~benchmarks.vs_flower.fleet_time.startup_seconds`).
    """
    row: dict[str, Any] = {
        "variant": variant,
        "repeat": repeat,
        "startup_s": curve[0].wall_seconds if startup is None else startup,
        "final_acc": curve[-1].accuracy,
        "wall_s": curve[-1].wall_seconds,
        "fleet_s": curve[-1].fleet_seconds,
    }
    for t in targets:
        hit = first_reaching(curve, t)
        row[f"rounds_to_{t:g}"] = float("nan") if hit is None else hit.round
        row[f"wall_s_to_{t:g}"] = float("nan") if hit is None else hit.wall_seconds
        row[f"fleet_s_to_{t:g}"] = float("nan") if hit is None else hit.fleet_seconds
    return row


def _mean(values: Sequence[float], fmt: str = ".1f") -> str:
    """Mean of the runs that reached it (NaN: did not), with how many did when not all."""
    reached = [v for v in values if not math.isnan(v)]
    if not reached:
        return "not reached"
    text = format(statistics.fmean(reached), fmt)
    return text if len(reached) == len(values) else f"{text} ({len(reached)} of {len(values)} runs)"


def table(rows: Sequence[dict[str, Any]], targets: Sequence[float]) -> str:
    """Markdown table: per variant, the mean over its runs of each figure."""
    head = ["variant", "runs", "start-up s", "final acc"]
    for t in targets:
        head += [f"rounds to {t:g}", f"s to {t:g} (this machine)", f"fleet s to {t:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        cells = [variant, str(len(mine)), _mean([r["startup_s"] for r in mine])]
        cells.append(f"{statistics.fmean(r['final_acc'] for r in mine):.4f}")
        for t in targets:
            cells += [
                _mean([r[f"{k}_to_{t:g}"] for r in mine], f)
                for k, f in (("rounds", "g"), ("wall_s", ".1f"), ("fleet_s", ".1f"))
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out: Path, curves: dict[tuple[str, int], list[Evaluation]]) -> None:
    """``vs_flower.png``: accuracy against rounds, seconds on this machine and fleet seconds, every
    run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    colours = {"product": "tab:blue", "stock-capable": "tab:orange", "stock-all": "tab:green"}
    for (variant, repeat), curve in sorted(curves.items()):
        style = dict(
            color=colours.get(variant, "grey"),
            marker="o",
            ms=3,
            alpha=0.85,
            ls="-" if repeat == 1 else "--",
        )
        label = f"{variant} #{repeat}"
        axes[0].plot([e.round for e in curve], [e.accuracy for e in curve], label=label, **style)
        axes[1].plot([e.wall_seconds for e in curve], [e.accuracy for e in curve], **style)
        axes[2].plot([e.fleet_seconds for e in curve], [e.accuracy for e in curve], **style)
    for ax, xlabel in zip(
        axes, ("round", "seconds since submission (this machine)", "emulated fleet seconds")
    ):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("global test accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "vs_flower.png", dpi=110)
    plt.close(fig)


def write(out: Path, rows: list[dict[str, Any]], targets: Sequence[float], header: str) -> None:
    """results.csv and summary.md for the runs so far (after every run: nothing lost)."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.md").write_text(f"{header}\n\n{table(rows, targets)}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos bench-vs-flower``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--capacities", type=parse_capacities, default=parse_capacities("1,1/2,1/4,1/4,1/8,1/16")
    )
    ap.add_argument("--rounds", type=int, default=10, help="rounds of every run")
    ap.add_argument(
        "--repeats", type=int, default=2, help="repetitions of every variant, interleaved"
    )
    ap.add_argument(
        "--targets", default="0.9,0.95", help="comma-separated target accuracies (fractions)"
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument(
        "--link-mbit", type=float, default=100.0, help="link speed of a capacity-1 node, Mbit/s"
    )
    ap.add_argument(
        "-c", "--run-config", action="append", default=[], help="the product run's overrides"
    )
    ap.add_argument("--out", type=Path, default=Path("results/vs-flower"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep finished runs (their metrics.json and submission time)",
    )
    args = ap.parse_args(argv)
    targets = [float(t) for t in args.targets.split(",") if t]
    if not targets or any(not 0 < t <= 1 for t in targets):
        ap.error(f"--targets {args.targets!r}: expected accuracies in (0, 1]")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(variants) - set(VARIANTS)):
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if "stock-capable" in variants and not any(c >= 1.0 for c in args.capacities):
        ap.error("--capacities: stock-capable needs a node of capacity 1")
    if args.rounds < 1 or args.repeats < 1 or args.link_mbit <= 0:
        ap.error("--rounds and --repeats take a positive count, --link-mbit a positive speed")
    # Client evaluation rounds would cost the product time the stock app never spends: central
    # evaluation only.
    product_config = {
        "eval-every": 0,
        **parse_overrides(args.run_config),
        "num-rounds": args.rounds,
    }
    product_config.setdefault("min-nodes", len(args.capacities))
    cfg = check_run_config(product_config)  # fails here, naming the key, before any process starts
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    header = (
        f"Command: `fibos bench-vs-flower {command}`\n\n"
        f"Capacities {', '.join(f'{c:g}' for c in args.capacities)}; {args.rounds} rounds; method "
        f"{cfg.method}, model {cfg.model}, dataset {cfg.dataset}, partitioner {cfg.partitioner}, "
        f"seed {cfg.seed}; fleet links {args.link_mbit:g} Mbit/s x capacity. Means over the runs."
    )
    rows: list[dict[str, Any]] = []
    curves: dict[tuple[str, int], list[Evaluation]] = {}
    plan = [(repeat, variant) for repeat in range(1, args.repeats + 1) for variant in variants]
    for n, (repeat, variant) in enumerate(plan, 1):
        folder = (args.out / "runs" / f"{variant}-{repeat}").resolve()
        done = folder / "metrics.json", folder / SUBMITTED
        if args.reuse and all(p.exists() for p in done):
            metrics = json.loads(done[0].read_text())
            submitted = float(json.loads(done[1].read_text())["submitted_at"])
            print(f"[run {n}/{len(plan)}] {variant} #{repeat}: reused {folder}", flush=True)
        else:
            print(f"[run {n}/{len(plan)}] {variant} #{repeat}", flush=True)
            metrics, submitted = run_variant(
                variant,
                args.capacities,
                product_config,
                cfg,
                folder,
                args.timeout,
                lambda line: print("    " + line, flush=True) if line.startswith("[") else None,
            )
        curve = curve_of(variant, metrics, submitted, args.link_mbit)
        curves[(variant, repeat)] = curve
        rows.append(
            run_row(variant, repeat, curve, targets, startup_seconds(metrics["rounds"], submitted))
        )
        print(f"[run {n}/{len(plan)}] {variant} #{repeat}: {rows[-1]}", flush=True)
        write(args.out, rows, targets, header)
    plot(args.out, curves)
    print()
    print(table(rows, targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
