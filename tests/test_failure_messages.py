"""Operator mistakes are refused at once, naming the flag or file, before any process starts or any
wait begins.

And a ``fibos control submit`` that runs past ``--timeout`` stops the run on the SuperLink instead
of leaving it running there while saying it was stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import control, fibos, launcher

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(fibos.COMMANDS))
def test_every_subcommands_help_shows_its_fibos_usage(name: str, capsys) -> None:
    assert fibos.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fibos {name} "), out[:200]
    # The module's own usage examples must be the command the operator types, not the module behind
    # it.
    examples = [line for line in out.splitlines() if line.strip().startswith("python -m ")]
    assert not examples, examples


def test_a_results_path_that_is_a_file_is_refused_naming_it(
    tmp_path: Path, capsys, no_process
) -> None:
    results = tmp_path / "results"
    results.write_text("not a folder")
    assert fibos.main(["local", "--capacities", "1", "--results", str(results)]) == 2
    assert f"error: --results {results} is a file, not a folder" in capsys.readouterr().err
    under = results / "run"
    assert fibos.main(["local", "--capacities", "1", "--results", str(under)]) == 2
    assert f"--results {under} lies under {results}, which is a file" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(
    value: str, tmp_path: Path, capsys, no_process
):
    with pytest.raises(SystemExit) as refused:  # argparse's usage error, as `fibos local` shows it
        launcher.main(["--capacities", "1", "--results", str(tmp_path), "--timeout", value])
    assert refused.value.code == 2
    assert f"argument --timeout: {value!r}" in capsys.readouterr().err


def test_a_file_error_of_the_launch_is_said_not_raised(
    tmp_path: Path, capsys, monkeypatch, no_process
) -> None:
    """What the checks cannot foresee (a lock file that cannot be written) still ends in one line
    naming it."""
    lock = tmp_path / ".fibos-run.lock"

    def refuse(self: launcher.LocalFederation) -> launcher.LocalFederation:
        raise PermissionError(13, "Permission denied", str(lock))

    monkeypatch.setattr(launcher.LocalFederation, "__enter__", refuse)
    assert fibos.main(["local", "--capacities", "1", "--results", str(tmp_path)]) == 1
    assert f"error: [Errno 13] Permission denied: '{lock}'" in capsys.readouterr().err


def test_a_submission_of_a_folder_without_an_app_is_refused_naming_it(
    tmp_path: Path, capsys, no_process
) -> None:
    code = fibos.main(
        ["control", "submit", "--superlink", "127.0.0.1:1", "--insecure", "--app", str(tmp_path)]
    )
    assert code == 2
    assert (
        f"error: {tmp_path} holds no pyproject.toml: it is not a Flower app folder"
        in capsys.readouterr().err
    )


def test_missing_certificate_or_key_files_are_refused_before_the_wait(
    tmp_path: Path, capsys, no_process
) -> None:
    """flwr would report either only as a SuperLink that does not answer, after the whole
    ``--wait``."""
    pub = tmp_path / "edge-07.pub"
    pub.write_text("ecdsa-sha2-nistp384 AAAA edge-07\n")
    ca = tmp_path / "ca.crt"
    base = ["control", "register", "--superlink", "127.0.0.1:1", "--wait", "300"]
    started = time.monotonic()
    assert fibos.main([*base, "--root-certificates", str(ca), str(pub)]) != 0
    assert f"error: --root-certificates {ca}: no such file" in capsys.readouterr().err
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    gone = tmp_path / "edge-08.pub"
    assert fibos.main([*base, "--root-certificates", str(ca), str(pub), str(gone)]) != 0
    assert f"error: no such public key file or folder: {gone}" in capsys.readouterr().err
    assert time.monotonic() - started < 30  # not the 300 s wait


def test_register_reads_a_folder_of_keys_and_an_empty_one_is_no_error(
    tmp_path: Path, capsys, monkeypatch, no_process
) -> None:
    """The coordinator's ``register`` one-shot reads a folder that stays empty until a node's key
    arrives."""
    calls: list[tuple[str, ...]] = []

    def flwr(
        env: dict[str, str], *argv: str, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        calls.append(argv)
        return subprocess.CompletedProcess(
            ["flwr", *argv], 0, json.dumps({"success": True, "nodes": []}), ""
        )

    monkeypatch.setattr(control, "_flwr", flwr)
    keys = tmp_path / "node-keys"
    keys.mkdir()
    (keys / "README.md").write_text("not a key")
    base = ["control", "register", "--superlink", "127.0.0.1:1", "--insecure", str(keys)]
    assert fibos.main(base) == 0
    assert "no public keys to register yet" in capsys.readouterr().out and calls == []
    for name in ("lab-pi-2", "lab-pi-1"):
        (keys / f"{name}.pub").write_text(f"ecdsa-sha2-nistp384 AAAA {name}\n")
    assert fibos.main(base) == 0
    registered = [argv[2] for argv in calls if argv[:2] == ("supernode", "register")]
    assert registered == [str(keys / "lab-pi-1.pub"), str(keys / "lab-pi-2.pub")]
    assert "lab-pi-1: registered" in capsys.readouterr().out


def _submit_past_its_timeout(
    monkeypatch, run_id: int | None, stop_reply: dict
) -> list[tuple[str, ...]]:
    """``fibos control submit`` whose run outlasts ``--timeout``; ``flwr stop`` answers
    ``stop_reply``."""
    calls: list[tuple[str, ...]] = []

    def flwr(
        env: dict[str, str], *argv: str, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        calls.append(argv)
        reply = {"success": True, "nodes": []} if argv[0] == "supernode" else stop_reply
        return subprocess.CompletedProcess(["flwr", *argv], 0, json.dumps(reply), "")

    def run(cmd, env, log, timeout, echo, connection=None) -> None:
        log.write_text("INFO : waiting for nodes\n")
        raise launcher.RunTimeout(
            f"the run exceeded {timeout:.0f} s and was stopped; see {log}", run_id
        )

    monkeypatch.setattr(control, "_flwr", flwr)
    monkeypatch.setattr(control, "run_federation_command", run)
    return calls


def test_a_submitted_run_past_its_timeout_is_stopped_on_the_superlink(
    monkeypatch, capsys, tmp_path
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    calls = _submit_past_its_timeout(monkeypatch, 7, {"success": True, "run-id": 7})
    argv = [
        "submit",
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
        "--app",
        str(ROOT),
        "--timeout",
        "20",
    ]
    assert control.main(argv) == 1
    assert ("stop", "7", "fibos", "--format", "json") in calls
    assert (
        "error: the run exceeded --timeout 20 s; run 7 was stopped on the SuperLink"
        in capsys.readouterr().err
    )


def test_a_run_that_could_not_be_stopped_is_said_to_run_on(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _submit_past_its_timeout(monkeypatch, 7, {"success": False, "error-message": "Run 7 not found"})
    argv = [
        "submit",
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
        "--app",
        str(ROOT),
        "--timeout",
        "20",
    ]
    assert control.main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "run 7 could not be stopped (Run 7 not found); it may still run: `flwr stop 7` ends it"
        in err
    )


def test_a_joining_nodes_missing_data_folder_is_refused_before_anything_is_made(
    tmp_path: Path, capsys
) -> None:
    from cli.credentials import make_ca
    from cli.join import main as join_main

    make_ca(tmp_path)
    data = tmp_path / "no-such-data"
    argv = [
        "--name",
        "edge-07",
        "--superlink",
        "127.0.0.1:1",
        "--root-certificates",
        str(tmp_path / "ca.crt"),
    ]
    argv += [
        "--no-register",
        "--capacity",
        "1",
        "--data-path",
        str(data),
        "--keys",
        str(tmp_path / "keys"),
    ]
    with pytest.raises(SystemExit) as refused:
        join_main(argv)
    assert refused.value.code == 2
    assert f"--data-path {data}: no such file or folder on this machine" in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()


_REFUSED_WITHOUT_TORCH = """
import sys
from cli.fibos import main
code = main(sys.argv[1:])
print("EXIT", code, "torch" in sys.modules, "common.methods.masked" in sys.modules)
"""


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["local", "--capacities", "1,1/4", "-c", "lr=x"], "lr='x'"),
        (
            ["local", "--capacities", "1,1/4", "-c", "method=fedrolex", "-c", "model=mlp"],
            "model='mlp'",
        ),
        (["local", "--capacities", "1,1/4", "-c", "fisher-every=0"], "fisher-every"),
        (["local", "--capacities", "1,1/4", "-c", "gmr-capacity-kind=memory"], "capacity-kind"),
        (
            [
                "control",
                "submit",
                "--superlink",
                "127.0.0.1:9",
                "--insecure",
                "-c",
                "width-roll=left",
            ],
            "width-roll",
        ),
    ],
)
def test_bad_settings_are_refused_without_importing_torch(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    """The schema and every method's keys and rules load without torch or any training code (a fresh
    process)."""
    if argv[0] == "local":
        argv = [*argv, "--results", str(tmp_path / "run")]
    out = subprocess.run(
        [sys.executable, "-c", _REFUSED_WITHOUT_TORCH, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "EXIT 2 False False" in out.stdout, out.stdout + out.stderr
    assert named in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()
