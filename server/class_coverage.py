"""Which classes a finished run's global model recognises, grouped by the capacity of the clients that hold them.

Under label skew a class lives on a few clients. If those clients train small
submodels, the positions that decide the class in the full model may be
trained mostly by *other* clients, who never see it. This report makes that
visible: for each class, the recall of the final global model on the server's
test set and the largest capacity among the clients whose training data holds
the class (0: no client holds it).

Usage::

    python -m server.class_coverage results/bench/runs/digits-pathological2-s0-fedfibos [more run folders]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray


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
            f"  classes {[r.label for r in group]} ({held}): recall {np.mean(recalls) if recalls else float('nan'):.2f}"
        )
    return lines


def run_coverage(folder: Path) -> tuple[float, list[ClassCoverage]]:
    """Evaluate a finished run folder (``metrics.json`` + ``model.pt``) class by class."""
    import torch

    from client.local_data import derive_local_data
    from client.training import as_input
    from common.config import NodeConfig, RunConfig
    from common.datasets import load_dataset
    from common.models import build_model

    stored = json.loads((folder / "metrics.json").read_text())["run"]
    run = RunConfig(**{k: v for k, v in stored.items() if k in RunConfig.__dataclass_fields__})
    capacities = [float(c) for c in run.capacity_mix.split(",") if c]
    if not capacities:
        raise ValueError(f"{folder}: the run has no capacity-mix, so its clients cannot be derived")
    test = load_dataset(run.dataset, run.test_fraction, run.seed, run.data_path).test
    client_labels = [
        derive_local_data(run, NodeConfig(partition_id=i, num_partitions=len(capacities), capacity=cap)).train.y
        for i, cap in enumerate(capacities)
    ]
    model = build_model(run.model, test.num_classes, int(test.x.shape[1]) if test.x.ndim == 4 else 1, 0)
    model.load_state_dict(torch.load(folder / "model.pt"), strict=False)
    model.eval()
    with torch.no_grad():
        pred = np.concatenate(
            [model(as_input(torch.from_numpy(test.x[i : i + 512]))).argmax(1).numpy() for i in range(0, len(test), 512)]
        )
    rows = class_coverage(pred, test.y, client_labels, capacities, test.num_classes)
    return float(np.mean(pred == test.y)), rows


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m server.class_coverage``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="finished run folders (metrics.json + model.pt)")
    args = ap.parse_args(argv)
    for folder in args.runs:
        accuracy, rows = run_coverage(folder)
        print("\n".join(coverage_lines(folder.name, accuracy, rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
