"""Benchmark: the server's work per FedFIbOS round, step by step, against the plainest numpy code for each step.

For every model and number of clients per round, one round of the server's steps
runs on synthetic data of the model's size (global values from the model's
initialisation, heavy-tailed Fisher uploads), the way the strategy runs it: each
client's mask is ranked and its download encoded (the round keeps only what it
sent, the mask as packed bits); then the replies are taken one at a time, in the
clients' key order, each validated and decoded (``masked`` Fisher encoding),
added to the method's running sum (:mod:`common.aggregation.running_sums`), its
Fisher folded into the state, and dropped; then the running sum gives the new
model, the trimmed prior and its interval are computed (one sort gives both, as in
the strategy), the certified prior influence, the central-evaluation masks of every
capacity level (once per level, cached as the method caches them) and the
checkpoint. Next to each step the same run times the step's *anchor*, the plainest
numpy code that does the same arithmetic without the product's checks and
guarantees (``argpartition`` top-k, a dense float32 sum of the deltas, ...), so the
ratio column does not depend on the machine. A second table compares each
capacity's download with its information limit ``4k + d H(k/d) / 8`` bytes (``k``
values of 4 bytes and the entropy of a mask of ``k`` among ``d``).

Two kinds of round are timed (``--rounds``, :func:`run_round`): a *refresh* round (every stored client
ranked anew by its own estimate, every reply a Fisher upload) and a *held* round, the steady state
between refreshes with the ``global`` estimator (each stored client's mask held, replies the update
only). Each reply is timed from its bytes as they arrive (Flower ``Array`` records, viewed in place by
:func:`server.replies.record_arrays`). Besides each step's wall-clock seconds the benchmark records the
project's CPU seconds, and the per-client constant: the seconds of the work done once per client,
divided by the clients, and the slope of the whole round between client counts
(:func:`per_client_rows`).

Each configuration runs in a process of its own (forked), whose peak resident
memory is the round's: Python and numpy, the synthetic data, and what the round
holds. The state holds at most what ``fisher-memory-mb`` allows (the run config's
default unless ``--fisher-memory-mb``). Before anything runs, each configuration's
memory is estimated (:func:`round_memory`); if one would not fit in
``--max-memory-gb`` or in the memory the machine has available, the benchmark is
refused with the figure it would need.

Usage::

    fibos bench-server --models cnn,resnet18 --clients 10,50,200 --rounds refresh,held --out results/server-bench

Writes ``server_bench.json`` (every step's seconds, the peak memory) and ``server_bench.png``
(server seconds per round against clients, project and anchor) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
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
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray

from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.fisher.codec import encode_fisher
from common.fisher.held_masks import HeldMasks
from common.fisher.level_masks import LevelMasks
from common.fisher.prior_influence import contested_by_level, trim_count
from common.fisher.selection import budget, select_mask
from common.fisher.state import FisherState, fisher_capacity
from common.methods import create_method
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.training.peak_memory import PeakRSS, current_rss_bytes
from common.wire import protocol as P
from common.wire.mask_codec import ENCODINGS, encode_mask
from common.wire.protocol import encode_submodel
from common.wire.validation import ReplyRecords, SentSubmodel
from server.persistence import save_checkpoint
from server.replies import record_arrays

#: (key, label) of the timed steps, in the order a round runs them.
STEPS: tuple[tuple[str, str], ...] = (
    ("select", "select client masks"),
    ("encode", "encode downloads"),
    ("validate", "validate + decode replies"),
    ("aggregate", "aggregate (running sum)"),
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
    cpu: dict[str, float] = field(default_factory=dict)  # the project's CPU seconds (this process, every thread)
    extra: dict[str, float] = field(default_factory=dict)  # checkpoint sizes and the incremental save


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Laps:
    """Wall-clock and CPU seconds between successive :meth:`lap` calls (CPU: this process's, every thread)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """Seconds (wall, CPU) since the previous lap."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def measure(t: StepTimes, key: str, fn: Callable[[], object]) -> None:
    """``fn()`` timed as the project's step ``key``: wall clock and CPU seconds."""
    clock = Laps()
    fn()
    t.project[key], t.cpu[key] = clock.lap()


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
    """Bytes a round of ``n`` clients holds at its peak besides the process itself, by part.

    * ``sent``: what the round keeps of each download until the reply is folded, the mask as packed bits
      (``d / 8`` bytes a client);
    * ``fold``: the running sum (16 bytes per position: two float64 sums, the most any method's takes), and the
      one reply being folded: its mask unpacked (1 byte per position), its decoded Fisher (4), its Fisher
      payload as received (4 at most), the update's indices (4 per kept position: ``int32``) and its delta as
      received (4 per kept; validation views it, no copy);
    * ``fisher_state``: the stored estimates (``min(n, clients the budget holds)``), the state's fixed
      12 bytes per position (:func:`common.fisher.state.fisher_capacity`) and each stored client's held mask
      (packed bits, ``d / 8`` bytes);
    * ``checkpoint``: the state serialised for the checkpoint (a copy of the stored estimates and held masks).

    Only ``sent`` grows with the clients of the round; the rest is bounded by the model and ``fisher-memory-mb``.
    """
    fisher = cfg.options("fisher")
    kept = max(budget(g, d) for g in levels)
    stored = min(n, fisher_capacity(fisher.memory_mb, d, fisher.precision))
    estimates = stored * d * np.dtype(fisher.precision.replace("fp", "float")).itemsize
    estimates += stored * ((d + 7) // 8)  # the held masks, serialised with the estimates
    return {
        "sent": float(n * ((d + 7) // 8)),
        "fold": float(16 * d + d * (1 + 4 + 4) + kept * (4 + 4)),
        "fisher_state": float(estimates + 12 * d),
        "checkpoint": float(estimates),
    }


def resident_bytes() -> int:
    """This process's resident memory now (bytes; 0 where ``/proc`` is not available)."""
    return current_rss_bytes() or 0


def available_bytes() -> int | None:
    """Memory the machine has available for a new process (``MemAvailable``, bytes; ``None`` without ``/proc``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def in_own_process(fn: Callable[[], StepTimes]) -> tuple[StepTimes, int]:
    """``fn()`` run in a forked process; its result and that process's peak resident memory (bytes).

    The peak is the kernel's high-water mark (``VmHWM``), reset when the process starts
    (``/proc/self/clear_refs``), so it is this configuration's alone, whatever ran before in the parent;
    without ``/proc`` it is sampled (:class:`common.training.peak_memory.PeakRSS`).
    """
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        exact = reset_high_water_mark()
        with PeakRSS() as sampled:
            out = fn()
        send.send((out, high_water_mark() if exact else sampled.peak_bytes))

    proc = ctx.Process(target=child)
    proc.start()
    try:
        out, peak = receive.recv()
    except EOFError as err:
        proc.join()
        raise RuntimeError(f"the benchmark's round process ended with status {proc.exitcode}") from err
    proc.join()
    return out, int(peak)


def reset_high_water_mark() -> bool:
    """Reset this process's peak resident memory to its current one (Linux); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def high_water_mark() -> int:
    """This process's peak resident memory since the last reset (``VmHWM``, bytes)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class SyntheticRound:
    """A model's data for the benchmark: global values, a pool of Fisher uploads, reply payloads by size.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    x : NDArray[float32]
        Global values (the model's initialisation).
    pool : int
        Distinct synthetic Fisher uploads; client ``i``'s estimate is number ``i % pool``, shifted
        (:meth:`estimate`), and its replies carry upload number ``i % pool``.
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

    def estimate(self, i: int) -> NDArray[np.float32]:
        """Client ``i``'s Fisher estimate: upload ``i % pool`` shifted by ``i // pool`` positions (``np.roll``).

        Every client's estimate, and so its Fisher-ranked mask, differs from every other's, as on a real fleet
        (with the pool alone, clients ``pool`` apart would send the same mask, whose code is then looked up).
        """
        upload = self.uploads[i % len(self.uploads)]
        return upload if i < len(self.uploads) else np.roll(upload, i // len(self.uploads))

    def delta(self, k: int) -> NDArray[np.float32]:
        """A delta of ``k`` values (shared by every reply of that size: the payload's content is not timed)."""
        if k not in self._deltas:
            self._deltas[k] = (self.rng.standard_normal(k) * 1e-3).astype(np.float32)
        return self._deltas[k]


#: The round kinds :func:`run_round` times.
ROUND_KINDS: tuple[str, ...] = ("refresh", "held")


def run_round(
    data: SyntheticRound, cfg: RunConfig, n: int, levels: Sequence[float], workdir: Path, kind: str = "refresh"
) -> StepTimes:
    """One round for ``n`` clients, every step timed with its anchor, the replies folded one at a time.

    ``kind``:

    * ``refresh``: the Fisher state first receives one upload per client (round 1, not timed), so the timed
      round 2 ranks every stored client by its own estimate (its mask is then held, as the method holds it), and
      every reply carries a Fisher upload (``masked``), each download the global values outside its mask
      (``fisher-at``). A running federation with the ``global`` estimator splits this work over two rounds (the
      refresh round's downloads still use the held masks; the masks are ranked anew in the round after it), so
      this is the costliest round there is.
    * ``held``: the steady state between refreshes (``fisher-every`` rounds). Round 1's uploads and round 2's
      selection (not timed) leave every stored client a held mask; in the timed round 3 each stored client's
      mask is its held one (:class:`common.fisher.held_masks.HeldMasks`), every other client is ranked by the
      prior (one mask per level), and the replies carry the update only.

    The round starts as the strategy leaves the previous one: the prior (and its interval) computed from the
    state's estimates, so a client beyond the Fisher budget is ranked by a cached prior; the masks' codes
    (:data:`common.wire.mask_codec.ENCODINGS`) known for the held masks only, which the previous round sent, so
    a repeated round finds nothing of its predecessor. Every client's estimate is its own
    (:meth:`SyntheticRound.estimate`), so no two clients are sent the same Fisher-ranked mask.

    The work done once per client (select, encode and what the round keeps of the download, validate, add to
    the running sum, the Fisher state) is also summed by itself, wall clock and CPU, in ``extra``
    (``per_client_seconds``, ``per_client_cpu_seconds``): the per-client constant. A capacity level's
    prior-ranked mask, ranked once per round for all the clients of that level, counts in the round's "select"
    step but not in the per-client constant.
    """
    if kind not in ROUND_KINDS:
        raise ValueError(f"round kind {kind!r}; expected one of {ROUND_KINDS}")
    layout, x, d = data.layout, data.x, data.layout.size
    fisher_keys = cfg.options("fisher")
    guards = mask_guards(cfg)  # read once, as the method keeps them, not inside each timed selection
    state = FisherState(
        d,
        fisher_keys.staleness_decay,
        fisher_keys.ema,
        fisher_keys.trim,
        max_clients=fisher_capacity(fisher_keys.memory_mb, d, fisher_keys.precision),
        precision=fisher_keys.precision,
    )
    caps = capacities_for(n, levels)
    keys = [f"client-{i:06d}" for i in range(n)]  # sorted as the strategy folds them: by client key
    for i, key in enumerate(keys):
        state.update(key, data.estimate(i), 100.0, 1)
    # The round starts with the encodings the previous round left: none of this round's new masks (nor a repeat's).
    ENCODINGS.clear()
    held = HeldMasks(d)  # as the method holds them (``global`` estimator): stamped with the estimate's round
    if kind == "held":
        for key, gamma in zip(keys, caps):  # round 2 (not timed): each stored client's mask ranked, held and sent
            if key in state.clients:
                own = state.clients[key]
                mask = select_mask(layout, x, gamma, "fisher", state.estimate(key, 2), *guards)
                held.put(key, own.round, gamma, mask)
                encode_mask(mask)  # so its code is known, as the round that sent it left it
    rnd = 2 if kind == "refresh" else 3
    uploads = kind == "refresh"
    # The previous round ended as the strategy ends one (``round_entries``, before central evaluation): the trimmed
    # prior and its interval computed from the state's estimates, so the prior is cached when this round's
    # configure ranks the clients beyond the Fisher budget by it. That sort is this round's "prior" step too,
    # once the replies have changed the estimates; it is not charged to the first such client's selection.
    state.prior_interval()
    state.global_prior()
    t = StepTimes()
    for key, _ in STEPS:
        t.project[key], t.anchor[key], t.cpu[key] = 0.0, 0.0, 0.0
    t.anchor["validate"] = t.anchor["influence"] = None
    if not uploads:
        t.anchor["fisher"] = None
    absx = np.abs(x)
    levels_cache = LevelMasks()  # as the method keeps it: one prior-ranked mask per level (the model has changed)

    def select(key: str, gamma: float) -> NDArray[np.bool_]:
        own = state.clients.get(key)
        if own is not None:
            kept = held.get(key, own.round, gamma)
            if kept is not None:
                return kept
            mask = select_mask(layout, x, gamma, "fisher", state.estimate(key, rnd), *guards)
            held.put(key, own.round, gamma, mask)
            return mask

        def by_prior() -> NDArray[np.bool_]:
            return select_mask(layout, x, gamma, "fisher", state.global_prior(), *guards)

        # Evicted beyond fisher-memory-mb: ranked by the prior, one mask per level, as the method does.
        return levels_cache.get(x, (state, state.version), gamma, by_prior)

    def select_anchor(key: str, f: NDArray[np.float32], gamma: float) -> None:
        if kind == "held" and key in state.clients:  # the plainest mask kept between rounds: its packed bits
            np.unpackbits(held.packed(key), count=d).view(np.bool_)
            return
        k = budget(gamma, d)
        if k < d:
            np.argpartition(f * absx, d - k)[d - k :]

    def add(key: str, project: tuple[float, float], anchor: float | None = None, per_client: bool = True) -> None:
        t.project[key] += project[0]
        t.cpu[key] += project[1]
        if per_client:
            t.extra["per_client_seconds"] = t.extra.get("per_client_seconds", 0.0) + project[0]
            t.extra["per_client_cpu_seconds"] = t.extra.get("per_client_cpu_seconds", 0.0) + project[1]
        if anchor is not None:
            t.anchor[key] = (t.anchor[key] or 0.0) + anchor

    # Configure: each client's mask and download; the round keeps what it sent (packed mask) and no download.
    # Each step is timed client by client, the project's call and then the anchor's, so that a burst of load from
    # other work on the machine falls on both sides alike instead of on whichever ran during it.
    sent: list[SentSubmodel] = []
    for i, (key, gamma) in enumerate(zip(keys, caps)):
        misses = levels_cache.misses
        clock = Laps()
        mask = select(key, gamma)
        selected = clock.lap()
        # A level's prior-ranked mask is ranked once per round (a miss), whatever the clients of that level: the
        # round's work, not a client's; later clients of the level look it up (counted per client).
        per_level = levels_cache.misses > misses
        select_anchor(key, data.uploads[i % len(data.uploads)], gamma)
        select_wall = clock.lap()[0]
        payload = encode_submodel(x, mask)
        fisher_at = P.outside_values(x, mask) if uploads else None  # a refresh: the values outside the mask
        sent.append(SentSubmodel(i, rnd, mask, payload.digest, 1000, uploads))
        encoded = clock.lap()
        x[mask], np.packbits(mask)
        if uploads:
            x[~mask]
        add("select", selected, select_wall, per_client=not per_level)
        add("encode", encoded, clock.lap()[0])
        del mask, payload, fisher_at

    # Fold: each reply validated, added to the running sum, its Fisher (if any) into the state, and dropped.
    method = create_method(parse_run_config({"fisher-encoding": "masked"}))  # decodes the payload encoded below
    method.start_server(layout)
    sums = method.running_sum()
    assert sums is not None
    metrics = {"num-examples": 100, "train-loss": 1.0, "train-seconds": 1.0, "fisher-seconds": 0.1}
    fisher_out: dict[tuple[int, int], dict[str, NDArray]] = {}  # payloads shared by replies of one upload and size
    acc = np.zeros(d, dtype=np.float32)  # the anchors' dense float32 sums (12 bytes per position with `dense`, `buf`)
    dense = np.zeros(d, dtype=np.float32)
    buf = np.empty(d, dtype=np.float32)
    for i, (key, s) in enumerate(zip(keys, sent)):
        upload = i % len(data.uploads)
        arrays = {P.DELTA: data.delta(s.kept)}
        if uploads:
            if (upload, s.kept) not in fisher_out:
                fisher_out[(upload, s.kept)] = encode_fisher(data.uploads[upload], s.mask, layout, "masked")
            arrays.update(fisher_out[(upload, s.kept)])
        record = ArrayRecord({name: Array(a) for name, a in arrays.items()})  # the reply as it arrives (bytes)
        del arrays
        clock = Laps()
        records = ReplyRecords(record_arrays(record), metrics, {"round": rnd, "mask-digest": s.digest})
        reply = method.validate(records, s, x)
        validated = clock.lap()
        sums.add(reply.update)
        summed = clock.lap()
        np.add(acc, dense, out=acc)
        sum_anchor = clock.lap()[0]
        add("validate", validated)
        add("aggregate", summed, sum_anchor)
        if uploads:
            assert reply.fisher is not None
            state.update(key, reply.fisher, reply.update.weight, rnd)
            folded = clock.lap()
            np.multiply(reply.fisher, np.float32(1 / reply.fisher.mean()), out=buf)
            np.add(acc, buf, out=acc)
            add("fisher", folded, clock.lap()[0])
        else:
            assert reply.fisher is None
        del reply, records, record  # as the strategy drops each reply once folded
    fisher_out.clear()
    sent.clear()
    clock = Laps()
    sums.apply(x)
    applied = clock.lap()
    x + acc
    add("aggregate", applied, clock.lap()[0], per_client=False)
    del sums, acc, dense, buf

    intervals: list = []

    def prior() -> None:
        # As in the strategy: the sort behind prior_influence's interval fills the prior too.
        intervals.append(state.prior_interval())
        state.global_prior()

    measure(t, "prior", prior)
    stored = [c.fisher for c in state.clients.values()]
    m = len(stored)
    cut = trim_count(fisher_keys.trim, m)

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
            contested_by_level(layout, x, below, *interval, *guards)

    measure(t, "influence", influence)

    def eval_masks() -> None:
        for gamma in sorted(set(caps), reverse=True):

            def by_prior(gamma: float = gamma) -> NDArray[np.bool_]:
                return select_mask(layout, x, gamma, "fisher", state.global_prior(), *guards)

            levels_cache.get(x, (state, state.version), gamma, by_prior)

    def eval_masks_anchor() -> None:
        scores = state.global_prior() * absx
        for gamma in below:
            np.argpartition(scores, d - budget(gamma, d))

    measure(t, "eval_masks", eval_masks)
    t.anchor["eval_masks"] = timed(eval_masks_anchor)

    # A folder of its own: a repeated round would otherwise find its state's chunks stored by the one before.
    folder = Path(tempfile.mkdtemp(dir=workdir))
    path = folder / "checkpoint.npz"
    written: list[int] = []  # state bytes written by the first checkpoint (all of it: the chunk folder is new)

    def state_bytes() -> bytes:
        # As FedFIbOS serialises its state: the Fisher state's npz with the held masks as members after its own.
        return state.to_bytes(extra=held.arrays())

    measure(t, "checkpoint", lambda: written.append(save_checkpoint(path, rnd, x, state_bytes())))
    size = path.stat().st_size + written[0]

    def checkpoint_anchor() -> None:
        raw = folder / "raw.bin"
        with open(raw, "wb") as f:
            f.write(x.tobytes())
            for c in state.clients.values():
                f.write(c.fisher.tobytes())
            for key in state.clients:
                bits = held.packed(key)
                if bits is not None:
                    f.write(bits.tobytes())
            f.flush()
            os.fsync(f.fileno())

    t.anchor["checkpoint"] = timed(checkpoint_anchor)
    # The next round's checkpoint when one stored client re-uploads: what the incremental layout writes.
    first = next(iter(state.clients))
    state.update(first, data.uploads[-1] * 2.0, 100.0, rnd + 1)
    t0 = time.perf_counter()
    again = save_checkpoint(path, rnd + 1, x, state_bytes())
    t.extra.update(
        checkpoint_mb=size / 2**20,
        incremental_written_mb=again / 2**20,
        incremental_seconds=time.perf_counter() - t0,
    )
    shutil.rmtree(folder)
    return t


def repeated_rounds(
    data: SyntheticRound,
    cfg: RunConfig,
    n: int,
    levels: Sequence[float],
    workdir: Path,
    repeat: int,
    kind: str = "refresh",
) -> StepTimes:
    """``repeat`` rounds of :func:`run_round`; each step's fastest (load from other work only adds time)."""
    t = run_round(data, cfg, n, levels, workdir, kind)
    for _ in range(repeat - 1):
        again = run_round(data, cfg, n, levels, workdir, kind)
        t.project = {k: min(v, again.project[k]) for k, v in t.project.items()}
        t.cpu = {k: min(v, again.cpu[k]) for k, v in t.cpu.items()}
        t.anchor = {k: None if v is None else min(v, again.anchor[k] or v) for k, v in t.anchor.items()}
        for k in ("per_client_seconds", "per_client_cpu_seconds"):
            t.extra[k] = min(t.extra[k], again.extra[k])
    return t


def synthetic_memory(d: int, levels: Sequence[float], pool: int) -> dict[str, float]:
    """Bytes of the benchmark's own data: global values, the pool of uploads, a delta and a Fisher payload per size,
    and the anchors' three float32 vectors (none of which a server holds)."""
    kept = sum(budget(g, d) for g in levels)
    return {"synthetic": float(4 * d * (1 + pool) + 4 * kept * (1 + 2 * pool) + 12 * d)}


def kind_of(row: dict) -> str:
    """A result row's round kind (an earlier run's rows, before there were kinds, are refresh rounds)."""
    return row.get("round", "refresh")


def memory_table(results: list[dict]) -> str:
    """Per round: the peak resident memory measured, and the estimate the benchmark checked before it ran."""
    lines = [
        "| model | clients | round | peak RSS GiB | estimated GiB | of which grows with the clients (sent masks) GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r or "peak_rss_gib" not in r:
            continue
        lines.append(
            f"| {r['model']} | {r['clients']} | {kind_of(r)} | {r['peak_rss_gib']:.2f} | {r['estimate_gib']:.2f} | "
            f"{r['memory_gib']['sent']:.3f} |"
        )
    return "\n".join(lines)


def download_rows(data: SyntheticRound, cfg: RunConfig, levels: Sequence[float]) -> list[dict[str, float | str]]:
    """Per capacity: the download's bytes (values + encoded mask) against ``4k + d H(k/d) / 8``."""
    layout, x, d = data.layout, data.x, data.layout.size
    rows = []
    for gamma in levels:
        mask = select_mask(layout, x, gamma, "fisher", data.uploads[0], *mask_guards(cfg))
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
    """The per-step Markdown table: one block of rows per (model, clients, round kind).

    Parameters
    ----------
    results : list[dict]
        This run's rounds (``server_bench.json``'s ``rounds``).
    earlier : list[dict], optional
        An earlier run's rounds: its project seconds and ratio are shown beside this run's, step by step
        (``-`` where it did not measure that model, client count, round kind or step).

    A ``round`` column appears when the rows name their kind (:data:`ROUND_KINDS`).
    """
    before = {(r["model"], r["clients"], kind_of(r)): r for r in earlier or [] if "skipped" not in r}
    kinds = any("round" in r for r in results)
    head = "| model | clients |" + (" round |" if kinds else "") + " step | project s | numpy anchor s | ratio |"
    rule = "|---|---|" + ("---|" if kinds else "") + "---|---|---|---|"
    if earlier is not None:
        head += " earlier project s | earlier ratio |"
        rule += "---|---|"

    def cells(p: float | None, a: float | None, digits: int) -> tuple[str, str, str]:
        ratio = "-" if p is None or a is None or a <= 0 else f"{p / a:.1f}"
        return ("-" if p is None else f"{p:.{digits}f}", "-" if a is None else f"{a:.{digits}f}", ratio)

    lines = [head, rule]
    for r in results:
        lead = f"| {r['model']} | {r['clients']} |" + (f" {kind_of(r)} |" if kinds else "")
        if "skipped" in r:
            tail = " - | - |" if earlier is not None else ""
            lines.append(f"{lead} skipped: {r['skipped']} | - | - | - |{tail}")
            continue
        old = before.get((r["model"], r["clients"], kind_of(r)))
        rows = [(label, r["project"][key], r["anchor"][key], key, 3) for key, label in STEPS]
        rows.append(("**whole round**", r["round_project"], r["round_anchor"], None, 2))
        for label, p, a, key, digits in rows:
            project, anchor, ratio = cells(p, a, digits)
            line = f"{lead} {label} | {project} | {anchor} | {ratio} |"
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
    """Per model (and round kind): the least-squares line ``seconds = a + b * clients`` through the measured rounds."""
    out = []
    for model, kind in dict.fromkeys((r["model"], r.get("round")) for r in results):
        pts = [
            (r["clients"], r["round_project"])
            for r in results
            if r["model"] == model and r.get("round") == kind and "skipped" not in r
        ]
        if len(pts) < 2:
            continue
        b, a = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
        worst = max(abs(s - (a + b * c)) / s for c, s in pts)
        name = model if kind is None else f"{model}, {kind} round"
        out.append(f"{name}: server seconds per round = {a:.3f} + {b:.4f} x clients (largest deviation {worst:.0%})")
    return out


def per_client_rows(results: list[dict]) -> list[dict]:
    """Per model, round kind and client count: the server's seconds per client of the round.

    * ``work``, ``work_cpu``: the steps done once per client (select, encode and keep what was sent, validate,
      the running sum, the Fisher state), wall clock and CPU, divided by the clients: the per-client constant;
    * ``slope``, ``slope_cpu``: the whole round's seconds between this client count and the one before,
      ``(T(n) - T(m)) / (n - m)``: linear time shows as slopes that do not grow with the clients;
    * ``ratio``: the whole round against its numpy anchors.
    """
    out = []
    done = [r for r in results if "skipped" not in r and "per_client_seconds" in r]
    for model, kind in dict.fromkeys((r["model"], kind_of(r)) for r in done):
        prev = None
        for r in sorted((r for r in done if r["model"] == model and kind_of(r) == kind), key=lambda r: r["clients"]):
            n = r["clients"]
            row = {
                "model": model,
                "round": kind,
                "clients": n,
                "work": r["per_client_seconds"] / n,
                "work_cpu": r["per_client_cpu_seconds"] / n,
                "slope": None,
                "slope_cpu": None,
                "ratio": r["round_project"] / r["round_anchor"] if r["round_anchor"] > 0 else None,
            }
            if prev is not None:
                row["slope"] = (r["round_project"] - prev["round_project"]) / (n - prev["clients"])
                row["slope_cpu"] = (r["round_cpu"] - prev["round_cpu"]) / (n - prev["clients"])
            out.append(row)
            prev = r
    return out


def per_client_table(results: list[dict]) -> str:
    """:func:`per_client_rows` as a Markdown table."""

    def f(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [
        "| model | round | clients | per-client steps s / client | CPU s / client | whole round: slope s / client "
        "| CPU slope s / client | whole round / anchor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in per_client_rows(results):
        lines.append(
            f"| {r['model']} | {r['round']} | {r['clients']} | {f(r['work'])} | {f(r['work_cpu'])} | {f(r['slope'])} "
            f"| {f(r['slope_cpu'])} | {f(r['ratio'], 1)} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Server seconds per round against clients per round, project and anchor (and the project's CPU seconds,
    which load from other work on the machine moves less): one panel per model."""
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
        for kind in dict.fromkeys(kind_of(r) for r in rows):
            mine = [r for r in rows if kind_of(r) == kind]
            n = [r["clients"] for r in mine]
            ax.plot(n, [r["round_project"] for r in mine], "o-", label=f"project, {kind} round")
            ax.plot(n, [r["round_anchor"] for r in mine], "s--", alpha=0.7, label=f"numpy anchor, {kind} round")
            if all("round_cpu" in r for r in mine):
                ax.plot(n, [r["round_cpu"] for r in mine], "^:", label=f"project CPU seconds, {kind} round")
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
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="refuse to start when a configuration would need more (GiB; also refused beyond the available memory)",
    )
    ap.add_argument(
        "--rounds",
        default=",".join(ROUND_KINDS),
        help="round kinds, comma-separated: refresh (stored clients ranked anew, every reply a Fisher upload), "
        "held (masks held between refreshes, replies the update only)",
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
    kinds = [k.strip() for k in args.rounds.split(",") if k.strip()]
    for k in kinds:
        if k not in ROUND_KINDS:
            raise SystemExit(f"--rounds: unknown round kind {k!r}; expected some of {list(ROUND_KINDS)}")
    # Read before anything is written: the earlier file may be the one this run replaces.
    earlier = None if args.earlier is None else json.loads(args.earlier.read_text())["rounds"]
    levels = [float(g) for g in args.capacities.split(",")]
    built = {}
    for model_name in models:
        model = build_model(model_name, 10, IN_CHANNELS[model_name], args.seed)
        layout = model_layout(model)
        built[model_name] = (layout, layout.flatten(trainable_arrays(model)))
        del model
    process = resident_bytes()
    available = available_bytes()
    limit = args.max_memory_gb * 2**30 if available is None else min(args.max_memory_gb * 2**30, available)
    needs = {
        (m, n): {
            "process": float(process),
            **synthetic_memory(layout.size, levels, args.pool),
            **round_memory(layout.size, levels, n, cfg),
        }
        for m, (layout, _) in built.items()
        for n in clients
    }
    refused = [
        f"{m} x {n}: needs ~{sum(parts.values()) / 2**30:.1f} GiB ("
        + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.2f}" for k, v in parts.items())
        + ")"
        for (m, n), parts in needs.items()
        if sum(parts.values()) > limit
    ]
    if refused:
        why = f"--max-memory-gb {args.max_memory_gb:g}"
        if available is not None and available < args.max_memory_gb * 2**30:
            why = f"the {available / 2**30:.1f} GiB this machine has available"
        raise SystemExit("refused before any round: more memory than " + why + "\n" + "\n".join(refused))
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    downloads: dict[str, list] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for model_name, (layout, x) in built.items():
            data = SyntheticRound(layout, x, args.pool, args.seed)
            downloads[model_name] = download_rows(data, cfg, levels)
            for kind, n in ((kind, n) for kind in kinds for n in clients):
                need = needs[(model_name, n)]
                row: dict = {
                    "model": model_name,
                    "d": layout.size,
                    "clients": n,
                    "round": kind,
                    "memory_gib": {k: v / 2**30 for k, v in need.items()},
                }
                run = partial(repeated_rounds, data, cfg, n, levels, Path(tmp), args.repeat, kind)
                t, peak = in_own_process(run)
                row.update(
                    project=t.project,
                    anchor=t.anchor,
                    cpu=t.cpu,
                    round_cpu=sum(t.cpu.values()),
                    **t.extra,
                    round_project=sum(t.project.values()),
                    round_anchor=sum(v for v in t.anchor.values() if v is not None),
                    one_mask_seconds=t.project["select"] / max(1, sum(g < 1 for g in capacities_for(n, levels))),
                    peak_rss_gib=peak / 2**30,
                    estimate_gib=sum(need.values()) / 2**30,
                )
                results.append(row)
                print(
                    f"{model_name} x {n}, {kind} round: {row['round_project']:.2f} s, CPU {row['round_cpu']:.2f} s "
                    f"(anchor {row['round_anchor']:.2f} s), per client {row['per_client_seconds'] / n:.3f} s, CPU "
                    f"{row['per_client_cpu_seconds'] / n:.3f} s; peak RSS {row['peak_rss_gib']:.2f} GiB "
                    f"(estimated {row['estimate_gib']:.2f})",
                    flush=True,
                )
            del data
    print()
    print(table(results, earlier))
    print()
    for line in scaling_lines(results):
        print(line)
    print()
    print(per_client_table(results))
    print()
    for r in results:
        if "skipped" not in r:
            print(
                f"{r['model']} x {r['clients']}, {kind_of(r)} round: {r['one_mask_seconds']:.3f} s per mask below "
                "capacity 1"
            )
    print()
    print(memory_table(results))
    print()
    print("| model | clients | round | checkpoint MiB | next round, one client re-uploaded: MiB written | seconds |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "skipped" not in r:
            print(
                f"| {r['model']} | {r['clients']} | {kind_of(r)} | {r['checkpoint_mb']:.0f} | "
                f"{r['incremental_written_mb']:.0f} | {r['incremental_seconds']:.2f} |"
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
        "settings": {
            "capacities": levels,
            "pool": args.pool,
            "seed": args.seed,
            "repeat": args.repeat,
            "rounds": kinds,
            **overrides,
        },
        "rounds": results,
        "downloads": downloads,
        "scaling": scaling_lines(results),
        "per_client": per_client_rows(results),
    }
    (args.out / "server_bench.json").write_text(json.dumps(doc, indent=1))
    plot(results, args.out / "server_bench.png")
    print(f"\nwrote {args.out / 'server_bench.json'} and {args.out / 'server_bench.png'}")
    return 0


def mask_guards(cfg: RunConfig) -> tuple[int, bool]:
    """The run's guards of a Fisher-ranked mask, ``(min-per-row, keep-vectors)``, as the method passes them."""
    guards = cfg.options("mask-guards")
    return guards.min_per_row, guards.keep_vectors


if __name__ == "__main__":
    sys.exit(main())
