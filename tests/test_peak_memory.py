"""The client's peak-memory probe and its path to the benchmark table."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from benchmarks.benchmark import summarise
from common.training.peak_memory import PeakRSS, current_rss_bytes, lifetime_peak_rss_bytes

needs_proc = pytest.mark.skipif(
    current_rss_bytes() is None, reason="no /proc/self/statm on this platform"
)

MIB = 2**20


@needs_proc
def test_peak_sees_a_block_allocation_that_is_freed_before_the_block_ends():
    before = current_rss_bytes()
    with PeakRSS(interval_s=0.001) as peak:
        buf = np.ones(200 * MIB // 8)  # 200 MiB, touched so it is resident
        time.sleep(0.05)
        del buf
    after = current_rss_bytes()
    assert peak.peak_bytes >= before + 190 * MIB
    assert (
        after < peak.peak_bytes - 150 * MIB
    )  # freed: the peak, not the end state, is what is reported
    assert peak.peak_mib == peak.peak_bytes / MIB


@needs_proc
def test_peak_of_a_quiet_block_is_near_the_current_rss_not_the_lifetime_peak():
    with PeakRSS() as warm:
        big = np.ones(300 * MIB // 8)
        time.sleep(0.02)
        del big
    assert lifetime_peak_rss_bytes() >= warm.peak_bytes - 4 * MIB
    with PeakRSS() as quiet:
        time.sleep(0.02)
    assert quiet.peak_bytes < warm.peak_bytes - 250 * MIB


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        PeakRSS(interval_s=0)


def _row(method: str, peak: float) -> dict:
    return {
        "dataset": "digits",
        "partition": "iid",
        "method": method,
        "fisher_encoding": "none",
        "global_acc": 0.5,
        "global_acc_last": 0.5,
        "local_acc": 0.5,
        "kib_down_per_client_round": 1.0,
        "kib_up_per_client_round": 1.0,
        "client_train_s": 1.0,
        "client_fisher_s": 0.0,
        "server_s_per_round": 0.1,
        "client_peak_mib": peak,
    }


def test_summary_shows_the_peak_column_only_when_a_run_reported_one():
    with_peak = summarise([_row("fedavg", 512.0), _row("fiarse", math.nan)])
    assert "client peak MiB" in with_peak.splitlines()[0]
    assert "512 ± 0" in with_peak
    without = summarise([_row("fedavg", math.nan)])
    assert "client peak MiB" not in without
