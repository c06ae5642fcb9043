"""Side-by-side benchmark: methods x datasets x partitions x seeds on Flower's Simulation Engine.

Every run is the same ServerApp/ClientApp as a deployment, started by
:func:`cli.launcher.run_local_federation` with ``simulation=True``; only the
method (and optionally the Fisher upload encoding) changes between runs that
share data, partition, seed and capacities.

Usage::

    fibos bench --datasets digits --partitions dirichlet:0.1 --seeds 0,1,2 --out results/bench

Every run uses ``model = "cnn-bn"`` (the CNN with static BatchNorm, which the width methods'
published code assumes) and ``clip-grad-norm = 1`` (their published gradient clipping, for every
method) unless ``-c`` says otherwise; the model without normalisation that earlier results used is
``-c model=cnn``, and ``-c clip-grad-norm=0`` turns clipping off.

A method may carry run-config keys of its own after ``+``: ``fedfibos+fisher-every=1`` is a row of
its own beside ``fedfibos``, which is how one command compares a method's variants (the Fisher
ablation) or runs FedGMR twice: capacity-limited (``fedgmr+capacity-kind=memory``) and as
published (``fedgmr``, whose ``bandwidth`` clients grow to the full model). By default every
method runs, FedGMR both ways.

Every table gives, per capacity level ``g``: ``trained @g``, the mean over the round's clients of
capacity ``g`` of the submodel each of them trains, on the server's test set (the same meaning
for every method); ``extract @g``, the submodel the server would hand a new device of capacity
``g``; ``overlap @g``, the mean Jaccard overlap of a client's mask with its own previous one.
The ``<= capacity`` column says whether every client stayed within its capacity (FedAvg and
bandwidth-kind FedGMR do not: compare them with each other, not with the capacity-limited rows).

Writes ``results.csv`` (one row per run), ``mask_layers.csv`` (positions per tensor of the
submodels at each capacity, last round), ``summary.md`` (mean +- std over seeds),
``accuracy_vs_round.png`` and ``accuracy_vs_bytes.png`` to ``--out`` (and
``accuracy_vs_epsilon.png`` when a method carries ``dp-epsilon``, from
:mod:`benchmarks.privacy.dp_price`), and prints the summary table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.privacy.dp_price import plot_price, price_grid
from benchmarks.time_to_accuracy import accuracy_curve, time_to_target
from cli.launcher import parse_capacities, run_local_federation
from common.config.parse import RENAMED_KEYS, config_from_flat, parse_run_config
from common.config.run import RunConfig
from common.config.schema import ConfigError
from common.fisher.codec import FISHER_ENCODINGS
from common.methods import method_spec, registry
from common.wire.byte_budget import BYTES_SLACK, byte_ratios

HIGHLIGHT = RunConfig.model_fields[
    "method"
].default  # the product's method: drawn thicker in the plots
DEFAULT_MIX = "1,1/4,1/16,1/64"  # FIARSE-like: equal numbers of clients at each capacity
# A client "stays within its capacity" while its submodel's density is at most this much above it
# (rounding of channel counts and the always-kept tensors add a little).
CAPACITY_SLACK = 1.25
# Every method on the BatchNorm CNN with the width methods' published gradient clipping, so no
# method is handicapped by the recipe of another (FedAvg on cnn-bn diverges at lr 0.1 without
# clipping).
BENCH_DEFAULTS: dict[str, Any] = {"model": "cnn-bn", "clip-grad-norm": 1.0}
# Run-config keys each run takes from a command-line flag (a -c override of one is refused).
FLAG_KEYS: dict[str, str] = {
    "method": "--methods",
    "dataset": "--datasets",
    "seed": "--seeds",
    "num-rounds": "--rounds",
    "fisher-encoding": "--fisher-encodings",
    "partitioner": "--partitions",
    "dirichlet-alpha": "--partitions",
    "classes-per-client": "--partitions",
    "capacity-mix": "--capacities",
}


@dataclass(frozen=True)
class Partition:
    """A partition spec: ``iid``, ``dirichlet:<alpha>`` or ``pathological:<classes per client>``."""

    kind: str
    value: float | None = None

    @classmethod
    def parse(cls, text: str) -> Partition:
        kind, _, value = text.partition(":")
        if kind == "iid" and not value:
            return cls("iid")
        if kind in ("dirichlet", "pathological") and value:
            return cls(kind, float(value))
        raise argparse.ArgumentTypeError(
            f"partition {text!r}: use iid, dirichlet:<alpha> or pathological:<k>"
        )

    @property
    def label(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value:g}"

    def run_config(self) -> dict[str, Any]:
        """Run-config keys for this partition."""
        if self.kind == "dirichlet":
            return {"partitioner": "dirichlet", "dirichlet-alpha": self.value}
        if self.kind == "pathological":
            return {"partitioner": "pathological", "classes-per-client": int(self.value)}
        return {"partitioner": "iid"}


@dataclass(frozen=True)
class MethodSpec:
    """A method and the run-config keys of this row: ``name`` or ``name+key=value+key=value``."""

    name: str
    overrides: dict[str, Any]
    label: str

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        from cli.launcher import parse_overrides

        name, *pairs = text.split("+")
        if not name or any("=" not in p for p in pairs):
            raise argparse.ArgumentTypeError(
                f"method {text!r}: use <method> or <method>+<key>=<value>[+...]"
            )
        overrides = parse_overrides(pairs)
        for key in overrides:
            if key in FLAG_KEYS:
                raise argparse.ArgumentTypeError(
                    f"method {text!r}: {key} comes from {FLAG_KEYS[key]}"
                )
        return cls(name, overrides, text)


def upload_encoding(run: RunConfig) -> str:
    """The Fisher encoding the run's clients upload (``none`` for a method that reads no Fisher)."""
    return method_spec(run.method).upload_encoding(run)


def default_methods() -> list[str]:
    """Every registered method, each followed by its own ``bench_variants``."""
    return [
        spec
        for name, cls in registry().items()
        for spec in (name, *(f"{name}+{v}" for v in cls.bench_variants))
    ]


#: Rounds averaged in ``global_acc_last``: with a sample of the clients per round the final round's
#: accuracy swings by several points from round to round, so the table also gives the mean over the
#: last rounds.
LAST_ROUNDS = 5


def cluster_ari(clusters: dict[str, Any], node_groups: int) -> float:
    """The adjusted Rand index of a run's last clusters (a round record's ``clusters``; an
    unplaced client counts in the first) against its true groups (partition ``p`` in group
    ``p mod node_groups``); NaN without partition keys."""
    from sklearn.metrics import adjusted_rand_score

    placed = {**{k: 0 for k in clusters["unplaced"]}, **clusters["of"]}
    pairs = [
        (int(k.removeprefix("partition-")) % node_groups, c)
        for k, c in placed.items()
        if k.removeprefix("partition-").isdigit()
    ]
    if not pairs:
        return float("nan")
    truth, found = zip(*pairs, strict=True)
    return float(adjusted_rand_score(truth, found))


def run_row(
    metrics: dict[str, Any], wall: float, target_acc: float = 0.8, label: str | None = None
) -> dict[str, Any]:
    """One results.csv row from a run's metrics.json (``s_to_target_acc``: seconds to
    ``target_acc``).

    ``global_acc`` is the full model after the last round; ``global_acc_last`` its mean over the
    last :data:`LAST_ROUNDS` rounds (fewer in a shorter run). ``label`` names the row's method (a
    :class:`MethodSpec` label; default the run's method). Per capacity level: ``trained_cap_*`` (the
    clients' own submodels, last evaluated round), ``acc_cap_*`` (the server's extraction),
    ``overlap_cap_*`` (mean mask overlap with the client's previous mask, every round it was known),
    ``overlap_min_cap_*`` (the lowest round mean of it from round 2 on: the round a refresh moved
    the masks), ``local_cap_*`` (the clients' own submodels on their own test splits, last evaluated
    round), ``adapted_cap_*`` (the same after ``adapt-steps`` local steps, when the run adapts),
    ``bytes_ratio_cap_*`` (the largest, over the level's clients, of bytes down or up over the run
    divided by the bytes of the submodels it trained: :func:`run_byte_ratios`); ``within_capacity``:
    no client's submodel exceeded :data:`CAPACITY_SLACK` times its capacity, and none moved more
    than :data:`~common.wire.byte_budget.BYTES_SLACK` times its submodels' bytes.
    """
    run = metrics["run"]
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    last = rounds[-1]["global"]
    clients = [c for r in rounds for c in r["clients"]]
    ok = [c for c in clients if c["status"] == "ok"]
    local = next((r["local"] for r in reversed(rounds) if r.get("local")), None)
    reach = time_to_target(*accuracy_curve(metrics["rounds"]), target_acc)

    def mean(key: str, items: list[dict[str, Any]]) -> float:
        vals = [c[key] for c in items if c.get(key) is not None]
        return statistics.fmean(vals) if vals else float("nan")

    row = {
        "method": label or run["method"],
        "dataset": run["dataset"],
        "partition": run["partitioner"]
        + (f":{run['dirichlet_alpha']:g}" if run["partitioner"] == "dirichlet" else "")
        + (f":{run['classes_per_client']}" if run["partitioner"] == "pathological" else ""),
        "seed": run["seed"],
        "fisher_encoding": run.get("upload_encoding") or upload_encoding(config_from_flat(run)),
        "rounds": len(rounds),
        "global_acc": last["accuracy"],
        "global_acc_last": statistics.fmean(r["global"]["accuracy"] for r in rounds[-LAST_ROUNDS:]),
        "local_acc": local["accuracy"] if local else float("nan"),
        "kib_down_per_client_round": mean("bytes_down", clients) / 1024,
        "kib_up_per_client_round": mean("bytes_up", ok) / 1024,
        "client_train_s": mean("train_seconds", ok),
        "client_fisher_s": mean("fisher_seconds", ok),
        "client_peak_mib": max(
            (c["peak_rss_mib"] for c in ok if c.get("peak_rss_mib") is not None),
            default=float("nan"),
        ),
        "server_s_per_round": statistics.fmean(r["server_seconds"] for r in rounds),
        "wall_s": wall,
        "s_to_target_acc": float("nan") if reach is None else reach,
    }
    clusters = rounds[-1].get("clusters")
    if clusters:  # cluster-by: how many clusters, and how well they match the fleet's groups
        row["clusters"] = len(clusters["sizes"])
        row["cluster_ari"] = cluster_ari(clusters, int(run.get("node_groups", 1)))
    for level, v in last.get("per_capacity", {}).items():
        row[f"acc_cap_{level}"] = v["accuracy"]
    trained = next(
        (
            r["global"]["trained_per_capacity"]
            for r in reversed(rounds)
            if r["global"].get("trained_per_capacity")
        ),
        {},
    )
    for level, v in trained.items():
        row[f"trained_cap_{level}"] = v["accuracy"]
    # what a device's owner sees: its own submodel on its own test split, per capacity (last
    # evaluated round)
    own = next(
        (
            r["federated"]["per_capacity"]
            for r in reversed(rounds)
            if (r.get("federated") or {}).get("per_capacity")
        ),
        {},
    )
    for level, v in own.items():
        row[f"local_cap_{level}"] = v["accuracy"]
        if (
            "adapted_accuracy" in v
        ):  # adapt-steps: the same after the client adapted it on its own data
            row[f"adapted_cap_{level}"] = v["adapted_accuracy"]
    for level in {c["capacity"] for c in clients if c.get("capacity") is not None}:
        per_round = [
            [
                c["mask_overlap"]
                for c in r["clients"]
                if c.get("capacity") == level and c.get("mask_overlap") is not None
            ]
            for r in rounds
        ]
        overlaps = [v for vals in per_round for v in vals]
        if overlaps:
            row[f"overlap_cap_{level:g}"] = statistics.fmean(overlaps)
        later = [
            statistics.fmean(vals) for r, vals in zip(rounds, per_round) if vals and r["round"] > 1
        ]
        if later:  # round 1 compares with the warm-up's (magnitude-ranked) mask
            row[f"overlap_min_cap_{level:g}"] = min(later)
    sized = [c for c in clients if c.get("capacity") is not None and c.get("density") is not None]
    ratios = run_byte_ratios(metrics)
    for level in sorted({cap for _, _, cap in ratios.values()}, reverse=True):
        row[f"bytes_ratio_cap_{level:g}"] = max(
            max(dn, up) for dn, up, cap in ratios.values() if cap == level
        )
    row["within_capacity"] = (
        all(c["density"] <= CAPACITY_SLACK * c["capacity"] for c in sized)
        and all(max(dn, up) <= BYTES_SLACK for dn, up, _ in ratios.values())
        if sized
        else float("nan")
    )
    # traffic and step time per capacity level: what a device of that size pays (CSV only, not the
    # summary)
    for level in sorted(
        {c["capacity"] for c in clients if c.get("capacity") is not None}, reverse=True
    ):
        row[f"kib_down_cap_{level:g}"] = (
            mean("bytes_down", [c for c in clients if c.get("capacity") == level]) / 1024
        )
        row[f"kib_up_cap_{level:g}"] = (
            mean("bytes_up", [c for c in ok if c.get("capacity") == level]) / 1024
        )

    def per_step(c: dict[str, Any]) -> float | None:
        if c.get("train_seconds") is None or not c.get("num_examples") or "batch_size" not in run:
            return None
        return c["train_seconds"] / (
            run["local_epochs"] * math.ceil(c["num_examples"] / run["batch_size"])
        )

    steps = [s for s in map(per_step, ok) if s is not None]
    row["client_s_per_step"] = statistics.fmean(steps) if steps else float("nan")
    # what a capacity saves on the device: seconds per local step and peak resident memory, per
    # level
    for level in sorted({c["capacity"] for c in ok if c.get("capacity") is not None}, reverse=True):
        mine = [c for c in ok if c.get("capacity") == level]
        level_steps = [s for s in map(per_step, mine) if s is not None]
        row[f"s_per_step_cap_{level:g}"] = (
            statistics.fmean(level_steps) if level_steps else float("nan")
        )
        row[f"peak_mib_cap_{level:g}"] = max(
            (c["peak_rss_mib"] for c in mine if c.get("peak_rss_mib") is not None),
            default=float("nan"),
        )
    return row


def run_byte_ratios(metrics: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Per client of a run: its bytes down and up over the run against its submodels' bytes, and its
    capacity.

    Round 0's messages (the opening, a warm-up) count as bytes without a share
    (:func:`byte_ratios`). Records without a client's capacity, positions or mask bytes give nothing
    (``{}``).
    """
    needed = ("capacity", "selected", "density", "bytes_down", "mask_bytes")
    entries: list[dict[str, Any]] = []
    for r in metrics["rounds"]:
        if r["round"] > 0:
            entries += r["clients"]
            continue
        opening = list(r.get("clients", [])) + list(
            (r.get("fisher_warmup") or {}).get("clients", [])
        )
        entries += [dict(c, train=False) for c in opening]
    if not entries or any(c.get(key) is None for c in entries for key in needed):
        return {}
    sized = next((c for c in entries if c.get("train", True) and c["density"] > 0), None)
    if sized is None:
        return {}
    return byte_ratios(entries, round(sized["selected"] / sized["density"]))


def curves(metrics: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    """Rounds, global accuracy per round and cumulative MiB moved (down + up, all clients)."""
    xs, acc, mib = [], [], []
    total = 0.0
    for r in metrics["rounds"]:
        total += sum(c["bytes_down"] + c["bytes_up"] for c in r["clients"]) / 2**20
        xs.append(r["round"])
        acc.append(r["global"]["accuracy"])
        mib.append(total)
    return xs, acc, mib


def worst_bytes_ratio(rows: list[dict[str, Any]]) -> tuple[float, str] | None:
    """The largest ``bytes_ratio_cap_*`` of ``rows`` (results rows, or results.csv's strings) and
    its capacity level; ``None`` when no row has one."""
    found = [
        (float(v), k.removeprefix("bytes_ratio_cap_"))
        for row in rows
        for k, v in row.items()
        if k.startswith("bytes_ratio_cap_") and v not in (None, "") and float(v) == float(v)
    ]
    return max(found, default=None)


def stayed_within(rows: list[dict[str, Any]]) -> bool:
    """Whether every run of ``rows`` stayed within capacity (``within_capacity``, a bool or
    results.csv's string)."""
    return all(r.get("within_capacity") in (True, "True") for r in rows)


def summarise(rows: list[dict[str, Any]]) -> str:
    """Markdown table: mean +- std over seeds per (dataset, partition, method, encoding).

    Per capacity level below 1 (level 1 is the full model, ``global acc``): the clients' trained
    submodels, the server's extraction and the mask overlap, each where some run reports it.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(
            (row["dataset"], row["partition"], row["method"], row["fisher_encoding"]), []
        ).append(row)

    def levels(prefix: str, full: bool = False) -> list[str]:
        found = {k[len(prefix) :] for row in rows for k in row if k.startswith(prefix)}
        return sorted((lv for lv in found if full or float(lv) < 1), key=float, reverse=True)

    trained, extracted, local = levels("trained_cap_"), levels("acc_cap_"), levels("local_cap_")
    adapted = levels("adapted_cap_", full=True)  # the full model adapts too
    overlap, lowest = levels("overlap_cap_"), levels("overlap_min_cap_")

    def ms(vals: list[float], scale: float = 1.0, digits: int = 3) -> str:
        vals = [v * scale for v in vals if v == v]
        if not vals:
            return "-"
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.fmean(vals):.{digits}f} ± {sd:.{digits}f}"

    def within(group: list[dict[str, Any]]) -> str:
        flags = [g.get("within_capacity") for g in group]
        flags = [
            f if isinstance(f, bool) else str(f) == "True"
            for f in flags
            if f is not None and f == f and f != ""
        ]
        if not flags:
            return "-"
        if all(flags):
            return "yes"
        worst = worst_bytes_ratio(group)
        if worst is None or worst[0] <= BYTES_SLACK:
            return "no"
        return f"no ({worst[0]:.1f}x bytes @{worst[1]})"

    head = ["dataset", "partition", "method", "Fisher enc.", "≤ capacity", "seeds", "global acc"]
    head += [f"last {LAST_ROUNDS} rounds"]
    head += [f"trained @{lv}" for lv in trained] + [f"extract @{lv}" for lv in extracted]
    head += [f"local @{lv}" for lv in local] + [f"adapted @{lv}" for lv in adapted]
    head += [f"overlap @{lv}" for lv in overlap] + [f"min overlap @{lv}" for lv in lowest]
    head += ["local acc", "KiB down", "KiB up", "train s", "Fisher s", "server s/round"]
    # runs made before clients reported their peak memory have none; the column appears once one
    # does
    with_peak = any(math.isfinite(row.get("client_peak_mib", float("nan"))) for row in rows)
    if with_peak:
        head.append("client peak MiB")
    with_clusters = any("cluster_ari" in row for row in rows)
    if with_clusters:
        head += ["clusters", "cluster ARI"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (dataset, partition, method, enc), group in sorted(groups.items()):
        cells = [
            dataset,
            partition,
            method,
            enc,
            within(group),
            str(len(group)),
            ms([g["global_acc"] for g in group]),
        ]
        cells.append(ms([g.get("global_acc_last", float("nan")) for g in group]))
        cells += [ms([g.get(f"trained_cap_{lv}", float("nan")) for g in group]) for lv in trained]
        cells += [ms([g.get(f"acc_cap_{lv}", float("nan")) for g in group]) for lv in extracted]
        cells += [ms([g.get(f"local_cap_{lv}", float("nan")) for g in group]) for lv in local]
        cells += [ms([g.get(f"adapted_cap_{lv}", float("nan")) for g in group]) for lv in adapted]
        cells += [
            ms([g.get(f"overlap_cap_{lv}", float("nan")) for g in group], digits=2)
            for lv in overlap
        ]
        cells += [
            ms([g.get(f"overlap_min_cap_{lv}", float("nan")) for g in group], digits=2)
            for lv in lowest
        ]
        cells += [
            ms([g["local_acc"] for g in group]),
            ms([g["kib_down_per_client_round"] for g in group], digits=1),
            ms([g["kib_up_per_client_round"] for g in group], digits=1),
            ms([g["client_train_s"] for g in group], digits=2),
            ms([g["client_fisher_s"] for g in group], digits=3),
            ms([g["server_s_per_round"] for g in group], digits=2),
        ]
        if with_peak:
            cells.append(ms([g.get("client_peak_mib", float("nan")) for g in group], digits=0))
        if with_clusters:
            cells.append(ms([float(g.get("clusters", float("nan"))) for g in group], digits=1))
            cells.append(ms([float(g.get("cluster_ari", float("nan"))) for g in group]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[tuple[dict[str, Any], dict[str, Any]]], out: Path) -> list[Path]:
    """Accuracy vs round and vs cumulative bytes, one panel per dataset x partition, mean over
    seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(row["dataset"], row["partition"]) for row, _ in runs})
    paths = []
    for kind, xlabel in (("round", "round"), ("bytes", "cumulative MiB (down + up, all clients)")):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
        for ax, (dataset, partition) in zip(axes[0], panels):
            series: dict[str, list[tuple[list, list, list]]] = {}
            for row, metrics in runs:
                if (row["dataset"], row["partition"]) == (dataset, partition):
                    label = row["method"] + encoding_tag(row)
                    series.setdefault(label, []).append(curves(metrics))
            for label, cs in sorted(series.items()):
                n = min(len(c[0]) for c in cs)
                acc = [statistics.fmean(c[1][i] for c in cs) for i in range(n)]
                x = (
                    cs[0][0][:n]
                    if kind == "round"
                    else [statistics.fmean(c[2][i] for c in cs) for i in range(n)]
                )
                ax.plot(
                    x, acc, marker="o", ms=2.5, lw=2.5 if label == HIGHLIGHT else 1.5, label=label
                )
            ax.set_title(f"{dataset}, {partition}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("global test accuracy (full model)")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / f"accuracy_vs_{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    grid = price_grid([row for row, _ in runs], tag=encoding_tag)
    if grid:
        paths.append(plot_price(grid, out / "accuracy_vs_epsilon.png"))
    return paths


def encoding_tag(row: dict[str, Any]) -> str:
    """A run's Fisher upload encoding as its plots name it: `` (ranked)``, or ``""`` for a run
    that uploads none or the plain masked one."""
    encoding = row["fisher_encoding"]
    return "" if encoding in ("none", "masked") else f" ({encoding})"


def settings_differ(cfg: dict[str, Any], stored: dict[str, Any]) -> str:
    """The planned run-config keys whose value differs from a stored run's settings (``""`` when
    none).

    A run stored before a key was renamed (:data:`~common.config.parse.RENAMED_KEYS`) is read under
    the new name.
    """
    planned = parse_run_config(cfg).flat()
    diffs = []
    for key in sorted(cfg):
        attr = key.replace("-", "_")
        value = stored.get(attr)
        if attr not in stored:
            old = [o.replace("-", "_") for o, new in RENAMED_KEYS.items() if new == key]
            value = next((stored[o] for o in old if o in stored), None)
        if value != planned[attr]:
            diffs.append(f"{key}: {value!r} stored, {planned[attr]!r} planned")
    return "; ".join(diffs)


def stored_folder(runs: Path, name: str) -> Path:
    """The folder of run ``name``, or the one an earlier release named it by, before its keys were
    renamed."""
    folder = runs / name
    if not folder.exists():
        for old, new in RENAMED_KEYS.items():
            legacy = runs / name.replace(f"+{new}=", f"+{old}=")
            if legacy != folder and legacy.exists():
                return legacy
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``make bench`` / ``fibos bench``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods, each optionally with keys of its own: "
        "`fedfibos+fisher-every=1` (default: every method the model and dataset allow, e.g. no "
        "`lora` on images, and FedGMR also capacity-limited)",
    )
    ap.add_argument("--datasets", default="digits,mnist5k", help="comma-separated datasets")
    ap.add_argument(
        "--partitions",
        default="dirichlet:0.1,dirichlet:0.5,pathological:2",
        help="e.g. iid,dirichlet:0.1",
    )
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument(
        "--capacities", default=DEFAULT_MIX, help=f"capacity of each client (default {DEFAULT_MIX})"
    )
    ap.add_argument(
        "--clients-per-capacity", type=int, default=2, help="clients at each capacity level"
    )
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--fisher-encodings",
        default="ranked",
        help=f"fedfibos uploads to compare: {', '.join(FISHER_ENCODINGS)}",
    )
    ap.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="extra run-config overrides for every run (repeatable)",
    )
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse finished runs found in --out/runs (resume an interrupted matrix)",
    )
    ap.add_argument(
        "--existing-only",
        action="store_true",
        help="with --reuse: only tabulate and plot the finished runs",
    )
    args = ap.parse_args(argv)

    from cli.launcher import parse_overrides

    chosen = (
        args.methods is not None
    )  # a method the user names must run; a default one may not fit the data
    try:
        methods = [
            MethodSpec.parse(m)
            for m in (args.methods.split(",") if chosen else default_methods())
            if m
        ]
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    encodings = [e for e in args.fisher_encodings.split(",") if e]
    partitions = [Partition.parse(p) for p in args.partitions.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    capacities = parse_capacities(args.capacities) * args.clients_per_capacity
    extra = parse_overrides(args.run_config)
    for key, flag in FLAG_KEYS.items():
        if key in extra:  # the flag's value would silently win over the -c key
            ap.error(
                f"-c {key}={extra[key]!r}: the benchmark sets {key} from {flag}; use that instead"
            )
    plan = []
    for dataset in args.datasets.split(","):
        for part in partitions:
            for seed in seeds:
                for method in methods:
                    # fail early, naming the bad key
                    try:
                        probe = parse_run_config(
                            {
                                **BENCH_DEFAULTS,
                                **extra,
                                **method.overrides,
                                "method": method.name,
                                "dataset": dataset,
                            }
                        )
                    except ConfigError as err:
                        if chosen:
                            raise
                        if part is partitions[0] and seed == seeds[0]:
                            print(f"{method.label} left out on {dataset}: {err}", flush=True)
                        continue
                    uploads = upload_encoding(probe) != "none"
                    for enc in encodings if uploads else encodings[:1]:
                        cfg = {
                            **BENCH_DEFAULTS,
                            **extra,
                            **method.overrides,
                            "method": method.name,
                            "dataset": dataset,
                            "seed": seed,
                            "num-rounds": args.rounds,
                            "fisher-encoding": enc,
                            **part.run_config(),
                        }
                        parse_run_config(cfg)  # fail before the first run, naming the bad key
                        name = f"{dataset}-{part.label.replace(':', '')}-s{seed}-{method.label}" + (
                            f"-{enc}" if uploads and len(encodings) > 1 else ""
                        )
                        plan.append((name, cfg, method.label))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps([n for n, _, _ in plan], indent=1))
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    failed: list[str] = []
    started = time.monotonic()
    for i, (name, cfg, label) in enumerate(plan, 1):
        folder = stored_folder(args.out / "runs", name) if args.reuse else args.out / "runs" / name
        if args.reuse and (folder / "model.pt").exists():
            metrics = json.loads((folder / "metrics.json").read_text())
            differs = settings_differ(cfg, metrics["run"])
            if not differs:
                runs.append((run_row(metrics, float("nan"), label=label), metrics))
                print(f"[run {i}/{len(plan)}] {name}: reused", flush=True)
                continue
            print(
                f"[run {i}/{len(plan)}] {name}: stored run has other settings ({differs}), not "
                "reused",
                flush=True,
            )
        if args.existing_only:
            print(f"[run {i}/{len(plan)}] {name}: not run (--existing-only)", flush=True)
            continue
        print(f"[run {i}/{len(plan)}] {name}", flush=True)
        t0 = time.monotonic()
        try:
            metrics = run_local_federation(
                capacities,
                folder,
                cfg,
                timeout=args.timeout,
                echo=lambda line: (
                    print("    " + line, flush=True) if line.startswith("[round") else None
                ),
                simulation=True,
            )
        except (
            RuntimeError,
            TimeoutError,
        ) as err:  # one broken run must not cost the rest of the matrix
            failed.append(name)
            print(
                f"[run {i}/{len(plan)}] {name}: FAILED ({err}); going on with the next run",
                flush=True,
            )
            continue
        row = run_row(metrics, time.monotonic() - t0, label=label)
        runs.append((row, metrics))
        write_results(
            args.out,
            runs,
            argv,
            len(seeds),
            f"{len(capacities)} clients ({args.capacities} x {args.clients_per_capacity}), "
            f"{args.rounds} rounds",
        )  # after every run: nothing lost
        print(
            f"[run {i}/{len(plan)}] {name}: global acc {row['global_acc']:.4f} in "
            f"{row['wall_s']:.0f} s (elapsed {time.monotonic() - started:.0f} s)",
            flush=True,
        )
    table = write_results(
        args.out,
        runs,
        argv,
        len(seeds),
        f"{len(capacities)} clients ({args.capacities} x {args.clients_per_capacity}), "
        f"{args.rounds} rounds",
    )
    paths = plot(runs, args.out) if runs else []  # nothing finished: a table of no rows, no plot
    print()
    print(table)
    print(
        f"\n{len(plan)} runs in {time.monotonic() - started:.0f} s -> {args.out / 'results.csv'}, "
        + ", ".join(str(p) for p in paths)
    )
    if failed:
        print(
            f"{len(failed)} run(s) failed and are not in the table (rerun with --reuse): "
            f"{', '.join(failed)}"
        )
        return 1
    return 0


def mask_layer_rows(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Where each method's submodels sit: mean positions per tensor at each capacity, in the last
    round.

    One row per run and capacity level below 1 (runs whose clients report no ``layer_positions``
    give none).
    """
    out = []
    for row, metrics in runs:
        last = next((r for r in reversed(metrics["rounds"]) if r["round"] > 0), None)
        if last is None:
            continue
        by_level: dict[float, list[dict[str, int]]] = {}
        for c in last["clients"]:
            if c.get("layer_positions") and c.get("capacity") is not None and c["capacity"] < 1:
                by_level.setdefault(c["capacity"], []).append(c["layer_positions"])
        for gamma, counts in sorted(by_level.items(), reverse=True):
            entry = {k: row[k] for k in ("dataset", "partition", "method", "seed")} | {
                "capacity": f"{gamma:g}"
            }
            entry |= {name: statistics.fmean(c[name] for c in counts) for name in counts[0]}
            out.append(entry)
    return out


def write_results(
    out: Path,
    runs: list[tuple[dict[str, Any], dict[str, Any]]],
    argv: Sequence[str] | None,
    seeds: int,
    setup: str,
) -> str:
    """Write results.csv, mask_layers.csv and summary.md for the runs so far; returns the summary
    table."""
    rows = [row for row, _ in runs]
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k.startswith("acc_cap_"), k))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    layers = mask_layer_rows(runs)
    if layers:
        with open(out / "mask_layers.csv", "w", newline="") as f:
            names = list(dict.fromkeys(k for r in layers for k in r))
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(layers)
    table = summarise(rows)
    paired = paired_differences(rows)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    (out / "summary.md").write_text(
        f"Command: `fibos bench {command}`\n\n"
        f"{setup}, Simulation Engine. Mean ± std over up to {seeds} seed(s).\n\n{table}\n"
        + (f"\n{paired}\n" if paired else "")
    )
    return table


#: The figures :func:`paired_differences` compares: the full model, then each capacity's trained
#: submodels.
PAIRED = ("global_acc", "trained_cap_0.25", "trained_cap_0.0625", "trained_cap_0.015625")


def paired_differences(rows: list[dict[str, Any]], reference: str = HIGHLIGHT) -> str:
    """Markdown: ``reference`` minus each other method within capacity, seed by seed, on the same
    data.

    For each dataset and partition where ``reference`` ran, and each other method whose every run
    stayed within capacity (values and bytes), one line per figure of :data:`PAIRED`: the per-seed
    differences (seeds both ran), their mean and how many seeds ``reference`` is ahead. ``""`` when
    there is nothing to compare.
    """
    groups: dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]] = {}
    for row in rows:
        groups.setdefault((row["dataset"], row["partition"]), {}).setdefault(row["method"], {})[
            int(row["seed"])
        ] = row

    lines = []
    for (dataset, partition), methods in sorted(groups.items()):
        mine = methods.get(reference)
        if not mine:
            continue
        for method, theirs in sorted(methods.items()):
            seeds = sorted(set(mine) & set(theirs))
            if method == reference or not seeds or not stayed_within(list(theirs.values())):
                continue
            for key in PAIRED:
                diffs = [
                    float(mine[s].get(key, "nan")) - float(theirs[s].get(key, "nan")) for s in seeds
                ]
                if any(d != d for d in diffs):
                    continue
                wins = sum(d > 0 for d in diffs)
                per_seed = " / ".join(f"{d:+.3f}" for d in diffs)
                label = (
                    "full model"
                    if key == "global_acc"
                    else "trained @" + key.removeprefix("trained_cap_")
                )
                lines.append(
                    f"| {dataset} | {partition} | {method} | {label} | {','.join(map(str, seeds))} "
                    f"| {per_seed} | {statistics.fmean(diffs):+.3f} | {wins} of {len(seeds)} |"
                )
    if not lines:
        return ""
    head = (
        f"{reference} minus each method within capacity, seed by seed:\n\n"
        "| dataset | partition | method | figure | seeds | per seed | mean | seeds ahead |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
