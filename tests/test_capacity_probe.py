"""capacity=auto: the device probe and the rule that maps it to gamma."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from client.capacity_probe import (
    MIN_CAPACITY,
    REFERENCE_GFLOPS,
    REFERENCE_MEMORY_GIB,
    DeviceProbe,
    cached_probe,
    capacity_from_probe,
    probe_device,
)
from common.config.node import parse_node_config
from common.config.schema import ConfigError

LADDER = {1.0, 0.5, 0.25, 0.125, 0.0625}


@pytest.mark.parametrize(
    ("memory", "gflops", "gamma"),
    [
        (REFERENCE_MEMORY_GIB, REFERENCE_GFLOPS, 1.0),  # the reference machine
        (64.0, 5000.0, 1.0),  # a GPU box: capped at the full model
        (4.0, 5.0, 1 / 16),  # a Raspberry Pi 4 class board: throughput-bound, clamped at 1/16
        (4.0, 1000.0, 0.5),  # plenty of compute, half the reference memory
        (3.9, 1000.0, 0.25),  # just under half: rounded down, never up
        (16.0, 60.0, 0.25),  # 60/200 = 0.3 -> 1/4
        (0.1, 0.1, 1 / 16),
    ],
)
def test_rule_examples(memory: float, gflops: float, gamma: float) -> None:
    assert capacity_from_probe(memory, gflops) == gamma


@given(
    st.floats(0.01, 1e4, allow_nan=False),
    st.floats(0.01, 1e6, allow_nan=False),
)
def test_rule_properties(memory: float, gflops: float) -> None:
    gamma = capacity_from_probe(memory, gflops)
    assert gamma in LADDER
    ratio = min(1.0, memory / REFERENCE_MEMORY_GIB, gflops / REFERENCE_GFLOPS)
    # never above what was measured (except the 1/16 floor), and within one rung of it
    assert gamma <= max(ratio * (1 + 1e-9), MIN_CAPACITY)
    assert gamma == MIN_CAPACITY or gamma > ratio / 2
    # more memory or more speed never lowers the share
    assert capacity_from_probe(memory * 2, gflops) >= gamma
    assert capacity_from_probe(memory, gflops * 2) >= gamma


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_rule_rejects_bad_measurements(bad: float) -> None:
    with pytest.raises(ValueError, match="memory_gib"):
        capacity_from_probe(bad, 10.0)
    with pytest.raises(ValueError, match="gflops"):
        capacity_from_probe(8.0, bad)


def test_probe_measures_this_cpu() -> None:
    probe = probe_device(torch.device("cpu"), probe_seconds=0.05)
    assert probe.device == "cpu"
    assert 0 < probe.memory_gib < 1e5
    assert 0 < probe.gflops < 1e6
    assert probe.capacity == capacity_from_probe(probe.memory_gib, probe.gflops)


def test_probe_is_cached_per_node(tmp_path) -> None:
    first = cached_probe(torch.device("cpu"), tmp_path, probe_seconds=0.05)
    (file,) = tmp_path.glob("capacity-probe-*.json")
    # a later message reads the first measurement instead of measuring again (so gamma cannot drift)
    file.write_text(file.read_text().replace(repr(first.gflops), "12345.0"))
    again = cached_probe(torch.device("cpu"), tmp_path, probe_seconds=0.05)
    assert isinstance(again, DeviceProbe) and again.gflops == 12345.0
    file.write_text("{not json")  # a damaged cache is measured again, not trusted
    assert (
        cached_probe(torch.device("cpu"), tmp_path, probe_seconds=0.05).memory_gib
        == first.memory_gib
    )


def test_node_config_accepts_auto_and_names_it_in_errors() -> None:
    node = parse_node_config({"partition-id": 0, "num-partitions": 2, "capacity": "auto"})
    assert node.capacity is None
    with pytest.raises(ConfigError, match="capacity.*capacity=auto"):
        parse_node_config({"partition-id": 0, "num-partitions": 2, "capacity": "fast"})
