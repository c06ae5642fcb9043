"""The node configuration (``--node-config``): what a SuperNode declares about itself.

Light like :mod:`common.config.run`: checking a node's settings loads neither torch nor the methods.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.config.capacity import CAPACITY_KINDS, parse_capacity_list
from common.config.schema import ConfigError
from common.data.client_seed import client_seed
from common.training.catalog import DEVICES


def _num(key: str, value: Any, lo: float, hi: float, lo_open: bool = False, integer: bool = False) -> int | float:
    """Node-config number check: ``value`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r}: expected a {'whole ' if integer else ''}number")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{key}={value!r}: expected a whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ConfigError(f"{key}={value!r}: allowed range is {'(' if lo_open else '['}{lo}, {hi}]")
    return int(value) if integer else float(value)


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
    capacity_kind : str or None
        What ``capacity`` limits (``capacity-kind``): ``bandwidth`` (a slow link: FedGMR may grow
        the submodel past it, to the full model) or ``memory`` (a hard cap). ``None``: the run's
        default (``gmr-capacity-kind``).
    data_path : str
        The node's own data (``data-path``, read in ``dataset = "node"`` runs): a folder or file on this
        machine (:mod:`common.data.node_data`). Such a node needs no partition (``partition_id`` ``None``) unless
        it also takes part in runs on a shared dataset.
    label_column, input_column : str
        Tables only (``label-column``, ``input-column``): the label column (default ``label``) and the
        image or text column (default: found by its usual names).
    """

    partition_id: int | None
    num_partitions: int | None
    capacity: float | None
    device: str = "auto"
    client_id: str = ""
    bench_delay_s: float = 0.0
    capacity_kind: str | None = None
    data_path: str = ""
    label_column: str = "label"
    input_column: str = ""

    @property
    def key(self) -> str:
        """The identity reported to the server (default: the partition, or this host and its data folder)."""
        if self.client_id:
            return self.client_id
        if self.partition_id is not None:
            return f"partition-{self.partition_id}"
        return f"{socket.gethostname()}:{self.data_path}"

    @property
    def stream(self) -> int:
        """This node's stream of the run's seed (local split, batch order): its partition, or a hash of its key."""
        return self.partition_id if self.partition_id is not None else client_seed(self.key) % 100_003


def parse_node_config(raw: Mapping[str, Any], capacity_mix: str = "") -> NodeConfig:
    """Validate a node configuration (``context.node_config``).

    Extra keys are ignored because Flower adds its own. A node without
    ``capacity`` (e.g. a simulated one, whose node config Flower fills with the
    partition only) takes ``capacity_mix[partition-id mod len]`` from the run
    config's ``capacity-mix``; with no mix it is an error.
    """
    mix = parse_capacity_list(capacity_mix)
    data_path = raw.get("data-path", "")
    if "data-path" in raw and (not isinstance(data_path, str) or not data_path.strip()):
        raise ConfigError(f"data-path={data_path!r}: expected the path of this node's data folder or file")
    # A node with its own data may also hold a partition (for runs on a shared dataset); without data-path it must.
    partitioned = not data_path or "partition-id" in raw or "num-partitions" in raw
    if data_path:
        example = "--node-config 'data-path=\"/data\" capacity=0.25'"
    else:
        example = "--node-config 'partition-id=0 num-partitions=6 capacity=0.25'"
    required = (("partition-id", "num-partitions") if partitioned else ()) + (
        () if mix and partitioned else ("capacity",)
    )
    for key in required:
        if key not in raw:
            raise ConfigError(f"node-config is missing {key!r} (e.g. {example})")
    for key in ("label-column", "input-column"):
        if key in raw and (not data_path or not isinstance(raw[key], str) or not raw[key]):
            raise ConfigError(f"{key}={raw[key]!r}: expected a column name, with data-path set")
    partition_id: int | None = None
    num_partitions: int | None = None
    if partitioned:
        num_partitions = int(_num("num-partitions", raw["num-partitions"], 1, 1_000_000, integer=True))
        partition_id = int(_num("partition-id", raw["partition-id"], 0, num_partitions - 1, integer=True))
    capacity: float | None
    if raw.get("capacity") == "auto":
        capacity = None
    elif "capacity" in raw:
        try:
            capacity = float(_num("capacity", raw["capacity"], 0, 1, lo_open=True))
        except ConfigError as err:
            raise ConfigError(f"{err} (or capacity=auto to measure the device)") from None
    else:
        assert partition_id is not None  # a node with data-path must set capacity (checked above)
        capacity = mix[partition_id % len(mix)]
    device = raw.get("device", "auto")
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: allowed values are {', '.join(DEVICES)}")
    client_id = raw.get("client-id", "")
    if "client-id" in raw and (not isinstance(client_id, str) or not client_id):
        raise ConfigError(f"client-id={client_id!r}: expected a non-empty string")
    delay = float(_num("bench-delay-s", raw["bench-delay-s"], 0, 3600)) if "bench-delay-s" in raw else 0.0
    kind = raw.get("capacity-kind")
    if kind is not None and kind not in CAPACITY_KINDS:
        raise ConfigError(f"capacity-kind={kind!r}: allowed values are {', '.join(CAPACITY_KINDS)}")
    return NodeConfig(
        partition_id,
        num_partitions,
        capacity,
        str(device),
        client_id,
        delay,
        kind,
        str(data_path),
        str(raw.get("label-column", "label")),
        str(raw.get("input-column", "")),
    )
