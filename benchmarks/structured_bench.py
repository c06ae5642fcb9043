"""Client-side cost of a CA-HFP (physically smaller) submodel against a FedFIbOS (masked) submodel.

For each model and budget ``gamma`` it measures, on the client's training path
(:func:`common.training.loop.train_small` for the structured submodel,
:func:`common.training.loop.train_masked` with Fisher accumulation for the masked one):

* ``params``: trainable parameters the client allocates and the number it holds;
* ``train GFLOPs/sample``: FLOPs of one training step (forward + backward) divided
  by the batch size, counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matrix multiplications and convolutions; element-wise ops are not counted, so
  the mask multiplications of the masked path are left out in its favour);
* ``fwd GFLOPs/sample``: the same for one forward pass (inference);
* ``train MiB``: peak memory of local training above what the process held just
  before it, over one local epoch after a warm-up epoch (the warm-up pays the
  one-time costs: shared-library pages, kernel selection). On CPU: freed heap
  memory is returned to the OS (glibc ``malloc_trim``), the peak resident set
  size is reset (Linux ``clear_refs`` = 5) right before the epoch, and
  ``VmHWM - VmRSS(before)`` is read after it, in a fresh subprocess per
  configuration that holds only what a client holds (the received arrays, the
  model, the data). This is what the operating system had to provide
  (activations, gradients, optimiser and Fisher buffers, allocator slack);
  tracemalloc would not see PyTorch's allocations. Linux with glibc only. On CUDA:
  ``torch.cuda.max_memory_allocated`` over the epoch minus the memory allocated
  before it;
* ``s/epoch``: wall-clock seconds of one local epoch, the best of ``--repeats``
  epochs after the measured one (the minimum filters out interference from other
  processes on a shared machine), and ``CPU s/epoch``, the process's CPU time for
  the same epoch: with one torch thread it is the compute itself and barely
  depends on how busy the machine is (the wall-clock time does, a lot, on a
  shared machine; ``load_avg_1min`` is recorded with every measurement).

SmallCNN trains on the digits training pool (8x8, 1 channel); ResNet-18 on random
32x32 RGB images (its cost does not depend on the pixel values). Channels of the
structured model are chosen by the first-round rule (weight norm), positions of the
masked model by the Fisher rule with a random Fisher estimate: which positions or
channels are kept does not change the cost.

Usage::

    fibos bench-structured --out docs/structured

Writes ``results.json``, ``results.csv``, ``table.md`` and
``structured_vs_masked.png`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

GAMMAS = ("1", "1/2", "1/4", "1/8", "1/16")
MODELS = {"cnn": "digits (8x8x1)", "resnet18": "random 32x32x3"}


def _data(model: str, examples: int, seed: int):
    from common.data.arrays import ArrayDataset
    from common.data.datasets import load_dataset

    if model == "cnn":
        pool = load_dataset("digits", 0.2, seed).train
        return pool.subset(np.arange(min(examples, len(pool))))
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(examples, 3, 32, 32), dtype=np.uint8)
    return ArrayDataset(x, rng.integers(0, 10, size=examples).astype(np.int64), 10)


def prepare(model: str, gamma: float, variant: str, seed: int, folder: Path) -> Path:
    """What the server would send a client (``variant``: ``structured`` or ``masked``), saved as
    ``.npz``."""
    from common.config.parse import parse_run_config
    from common.fisher.selection import select_mask
    from common.methods.cahfp import CAHFP
    from common.models.architectures import build_model, model_layout, trainable_arrays
    from common.wire import protocol as P

    full = build_model(model, 10, 1 if model == "cnn" else 3, seed)
    layout = model_layout(full)
    x = layout.flatten(trainable_arrays(full))
    path = folder / f"{model}-{gamma:g}-{variant}.npz"
    if variant == "structured":
        server = CAHFP(parse_run_config({"method": "cahfp", "model": model}))
        server.start_server(layout)
        mask, _ = server.mask_for(None, 1, gamma, x)
        np.savez(path, **server.encode(x, mask).records[P.SUBMODEL])
    else:
        fisher = np.abs(np.random.default_rng(seed).normal(size=layout.size)).astype(np.float32)
        mask = select_mask(layout, x, gamma, "fisher", fisher)
        np.savez(path, params=np.where(mask, x, 0).astype(np.float32), mask=mask)
    return path


def _status_mib(field: str) -> float:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _release_and_reset_peak() -> float:
    """Return freed heap memory to the OS, reset the peak RSS; the resident MiB now.

    Without the trim, memory the warm-up epoch freed stays resident in the C
    allocator's free lists and the measured epoch reuses it without growing RSS.
    """
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return rss


def measure(
    model: str, variant: str, payload: Path, examples: int, batch_size: int, seed: int, repeats: int
) -> dict[str, Any]:
    """Cost of local training in this process (run it in a fresh one per configuration)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.models.architectures import build_model, model_layout
    from common.models.structured import build_structured_model
    from common.training.loop import TrainConfig, as_input, attach_masks, train_masked
    from common.training.structured import train_small

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = _data(model, examples, seed)
    arrays = dict(np.load(payload))
    cfg = TrainConfig(
        epochs=1, batch_size=batch_size, lr=0.01, momentum=0.9, fisher_batches=0, seed=seed
    )
    if variant == "structured":
        with torch.device("meta"):
            skeleton = build_model(model, 10, data.in_channels, seed)
        net = build_structured_model(skeleton, arrays).to(device)
        held = allocated = sum(p.numel() for p in net.parameters())

        def epoch() -> None:
            train_small(net, data, cfg, device)

        flop_net = net
    else:
        net = build_model(model, 10, data.in_channels, seed)
        layout = model_layout(net)
        params, mask = arrays["params"], arrays["mask"]
        held, allocated = int(mask.sum()), layout.size

        def epoch() -> None:
            train_masked(net, layout, params, mask, data, cfg, device)

        flop_net = build_model(model, 10, data.in_channels, seed).to(device)
        attach_masks(flop_net, layout, mask)
    epoch()  # warm-up: one-time costs (library pages, kernel selection) are not a round's cost
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        rss_before = _release_and_reset_peak()
    epoch()
    if device.type == "cuda":
        torch.cuda.synchronize()
        train_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        train_mib = _status_mib("VmHWM") - rss_before
    times, cpu_times = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        epoch()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    batch = as_input(torch.from_numpy(data.x[:batch_size]).to(device))
    target = torch.from_numpy(data.y[:batch_size]).to(device)
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            flop_net(batch)
    with FlopCounterMode(display=False) as step:
        torch.nn.functional.cross_entropy(flop_net(batch), target).backward()
    return {
        "params_held": int(held),
        "params_allocated": int(allocated),
        "train_gflops_per_sample": step.get_total_flops() / len(batch) / 1e9,
        "fwd_gflops_per_sample": fwd.get_total_flops() / len(batch) / 1e9,
        "train_mib": train_mib,
        "rss_before_mib": rss_before if device.type == "cpu" else float("nan"),
        "s_per_epoch": min(times),
        "s_per_epoch_median": float(np.median(times)),
        "cpu_s_per_epoch": min(cpu_times),
        "examples": len(data),
        "load_avg_1min": os.getloadavg()[0],  # other processes on the machine slow the timings
        "device": device.type,
        "threads": torch.get_num_threads(),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one line per model and budget, structured next to masked."""
    head = [
        "model",
        "gamma",
        "params held (S / M)",
        "params allocated (S / M)",
        "train GFLOPs/sample (S / M)",
        "fwd GFLOPs/sample (S / M)",
        "train MiB (S / M)",
        "s/epoch (S / M)",
        "CPU s/epoch (S / M)",
        "CPU speed-up",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["model"], r["gamma"], r["variant"]): r for r in rows}
    for model in MODELS:
        for g in GAMMAS:
            s, m = by.get((model, g, "structured")), by.get((model, g, "masked"))
            if s is None or m is None:
                continue

            def pair(key: str, fmt: str, s=s, m=m) -> str:
                return f"{format(s[key], fmt)} / {format(m[key], fmt)}"

            lines.append(
                "| "
                + " | ".join(
                    [
                        model,
                        g,
                        pair("params_held", ","),
                        pair("params_allocated", ","),
                        pair("train_gflops_per_sample", ".4f"),
                        pair("fwd_gflops_per_sample", ".4f"),
                        pair("train_mib", ".1f"),
                        pair("s_per_epoch", ".3f"),
                        pair("cpu_s_per_epoch", ".3f"),
                        f"{m['cpu_s_per_epoch'] / s['cpu_s_per_epoch']:.2f}x",
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Cost against budget, structured vs masked, one row of panels per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (
        ("train_gflops_per_sample", "train GFLOPs / sample"),
        ("train_mib", "training memory (MiB)"),
        ("cpu_s_per_epoch", "CPU seconds / local epoch"),
    )
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(
        len(models), len(metrics), figsize=(13, 3.4 * len(models)), squeeze=False
    )
    for ax_row, model in zip(axes, models):
        for ax, (key, label) in zip(ax_row, metrics):
            for variant, style in (("structured", "o-"), ("masked", "s--")):
                pts = sorted(
                    (float(Fraction(r["gamma"])), r[key])
                    for r in rows
                    if r["model"] == model and r["variant"] == variant
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{variant}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("capacity gamma")
            ax.set_title(f"{model}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos bench-structured``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: cnn, resnet18")
    ap.add_argument(
        "--gammas", default=",".join(GAMMAS), help="comma-separated budgets, fractions allowed"
    )
    ap.add_argument(
        "--cnn-examples", type=int, default=1437, help="digits examples per local epoch (SmallCNN)"
    )
    ap.add_argument(
        "--resnet-examples", type=int, default=64, help="random images per local epoch (ResNet-18)"
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per measurement")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed epochs per configuration (the best is reported)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/structured"))
    ap.add_argument(
        "--one", nargs=3, metavar=("MODEL", "VARIANT", "PAYLOAD"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)

    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        model, variant, payload = args.one
        examples = args.cnn_examples if model == "cnn" else args.resnet_examples
        print(
            json.dumps(
                measure(
                    model,
                    variant,
                    Path(payload),
                    examples,
                    args.batch_size,
                    args.seed,
                    args.repeats,
                )
            )
        )
        return 0

    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    gammas = [g.strip() for g in args.gammas.split(",") if g.strip()]
    for g in gammas:
        if not 0 < Fraction(g) <= 1:
            ap.error(f"--gammas: {g!r} is outside (0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    plan = [(m, g, v) for m in models for g in gammas for v in ("structured", "masked")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, g, variant) in enumerate(plan, 1):
            payload = prepare(model, float(Fraction(g)), variant, args.seed, Path(tmp))
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.structured_bench",
                "--one",
                model,
                variant,
                str(payload),
                "--cnn-examples",
                str(args.cnn_examples),
                "--resnet-examples",
                str(args.resnet_examples),
                "--batch-size",
                str(args.batch_size),
                "--threads",
                str(args.threads),
                "--repeats",
                str(args.repeats),
                "--seed",
                str(args.seed),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                raise RuntimeError(
                    f"measurement {model} gamma={g} {variant} failed (exit {out.returncode})"
                )
            row = {"model": model, "data": MODELS[model], "gamma": g, "variant": variant}
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print(
                f"[{i}/{len(plan)}] {model} gamma={g} {variant}: {row['params_held']:,} params, "
                f"{row['train_gflops_per_sample']:.4f} GFLOPs/sample, {row['train_mib']:.1f} MiB, "
                f"{row['s_per_epoch']:.3f} s/epoch ({row['cpu_s_per_epoch']:.3f} CPU s, "
                f"load {row['load_avg_1min']:.1f}) (elapsed {time.monotonic() - started:.0f} s)",
                flush=True,
            )
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = table(rows)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "table.md").write_text(
        f"Command: `fibos bench-structured {command}`\n\nS = structured (CA-HFP), M = masked "
        f"(FedFIbOS). Device {rows[0]['device']}, {rows[0]['threads']} torch thread(s).\n\n{text}\n"
    )
    png = plot(rows, args.out / "structured_vs_masked.png")
    print()
    print(text)
    print(f"\n{len(plan)} measurements in {time.monotonic() - started:.0f} s -> {args.out}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
