"""Human-facing views of metrics.json: a summary table and an accuracy-per-round plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.federated_evaluation import global_figures


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_table(metrics: dict[str, Any]) -> str:
    """Final accuracies and per-client averages over all rounds, as a Markdown table."""
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    if not rounds:
        return "no completed rounds"
    g = next((f for f in map(global_figures, reversed(rounds)) if f), None)
    lines = []
    if g is None:
        lines.append("no global figures: no server test set and no evaluation round (eval-every)")
    elif g["accuracy"] is None:
        lines.append(
            "final global accuracy (full model): not measured (no node holds all of it; "
            f"{g['source']})"
        )
    else:
        lines.append(
            f"final global accuracy (full model, {g['source']}): {g['accuracy']:.4f}   loss "
            f"{g['loss']:.4f}"
        )
    for level, v in (g or {}).get("per_capacity", {}).items():
        density = f" (density {v['density']:.4f})" if "density" in v else f" ({v['nodes']} nodes)"
        lines.append(f"  submodel at capacity {level:>7}: accuracy {v['accuracy']:.4f}{density}")
    local = next((r["local"] for r in reversed(rounds) if r.get("local")), None)
    if local:
        lines.append(
            f"local accuracy (clients' own submodels on their test splits): {local['accuracy']:.4f}"
        )
    lines.append(f"server seconds per round: {_mean([r['server_seconds'] for r in rounds]):.3f}")
    lines.append("")
    lines.append(
        "| node | capacity | device | density | KiB down/round | KiB up/round | train s | Fisher s "
        "| replies |"
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

    figures = [(r["round"], f, r) for r in metrics["rounds"] if (f := global_figures(r))]
    source = figures[-1][1]["source"] if figures else "server test set"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    full = [(rnd, f["accuracy"]) for rnd, f, _ in figures if f["accuracy"] is not None]
    ax.plot(
        [p[0] for p in full],
        [p[1] for p in full],
        "k-o",
        lw=2,
        ms=4,
        label=f"global (full model, {source})",
    )
    levels = sorted(
        {lv for _, f, _ in figures for lv in f.get("per_capacity", {})}, key=float, reverse=True
    )
    for level in levels:
        pts = [
            (rnd, f["per_capacity"][level]["accuracy"])
            for rnd, f, _ in figures
            if level in f["per_capacity"]
        ]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "--",
            lw=1,
            label=f"submodel, capacity {level}",
        )
    local = [(r["round"], r["local"]["accuracy"]) for r in metrics["rounds"] if r.get("local")]
    if local:
        ax.plot(
            [p[0] for p in local],
            [p[1] for p in local],
            "s",
            color="tab:red",
            label="local (clients' test splits)",
        )
    run = metrics.get("run", {})
    ax.set_title(
        f"{run.get('method', '')} on {run.get('dataset', '')} ({run.get('partitioner', '')})"
    )
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
