"""Benchmark: what a client's Fisher upload costs, against the local training it rides on.

A FedFIbOS client spends, beyond local training, the time to estimate its diagonal
Fisher and to encode it for the uplink. This command measures both on real data and
the real client code, for each model x estimator x capacity:

* ``train s``: ``train_masked`` over the client's examples for ``--local-epochs`` epochs
  (what a round trains; no Fisher measured);
* ``estimate s``: ``global``: :func:`common.fisher.estimation.per_example_fisher` on
  ``--fisher-examples`` examples at the full global model (a refresh round's cost, paid every
  ``fisher-every`` rounds); ``received``: the same at the received submodel (every round);
  ``path``: the extra time of the same training with the Fisher accumulated along it;
* ``encode s``: :func:`common.fisher.codec.encode_fisher` in ``--encoding``;
* ``overhead``: ``(estimate + encode) / train``.

The client is one Dirichlet partition of ``--partitions`` (the benchmark's 8-client
split); its mask is the magnitude top-k of the initial model at the capacity. Each
figure is the median of ``--repeat`` runs after one warm-up run (one-time costs such as
kernel selection are not a round's cost), with ``--threads`` torch threads (default 1,
what ``fibos local`` gives each SuperNode).

Usage::

    fibos bench-fisher-cost --models cnn,cnn-bn,resnet18 --out results/fisher-cost

Writes ``fisher_cost.json``, ``fisher_cost.csv`` and ``fisher_cost.png`` to ``--out``
and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from benchmarks.bench_rows import write_rows
from cli.launcher import parse_capacities
from common.data.arrays import ArrayDataset
from common.data.datasets import load_dataset
from common.data.partitioning import partition_indices
from common.fisher.codec import FISHER_ENCODINGS, encode_fisher
from common.fisher.estimation import example_indices, per_example_fisher
from common.fisher.selection import select_mask
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.loop import TrainConfig, train_masked

T = TypeVar("T")


@dataclass(frozen=True)
class CostRow:
    """One model x estimator x capacity: medians in seconds, and the overhead ratio."""

    dataset: str
    model: str
    estimator: str
    encoding: str
    capacity: float
    examples: int
    train_seconds: float
    estimate_seconds: float
    encode_seconds: float
    overhead: float


def _median_seconds(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Median wall seconds of ``repeat`` calls of ``fn`` after one unmeasured call, and the last
    result."""
    result = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def measure_costs(
    dataset: str,
    model_name: str,
    data: ArrayDataset,
    capacities: Sequence[float],
    estimators: Sequence[str],
    encoding: str,
    local_epochs: int,
    fisher_examples: int,
    repeat: int,
    seed: int,
) -> list[CostRow]:
    """Every estimator x capacity for one client's data.

    Parameters
    ----------
    dataset, model_name : str
        Names written into the rows.
    data : ArrayDataset
        The client's training examples.
    capacities : Sequence[float]
        Capacities (share of the model's weights) to measure at.
    estimators : Sequence[str]
        Any of ``global``, ``received`` and ``path``.
    encoding : str
        Upload encoding whose encoder is timed.
    local_epochs : int
        Epochs of the local training the overhead is relative to.
    fisher_examples : int
        Examples of the ``received`` estimate.
    repeat : int
        Measured runs per figure (median).
    seed : int
        Model initialisation and example draw.
    """
    device = torch.device("cpu")
    model = build_model(model_name, data.num_classes, data.in_channels, seed)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    cfg = TrainConfig(epochs=local_epochs, batch_size=32, lr=0.05, momentum=0.9, seed=seed)
    idx = example_indices(len(data), fisher_examples, seed)
    rows = []
    for gamma in capacities:
        mask = select_mask(layout, x, gamma, "magnitude")
        train, _ = _median_seconds(
            partial(train_masked, model, layout, x, mask, data, cfg, device, False), repeat
        )
        whole = np.ones(layout.size, dtype=bool)
        for est in estimators:
            if est == "global":
                estimate, fisher = _median_seconds(
                    partial(per_example_fisher, model, layout, x, whole, data, idx, None, device),
                    repeat,
                )
            elif est == "received":
                estimate, fisher = _median_seconds(
                    partial(per_example_fisher, model, layout, x, mask, data, idx, None, device),
                    repeat,
                )
            else:
                along, trained = _median_seconds(
                    partial(train_masked, model, layout, x, mask, data, cfg, device, True), repeat
                )
                estimate = max(
                    along - train, 0.0
                )  # what accumulating along the path adds to the same training
                fisher = trained.fisher
            encode, _ = _median_seconds(
                partial(encode_fisher, fisher, mask, layout, encoding), repeat
            )
            rows.append(
                CostRow(
                    dataset,
                    model_name,
                    est,
                    encoding,
                    gamma,
                    len(data),
                    train,
                    estimate,
                    encode,
                    (estimate + encode) / max(train, 1e-9),
                )
            )
            print(f"  {model_name} {est} @{gamma:g}: overhead {rows[-1].overhead:.3f}", flush=True)
    return rows


def table(rows: Sequence[CostRow]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| dataset | model | estimator | encoding | capacity | examples | train s | estimate s | "
        "encode s | overhead |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dataset} | {r.model} | {r.estimator} | {r.encoding} | {r.capacity:g} | "
            f"{r.examples} | {r.train_seconds:.3f} | {r.estimate_seconds:.4f} | "
            f"{r.encode_seconds:.4f} | {r.overhead:.3f} |"
        )
    return "\n".join(lines)


def write_outputs(rows: Sequence[CostRow], out: Path) -> None:
    """``fisher_cost.json``, ``.csv`` and ``.png`` (overhead per model and capacity) in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_rows(rows, out, "fisher_cost")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r.model, r.estimator) for r in rows}):
        pts = sorted((r.capacity, r.overhead) for r in rows if (r.model, r.estimator) == key)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=" / ".join(key))
    ax.axhline(10, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity")
    ax.set_ylabel("Fisher estimate + encoding, % of local training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fisher_cost.png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", default="mnist5k", help="offline image dataset")
    ap.add_argument(
        "--models", default="cnn,cnn-bn,resnet18", help="comma-separated: cnn, cnn-bn, resnet18"
    )
    ap.add_argument("--capacities", default="1/4,1/16,1/64")
    ap.add_argument(
        "--estimators", default="global,received,path", help="any of global, received, path"
    )
    ap.add_argument("--encoding", default="ranked", help=f"one of {', '.join(FISHER_ENCODINGS)}")
    ap.add_argument(
        "--local-epochs", type=int, default=3, help="epochs of local training (the run default)"
    )
    ap.add_argument(
        "--fisher-examples", type=int, default=32, help="examples of the received estimate"
    )
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    ap.add_argument("--client", type=int, default=0, help="which partition is the measured client")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: what `fibos local` gives each SuperNode)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/fisher-cost")
    args = ap.parse_args(argv)
    estimators = [e for e in args.estimators.split(",") if e]
    for e in estimators:
        if e not in ("global", "received", "path"):
            ap.error(f"--estimators: {e!r} is not one of global, received, path")
    if args.encoding not in FISHER_ENCODINGS:
        ap.error(f"--encoding: {args.encoding!r} is not one of {', '.join(FISHER_ENCODINGS)}")
    for key in ("local_epochs", "fisher_examples", "repeat", "threads"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}: must be at least 1")
    capacities = parse_capacities(args.capacities)
    torch.set_num_threads(args.threads)
    split = load_dataset(args.dataset, 0.2, args.seed)
    idx = partition_indices(
        split.train.y, "dirichlet", args.partitions, args.client, args.seed, alpha=args.alpha
    )
    data = split.train.subset(idx)
    rows: list[CostRow] = []
    for model_name in [m for m in args.models.split(",") if m]:
        print(f"{model_name}: {len(data)} local examples, {args.local_epochs} epochs", flush=True)
        rows += measure_costs(
            args.dataset,
            model_name,
            data,
            capacities,
            estimators,
            args.encoding,
            args.local_epochs,
            args.fisher_examples,
            args.repeat,
            args.seed,
        )
    write_outputs(rows, Path(args.out))
    print(table(rows))
    print(f"-> {Path(args.out) / 'fisher_cost.csv'}, {Path(args.out) / 'fisher_cost.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
