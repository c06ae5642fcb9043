"""Which ranking rule gives the best submodel of a finished run's global model.

A masked method's small submodels can be weak for two different reasons: the
shared weights (how the federation trained them) or the rule that picks which
of them a small device keeps. This report separates the two. It takes a
finished run's global model and, for each capacity, keeps the top
``ceil(gamma d)`` positions by several rules, zeroes the rest and evaluates
that submodel on the server's test set. Run on the global models of two
methods, it gives a table of weights against rules: a rule that loses on both
methods' weights is the rule's fault, a method whose weights lose under every
rule is the training's.

The rules:

``fisher``
    FedFIbOS's key ``F_j^2 x_j^2`` (ranked as ``F_j |x_j|``), with ``F`` the
    clients' Fisher at the global model pooled by training examples (what the
    server's prior holds once every client has reported).
``client-fisher``
    The same key with each client's own Fisher, every client at every
    capacity; the figure is the mean over clients. Under label skew a
    client's estimate favours the positions of its own classes.
``obd``
    ``F_j x_j^2`` with the pooled ``F``: the diagonal second-order saliency of
    Optimal Brain Damage, one power of the Fisher less than ``fisher``.
``magnitude``
    ``|x_j|``: FIARSE's key.

The Fisher is the one FedFIbOS clients compute (mean squared per-example
gradient on ``fisher-examples`` of each client's training examples, with the
run's ``label-mask``), measured here at the full global model.

Usage::

    fibos ranking-rules results/bench/runs/digits-dirichlet0.1-s0-fedfibos [more run folders] --out rules.csv
"""  # noqa: E501

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from common.fisher.selection import budget, fisher_scores, magnitude_scores, topk_mask

if TYPE_CHECKING:
    import torch
    from torch import nn

    from common.data.datasets import ArrayDataset
    from common.models.layout import ParamLayout

RULES = ("fisher", "client-fisher", "obd", "magnitude")
"""Every rule the report knows, in the order its tables list them."""


def rule_scores(
    rule: str, x: NDArray[np.float32], fisher: NDArray[np.floating] | None
) -> NDArray[np.float64]:
    """Ranking key of one pooled rule (larger: kept first).

    Parameters
    ----------
    rule : str
        ``fisher`` (``F |x|``, which orders as ``F^2 x^2``), ``obd`` (``F x^2``) or ``magnitude``
        (``|x|``). ``client-fisher`` is ``fisher`` with one client's estimate passed as ``fisher``.
    x : NDArray[float32]
        The flat global parameters.
    fisher : NDArray, optional
        The flat diagonal Fisher at ``x``, non-negative; needed by every rule but ``magnitude``.
    """
    if rule == "magnitude":
        return magnitude_scores(x)
    if fisher is None:
        raise ValueError(f"rule {rule!r} needs a Fisher estimate")
    if rule in ("fisher", "client-fisher"):
        return fisher_scores(fisher, x)
    if rule == "obd":
        return fisher_scores(fisher, x) * np.abs(np.asarray(x, dtype=np.float64))
    raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")


def pooled_fisher(
    estimates: Sequence[NDArray[np.floating]], weights: Sequence[float]
) -> NDArray[np.float64]:
    """Examples-weighted mean of the clients' Fisher estimates.

    Parameters
    ----------
    estimates : sequence of NDArray
        One flat estimate per client, all of one length.
    weights : sequence of float
        Each client's number of training examples (positive).
    """
    if not estimates or len(estimates) != len(weights):
        raise ValueError("one weight per estimate, and at least one estimate")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w <= 0):
        raise ValueError(f"weights must be positive: {weights}")
    return np.tensordot(
        w / w.sum(), np.stack([np.asarray(e, dtype=np.float64) for e in estimates]), axes=1
    )


def submodel_accuracy(
    model: nn.Module,
    layout: ParamLayout,
    x: NDArray[np.float32],
    scores: NDArray[np.floating],
    gamma: Fraction,
    test: ArrayDataset,
    device: torch.device,
) -> float:
    """Test accuracy of ``x`` restricted to its top ``ceil(gamma d)`` positions by ``scores`` (the
    rest zero).

    Parameters
    ----------
    model : nn.Module
        An instance of the architecture; its parameters are overwritten.
    layout : ParamLayout
        Flat layout of its trainable tensors.
    x : NDArray[float32]
        Flat global parameters.
    scores : NDArray
        Ranking key per position.
    gamma : Fraction
        Capacity: the share of the ``d`` positions kept.
    test : ArrayDataset
        The evaluation set.
    device : torch.device
        Where to evaluate.
    """
    from common.models.architectures import load_flat
    from common.training.evaluation import evaluate

    mask = topk_mask(scores, budget(gamma, x.size))
    load_flat(model, layout, np.where(mask, x, 0).astype(np.float32))
    _, accuracy = evaluate(model, test, device)
    return float(accuracy)


@dataclass(frozen=True)
class RunRankings:
    """What :func:`run_rankings` finds in one run folder.

    Parameters
    ----------
    method : str
        The run's ``method``.
    accuracy : float
        Test accuracy of the full global model.
    by_rule : Mapping[tuple[str, Fraction], float]
        (rule, capacity) -> test accuracy of that submodel (``client-fisher``: mean over clients).
    """

    method: str
    accuracy: float
    by_rule: Mapping[tuple[str, Fraction], float]


def run_rankings(
    folder: Path, capacities: Sequence[Fraction], rules: Sequence[str] = RULES
) -> RunRankings:
    """Evaluate a finished run folder's global model under each rule and capacity.

    Parameters
    ----------
    folder : Path
        A run folder holding ``metrics.json`` (its ``run`` settings) and ``model.pt``.
    capacities : sequence of Fraction
        Capacities to evaluate, each in (0, 1].
    rules : sequence of str
        Names from :data:`RULES`.
    """
    import torch

    from common.config.node import NodeConfig
    from common.config.parse import config_from_flat
    from common.data.datasets import load_dataset
    from common.data.local_split import derive_local_data
    from common.fisher.estimation import example_indices, per_example_fisher
    from common.models.architectures import (
        build_run_model,
        load_flat,
        model_layout,
        trainable_arrays,
    )
    from common.training.evaluation import evaluate
    from common.training.loop import local_classes

    stored = json.loads((folder / "metrics.json").read_text())["run"]
    run = config_from_flat(stored)
    mix = [float(c) for c in run.capacity_mix.split(",") if c]
    if not mix:
        raise ValueError(f"{folder}: the run has no capacity-mix, so its clients cannot be derived")
    device = torch.device("cpu")
    test = load_dataset(run.dataset, run.test_fraction, run.seed, run.data_path).test
    trains = [
        derive_local_data(
            run, NodeConfig(partition_id=i, num_partitions=len(mix), capacity=c)
        ).train
        for i, c in enumerate(mix)
    ]
    model = build_run_model(run, test.num_classes, trains[0].in_channels)
    model.load_state_dict(torch.load(folder / "model.pt"), strict=False)
    model.eval()
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    _, full_accuracy = evaluate(model, test, device)

    whole = np.ones(layout.size, dtype=bool)
    estimates = []
    for i, train in enumerate(trains):
        present = local_classes(torch.from_numpy(train.y), train.num_classes, run.label_mask)
        indices = example_indices(len(train), run.options("fisher").examples, run.seed + i)
        estimates.append(
            per_example_fisher(model, layout, x, whole, train, indices, present, device)
        )
    pooled = pooled_fisher(estimates, [len(t) for t in trains])

    by_rule: dict[tuple[str, Fraction], float] = {}
    for rule in rules:
        if rule == "client-fisher":
            per_client = [rule_scores(rule, x, f) for f in estimates]
        else:
            per_client = [rule_scores(rule, x, None if rule == "magnitude" else pooled)]
        for gamma in capacities:
            accs = [submodel_accuracy(model, layout, x, s, gamma, test, device) for s in per_client]
            by_rule[rule, gamma] = float(np.mean(accs))
    load_flat(model, layout, x)
    return RunRankings(run.method, float(full_accuracy), by_rule)


def rankings_table(
    runs: Sequence[RunRankings], capacities: Sequence[Fraction], rules: Sequence[str]
) -> list[str]:
    """Markdown table: per method (mean over its runs) and rule, the submodel accuracy at each
    capacity."""
    grouped: dict[str, list[RunRankings]] = defaultdict(list)
    for r in runs:
        grouped[r.method].append(r)
    head = " | ".join(f"@{g}" for g in capacities)
    lines = [
        f"| weights of | runs | full | rule | {head} |",
        "|---|---|---|---|" + "---|" * len(capacities),
    ]
    for method, rs in grouped.items():
        full = np.mean([r.accuracy for r in rs])
        for rule in rules:
            cells = " | ".join(
                f"{np.mean([r.by_rule[rule, g] for r in rs]):.3f}" for g in capacities
            )
            lines.append(f"| {method} | {len(rs)} | {full:.3f} | `{rule}` | {cells} |")
    return lines


def _capacity(text: str) -> Fraction:
    value = Fraction(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"capacity {text!r} is not in (0, 1]")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos ranking-rules``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "runs", nargs="+", type=Path, help="finished run folders (metrics.json + model.pt)"
    )
    ap.add_argument(
        "--capacities",
        default="1/4,1/16,1/64",
        help="comma-separated capacities to evaluate (fractions of the model's parameters; default "
        "1/4,1/16,1/64)",
    )
    ap.add_argument(
        "--rules", default=",".join(RULES), help=f"comma-separated rules from {', '.join(RULES)}"
    )
    ap.add_argument("--out", type=Path, help="CSV file for one row per run, rule and capacity")
    args = ap.parse_args(argv)
    try:
        capacities = [_capacity(c) for c in args.capacities.split(",") if c]
    except argparse.ArgumentTypeError as err:
        ap.error(f"--capacities: {err}")
    rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        ap.error(f"--rules: unknown {', '.join(unknown)}; choose from {', '.join(RULES)}")
    missing = [
        str(f)
        for f in args.runs
        if not (f / "metrics.json").is_file() or not (f / "model.pt").is_file()
    ]
    if missing:
        ap.error(
            f"not a finished run folder (needs metrics.json and model.pt): {', '.join(missing)}"
        )

    found = []
    rows = []
    for i, folder in enumerate(args.runs, 1):
        r = run_rankings(folder, capacities, rules)
        found.append(r)
        cells = "  ".join(
            f"{rule}@{g} {r.by_rule[rule, g]:.3f}" for rule in rules for g in capacities
        )
        print(f"[{i}/{len(args.runs)}] {folder.name}: full {r.accuracy:.3f}  {cells}", flush=True)
        rows += [
            {
                "run": folder.name,
                "method": r.method,
                "rule": rule,
                "capacity": str(g),
                "accuracy": r.by_rule[rule, g],
            }
            for rule in rules
            for g in capacities
        ]
    print("\n" + "\n".join(rankings_table(found, capacities, rules)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as fh:
            writer = csv.DictWriter(
                fh, fieldnames=["run", "method", "rule", "capacity", "accuracy"]
            )
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
