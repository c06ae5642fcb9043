"""``resume=true`` refuses a missing or damaged checkpoint or metrics.json before anything starts,
naming the file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cli import launcher
from server.persistence import CHECKPOINT, MetricsLog, chunk_store, save_checkpoint
from server.resume_check import ResumeError, check_resume

ROOT = Path(__file__).resolve().parents[1]
PARAMETERS = 50
DONE = 2  # the round the checkpoint holds


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A results folder as a launch interrupted after round 2 of 3 leaves it (checkpoint,
    metrics.json)."""
    cfg = launcher.check_run_config({"results-dir": str(tmp_path), "num-rounds": 3})
    save_checkpoint(
        tmp_path / CHECKPOINT, DONE, np.arange(PARAMETERS, dtype=np.float32), b"state" * 100
    )
    metrics = MetricsLog(tmp_path / "metrics.json", {**cfg.flat(), "d": PARAMETERS})
    for rnd in range(DONE + 1):
        metrics.append({"round": rnd})
    return tmp_path


def _rewrite_metrics(folder: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads((folder / "metrics.json").read_text())
    change(doc)
    (folder / "metrics.json").write_text(json.dumps(doc))


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "missing checkpoint": (
        lambda f: (f / CHECKPOINT).unlink(),
        [
            f"{CHECKPOINT} does not exist, so there is nothing to resume",
            "launch without resume=true",
        ],
    ),
    "empty checkpoint": (
        lambda f: (f / CHECKPOINT).write_bytes(b""),
        [f"{CHECKPOINT} is unreadable (EOFError"],
    ),
    "truncated checkpoint": (
        lambda f: (f / CHECKPOINT).write_bytes((f / CHECKPOINT).read_bytes()[:300]),
        [f"{CHECKPOINT} is unreadable (BadZipFile"],
    ),
    "garbled checkpoint": (lambda f: _garble(f / CHECKPOINT), [f"{CHECKPOINT} is unreadable"]),
    # np.load takes a file without the zip signature for a pickle ("contains pickled (object)
    # data").
    "checkpoint that is no archive": (
        lambda f: (f / CHECKPOINT).write_bytes(b"\x93garbage" * 40),
        [f"{CHECKPOINT} is unreadable (not an .npz archive: it begins with"],
    ),
    "missing chunk": (
        lambda f: next(chunk_store(f / CHECKPOINT).iterdir()).unlink(),
        ["its state chunk", "is missing from"],
    ),
    "truncated metrics": (
        lambda f: (f / "metrics.json").write_text((f / "metrics.json").read_text()[:200]),
        ["metrics.json is unreadable (JSONDecodeError"],
    ),
    "missing metrics": (
        lambda f: (f / "metrics.json").unlink(),
        ["metrics.json does not exist, so the resumed run would lack the rounds already done"],
    ),
    "metrics behind the checkpoint": (
        lambda f: _rewrite_metrics(f, lambda d: d.update(rounds=d["rounds"][:1])),
        ["metrics.json records rounds up to 0", f"holds round {DONE}"],
    ),
    "another model size": (
        lambda f: _rewrite_metrics(f, lambda d: d["run"].update(d=PARAMETERS + 1)),
        [f"a model of {PARAMETERS} parameters", f"one of {PARAMETERS + 1}"],
    ),
    "another method": (
        lambda f: _rewrite_metrics(f, lambda d: d["run"].update(method="heterofl")),
        ["has method='heterofl'", "resume with method='heterofl'"],
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_resume_from_damaged_files_is_refused_before_any_process_starts(
    case, folder, capsys, no_process
):
    damage, named = DAMAGE[case]
    damage(folder)
    metrics_before = (
        (folder / "metrics.json").read_bytes() if (folder / "metrics.json").exists() else None
    )
    started = time.monotonic()
    code = launcher.main(["--results", str(folder), "--rounds", "3", "-c", "resume=true"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: resume=true: "), err
    assert str(folder) in err and all(text in err for text in named), err
    assert elapsed < 5.0
    assert not (folder / "logs").exists() and not (folder / ".flwr").exists()
    if metrics_before is not None:  # the earlier rounds are kept as they were
        assert (folder / "metrics.json").read_bytes() == metrics_before


def test_a_checkpoint_beyond_num_rounds_is_refused(folder, capsys, no_process):
    assert launcher.main(["--results", str(folder), "--rounds", "1", "-c", "resume=true"]) == 2
    assert (
        f"holds round {DONE}, beyond num-rounds=1; give num-rounds={DONE} or more"
        in capsys.readouterr().err
    )


def test_whole_files_are_accepted(folder):
    cfg = launcher.check_run_config({"results-dir": str(folder), "num-rounds": 5, "resume": True})
    assert check_resume(folder, cfg) == DONE
    launcher.LocalFederation((1.0,), folder).run_overrides(
        {"num-rounds": 5, "resume": True}, folder
    )


def test_the_serverapp_refuses_a_resume_without_a_checkpoint_and_keeps_metrics(folder):
    """A run submitted through the Control API has no launcher in front: the ServerApp refuses it
    itself."""
    from flwr.app import Context, RecordDict

    from server.app import main as serverapp_main

    (folder / CHECKPOINT).unlink()
    before = (folder / "metrics.json").read_bytes()
    run_config = {
        **launcher.app_run_config(ROOT),
        "results-dir": str(folder),
        "num-rounds": 3,
        "resume": True,
    }
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    with pytest.raises(ResumeError, match="nothing to resume") as refused:
        serverapp_main(None, context)
    assert (folder / "metrics.json").read_bytes() == before
    # The launcher shows the ServerApp's last exception line: this one must be recognised as such.
    line = f"server.resume_check.ResumeError: {refused.value}"
    assert launcher.EXCEPTION_LINE.match(line)
