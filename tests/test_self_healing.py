"""Runs that heal themselves: the ServerApp and the SuperLink killed mid-run, SuperNodes killed and
restarted.

The federation tests kill processes from outside, as a crash or the OOM killer would, and check that
the run ends without a person, at the uninterrupted run's model to the bit, with a record of each
restart.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import torch

from cli.launcher import LocalFederation, main
from cli.restarts import RestartPolicy, record_restart
from server.persistence import MetricsLog
from server.restart_log import RESUBMITTED, last_recorded_round, note_resume, restart_record
from server.round_log import ROUNDS_JSONL, RoundLog, read_rounds
from tests.federation_progress import checkpointed_round, wait_for_round, wait_until


def test_restart_waits_double_up_to_the_most() -> None:
    policy = RestartPolicy(attempts=5, backoff_s=2.0, max_backoff_s=10.0)
    assert [policy.wait_s(done) for done in range(5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    with pytest.raises(ValueError, match="attempts"):
        RestartPolicy(attempts=-1)
    with pytest.raises(ValueError, match="back-off"):
        RestartPolicy(backoff_s=-1.0)


def test_a_restart_record_survives_the_resumed_runs_rewrite_of_both_files(tmp_path: Path) -> None:
    run = {"num_rounds": 5}
    metrics, rounds = MetricsLog(tmp_path / "metrics.json", run), RoundLog(tmp_path / ROUNDS_JSONL)
    for rnd in range(4):
        metrics.append({"round": rnd})
        rounds.append({"round": rnd})
    with open(tmp_path / ROUNDS_JSONL, "a") as f:
        f.write('{"round": 4, "glob')  # the line the kill tore
    assert last_recorded_round(tmp_path) == 3
    record = restart_record(1, "serverapp", "the run failed: killed", 2, 3, 1_800_000_000.0)
    assert record["rounds_redone"] == 2 and record["failed_at"].startswith("2027-01-15T08:00:00")
    record_restart(tmp_path, record)
    assert [r for r in read_rounds(tmp_path / ROUNDS_JSONL) if "restart" in r] == [
        {"restart": record}
    ]
    # the resumed run (after round 2) rewrites both files: the record stays, after round 2
    metrics, rounds = (
        MetricsLog(tmp_path / "metrics.json", run, keep_until=2),
        RoundLog(tmp_path / ROUNDS_JSONL, 2),
    )
    for rnd in (3, 4):
        metrics.append({"round": rnd, "resumed": True})
        rounds.append({"round": rnd, "resumed": True})
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert doc["restarts"] == [record] and [r["round"] for r in doc["rounds"]] == [0, 1, 2, 3, 4]
    lines = read_rounds(tmp_path / ROUNDS_JSONL)
    assert [r.get("round", "restart") for r in lines] == [0, 1, 2, "restart", 3, 4]


def test_bad_restart_settings_are_refused_before_anything_starts(
    tmp_path: Path, no_process
) -> None:
    for flag in ("--restarts", "--node-restarts"):
        with pytest.raises(SystemExit):
            main([flag, "-1", "--results", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--restart-backoff", "0", "--results", str(tmp_path)])


def test_a_failure_is_resumed_as_often_as_allowed_and_one_without_checkpoint_is_not(
    tmp_path: Path, monkeypatch
) -> None:
    fed = LocalFederation((1.0,), tmp_path / "federation", echo=lambda line: None)
    out = tmp_path / "run"
    calls: list[dict] = []

    def failing_run(config, results_dir, app_dir, timeout, lock=True):
        calls.append(dict(config))
        raise RuntimeError("the run failed: the ServerApp was lost")

    monkeypatch.setattr(fed, "run", failing_run)
    monkeypatch.setattr("cli.launcher.time.sleep", lambda s: None)
    # nothing to resume from: not retried, and the error says why
    with pytest.raises(
        RuntimeError, match="not restarted: resume=true: .*checkpoint.npz does not exist"
    ):
        fed.run_healing({"num-rounds": 3}, out, timeout=60, restarts=RestartPolicy(attempts=2))
    assert calls == [{"num-rounds": 3}]

    # with a checkpoint: resumed twice (the policy's most), each recorded, then given up with the
    # reason
    calls.clear()
    monkeypatch.setattr(fed, "run_overrides", lambda config, results_dir, app_dir: dict(config))
    monkeypatch.setattr("cli.launcher.check_checkpoint", lambda path: (2, 10))
    out.mkdir(exist_ok=True)
    MetricsLog(out / "metrics.json", {}).append({"round": 2})
    with pytest.raises(RuntimeError, match="not restarted again: 2 restarts made"):
        fed.run_healing({"num-rounds": 3}, out, timeout=60, restarts=RestartPolicy(attempts=2))
    assert [c.get("resume", False) for c in calls] == [False, True, True]
    doc = json.loads((out / "metrics.json").read_text())
    assert [(r["attempt"], r["fault"], r["resumed_from_round"]) for r in doc["restarts"]] == [
        (1, "serverapp", 2),
        (2, "serverapp", 2),
    ]
    assert doc["restarts"][0]["why"] == "the run failed: the ServerApp was lost"

    # a database locked past Flower's busy timeout: the SuperLink is replaced, not resubmitted to
    from cli.launcher import SuperLinkDatabaseError

    replaced: list[bool] = []
    monkeypatch.setattr(fed, "restart_superlink", lambda: replaced.append(True))
    outcomes = [SuperLinkDatabaseError("the SuperLink's database x was locked"), None]

    def locked_once(config, results_dir, app_dir, timeout, lock=True):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return {"rounds": []}

    monkeypatch.setattr(fed, "run", locked_once)
    assert fed.run_healing(
        {"num-rounds": 3}, out, timeout=60, restarts=RestartPolicy(attempts=2)
    ) == {"rounds": []}
    assert replaced == [True]
    assert json.loads((out / "metrics.json").read_text())["restarts"][-1]["fault"] == "superlink"

    # attempts=0: the first failure is final, as it was
    monkeypatch.setattr(fed, "run", failing_run)
    calls.clear()
    with pytest.raises(RuntimeError, match="the ServerApp was lost") as err:
        fed.run_healing({"num-rounds": 3}, out, timeout=60, restarts=RestartPolicy(attempts=0))
    assert "restarted" not in str(err.value) and len(calls) == 1


def test_a_federation_being_stopped_is_not_healed(tmp_path: Path, monkeypatch) -> None:
    """A run that fails because its federation is being stopped (by another thread: a test's
    timeout, an embedding program) is not restarted, neither at the failure nor after the wait."""
    fed = LocalFederation((1.0,), tmp_path / "federation", echo=lambda line: None)
    out = tmp_path / "run"
    out.mkdir()
    MetricsLog(out / "metrics.json", {}).append({"round": 2})
    monkeypatch.setattr(fed, "run_overrides", lambda config, results_dir, app_dir: dict(config))
    monkeypatch.setattr("cli.launcher.check_checkpoint", lambda path: (2, 10))
    started: list[str] = []
    monkeypatch.setattr(fed, "restart_superlink", lambda: started.append("superlink"))
    monkeypatch.setattr(fed, "superlink_dead", lambda: True)

    def stopped_run(config, results_dir, app_dir, timeout, lock=True):
        raise RuntimeError("the run failed: flwr run exited with status -15")

    monkeypatch.setattr(fed, "run", stopped_run)
    policy = RestartPolicy(attempts=3, backoff_s=0.5)
    # stopped while the restart waits its back-off
    monkeypatch.setattr("cli.launcher.time.sleep", lambda s: s == 0.5 and fed._watch_stop.set())
    with pytest.raises(RuntimeError, match="not restarted: the federation is stopping"):
        fed.run_healing({"num-rounds": 3}, out, timeout=60, restarts=policy)
    # already stopping when the run fails
    with pytest.raises(RuntimeError, match="not restarted: the federation is stopping"):
        fed.run_healing({"num-rounds": 3}, out, timeout=60, restarts=policy)
    assert started == [] and "restarts" not in json.loads((out / "metrics.json").read_text())


def _restarts(out: Path) -> list[dict]:
    try:
        return json.loads((out / "metrics.json").read_text()).get("restarts", [])
    except (OSError, ValueError):
        return []


def recovery_seconds(metrics: dict) -> list[float]:
    """Per restart: seconds from the failure to the end of the first round after the one it resumed
    from."""
    ends = {r["round"]: r["time"] for r in metrics["rounds"]}
    out = []
    for r in metrics["restarts"]:
        failed = datetime.fromisoformat(r["failed_at"]).timestamp()
        out.append(ends[r["resumed_from_round"] + 1] - failed)
    return out


@dataclass
class HealingRun:
    """:meth:`LocalFederation.run_healing` in a thread: its metrics once it ends, or what it
    raised."""

    thread: threading.Thread
    result: dict
    failure: list[BaseException]


def heal_in_background(
    fed: LocalFederation, config: dict, out: Path, policy: RestartPolicy
) -> HealingRun:
    """Start ``fed.run_healing(config, out)`` in a thread, for a test to inject faults meanwhile."""
    result: dict = {}
    failure: list[BaseException] = []

    def healing() -> None:
        try:
            result.update(fed.run_healing(config, out, timeout=1500, restarts=policy))
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=healing)
    thread.start()
    return HealingRun(thread, result, failure)


@pytest.mark.federation
def test_a_run_heals_from_a_lost_serverapp_and_a_lost_superlink_to_the_same_model(
    tmp_path: Path,
) -> None:
    """8 rounds; the ServerApp SIGKILLed in round 3 and the SuperLink in round 6: two restarts, the
    same bits."""
    config = {"num-rounds": 8, "eval-every": 0, "local-epochs": 1}
    lines: list[str] = []
    policy = RestartPolicy(attempts=3, backoff_s=0.5)
    with LocalFederation(
        (1.0, 0.25), tmp_path / "federation", echo=lines.append, node_restarts=policy
    ) as fed:
        reference = fed.run(config, tmp_path / "reference", timeout=900)
        out = tmp_path / "healed"
        healing = heal_in_background(fed, config, out, policy)
        result, failure, thread = healing.result, healing.failure, healing.thread
        wait_for_round(out, 2)
        assert wait_until(lambda: checkpointed_round(out) >= 2, 120), "no checkpoint of round 2"
        pids = fed.serverapp_processes()
        assert pids, "no ServerApp process to kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        # the resumed run goes on past round 5; then the SuperLink dies in round 6
        assert wait_until(lambda: len(_restarts(out)) == 1 or failure, 300), "the run never resumed"
        wait_for_round(out, 5)
        assert wait_until(lambda: checkpointed_round(out) >= 5, 120), "no checkpoint of round 5"
        assert fed.superlink is not None
        os.kill(fed.superlink.pid, signal.SIGKILL)
        thread.join(timeout=1500)
        assert not thread.is_alive() and not failure, failure

    assert [r["round"] for r in result["rounds"]] == list(range(config["num-rounds"] + 1))
    restarts = result["restarts"]
    assert [r["fault"] for r in restarts] == ["serverapp", "superlink"], restarts
    assert [r["attempt"] for r in restarts] == [1, 2]
    assert (
        2
        <= restarts[0]["resumed_from_round"]
        < restarts[1]["resumed_from_round"]
        < config["num-rounds"]
    )
    assert all(r["rounds_redone"] >= 1 for r in restarts)
    jsonl = read_rounds(out / ROUNDS_JSONL)
    assert [r["restart"] for r in jsonl if "restart" in r] == restarts
    assert [r["round"] for r in jsonl if "round" in r] == list(range(config["num-rounds"] + 1))
    assert sum("restart 1 of at most 3" in line for line in lines) == 1, lines
    recovery = recovery_seconds(result)
    assert all(0 < s < 600 for s in recovery), recovery
    print(
        f"recovered in {', '.join(f'{s:.1f}' for s in recovery)} s (failure to the end of the "
        "round redone)"
    )
    ref_model, got_model = (
        torch.load(tmp_path / "reference" / "model.pt"),
        torch.load(out / "model.pt"),
    )
    assert all(torch.equal(ref_model[k], got_model[k]) for k in ref_model)
    assert [r["global"]["accuracy"] for r in result["rounds"]] == [
        r["global"]["accuracy"] for r in reference["rounds"]
    ]


@pytest.mark.federation
def test_a_supernode_killed_twice_comes_back_and_one_stopped_on_purpose_stays_down(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    policy = RestartPolicy(attempts=3, backoff_s=0.5)
    config = {"num-rounds": 6, "eval-every": 0, "local-epochs": 1, "round-timeout": 60.0}
    with LocalFederation(
        (1.0, 0.25), tmp_path / "federation", echo=lines.append, node_restarts=policy
    ) as fed:
        out = tmp_path / "run"
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(fed.run_healing(config, out, timeout=900))
        )
        thread.start()
        for rnd in (2, 4):
            wait_for_round(out, rnd)
            os.kill(fed.nodes[1].pid, signal.SIGKILL)
            made = rnd // 2
            assert wait_until(lambda m=made: fed.node_restarts_made.get(1, 0) >= m, 60), (
                f"node 1 not restarted after round {rnd}"
            )
        thread.join(timeout=900)
        assert result, "the run did not finish"
        assert fed.node_restarts_made == {1: 2}
        assert sum(line.startswith("SuperNode 1: restart") for line in lines) == 2, lines
        # a node stopped on purpose stays down
        fed.kill_node(0)
        time.sleep(2.0)
        assert 0 not in fed.nodes and fed.node_restarts_made.get(0, 0) == 0
        fed.start_node(0)

    assert [r["round"] for r in result["rounds"]] == list(range(config["num-rounds"] + 1))
    assert "restarts" not in result
    small = [[c for c in r["clients"] if c["capacity"] == 0.25] for r in result["rounds"][1:]]
    assert any(c["status"] == "ok" for c in small[-1]), (
        "the restarted node did not train in the last round"
    )


def test_control_submit_resubmits_a_failed_run_with_resume_until_the_resume_is_refused(
    monkeypatch, capsys, tmp_path: Path
) -> None:
    """The compose stack's `submit`: a lost run is resubmitted with resume=true; a refused resume is
    final."""
    from cli import control

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(control, "wait_for_control_api", lambda *a, **k: None)
    monkeypatch.setattr(control.time, "sleep", lambda s: None)
    root = Path(__file__).resolve().parents[1]
    argv = [
        "submit",
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
        "--app",
        str(root),
        "--restarts",
        "3",
    ]

    def scripted(outcomes: list[str | None]):
        commands: list[list[str]] = []

        def run(cmd, env, log, timeout, echo, connection=None) -> None:
            commands.append(cmd)
            log.write_text("log\n")
            outcome = outcomes[len(commands) - 1]
            if outcome is not None:
                raise RuntimeError(outcome)

        monkeypatch.setattr(control, "run_federation_command", run)
        return commands

    commands = scripted(
        ["the run failed (finished:failed): No heartbeat received from the task", "lost", None]
    )
    assert control.main(argv) == 0
    assert ["resume=true" in " ".join(c) for c in commands] == [False, True, True]
    out = capsys.readouterr().out
    assert "resubmitting it with resume=true in 5 s (restart 1 of at most 3" in out
    assert "in 10 s (restart 2 of at most 3" in out

    commands = scripted(
        ["lost", "the run failed: resume=true: /results/x/checkpoint.npz does not exist", None]
    )
    assert control.main(argv) == 1 and len(commands) == 2
    assert "checkpoint.npz does not exist" in capsys.readouterr().err

    commands = scripted(["lost"] * 5)
    assert control.main([*argv[:-1], "1"]) == 1 and len(commands) == 2
    assert "not restarted again: 1 restarts made" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        control.main([*argv[:-1], "-1"])


@pytest.mark.federation
def test_a_locked_database_and_a_frozen_supernode_do_not_need_a_person(tmp_path: Path) -> None:
    """The SuperLink's SQLite database held locked for 12 s (past Flower's 5 s busy timeout), then a
    SuperNode stopped (SIGSTOP) past Flower's heartbeat expiry and continued: the run ends, every
    round recorded."""
    import sqlite3

    lines: list[str] = []
    policy = RestartPolicy(attempts=3, backoff_s=0.5)
    # 14 rounds: a round waits at most 20 s for the stopped node, so rounds remain after it
    # continues
    config = {"num-rounds": 14, "eval-every": 0, "local-epochs": 1, "round-timeout": 20.0}
    with LocalFederation(
        (1.0, 0.25), tmp_path / "federation", echo=lines.append, node_restarts=policy
    ) as fed:
        out = tmp_path / "run"
        healing = heal_in_background(fed, config, out, policy)
        result, failure, thread = healing.result, healing.failure, healing.thread
        wait_for_round(out, 2)
        db = sqlite3.connect(fed.database_path, timeout=30, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        time.sleep(12.0)
        db.execute("COMMIT")
        db.close()
        wait_for_round(out, 4, timeout=600)
        node = fed.nodes[1]
        os.kill(node.pid, signal.SIGSTOP)
        time.sleep(
            75.0
        )  # past Flower's heartbeat expiry (the SuperLink then treats the node as gone)
        os.kill(node.pid, signal.SIGCONT)
        continued = time.time()
        thread.join(timeout=1500)
        assert not thread.is_alive() and not failure, (failure, lines[-20:])

    assert [r["round"] for r in result["rounds"]] == list(range(config["num-rounds"] + 1))
    assert len(result.get("restarts", [])) <= 1, result.get("restarts")
    after = [
        c
        for r in result["rounds"]
        if r["time"] > continued
        for c in r["clients"]
        if c["status"] == "ok"
    ]
    assert any(c["capacity"] == 0.25 for c in after), (
        "the stopped node never trained again after it continued"
    )
    print(f"restarts: {result.get('restarts', [])}; node restarts: {fed.node_restarts_made}")


def test_the_resumed_serverapp_stamps_the_launchers_record_or_writes_its_own(
    tmp_path: Path,
) -> None:
    launcher_record = restart_record(1, "superlink", "the run failed: lost", 3, 4, 1_800_000_000.0)
    restarts = [launcher_record]
    stamped = note_resume(restarts, 3, 4, 1_800_000_030.0)
    assert stamped is launcher_record and restarts == [launcher_record]
    assert stamped["resumed_at"].startswith("2027-01-15T08:00:30")
    # a second resume from the same round that no launcher recorded (an operator's resume=true): a
    # record of its own
    own = note_resume(restarts, 3, 5, 1_800_000_100.0)
    assert own["attempt"] == 2 and own["fault"] == "unknown" and own["why"] == RESUBMITTED
    assert own["failed_at"] is None and own["rounds_redone"] == 3 and len(restarts) == 2

    # in rounds.jsonl, the stamped record replaces the launcher's line; one of its own is added
    # after the rounds
    path = tmp_path / ROUNDS_JSONL
    log = RoundLog(path)
    for rnd in range(5):
        log.append({"round": rnd})
    record_restart_line = {"restart": restart_record(1, "superlink", "lost", 3, 4, 1_800_000_000.0)}
    with open(path, "a") as f:
        f.write(json.dumps(record_restart_line) + "\n")
    resumed = RoundLog(path, keep_until=3)
    resumed.note_restart(stamped)
    resumed.note_restart(own)
    resumed.append({"round": 4})
    assert [r.get("round", r.get("restart", {}).get("attempt")) for r in read_rounds(path)] == [
        0,
        1,
        2,
        3,
        1,
        2,
        4,
    ]
    assert read_rounds(path)[4]["restart"]["resumed_at"] == stamped["resumed_at"]
    with pytest.raises(RuntimeError, match="resumed run"):
        RoundLog(path).note_restart(own)
