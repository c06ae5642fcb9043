"""Run and node configuration: parsing and validation.

A bad value fails fast with a ``ConfigError`` that names the key, the value and
the allowed range, before any training starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from common.datasets import DATASETS, TEXT_DATASETS
from common.fisher_codec import FISHER_ENCODINGS
from common.models import MODELS, TEXT_MODELS
from common.partitioning import PARTITIONERS
from common.restoration import RESTORE_RULES, SCHEDULES
from common.width_masks import WIDTH_MODELS

METHODS: tuple[str, ...] = ("fedfibos", "fiarse", "heterofl", "fedrolex", "fedavg", "fedavg-drop", "fedgmr", "cahfp")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the allowed range."""


def _num(
    key: str,
    lo: float | None,
    hi: float | None,
    lo_open: bool = False,
    integer: bool = False,
) -> Callable:
    def check(value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a {'whole ' if integer else ''}number")
        if integer and (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{key}={value!r}: expected a whole number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and value > hi
        if below or above:
            left = "(" if lo_open else "["
            raise ConfigError(f"{key}={value!r}: allowed range is {left}{lo}, {hi if hi is not None else 'inf'}]")
        return int(value) if integer else float(value)

    return check


def _choice(key: str, allowed: tuple[str, ...]) -> Callable:
    def check(value: Any) -> str:
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(allowed)}")
        return str(value)

    return check


def _flag(key: str) -> Callable:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value

    return check


def _text(key: str) -> Callable:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}={value!r}: expected a non-empty string")
        return value

    return check


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration (``[tool.flwr.app.config]``); see README for each key."""

    num_rounds: int = 10
    method: str = "fedfibos"
    dataset: str = "digits"
    model: str = "cnn"
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.2
    local_test_fraction: float = 0.2
    seed: int = 42
    local_epochs: int = 3
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    label_mask: bool = False
    server_lr: float = 1.0
    fisher_encoding: str = "masked"
    fisher_batches: int = 0
    fisher_ema: float = 0.0
    fisher_staleness_decay: float = 0.7
    fisher_trim: float = 0.1
    fisher_precision: str = "fp32"
    fisher_memory_mb: float = 4096.0
    min_per_row: int = 1
    eval_every: int = 5
    round_timeout: float = 300.0
    poll_interval: float = 0.2
    results_dir: str = "results"
    capacity_mix: str = ""
    data_path: str = ""
    min_replies: int = 1
    min_nodes: int = 1
    resume: bool = False
    # FedGMR (method "fedgmr"): common/restoration.py, common/async_aggregation.py, server/async_rounds.py
    gmr_schedule: str = "linear"
    gmr_start: float = 0.25
    gmr_ceiling: float = 1.0
    gmr_restore_rounds: int = 10
    gmr_step_factor: float = 2.0
    gmr_selection: str = "random"
    gmr_mode: str = "sync"
    gmr_staleness_exponent: float = 0.5
    gmr_max_staleness: int = 10
    gmr_server_lr: float = 0.5
    gmr_eval_updates: int = 0

    @property
    def upload_encoding(self) -> str:
        """Fisher encoding clients actually upload: ``none`` for methods that never read it."""
        reads_fisher = self.method == "fedfibos" or (self.method == "fedgmr" and self.gmr_selection == "fisher")
        return self.fisher_encoding if reads_fisher else "none"


_RUN_CHECKS: dict[str, Callable] = {
    "num-rounds": _num("num-rounds", 1, 100_000, integer=True),
    "method": _choice("method", METHODS),
    "dataset": _choice("dataset", DATASETS),
    "model": _choice("model", MODELS),
    "partitioner": _choice("partitioner", PARTITIONERS),
    "dirichlet-alpha": _num("dirichlet-alpha", 0, None, lo_open=True),
    "classes-per-client": _num("classes-per-client", 1, 100_000, integer=True),
    "test-fraction": _num("test-fraction", 0, 0.9, lo_open=True),
    "local-test-fraction": _num("local-test-fraction", 0, 0.9, lo_open=True),
    "seed": _num("seed", 0, 2**32 - 1, integer=True),
    "local-epochs": _num("local-epochs", 1, 1000, integer=True),
    "batch-size": _num("batch-size", 1, 65_536, integer=True),
    "lr": _num("lr", 0, 10, lo_open=True),
    "momentum": _num("momentum", 0, 0.999),
    "weight-decay": _num("weight-decay", 0, 1),
    "proximal-mu": _num("proximal-mu", 0, 100),
    "label-mask": _flag("label-mask"),
    "server-lr": _num("server-lr", 0, 10, lo_open=True),
    "fisher-encoding": _choice("fisher-encoding", FISHER_ENCODINGS),
    "fisher-batches": _num("fisher-batches", 0, 1_000_000, integer=True),
    "fisher-ema": _num("fisher-ema", 0, 0.99),
    "fisher-staleness-decay": _num("fisher-staleness-decay", 0, 1),
    "fisher-trim": _num("fisher-trim", 0, 0.45),
    "fisher-precision": _choice("fisher-precision", ("fp32", "fp16")),
    "fisher-memory-mb": _num("fisher-memory-mb", 1, 10_000_000),
    "min-per-row": _num("min-per-row", 0, 1_000_000, integer=True),
    "eval-every": _num("eval-every", 0, 100_000, integer=True),
    "round-timeout": _num("round-timeout", 0, 86_400, lo_open=True),
    "poll-interval": _num("poll-interval", 0.01, 10),
    "results-dir": _text("results-dir"),
    "min-replies": _num("min-replies", 1, 1_000_000, integer=True),
    "min-nodes": _num("min-nodes", 1, 1_000_000, integer=True),
    "resume": _flag("resume"),
    "data-path": lambda v: v if isinstance(v, str) else _text("data-path")(v),
    "capacity-mix": lambda v: (parse_capacity_list(v), v)[1],  # validated, kept as the text
    "gmr-schedule": _choice("gmr-schedule", SCHEDULES),
    "gmr-start": _num("gmr-start", 0, 1, lo_open=True),
    "gmr-ceiling": _num("gmr-ceiling", 0, 1, lo_open=True),
    "gmr-restore-rounds": _num("gmr-restore-rounds", 1, 1_000_000, integer=True),
    "gmr-step-factor": _num("gmr-step-factor", 1, 1000, lo_open=True),
    "gmr-selection": _choice("gmr-selection", RESTORE_RULES),
    "gmr-mode": _choice("gmr-mode", ("sync", "async")),
    "gmr-staleness-exponent": _num("gmr-staleness-exponent", 0, 10),
    "gmr-max-staleness": _num("gmr-max-staleness", 0, 1_000_000, integer=True),
    "gmr-server-lr": _num("gmr-server-lr", 0, 10, lo_open=True),
    "gmr-eval-updates": _num("gmr-eval-updates", 0, 1_000_000, integer=True),
}


def parse_capacity_list(value: Any, key: str = "capacity-mix") -> tuple[float, ...]:
    """``"1,1/4,1/16"`` -> capacities, each in (0, 1]; ``""`` -> none. Errors name ``key``."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string like '1,1/4,1/16'")
    out = []
    for item in filter(None, (i.strip() for i in value.split(","))):
        num, _, den = item.partition("/")
        try:
            gamma = float(num) / float(den) if den else float(num)
        except (ValueError, ZeroDivisionError) as err:
            raise ConfigError(f"{key}={value!r}: {item!r} is not a number or fraction") from err
        if not 0 < gamma <= 1:
            raise ConfigError(f"{key}={value!r}: {item!r} is outside (0, 1]")
        out.append(gamma)
    return tuple(out)


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate a run configuration (e.g. ``context.run_config``).

    Unknown keys are rejected too, so a typo never silently falls back to a default.
    """
    unknown = sorted(set(raw) - set(_RUN_CHECKS))
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {unknown}; known keys: {sorted(_RUN_CHECKS)}")
    defaults = {f.name: f.default for f in fields(RunConfig)}
    values = {}
    for key, check in _RUN_CHECKS.items():
        attr = key.replace("-", "_")
        values[attr] = check(raw[key]) if key in raw else defaults[attr]
    cfg = RunConfig(**values)
    if (cfg.dataset in TEXT_DATASETS) != (cfg.model in TEXT_MODELS):
        raise ConfigError(
            f"model={cfg.model!r} does not fit dataset={cfg.dataset!r}: text datasets ({', '.join(TEXT_DATASETS)}) "
            f"take text models ({', '.join(TEXT_MODELS)}), image datasets the others"
        )
    if cfg.partitioner == "natural" and cfg.dataset != "femnist":
        raise ConfigError(f"partitioner='natural' needs a dataset with natural groups (femnist), not {cfg.dataset!r}")
    if cfg.method == "fedgmr" and cfg.gmr_mode == "async" and cfg.resume:
        raise ConfigError("resume=true: the asynchronous FedGMR loop (gmr-mode='async') has no rounds to resume from")
    if cfg.method in ("heterofl", "fedrolex", "cahfp") and cfg.model not in WIDTH_MODELS:
        raise ConfigError(
            f"method={cfg.method!r} needs a channel graph for model={cfg.model!r}; available for: "
            f"{', '.join(WIDTH_MODELS)}"
        )
    return cfg


@dataclass(frozen=True)
class NodeConfig:
    """Validated SuperNode configuration (``--node-config``).

    Parameters
    ----------
    partition_id : int
        This node's data partition, in ``[0, num_partitions)``.
    num_partitions : int
        Number of partitions the training pool is split into.
    capacity : float or None
        Fraction of the global model this node can hold, in (0, 1]; ``None``
        for ``capacity=auto``: the ClientApp measures its device and maps it to
        a share (``client.capacity_probe``).
    device : str
        ``auto`` (cuda, then mps, then cpu), or a fixed ``cpu`` / ``cuda`` / ``mps``.
    client_id : str
        Stable name of this client; the server keys its Fisher state by it, so a
        restarted SuperNode (new node id) is recognised. Default: ``partition-<id>``.
    bench_delay_s : float
        TEST/BENCHMARK KNOB ONLY (``bench-delay-s``): extra seconds the node waits per
        local epoch, to emulate a slower device in wall-clock comparisons. Default 0.
    """

    partition_id: int
    num_partitions: int
    capacity: float | None
    device: str = "auto"
    client_id: str = ""
    bench_delay_s: float = 0.0

    @property
    def key(self) -> str:
        """The identity reported to the server."""
        return self.client_id or f"partition-{self.partition_id}"


def parse_node_config(raw: Mapping[str, Any], capacity_mix: str = "") -> NodeConfig:
    """Validate a node configuration (``context.node_config``).

    Extra keys are ignored because Flower adds its own. A node without
    ``capacity`` (e.g. a simulated one, whose node config Flower fills with the
    partition only) takes ``capacity_mix[partition-id mod len]`` from the run
    config's ``capacity-mix``; with no mix it is an error.
    """
    mix = parse_capacity_list(capacity_mix)
    required = ("partition-id", "num-partitions") + (() if mix else ("capacity",))
    for key in required:
        if key not in raw:
            raise ConfigError(
                f"node-config is missing {key!r} (e.g. --node-config 'partition-id=0 num-partitions=6 capacity=0.25')"
            )
    num_partitions = _num("num-partitions", 1, 1_000_000, integer=True)(raw["num-partitions"])
    partition_id = _num("partition-id", 0, num_partitions - 1, integer=True)(raw["partition-id"])
    capacity: float | None
    if raw.get("capacity") == "auto":
        capacity = None
    elif "capacity" in raw:
        try:
            capacity = _num("capacity", 0, 1, lo_open=True)(raw["capacity"])
        except ConfigError as err:
            raise ConfigError(f"{err} (or capacity=auto to measure the device)") from None
    else:
        capacity = mix[partition_id % len(mix)]
    device = _choice("device", DEVICES)(raw.get("device", "auto"))
    client_id = _text("client-id")(raw["client-id"]) if "client-id" in raw else ""
    delay = _num("bench-delay-s", 0, 3600)(raw["bench-delay-s"]) if "bench-delay-s" in raw else 0.0
    return NodeConfig(partition_id, num_partitions, capacity, device, client_id, delay)
