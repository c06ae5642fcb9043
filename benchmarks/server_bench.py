"""Benchmark: the server's work per FedFIbOS round, step by step, against the plainest numpy code.

For every model and number of clients per round, the product's strategy
(:class:`server.strategy.SubmodelStrategy`, FedFIbOS) runs rounds over a grid of synthetic nodes
(:class:`benchmarks.synthetic_grid.SyntheticGrid`): each node answers its TRAIN message at once with
a valid reply for the submodel it was sent (the mask's digest, one delta value per position sent,
its Fisher upload when asked), its values synthetic (global values from the model's initialisation,
heavy-tailed Fisher uploads), so that no node trains. One round is timed: the strategy's
:meth:`~server.strategy.SubmodelStrategy.run_round` (each client's mask ranked and its TRAIN message
built; the replies taken one at a time in the clients' key order, validated, folded into the
method's running sum and Fisher state, and dropped; the method's round entries, whose sort gives the
trimmed prior and ``prior_influence``), then the round's central evaluation (the masks it ranks for
every capacity level; no model is run) and its checkpoint
(:func:`server.persistence.save_checkpoint` of the method's state, as the ServerApp writes it after
every round).

The benchmark calls none of these steps itself. It replaces a few bound methods of the strategy's
own objects by wrappers that time each call under its step's name (:mod:`benchmarks.step_clock`):
the method's ``mask_for`` (select), the strategy's ``submodel_message`` with the method's ``encode``
and ``fisher_request`` (encode), the method's ``validate``, its round fold's ``add`` and ``finish``
(aggregate), ``observe`` of a reply carrying a Fisher (Fisher state), the Fisher state's
``prior_interval`` and ``global_prior`` (prior), ``round_entries`` (``prior_influence``), the
strategy's ``level_mask`` (central-evaluation masks). A call inside another counts for its own step
only. What the strategy's own clock measured of the round
(:class:`~server.strategy_core.server_clock.ServerClock`, the grid's time left out) and no step
holds is the ``rest`` (the model's arrays, taking the replies apart, the round's records). Next to
each step the same run times the step's *anchor*, the plainest numpy code that does the same
arithmetic without the product's checks and guarantees (``argpartition`` top-k, a dense float32 sum
of the deltas, ...), run beside each of the product's calls so that load from other work falls on
both alike; the ratio column then does not depend on the machine. A second table compares each
capacity's download with its information limit ``4k + d H(k/d) / 8`` bytes (``k`` values of 4 bytes
and the entropy of a mask of ``k`` among ``d``).

Two kinds of round are timed (``--rounds``, :func:`run_round`): a *refresh* round (with
``fisher-every = 1``: round 1 stores every client's Fisher, untimed; in round 2 every stored client
is ranked by its own estimate and every reply carries a Fisher upload) and a *held* round, the
steady state between refreshes (rounds 1 and 2 untimed; in round 3 each stored client's mask is
held and its reply the update only). The rounds are played as
:meth:`~server.strategy.SubmodelStrategy.start` plays them: a round's central evaluation and
checkpoint run once the next round's messages are out, beside the nodes' training (not timed), the
timed round's at once, as the last round's. Besides each step's wall-clock seconds the benchmark
records the process's CPU seconds, and the per-client constant: the seconds of the work done once
per client, divided by the clients, and the slope of the whole round between client counts
(:func:`per_client_rows`).

Each configuration runs in a process of its own (forked), whose peak resident memory is the round's:
Python and numpy, the synthetic data, and what the strategy holds (among it every TRAIN message of
the round, all built before the grid pushes any). The state holds at most what ``fisher-memory-mb``
allows (the run config's default unless ``--fisher-memory-mb``). Before anything runs, each
configuration's memory is estimated (:func:`round_memory`); if one would not fit in
``--max-memory-gb`` or in the memory the machine has available, the benchmark is refused with the
figure it would need.

Usage::

    fibos bench-server --models cnn,resnet18 --clients 10,50,200 --rounds refresh,held \
        --out results/server-bench

Writes ``server_bench.json`` (every step's seconds, the peak memory) and ``server_bench.png``
(server seconds per round against clients, project and anchor) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from benchmarks.step_clock import Patches, StepClock
from benchmarks.synthetic_grid import EXAMPLES, SyntheticGrid, SyntheticRound, client_key
from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.config.schema import kebab
from common.fisher.prior_influence import trim_count
from common.fisher.selection import budget, select_mask
from common.fisher.state import fisher_capacity
from common.methods.fedfibos import FedFIbOS
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.training.peak_memory import PeakRSS, current_rss_bytes
from common.wire.mask_codec import ENCODINGS
from common.wire.protocol import encode_submodel
from server.grid_io import REPLY_WINDOW
from server.persistence import CHECKPOINT, chunk_store, save_checkpoint
from server.strategy import SubmodelStrategy, TrainedRound

#: (key, label) of the timed steps, in the order a round runs them.
STEPS: tuple[tuple[str, str], ...] = (
    ("select", "select client masks"),
    ("encode", "encode downloads (TRAIN messages)"),
    ("validate", "validate + decode replies"),
    ("aggregate", "aggregate (running sum)"),
    ("fisher", "Fisher state update"),
    ("prior", "trimmed prior + interval"),
    ("influence", "prior_influence"),
    ("rest", "rest of the strategy's round"),
    ("eval_masks", "central-evaluation masks"),
    ("checkpoint", "checkpoint (fsync)"),
)
#: Steps without an anchor: nothing plainer does their work (checks, a certificate, the rest).
UNANCHORED = ("validate", "influence", "rest")
IN_CHANNELS = {"cnn": 1, "resnet18": 3}


@dataclass
class StepTimes:
    """Seconds of one round's steps: the project's code and the numpy anchor (``None``: no
    anchor)."""

    project: dict[str, float] = field(default_factory=dict)
    anchor: dict[str, float | None] = field(default_factory=dict)
    cpu: dict[str, float] = field(
        default_factory=dict
    )  # the project's CPU seconds (this process, every thread)
    extra: dict[str, float] = field(
        default_factory=dict
    )  # checkpoint sizes and the incremental save


def mask_entropy_bytes(k: int, d: int) -> float:
    """``d H(k/d) / 8``: the information in a mask of ``k`` kept among ``d`` (bytes)."""
    if k in (0, d):
        return 0.0
    p = k / d
    return d * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / 8


def capacities_for(n: int, levels: Sequence[float]) -> list[float]:
    """Client ``i``'s capacity: the levels cycled through."""
    return [levels[i % len(levels)] for i in range(n)]


#: What each part of :func:`round_memory` holds.
MEMORY_PARTS: dict[str, str] = {
    "sent": (
        "what the round keeps of each download until its reply is folded (the mask as packed "
        "bits, d / 8 bytes a client), for this round and the previous one, whose plan waits "
        "for its central evaluation until this round's messages are out"
    ),
    "mask_history": "each client's last mask (packed bits), against which its next is measured",
    "messages": (
        "every TRAIN message of the round, all built before the grid pushes any: the values "
        "kept (4 bytes each), the mask's code (at most its packed bits) and, in a refresh "
        "round, the values outside the mask (4 bytes each)"
    ),
    "grid": (
        "the synthetic grid's (a SuperLink's, in a federation): each pending message's mask "
        "code in a refresh round, and the making of one reply (its Fisher in float64, the "
        "positions outside the mask)"
    ),
    "replies": (
        "the replies pulled ahead of the one folded (server.grid_io.REPLY_WINDOW): the delta "
        "and, in a refresh round, the Fisher payload (values inside the mask, one mean per "
        "row)"
    ),
    "fold": (
        "the running sum (16 bytes per position: two float64 sums, the most any method's "
        "takes) and the reply folded: its mask unpacked (1 byte per position), its decoded "
        "Fisher (4), its payload as received (4 at most), the update's int32 indices and its "
        "delta (4 + 4 per kept)"
    ),
    "model": (
        "the global values the strategy holds at once (the round's start and end, the model's"
        " arrays, their flat copy, the level masks' copy, one serialisation), 4 bytes each, "
        "and one mask per capacity level (1 byte per position)"
    ),
    "fisher_state": (
        "the stored estimates (min(n, the clients the budget holds)), the state's fixed 12 "
        "bytes per position (common.fisher.state.fisher_capacity) and each stored client's "
        "held mask (packed bits)"
    ),
    "checkpoint": "the state serialised for the checkpoint (a copy of its estimates and masks)",
}
#: Memory parts of :func:`round_memory` that grow with the clients of the round.
GROWS_WITH_CLIENTS = ("sent", "mask_history", "messages", "grid")
#: Bytes of a Flower message besides its arrays, at most (metadata, records, ``.npy`` headers).
MESSAGE_OVERHEAD = 4096


def round_memory(
    d: int,
    levels: Sequence[float],
    n: int,
    cfg: RunConfig,
    kind: str = "refresh",
    rows: int | None = None,
) -> dict[str, float]:
    """Bytes a round of ``n`` clients holds at its peak besides the process, by part (at most).

    Parameters
    ----------
    d : int
        The model's parameters.
    levels : Sequence[float]
        The capacity levels, cycled through the clients (:func:`capacities_for`).
    n : int
        Clients of the round.
    cfg : RunConfig
        The run config (``fisher-memory-mb``, ``fisher-precision``).
    kind : str
        The round kind (:data:`ROUND_KINDS`): a refresh round's downloads carry the values outside
        the mask, its replies a Fisher upload.
    rows : int, optional
        The layout's rows (a ``masked`` Fisher upload sends one mean per row); default ``d``, the
        most.

    Returns
    -------
    dict
        Bytes by part (:data:`MEMORY_PARTS` says what each holds).
    """
    fisher = cfg.options("fisher")
    refresh = kind == "refresh"
    packed = (d + 7) // 8
    kept = [budget(g, d) for g in capacities_for(n, levels)]
    most = max(budget(g, d) for g in levels)
    outside = sum(d - k for k in kept) if refresh else 0
    fisher_up = 4 * most + 4 * (d if rows is None else rows) if refresh else 0
    reply = 4 * most + fisher_up + MESSAGE_OVERHEAD
    grid = n * (packed + MESSAGE_OVERHEAD) + 40 * d if refresh else n * MESSAGE_OVERHEAD
    stored = min(n, fisher_capacity(fisher.memory_mb, d, fisher.precision))
    estimates = stored * d * np.dtype(fisher.precision.replace("fp", "float")).itemsize
    estimates += stored * packed  # the held masks, serialised with the estimates
    return {
        "sent": float(2 * n * packed),
        "mask_history": float(n * packed),
        "messages": float(4 * sum(kept) + 4 * outside + n * (packed + MESSAGE_OVERHEAD)),
        "grid": float(grid),
        "replies": float(REPLY_WINDOW * reply),
        "fold": float(16 * d + d * (1 + 4 + 4) + most * (4 + 4)),
        "model": float(7 * 4 * d + len(set(levels)) * d),
        "fisher_state": float(estimates + 12 * d),
        "checkpoint": float(estimates),
    }


def grows_with_clients(parts: dict[str, float]) -> float:
    """The bytes of ``parts`` (:func:`round_memory`'s) that grow with the clients of the round."""
    return sum(parts.get(name, 0.0) for name in GROWS_WITH_CLIENTS)


def resident_bytes() -> int:
    """This process's resident memory now (bytes; 0 where ``/proc`` is not available)."""
    return current_rss_bytes() or 0


def available_bytes() -> int | None:
    """Memory the machine has available for a new process (``MemAvailable``, bytes; ``None`` without
    ``/proc``)."""
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
    (``/proc/self/clear_refs``), so it is this configuration's alone, whatever ran before in the
    parent; without ``/proc`` it is sampled (:class:`common.training.peak_memory.PeakRSS`).
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
        raise RuntimeError(
            f"the benchmark's round process ended with status {proc.exitcode}"
        ) from err
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


#: The round kinds :func:`run_round` times.
ROUND_KINDS: tuple[str, ...] = ("refresh", "held")
#: The round each kind times; the rounds before it are played untimed.
TIMED_ROUND = {"refresh": 2, "held": 3}
#: Run-config keys of each kind: a refresh every round, or none before the timed round.
ROUND_SETTINGS: dict[str, dict[str, object]] = {
    "refresh": {"fisher-every": 1},
    "held": {"fisher-every": 5},
}
#: Run-config keys every benchmark run sets.
BENCH_SETTINGS: dict[str, object] = {
    "method": "fedfibos",
    "fisher-encoding": "masked",  # the upload this benchmark has timed from the start
    "fedfibos-byte-budget": 0.0,  # no byte ledger: a refresh round asks every client for its Fisher
    "fraction-train": 1.0,  # every node trains: the clients of the round are the grid's nodes
    "eval-every": 0,  # no round of the nodes' own evaluation (the synthetic nodes only train)
}
#: ``num_rounds`` given to the strategy: beyond the rounds played, so none is the run's last (whose
#: evaluation also measures every client's own submodel).
NUM_ROUNDS = 1000
#: Seconds the strategy waits for nodes and replies (the synthetic grid answers at once).
TIMEOUT = 60.0


def bench_config(cfg: RunConfig, kind: str) -> RunConfig:
    """``cfg`` with :data:`BENCH_SETTINGS` and the round kind's :data:`ROUND_SETTINGS`.

    Parameters
    ----------
    cfg : RunConfig
        The run config (its Fisher budget, precision and mask guards are kept).
    kind : str
        The round kind (:data:`ROUND_KINDS`).
    """
    raw = {kebab(name): value for name, value in cfg.flat().items()}
    return parse_run_config({**raw, **BENCH_SETTINGS, **ROUND_SETTINGS[kind]})


def no_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Central evaluation's ``evaluate_fn``, without a model: the server's masks are what is timed.

    Parameters
    ----------
    server_round : int
        The round evaluated.
    arrays : ArrayRecord
        The model (or a capacity level's submodel) to evaluate.
    """
    return MetricRecord({"accuracy": 0.0, "loss": 0.0})


@contextmanager
def quiet_flower() -> Iterator[None]:
    """Flower's log at warnings only: the strategy logs one line per node that joins."""
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        flwr_log.setLevel(level)


@dataclass
class BenchFederation:
    """The product's strategy over a :class:`SyntheticGrid`, its result, checkpoint and clock.

    Parameters
    ----------
    strategy : SubmodelStrategy
        The strategy, its nodes discovered.
    grid : SyntheticGrid
        The synthetic nodes.
    result : Result
        The run's result so far (the model's arrays each round starts from).
    checkpoint : Path
        Where the ServerApp's checkpoint is written.
    clock : StepClock
        The seconds of the timed round's steps.
    """

    strategy: SubmodelStrategy
    grid: SyntheticGrid
    result: Result
    checkpoint: Path
    clock: StepClock = field(default_factory=StepClock)


def bench_federation(
    data: SyntheticRound, cfg: RunConfig, n: int, levels: Sequence[float], folder: Path
) -> BenchFederation:
    """The strategy of ``cfg`` over ``n`` synthetic nodes of capacities ``levels`` (cycled).

    The nodes are discovered as :meth:`SubmodelStrategy.start` discovers them (each QUERYd).

    Parameters
    ----------
    data : SyntheticRound
        The model's synthetic data; its global values are the initial model.
    cfg : RunConfig
        The run config (:func:`bench_config`).
    n : int
        Nodes, all of which train every round.
    levels : Sequence[float]
        Capacity levels, cycled through the nodes.
    folder : Path
        Where the checkpoint goes.
    """
    strategy = SubmodelStrategy(cfg, data.layout)
    grid = SyntheticGrid(data, capacities_for(n, levels), strategy.method.upload_encoding(cfg))
    strategy.evaluate_fn = no_evaluation
    # As ``start`` begins: the initial model, then discovery.
    result = Result(arrays=strategy.to_arrays(data.x))
    strategy.x = np.array(data.x, dtype=np.float32, copy=True)
    strategy.registry.join(grid, TIMEOUT)
    return BenchFederation(strategy, grid, result, folder / CHECKPOINT)


def train_round(
    fed: BenchFederation,
    server_round: int,
    on_pushed: Callable[[], None],
) -> TrainedRound:
    """The strategy's ``run_round`` of ``server_round``.

    Parameters
    ----------
    fed : BenchFederation
        The federation.
    server_round : int
        The round.
    on_pushed : Callable
        Runs once the round's messages are out (the previous round's evaluation).
    """
    strategy = fed.strategy
    config = ConfigRecord()
    return strategy.run_round(
        fed.grid,
        server_round,
        NUM_ROUNDS,
        TIMEOUT,
        config,
        fed.result,
        on_pushed,
    )


def finish_round(fed: BenchFederation, done: TrainedRound, overlapped: bool) -> int:
    """The round's central evaluation, then the checkpoint; the state bytes the checkpoint wrote.

    The checkpoint is the one ``server/app.py`` writes after each round (``checkpoint-every = 1``,
    the default): :func:`save_checkpoint` of the model and the method's ``state_bytes``.

    Parameters
    ----------
    fed : BenchFederation
        The federation.
    done : TrainedRound
        The round trained and aggregated.
    overlapped : bool
        It runs while the next round's nodes train.
    """
    strategy = fed.strategy
    strategy.complete_round(done, fed.grid, TIMEOUT, ConfigRecord(), fed.result, overlapped)
    with fed.clock.step("checkpoint", per_client=False):
        state = strategy.method.state_bytes()
        return save_checkpoint(fed.checkpoint, done.server_round, strategy.x, state)


@dataclass
class TimedRound:
    """What :func:`play` measured of the timed round besides its steps.

    Parameters
    ----------
    done : TrainedRound
        The round, with the strategy's own clock (``done.clock``).
    inside : list of float
        Seconds the steps and the anchors took inside ``run_round``: step wall, step CPU, anchor
        wall and anchor CPU.
    code_hits : int
        Mask codes the round looked up instead of encoding
        (:data:`common.wire.mask_codec.ENCODINGS`).
    written : int
        State bytes its checkpoint wrote.
    """

    done: TrainedRound
    inside: list[float]
    code_hits: int
    written: int


def play(fed: BenchFederation, kind: str, instrument: Callable[[], Patches]) -> TimedRound:
    """Rounds 1 to the kind's timed round, as :meth:`SubmodelStrategy.start` plays them.

    Each round's central evaluation and checkpoint run once the next round's messages are out
    (``start``'s ``evaluate_waiting``), beside the nodes' training: the strategy's clock leaves them
    out, and so does the benchmark's. The last round is timed; its evaluation and checkpoint run at
    once, as a run's last round's do.

    Parameters
    ----------
    fed : BenchFederation
        The federation, discovered.
    kind : str
        The round kind (:data:`TIMED_ROUND`).
    instrument : Callable
        Replaces the product's calls by timed ones for the timed round (the patches to undo).
    """
    waiting: list[TrainedRound] = []

    def evaluate_waiting() -> None:
        with fed.clock.paused():
            while waiting:
                finish_round(fed, waiting.pop(), overlapped=True)

    last = TIMED_ROUND[kind]
    for server_round in range(1, last):
        done = train_round(fed, server_round, evaluate_waiting)
        evaluate_waiting()
        waiting.append(done)
    patches = instrument()
    try:
        hits, before = ENCODINGS.hits, fed.clock.totals()
        done = train_round(fed, last, evaluate_waiting)
        inside = [after - then for after, then in zip(fed.clock.totals(), before)]
        hits = ENCODINGS.hits - hits
        evaluate_waiting()
        written = finish_round(fed, done, overlapped=False)
    finally:
        patches.undo()
    return TimedRound(done, inside, hits, written)


class Anchors:
    """Each step's anchor: the plainest numpy code for its arithmetic, without the product's checks.

    Parameters
    ----------
    data : SyntheticRound
        The model's synthetic data (the anchors rank by its uploads, at its global values).
    method : FedFIbOS
        The round's method (its held masks and Fisher state, read after the product used them).
    n : int
        Clients of the round.
    """

    def __init__(self, data: SyntheticRound, method: FedFIbOS, n: int) -> None:
        d = data.layout.size
        self.data, self.method, self.d = data, method, d
        self.index = {client_key(i): i for i in range(n)}
        self.absx = np.abs(data.x)
        # The dense float32 sums (12 bytes per position with ``dense`` and ``buf``).
        self.acc = np.zeros(d, dtype=np.float32)
        self.dense = np.zeros(d, dtype=np.float32)
        self.buf = np.empty(d, dtype=np.float32)

    def select(self, key: str, gamma: float, source: str) -> None:
        """A client's mask: a held one's bits unpacked, else an ``argpartition`` of ``F|x|``."""
        if source == "held":
            packed = self.method.held.packed(key)
            if packed is not None:
                np.unpackbits(packed, count=self.d).view(np.bool_)
                return
        k = budget(gamma, self.d)
        if k < self.d:
            f = self.data.uploads[self.index[key] % len(self.data.uploads)]
            np.argpartition(f * self.absx, self.d - k)[self.d - k :]

    @staticmethod
    def download(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> None:
        """A download: the values kept and the packed mask."""
        x[mask], np.packbits(mask)

    @staticmethod
    def outside(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> None:
        """A refresh's ``fisher-at``: the values outside the mask."""
        x[~mask]

    def add(self) -> None:
        """One reply into a dense float32 sum."""
        np.add(self.acc, self.dense, out=self.acc)

    def apply(self, x: NDArray[np.float32]) -> None:
        """The sum into the model."""
        x + self.acc

    def fisher(self, f: NDArray[np.float32]) -> None:
        """One upload normalised to mean 1 and summed."""
        np.multiply(f, np.float32(1 / f.mean()), out=self.buf)
        np.add(self.acc, self.buf, out=self.acc)

    def prior(self) -> None:
        """The stored estimates' trimmed mean: a ``partition`` along the clients, block by block."""
        state = self.method.fisher
        stored = [c.fisher for c in state.clients.values()]
        m = len(stored)
        cut = trim_count(state.trim, m)
        block = 1 << 20
        for start in range(0, self.d, block):
            s = np.stack([f[start : start + block] for f in stored])
            if cut:
                s.partition((cut, m - cut - 1), axis=0)
                s[cut : m - cut].mean(axis=0, dtype=np.float64)
            else:
                s.mean(axis=0, dtype=np.float64)

    def eval_masks(self, levels: Sequence[float]) -> None:
        """Each level's mask below capacity 1: one ``argpartition`` of the prior times ``|x|``."""
        prior = self.method.fisher.global_prior()
        if prior is None:
            return
        scores = prior * self.absx
        for gamma in sorted({g for g in levels if g < 1.0}, reverse=True):
            np.argpartition(scores, self.d - budget(gamma, self.d))

    def checkpoint(self, folder: Path, x: NDArray[np.float32]) -> None:
        """The model, the stored estimates and their held masks written raw to a file, ``fsync``."""
        with open(folder / "raw.bin", "wb") as f:
            f.write(x.tobytes())
            for c in self.method.fisher.clients.values():
                f.write(c.fisher.tobytes())
            for key in self.method.fisher.clients:
                bits = self.method.held.packed(key)
                if bits is not None:
                    f.write(bits.tobytes())
            f.flush()
            os.fsync(f.fileno())


def instrument(fed: BenchFederation, anchors: Anchors) -> Patches:
    """Time the product's calls of a round under their steps, each with its anchor beside it.

    The per-client steps are the calls made once per client: a mask (but not a capacity level's mask
    ranked by the prior, made once per round for every client of that level), a TRAIN message, a
    reply's validation, its fold into the running sum and its Fisher into the state.

    Parameters
    ----------
    fed : BenchFederation
        The federation whose strategy and method are timed.
    anchors : Anchors
        The anchors.
    """
    strategy, clock, patches = fed.strategy, fed.clock, Patches()
    method = strategy.method
    assert isinstance(method, FedFIbOS)
    patches.set(method, "mask_for", timed_mask_for(method, clock, anchors))
    instrument_downloads(fed, method, anchors, patches)
    patches.set(method, "validate", clock.wrap(method.validate, "validate"))
    patches.set(method, "round_fold", timed_round_fold(method, clock, anchors))
    patches.set(method, "observe", timed_observe(method, clock, anchors))
    instrument_round_end(fed, method, patches)
    return patches


def instrument_downloads(
    fed: BenchFederation,
    method: FedFIbOS,
    anchors: Anchors,
    patches: Patches,
) -> None:
    """Time each TRAIN message as "encode": the whole message is the download (the submodel's
    encoding, a refresh's values outside the mask, what the round keeps of it, its records).

    Parameters
    ----------
    fed : BenchFederation
        The federation whose strategy builds the messages.
    method : FedFIbOS
        Its method.
    anchors : Anchors
        The anchors.
    patches : Patches
        Where the timed calls are set.
    """
    clock = fed.clock

    def download(out: Any, x: NDArray[np.float32], mask: NDArray[np.bool_]) -> None:
        anchors.download(x, mask)

    def fisher_at(out: Any, key: str, rnd: int, x: NDArray, mask: NDArray, *_: Any) -> None:
        if out is not None and out.arrays:
            anchors.outside(x, mask)

    message = clock.wrap(fed.strategy.submodel_message, "encode")
    encode = clock.wrap(method.encode, "encode", beside=download)
    request = clock.wrap(method.fisher_request, "encode", beside=fisher_at)
    patches.set(fed.strategy, "submodel_message", message)
    patches.set(method, "encode", encode)
    patches.set(method, "fisher_request", request)


def instrument_round_end(fed: BenchFederation, method: FedFIbOS, patches: Patches) -> None:
    """Time the prior, ``prior_influence`` and central evaluation's level masks (once per round).

    Parameters
    ----------
    fed : BenchFederation
        The federation whose strategy evaluates the levels.
    method : FedFIbOS
        Its method.
    patches : Patches
        Where the timed calls are set.
    """
    clock = fed.clock
    for name in ("prior_interval", "global_prior"):
        call = getattr(method.fisher, name)
        patches.set(method.fisher, name, clock.wrap(call, "prior", per_client=False))
    entries = clock.wrap(method.round_entries, "influence", per_client=False)
    patches.set(method, "round_entries", entries)
    # Central evaluation's mask of each level: everything it calls counts as that step's.
    level_mask = fed.strategy.level_mask
    patches.set(fed.strategy, "level_mask", clock.wrap(level_mask, "eval_masks", False, True))


def timed_mask_for(method: FedFIbOS, clock: StepClock, anchors: Anchors) -> Callable[..., Any]:
    """``method.mask_for`` timed as "select", its anchor beside each client's mask.

    A call that ranks a capacity level's mask (a miss of the method's level cache) is the round's
    work, not a client's: every later client of that level looks the mask up.
    """
    real = method.mask_for

    def mask_for(
        key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        misses = method.level_masks.misses
        with clock.step("select") as span:
            mask, source = real(key, server_round, gamma, x)
            span.per_client = method.level_masks.misses == misses
            if span.counted and key is not None:
                clock.anchor("select", lambda: anchors.select(key, gamma, source))
        return mask, source

    return mask_for


def timed_round_fold(method: FedFIbOS, clock: StepClock, anchors: Anchors) -> Callable[..., Any]:
    """``method.round_fold`` whose fold's ``add`` (per client) and ``finish`` are timed as the
    "aggregate" step (the running sum)."""
    real = method.round_fold

    def round_fold(x: NDArray[np.float32], server_round: int, min_replies: int) -> Any:
        with clock.step("aggregate", per_client=False):  # the running sum's buffers
            fold = real(x, server_round, min_replies)
        # The fold is this round's alone: its calls are replaced on it, not patched back.
        fold.add = clock.wrap(fold.add, "aggregate", beside=lambda *_: anchors.add())
        apply = partial(anchors.apply, x)
        fold.finish = clock.wrap(fold.finish, "aggregate", False, beside=lambda *_: apply())
        return fold

    return round_fold


def timed_observe(method: FedFIbOS, clock: StepClock, anchors: Anchors) -> Callable[..., None]:
    """``method.observe`` of a reply carrying a Fisher timed as the "Fisher state update" step.

    A reply carrying none only passes through, within the fold's step.
    """
    real = method.observe

    def observe(accepted: Any, fisher_round: int) -> None:
        fisher = accepted.reply.fisher
        if fisher is None:
            real(accepted, fisher_round)
            return
        with clock.step("fisher") as span:
            real(accepted, fisher_round)
            if span.counted:
                clock.anchor("fisher", lambda: anchors.fisher(fisher))

    return observe


def step_times(fed: BenchFederation, timed: TimedRound, anchors: Anchors) -> StepTimes:
    """The timed round's steps from the clock, its ``rest``, and the anchors run after the round.

    ``rest`` is what the strategy's own clock measured of ``run_round`` (its work, the grid's left
    out) that neither a step nor an anchor took.

    Parameters
    ----------
    fed : BenchFederation
        The federation after the timed round.
    timed : TimedRound
        What :func:`play` measured.
    anchors : Anchors
        The anchors (those of the prior, the level masks and the checkpoint run here).
    """
    clock, levels = fed.clock, fed.strategy.registry.capacities()
    clock.anchor("prior", anchors.prior)
    clock.anchor("eval_masks", lambda: anchors.eval_masks(levels))
    clock.anchor("checkpoint", lambda: anchors.checkpoint(fed.checkpoint.parent, fed.strategy.x))
    own = timed.done.clock
    clock.project["rest"] = max(0.0, own.seconds - timed.inside[0] - timed.inside[2])
    clock.cpu["rest"] = max(0.0, own.cpu_seconds - timed.inside[1] - timed.inside[3])
    t = StepTimes()
    for key, _ in STEPS:
        t.project[key] = clock.project.get(key, 0.0)
        t.cpu[key] = clock.cpu.get(key, 0.0)
        if key in UNANCHORED:
            t.anchor[key] = None
        elif key == "fisher":  # ``None``: no reply of the round carried a Fisher
            t.anchor[key] = clock.anchors.get(key)
        else:
            t.anchor[key] = clock.anchors.get(key, 0.0)
    t.extra.update(
        per_client_seconds=clock.per_client[0],
        per_client_cpu_seconds=clock.per_client[1],
        strategy_seconds=own.seconds,
        strategy_cpu_seconds=own.cpu_seconds,
        mask_code_hits=float(timed.code_hits),
    )
    return t


def checkpoint_extras(
    fed: BenchFederation,
    timed: TimedRound,
    data: SyntheticRound,
) -> dict[str, float]:
    """The timed round's checkpoint, and the next round's when one stored client re-uploads.

    The checkpoint's MiB in all and the MiB the round wrote; the MiB the next round's writes (the
    incremental layout writes only the chunks that changed) and its seconds.

    Parameters
    ----------
    fed : BenchFederation
        The federation after the timed round (its Fisher state is changed here).
    timed : TimedRound
        What :func:`play` measured.
    data : SyntheticRound
        The synthetic data (the re-upload).
    """
    path, strategy = fed.checkpoint, fed.strategy
    size = path.stat().st_size + sum(f.stat().st_size for f in chunk_store(path).iterdir())
    state = strategy.method.fisher
    server_round = timed.done.server_round + 1
    state.update(next(iter(state.clients)), data.uploads[-1] * 2.0, EXAMPLES, server_round)
    t0 = time.perf_counter()
    again = save_checkpoint(path, server_round, strategy.x, strategy.method.state_bytes())
    return {
        "checkpoint_mb": size / 2**20,
        "checkpoint_written_mb": timed.written / 2**20,
        "incremental_written_mb": again / 2**20,
        "incremental_seconds": time.perf_counter() - t0,
    }


def run_round(
    data: SyntheticRound,
    cfg: RunConfig,
    n: int,
    levels: Sequence[float],
    workdir: Path,
    kind: str = "refresh",
) -> StepTimes:
    """One round of ``kind`` for ``n`` clients, run by the product's strategy, its steps timed.

    A federation of its own (:func:`bench_federation`, run config :func:`bench_config`) plays the
    rounds before the timed one untimed and then the timed one (:func:`play`), whose steps are the
    product's calls (:func:`instrument`):

    * ``refresh``: round 1 stores every client's Fisher (up to ``fisher-memory-mb``); in round 2
      every stored client is ranked by its own estimate (its mask then held, as FedFIbOS holds it)
      and asked for a Fisher upload (``masked``; its download carries the values outside its mask,
      ``fisher-at``). A federation with ``fisher-every`` > 1 splits this work over two rounds (the
      refresh round's downloads still use the held masks), so this is the costliest round there is.
    * ``held``: the steady state between refreshes: round 2 ranks and holds every stored client's
      mask; in round 3 each is held, every other client ranked by the prior (one mask per capacity
      level), and the stored clients' replies carry the update only. (A client the Fisher state does
      not hold, beyond ``fisher-memory-mb``, is asked for its Fisher every round, as FedFIbOS asks
      it: with more clients than the budget holds, those replies carry a Fisher upload.)

    Every client's estimate is its own (:meth:`SyntheticRound.estimate`), so no two clients are sent
    the same Fisher-ranked mask. The round starts with the mask codes the rounds before it left
    (:data:`common.wire.mask_codec.ENCODINGS`), and a repeat with none of its predecessor's.

    Parameters
    ----------
    data : SyntheticRound
        The model's synthetic data.
    cfg : RunConfig
        The run config (its Fisher budget, precision and mask guards).
    n : int
        Clients of the round.
    levels : Sequence[float]
        Capacity levels, cycled through the clients.
    workdir : Path
        Where the round's checkpoint folder is made (and removed).
    kind : str
        The round kind (:data:`ROUND_KINDS`).
    """
    if kind not in ROUND_KINDS:
        raise ValueError(f"round kind {kind!r}; expected one of {ROUND_KINDS}")
    folder = Path(tempfile.mkdtemp(dir=workdir))  # a repeat finds none of its predecessor's chunks
    ENCODINGS.clear()  # nor its mask codes
    try:
        with quiet_flower():
            fed = bench_federation(data, bench_config(cfg, kind), n, levels, folder)
            method = fed.strategy.method
            assert isinstance(method, FedFIbOS)
            anchors = Anchors(data, method, n)
            timed = play(fed, kind, partial(instrument, fed, anchors))
            t = step_times(fed, timed, anchors)
            t.extra.update(checkpoint_extras(fed, timed, data))
    finally:
        shutil.rmtree(folder)
    return t


#: Figures of :attr:`StepTimes.extra` that :func:`repeated_rounds` keeps the fastest of.
FASTEST_EXTRAS = (
    "per_client_seconds",
    "per_client_cpu_seconds",
    "strategy_seconds",
    "strategy_cpu_seconds",
)


def repeated_rounds(
    data: SyntheticRound,
    cfg: RunConfig,
    n: int,
    levels: Sequence[float],
    workdir: Path,
    repeat: int,
    kind: str = "refresh",
) -> StepTimes:
    """``repeat`` rounds of :func:`run_round`; each step's fastest (load from other work only adds
    time)."""
    t = run_round(data, cfg, n, levels, workdir, kind)
    for _ in range(repeat - 1):
        again = run_round(data, cfg, n, levels, workdir, kind)
        t.project = {k: min(v, again.project[k]) for k, v in t.project.items()}
        t.cpu = {k: min(v, again.cpu[k]) for k, v in t.cpu.items()}
        t.anchor = {
            k: None if v is None else min(v, again.anchor[k] or v) for k, v in t.anchor.items()
        }
        for k in FASTEST_EXTRAS:
            t.extra[k] = min(t.extra[k], again.extra[k])
    return t


def synthetic_memory(d: int, levels: Sequence[float], pool: int) -> dict[str, float]:
    """Bytes of the benchmark's own data, none of which a server holds.

    The global values, the pool of uploads, a delta per size (as values and serialised), and the
    anchors' four float32 vectors.
    """
    kept = sum(budget(g, d) for g in levels)
    return {"synthetic": float(4 * d * (1 + pool) + 8 * kept + 16 * d)}


def kind_of(row: dict) -> str:
    """A result row's round kind (an earlier run's rows, before there were kinds, are refresh
    rounds)."""
    return row.get("round", "refresh")


def memory_table(results: list[dict]) -> str:
    """Per round: the peak resident memory measured, and the estimate checked before it ran."""
    lines = [
        "| model | clients | round | peak RSS GiB | estimated GiB "
        "| of which grows with the clients (masks sent and seen, messages) GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r or "peak_rss_gib" not in r:
            continue
        lines.append(
            f"| {r['model']} | {r['clients']} | {kind_of(r)} | {r['peak_rss_gib']:.2f} "
            f"| {r['estimate_gib']:.2f} | {grows_with_clients(r['memory_gib']):.3f} |"
        )
    return "\n".join(lines)


def download_rows(
    data: SyntheticRound, cfg: RunConfig, levels: Sequence[float]
) -> list[dict[str, float | str]]:
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
        An earlier run's rounds: its project seconds and ratio are shown beside this run's, step by
        step (``-`` where it did not measure that model, client count, round kind or step).

    A ``round`` column appears when the rows name their kind (:data:`ROUND_KINDS`).
    """
    before = {
        (r["model"], r["clients"], kind_of(r)): r for r in earlier or [] if "skipped" not in r
    }
    kinds = any("round" in r for r in results)
    head = (
        "| model | clients |"
        + (" round |" if kinds else "")
        + " step | project s | numpy anchor s | ratio |"
    )
    rule = "|---|---|" + ("---|" if kinds else "") + "---|---|---|---|"
    if earlier is not None:
        head += " earlier project s | earlier ratio |"
        rule += "---|---|"

    def cells(p: float | None, a: float | None, digits: int) -> tuple[str, str, str]:
        ratio = "-" if p is None or a is None or a <= 0 else f"{p / a:.1f}"
        return (
            "-" if p is None else f"{p:.{digits}f}",
            "-" if a is None else f"{a:.{digits}f}",
            ratio,
        )

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
    """Per model (and round kind): the least-squares line ``seconds = a + b * clients`` through the
    measured rounds."""
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
        out.append(
            f"{name}: server seconds per round = {a:.3f} + {b:.4f} x clients (largest deviation "
            f"{worst:.0%})"
        )
    return out


def per_client_rows(results: list[dict]) -> list[dict]:
    """Per model, round kind and client count: the server's seconds per client of the round.

    * ``work``, ``work_cpu``: the steps done once per client (select, encode and keep what was sent,
      validate, the running sum, the Fisher state), wall clock and CPU, divided by the clients: the
      per-client constant;
    * ``slope``, ``slope_cpu``: the whole round's seconds between this client count and the one
      before, ``(T(n) - T(m)) / (n - m)``: linear time shows as slopes that do not grow with the
      clients;
    * ``ratio``: the whole round against its numpy anchors.
    """
    out = []
    done = [r for r in results if "skipped" not in r and "per_client_seconds" in r]
    for model, kind in dict.fromkeys((r["model"], kind_of(r)) for r in done):
        prev = None
        for r in sorted(
            (r for r in done if r["model"] == model and kind_of(r) == kind),
            key=lambda r: r["clients"],
        ):
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
        "| model | round | clients | per-client steps s / client | CPU s / client | whole round: "
        "slope s / client | CPU slope s / client | whole round / anchor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in per_client_rows(results):
        lines.append(
            f"| {r['model']} | {r['round']} | {r['clients']} | {f(r['work'])} | {f(r['work_cpu'])} "
            f"| {f(r['slope'])} | {f(r['slope_cpu'])} | {f(r['ratio'], 1)} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Server seconds per round against clients per round, project and anchor (and the project's CPU
    seconds, which load from other work on the machine moves less): one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [
        m
        for m in dict.fromkeys(r["model"] for r in results)
        if any(r["model"] == m and "skipped" not in r for r in results)
    ]
    fig, axes = plt.subplots(
        1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4), squeeze=False
    )
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model and "skipped" not in r]
        for kind in dict.fromkeys(kind_of(r) for r in rows):
            mine = [r for r in rows if kind_of(r) == kind]
            n = [r["clients"] for r in mine]
            ax.plot(n, [r["round_project"] for r in mine], "o-", label=f"project, {kind} round")
            ax.plot(
                n,
                [r["round_anchor"] for r in mine],
                "s--",
                alpha=0.7,
                label=f"numpy anchor, {kind} round",
            )
            if all("round_cpu" in r for r in mine):
                ax.plot(
                    n,
                    [r["round_cpu"] for r in mine],
                    "^:",
                    label=f"project CPU seconds, {kind} round",
                )
        ax.set_title(f"{model} (d = {rows[0]['d']:,})")
        ax.set_xlabel("clients per round")
        ax.set_ylabel("server seconds per round")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: Each model's layout and initial global values (flat), by name.
Built = dict[str, tuple[ParamLayout, NDArray[np.float32]]]
#: Each configuration's memory by part (bytes), by (model, clients, round kind).
Needs = dict[tuple[str, int, str], dict[str, float]]


def progress_line(row: dict) -> str:
    """The line printed once a configuration has run (a :func:`result_row`)."""
    n = row["clients"]
    return (
        f"{row['model']} x {n}, {row['round']} round: {row['round_project']:.2f} s, "
        f"CPU {row['round_cpu']:.2f} s (anchor {row['round_anchor']:.2f} s), "
        f"per client {row['per_client_seconds'] / n:.3f} s, "
        f"CPU {row['per_client_cpu_seconds'] / n:.3f} s; peak RSS {row['peak_rss_gib']:.2f} GiB "
        f"(estimated {row['estimate_gib']:.2f})"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (:func:`main`'s ``argv``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="cnn,resnet18", help="comma-separated: cnn, resnet18")
    ap.add_argument("--clients", default="10,50,200", help="comma-separated clients per round")
    ap.add_argument(
        "--capacities",
        default="1,0.25,0.0625,0.015625",
        help="capacity levels, cycled through the clients",
    )
    ap.add_argument(
        "--fisher-memory-mb", type=float, default=None, help="default: the run config's"
    )
    ap.add_argument(
        "--fisher-precision",
        default=None,
        choices=("fp32", "fp16"),
        help="default: the run config's",
    )
    ap.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="refuse to start when a configuration would need more (GiB; also refused beyond the "
        "available memory)",
    )
    ap.add_argument(
        "--rounds",
        default=",".join(ROUND_KINDS),
        help="round kinds, comma-separated: refresh (stored clients ranked anew, every reply a "
        "Fisher upload), held (masks held between refreshes, replies the update only)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds per configuration; each step's fastest is kept",
    )
    ap.add_argument(
        "--pool", type=int, default=4, help="distinct synthetic Fisher uploads cycled through"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/server-bench"))
    ap.add_argument(
        "--earlier",
        type=Path,
        default=None,
        help="an earlier server_bench.json, shown beside this run's steps",
    )
    return ap.parse_args(argv)


def listed(text: str, known: Sequence[str], flag: str, what: str) -> list[str]:
    """The comma-separated names of ``text``; exits naming ``flag`` when one is not in ``known``.

    Parameters
    ----------
    text : str
        The flag's value.
    known : Sequence[str]
        The names allowed.
    flag, what : str
        The flag and what its names are, for the message.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in known:
            raise SystemExit(f"{flag}: unknown {what} {name!r}; expected some of {sorted(known)}")
    return names


def bench_models(models: Sequence[str], seed: int) -> Built:
    """Each model's layout and initial global values (flat).

    Parameters
    ----------
    models : Sequence[str]
        Model names (:data:`IN_CHANNELS`).
    seed : int
        The initialisation's seed.
    """
    built = {}
    for name in models:
        model = build_model(name, 10, IN_CHANNELS[name], seed)
        layout = model_layout(model)
        built[name] = (layout, layout.flatten(trainable_arrays(model)))
        del model
    return built


def memory_needs(
    built: Built,
    args: argparse.Namespace,
    cfg: RunConfig,
    levels: Sequence[float],
    kinds: Sequence[str],
) -> Needs:
    """Each configuration's memory (bytes by part): this process, the synthetic data and
    :func:`round_memory`.

    Parameters
    ----------
    built : dict
        Each model's layout and global values.
    args : argparse.Namespace
        The command line (clients, pool).
    cfg : RunConfig
        The run config.
    levels : Sequence[float]
        The capacity levels.
    kinds : Sequence[str]
        The round kinds.
    """
    process = float(resident_bytes())
    return {
        (m, n, kind): {
            "process": process,
            **synthetic_memory(layout.size, levels, args.pool),
            **round_memory(layout.size, levels, n, cfg, kind, layout.num_rows),
        }
        for m, (layout, _) in built.items()
        for kind in kinds
        for n in args.clients
    }


def refuse_beyond(needs: Needs, max_memory_gb: float) -> None:
    """Exit, naming each configuration's figure and parts, when one needs more than
    ``max_memory_gb`` GiB or than the machine has available.

    Parameters
    ----------
    needs : dict
        :func:`memory_needs`.
    max_memory_gb : float
        ``--max-memory-gb``.
    """
    available = available_bytes()
    limit = max_memory_gb * 2**30 if available is None else min(max_memory_gb * 2**30, available)
    refused = [
        f"{m} x {n}, {kind} round: needs ~{sum(parts.values()) / 2**30:.1f} GiB ("
        + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.2f}" for k, v in parts.items())
        + ")"
        for (m, n, kind), parts in needs.items()
        if sum(parts.values()) > limit
    ]
    if refused:
        why = f"--max-memory-gb {max_memory_gb:g}"
        if available is not None and available < max_memory_gb * 2**30:
            why = f"the {available / 2**30:.1f} GiB this machine has available"
        raise SystemExit(
            "refused before any round: more memory than " + why + "\n" + "\n".join(refused)
        )


def result_row(
    model: str, d: int, n: int, kind: str, need: dict[str, float], t: StepTimes, peak: int, low: int
) -> dict:
    """One configuration's row of ``server_bench.json``.

    Parameters
    ----------
    model : str
        The model.
    d : int
        Its parameters.
    n : int
        Clients of the round.
    kind : str
        The round kind.
    need : dict
        Its estimated memory by part (bytes).
    t : StepTimes
        Its steps.
    peak : int
        Its process's peak resident memory (bytes).
    low : int
        Its clients below capacity 1 (those whose mask is ranked).
    """
    return {
        "model": model,
        "d": d,
        "clients": n,
        "round": kind,
        "memory_gib": {k: v / 2**30 for k, v in need.items()},
        "project": t.project,
        "anchor": t.anchor,
        "cpu": t.cpu,
        "round_cpu": sum(t.cpu.values()),
        **t.extra,
        "round_project": sum(t.project.values()),
        "round_anchor": sum(v for v in t.anchor.values() if v is not None),
        "one_mask_seconds": t.project["select"] / max(1, low),
        "peak_rss_gib": peak / 2**30,
        "estimate_gib": sum(need.values()) / 2**30,
    }


def measure_all(
    built: Built,
    args: argparse.Namespace,
    cfg: RunConfig,
    levels: Sequence[float],
    kinds: Sequence[str],
    needs: Needs,
) -> tuple[list[dict], dict[str, list]]:
    """Every configuration's round, each in a forked process: the rows, and each model's download
    rows.

    Parameters
    ----------
    built : dict
        Each model's layout and global values.
    args : argparse.Namespace
        The command line (clients, pool, seed, repeat, out).
    cfg : RunConfig
        The run config.
    levels : Sequence[float]
        The capacity levels.
    kinds : Sequence[str]
        The round kinds.
    needs : dict
        :func:`memory_needs`.
    """
    results: list[dict] = []
    downloads: dict[str, list] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for model, (layout, x) in built.items():
            data = SyntheticRound(layout, x, args.pool, args.seed)
            downloads[model] = download_rows(data, cfg, levels)
            for kind, n in ((kind, n) for kind in kinds for n in args.clients):
                run = partial(repeated_rounds, data, cfg, n, levels, Path(tmp), args.repeat, kind)
                t, peak = in_own_process(run)
                low = sum(g < 1 for g in capacities_for(n, levels))
                row = result_row(model, layout.size, n, kind, needs[(model, n, kind)], t, peak, low)
                results.append(row)
                print(progress_line(row), flush=True)
            del data
    return results, downloads


def print_report(
    results: list[dict],
    downloads: dict[str, list],
    earlier: list[dict] | None,
) -> None:
    """The tables: steps, scaling lines, per client, masks, memory, checkpoint and downloads.

    Parameters
    ----------
    results : list[dict]
        This run's rows.
    downloads : dict
        Each model's :func:`download_rows`.
    earlier : list[dict], optional
        An earlier run's rows, shown beside this run's steps.
    """
    done = [r for r in results if "skipped" not in r]
    print()
    print(table(results, earlier))
    print()
    for line in scaling_lines(results):
        print(line)
    print()
    print(per_client_table(results))
    print()
    for r in done:
        print(
            f"{r['model']} x {r['clients']}, {kind_of(r)} round: "
            f"{r['one_mask_seconds']:.3f} s per mask below capacity 1"
        )
    print()
    print(memory_table(results))
    print()
    print(checkpoint_table(done))
    print()
    print(download_table(downloads))


def checkpoint_table(results: list[dict]) -> str:
    """Per round: the checkpoint, what the round wrote of it, and the next round's when one client
    re-uploads."""
    lines = [
        "| model | clients | round | checkpoint MiB | written by the round MiB "
        "| next round, one client re-uploaded: MiB written | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['clients']} | {kind_of(r)} | {r['checkpoint_mb']:.0f} "
            f"| {r.get('checkpoint_written_mb', r['checkpoint_mb']):.0f} "
            f"| {r['incremental_written_mb']:.0f} | {r['incremental_seconds']:.2f} |"
        )
    return "\n".join(lines)


def download_table(downloads: dict[str, list]) -> str:
    """Each model's :func:`download_rows` as a Markdown table."""
    columns = ("model", "capacity", "kept k", "mask kind", "mask bytes", "download bytes")
    columns += ("4k + d H(k/d)/8", "ratio")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for model, rows in downloads.items():
        for r in rows:
            lines.append(
                f"| {model} | {r['capacity']:g} | {r['kept']:,} | {r['mask_kind']} "
                f"| {r['mask_bytes']:,} | {r['download_bytes']:,} | {r['limit_bytes']:,.0f} "
                f"| {r['ratio']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    overrides: dict[str, object] = {}
    if args.fisher_memory_mb is not None:
        overrides["fisher-memory-mb"] = args.fisher_memory_mb
    if args.fisher_precision is not None:
        overrides["fisher-precision"] = args.fisher_precision
    cfg = parse_run_config(overrides)
    models = listed(args.models, list(IN_CHANNELS), "--models", "model")
    args.clients = [int(c) for c in args.clients.split(",")]
    kinds = listed(args.rounds, ROUND_KINDS, "--rounds", "round kind")
    # Read before anything is written: the earlier file may be the one this run replaces.
    earlier = None if args.earlier is None else json.loads(args.earlier.read_text())["rounds"]
    levels = [float(g) for g in args.capacities.split(",")]
    built = bench_models(models, args.seed)
    needs = memory_needs(built, args, cfg, levels, kinds)
    refuse_beyond(needs, args.max_memory_gb)
    args.out.mkdir(parents=True, exist_ok=True)
    results, downloads = measure_all(built, args, cfg, levels, kinds, needs)
    print_report(results, downloads, earlier)
    doc = {
        "command": "fibos bench-server " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {
            "capacities": levels,
            "pool": args.pool,
            "seed": args.seed,
            "repeat": args.repeat,
            "rounds": kinds,
            **overrides,
            "bench": BENCH_SETTINGS,
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
    """The run's guards of a Fisher-ranked mask, ``(min-per-row, keep-vectors)``, as the method
    passes them."""
    guards = cfg.options("mask-guards")
    return guards.min_per_row, guards.keep_vectors


if __name__ == "__main__":
    sys.exit(main())
