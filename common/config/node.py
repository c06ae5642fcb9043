"""The node configuration (``--node-config``): what a SuperNode declares about itself.

Light like :mod:`common.config.run`: checking a node's settings loads neither torch nor the methods.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from common.config.capacity import CAPACITY_KINDS, parse_capacity_list
from common.config.schema import ConfigError, Schema
from common.data.client_seed import client_seed
from common.training.catalog import DEVICES


def _num(
    key: str, value: Any, lo: float, hi: float, lo_open: bool = False, integer: bool = False
) -> int | float:
    """Node-config number check: ``value`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), naming
    ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r}: expected a {'whole ' if integer else ''}number")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{key}={value!r}: expected a whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ConfigError(f"{key}={value!r}: allowed range is {'(' if lo_open else '['}{lo}, {hi}]")
    return int(value) if integer else float(value)


def _node_field(default: Any, required: str, allowed: str, description: str) -> Any:
    """A node-config key: its default, when it is required, what it accepts, and its meaning
    (README's table)."""
    return Field(
        default,
        description=description,
        json_schema_extra={"required": required, "allowed": allowed},
    )


class NodeConfig(Schema):
    """Validated SuperNode configuration (``--node-config``), built by :func:`parse_node_config`.

    The field descriptions are the README's node-config table (``fibos docs``); ``capacity`` is
    ``None`` for ``capacity=auto`` (the ClientApp measures its device,
    :mod:`client.capacity_probe`), ``partition_id`` and ``num_partitions`` are ``None`` for a node
    that only has its own data, and ``capacity_kind`` ``None`` leaves it to the run's
    ``capacity-kind``.
    """

    partition_id: int | None = _node_field(
        None,
        "yes, without `data-path`",
        "`[0, num-partitions)`",
        "this node's partition of the run's shared dataset",
    )
    num_partitions: int | None = _node_field(
        None, "yes, without `data-path`", ">= 1", "partitions the training pool is split into"
    )
    data_path: str = _node_field(
        "",
        'for `dataset = "node"` runs',
        "path on the node's machine",
        "the node's own data instead of a partition (docs/guide/own-data.md)",
    )
    label_column: str = _node_field(
        "label",
        "no (`label`)",
        "column name",
        "tables (Parquet, CSV, `save_to_disk`): the label column",
    )
    input_column: str = _node_field(
        "",
        "no (`image`/`img`, or `text`/`sentence`/`content`)",
        "column name",
        "tables: the image column (images, or file paths relative to the table) or text column",
    )
    capacity: float | None = _node_field(
        None,
        "yes, unless the run sets `capacity-mix` (a node with `data-path` always)",
        '(0, 1] or `"auto"`',
        'fraction of the global model this node holds; `"auto"` measures the device '
        "(docs/guide/real-client.md)",
    )
    device: Literal[DEVICES] = _node_field(  # type: ignore[valid-type]
        "auto",
        "no (`auto`)",
        ", ".join(f"`{d}`" for d in DEVICES),
        "`auto`: CUDA, then MPS, then CPU",
    )
    client_id: str = _node_field(
        "",
        "no (`partition-<id>`, or `<host>:<data-path>`)",
        "string",
        "stable name; the server keys this client's Fisher state by it, so a restarted SuperNode "
        "(new node id) keeps it",
    )
    bench_delay_s: float = _node_field(
        0.0,
        "no (0)",
        "[0, 3600]",
        "TEST/BENCHMARK KNOB: extra seconds per local epoch, to emulate a slower device "
        "(`docs/design/fedgmr.md`)",
    )
    capacity_kind: Literal[CAPACITY_KINDS] | None = _node_field(  # type: ignore[valid-type]
        None,
        "no (the run's `capacity-kind`)",
        ", ".join(f"`{k}`" for k in CAPACITY_KINDS),
        "what `capacity` limits: `bandwidth` (a slow link; FedGMR may restore the submodel past "
        "it, up to `gmr-ceiling`) or `memory` (a hard cap); FedGMR reads it "
        "(`docs/design/fedgmr.md`), the other methods treat every capacity as a cap",
    )

    @property
    def key(self) -> str:
        """The identity reported to the server (default: the partition, or this host and its data
        folder)."""
        if self.client_id:
            return self.client_id
        if self.partition_id is not None:
            return f"partition-{self.partition_id}"
        return f"{socket.gethostname()}:{self.data_path}"

    @property
    def stream(self) -> int:
        """This node's stream of the run's seed (local split, batch order): its partition, or a hash
        of its key."""
        return (
            self.partition_id if self.partition_id is not None else client_seed(self.key) % 100_003
        )


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
        raise ConfigError(
            f"data-path={data_path!r}: expected the path of this node's data folder or file"
        )
    # A node with its own data may also hold a partition (for runs on a shared dataset); without
    # data-path it must.
    partitioned = not data_path or "partition-id" in raw or "num-partitions" in raw
    _check_keys(raw, data_path, partitioned, bool(mix))
    partition_id, num_partitions = _partition(raw, partitioned)
    capacity = _capacity(raw, partition_id, mix)
    device = raw.get("device", "auto")
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: allowed values are {', '.join(DEVICES)}")
    client_id = raw.get("client-id", "")
    if "client-id" in raw and (not isinstance(client_id, str) or not client_id):
        raise ConfigError(f"client-id={client_id!r}: expected a non-empty string")
    delay = (
        float(_num("bench-delay-s", raw["bench-delay-s"], 0, 3600))
        if "bench-delay-s" in raw
        else 0.0
    )
    kind = raw.get("capacity-kind")
    if kind is not None and kind not in CAPACITY_KINDS:
        raise ConfigError(f"capacity-kind={kind!r}: allowed values are {', '.join(CAPACITY_KINDS)}")
    return NodeConfig(
        partition_id=partition_id,
        num_partitions=num_partitions,
        capacity=capacity,
        device=str(device),
        client_id=client_id,
        bench_delay_s=delay,
        capacity_kind=kind,
        data_path=str(data_path),
        label_column=str(raw.get("label-column", "label")),
        input_column=str(raw.get("input-column", "")),
    )


def _check_keys(raw: Mapping[str, Any], data_path: Any, partitioned: bool, mixed: bool) -> None:
    """Refuse a node configuration that lacks a required key or sets a column without data.

    Parameters
    ----------
    raw : Mapping[str, Any]
        The node configuration, as :func:`parse_node_config` received it.
    data_path : Any
        Its ``data-path`` (``""`` when not set).
    partitioned : bool
        Whether the node holds a partition of the run's shared dataset.
    mixed : bool
        Whether the run sets a ``capacity-mix`` (a partitioned node may then leave out
        ``capacity``).
    """
    if data_path:
        example = "--node-config 'data-path=\"/data\" capacity=0.25'"
    else:
        example = "--node-config 'partition-id=0 num-partitions=6 capacity=0.25'"
    required = (("partition-id", "num-partitions") if partitioned else ()) + (
        () if mixed and partitioned else ("capacity",)
    )
    for key in required:
        if key not in raw:
            raise ConfigError(f"node-config is missing {key!r} (e.g. {example})")
    for key in ("label-column", "input-column"):
        if key in raw and (not data_path or not isinstance(raw[key], str) or not raw[key]):
            raise ConfigError(f"{key}={raw[key]!r}: expected a column name, with data-path set")


def _partition(raw: Mapping[str, Any], partitioned: bool) -> tuple[int | None, int | None]:
    """``(partition_id, num_partitions)`` of a partitioned node, ``(None, None)`` otherwise.

    Parameters
    ----------
    raw : Mapping[str, Any]
        The node configuration (holding both keys when ``partitioned``).
    partitioned : bool
        Whether the node holds a partition of the run's shared dataset.
    """
    partition_id: int | None = None
    num_partitions: int | None = None
    if partitioned:
        num_partitions = int(
            _num("num-partitions", raw["num-partitions"], 1, 1_000_000, integer=True)
        )
        partition_id = int(
            _num("partition-id", raw["partition-id"], 0, num_partitions - 1, integer=True)
        )
    return partition_id, num_partitions


def _capacity(
    raw: Mapping[str, Any],
    partition_id: int | None,
    mix: tuple[float, ...],
) -> float | None:
    """The node's capacity: its ``capacity`` key, ``None`` for ``auto``, else its share of ``mix``.

    Parameters
    ----------
    raw : Mapping[str, Any]
        The node configuration.
    partition_id : int or None
        The node's partition (set whenever ``capacity`` is missing, checked by :func:`_check_keys`).
    mix : tuple[float, ...]
        The run's ``capacity-mix``, parsed.
    """
    capacity: float | None
    if raw.get("capacity") == "auto":
        capacity = None
    elif "capacity" in raw:
        try:
            capacity = float(_num("capacity", raw["capacity"], 0, 1, lo_open=True))
        except ConfigError as err:
            raise ConfigError(f"{err} (or capacity=auto to measure the device)") from None
    else:
        assert partition_id is not None  # a node with data-path must set capacity (_check_keys)
        capacity = mix[partition_id % len(mix)]
    return capacity
