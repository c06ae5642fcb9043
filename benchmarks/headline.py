"""README's headline table, generated from the ``results.csv`` it cites, so that it cannot drift
from it.

README holds a marker line ``<!-- headline: <path to results.csv> -->``; ``fibos docs`` writes the
table below it from that file (:func:`headline_table`): one column per method, the methods within
capacity first, by their full model's mean; one row per figure, mean ± standard deviation over the
seeds, and what a capacity saves on a device (bytes moved against its share, seconds per local step
and peak resident memory at 1 and at the smallest capacity).
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from benchmarks.benchmark import stayed_within, worst_bytes_ratio
from common.wire.byte_budget import BYTES_SLACK

MARKER = "<!-- headline: "

#: (label, results.csv column, digits): the accuracies, mean ± sd over seeds.
ACCURACY_ROWS = (
    ("full model, last round", "global_acc", 3),
    ("trained @1/4", "trained_cap_0.25", 3),
    ("trained @1/16", "trained_cap_0.0625", 3),
    ("trained @1/64", "trained_cap_0.015625", 3),
    ("own test split @1/64", "local_cap_0.015625", 3),
)
#: (label, column, digits): what a device pays, means over seeds.
COST_ROWS = (
    ("KiB down / up a round @1/64", ("kib_down_cap_0.015625", "kib_up_cap_0.015625"), 1),
    ("s per local step @1 / @1/64", ("s_per_step_cap_1", "s_per_step_cap_0.015625"), 3),
    ("peak MiB @1 / @1/64", ("peak_mib_cap_1", "peak_mib_cap_0.015625"), 0),
)


def _floats(rows: list[dict[str, str]], key: str) -> list[float]:
    vals = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    return [v for v in vals if not math.isnan(v)]


def _mean_sd(vals: list[float], digits: int) -> str:
    if not vals:
        return "-"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.{digits}f} ± {sd:.{digits}f}"


def _capacity(rows: list[dict[str, str]]) -> tuple[bool, str]:
    """Whether every run stayed within capacity, and the cell saying so (with the worst byte ratio
    when over)."""
    found = worst_bytes_ratio(rows)
    if stayed_within(rows):
        return True, "yes" if found is None else f"yes ({found[0]:.2f}x)"
    if found is not None and found[0] > BYTES_SLACK:
        return False, f"no ({found[0]:.1f}x bytes)"
    return False, "no"


def headline_table(results: Path) -> str:
    """The markdown table of ``results`` (a ``fibos bench`` results.csv), methods as columns."""
    with open(results, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{results} holds no runs")
    by_method: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    capacity = {m: _capacity(rs) for m, rs in by_method.items()}
    order = sorted(
        by_method,
        key=lambda m: (
            not capacity[m][0],
            -statistics.fmean(_floats(by_method[m], "global_acc") or [0.0]),
        ),
    )
    seeds = sorted({int(r["seed"]) for r in rows})
    lines = [
        f"| {len(seeds)} seeds ({', '.join(map(str, seeds))}) | " + " | ".join(order) + " |",
        "|---|" + "---|" * len(order),
        "| ≤ capacity (values and bytes; worst bytes / share) | "
        + " | ".join(capacity[m][1] for m in order)
        + " |",
    ]
    for label, key, digits in ACCURACY_ROWS:
        lines.append(
            f"| {label} | "
            + " | ".join(_mean_sd(_floats(by_method[m], key), digits) for m in order)
            + " |"
        )
    for label, (a, b), digits in COST_ROWS:
        cells = []
        for m in order:
            va, vb = _floats(by_method[m], a), _floats(by_method[m], b)
            cells.append(
                f"{statistics.fmean(va):.{digits}f} / {statistics.fmean(vb):.{digits}f}"
                if va and vb
                else "-"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def headline_block(text: str, root: Path) -> str:
    """``text`` (README) with the table under each headline marker rewritten from the results.csv it
    names."""
    out, pos = [], 0
    while (i := text.find(MARKER, pos)) >= 0:
        end = text.index("-->", i)
        path = text[i + len(MARKER) : end].strip()
        line_end = text.index("\n", end) + 1
        j = line_end
        while j < len(text) and text.startswith("|", j):  # the table that follows, if any
            j = text.index("\n", j) + 1
        out += [text[pos:line_end], headline_table(root / path)]
        pos = j
    return "".join(out) + text[pos:]
