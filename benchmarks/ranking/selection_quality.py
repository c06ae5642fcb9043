"""Benchmark: how close the server's Fisher-ranked mask is to the one the defined Fisher would give.

FedFIbOS keeps, for a client of capacity ``gamma``, the ``k`` positions with the
largest ``F_j^2 x_j^2``, where ``F`` is the client's diagonal Fisher at the model it
received. What the server actually ranks by is an *estimate* of ``F`` (how the
client measured it) passed through an *upload encoding* (what survives the
uplink). For each estimator x encoding x capacity this command measures, on real
data and a real model:

* ``overlap``: ``|S ∩ S*| / |S*|``, where ``S*`` is the mask the exact per-example
  Fisher at the received weights (all local examples) gives and ``S`` the mask the
  server computes from the decoded upload (same guards, same budget);
* ``error``: the masking surrogate ``sum_{j not in S} F*_j^2 x_j^2`` divided by its
  optimum ``sum_{j not in S*} F*_j^2 x_j^2`` (1 = optimal);
* ``bytes``: the upload's Fisher payload;
* ``cost``: the estimator's seconds divided by one local epoch's training seconds.

The received model is the global model after ``--warmup-epochs`` of central SGD
on ``--warmup-examples`` training examples (a model mid-training, not at
initialisation); each client holds a Dirichlet partition and trained last round
on the magnitude mask of its capacity (what round 1 gives it), so the Fisher it
measures is that of its masked effective weights. ``magnitude`` rows rank by
``|x|`` alone (the first-round fallback).

Usage::

    fibos bench-selection --datasets digits --models cnn --out results/selection
    fibos bench-selection --datasets mnist5k --models resnet18 --clients 2 --reference-examples 64

Writes ``selection.json``, ``selection.csv`` and ``selection.png`` (overlap against
capacity, one line per estimator x encoding) to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_rows import write_rows
from cli.launcher import parse_capacities
from common.data.arrays import ArrayDataset
from common.data.datasets import load_dataset
from common.data.partitioning import partition_indices
from common.fisher.codec import FISHER_ENCODINGS, decode_fisher, encode_fisher
from common.fisher.estimation import example_indices, per_example_fisher
from common.fisher.selection import masking_error, select_mask
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.training.loop import TrainConfig, train_loop, train_masked


@dataclass(frozen=True)
class Row:
    """One estimator x encoding x capacity, averaged over clients."""

    dataset: str
    model: str
    estimator: str
    encoding: str
    capacity: float
    overlap: float
    error_ratio: float
    fisher_bytes: float
    cost: float
    clients: int


def received_model(
    name: str, train: ArrayDataset, examples: int, epochs: int, seed: int
) -> tuple[np.ndarray, ParamLayout]:
    """The global model after a short central warm-up: flat parameters and its layout."""
    model = build_model(name, train.num_classes, train.in_channels, seed)
    if epochs > 0 and examples > 0:
        subset = train.subset(example_indices(len(train), examples, seed))
        cfg = TrainConfig(epochs=epochs, batch_size=32, lr=0.05, momentum=0.9, seed=seed)
        train_loop(model, subset, cfg, torch.device("cpu"))
    layout = model_layout(model)
    return layout.flatten(trainable_arrays(model)), layout


def measure_client(
    model_name: str,
    layout: ParamLayout,
    x: np.ndarray,
    data: ArrayDataset,
    capacities: Sequence[float],
    estimators: Sequence[str],
    encodings: Sequence[str],
    reference_examples: int,
    seed: int,
    min_per_row: int,
) -> list[dict]:
    """Every estimator x encoding x capacity for one client: overlap, error ratio, bytes, cost."""
    device = torch.device("cpu")
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9, seed=seed)
    out = []
    for gamma in capacities:
        held = select_mask(layout, x, gamma, "magnitude", min_per_row=min_per_row)
        fresh = build_model(model_name, data.num_classes, data.in_channels, seed)
        ref_idx = example_indices(len(data), reference_examples, seed + 1)
        reference = per_example_fisher(fresh, layout, x, held, data, ref_idx, None, device)
        best = select_mask(layout, x, gamma, "fisher", reference, min_per_row)
        optimum = masking_error(reference, x, best)
        t0 = time.perf_counter()
        trained = train_masked(fresh, layout, x, held, data, cfg, device, measure_fisher=False)
        epoch_seconds = time.perf_counter() - t0
        del trained
        for est in estimators:
            t0 = time.perf_counter()
            if est == "path":
                fisher = train_masked(fresh, layout, x, held, data, cfg, device).fisher
            else:
                n = int(est.removeprefix("received"))
                idx = example_indices(len(data), n, seed)
                fisher = per_example_fisher(fresh, layout, x, held, data, idx, None, device)
            cost = (time.perf_counter() - t0) / max(epoch_seconds, 1e-9)
            if est == "path":
                cost = max(cost - 1.0, 0.0)  # the path estimate rides on the epoch it measures
            for enc in encodings:
                payload = encode_fisher(fisher, held, layout, enc)
                decoded = decode_fisher(payload, held, layout, enc)
                chosen = select_mask(layout, x, gamma, "fisher", decoded, min_per_row)
                out.append(
                    _entry(est, enc, gamma, chosen, best, reference, x, optimum, payload, cost)
                )
        chosen = select_mask(layout, x, gamma, "magnitude", min_per_row=min_per_row)
        out.append(_entry("none", "magnitude", gamma, chosen, best, reference, x, optimum, {}, 0.0))
    return out


def _entry(est, enc, gamma, chosen, best, reference, x, optimum, payload, cost) -> dict:
    overlap = float(np.count_nonzero(chosen & best) / max(np.count_nonzero(best), 1))
    ratio = masking_error(reference, x, chosen) / optimum if optimum > 0 else 1.0
    nbytes = float(sum(np.asarray(a).nbytes for a in payload.values()))
    return {
        "estimator": est,
        "encoding": enc,
        "capacity": gamma,
        "overlap": overlap,
        "error_ratio": ratio,
        "fisher_bytes": nbytes,
        "cost": cost,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--datasets", default="digits", help="comma-separated offline datasets")
    ap.add_argument("--models", default="cnn", help="comma-separated: cnn, resnet18")
    ap.add_argument("--capacities", default="1/4,1/16,1/64")
    ap.add_argument(
        "--estimators",
        default="path,received32,received128",
        help="path (minibatch gradients along local SGD) and/or receivedN (N examples at the "
        "received weights)",
    )
    ap.add_argument("--encodings", default=",".join(FISHER_ENCODINGS))
    ap.add_argument(
        "--clients",
        type=int,
        default=4,
        help="clients measured (of --partitions Dirichlet partitions)",
    )
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    ap.add_argument(
        "--reference-examples", type=int, default=0, help="examples in the exact Fisher (0 = all)"
    )
    ap.add_argument("--warmup-examples", type=int, default=512)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--min-per-row", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/selection")
    args = ap.parse_args(argv)

    capacities = parse_capacities(args.capacities)
    estimators = [e for e in args.estimators.split(",") if e]
    for e in estimators:
        if e != "path" and not (e.startswith("received") and e.removeprefix("received").isdigit()):
            ap.error(f"--estimators: {e!r} is neither 'path' nor 'receivedN'")
    encodings = [e for e in args.encodings.split(",") if e]
    for e in encodings:
        if e not in FISHER_ENCODINGS:
            ap.error(f"--encodings: {e!r} is not one of {', '.join(FISHER_ENCODINGS)}")
    torch.manual_seed(args.seed)
    rows: list[Row] = []
    for dataset in args.datasets.split(","):
        split = load_dataset(dataset, 0.2, args.seed)
        for model_name in args.models.split(","):
            x, layout = received_model(
                model_name, split.train, args.warmup_examples, args.warmup_epochs, args.seed
            )
            per_client = []
            for c in range(args.clients):
                idx = partition_indices(
                    split.train.y, "dirichlet", args.partitions, c, args.seed, alpha=args.alpha
                )
                t0 = time.perf_counter()
                per_client.append(
                    measure_client(
                        model_name,
                        layout,
                        x,
                        split.train.subset(idx),
                        capacities,
                        estimators,
                        encodings,
                        args.reference_examples,
                        args.seed + c,
                        args.min_per_row,
                    )
                )
                print(
                    f"{dataset} {model_name} d={layout.size:,}: client {c + 1}/{args.clients} "
                    f"({len(idx)} examples) {time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
            for i, first in enumerate(per_client[0]):
                vals = [pc[i] for pc in per_client]
                rows.append(
                    Row(
                        dataset,
                        model_name,
                        first["estimator"],
                        first["encoding"],
                        first["capacity"],
                        float(np.mean([v["overlap"] for v in vals])),
                        float(np.mean([v["error_ratio"] for v in vals])),
                        float(np.mean([v["fisher_bytes"] for v in vals])),
                        float(np.mean([v["cost"] for v in vals])),
                        len(vals),
                    )
                )
    write_outputs(rows, Path(args.out))
    return 0


def table(rows: Sequence[Row]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| dataset | model | estimator | encoding | capacity | overlap | error / optimum | Fisher "
        "bytes | cost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dataset} | {r.model} | {r.estimator} | {r.encoding} | {r.capacity:.4g} | "
            f"{r.overlap:.3f} | {r.error_ratio:.3f} | {r.fisher_bytes:,.0f} | {r.cost:.2f} |"
        )
    return "\n".join(lines)


def write_outputs(rows: Sequence[Row], out: Path) -> None:
    """selection.json / .csv / .png and the printed table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_rows(rows, out, "selection")
    groups = sorted({(r.dataset, r.model) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (dataset, model_name) in zip(axes[0], groups):
        mine = [r for r in rows if (r.dataset, r.model) == (dataset, model_name)]
        for key in sorted({(r.estimator, r.encoding) for r in mine}):
            pts = sorted((r.capacity, r.overlap) for r in mine if (r.estimator, r.encoding) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" / ".join(key))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity")
        ax.set_ylabel("overlap with the exact-Fisher mask")
        ax.set_title(f"{dataset}, {model_name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "selection.png", dpi=120)
    plt.close(fig)
    print(table(rows))
    print(f"-> {out / 'selection.json'}, {out / 'selection.csv'}, {out / 'selection.png'}")
