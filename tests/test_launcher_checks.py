"""The launcher refuses bad settings and busy folders before any process starts, and says why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import launcher
from cli.run_folder import LOCK_FILE, RunFolderBusy, RunFolderLock, new_log_folder
from common.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]

BAD_SETTINGS = [
    (["-c", "method='nope'"], "method='nope'"),
    (["-c", "lr=-1"], "lr=-1"),
    (["-c", "num-rounds=0"], "num-rounds=0"),
    (["--rounds", "0"], "num-rounds=0"),
    (["-c", "typo-key=1"], "typo-key"),
    (["--capacities", "1,,1"], "--capacities='1,,1': item 2 is empty"),
    (["--capacities", "1,1/4,"], "item 3 is empty"),
    (["-c", "data-path='/nonexistent'"], "data-path='/nonexistent'"),
    (
        ["-c", "dataset='cifar10' data-path='/nonexistent'"],
        "data-path='/nonexistent': no such file",
    ),
    (
        ["-c", "dataset='ag_news' model='hf' model-path='/nonexistent'"],
        "model-path='/nonexistent': no such model",
    ),
    (["--rounds", "2", "-c", "num-rounds=3"], "num-rounds=3 (from -c) and --rounds 2"),
    (["-c", "results-dir='/elsewhere'"], "results-dir='/elsewhere' (from -c) and --results"),
    (
        ["-c", "capacity-mix='1,1/4'"],
        "capacity-mix='1,1/4': applies only to nodes without a capacity",
    ),
]


@pytest.mark.parametrize(("argv", "named"), BAD_SETTINGS)
def test_each_bad_setting_is_refused_before_any_process_starts(
    argv, named, tmp_path, capsys, no_process
):
    results = tmp_path / "run"
    started = time.monotonic()
    try:
        code = launcher.main(["--results", str(results), *argv])
    except SystemExit as done:  # argparse's usage errors (a bad --capacities)
        code = done.code
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code != 0
    assert named in err, err
    assert elapsed < 5.0
    assert not (results / "logs").exists() and not (results / ".flwr").exists()


def test_matching_flag_and_key_are_accepted(tmp_path):
    same = launcher.merge_flag_settings(
        {"num-rounds": 3, "results-dir": str(tmp_path / "a" / ".." / "a")},
        {"num-rounds": ("--rounds 3", 3), "results-dir": ("--results", str(tmp_path / "a"))},
    )
    assert same["num-rounds"] == 3 and same["results-dir"] == str(tmp_path / "a")
    with pytest.raises(ConfigError, match="--rounds 3"):
        launcher.merge_flag_settings({"num-rounds": 3.0}, {"num-rounds": ("--rounds 3", 3)})


def test_the_command_line_exits_non_zero_with_the_key_on_stderr(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.fibos",
            "local",
            "--results",
            str(tmp_path / "run"),
            "-c",
            "lr=-1",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "lr=-1" in done.stderr and "greater than 0" in done.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_a_locked_folder_is_refused_naming_the_holder(tmp_path):
    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderBusy, match=f"launcher PID {os.getpid()}"):
            RunFolderLock(tmp_path).acquire()
    with RunFolderLock(tmp_path):  # released: free again
        pass


def test_a_dead_holder_frees_the_folder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from cli.run_folder import RunFolderLock; "
            f"RunFolderLock(__import__('pathlib').Path({str(tmp_path)!r})).acquire(); "
            "print('held', flush=True); time.sleep(600)",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"launcher PID {holder.pid}"):
            RunFolderLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunFolderLock(tmp_path):
        assert (tmp_path / LOCK_FILE).exists()


def test_each_launch_gets_its_own_log_folder_and_latest_follows(tmp_path):
    first = new_log_folder(tmp_path / "logs", "20260101T000000Z-1")
    (first / "superlink.log").write_text("first launch")
    second = new_log_folder(tmp_path / "logs", "20260101T000100Z-2")
    assert (tmp_path / "logs" / "latest").resolve() == second.resolve()
    assert (first / "superlink.log").read_text() == "first launch"
    with pytest.raises(FileExistsError):
        new_log_folder(tmp_path / "logs", "20260101T000100Z-2")


def test_a_failed_run_names_its_last_error_line(tmp_path):
    """``flwr run`` exits 0 when the ServerApp raised; the launcher still fails, with the exception
    line."""
    script = (
        "print('INFO : starting');"
        "print('\\x1b[91mERROR \\x1b[0m:     ServerApp raised an exception');"
        "print('Traceback (most recent call last):');"
        "print('  File \"app.py\", line 1, in main');"
        "print('common.config.schema.ConfigError: lr=-1: Input should be greater than 0');"
        "print('\\x1b[91mERROR \\x1b[0m:     Exit Code: 201')"
    )
    log = tmp_path / "serverapp.log"
    echoed: list[str] = []
    with pytest.raises(RuntimeError) as err:
        launcher.run_federation_command(
            [sys.executable, "-c", script], dict(os.environ), log, 60, echoed.append
        )
    assert (
        "the run failed: common.config.schema.ConfigError: lr=-1: Input should be greater than 0"
        in str(err.value)
    )
    assert str(log) in str(err.value)
    boxed = (
        "print('\\u256d\\u2500 Error \\u2500\\u256e');"
        "print('\\u2502 Connection to the SuperLink is unavailable. \\u2502');"
        "print('\\u2502 Please check your network. \\u2502'); print('\\u2570\\u2500\\u256f'); "
        "raise SystemExit(1)"
    )
    with pytest.raises(
        RuntimeError, match="Connection to the SuperLink is unavailable. Please check your network."
    ):
        launcher.run_federation_command(
            [sys.executable, "-c", boxed], dict(os.environ), log, 60, echoed.append
        )


def test_the_timeout_is_kept_by_the_clock_while_the_run_prints_nothing(tmp_path):
    """A run waiting for a node that never comes prints nothing; ``--timeout`` must end it all the
    same."""
    script = "import time; print('INFO : waiting for nodes', flush=True); time.sleep(60)"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="exceeded 1 s and was stopped"):
        launcher.run_federation_command(
            [sys.executable, "-c", script],
            dict(os.environ),
            tmp_path / "serverapp.log",
            1.0,
            lambda line: None,
        )
    assert time.monotonic() - started < 15  # it used to wait for the next line: here, 60 s
    assert "waiting for nodes" in (tmp_path / "serverapp.log").read_text()


def test_a_submission_through_the_control_api_is_validated_before_anything_is_sent(
    capsys, monkeypatch
):
    from cli import control

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be sent for a bad run config")

    monkeypatch.setattr(control.subprocess, "run", refuse)
    monkeypatch.setattr(control.subprocess, "Popen", refuse)
    code = control.main(
        ["submit", "--superlink", "127.0.0.1:1", "--insecure", "--app", str(ROOT), "-c", "lr=-1"]
    )
    assert code == 2
    assert "lr=-1" in capsys.readouterr().err


def test_the_schema_refuses_empty_capacity_items_and_a_data_path_without_use():
    from common.config.capacity import parse_capacity_list
    from common.config.parse import parse_run_config

    assert parse_capacity_list("") == () and parse_capacity_list(" 1, 1/3 ") == (1.0, 1 / 3)
    for bad in ("1,,1", "1,", ",1", " , "):
        with pytest.raises(ConfigError, match="capacity-mix=.*is empty"):
            parse_run_config({"capacity-mix": bad})
    for dataset in ("digits", "mnist5k"):
        with pytest.raises(
            ConfigError, match=f"data-path='/data' is set, but dataset='{dataset}' is built in"
        ):
            parse_run_config({"dataset": dataset, "data-path": "/data"})
