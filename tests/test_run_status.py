"""A run's outcome is the SuperLink's record of it: a broken log stream is followed again, a failed
run fails."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from cli import launcher
from cli.run_status import RunStatus, parse_run_status

FAKE_FLWR = """#!{python}
import json, sys
from pathlib import Path
state = Path({state!r})
doc = json.loads(state.read_text())
cmd = sys.argv[1]
doc["calls"].append(sys.argv[1:])
if cmd == "run":
    print("Successfully started run 7")
    print("[round 1/3] global acc 0.5000 loss 1.0000 | replies 2/2")
    # the stream breaks here: flwr run ends with status 0 while the run goes on
elif cmd == "ls":
    status = doc["statuses"].pop(0) if len(doc["statuses"]) > 1 else doc["statuses"][0]
    if status == "garbled":
        print("Connection refused")
    else:
        run = {{"run-id": "7", "status": status, "status-details": doc["details"]}}
        print(json.dumps({{"success": True, "runs": [run]}}))
elif cmd == "log":
    print("[round 2/3] global acc 0.6000 loss 0.9000 | replies 2/2")
    print("[round 3/3] global acc 0.7000 loss 0.8000 | replies 2/2")
state.write_text(json.dumps(doc))
"""


def _fake_flwr(
    tmp_path: Path, statuses: list[str], details: str = ""
) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"statuses": statuses, "details": details, "calls": []}))
    flwr = bin_dir / "flwr"
    flwr.write_text(FAKE_FLWR.format(python=sys.executable, state=str(state)))
    flwr.chmod(flwr.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, state


def _follow(tmp_path: Path, env: dict[str, str]) -> list[str]:
    echoed: list[str] = []
    launcher.run_federation_command(
        ["flwr", "run", ".", "fibos", "--stream"],
        env,
        tmp_path / "run.log",
        60,
        echoed.append,
        connection="fibos",
    )
    return echoed


def test_a_broken_stream_is_followed_again_and_a_failed_run_fails(tmp_path):
    env, state = _fake_flwr(
        tmp_path, ["running", "finished:failed"], details="ServerApp exited with code 201"
    )
    with pytest.raises(
        RuntimeError, match=r"the run failed \(finished:failed\): ServerApp exited with code 201"
    ):
        _follow(tmp_path, env)
    calls = json.loads(state.read_text())["calls"]
    assert [c[0] for c in calls] == ["run", "ls", "log", "ls"]
    assert calls[2] == ["log", "7", "fibos", "--stream"]
    log = (tmp_path / "run.log").read_text()
    assert "[round 3/3]" in log  # the rounds after the break are in the log too


def test_a_broken_stream_of_a_run_that_completes_succeeds_with_every_round_echoed(tmp_path):
    env, _ = _fake_flwr(tmp_path, ["running", "finished:completed"])
    echoed = _follow(tmp_path, env)
    assert any("following it again" in line for line in echoed)
    assert [line.split("]")[0] for line in echoed if line.startswith("[round")] == [
        "[round 1/3",
        "[round 2/3",
        "[round 3/3",
    ]


def test_a_stopped_run_fails_and_an_unreadable_status_falls_back_to_the_log(tmp_path):
    env, _ = _fake_flwr(tmp_path / "a", ["finished:stopped"])
    with pytest.raises(RuntimeError, match=r"finished:stopped"):
        _follow(tmp_path / "a", env)
    env, _ = _fake_flwr(tmp_path / "b", ["garbled"])
    echoed = _follow(tmp_path / "b", env)
    assert any("final status could not be read" in line for line in echoed)


def test_run_status_parses_flowers_json_and_says_why_it_cannot():
    doc = {
        "success": True,
        "runs": [{"run-id": "3", "status": "finished:completed", "status-details": ""}],
    }
    got = parse_run_status(json.dumps(doc), 3)
    assert (
        got == RunStatus("finished:completed")
        and got.succeeded
        and got.finished
        and not got.unfinished
    )
    assert parse_run_status(json.dumps(doc), 4).status == "unknown"
    assert (
        "did not answer"
        in parse_run_status(json.dumps({"success": False, "error-message": "x"}), 3).details
    )
    assert parse_run_status("Traceback ...", 3).status == "unknown"
    assert RunStatus("running").unfinished and not RunStatus("finished:failed").succeeded
