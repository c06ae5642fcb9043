"""The by-hand steps of docs/guide/deployment.md ("By hand"), run as written on loopback.

The documentation's fenced blocks marked ``<!-- by-hand NAME: ... -->`` are taken from the file and
run with
bash: only the values of the settings block are replaced (loopback, free ports, this test's
folders), every other line runs verbatim. So a step that is wrong, missing or out of order in the
docs fails here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cli.launcher import APP_DIR, flower_env, free_port, wait_for_port
from cli.process_group import ProcessGroup

pytestmark = pytest.mark.federation

DEPLOYMENT = APP_DIR / "docs" / "guide" / "deployment.md"
BLOCK = re.compile(r"<!-- by-hand (?P<name>[\w-]+):[^>]*-->\s*```bash\n(?P<body>.*?)```", re.DOTALL)
SETTING = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*)=\S*(?P<comment>\s+#.*)?$")
#: The steps in the order the docs give them; the daemons run until the test stops them.
STEPS = ("certificates", "superlink", "join", "node-key", "supernode", "submit")
DAEMONS = {"superlink", "join", "supernode"}


def doc_blocks(path: Path) -> dict[str, str]:
    """The marked ``bash`` blocks of ``path``, by name (a name given twice is an error)."""
    blocks: dict[str, str] = {}
    for match in BLOCK.finditer(path.read_text()):
        name = match["name"]
        assert name not in blocks, f"{path.name}: two by-hand blocks named {name!r}"
        blocks[name] = match["body"]
    return blocks


def with_values(settings: str, values: dict[str, str]) -> str:
    """The settings block with each assignment's value replaced by ``values[name]``.

    Every line must be a plain assignment (or a comment), and the block must assign exactly the
    names in ``values``: a setting the docs add or drop would otherwise go unnoticed here.
    """
    out, names = [], []
    for line in settings.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            out.append(line)
            continue
        match = SETTING.match(line)
        assert match, f"settings line is not NAME=value: {line!r}"
        names.append(match["name"])
        out.append(f"{match['name']}={shlex.quote(values[match['name']])}{match['comment'] or ''}")
    assert sorted(names) == sorted(values), (
        f"the docs' settings are {names}, the test sets {sorted(values)}"
    )
    return "\n".join(out) + "\n"


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@pytest.mark.timeout(
    1200
)  # a federation takes 30-90 s on a quiet 2-core machine; much longer under load
def test_by_hand_steps_run_as_written(tmp_path: Path) -> None:
    blocks = doc_blocks(DEPLOYMENT)
    assert set(blocks) == {"settings", *STEPS}, f"by-hand blocks in deployment.md: {sorted(blocks)}"

    superlink_dir, node_dir, logs = (
        tmp_path / "superlink-host",
        tmp_path / "node-host",
        tmp_path / "logs",
    )
    port = free_port()
    settings = with_values(
        blocks["settings"],
        {
            # A name where LISTEN is an address: the nodes check the certificate for the one, the
            # SuperLink's own ServerApp executor (which dials LISTEN) for the other, so both
            # documented SANs are needed.
            "SUPERLINK_HOST": "localhost",
            "SUPERLINK_PORT": str(port),
            # the docs' 0.0.0.0 would open the test's SuperLink to the network
            "LISTEN": "127.0.0.1",
            "SUPERLINK_DIR": str(superlink_dir),
            "NODE_DIR": str(node_dir),
            "APP": str(APP_DIR),
            "LAB1_PORT": str(free_port()),
            "LAB2_PORT": str(free_port()),
        },
    )
    # Outside the repository, so no step leans on the working directory; a private FLWR_HOME, so the
    # user's Flower config is never touched; one intra-op thread per process on a shared machine.
    work = tmp_path / "cwd"
    work.mkdir()
    # Every process a step starts (Flower's detached executors included) inherits the marker entry:
    # stopping the group ends them all, and its guard does it should pytest itself be killed. TMPDIR
    # keeps what the steps leave in temporary folders (`fibos control`'s run log) inside the test's
    # folder.
    (tmp_path / "tmp").mkdir()
    env = {
        **flower_env(tmp_path / "flwr-home"),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path / "tmp"),
        "FIBOS_BY_HAND_TEST": str(tmp_path),
    }
    group = ProcessGroup(f"FIBOS_BY_HAND_TEST={tmp_path}", guard_log=logs / "guard.log")
    daemons: dict[str, subprocess.Popen] = {}

    def start(name: str) -> subprocess.Popen:
        script = f"set -eu\ncd {shlex.quote(str(work))}\n{settings}{blocks[name]}"
        return group.start(["bash", "-c", script], logs / f"{name}.log", env)

    def check_daemons() -> None:
        for name, proc in daemons.items():
            if proc.poll() is not None:
                pytest.fail(
                    f"step {name!r} exited with {proc.returncode}:\n{_tail(logs / f'{name}.log')}"
                )

    def run_to_end(name: str, timeout: float) -> None:
        proc = start(name)
        deadline = time.monotonic() + timeout
        while (
            proc.poll() is None
        ):  # a daemon that dies meanwhile would leave this step waiting for it
            check_daemons()
            if time.monotonic() > deadline:
                pytest.fail(
                    f"step {name!r} did not finish within {timeout:.0f} "
                    f"s:\n{_tail(logs / f'{name}.log')}"
                )
            time.sleep(0.5)
        assert proc.returncode == 0, (
            f"step {name!r} exited with {proc.returncode}:\n{_tail(logs / f'{name}.log')}"
        )

    try:
        run_to_end("certificates", 120)
        daemons["superlink"] = start("superlink")
        wait_for_port(port, 120, daemons["superlink"])
        # The docs' one manual step, "copy ca.crt to each node machine" (scp between real machines).
        node_dir.mkdir()
        shutil.copy(superlink_dir / "certs" / "ca.crt", node_dir / "ca.crt")
        daemons["join"] = start("join")
        run_to_end("node-key", 300)
        daemons["supernode"] = start("supernode")
        run_to_end("submit", 900)
        check_daemons()  # both nodes must still be up after the run
    finally:
        group.stop()

    metrics = json.loads((superlink_dir / "results" / "check" / "metrics.json").read_text())
    rounds = [r for r in metrics["rounds"] if r["round"] > 0]
    assert len(rounds) == 1 and rounds[0]["replies"] == 2
    clients = {c["client_key"]: c for c in rounds[0]["clients"]}
    assert sorted(clients) == ["lab-1", "lab-2"]  # the documented node names, both trained
    assert {k: (c["status"], c["capacity"]) for k, c in clients.items()} == {
        "lab-1": ("ok", 1.0),
        "lab-2": ("ok", 0.25),
    }
    assert rounds[0]["global"]["accuracy"] is not None  # eval-every=1: the round was evaluated
    assert "lab-1: registered" in (logs / "join.log").read_text()
    assert "lab-2: registered" in (logs / "node-key.log").read_text()
    link_log = (logs / "superlink.log").read_text()
    assert (
        "No SuperNode found" not in link_log
    )  # registration came before each SuperNode, as documented
    assert (superlink_dir / "results" / "check" / "model.pt").exists()
