"""Watching a run: ``rounds.jsonl`` (append, resume, SIGKILL) and the progress line's time left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from cli.launcher import run_federation_command
from server.round_log import RoundLog, read_rounds
from server.strategy_core.round_records import progress_line

ROOT = Path(__file__).resolve().parents[1]


def _record(rnd: int, **extra) -> dict:
    return {
        "round": rnd,
        "global": {"accuracy": 0.1 * rnd, "loss": 2.0 - 0.1 * rnd},
        "clients": [],
        **extra,
    }


def test_each_append_is_one_json_line_readable_at_once(tmp_path):
    path = tmp_path / "rounds.jsonl"
    log = RoundLog(path)
    for rnd in range(3):
        log.append(
            _record(rnd, note="two\nlines")
        )  # a newline inside a string stays inside its line
        assert [r["round"] for r in read_rounds(path)] == list(range(rnd + 1))
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert [json.loads(line) for line in lines] == [_record(r, note="two\nlines") for r in range(3)]


def test_a_fresh_run_starts_the_file_over_at_its_first_round_only(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(json.dumps(_record(r)) + "\n" for r in range(5)))
    log = RoundLog(path)
    assert len(read_rounds(path)) == 5  # nothing written before the first round ends
    log.append(_record(0))
    assert read_rounds(path) == [_record(0)]


def test_a_resume_keeps_the_rounds_up_to_the_checkpoint_and_drops_later_ones(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text(
        "".join(json.dumps(_record(r)) + "\n" for r in range(6)) + '{"round": 6, "glo'
    )  # torn
    log = RoundLog(path, keep_until=3)
    assert path.read_text().endswith(
        '{"round": 6, "glo'
    )  # untouched until the first round of the resume
    log.append(_record(4, resumed=True))
    log.append(_record(5, resumed=True))
    assert read_rounds(path) == [_record(r) for r in range(4)] + [
        _record(r, resumed=True) for r in (4, 5)
    ]
    assert not [
        p for p in tmp_path.iterdir() if p.name != "rounds.jsonl"
    ]  # no temporary file left behind


def test_a_resume_without_an_earlier_file_starts_one(tmp_path):
    path = tmp_path / "sub" / "rounds.jsonl"
    RoundLog(path, keep_until=2).append(_record(3))
    assert read_rounds(path) == [_record(3)]


def test_read_rounds_of_a_missing_file_is_empty(tmp_path):
    assert read_rounds(tmp_path / "nothing.jsonl") == []


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from server.round_log import RoundLog

    log = RoundLog(Path(sys.argv[1]))
    rnd = 0
    while True:
        log.append({"round": rnd, "clients": [{"bytes_down": rnd, "pad": "x" * 4096} for _ in range(8)]})
        print(rnd, flush=True)  # reported only once the line is on disk
        rnd += 1
    """  # noqa: E501
)


def test_every_finished_round_survives_a_sigkill(tmp_path):
    path = tmp_path / "rounds.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        finished = -1
        while finished < 20:
            line = proc.stdout.readline()
            assert line, "the child exited early"
            finished = int(line)
        os.kill(proc.pid, signal.SIGKILL)  # mid-way through a later round's append, most likely
        proc.wait(timeout=30)
        finished = max([finished, *(int(line) for line in proc.stdout.read().split())])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    rounds = [r["round"] for r in read_rounds(path)]
    assert rounds[: finished + 1] == list(range(finished + 1))  # every reported round, in order
    assert len(rounds) <= finished + 2  # at most the one being written when it died beyond them


def _round(rnd: int, seconds: float) -> dict:
    clients = [{"bytes_down": 2048, "bytes_up": 1024}]
    return {
        "round": rnd,
        "global": {"accuracy": 0.5, "loss": 1.0},
        "replies": 1,
        "sent": 1,
        "clients": clients,
    } | {"round_seconds": seconds}


def test_the_progress_line_estimates_the_time_left_from_the_mean_round():
    line = progress_line(_round(3, 4.0), 10, [1.0, 1.0])  # mean 2 s, 7 rounds to go
    assert line.startswith("[round 3/10]")
    assert line.endswith("| 4.0 s | ~14 s left")
    assert progress_line(_round(1, 2.5), 5).endswith(
        "| ~10 s left"
    )  # one round so far: its own time
    assert progress_line(_round(6, 2.0), 10, iter([1.0, 3.0])).endswith(
        "| ~8 s left"
    )  # any iterable
    assert "left" not in progress_line(
        _round(10, 2.0), 10, [1.0] * 9
    )  # the last round: nothing left
    assert "left" not in progress_line(_round(0, 0.0), 10)  # nothing measured yet


def test_fibos_local_echoes_the_progress_line_with_its_time_left(tmp_path):
    """The launcher keeps only some lines of ``flwr run --stream``; the round line, time left
    included, is one."""
    line = progress_line(_round(2, 3.0), 6, [3.0])
    script = f"print('noise'); print({'INFO :      ' + line!r}); print('more noise')"
    echoed: list[str] = []
    run_federation_command(
        [sys.executable, "-c", script], dict(os.environ), tmp_path / "run.log", 60, echoed.append
    )
    assert echoed == [line]
    assert echoed[0].endswith("~12 s left")
