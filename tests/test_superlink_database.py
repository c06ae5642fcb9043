"""``fibos local --superlink-database``: where the SuperLink keeps its state, and how a locked
database is reported.

The federation itself under a held lock: ``tests/test_superlink_lock.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cli.launcher import (
    MEMORY_DATABASE,
    LocalFederation,
    database_diagnosis,
    main,
    superlink_database,
)


def test_the_flag_takes_memory_or_a_file_in_an_existing_folder(tmp_path: Path) -> None:
    assert superlink_database("memory") == superlink_database("MEMORY") == MEMORY_DATABASE
    assert superlink_database(str(tmp_path / "state.db")) == str((tmp_path / "state.db").resolve())
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        superlink_database(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        superlink_database(str(tmp_path / "no-such-folder" / "state.db"))
    with pytest.raises(argparse.ArgumentTypeError, match="memory or a file path"):
        superlink_database(" ")


def test_a_bad_database_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "--capacities",
                "1",
                "--results",
                str(tmp_path / "run"),
                "--superlink-database",
                str(tmp_path),
            ]
        )
    assert exited.value.code == 2
    assert "--superlink-database" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_launch_database_defaults_to_a_file_of_the_launch(tmp_path: Path) -> None:
    default = LocalFederation([1.0], tmp_path)
    assert default.database_path == str(default.flwr_home / "state.db")
    assert (
        LocalFederation([1.0], tmp_path, database=MEMORY_DATABASE).database_path == MEMORY_DATABASE
    )
    assert (
        LocalFederation([1.0], tmp_path, database="/srv/state.db").database_path == "/srv/state.db"
    )


def test_a_locked_database_in_the_superlink_log_is_named_with_what_to_do(tmp_path: Path) -> None:
    log = tmp_path / "superlink.log"
    log.write_text("INFO: ControlServicer.StartRun\n")
    assert database_diagnosis(log, "/x/state.db") == ""
    assert database_diagnosis(tmp_path / "missing.log", "/x/state.db") == ""
    log.write_text(
        "ERROR: [/v1/runtime/push-messages][UnexpectedError:OperationalError] "
        "(sqlite3.OperationalError) database is locked\nERROR: [/v1/fleet/pull-messages] ... "
        "database is locked\n"
    )
    why = database_diagnosis(log, "/x/state.db")
    assert why.startswith(
        "the SuperLink's database /x/state.db was locked ('database is locked', 2 times in "
    )
    assert "--superlink-database memory" in why and "resume=true" in why
    earlier = (
        log.stat().st_size
    )  # what an earlier run of the same SuperLink logged is not this run's cause
    assert database_diagnosis(log, "/x/state.db", since=earlier) == ""
    with open(log, "a") as more:
        more.write("ERROR: [/v1/runtime/push-messages] ... database is locked\n")
    assert "('database is locked', once in" in database_diagnosis(log, "/x/state.db", since=earlier)
