"""Benchmark: the server's work per FedFIbOS round, step by step, against the plainest numpy code for each step.

For every model and number of clients per round, one round of the server's steps
runs in this process on synthetic data of the model's size (global values from
the model's initialisation, heavy-tailed Fisher uploads): ranking each client's
mask, encoding the downloads, validating and decoding the replies (``masked``
Fisher encoding), the mask-aware aggregation, the Fisher-state update, the
trimmed prior and its interval (one sort gives both, as in the strategy), the
certified prior influence, the central-evaluation masks of every capacity level
(once per level, cached as the method caches them) and the checkpoint. Next to each step the same run times
the step's *anchor*, the plainest numpy code that does the same arithmetic
without the product's checks and guarantees (``argpartition`` top-k, a dense
float32 sum of the deltas, ...), so the ratio column does not depend on the
machine. A second table compares each capacity's download with its
information limit ``4k + d H(k/d) / 8`` bytes (``k`` values of 4 bytes and the
entropy of a mask of ``k`` among ``d``).

The state holds at most what ``fisher-memory-mb`` allows (the run config's
default unless ``--fisher-memory-mb``); a configuration whose replies would
not fit in ``--max-memory-gb`` (replies held until aggregation plus the Fisher
state, :func:`round_memory`) is skipped and its estimated need printed.

Usage::

    fibos bench-server --models cnn,resnet18 --clients 10,50,200 --out results/server-bench

Writes ``server_bench.json`` (every step's seconds) and ``server_bench.png``
(server seconds per round against clients, project and anchor) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import aggregate_masked
from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.fisher.codec import encode_fisher
from common.fisher.level_masks import LevelMasks
from common.fisher.prior_influence import contested_by_level, trim_count
from common.fisher.selection import budget, select_mask
from common.fisher.state import FisherState, fisher_capacity
from common.methods import create_method
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.protocol import encode_submodel
from common.wire.validation import ReplyRecords, SentSubmodel, TrainReply
from server.persistence import save_checkpoint

#: (key, label) of the timed steps, in the order a round runs them.
STEPS: tuple[tuple[str, str], ...] = (
    ("select", "select client masks"),
    ("encode", "encode downloads"),
    ("validate", "validate + decode replies"),
    ("aggregate", "aggregate_masked"),
    ("fisher", "Fisher state update"),
    ("prior", "trimmed prior + interval"),
    ("influence", "prior_influence"),
    ("eval_masks", "central-evaluation masks"),
    ("checkpoint", "checkpoint (fsync)"),
)
IN_CHANNELS = {"cnn": 1, "resnet18": 3}


@dataclass
class StepTimes:
    """Seconds of one round's steps: the project's code and the numpy anchor (``None``: no anchor)."""

    project: dict[str, float] = field(default_factory=dict)
    anchor: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)  # checkpoint sizes and the incremental save


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(pairs: Sequence[tuple[Callable[[], object], Callable[[], object]]]) -> tuple[float, float]:
    """Total seconds of the project's and the anchor's calls, timed alternately pair by pair.

    A step done once per client is timed client by client, the project's call and
    then the anchor's, so a burst of load from other work on the machine falls on
    both sides alike instead of on whichever ran during it.
    """
    project = anchor = 0.0
    for run_project, run_anchor in pairs:
        project += timed(run_project)
        anchor += timed(run_anchor)
    return project, anchor


def mask_entropy_bytes(k: int, d: int) -> float:
    """``d H(k/d) / 8``: the information in a mask of ``k`` kept among ``d`` (bytes)."""
    if k in (0, d):
        return 0.0
    p = k / d
    return d * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / 8


def capacities_for(n: int, levels: Sequence[float]) -> list[float]:
    """Client ``i``'s capacity: the levels cycled through."""
    return [levels[i % len(levels)] for i in range(n)]


def round_memory(d: int, levels: Sequence[float], n: int, cfg: RunConfig) -> dict[str, float]:
    """Bytes a round of ``n`` clients holds at its peak (after validation, before aggregation), by part.

    * ``replies``: per client, the mask sent (1 byte per position), the decoded Fisher (4 per position),
      the update's indices (8 per kept position) and its delta (4 per kept position);
    * ``fisher_state``: the stored estimates (``min(n, clients the budget holds)``) and the state's fixed
      12 bytes per position (:func:`common.fisher.state.fisher_capacity`).

    The benchmark shares one delta array between replies of the same size, so it holds a little less
    than ``replies``; a server holds more: the received messages until the round is aggregated.
    """
    kept = [budget(g, d) for g in capacities_for(n, levels)]
    replies = sum(d * (1 + 4) + k * (8 + 4) for k in kept)
    stored = min(n, fisher_capacity(cfg.options("fisher").memory_mb, d, cfg.options("fisher").precision))
    state = stored * d * np.dtype(cfg.options("fisher").precision.replace("fp", "float")).itemsize + 12 * d
    return {"replies": float(replies), "fisher_state": float(state)}


class SyntheticRound:
    """A model's data for the benchmark: global values, a pool of Fisher uploads, reply payloads by size.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    x : NDArray[float32]
        Global values (the model's initialisation).
    pool : int
        Distinct synthetic Fisher uploads; client ``i`` uploads number ``i % pool``.
    seed : int
        Seed of the synthetic data.
    """

    def __init__(self, layout: ParamLayout, x: NDArray[np.float32], pool: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.layout = layout
        self.x = x
        base = rng.lognormal(0.0, 2.0, layout.size).astype(np.float32)
        self.uploads = [base * rng.lognormal(0.0, 0.5, layout.size).astype(np.float32) for _ in range(pool)]
        self.rng = rng
        self._deltas: dict[int, NDArray[np.float32]] = {}

    def delta(self, k: int) -> NDArray[np.float32]:
        """A delta of ``k`` values (shared by every reply of that size: the payload's content is not timed)."""
        if k not in self._deltas:
            self._deltas[k] = (self.rng.standard_normal(k) * 1e-3).astype(np.float32)
        return self._deltas[k]


def run_round(data: SyntheticRound, cfg: RunConfig, n: int, levels: Sequence[float], workdir: Path) -> StepTimes:
    """One round for ``n`` clients, every step timed with its anchor.

    The Fisher state first receives one upload per client (round 1, not timed),
    so the timed round 2 ranks every client by its own estimate, as a running
    federation does.
    """
    layout, x, d = data.layout, data.x, data.layout.size
    state = FisherState(
        d,
        cfg.options("fisher").staleness_decay,
        cfg.options("fisher").ema,
        cfg.options("fisher").trim,
        max_clients=fisher_capacity(cfg.options("fisher").memory_mb, d, cfg.options("fisher").precision),
        precision=cfg.options("fisher").precision,
    )
    caps = capacities_for(n, levels)
    keys = [f"client-{i}" for i in range(n)]
    uploads = [data.uploads[i % len(data.uploads)] for i in range(n)]
    for key, f in zip(keys, uploads):
        state.update(key, f, 100.0, 1)
    rnd = 2
    t = StepTimes()
    absx = np.abs(x)

    masks: list[NDArray[np.bool_]] = []
    levels_cache = LevelMasks()  # as the method keeps it: one prior-ranked mask per level

    def select(key: str, gamma: float) -> None:
        if key in state.clients:
            masks.append(select_mask(layout, x, gamma, "fisher", state.estimate(key, rnd), min_per_row(cfg)))
            return

        def by_prior() -> NDArray[np.bool_]:
            return select_mask(layout, x, gamma, "fisher", state.global_prior(), min_per_row(cfg))

        # Evicted beyond fisher-memory-mb: ranked by the prior, one mask per level, as the method does.
        masks.append(levels_cache.get(x, (state, state.version), gamma, by_prior))

    def select_anchor(f: NDArray[np.float32], gamma: float) -> None:
        k = budget(gamma, d)
        if k < d:
            np.argpartition(f * absx, d - k)[d - k :]

    t.project["select"], t.anchor["select"] = interleaved(
        [(partial(select, key, gamma), partial(select_anchor, f, gamma)) for key, f, gamma in zip(keys, uploads, caps)]
    )

    payloads = []
    t.project["encode"] = timed(lambda: payloads.extend(encode_submodel(x, m) for m in masks))
    t.anchor["encode"] = timed(lambda: [(x[m], np.packbits(m)) for m in masks])

    sent, arrays, fisher_out = [], [], {}
    for i, (m, p) in enumerate(zip(masks, payloads)):
        sent.append(SentSubmodel(i, rnd, m, p.digest, 1000))
        k = int(np.count_nonzero(m))
        key = (i % len(uploads), k)
        if key not in fisher_out:  # reply payloads are shared by clients with the same upload and size
            fisher_out[key] = encode_fisher(uploads[i], m, layout, "masked")
        arrays.append({P.DELTA: data.delta(k), **fisher_out[key]})
    metrics = {"num-examples": 100, "train-loss": 1.0, "train-seconds": 1.0, "fisher-seconds": 0.1}
    replies: list[TrainReply] = []

    method = create_method(parse_run_config({"fisher-encoding": "masked"}))  # decodes the payload encoded above
    method.start_server(layout)

    def validate() -> None:
        for s, a in zip(sent, arrays):
            replies.append(method.validate(ReplyRecords(a, metrics, {"round": rnd, "mask-digest": s.digest}), s, x))

    t.project["validate"] = timed(validate)
    t.anchor["validate"] = None
    arrays.clear()  # the decoded replies hold what the round needs from here on

    updates = [r.update for r in replies]
    t.project["aggregate"] = timed(lambda: aggregate_masked(x, updates, cfg.server_lr))
    dense = np.zeros(d, dtype=np.float32)

    def aggregate_anchor() -> None:
        acc = np.zeros(d, dtype=np.float32)
        for _ in updates:
            acc += dense
        x + acc

    t.anchor["aggregate"] = timed(aggregate_anchor)
    updates.clear()

    acc = np.zeros(d, dtype=np.float32)
    buf = np.empty(d, dtype=np.float32)

    def fisher_anchor(fisher: NDArray[np.float32]) -> None:
        np.multiply(fisher, np.float32(1 / fisher.mean()), out=buf)
        np.add(acc, buf, out=acc)

    steps = []
    for key, r in zip(keys, replies):
        assert r.fisher is not None
        steps.append((partial(state.update, key, r.fisher, r.update.weight, rnd), partial(fisher_anchor, r.fisher)))
    t.project["fisher"], t.anchor["fisher"] = interleaved(steps)
    steps.clear()
    replies.clear()

    intervals: list = []

    def prior() -> None:
        # As in the strategy: the sort behind prior_influence's interval fills the prior too.
        intervals.append(state.prior_interval())
        state.global_prior()

    t.project["prior"] = timed(prior)
    stored = [c.fisher for c in state.clients.values()]
    m = len(stored)
    cut = trim_count(cfg.options("fisher").trim, m)

    def prior_anchor() -> None:
        block = 1 << 20
        for start in range(0, d, block):
            s = np.stack([f[start : start + block] for f in stored])
            if cut:
                s.partition((cut, m - cut - 1), axis=0)
                s[cut : m - cut].mean(axis=0, dtype=np.float64)
            else:
                s.mean(axis=0, dtype=np.float64)

    t.anchor["prior"] = timed(prior_anchor)
    stored.clear()

    below = sorted({g for g in caps if g < 1.0}, reverse=True)

    interval = intervals[0]

    def influence() -> None:
        if interval is not None:
            contested_by_level(layout, x, below, *interval, min_per_row(cfg))

    t.project["influence"] = timed(influence)
    t.anchor["influence"] = None

    def eval_masks() -> None:
        for gamma in sorted(set(caps), reverse=True):

            def by_prior(gamma: float = gamma) -> NDArray[np.bool_]:
                return select_mask(layout, x, gamma, "fisher", state.global_prior(), min_per_row(cfg))

            levels_cache.get(x, (state, state.version), gamma, by_prior)

    def eval_masks_anchor() -> None:
        scores = state.global_prior() * absx
        for gamma in below:
            np.argpartition(scores, d - budget(gamma, d))

    t.project["eval_masks"] = timed(eval_masks)
    t.anchor["eval_masks"] = timed(eval_masks_anchor)

    # A folder of its own: a repeated round would otherwise find its state's chunks stored by the one before.
    folder = Path(tempfile.mkdtemp(dir=workdir))
    path = folder / "checkpoint.npz"
    stored: list[int] = []  # state bytes written by the first checkpoint (all of it: the chunk folder is new)
    t.project["checkpoint"] = timed(lambda: stored.append(save_checkpoint(path, rnd, x, state.to_bytes())))
    size = path.stat().st_size + stored[0]

    def checkpoint_anchor() -> None:
        raw = folder / "raw.bin"
        with open(raw, "wb") as f:
            f.write(x.tobytes())
            for c in state.clients.values():
                f.write(c.fisher.tobytes())
            f.flush()
            os.fsync(f.fileno())

    t.anchor["checkpoint"] = timed(checkpoint_anchor)
    # The next round's checkpoint when one stored client re-uploads: what the incremental layout writes.
    first = next(iter(state.clients))
    state.update(first, data.uploads[-1] * 2.0, 100.0, rnd + 1)
    t0 = time.perf_counter()
    written = save_checkpoint(path, rnd + 1, x, state.to_bytes())
    t.extra = {
        "checkpoint_mb": size / 2**20,
        "incremental_written_mb": written / 2**20,
        "incremental_seconds": time.perf_counter() - t0,
    }
    shutil.rmtree(folder)
    return t


def download_rows(data: SyntheticRound, cfg: RunConfig, levels: Sequence[float]) -> list[dict[str, float | str]]:
    """Per capacity: the download's bytes (values + encoded mask) against ``4k + d H(k/d) / 8``."""
    layout, x, d = data.layout, data.x, data.layout.size
    rows = []
    for gamma in levels:
        mask = select_mask(layout, x, gamma, "fisher", data.uploads[0], min_per_row(cfg))
        p = encode_submodel(x, mask)
        k = int(np.count_nonzero(mask))
        limit = 4 * k + mask_entropy_bytes(k, d)
        rows.append(
            {
                "capacity": gamma,
                "kept": k,
                "mask_kind": p.mask_kind,
                "mask_bytes": int(p.mask_data.nbytes),
                "download_bytes": p.nbytes,
                "limit_bytes": limit,
                "ratio": p.nbytes / limit,
            }
        )
    return rows


def table(results: list[dict], earlier: list[dict] | None = None) -> str:
    """The per-step Markdown table: one block of rows per (model, clients).

    Parameters
    ----------
    results : list[dict]
        This run's rounds (``server_bench.json``'s ``rounds``).
    earlier : list[dict], optional
        An earlier run's rounds: its project seconds and ratio are shown beside this run's, step by step
        (``-`` where it did not measure that model, client count or step).
    """
    before = {(r["model"], r["clients"]): r for r in earlier or [] if "skipped" not in r}
    head = "| model | clients | step | project s | numpy anchor s | ratio |"
    rule = "|---|---|---|---|---|---|"
    if earlier is not None:
        head += " earlier project s | earlier ratio |"
        rule += "---|---|"

    def cells(p: float | None, a: float | None, digits: int) -> tuple[str, str, str]:
        ratio = "-" if p is None or a is None or a <= 0 else f"{p / a:.1f}"
        return ("-" if p is None else f"{p:.{digits}f}", "-" if a is None else f"{a:.{digits}f}", ratio)

    lines = [head, rule]
    for r in results:
        if "skipped" in r:
            tail = " - | - |" if earlier is not None else ""
            lines.append(f"| {r['model']} | {r['clients']} | skipped: {r['skipped']} | - | - | - |{tail}")
            continue
        old = before.get((r["model"], r["clients"]))
        rows = [(label, r["project"][key], r["anchor"][key], key, 3) for key, label in STEPS]
        rows.append(("**whole round**", r["round_project"], r["round_anchor"], None, 2))
        for label, p, a, key, digits in rows:
            project, anchor, ratio = cells(p, a, digits)
            line = f"| {r['model']} | {r['clients']} | {label} | {project} | {anchor} | {ratio} |"
            if earlier is not None:
                if old is None:
                    then = (None, None)
                elif key is None:
                    then = (old["round_project"], old["round_anchor"])
                else:
                    then = (old["project"].get(key), old["anchor"].get(key))
                was, _, was_ratio = cells(*then, digits)
                line += f" {was} | {was_ratio} |"
            lines.append(line)
    return "\n".join(lines)


def scaling_lines(results: list[dict]) -> list[str]:
    """Per model: the least-squares line ``seconds = a + b * clients`` through the measured rounds."""
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        pts = [(r["clients"], r["round_project"]) for r in results if r["model"] == model and "skipped" not in r]
        if len(pts) < 2:
            continue
        b, a = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
        worst = max(abs(s - (a + b * c)) / s for c, s in pts)
        out.append(f"{model}: server seconds per round = {a:.3f} + {b:.4f} x clients (largest deviation {worst:.0%})")
    return out


def plot(results: list[dict], path: Path) -> None:
    """Server seconds per round against clients per round, project and anchor: one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [
        m
        for m in dict.fromkeys(r["model"] for r in results)
        if any(r["model"] == m and "skipped" not in r for r in results)
    ]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model and "skipped" not in r]
        n = [r["clients"] for r in rows]
        ax.plot(n, [r["round_project"] for r in rows], "o-", label="project")
        ax.plot(n, [r["round_anchor"] for r in rows], "s--", alpha=0.7, label="numpy anchor")
        ax.set_title(f"{model} (d = {rows[0]['d']:,})")
        ax.set_xlabel("clients per round")
        ax.set_ylabel("server seconds per round")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,resnet18", help="comma-separated: cnn, resnet18")
    ap.add_argument("--clients", default="10,50,200", help="comma-separated clients per round")
    ap.add_argument(
        "--capacities", default="1,0.25,0.0625,0.015625", help="capacity levels, cycled through the clients"
    )
    ap.add_argument("--fisher-memory-mb", type=float, default=None, help="default: the run config's")
    ap.add_argument("--fisher-precision", default=None, choices=("fp32", "fp16"), help="default: the run config's")
    ap.add_argument(
        "--max-memory-gb", type=float, default=8.0, help="skip rounds whose replies and Fisher state need more (GiB)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds per configuration; each step's fastest is kept")
    ap.add_argument("--pool", type=int, default=4, help="distinct synthetic Fisher uploads cycled through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/server-bench"))
    ap.add_argument(
        "--earlier", type=Path, default=None, help="an earlier server_bench.json, shown beside this run's steps"
    )
    args = ap.parse_args(argv)

    overrides: dict[str, object] = {}
    if args.fisher_memory_mb is not None:
        overrides["fisher-memory-mb"] = args.fisher_memory_mb
    if args.fisher_precision is not None:
        overrides["fisher-precision"] = args.fisher_precision
    cfg = parse_run_config(overrides)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in IN_CHANNELS:
            raise SystemExit(f"--models: unknown model {m!r}; expected some of {sorted(IN_CHANNELS)}")
    clients = [int(c) for c in args.clients.split(",")]
    # Read before anything is written: the earlier file may be the one this run replaces.
    earlier = None if args.earlier is None else json.loads(args.earlier.read_text())["rounds"]
    levels = [float(g) for g in args.capacities.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    downloads: dict[str, list] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for model_name in models:
            model = build_model(model_name, 10, IN_CHANNELS[model_name], args.seed)
            layout = model_layout(model)
            x = layout.flatten(trainable_arrays(model))
            del model
            data = SyntheticRound(layout, x, args.pool, args.seed)
            downloads[model_name] = download_rows(data, cfg, levels)
            for n in clients:
                memory = {k: v / 2**30 for k, v in round_memory(layout.size, levels, n, cfg).items()}
                need = sum(memory.values())
                row: dict = {"model": model_name, "d": layout.size, "clients": n, "memory_gib": memory}
                if need > args.max_memory_gb:
                    row["skipped"] = (
                        f"needs ~{need:.1f} GiB (replies {memory['replies']:.1f}, Fisher state "
                        f"{memory['fisher_state']:.1f}) > --max-memory-gb {args.max_memory_gb:g}"
                    )
                    print(f"{model_name} x {n}: {row['skipped']}", flush=True)
                    results.append(row)
                    continue
                t = run_round(data, cfg, n, levels, Path(tmp))
                for _ in range(args.repeat - 1):  # each step's fastest of the repeats: load spikes only add time
                    again = run_round(data, cfg, n, levels, Path(tmp))
                    t.project = {k: min(v, again.project[k]) for k, v in t.project.items()}
                    t.anchor = {k: None if v is None else min(v, again.anchor[k] or v) for k, v in t.anchor.items()}
                row.update(
                    project=t.project,
                    anchor=t.anchor,
                    **t.extra,
                    round_project=sum(t.project.values()),
                    round_anchor=sum(v for v in t.anchor.values() if v is not None),
                    one_mask_seconds=t.project["select"] / max(1, sum(g < 1 for g in capacities_for(n, levels))),
                )
                results.append(row)
                print(
                    f"{model_name} x {n}: round {row['round_project']:.2f} s (anchor {row['round_anchor']:.2f} s)",
                    flush=True,
                )
    print()
    print(table(results, earlier))
    print()
    for line in scaling_lines(results):
        print(line)
    for r in results:
        if "skipped" not in r:
            print(f"{r['model']} x {r['clients']}: {r['one_mask_seconds']:.3f} s per mask below capacity 1")
    print()
    print("| model | clients | checkpoint MiB | next round, one client re-uploaded: MiB written | seconds |")
    print("|---|---|---|---|---|")
    for r in results:
        if "skipped" not in r:
            print(
                f"| {r['model']} | {r['clients']} | {r['checkpoint_mb']:.0f} | {r['incremental_written_mb']:.0f} | "
                f"{r['incremental_seconds']:.2f} |"
            )
    print()
    print("| model | capacity | kept k | mask kind | mask bytes | download bytes | 4k + d H(k/d)/8 | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for model_name, rows in downloads.items():
        for r in rows:
            print(
                f"| {model_name} | {r['capacity']:g} | {r['kept']:,} | {r['mask_kind']} | {r['mask_bytes']:,} | "
                f"{r['download_bytes']:,} | {r['limit_bytes']:,.0f} | {r['ratio']:.3f} |"
            )
    doc = {
        "command": "fibos bench-server " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {"capacities": levels, "pool": args.pool, "seed": args.seed, "repeat": args.repeat, **overrides},
        "rounds": results,
        "downloads": downloads,
        "scaling": scaling_lines(results),
    }
    (args.out / "server_bench.json").write_text(json.dumps(doc, indent=1))
    plot(results, args.out / "server_bench.png")
    print(f"\nwrote {args.out / 'server_bench.json'} and {args.out / 'server_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def min_per_row(cfg: RunConfig) -> int:
    """The run's ``min-per-row`` guard (a key the Fisher-ranked methods own)."""
    return cfg.options("mask-guards").min_per_row
