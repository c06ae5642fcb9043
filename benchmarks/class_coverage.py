"""Which classes a finished run's global model recognises, grouped by the capacity of the clients
that hold them.

Under label skew a class lives on a few clients. If those clients train small
submodels, the positions that decide the class in the full model may be
trained mostly by *other* clients, who never see it. This report makes that
visible: for each class, the recall of the final global model on the server's
test set and the largest capacity among the clients whose training data holds
the class (0: no client holds it).

Each run's report also counts dead units: channels of each hidden Conv2d or
Linear layer whose output is never positive on the first 1000 test examples
(``DEAD_UNIT_SAMPLE``). Where a ReLU
follows the layer (the small CNN, the fastText model) such a unit passes no
gradient, so no client can revive it; a global model whose hidden channels have
all died predicts one class whatever it is shown.

With several run folders it also prints a Markdown table per method: recall
averaged over every (run, class) pair in each tier, the pair count in brackets,
and the mean global accuracy (the tables in ``docs/results/benchmarks.md``).

Usage::

    fibos class-coverage results/bench/runs/digits-pathological2-s0-fedfibos [more run folders]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ClassCoverage:
    """One class of one run.

    Parameters
    ----------
    label : int
        The class.
    recall : float
        Share of the test examples of this class that the global model predicts as it (NaN if none).
    top_capacity : float
        Largest capacity among the clients that hold this class (0 when none does).
    holders : int
        Number of clients that hold it.
    """

    label: int
    recall: float
    top_capacity: float
    holders: int


def class_coverage(
    predictions: NDArray[np.int64],
    labels: NDArray[np.int64],
    client_labels: Sequence[NDArray[np.int64]],
    capacities: Sequence[float],
    num_classes: int,
) -> list[ClassCoverage]:
    """Per-class recall and who holds each class.

    Parameters
    ----------
    predictions, labels : NDArray[int64]
        The global model's predictions and the true labels on the server's test set.
    client_labels : sequence of NDArray[int64]
        Each client's training labels.
    capacities : sequence of float
        Each client's capacity, aligned with ``client_labels``.
    num_classes : int
        Number of classes.
    """
    if len(client_labels) != len(capacities):
        raise ValueError(f"{len(client_labels)} clients' labels but {len(capacities)} capacities")
    out = []
    for c in range(num_classes):
        of_class = labels == c
        recall = float(np.mean(predictions[of_class] == c)) if of_class.any() else float("nan")
        caps = [cap for ys, cap in zip(client_labels, capacities) if np.any(ys == c)]
        out.append(ClassCoverage(c, recall, max(caps, default=0.0), len(caps)))
    return out


def coverage_lines(name: str, accuracy: float, rows: Sequence[ClassCoverage]) -> list[str]:
    """Human-readable summary: recall per tier of the largest holder's capacity."""
    lines = [f"{name}: global acc {accuracy:.3f}"]
    for tier in sorted({r.top_capacity for r in rows}, reverse=True):
        group = [r for r in rows if r.top_capacity == tier]
        recalls = [r.recall for r in group if not np.isnan(r.recall)]
        held = f"largest holder at capacity {tier:g}" if tier > 0 else "held by no client"
        lines.append(
            f"  classes {[r.label for r in group]} ({held}): recall "
            f"{np.mean(recalls) if recalls else float('nan'):.2f}"
        )
    return lines


def tier_name(tier: float) -> str:
    """Column heading for the classes whose largest holder has capacity ``tier`` (0: no holder)."""
    if tier <= 0:
        return "held by no client"
    inverse = 1 / tier
    return (
        f"at capacity 1/{inverse:g}"
        if tier < 1 and inverse == round(inverse)
        else f"at capacity {tier:g}"
    )


def coverage_table(runs: Sequence[tuple[str, float, Sequence[ClassCoverage]]]) -> list[str]:
    """Markdown table pooling runs per method.

    Parameters
    ----------
    runs : sequence of (method, global accuracy, per-class rows)
        One entry per finished run; runs of one method (e.g. several seeds) are pooled.

    Returns
    -------
    list[str]
        Table lines: one row per method in order of first appearance, one column per holder tier
        (largest capacity first, "held by no client" last) with the recall averaged over every (run,
        class) pair of that tier and the number of pairs in brackets, and the mean global accuracy.
    """
    tiers = sorted(
        {r.top_capacity for _, _, rows in runs for r in rows}, key=lambda t: (t <= 0, -t)
    )
    methods = list(dict.fromkeys(m for m, _, _ in runs))
    lines = [
        "| method | " + " | ".join(tier_name(t) for t in tiers) + " | global acc |",
        "|---|" + "---|" * (len(tiers) + 1),
    ]
    for method in methods:
        mine = [(acc, rows) for m, acc, rows in runs if m == method]
        cells = []
        for tier in tiers:
            recalls = [
                r.recall
                for _, rows in mine
                for r in rows
                if r.top_capacity == tier and not np.isnan(r.recall)
            ]
            cells.append(f"{np.mean(recalls):.2f} ({len(recalls)})" if recalls else "-")
        lines.append(
            f"| {method} | " + " | ".join(cells) + f" | {np.mean([a for a, _ in mine]):.3f} |"
        )
    return lines


def dead_units(model: torch.nn.Module, x: torch.Tensor) -> dict[str, tuple[int, int]]:
    """Per hidden layer, how many output channels are never positive on the inputs ``x``.

    Parameters
    ----------
    model : torch.nn.Module
        The model, in eval mode. Every ``Conv2d`` and ``Linear`` except the last ``Linear`` (the
        classifier) is counted; a channel is an output channel of a convolution or an output unit of
        a linear layer.
    x : torch.Tensor
        A batch of inputs, e.g. the server's test set.

    Returns
    -------
    dict[str, tuple[int, int]]
        Layer name -> (channels whose output is <= 0 for every input and position, channels), in
        module order.
    """
    import torch
    from torch import nn

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if layers and isinstance(layers[-1][1], nn.Linear):
        layers = layers[:-1]
    peak: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
            # channel axis is 1 for conv maps and linear outputs alike; reduce over every other axis
            peak[name] = out.detach().transpose(0, 1).reshape(out.shape[1], -1).amax(1)

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in layers]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {n: (int((peak[n] <= 0).sum()), int(peak[n].numel())) for n, _ in layers}


DEAD_UNIT_SAMPLE = 1000
"""Test examples :func:`run_coverage` counts dead units on (the first ones of the server's test
set)."""


class RunCoverage(NamedTuple):
    """What :func:`run_coverage` finds in one run folder."""

    method: str
    """The run's ``method``."""
    accuracy: float
    """Global accuracy of the final model on the server's test set."""
    rows: list[ClassCoverage]
    """Per class, from :func:`class_coverage`."""
    dead: dict[str, tuple[int, int]]
    """Per hidden layer, :func:`dead_units` on the first ``DEAD_UNIT_SAMPLE`` test examples."""


def run_coverage(folder: Path) -> RunCoverage:
    """Evaluate a finished run folder (``metrics.json`` + ``model.pt``): accuracy, per class, and
    dead units."""
    import torch

    from common.config.node import NodeConfig
    from common.config.parse import config_from_flat
    from common.data.datasets import load_dataset
    from common.data.local_split import derive_local_data
    from common.models.architectures import build_model
    from common.training.loop import as_input

    stored = json.loads((folder / "metrics.json").read_text())["run"]
    run = config_from_flat(stored)
    capacities = [float(c) for c in run.capacity_mix.split(",") if c]
    if not capacities:
        raise ValueError(f"{folder}: the run has no capacity-mix, so its clients cannot be derived")
    test = load_dataset(run.dataset, run.test_fraction, run.seed, run.data_path).test
    client_labels = [
        derive_local_data(
            run, NodeConfig(partition_id=i, num_partitions=len(capacities), capacity=cap)
        ).train.y
        for i, cap in enumerate(capacities)
    ]
    model = build_model(
        run.model, test.num_classes, int(test.x.shape[1]) if test.x.ndim == 4 else 1, 0
    )
    model.load_state_dict(torch.load(folder / "model.pt"), strict=False)
    model.eval()
    with torch.no_grad():
        pred = np.concatenate(
            [
                model(as_input(torch.from_numpy(test.x[i : i + 512]))).argmax(1).numpy()
                for i in range(0, len(test), 512)
            ]
        )
    rows = class_coverage(pred, test.y, client_labels, capacities, test.num_classes)
    dead = dead_units(model, as_input(torch.from_numpy(test.x[:DEAD_UNIT_SAMPLE])))
    return RunCoverage(run.method, float(np.mean(pred == test.y)), rows, dead)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos class-coverage``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "runs", nargs="+", type=Path, help="finished run folders (metrics.json + model.pt)"
    )
    args = ap.parse_args(argv)
    pooled = []
    for folder in args.runs:
        cov = run_coverage(folder)
        print("\n".join(coverage_lines(folder.name, cov.accuracy, cov.rows)))
        dead = ", ".join(f"{n} {d}/{t}" for n, (d, t) in cov.dead.items())
        print(
            f"  dead units (never positive on the first {DEAD_UNIT_SAMPLE} test examples): {dead}",
            flush=True,
        )
        pooled.append((cov.method, cov.accuracy, cov.rows))
    if len(pooled) > 1:
        print("\n" + "\n".join(coverage_table(pooled)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
