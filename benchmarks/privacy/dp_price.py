"""Table and plot: what ``dp-epsilon`` costs in accuracy, read from ``fibos bench`` results.

A bench row whose method label carries ``+dp-epsilon=E`` (``fedavg+dp-epsilon=8``) ran with a
privacy budget of ``E``; the same label without that pair (``fedavg``) is the run without DP. This
module groups a results.csv's rows by that family and budget, and gives for each dataset and
partition the per-seed accuracy at each budget (a Markdown table) and accuracy against epsilon (a
plot: one point per seed, the line through the seeds' mean). ``fibos bench`` writes the plot itself
when its methods include a budget; this command rebuilds both from finished results, several files
at once.

Usage::

    fibos bench-dp-price --results docs/bench/dp-digits-dirichlet0.1-gn/results.csv \\
        docs/bench/dp-mnist5k-dirichlet0.5-gn/results.csv --out docs/bench/dp-price

Writes ``dp_price.md`` and ``accuracy_vs_epsilon.png`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The label pair that sets a row's privacy budget.
EPSILON_KEY = "dp-epsilon"
#: The figure the table and plot give: the full model on the server's test set.
FIGURE = "global_acc"


def split_budget(method: str) -> tuple[str, float]:
    """A bench method label as ``(family, epsilon)``: the label without its ``dp-epsilon`` pair,
    and that pair's budget (``math.inf`` for a row without DP).

    Parameters
    ----------
    method : str
        A ``fibos bench`` row label, ``name`` or ``name+key=value+...``.

    Raises
    ------
    ValueError
        When the budget is not a positive number or is given twice.
    """
    name, *pairs = method.split("+")
    budgets = [p for p in pairs if p.partition("=")[0] == EPSILON_KEY]
    if len(budgets) > 1:
        raise ValueError(f"method {method!r}: {EPSILON_KEY} given {len(budgets)} times")
    if not budgets:
        return method, math.inf
    text = budgets[0].partition("=")[2]
    try:
        epsilon = float(text)
    except ValueError:
        raise ValueError(f"method {method!r}: {EPSILON_KEY} {text!r} is not a number") from None
    if not epsilon > 0:
        raise ValueError(f"method {method!r}: {EPSILON_KEY} must be positive, got {text}")
    family = "+".join([name, *(p for p in pairs if p not in budgets)])
    return family, epsilon


#: ``(dataset, partition) -> family -> epsilon -> seed -> figure``
PriceGrid = dict[tuple[str, str], dict[str, dict[float, dict[int, float]]]]


def price_grid(
    rows: Sequence[Mapping[str, Any]], tag: Callable[[Mapping[str, Any]], str] | None = None
) -> PriceGrid:
    """Group bench rows by dataset and partition, family, budget and seed.

    Only families that ran with at least one budget are kept: a method never run under DP has no
    price to show. A row that repeats a (dataset, partition, method, seed) is refused, since two
    files must not silently overwrite each other's runs.

    Parameters
    ----------
    rows : Sequence[Mapping]
        ``results.csv`` rows (columns ``dataset``, ``partition``, ``method``, ``seed`` and
        :data:`FIGURE`).
    tag : Callable, optional
        Text appended to a row's family, for rows that differ in more than the method label
        (``fibos bench`` tags its Fisher upload encoding when several ran).
    """
    grid: PriceGrid = {}
    for row in rows:
        family, epsilon = split_budget(str(row["method"]))
        family += tag(row) if tag else ""
        seeds = (
            grid.setdefault((str(row["dataset"]), str(row["partition"])), {})
            .setdefault(family, {})
            .setdefault(epsilon, {})
        )
        seed = int(row["seed"])
        if seed in seeds:
            raise ValueError(
                f"{row['dataset']} {row['partition']} {row['method']} seed {seed}: given twice"
            )
        seeds[seed] = float(row[FIGURE])
    for families in grid.values():
        for family in [f for f, by in families.items() if set(by) == {math.inf}]:
            del families[family]
    return {key: families for key, families in grid.items() if families}


def _budget_label(epsilon: float) -> str:
    return "no DP" if math.isinf(epsilon) else f"epsilon {epsilon:g}"


def price_table(grid: PriceGrid) -> str:
    """Markdown: per dataset and partition, one row per family, one column per budget (no DP
    first, then the largest epsilon down), each cell the per-seed figures in seed order and their
    mean."""
    parts = []
    for (dataset, partition), families in sorted(grid.items()):
        budgets = sorted({e for by in families.values() for e in by}, reverse=True)
        head = " | ".join(_budget_label(e) for e in budgets)
        lines = [
            f"{dataset}, {partition}: full model on the server's test set, per seed (mean)\n",
            f"| method | {head} |",
            "|---" * (len(budgets) + 1) + "|",
        ]
        for family, by in sorted(families.items()):
            cells = []
            for epsilon in budgets:
                seeds = by.get(epsilon, {})
                values = [seeds[s] for s in sorted(seeds)]
                cells.append(
                    " / ".join(f"{v:.3f}" for v in values) + f" ({statistics.fmean(values):.3f})"
                    if values
                    else ""
                )
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot_price(grid: PriceGrid, path: Path) -> Path:
    """Accuracy against epsilon (log axis; no DP drawn at twice the largest budget), one panel
    per dataset and partition: a point per seed, a line through the means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(grid)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        families = grid[key]
        finite = sorted({e for by in families.values() for e in by if not math.isinf(e)})
        no_dp_at = 2 * finite[-1]
        for family, by in sorted(families.items()):
            budgets = sorted(by, key=lambda e: no_dp_at if math.isinf(e) else e)
            xs = [no_dp_at if math.isinf(e) else e for e in budgets]
            means = [statistics.fmean(by[e].values()) for e in budgets]
            (line,) = ax.plot(xs, means, marker="o", lw=1.5, label=family)
            for x, e in zip(xs, budgets):
                ax.scatter([x] * len(by[e]), list(by[e].values()), s=10, color=line.get_color())
        ax.set_xscale("log")
        ax.set_xticks([*finite, no_dp_at], [*(f"{e:g}" for e in finite), "no DP"])
        ax.set_title(f"{key[0]}, {key[1]}")
        ax.set_xlabel("dp-epsilon per node (delta 1e-5)")
        ax.set_ylabel("global test accuracy (full model)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--results`` one or more results.csv, ``--out`` a folder."""
    parser = argparse.ArgumentParser(prog="fibos bench-dp-price", description=__doc__)
    parser.add_argument("--results", nargs="+", type=Path, required=True, help="results.csv files")
    parser.add_argument("--out", type=Path, required=True, help="folder for the table and plot")
    args = parser.parse_args(argv)
    rows: list[dict[str, str]] = []
    for path in args.results:
        if not path.is_file():
            parser.error(f"--results {path}: no such file")
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    try:
        grid = price_grid(rows)
    except KeyError as missing:
        parser.error(
            f"--results: a row has no column {missing}; give fibos bench results.csv files"
        )
    except ValueError as bad:
        parser.error(f"--results: {bad}")
    if not grid:
        parser.error("no row ran with dp-epsilon: nothing to price")
    table = price_table(grid)
    args.out.mkdir(parents=True, exist_ok=True)
    sources = ", ".join(f"`{p}`" for p in args.results)
    (args.out / "dp_price.md").write_text(f"From {sources}.\n\n{table}\n")
    plot_price(grid, args.out / "accuracy_vs_epsilon.png")
    print(table)
    return 0
