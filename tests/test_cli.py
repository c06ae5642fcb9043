"""``fibos``: every subcommand's message reaches stderr with a non-zero exit, and its help names
it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cli import control, fibos, launcher  # noqa: F401 (imported here: torch's import runs ldconfig, a process)


def test_an_override_without_a_value_is_named_on_stderr(tmp_path: Path, capsys, no_process) -> None:
    code = fibos.main(
        ["local", "--capacities", "1,1/4", "--results", str(tmp_path / "run"), "-c", "lr"]
    )
    assert code != 0
    assert "run-config override 'lr' is not key=value" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_registration_without_trust_says_what_to_give(tmp_path: Path, capsys, no_process) -> None:
    pub = tmp_path / "edge-07.pub"
    pub.write_text("ecdsa-sha2-nistp384 AAAA edge-07\n")
    code = fibos.main(["control", "register", "--superlink", "127.0.0.1:28000", str(pub)])
    assert code != 0
    assert "give --root-certificates CA.crt (TLS), or --insecure" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["local", "--help"], "usage: fibos local [-h] [--capacities CAPACITIES]"),
        (["control", "--help"], "usage: fibos control [-h] {register,submit}"),
        (
            ["control", "register", "--help"],
            "usage: fibos control register [-h] --superlink SUPERLINK",
        ),
    ],
)
def test_a_subcommands_help_names_it(argv: list[str], usage: str, capsys) -> None:
    argv0 = sys.argv[0]
    assert fibos.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out
    assert "python -m server." not in out
    assert sys.argv[0] == argv0  # restored for the rest of the process


def test_an_unknown_or_missing_subcommand_is_said_without_a_traceback(capsys) -> None:
    assert fibos.main(["nosuch"]) == 2
    err = capsys.readouterr().err
    assert "No such command 'nosuch'" in err and "Traceback" not in err
    assert fibos.main([]) == 2  # the help, as `fibos --help` shows it
    shown = capsys.readouterr()
    assert (
        "Usage: fibos [OPTIONS] COMMAND" in shown.out + shown.err and "Traceback" not in shown.err
    )
