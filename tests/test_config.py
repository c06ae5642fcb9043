"""Run and node configuration: defaults match the manifest, bad values fail naming the key."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from cli.launcher import parse_capacities, parse_overrides, toml_overrides
from common.config.node import parse_node_config
from common.config.parse import default_run_config, parse_run_config
from common.config.schema import ConfigError

MANIFEST = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def test_manifest_defaults_parse_to_dataclass_defaults():
    raw = MANIFEST["tool"]["flwr"]["app"]["config"]
    assert parse_run_config(raw) == default_run_config()
    assert parse_run_config({}).flat() == default_run_config().flat()


@pytest.mark.parametrize(
    "key,value",
    [
        ("num-rounds", 0),
        ("num-rounds", 2.5),
        ("num-rounds", True),
        ("method", "fedsgd"),
        ("lr", 0),
        ("lr", float("nan")),
        ("momentum", 1.0),
        ("dirichlet-alpha", -1),
        ("fisher-encoding", "zip"),
        ("fisher-staleness-decay", 1.5),
        ("poll-interval", 0),
        ("results-dir", ""),
        ("seed", -1),
        ("partitioner", "shards"),
        ("model", "vit"),
    ],
)
def test_bad_run_value_names_key(key, value):
    with pytest.raises(ConfigError, match=key):
        parse_run_config({key: value})


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match="num-round"):
        parse_run_config({"num-round": 3})


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"num-partitions": 2, "capacity": 0.5}, "partition-id"),
        ({"partition-id": 0, "capacity": 0.5}, "num-partitions"),
        ({"partition-id": 0, "num-partitions": 2}, "capacity"),
        ({"partition-id": 2, "num-partitions": 2, "capacity": 0.5}, "partition-id"),
        ({"partition-id": 0, "num-partitions": 2, "capacity": 0}, "capacity"),
        ({"partition-id": 0, "num-partitions": 2, "capacity": 1.01}, "capacity"),
        ({"partition-id": 0, "num-partitions": 2, "capacity": 0.5, "device": "tpu"}, "device"),
    ],
)
def test_bad_node_config_names_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_node_config(raw)


def test_launcher_argument_parsing():
    assert parse_capacities("1, 1/2,0.25,1/16") == [1.0, 0.5, 0.25, 0.0625]
    for bad in ("0", "2", "x", "1/0x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_capacities(bad)
    assert parse_overrides("lr=0.1 method='fiarse' num-rounds=3") == {
        "lr": 0.1,
        "method": "fiarse",
        "num-rounds": 3,
    }
    values = {
        "lr": 0.1,
        "method": "fiarse",
        "results-dir": "/tmp/run-1",
        "flag": True,
        "num-rounds": 4,
    }
    assert parse_overrides(toml_overrides(values)) == values
    assert parse_overrides(["lr=0.1 seed=1", "lr=0.2"]) == {
        "lr": 0.2,
        "seed": 1,
    }  # repeated -c, later wins


def test_manifest_readme_tables_and_layout_are_generated_from_the_code():
    from cli.docs_reference import expected_files, readme_table

    for path, text in expected_files().items():
        assert path.read_text() == text, f"{path.name} is out of date: run `fibos docs --write`"
    assert readme_table().count("\n") == len(MANIFEST["tool"]["flwr"]["app"]["config"]) + 2
    assert "| `gmr-mode` | `sync` | `sync`, `async` |" in readme_table()
