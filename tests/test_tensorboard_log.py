"""The optional TensorBoard writer: scalars that read back, and ``tensorboard=true`` refused without
its package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli import launcher
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from server import tensorboard_log
from server.tensorboard_log import TensorBoardLog, check_tensorboard, round_scalars

ROOT = Path(__file__).resolve().parents[1]
HINT = "pip install 'fibos-fl[tensorboard]'"


def _record(rnd: int) -> dict:
    if rnd == 0:  # the start record: central evaluation only
        return {
            "round": 0,
            "global": {"accuracy": 0.1, "loss": 2.3, "per_capacity": {}},
            "clients": [],
        }
    per_capacity = {
        "1": {"accuracy": 0.5 + 0.01 * rnd, "loss": 1.0},
        "0.25": {"accuracy": 0.3 + 0.01 * rnd},
    }
    return {
        "round": rnd,
        "global": {
            "accuracy": 0.5 + 0.01 * rnd,
            "loss": 1.5 - 0.1 * rnd,
            "per_capacity": per_capacity,
        },
        "local": {"accuracy": 0.6, "loss": 1.2} if rnd % 2 == 0 else None,
        "clients": [
            {"bytes_down": 1000 * rnd, "bytes_up": 10 * rnd},
            {"bytes_down": 500, "bytes_up": 5},
        ],
        "round_seconds": 1.5 * rnd,
    }


def test_round_scalars_name_what_the_record_holds():
    assert round_scalars(_record(0)) == {"global/accuracy": 0.1, "global/loss": 2.3}
    assert round_scalars(_record(2)) == {
        "global/accuracy": pytest.approx(0.52),
        "global/loss": pytest.approx(1.3),
        "local/accuracy": 0.6,
        "bytes/down": 2500.0,
        "bytes/up": 25.0,
        "time/round_seconds": 3.0,
        "per_capacity/1/accuracy": pytest.approx(0.52),
        "per_capacity/0.25/accuracy": pytest.approx(0.32),
    }
    assert "local/accuracy" not in round_scalars(_record(1))  # no federated evaluation that round


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_the_event_files_read_back_with_each_tag_at_its_round(tmp_path):
    folder = tmp_path / "results" / "tensorboard"
    log = TensorBoardLog(folder)
    for rnd in range(4):
        log.append(_record(rnd))
        if rnd == 1:  # flushed as each round ends: readable while the run goes on
            assert _scalars(folder)["global/accuracy"].keys() == {0, 1}
    log.close()
    got = _scalars(folder)
    assert set(got) == {
        "global/accuracy",
        "global/loss",
        "local/accuracy",
        "bytes/down",
        "bytes/up",
        "time/round_seconds",
        "per_capacity/1/accuracy",
        "per_capacity/0.25/accuracy",
    }
    assert got["global/accuracy"] == pytest.approx({0: 0.1, 1: 0.51, 2: 0.52, 3: 0.53})
    assert got["global/loss"] == pytest.approx({0: 2.3, 1: 1.4, 2: 1.3, 3: 1.2})
    assert got["local/accuracy"] == pytest.approx({2: 0.6})
    assert got["bytes/down"] == {1: 1500.0, 2: 2500.0, 3: 3500.0}
    assert got["bytes/up"] == {1: 15.0, 2: 25.0, 3: 35.0}
    assert got["time/round_seconds"] == {1: 1.5, 2: 3.0, 3: 4.5}
    assert got["per_capacity/0.25/accuracy"] == pytest.approx({1: 0.31, 2: 0.32, 3: 0.33})


def test_a_resume_hides_the_rounds_after_the_checkpoint(tmp_path):
    folder = tmp_path / "tensorboard"
    first = TensorBoardLog(folder)
    for rnd in range(5):  # killed after round 4, checkpoint at round 2
        first.append(_record(rnd))
    first.close()
    resumed = TensorBoardLog(folder, resume_after=2)
    resumed.append({**_record(3), "global": {"accuracy": 0.9, "loss": 0.1}})
    resumed.close()
    assert _scalars(folder)["global/accuracy"] == pytest.approx({0: 0.1, 1: 0.51, 2: 0.52, 3: 0.9})


def test_tensorboard_is_off_by_default_and_a_strict_bool():
    assert parse_run_config({}).tensorboard is False
    assert parse_run_config({"tensorboard": True}).tensorboard is True
    with pytest.raises(ConfigError, match="tensorboard='yes'"):
        parse_run_config({"tensorboard": "yes"})


def test_tensorboard_true_without_the_package_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(tensorboard_log, "tensorboard_available", lambda: False)
    check_tensorboard(parse_run_config({}))  # off: nothing to check
    with pytest.raises(ConfigError) as err:
        check_tensorboard(parse_run_config({"tensorboard": True}))
    assert "tensorboard=true" in str(err.value) and HINT in str(err.value)
    monkeypatch.setattr(tensorboard_log, "tensorboard_available", lambda: True)
    check_tensorboard(parse_run_config({"tensorboard": True}))


def test_fibos_local_refuses_it_before_any_process_starts(
    monkeypatch, tmp_path, capsys, no_process
):
    monkeypatch.setattr(tensorboard_log, "tensorboard_available", lambda: False)
    results = tmp_path / "run"
    assert launcher.main(["--results", str(results), "-c", "tensorboard=true"]) == 2
    err = capsys.readouterr().err
    assert "tensorboard=true" in err and HINT in err
    assert not (results / "logs").exists()


def test_the_serverapp_refuses_it_before_it_builds_or_writes_anything(monkeypatch, tmp_path):
    """A run submitted through the Control API has no launcher in front: the ServerApp refuses it
    itself."""
    from flwr.app import Context, RecordDict

    from server.app import main as serverapp_main

    monkeypatch.setattr(tensorboard_log, "tensorboard_available", lambda: False)
    results = tmp_path / "results"
    run_config = {**launcher.app_run_config(ROOT), "results-dir": str(results), "tensorboard": True}
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    with pytest.raises(ConfigError, match="tensorboard=true"):
        serverapp_main(None, context)
    assert not results.exists()


def test_the_package_is_found_when_installed():
    assert tensorboard_log.tensorboard_available()  # the dev extra installs it


def test_importing_the_module_does_not_load_tensorboard():
    code = (
        "import sys, server.tensorboard_log; assert 'torch.utils.tensorboard' not in sys.modules, "
        "'loaded'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_round_scalars_carry_the_nodes_figures_when_the_server_has_no_test_set():
    record = {
        "round": 3,
        "global": {},
        "federated": {
            "full_model": {"accuracy": 0.7, "loss": 0.9, "num_examples": 40, "nodes": 1},
            "per_capacity": {"1": {"accuracy": 0.7}, "0.25": {"accuracy": 0.4}, "0.0625": None},
            "all": {"accuracy": 0.6},
        },
    }
    assert round_scalars(record) == {
        "federated/accuracy": 0.7,
        "federated/loss": 0.9,
        "federated/per_capacity/1/accuracy": 0.7,
        "federated/per_capacity/0.25/accuracy": 0.4,
    }
