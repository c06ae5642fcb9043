"""Run and node configuration: parsing and validation.

A bad value fails fast with a ``ConfigError`` that names the key, the value and
the allowed range, before any training starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from common.datasets import DATASETS
from common.fisher_codec import FISHER_ENCODINGS
from common.models import MODELS
from common.partitioning import PARTITIONERS
from common.width_masks import WIDTH_MODELS

METHODS: tuple[str, ...] = ("fedfibos", "fiarse", "heterofl", "fedrolex", "fedavg", "fedavg-drop", "cahfp")
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
    resume: bool = False

    @property
    def upload_encoding(self) -> str:
        """Fisher encoding clients actually upload: ``none`` for methods that never read it."""
        return self.fisher_encoding if self.method == "fedfibos" else "none"


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
    "resume": _flag("resume"),
    "data-path": lambda v: v if isinstance(v, str) else _text("data-path")(v),
    "capacity-mix": lambda v: (parse_capacity_list(v), v)[1],  # validated, kept as the text
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
    if cfg.dataset == "ag_news":
        raise ConfigError(
            "dataset='ag_news' loads (token ids) but no text model exists yet; models: " + ", ".join(MODELS)
        )
    if cfg.partitioner == "natural" and cfg.dataset != "femnist":
        raise ConfigError(f"partitioner='natural' needs a dataset with natural groups (femnist), not {cfg.dataset!r}")
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
    capacity : float
        Fraction of the global model this node can hold, in (0, 1].
    device : str
        ``auto`` (cuda, then mps, then cpu), or a fixed ``cpu`` / ``cuda`` / ``mps``.
    client_id : str
        Stable name of this client; the server keys its Fisher state by it, so a
        restarted SuperNode (new node id) is recognised. Default: ``partition-<id>``.
    """

    partition_id: int
    num_partitions: int
    capacity: float
    device: str = "auto"
    client_id: str = ""

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
    if "capacity" in raw:
        capacity = _num("capacity", 0, 1, lo_open=True)(raw["capacity"])
    else:
        capacity = mix[partition_id % len(mix)]
    device = _choice("device", DEVICES)(raw.get("device", "auto"))
    client_id = _text("client-id")(raw["client-id"]) if "client-id" in raw else ""
    return NodeConfig(partition_id, num_partitions, capacity, device, client_id)
