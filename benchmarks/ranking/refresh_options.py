"""Benchmark: ways to rank a small client's next mask at the global model, what each costs it and
what it keeps.

FedFIbOS ranks a client of capacity ``gamma`` by its Fisher at the current global model ``x``.
Measuring that needs ``x`` on the client, and the client holds only its submodel: sending it the
rest costs ``4 (d - k)`` bytes, ``1/gamma - 1`` times its share (the bytes of its ``k`` values and
its mask). This command compares, for each client below capacity 1 of a Dirichlet split, the masks
these options give against the exact one:

* ``own-32`` (the definition, ``fedfibos-byte-budget = 0``): the rest of the model in float32, the
  client's Fisher at ``x`` on 32 examples, uploaded ``ranked``;
* ``int8-rest``: the rest of the model as 8-bit integers (one float32 scale per tensor), used only
  for the Fisher pass;
* ``candidates-4k``: the server sends the ``4k`` positions of the largest prior score (its current
  mask's included) and the client measures its Fisher at ``x`` on those positions, zero elsewhere;
  the mask is the top ``k`` among them;
* ``prior`` (``fedfibos-byte-budget > 0``): no extra bytes; the pooled Fisher of the clients that
  can afford a refresh (here the capacity-1 clients, whose refresh costs no download);
* ``magnitude``: ``|x|`` alone.

The exact mask ``S*`` is the top ``k`` of ``F*^2 x^2`` with ``F*`` the client's per-example Fisher
at ``x`` over all its examples (row ``exact``); ``overlap`` is ``|S ∩ S*| / k`` and ``mass kept``
the share of the total ``sum_j F*_j^2 x_j^2`` that ``S`` keeps (one minus the masking surrogate over
its value for the empty mask). ``extra down`` is the refresh's bytes beyond the submodel, and
``rounds per refresh`` how many rounds of a ``1.05`` byte budget's slack (5 % of the share a round)
pay for one. The global model is the CNN after a short central warm-up (a model mid-training). Both
the client's own ranking and the server's test set matter: the per-capacity accuracy of the masks
each option gives, on the server's test set, is ``acc``.

Usage::

    fibos bench-refresh --dataset digits --alpha 0.1 --out results/refresh-options

Writes ``refresh.json`` and ``refresh.csv`` to ``--out`` and prints the table (means over the
clients of each capacity).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_rows import write_rows
from benchmarks.ranking.selection_quality import received_model
from cli.launcher import parse_capacities
from common.data.datasets import load_dataset
from common.data.partitioning import partition_indices
from common.fisher.codec import decode_fisher, encode_fisher
from common.fisher.estimation import example_indices, per_example_fisher
from common.fisher.selection import budget, masking_error, select_mask, topk_mask
from common.fisher.state import FisherState
from common.models.architectures import build_model, load_flat
from common.models.layout import ParamLayout
from common.training.evaluation import evaluate
from common.wire.mask_codec import encode_mask

OPTIONS = ("exact", "own-32", "int8-rest", "candidates-4k", "prior", "magnitude")
BUDGET_SLACK = 0.05  # what a 1.05 byte budget leaves beyond the share, per round


@dataclass(frozen=True)
class Row:
    """One option at one capacity, averaged over that capacity's clients."""

    option: str
    capacity: float
    overlap: float
    mass_kept: float
    accuracy: float
    extra_down_bytes: float
    share_bytes: float
    rounds_per_refresh: float
    clients: int


def int8_rest(x: np.ndarray, mask: np.ndarray, layout: ParamLayout) -> tuple[np.ndarray, int]:
    """``x`` with the positions outside ``mask`` rounded to 8-bit integers, one symmetric scale per
    tensor, and the bytes that copy takes on the wire (one byte per position outside plus a float32
    scale per tensor)."""
    out = x.copy()
    tensors = 0
    bounds = layout.offsets.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        span = slice(start, stop)
        outside = ~mask[span]
        if not outside.any():
            continue
        values = x[span][outside]
        scale = float(np.abs(values).max()) / 127 or 1.0
        out[span][outside] = np.clip(np.round(values / scale), -127, 127).astype(np.float32) * scale
        tensors += 1
    return out, int((~mask).sum()) + 4 * tensors


def _mask_bytes(mask: np.ndarray) -> int:
    return int(encode_mask(mask)[1].nbytes)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", default="digits", help="offline dataset")
    ap.add_argument("--model", default="cnn-bn")
    ap.add_argument(
        "--capacities", default="1,1/4,1/16,1/64", help="the mix, one client each, repeated"
    )
    ap.add_argument("--clients-per-capacity", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    ap.add_argument(
        "--examples", type=int, default=32, help="examples in a client's Fisher estimate"
    )
    ap.add_argument("--warmup-examples", type=int, default=512)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/refresh-options")
    args = ap.parse_args(argv)

    capacities = parse_capacities(args.capacities) * args.clients_per_capacity
    torch.manual_seed(args.seed)
    split = load_dataset(args.dataset, 0.2, args.seed)
    x, layout = received_model(
        args.model, split.train, args.warmup_examples, args.warmup_epochs, args.seed
    )
    model = build_model(args.model, split.train.num_classes, split.train.in_channels, args.seed)
    device = torch.device("cpu")
    whole = np.ones(layout.size, dtype=bool)
    data = [
        split.train.subset(
            partition_indices(
                split.train.y, "dirichlet", len(capacities), i, args.seed, alpha=args.alpha
            )
        )
        for i in range(len(capacities))
    ]

    def fisher(i: int, point: np.ndarray, held: np.ndarray, examples: int) -> np.ndarray:
        idx = example_indices(len(data[i]), examples, args.seed + i)
        return per_example_fisher(model, layout, point, held, data[i], idx, None, device)

    def uploaded(f: np.ndarray, mask: np.ndarray) -> np.ndarray:
        decoded = decode_fisher(encode_fisher(f, mask, layout, "ranked"), mask, layout, "ranked")
        assert decoded is not None
        return decoded

    full = [i for i, g in enumerate(capacities) if g == 1]
    pooled = [
        FisherState.normalise(uploaded(fisher(i, x, whole, args.examples), whole)) for i in full
    ]
    weights = [len(data[i]) for i in full]
    prior = (
        np.average(np.stack(pooled), axis=0, weights=weights) if pooled else np.ones(layout.size)
    ).astype(np.float32)

    def accuracy(mask: np.ndarray) -> float:
        load_flat(model, layout, np.where(mask, x, 0).astype(np.float32))
        return float(evaluate(model, split.test, device)[1])

    per: dict[tuple[str, float], list[dict[str, float]]] = {}
    for i, gamma in enumerate(capacities):
        if gamma >= 1:
            continue
        k = budget(gamma, layout.size)
        # Inert positions (biases feeding a BatchNorm) never take budget: their score must not enter
        # the error.
        exact_f = np.where(layout.inert_mask, 0, fisher(i, x, whole, 0)).astype(np.float32)
        exact = select_mask(layout, x, gamma, "fisher", exact_f, 0, False)
        total = masking_error(exact_f, x, np.zeros(layout.size, dtype=bool))
        current = select_mask(layout, x, gamma, "fisher", prior, 0, False)  # the mask it holds now
        share = 4 * k + _mask_bytes(current)
        masks: dict[str, tuple[np.ndarray, int]] = {"exact": (exact, 4 * (layout.size - k))}
        f = uploaded(fisher(i, x, whole, args.examples), current)
        masks["own-32"] = (
            select_mask(layout, x, gamma, "fisher", f, 0, False),
            4 * (layout.size - k),
        )
        rough, rough_bytes = int8_rest(x, current, layout)
        f = uploaded(fisher(i, rough, whole, args.examples), current)
        masks["int8-rest"] = (select_mask(layout, x, gamma, "fisher", f, 0, False), rough_bytes)
        live_prior = np.where(layout.inert_mask, -1.0, prior.astype(np.float64) * np.abs(x))
        candidates = topk_mask(live_prior, min(layout.size, 4 * k), current)
        f = uploaded(fisher(i, x, candidates, args.examples), current)
        scores = np.where(candidates & ~layout.inert_mask, f.astype(np.float64) * np.abs(x), -1.0)
        masks["candidates-4k"] = (
            topk_mask(scores, k),
            4 * int((candidates & ~current).sum()) + _mask_bytes(candidates),
        )
        masks["prior"] = (current, 0)
        masks["magnitude"] = (select_mask(layout, x, gamma, "magnitude", None, 0, False), 0)
        for option, (mask, extra) in masks.items():
            per.setdefault((option, gamma), []).append(
                {
                    "overlap": float((mask & exact).sum() / k),
                    "kept": 1 - masking_error(exact_f, x, mask) / total if total > 0 else 1.0,
                    "accuracy": accuracy(mask),
                    "extra": float(extra),
                    "share": float(share),
                }
            )
        print(f"client {i} (capacity {gamma:g}, {len(data[i])} examples) measured", flush=True)
    rows = []
    for (option, gamma), vals in sorted(
        per.items(), key=lambda kv: (OPTIONS.index(kv[0][0]), -kv[0][1])
    ):

        def m(key: str, vals: list[dict[str, float]] = vals) -> float:
            return statistics.fmean(v[key] for v in vals)

        slack = BUDGET_SLACK * m("share")
        rows.append(
            Row(
                option,
                gamma,
                m("overlap"),
                m("kept"),
                m("accuracy"),
                m("extra"),
                m("share"),
                m("extra") / slack,
                len(vals),
            )
        )
    out = Path(args.out)
    write_rows(rows, out, "refresh")
    print(table(rows))
    return 0


def table(rows: Sequence[Row]) -> str:
    """Markdown: one line per option and capacity."""
    lines = [
        "| option | capacity | overlap with the exact mask | F^2 x^2 mass kept | acc (server test) "
        "| extra bytes down / share | rounds of 1.05 slack per refresh |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.option} | {r.capacity:g} | {r.overlap:.3f} | {r.mass_kept:.4f} | "
            f"{r.accuracy:.3f} | {r.extra_down_bytes / r.share_bytes:.2f} | "
            f"{r.rounds_per_refresh:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
