"""Human-facing views of metrics.json: a summary table and an accuracy-per-round plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_table(metrics: dict[str, Any]) -> str:
    """Final accuracies and per-client averages over all rounds, as a Markdown table."""
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    if not rounds:
        return "no completed rounds"
    last = rounds[-1]
    g = last["global"]
    lines = [
        f"final global accuracy (full model): {g['accuracy']:.4f}   loss {g['loss']:.4f}",
    ]
    for level, v in g.get("per_capacity", {}).items():
        lines.append(f"  submodel at capacity {level:>7}: accuracy {v['accuracy']:.4f} (density {v['density']:.4f})")
    local = next((r["local"] for r in reversed(rounds) if r.get("local")), None)
    if local:
        lines.append(f"local accuracy (clients' own submodels on their test splits): {local['accuracy']:.4f}")
    lines.append(f"server seconds per round: {_mean([r['server_seconds'] for r in rounds]):.3f}")
    lines.append("")
    lines.append(
        "| node | capacity | device | density | KiB down/round | KiB up/round | train s | Fisher s | replies |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r in rounds:
        for c in r["clients"]:
            by_node.setdefault(c["node_id"], []).append(c)
    for node_id, entries in sorted(by_node.items(), key=lambda kv: -kv[1][0]["capacity"]):
        ok = [e for e in entries if e["status"] == "ok"]
        lines.append(
            f"| {node_id} | {entries[0]['capacity']:g} | {entries[0]['device']} "
            f"| {_mean([e['density'] for e in entries]):.4f} "
            f"| {_mean([e['bytes_down'] for e in entries]) / 1024:.1f} "
            f"| {_mean([e['bytes_up'] for e in ok]) / 1024:.1f} "
            f"| {_mean([e['train_seconds'] for e in ok]):.2f} "
            f"| {_mean([e['fisher_seconds'] for e in ok]):.3f} "
            f"| {len(ok)}/{len(entries)} |"
        )
    return "\n".join(lines)


def write_accuracy_plot(metrics: dict[str, Any], path: Path) -> Path:
    """Global accuracy (full model and per capacity level) and local accuracy per round, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r for r in metrics["rounds"] if r.get("global")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [r["round"] for r in rounds]
    ax.plot(
        xs,
        [r["global"]["accuracy"] for r in rounds],
        "k-o",
        lw=2,
        ms=4,
        label="global (full model)",
    )
    levels = sorted(
        {lv for r in rounds for lv in r["global"].get("per_capacity", {})},
        key=float,
        reverse=True,
    )
    for level in levels:
        pts = [
            (r["round"], r["global"]["per_capacity"][level]["accuracy"])
            for r in rounds
            if level in r["global"].get("per_capacity", {})
        ]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "--",
            lw=1,
            label=f"submodel, capacity {level}",
        )
    local = [(r["round"], r["local"]["accuracy"]) for r in rounds if r.get("local")]
    if local:
        ax.plot(
            [p[0] for p in local],
            [p[1] for p in local],
            "s",
            color="tab:red",
            label="local (clients' test splits)",
        )
    run = metrics.get("run", {})
    ax.set_title(f"{run.get('method', '')} on {run.get('dataset', '')} ({run.get('partitioner', '')})")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
