"""Benchmark: which classes a node holds, read by a curious server from its Fisher upload or its
update.

For each partition and seed: the CNN after a short central warm-up (a model mid-training) is the
global model ``x``; 8 nodes (two each at capacity 1, 1/4, 1/16, 1/64) split the training pool. Each
node's upload is made with the product's own code, as a round would make it:

* ``fedfibos Fisher``: its per-example Fisher at ``x`` on ``fisher-examples`` of its examples,
  encoded ``ranked`` at its mask and decoded as the server decodes it. Under the default byte budget
  only the capacity-1 nodes upload one; under ``fedfibos-byte-budget = 0`` every node does (rows per
  capacity);
* ``fedfibos update``: one local epoch of masked SGD from ``x`` on its mask (capacity 1: everything;
  below: the top of ``F x^2`` by the capacity-1 nodes' pooled Fisher, the default's nested masks);
* ``fedavg update``: the same on the full model.

Two attacks read each upload (:mod:`benchmarks.privacy.label_inference`): ``classifier`` reads the
classifier's rows alone; ``signature`` fits the upload as a mixture of per-class signatures the
server measures at ``x`` on its own test set (per-class Fisher, per-class mean gradient). Each is
scored against the best guess that reads no upload
(:class:`~benchmarks.privacy.label_inference.LeakScore`); a node holds a class when the class is
more than ``--min-share`` of its examples.

With ``--epsilons`` each upload is also made as a node under ``dp-epsilon`` makes it: its local
steps run DP-SGD and its Fisher's per-example gradients are clipped and the sum noised, with the
noise multiplier the node's accountant would choose for a run of ``--dp-rounds`` rounds
(:mod:`common.privacy`); ``0`` is the run without. Differential privacy needs a model without batch
statistics (``--model cnn-gn``, per-example GroupNorm, or ``--model cnn``).

Usage::

    fibos bench-leak --partitions dirichlet:0.1,dirichlet:0.5,pathological:2 --seeds 0,1,2 --out results/leak
    fibos bench-leak --model cnn --epsilons 0,1,4,8 --out results/leak-dp

Writes ``leak.json`` and ``leak.csv`` to ``--out`` and prints the table (means over seeds).
"""  # noqa: E501

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_rows import write_rows
from benchmarks.benchmark import Partition
from benchmarks.privacy.label_inference import (
    LeakScore,
    find_classifier,
    fisher_scores,
    held_from_fisher,
    held_from_shares,
    held_from_update,
    mixture_shares,
    score_attack,
    shares,
    update_scores,
)
from benchmarks.ranking.selection_quality import received_model
from cli.launcher import parse_capacities
from common.data.arrays import ArrayDataset
from common.data.datasets import load_dataset
from common.data.partitioning import partition_indices
from common.fisher.codec import decode_fisher, encode_fisher
from common.fisher.estimation import example_indices, per_example_fisher
from common.fisher.selection import select_mask
from common.fisher.state import FisherState
from common.methods.specs.fisher import FisherOptions
from common.methods.specs.privacy import PrivacyOptions
from common.models.architectures import build_model, load_flat
from common.models.catalog import BATCH_STATISTICS_MODELS
from common.models.layout import ParamLayout
from common.privacy.accountant import calibrate_multiplier
from common.privacy.mechanism import privatise_fisher
from common.privacy.releases import fisher_uploads, node_releases
from common.training.loop import TrainConfig, train_masked

SOURCES = ("fedfibos Fisher", "fedfibos update", "fedavg update")
ATTACKS = ("classifier", "signature")
SIGNATURE_EXAMPLES = 64  # the server's examples per class in a signature


@dataclass(frozen=True, kw_only=True)
class Row(LeakScore):
    """One attack on one partition, over the nodes of one capacity (or all): its score, mean over
    seeds."""

    partition: str
    epsilon: float
    source: str
    attack: str
    capacity: str
    nodes: int


def partition_options(partition: Partition) -> dict[str, float | int]:
    """The keyword of :func:`~common.data.partitioning.partition_indices` that ``partition``
    sets."""
    if partition.kind == "dirichlet":
        return {"alpha": float(partition.value or 0.5)}
    if partition.kind == "pathological":
        return {"classes_per_client": int(partition.value or 2)}
    return {}


def mean_gradient(
    model: torch.nn.Module, layout: ParamLayout, x: np.ndarray, data: ArrayDataset
) -> np.ndarray:
    """The mean gradient of the loss over ``data`` at ``x``, flat in ``layout``'s order."""
    load_flat(model, layout, x)
    model.zero_grad()
    inputs, labels = torch.from_numpy(data.x), torch.from_numpy(data.y)
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    named = dict(model.named_parameters())
    return np.concatenate(
        [named[n].grad.detach().numpy().reshape(-1) for n in layout.names]
    ).astype(np.float64)


def measure(
    dataset: str,
    model_name: str,
    partition: str,
    capacities: Sequence[float],
    seed: int,
    examples: int,
    min_share: float,
    epsilon: float = 0.0,
    dp_rounds: int = 20,
) -> dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per (source, attack, capacity label): inferred held classes, inferred shares and true counts,
    per node.

    ``epsilon`` > 0: each node's uploads under that budget for a run of ``dp_rounds`` rounds (the
    product's default clipping bounds, delta ``1e-5``, the noise multiplier its accountant would
    choose).
    """
    spec = Partition.parse(partition)
    kind, options = spec.kind, partition_options(spec)
    torch.manual_seed(seed)
    split = load_dataset(dataset, 0.2, seed)
    classes = split.train.num_classes
    x, layout = received_model(model_name, split.train, 512, 1, seed)
    model = build_model(model_name, classes, split.train.in_channels, seed)
    classifier = find_classifier(layout, classes)
    device = torch.device("cpu")
    whole = np.ones(layout.size, dtype=bool)
    data = [
        split.train.subset(
            partition_indices(split.train.y, kind, len(capacities), i, seed, **options)
        )
        for i in range(len(capacities))
    ]
    counts = np.stack([np.bincount(d.y, minlength=classes) for d in data])
    dp = PrivacyOptions()
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.1, momentum=0.9, seed=seed, clip_grad_norm=1.0)
    noise = [0.0] * len(data)
    if epsilon > 0:
        fisher = (
            FisherOptions()
        )  # the definition's refreshes: the warm-up, then every `fisher-every` rounds
        uploads = fisher_uploads(dp_rounds, fisher.every, fisher.warmup)
        noise = [
            calibrate_multiplier(
                epsilon, dp.delta, node_releases(len(d), cfg.batch_size, 1, dp_rounds, uploads)
            )
            for d in data
        ]

    def fisher(i: int) -> np.ndarray:
        idx = example_indices(len(data[i]), examples, seed + i)
        if epsilon <= 0:
            return per_example_fisher(model, layout, x, whole, data[i], idx, None, device)
        clipped = per_example_fisher(
            model, layout, x, whole, data[i], idx, None, device, clip_norm=dp.fisher_clip
        )
        return privatise_fisher(clipped, noise[i], dp.fisher_clip, len(idx), seed + i)

    def uploaded(f: np.ndarray, mask: np.ndarray) -> np.ndarray:
        decoded = decode_fisher(encode_fisher(f, mask, layout, "ranked"), mask, layout, "ranked")
        assert decoded is not None
        return decoded

    own = [fisher(i) for i in range(len(capacities))]
    by_class = [
        split.test.subset(np.flatnonzero(split.test.y == c)[:SIGNATURE_EXAMPLES])
        for c in range(classes)
    ]
    fisher_signatures = np.stack(
        [
            per_example_fisher(model, layout, x, whole, d, np.arange(len(d)), None, device)
            for d in by_class
        ]
    )
    gradient_signatures = -np.stack([mean_gradient(model, layout, x, d) for d in by_class])
    full = [i for i, g in enumerate(capacities) if g >= 1]
    prior = np.average(
        np.stack([FisherState.normalise(uploaded(own[i], whole)) for i in full]),
        axis=0,
        weights=[len(data[i]) for i in full],
    )
    # select_mask's "fisher" rule ranks F^2 x^2: the square root of the prior makes it F x^2 (the
    # default power 1).
    masks = [
        whole
        if g >= 1
        else select_mask(layout, x, g, "fisher", np.sqrt(prior).astype(np.float32), 0, False)
        for g in capacities
    ]

    def update(i: int, mask: np.ndarray) -> np.ndarray:
        private = (
            replace(cfg, dp_grad_clip=dp.grad_clip, dp_noise_multiplier=noise[i])
            if epsilon > 0
            else cfg
        )
        trained = train_masked(
            model, layout, x, mask, data[i], private, device, measure_fisher=False
        ).params
        return np.where(mask, trained - x, 0.0)

    found: dict[tuple[str, str, str], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def note(
        source: str, attack: str, label: str, held: np.ndarray, inferred: np.ndarray, i: int
    ) -> None:
        found.setdefault((source, attack, label), []).append((held, inferred, counts[i]))

    for i, gamma in enumerate(capacities):
        label = f"{gamma:g}"
        upload = uploaded(own[i], masks[i])
        scores = fisher_scores(upload, classifier)
        held = held_from_fisher(scores)
        note("fedfibos Fisher", "classifier", label, held, shares(scores, held), i)
        q = mixture_shares(upload, fisher_signatures, masks[i])
        note("fedfibos Fisher", "signature", label, held_from_shares(q, min_share), q, i)
        # At capacity 1 fedfibos trains the whole model, as FedAvg does: one training serves both.
        fedfibos_delta = update(i, masks[i])
        fedavg_delta = fedfibos_delta if masks[i] is whole else update(i, whole)
        for source, mask, delta in (
            ("fedfibos update", masks[i], fedfibos_delta),
            ("fedavg update", whole, fedavg_delta),
        ):
            scores = update_scores(delta, mask, classifier)
            held = held_from_update(scores)
            note(source, "classifier", label, held, shares(scores, held), i)
            q = mixture_shares(-delta, -gradient_signatures, mask)
            note(source, "signature", label, held_from_shares(q, min_share), q, i)
        dp_note = f", epsilon {epsilon:g}, noise multiplier {noise[i]:.2f}" if epsilon > 0 else ""
        print(
            f"  {partition} seed {seed}: node {i} (capacity {label}, {len(data[i])} "
            f"examples{dp_note}) read",
            flush=True,
        )
    out = {
        key: tuple(np.stack(column) for column in zip(*per_node)) for key, per_node in found.items()
    }
    for source in SOURCES:
        for attack in ATTACKS:
            parts = [v for (s, a, _), v in out.items() if (s, a) == (source, attack)]
            out[(source, attack, "all")] = tuple(np.concatenate(column) for column in zip(*parts))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", default="digits", help="offline dataset")
    ap.add_argument("--model", default="cnn-bn")
    ap.add_argument("--partitions", default="dirichlet:0.1,dirichlet:0.5,pathological:2")
    ap.add_argument(
        "--capacities", default="1,1/4,1/16,1/64", help="the mix, one node each, repeated"
    )
    ap.add_argument("--clients-per-capacity", type=int, default=2)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated")
    ap.add_argument(
        "--fisher-examples", type=int, default=32, help="examples in a node's Fisher estimate"
    )
    ap.add_argument(
        "--min-share",
        type=float,
        default=0.05,
        help="a node holds a class above this share of its examples",
    )
    ap.add_argument(
        "--epsilons",
        default="0",
        help="comma-separated dp-epsilon budgets to make the uploads under (0 = no DP)",
    )
    ap.add_argument(
        "--dp-rounds", type=int, default=20, help="the run each budget is spread over (rounds)"
    )
    ap.add_argument("--out", default="results/leak")
    args = ap.parse_args(argv)
    try:
        epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    except ValueError:
        ap.error(f"--epsilons {args.epsilons!r}: give numbers, e.g. 0,1,4,8")
    if not epsilons or any(e < 0 for e in epsilons):
        ap.error(f"--epsilons {args.epsilons!r}: give budgets >= 0 (0 = no DP)")
    if any(e > 0 for e in epsilons) and args.model in BATCH_STATISTICS_MODELS:
        ap.error(
            f"--model {args.model}: normalises by batch statistics; differential privacy needs "
            "--model cnn-gn (or cnn)"
        )
    if args.dp_rounds < 1:
        ap.error(f"--dp-rounds {args.dp_rounds}: give 1 or more")
    if not 0 <= args.min_share < 1:
        ap.error(f"--min-share {args.min_share}: give a share in [0, 1)")
    partitions = [p.strip() for p in args.partitions.split(",") if p.strip()]
    for p in partitions:
        try:
            Partition.parse(p)
        except argparse.ArgumentTypeError as err:
            ap.error(f"--partitions: {err}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    capacities = parse_capacities(args.capacities) * args.clients_per_capacity

    rows = []
    for partition, epsilon in ((p, e) for p in partitions for e in epsilons):
        per_seed: dict[tuple[str, str, str], list[LeakScore]] = {}
        nodes: dict[tuple[str, str, str], int] = {}
        for seed in seeds:
            for key, (held, inferred, counts) in measure(
                args.dataset,
                args.model,
                partition,
                capacities,
                seed,
                args.fisher_examples,
                args.min_share,
                epsilon,
                args.dp_rounds,
            ).items():
                per_seed.setdefault(key, []).append(
                    score_attack(held, inferred, counts, args.min_share)
                )
                nodes[key] = len(counts)
        for (source, attack, capacity), scores in sorted(
            per_seed.items(),
            key=lambda kv: (
                SOURCES.index(kv[0][0]),
                ATTACKS.index(kv[0][1]),
                kv[0][2] != "all",
                -_level(kv[0][2]),
            ),
        ):
            mean = {f: statistics.fmean(getattr(s, f) for s in scores) for f in asdict(scores[0])}
            rows.append(
                Row(
                    **mean,
                    partition=partition,
                    epsilon=epsilon,
                    source=source,
                    attack=attack,
                    capacity=capacity,
                    nodes=nodes[(source, attack, capacity)],
                )
            )
    write_rows(rows, Path(args.out), "leak")
    print(table([r for r in rows if r.capacity == "all"]))
    return 0


def _level(label: str) -> float:
    return float(label) if label != "all" else 2.0


def table(rows: Sequence[Row]) -> str:
    """The Markdown table: each attack against its no-upload guess."""
    lines = [
        "| partition | epsilon | upload | attack | nodes (capacity) | classes right (chance) "
        "| whole set right (chance) | share error, TV (chance) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.partition} | {f'{r.epsilon:g}' if r.epsilon else 'no DP'} | {r.source} | "
            f"{r.attack} | {r.nodes} ({r.capacity}) | {r.membership:.3f} "
            f"({r.membership_chance:.3f}) | {r.exact:.3f} ({r.exact_chance:.3f}) | "
            f"{r.share_error:.3f} ({r.share_error_chance:.3f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
