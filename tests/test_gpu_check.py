"""``fibos check-gpu`` on a machine without a GPU: the CPU side of every check, its comparisons and
its report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli import gpu_check
from cli.gpu_check import Check, Devices, relative_distance, topk_overlap

CPU = Devices(torch.device("cpu"), torch.device("cpu"))


def test_relative_distance_and_topk_overlap_are_exact() -> None:
    a = np.array([3.0, 4.0, 0.0], dtype=np.float32)
    assert relative_distance(a, a) == 0.0
    assert relative_distance(np.zeros(3, np.float32), np.zeros(3, np.float32)) == 0.0
    assert relative_distance(a, np.zeros(3, np.float32)) == float("inf")
    assert relative_distance(np.zeros(3, np.float32), a) == pytest.approx(1.0)
    x = np.array([5.0, 1.0, 4.0, 0.5, 3.0, 2.0], dtype=np.float32)
    y = np.array([5.0, 4.0, 1.0, 0.5, 3.0, 2.0], dtype=np.float32)
    assert topk_overlap(x, x, 0.5) == 1.0
    # top 3 of x: {0, 2, 4}; of y: {0, 1, 4}
    assert topk_overlap(x, y, 0.5) == pytest.approx(2 / 3)
    assert topk_overlap(x, -x, 1 / 6) == 0.0


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal of a machine without a GPU"
)
def test_a_cuda_node_without_a_gpu_refuses_at_discovery_with_the_reason() -> None:
    check = gpu_check.discovery(CPU)
    assert check.status == "pass", check
    error = check.rows[0]["error"]
    assert "device=cuda" in error and "no CUDA device" in error and "device=cpu" in error


def test_training_and_fisher_compare_the_cpu_with_itself_exactly() -> None:
    run = gpu_check._run_config({"model": "cnn"})
    rounds = gpu_check.compare_rounds("train-cnn", run, CPU, (1.0, 0.0625))
    assert rounds.status == "pass", rounds
    assert [r["capacity"] for r in rounds.rows] == [1.0, 0.0625]
    for row in rounds.rows:
        assert row["update_rel_diff"] == 0.0 and row["loss_rel_diff"] == 0.0
        assert row["examples"] > 0 and row["cpu_s_per_example"] > 0 and row["peak_gpu_mib"] is None
    fisher = gpu_check.compare_fisher("fisher-cnn", run, CPU, 6, (0.25, 0.0625))
    assert fisher.status == "pass", fisher
    assert all(r["vectorised"] and r["overlap"] >= gpu_check.MASK_OVERLAP for r in fisher.rows)


def test_a_lora_round_on_the_tiny_text_model(text_setup) -> None:
    model_path, data_path = text_setup
    check = gpu_check.lora(
        CPU, model_path, {"dataset": "ag_news", "data-path": data_path, "text-length": 12}
    )
    assert check.status == "pass", check
    assert [r["capacity"] for r in check.rows] == [1.0, 0.25] and check.rows[0][
        "update_rel_diff"
    ] == 0.0
    assert gpu_check.lora(CPU, None, {}).status == "skipped"


def test_a_failing_path_is_a_failed_check_and_the_exit_status(tmp_path, monkeypatch) -> None:
    def broken(devices: Devices) -> Check:
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(gpu_check, "probe", broken)
    monkeypatch.setattr(
        gpu_check, "compare_rounds", lambda name, *a: Check(name, "pass", "stand-in")
    )
    monkeypatch.setattr(
        gpu_check, "compare_fisher", lambda name, *a: Check(name, "pass", "stand-in")
    )
    code = gpu_check.main(["--out", str(tmp_path), "--no-federation"])
    assert code == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["probe"] == {
        "name": "probe",
        "status": "fail",
        "detail": "RuntimeError: the probe broke",
        "rows": [],
    }
    assert by_name["lora"]["status"] in ("skipped", "pass") and "federation" not in by_name
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| probe | fail | RuntimeError: the probe broke |" in md
    assert report["tolerances"]["update_rtol"] == gpu_check.UPDATE_RTOL


def test_markdown_report_has_one_table_per_check_with_rows() -> None:
    checks = [
        Check("a", "pass", "x|y", [{"capacity": 1.0, "s": 0.12345}]),
        Check("b", "skipped", "why"),
    ]
    md = gpu_check.markdown_report(checks)
    assert "| a | pass | x/y |" in md and "| b | skipped | why |" in md
    assert "## a" in md and "| 1 | 0.123 |" in md and "## b" not in md


def test_only_runs_the_named_checks_and_refuses_unknown_names(tmp_path, capsys) -> None:
    assert gpu_check.main(["--out", str(tmp_path), "--only", "environment,probe"]) == 0
    names = [c["name"] for c in json.loads((tmp_path / "gpu-check.json").read_text())["checks"]]
    assert names == ["environment", "probe"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--only", "probe,warp-drive"])
    assert "warp-drive" in capsys.readouterr().err


def test_the_launcher_puts_each_nodes_device_in_its_node_config(tmp_path) -> None:
    from cli.launcher import LocalFederation, main

    fed = LocalFederation([1.0, 0.25], tmp_path / "run", devices=["cuda", "cpu"])
    assert fed.node_config(0) == 'partition-id=0 num-partitions=2 capacity=1.0 device="cuda"'
    assert fed.node_config(1).endswith('capacity=0.25 device="cpu"')
    assert (
        LocalFederation([1.0], tmp_path / "run").node_config(0)
        == "partition-id=0 num-partitions=1 capacity=1.0"
    )
    with pytest.raises(ValueError, match="tpu"):
        LocalFederation([1.0], tmp_path / "run", devices=["tpu"])
    with pytest.raises(ValueError, match="one entry per SuperNode"):
        LocalFederation([1.0, 0.5], tmp_path / "run", devices=["cpu"])
    for bad in ("cpu", "cpu,tpu"):
        with pytest.raises(SystemExit):
            main(["--capacities", "1,1/4", "--devices", bad, "--results", str(tmp_path / "r")])
