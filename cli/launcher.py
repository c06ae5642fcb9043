"""Local deployment launcher: a real SuperLink and N SuperNodes on loopback, one ``flwr run``.

Starts ``flower-superlink`` and ``flower-supernode`` processes (each SuperNode
with its own capacity), submits the app with ``flwr run``, prints one progress
line per round, then a summary table, writes ``accuracy.png`` next to
``metrics.json`` and always stops every process it started (also on failure,
Ctrl-C or SIGTERM).

Usage::

    fibos local --capacities 1,0.5,0.25,0.25,0.125,0.0625 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing, nullcontext
from pathlib import Path
from types import FrameType
from typing import TextIO

from cli.app_bundle import stage_app
from cli.process_group import ProcessGroup, pids_with_env, signal_group, stop_pids
from cli.restarts import RestartPolicy, record_restart
from cli.run_folder import RunFolderBusy, RunFolderLock, launch_id, new_log_folder
from cli.run_report import summary_table, write_accuracy_plot
from cli.run_status import RUN_STARTED, run_status
from common.config.capacity import parse_capacity_list
from common.config.overrides import parse_overrides
from common.config.parse import parse_run_config
from common.config.run import RunConfig
from common.config.schema import ConfigError
from common.data.catalog import NODE_DATASET
from common.models.model_path import resolve_model_path
from common.training.catalog import DEVICES
from server.persistence import CHECKPOINT, check_checkpoint
from server.restart_log import last_recorded_round, restart_record
from server.resume_check import check_resume
from server.tensorboard_log import check_tensorboard

DEFAULT_CAPACITIES = (1.0, 0.5, 0.25, 0.25, 0.125, 0.0625)
APP_DIR = Path(__file__).resolve().parents[1]
ROUND_LINE = re.compile(r"\[(?:round|update) \d+/\d+\].*")
#: The last line of a Python traceback: ``package.module.SomeError: message``.
EXCEPTION_LINE = re.compile(
    r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$"
)
#: ``--superlink-database`` value for Flower's in-memory state (no SQLite file; ``flower-superlink``
#: without ``--database``).
MEMORY_DATABASE = "memory"
#: What SQLite says when a write waited past its busy timeout (Flower's: 5 s, ``SQLITE_PRAGMAS``).
DATABASE_LOCKED = "database is locked"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Block until something listens on ``127.0.0.1:port``; fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process {proc.args[0]} exited with code {proc.returncode} before listening"
            )
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f} s")


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: no telemetry, no update check, a private FLWR_HOME."""
    env = dict(os.environ)
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_HOME=str(flwr_home),
        PYTHONUNBUFFERED="1",
        # The SuperLink and SuperNodes spawn flower-superexec / flwr-serverapp / flwr-clientapp
        # from PATH: make it this interpreter's environment even when no venv is activated.
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


def _bin(name: str) -> str:
    """A console script of the running interpreter's environment (works without an activated
    venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_capacities(text: str) -> list[float]:
    """``"1,1/2,0.25"`` -> ``[1.0, 0.5, 0.25]``; each must be in (0, 1] (argparse type)."""
    try:
        out = list(parse_capacity_list(text, "--capacities"))
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if not out:
        raise argparse.ArgumentTypeError("at least one capacity is needed")
    return out


def positive_seconds(text: str) -> float:
    """``"20"`` -> ``20.0``: a number of seconds above zero (argparse type for ``--timeout``)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return seconds


def superlink_database(text: str) -> str:
    """``--superlink-database``: ``memory``, or a file for the SuperLink's SQLite state (argparse
    type).

    A path is returned absolute; its folder must exist, and it must not be a folder itself.
    """
    if text.strip().lower() == MEMORY_DATABASE:
        return MEMORY_DATABASE
    if not text.strip():
        raise argparse.ArgumentTypeError("give memory or a file path")
    path = Path(text).expanduser().resolve()
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is a folder; give a file path (e.g. {path / 'state.db'}) or memory"
        )
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {path.parent} does not exist")
    return str(path)


def database_diagnosis(superlink_log: Path, database: str, since: int = 0) -> str:
    """Why a run failed, when the SuperLink's log shows its SQLite database locked; empty when it
    does not.

    ``since``: the log's size in bytes when the run began (what an earlier run of the same SuperLink
    logged is not this run's cause).

    Under load (or with another process holding the file) a SuperLink write waits past SQLite's busy
    timeout (Flower: 5 s, not configurable) and the request fails with an internal server error; the
    ServerApp or a node then sees only that error (``500 Internal Server Error``, ``push session may
    have expired``).
    """
    try:
        with open(superlink_log, "rb") as log:
            log.seek(since)
            count = log.read().decode(errors="replace").count(DATABASE_LOCKED)
    except OSError:
        return ""
    if not count:
        return ""
    times = "once" if count == 1 else f"{count} times"
    return (
        f"the SuperLink's database {database} was locked ('{DATABASE_LOCKED}', {times} in "
        f"{superlink_log}): a write waited longer than SQLite's 5 s busy timeout, because another "
        "process held the file or the machine was too loaded to commit in time. Launch again with "
        "--superlink-database memory (nothing the run needs is lost; -c resume=true continues "
        "from the last checkpoint), or with the database on a local, "
        "idle disk (--superlink-database PATH); docs/design/reliability.md, \"The SuperLink's "
        'database under load"'
    )


def check_results_folder(results_dir: Path, flag: str = "--results") -> None:
    """Refuse a results folder that cannot be one: an existing file, or a path through a file.

    Creating it would fail only once the launch has begun, with an ``OSError`` far from the flag.
    """
    for path in (results_dir, *results_dir.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == results_dir else f"lies under {path}, which is a file"
                raise ConfigError(f"{flag} {results_dir} {what}, not a folder; give a folder")
            return


def app_run_config(app_dir: Path) -> dict[str, object]:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of its pyproject.toml), as Flower
    reads them."""
    from flwr.common.config import flatten_dict, get_project_config

    if not (app_dir / "pyproject.toml").is_file():
        # Flower's own error is a FileNotFoundError traceback; the operator gave a wrong folder.
        raise ConfigError(f"{app_dir} holds no pyproject.toml: it is not a Flower app folder")
    return dict(flatten_dict(get_project_config(app_dir)["tool"]["flwr"]["app"].get("config", {})))


def check_run_config(overrides: Mapping[str, object], app_dir: Path = APP_DIR) -> RunConfig:
    """Validate the run config ``flwr run`` would give the ServerApp: the app's defaults with
    ``overrides``.

    The same schema the ServerApp and ClientApp parse (:func:`common.config.run.parse_run_config`),
    so a bad value is refused here, before any process starts, with the message that names the key.
    """
    return parse_run_config({**app_run_config(app_dir), **overrides})


def _same_setting(key: str, a: object, b: object) -> bool:
    """Whether two values of run-config ``key`` mean the same (paths resolved, capacity lists
    parsed)."""
    try:
        if key == "results-dir":
            return Path(str(a)).expanduser().resolve() == Path(str(b)).expanduser().resolve()
        if key == "capacity-mix":
            return parse_capacity_list(a) == parse_capacity_list(b)
    except ConfigError:
        return False
    return type(a) is type(b) and a == b


def merge_flag_settings(
    run_config: Mapping[str, object], flags: Mapping[str, tuple[str, object]]
) -> dict[str, object]:
    """``run_config`` plus the keys a launcher flag sets; a ``-c`` key that a flag sets differently
    is refused.

    Parameters
    ----------
    run_config : Mapping
        The ``-c`` overrides.
    flags : Mapping
        Run-config key -> (the flag as the operator wrote it, the value it sets).
    """
    out = dict(run_config)
    for key, (flag, value) in flags.items():
        if key in out and not _same_setting(key, out[key], value):
            raise ConfigError(
                f"{key}={out[key]!r} (from -c) and {flag} set {key} to different values; give it "
                f"once, either as {flag} or as -c {key}=..."
            )
        out[key] = value
    return out


class LocalFederation:
    """A SuperLink and its SuperNodes (or virtual ones) on loopback, for one or more ``flwr run``.

    Use as a context manager: entering locks ``home`` (:mod:`cli.run_folder`; a second launch on it
    is refused) and starts the daemons; leaving stops every process they started, and nothing else,
    also on errors, Ctrl-C and SIGTERM; should this process be killed outright, the group's guard
    stops them (:mod:`cli.process_group`, log ``guard.log``). Each launch has its own Flower state
    (FLWR_HOME and SuperLink database under ``home/.flwr/<launch>``, removed at the end) and its own
    log folder (``home/logs/<launch>``, linked as ``home/logs/latest``).

    Parameters
    ----------
    capacities : Sequence[float]
        One SuperNode per entry, with that capacity (fraction of the model, in (0, 1]).
        With ``simulation`` they are virtual SuperNodes of Flower's Simulation Engine
        (same ServerApp and ClientApp code), capacities passed as ``capacity-mix``.
    home : Path
        Folder for the SuperLink state, FLWR_HOME and ``logs/``.
    simulation : bool
        Run on the Simulation Engine (a ``--simulation`` SuperLink) instead of
        starting SuperNode processes.
    echo : callable
        Where progress lines go.
    secure : bool
        TLS with a private CA and SuperNode authentication: certificates and node
        key pairs are made in ``home/certs`` (:mod:`cli.credentials`) and each
        node's public key is registered with ``flwr supernode register``.
    unregistered : Sequence[int]
        With ``secure``, SuperNodes whose key is *not* registered (they must be refused).
    delays : Sequence[float]
        Test/benchmark knob: extra seconds per local epoch for SuperNode ``i``
        (``bench-delay-s``), to emulate slower devices; empty = none.
    data_paths : Sequence[str]
        With ``dataset = "node"``: SuperNode ``i`` reads its own data from ``data_paths[i]`` (its
        node config's ``data-path``, client id ``node-<i>``) instead of a partition; empty =
        partitions.
    devices : Sequence[str]
        SuperNode ``i`` trains on ``devices[i]`` (its node config's ``device``: ``auto``, ``cpu``,
        ``cuda``, ``mps``); empty = every node's default (``auto``).
    node_restarts : RestartPolicy, optional
        A SuperNode that exits while this federation is up is started again, with the same node
        config, as often as this allows (waiting longer each time); a node stopped by
        :meth:`kill_node` stays down. ``None`` (default): a node that exits stays down.
    database : str, optional
        The SuperLink's state: ``None`` (default) a SQLite file of this launch,
        ``<FLWR_HOME>/state.db``, removed at the end; ``"memory"`` Flower's in-memory state (no
        SQLite, nothing on disk); or a file path (kept after the launch).
    """

    def __init__(
        self,
        capacities: Sequence[float],
        home: Path,
        simulation: bool = False,
        echo=print,
        secure: bool = False,
        unregistered: Sequence[int] = (),
        delays: Sequence[float] = (),
        data_paths: Sequence[str] = (),
        database: str | None = None,
        devices: Sequence[str] = (),
        node_restarts: RestartPolicy | None = None,
    ) -> None:
        if secure and simulation:
            raise ValueError("the Simulation Engine runs without TLS or SuperNode authentication")
        self.secure = secure
        self.unregistered = set(unregistered)
        if delays and (simulation or len(delays) != len(capacities)):
            raise ValueError(
                "delays need one entry per SuperNode process (not available in simulation)"
            )
        self.delays = list(delays)
        if data_paths and (simulation or len(data_paths) != len(capacities)):
            raise ValueError(
                "data paths need one entry per SuperNode process (not available in simulation)"
            )
        self.data_paths = [str(Path(p).expanduser().resolve()) for p in data_paths]
        if devices and (simulation or len(devices) != len(capacities)):
            raise ValueError(
                "devices need one entry per SuperNode process (not available in simulation)"
            )
        unknown = sorted(set(devices) - set(DEVICES))
        if unknown:
            raise ValueError(f"devices {unknown}: allowed values are {', '.join(DEVICES)}")
        self.devices = list(devices)
        self.node_restarts = node_restarts
        #: Per SuperNode: restarts made, and when the next is due (monotonic seconds) while it is
        #: down.
        self.node_restarts_made: dict[int, int] = {}
        self._node_due: dict[int, float] = {}
        self._kept_down: set[int] = set()
        self._node_configs: dict[int, str] = {}
        self.superlink: subprocess.Popen | None = None
        self.superlink_starts = 0
        self.capacities = list(capacities)
        self.database = database
        self.home = home.resolve()
        self.simulation = simulation
        self.echo = echo
        self.certs = self.home / "certs"
        self.lock = RunFolderLock(self.home)
        # Set when entering: this launch's name, log folder, Flower state and environment.
        self.launch = ""
        self.logs = self.home / "logs"
        self.superlink_log = (
            self.logs / "superlink.log"
        )  # the current SuperLink's log, once one is started
        self.flwr_home = self.home / ".flwr"
        self.env: dict[str, str] = {}
        self.group = ProcessGroup(
            f"FLWR_HOME={self.flwr_home}"
        )  # no process has it: launches get their own
        self.runs = 0
        self.nodes: dict[int, subprocess.Popen] = {}
        self.node_markers: dict[int, bytes] = {}
        self._nodes_lock = threading.Lock()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._superlink_reported = False
        self.link_port = 0
        self._old_term = None

    def __enter__(self) -> LocalFederation:
        self.lock.acquire()
        try:
            self._refuse_leftovers()
            self.launch = launch_id()
            while (
                self.home / "logs" / self.launch
            ).exists():  # two launches in one second from one process
                self.launch += "+"
            self.logs = new_log_folder(self.home / "logs", self.launch)
            self.flwr_home = self.home / ".flwr" / self.launch
            self.flwr_home.mkdir(parents=True)
            self.env = flower_env(self.flwr_home)
            # Should this process die without stopping them, the group's guard stops them and says
            # so here.
            self.group = ProcessGroup(
                f"FLWR_HOME={self.flwr_home}", guard_log=self.logs / "guard.log"
            )
        except BaseException:
            self.lock.release()
            raise
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._start()
            self._watcher = threading.Thread(
                target=self._watch_nodes, name="supernode-watch", daemon=True
            )
            self._watcher.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self.group.stop()
        if self.launch:
            shutil.rmtree(self.flwr_home, ignore_errors=True)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        self.lock.release()

    def _refuse_leftovers(self) -> None:
        """Refuse the folder while processes of an earlier launch in it (a killed launcher's) still
        run.

        They would go on writing the same outputs as this launch.
        """
        prefix = f"FLWR_HOME={self.home / '.flwr'}{os.sep}".encode()
        left = pids_with_env(lambda entries: any(e.startswith(prefix) for e in entries))
        if left:
            raise RunFolderBusy(
                f"processes of an earlier launch in {self.home} are still running (PIDs "
                f"{', '.join(map(str, left))}); stop them first"
            )

    def _start(self) -> None:
        if self.secure:
            from cli.credentials import make_ca, make_server_cert
            from common.wire.node_keys import make_node_keys

            make_server_cert(self.certs, *make_ca(self.certs), ["localhost", "127.0.0.1"])
            for i in range(len(self.capacities)):
                make_node_keys(self.certs, f"node-{i}")
        self._start_superlink(free_port())
        for i in range(0 if self.simulation else len(self.capacities)):
            if self.secure and i not in self.unregistered:
                self.register_node(i)
            self.start_node(i)

    def _transport(self) -> list[str]:
        if not self.secure:
            return ["--insecure"]
        return [
            "--ssl-ca-certfile",
            str(self.certs / "ca.crt"),
            "--ssl-certfile",
            str(self.certs / "server.pem"),
            "--ssl-keyfile",
            str(self.certs / "server.key"),
            "--enable-supernode-auth",
        ]

    def _start_superlink(self, link_port: int) -> None:
        """Start the SuperLink on ``link_port`` and point this launch's ``flwr`` configuration at
        it."""
        self.superlink_starts += 1
        log_name = (
            "superlink.log"
            if self.superlink_starts == 1
            else f"superlink-{self.superlink_starts}.log"
        )
        superlink = self.group.start(
            [
                _bin("flower-superlink"),
                *self._transport(),
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(link_port),
                *([] if self.database == MEMORY_DATABASE else ["--database", self.database_path]),
                *(["--simulation"] if self.simulation else []),
            ],
            self.logs / log_name,
            self.env,
        )
        self.superlink, self.superlink_log = superlink, self.logs / log_name
        wait_for_port(link_port, 60, superlink)
        self.echo(f"SuperLink on 127.0.0.1:{link_port} (logs in {self.logs})")
        self.link_port = link_port
        trust = (
            f'root-certificates = "{self.certs / "ca.crt"}"' if self.secure else "insecure = true"
        )
        (self.flwr_home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = '
            f'"127.0.0.1:{link_port}"\n{trust}\n'
        )

    @property
    def closing(self) -> bool:
        """Whether the federation is being stopped (:meth:`__exit__` has begun): a run that fails
        then failed because its processes were stopped, and nothing is started again. A healing run
        in another thread (a test injecting faults, a program embedding the launcher) would
        otherwise restart a SuperLink and nodes that nobody stops."""
        return self._watch_stop.is_set()

    def restart_superlink(self) -> None:
        """A fresh SuperLink after the old one died, and every SuperNode started again to dial it.

        The SuperLink's state starts afresh (a new SQLite file of this launch, or memory) unless the
        launch was given a database file, which is reopened. The nodes are restarted rather than
        left to find the new SuperLink, whose state no longer knows them.
        """
        with self._nodes_lock:
            nodes = dict(self.nodes)
            self.nodes.clear()
            self._node_due.clear()
        for i, proc in nodes.items():
            signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
            self._stop_node_processes(i, grace=0.0)
        if self.superlink is not None and self.superlink.poll() is None:
            signal_group(self.superlink, signal.SIGKILL)
            self.superlink.wait(timeout=10)
        # What the old SuperLink started (its ServerApp above all) must not write beside the resumed
        # run.
        stop_pids(self.serverapp_processes, grace=5.0)
        if (
            self.database is None
        ):  # this launch's own file: the dead SuperLink's runs are not carried over
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(self.database_path + suffix).unlink(missing_ok=True)
        self._start_superlink(free_port())
        with self._nodes_lock:
            self._superlink_reported = False
        for i in range(0 if self.simulation else len(self.capacities)):
            if self.secure and i not in self.unregistered:
                self.register_node(i)
            if i not in self._kept_down:
                self.start_node(i)

    @property
    def database_path(self) -> str:
        """Where the SuperLink keeps its state: a file path, or ``memory``."""
        if self.database is None:
            return str(self.flwr_home / "state.db")
        return self.database

    def register_node(self, i: int) -> None:
        """Register SuperNode ``i``'s public key with the SuperLink (``flwr supernode
        register``)."""
        cmd = [
            _bin("flwr"),
            "supernode",
            "register",
            str(self.certs / f"node-{i}.pub"),
            "local",
            "--name",
            f"node-{i}",
        ]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"registering node-{i} failed: {done.stdout}{done.stderr}")
        self.echo(f"registered node-{i}")

    def node_config(self, i: int) -> str:
        """SuperNode ``i``'s ``--node-config``: partition ``i`` of ``len(capacities)`` (or its own
        folder in ``data_paths``), capacity ``capacities[i]``."""
        where = (
            f'data-path={json.dumps(self.data_paths[i])} client-id="node-{i}"'
            if self.data_paths
            else f"partition-id={i} num-partitions={len(self.capacities)}"
        )
        config = f"{where} capacity={self.capacities[i]!r}"
        if self.delays and self.delays[i]:
            config += f" bench-delay-s={float(self.delays[i])!r}"
        if self.devices:
            config += f" device={json.dumps(self.devices[i])}"
        return config

    def start_node(self, i: int, node_config: str | None = None) -> None:
        """Start SuperNode ``i`` (also restarts a stopped one).

        Parameters
        ----------
        i : int
            The node's number: its log is ``supernode-<i>.log``.
        node_config : str, optional
            Its ``--node-config`` (default :meth:`node_config`; a test may give a wrong one).
        """
        config = self.node_config(i) if node_config is None else node_config
        self._node_configs[i] = config
        with self._nodes_lock:
            self._kept_down.discard(i)
            self._node_due.pop(i, None)
        # Every process of this node, Flower's detached children included, carries this entry: when
        # the node dies they are found and stopped (:meth:`_watch_nodes`).
        marker = f"{self.launch}/node-{i}/{time.monotonic_ns()}"
        proc = self.group.start(
            [
                _bin("flower-supernode"),
                *(
                    [
                        "--root-certificates",
                        str(self.certs / "ca.crt"),
                        "--auth-supernode-private-key",
                        str(self.certs / f"node-{i}"),
                    ]
                    if self.secure
                    else ["--insecure"]
                ),
                "--superlink",
                f"127.0.0.1:{self.link_port}",
                "--port",
                str(free_port()),
                "--node-config",
                config,
            ],
            self.logs / f"supernode-{i}.log",
            # Every node shares this machine's cores: one intra-op thread each avoids
            # oversubscription.
            {**self.env, "OMP_NUM_THREADS": "1", "FIBOS_SUPERNODE": marker},
        )
        with self._nodes_lock:
            self.nodes[i] = proc
            self.node_markers[i] = f"FIBOS_SUPERNODE={marker}".encode()
        self.echo(f"SuperNode {i}: {config}")

    def node_processes(self, i: int) -> list[int]:
        """PIDs of SuperNode ``i``'s processes still alive (the node and everything it spawned)."""
        marker = self.node_markers.get(i)
        return [] if marker is None else pids_with_env(lambda entries: marker in entries)

    def _stop_node_processes(self, i: int, grace: float) -> None:
        stop_pids(lambda: self.node_processes(i), grace)

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i``, as a crash or power loss would; its children are stopped too.

        The node stays down (no restart under ``node_restarts``) until :meth:`start_node` starts it
        again, as ``docker compose kill`` leaves a container of a ``restart: unless-stopped``
        service down.
        """
        with self._nodes_lock:
            self._kept_down.add(i)
            proc = self.nodes.pop(i)
        signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=10)
        self._stop_node_processes(i, grace=0.0)

    def _report_dead_superlink(self) -> None:
        """Say once that the SuperLink died, and how to continue (from the watcher, or when a run
        fails)."""
        superlink = self.superlink
        with self._nodes_lock:
            if superlink is None or self._superlink_reported or superlink.poll() is None:
                return
            self._superlink_reported = True
        self.echo(
            f"the SuperLink exited (code {superlink.returncode}); the run cannot go on with it. "
            f"Its log: {self.logs}/superlink*.log. fibos local starts a fresh one and resumes the "
            "run when --restarts allows; otherwise launch again with -c resume=true to continue "
            "from the last completed round"
        )

    def serverapp_processes(self) -> list[int]:
        """PIDs of this launch's ServerApp processes still alive (``flwr-serverapp``, started by the
        SuperLink)."""

        def serverapp(pid: int) -> bool:
            try:
                return b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return False

        marker = f"FLWR_HOME={self.flwr_home}".encode()
        return [pid for pid in pids_with_env(lambda entries: marker in entries) if serverapp(pid)]

    def superlink_dead(self) -> bool:
        """Whether the SuperLink process has exited."""
        return self.superlink is not None and self.superlink.poll() is not None

    def _watch_nodes(self) -> None:
        """Background: when a SuperNode process dies, reap it and stop what it spawned; restart it
        if allowed.

        Flower's executor and ClientApp processes exit when their parent's PID disappears, but an
        unreaped SuperNode stays a zombie whose PID exists: without this they would run on until the
        launch ends. Under ``node_restarts`` the node is started again with its node config after
        the policy's wait (not while the SuperLink is down: :meth:`restart_superlink` restarts every
        node).

        A dead SuperLink is reported (the run fails with it; ``resume=true`` continues it).
        """
        while not self._watch_stop.wait(0.5):
            self._report_dead_superlink()
            with self._nodes_lock:
                dead = {i: p for i, p in self.nodes.items() if p.poll() is not None}
                for i in dead:
                    del self.nodes[i]
            for i, proc in dead.items():
                left = self.node_processes(i)
                self.echo(
                    f"SuperNode {i} exited (code {proc.returncode}); stopping the {len(left)} "
                    "processes it left"
                )
                self._stop_node_processes(i, grace=5.0)
                self._schedule_node_restart(i)
            self._restart_due_nodes()

    def _schedule_node_restart(self, i: int) -> None:
        policy = self.node_restarts
        with self._nodes_lock:
            if policy is None or i in self._kept_down:
                return
            made = self.node_restarts_made.get(i, 0)
            if made >= policy.attempts:
                self.echo(
                    f"SuperNode {i}: {made} restarts made, the most --node-restarts allows; it "
                    "stays down"
                )
                return
            wait = policy.wait_s(made)
            self._node_due[i] = time.monotonic() + wait
        self.echo(f"SuperNode {i}: restart {made + 1} of at most {policy.attempts} in {wait:.0f} s")

    def _restart_due_nodes(self) -> None:
        if self.superlink_dead():
            return
        now = time.monotonic()
        with self._nodes_lock:
            due = [i for i, at in self._node_due.items() if at <= now and i not in self.nodes]
            for i in due:
                del self._node_due[i]
                self.node_restarts_made[i] = self.node_restarts_made.get(i, 0) + 1
        for i in due:
            try:
                self.start_node(i, self._node_configs.get(i))
            except OSError as err:  # the launch goes on without it; said once
                self.echo(f"SuperNode {i} could not be started again: {err}")

    def run_overrides(
        self, run_config: Mapping[str, object], results_dir: Path, app_dir: Path = APP_DIR
    ) -> dict:
        """The validated ``-c`` overrides of a run of this federation writing to ``results_dir``.

        Adds what the launcher sets (``results-dir``; ``capacity-mix`` on the Simulation Engine),
        refuses a ``-c`` key set differently (or ``capacity-mix`` where it means nothing), and
        checks the whole run config with :func:`check_run_config` (and that ``data-path`` and a
        local ``model-path``, if any, exist; with ``resume=true``, that the checkpoint and
        metrics.json can be resumed from: :func:`check_resume`; with ``tensorboard=true``, that the
        tensorboard package is installed: :func:`check_tensorboard`). Starts nothing.
        """
        check_results_folder(results_dir)
        flags: dict[str, tuple[str, object]] = {
            "results-dir": ("--results", str(results_dir.resolve()))
        }
        if self.simulation:
            flags["capacity-mix"] = (
                "--capacities",
                ",".join(repr(float(c)) for c in self.capacities),
            )
        elif parse_capacity_list(run_config.get("capacity-mix", "")):
            raise ConfigError(
                f"capacity-mix={run_config['capacity-mix']!r}: applies only to nodes without a "
                "capacity in their node config, and every SuperNode this launcher starts has one; "
                "give capacities with --capacities"
            )
        overrides = merge_flag_settings(run_config, flags)
        cfg = check_run_config(overrides, app_dir)
        check_tensorboard(
            cfg
        )  # the ServerApp runs here: refuse tensorboard=true without its package now
        if (
            cfg.resume
        ):  # a missing or damaged checkpoint would otherwise surface after the federation is up
            check_resume(results_dir.resolve(), cfg)
        # Every node of a local federation reads data-path on this machine.
        if cfg.data_path and not Path(cfg.data_path).expanduser().exists():
            raise ConfigError(f"data-path={cfg.data_path!r}: no such file or folder")
        if cfg.dataset == NODE_DATASET and not self.data_paths:
            raise ConfigError(
                'dataset="node": each SuperNode reads its own data; give one folder per SuperNode '
                "with --data-paths"
            )
        if self.data_paths and cfg.dataset != NODE_DATASET:
            raise ConfigError(
                f"--data-paths gives each SuperNode its own data, but dataset={cfg.dataset!r}: add "
                '-c dataset="node" '
                "and -c classes=... (the run's class names, or their count)"
            )
        for i, path in enumerate(self.data_paths):
            if not Path(path).exists():
                raise ConfigError(f"--data-paths item {i + 1} {path!r}: no such file or folder")
        if cfg.test_data_path and not Path(cfg.test_data_path).expanduser().exists():
            raise ConfigError(f"test-data-path={cfg.test_data_path!r}: no such file or folder")
        if (
            cfg.model_path
        ):  # a local model folder must exist here too (a hub id is fetched by each process)
            resolve_model_path(cfg.model_path)
        return overrides

    def run(
        self,
        run_config: dict[str, object],
        results_dir: Path,
        app_dir: Path = APP_DIR,
        timeout: float = 3600.0,
        lock: bool = True,
    ) -> dict:
        """Submit the app with ``flwr run --stream`` and wait for it; returns the parsed
        metrics.json.

        Parameters
        ----------
        run_config : dict
            Run-config overrides (``results-dir`` is set to ``results_dir``).
        results_dir : Path
            Output folder (metrics.json, model.pt, fisher_state.npz, checkpoint.npz); locked for the
            run when it is not the federation's own folder.
        app_dir : Path
            The Flower app (folder with pyproject.toml).
        timeout : float
            Seconds the run may take before it is stopped.
        lock : bool
            Lock ``results_dir`` for the run (``False``: the caller holds its lock).
        """
        results_dir = results_dir.resolve()
        overrides = self.run_overrides(run_config, results_dir, app_dir)
        self.runs += 1
        # Flower would walk the whole checkout (its virtual environment too) to build the bundle.
        staged = stage_app(
            app_dir, self.flwr_home / "app"
        )  # a BundleError is a RuntimeError: the run failed
        cmd = [_bin("flwr"), "run", str(staged), "local", "--stream", "-c"]
        if self.simulation:
            cmd = [*cmd[:-1], "--federation-config", f"num-supernodes={len(self.capacities)}", "-c"]
            self.echo(
                f"Simulation Engine: {len(self.capacities)} virtual SuperNodes, capacities "
                f"{overrides['capacity-mix']}"
            )
        cmd.append(toml_overrides(overrides))
        self.echo("$ " + shlex.join(cmd))
        log = self.logs / ("serverapp.log" if self.runs == 1 else f"serverapp-{self.runs}.log")
        superlink_log = self.superlink_log
        logged_before = superlink_log.stat().st_size if superlink_log.exists() else 0
        try:
            with RunFolderLock(results_dir) if lock and results_dir != self.home else nullcontext():
                try:
                    run_federation_command(
                        cmd, self.env, log, timeout, self.echo, connection="local"
                    )
                except RuntimeError:
                    # The run can fail before the watcher's next look; the operator must still learn
                    # why.
                    time.sleep(0.2)
                    self._report_dead_superlink()
                    raise
            metrics_path = results_dir / "metrics.json"
            if not metrics_path.exists():
                raise RuntimeError(f"the run wrote no {metrics_path}; see {log}")
            if not (results_dir / "model.pt").exists():
                raise RuntimeError(f"the run did not finish (no model.pt); see {log}")
        except (RuntimeError, RunTimeout) as err:
            # Flower's own words for a locked database are an internal server error far from the
            # cause.
            why = database_diagnosis(superlink_log, self.database_path, since=logged_before)
            if not why:
                raise
            if isinstance(err, RunTimeout):
                raise RunTimeout(f"{why}\n{err}", err.run_id) from err
            raise SuperLinkDatabaseError(f"{why}\n{err}") from err
        return json.loads(metrics_path.read_text())

    def run_healing(
        self,
        run_config: dict[str, object],
        results_dir: Path,
        app_dir: Path = APP_DIR,
        timeout: float = 3600.0,
        restarts: RestartPolicy | None = None,
    ) -> dict:
        """:meth:`run`, and after a failure the same run resumed from its checkpoint, without a
        person.

        A run that fails (its ServerApp lost, or the SuperLink with it: then a fresh SuperLink and
        every node are started first, :meth:`restart_superlink`) is resubmitted with ``resume=true``
        after the policy's wait, as often as ``restarts`` allows; each restart is recorded
        (:mod:`cli.restarts`). A failure that cannot be resumed (no checkpoint yet, one that fails
        its checks, a setting the resumed run refuses) and a run past its timeout are not retried:
        the error says why. ``results_dir`` stays locked between the attempts.

        Parameters
        ----------
        run_config, results_dir, app_dir
            As for :meth:`run`.
        timeout : float
            Seconds all attempts together may take.
        restarts : RestartPolicy, optional
            Restarts allowed and the waits between them (default :class:`RestartPolicy`;
            ``attempts=0``: none).
        """
        policy = RestartPolicy() if restarts is None else restarts
        results_dir = results_dir.resolve()
        started = time.monotonic()
        config, made = dict(run_config), 0
        with RunFolderLock(results_dir) if results_dir != self.home else nullcontext():
            while True:
                left = timeout - (time.monotonic() - started)
                try:
                    return self.run(config, results_dir, app_dir, max(left, 1.0), lock=False)
                except RunTimeout:
                    raise
                except RuntimeError as err:
                    failed_at = time.time()
                    if policy.attempts == 0:
                        raise
                    if self.closing:
                        raise RuntimeError(
                            f"{err}\nnot restarted: the federation is stopping"
                        ) from err
                    if made >= policy.attempts:
                        gave_up = f"not restarted again: {made} restarts made, the most allowed"
                        raise RuntimeError(f"{err}\n{gave_up}") from err
                    config = {**config, "resume": True}
                    time.sleep(1.0)  # a SuperLink that went down with the run has exited by now
                    replace_link = self.superlink_dead() or isinstance(err, SuperLinkDatabaseError)
                    fault = "superlink" if replace_link else "serverapp"
                    try:
                        self.run_overrides(config, results_dir, app_dir)  # the resume's own checks
                    except ConfigError as why:
                        raise RuntimeError(f"{err}\nnot restarted: {why}") from err
                    resumed_from = check_checkpoint(results_dir / CHECKPOINT)[0]
                    why = next(
                        (line for line in str(err).splitlines() if line.strip()), type(err).__name__
                    )
                    record = restart_record(
                        made + 1,
                        fault,
                        why,
                        resumed_from,
                        last_recorded_round(results_dir),
                        failed_at,
                    )
                    wait = policy.wait_s(made)
                    self.echo(
                        "the run failed "
                        f"({'SuperLink lost' if fault == 'superlink' else 'ServerApp lost'}: "
                        f"{why}); restart {made + 1} of at most {policy.attempts} in {wait:.0f} s, "
                        f"resuming after round {resumed_from} ({record['rounds_redone']} round(s) "
                        "done again)"
                    )
                    time.sleep(wait)
                    if self.closing:  # stopped during the wait: start nothing it would not stop
                        raise RuntimeError(
                            f"{err}\nnot restarted: the federation is stopping"
                        ) from err
                    if fault == "superlink":
                        self.restart_superlink()
                    else:
                        # a ServerApp the SuperLink gave up on may still be running: it must not
                        # write beside
                        stop_pids(self.serverapp_processes, grace=5.0)
                    record_restart(results_dir, record)
                    made += 1


def run_local_federation(
    capacities: Sequence[float],
    results_dir: Path,
    run_config: dict[str, object],
    app_dir: Path = APP_DIR,
    timeout: float = 3600.0,
    echo=print,
    simulation: bool = False,
    delays: Sequence[float] = (),
    data_paths: Sequence[str] = (),
    database: str | None = None,
) -> dict:
    """Start a :class:`LocalFederation` in ``results_dir``, run the app once, stop everything.

    The run config is validated before any process starts (:meth:`LocalFederation.run_overrides`).
    ``delays`` (test/benchmark knob): extra seconds per local epoch per SuperNode.
    Returns the parsed metrics.json (see :meth:`LocalFederation.run`).
    """
    federation = LocalFederation(
        capacities,
        results_dir,
        simulation,
        echo,
        delays=delays,
        data_paths=data_paths,
        database=database,
    )
    federation.run_overrides(run_config, results_dir, app_dir)
    with federation:
        return federation.run(run_config, results_dir, app_dir, timeout)


def toml_overrides(values: dict[str, object]) -> str:
    """Run-config overrides as the space-separated TOML pairs ``flwr run -c`` takes."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            parts.append(f"{key}={value!r}")
        else:
            parts.append(f"{key}={json.dumps(str(value))}")
    return " ".join(parts)


class Deadline(threading.Timer):
    """A timer that stops a process (SIGTERM to its group, SIGKILL ``grace`` s later) when it fires.

    Parameters
    ----------
    proc : subprocess.Popen
        The process, leader of its own process group.
    timeout : float
        Seconds from now until it is stopped.
    grace : float
        Seconds it has to exit after SIGTERM.
    """

    def __init__(self, proc: subprocess.Popen, timeout: float, grace: float = 10.0) -> None:
        super().__init__(timeout, self._stop)
        self.daemon = True
        self.proc = proc
        self.grace = grace
        self.fired = threading.Event()

    def _stop(self) -> None:
        self.fired.set()
        signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            signal_group(self.proc, signal.SIGKILL)


class SuperLinkDatabaseError(RuntimeError):
    """A run failed because the SuperLink's SQLite database stayed locked past Flower's busy
    timeout.

    The SuperLink may outlive it in a state that starts no further run (its scheduler's write failed
    too), so a restart replaces it rather than resubmitting to it.
    """


class RunTimeout(TimeoutError):
    """A run that took longer than its timeout; its ``flwr`` command was stopped.

    The run on the SuperLink ends only with the SuperLink (``fibos local``) or when it is stopped
    (``flwr stop``, as ``fibos control submit`` does): ``run_id`` is the run's, when its log stream
    said it.
    """

    def __init__(self, message: str, run_id: int | None) -> None:
        super().__init__(message)
        self.run_id = run_id


class _RunLog:
    """The lines of one run's log streams: kept in the log file, round lines and problems echoed,
    failures noted."""

    def __init__(self, log_file: TextIO, echo: Callable[[str], None]) -> None:
        self.log_file, self.echo = log_file, echo
        self.last_exception = self.last_error = ""
        self.box: list[str] | None = (
            None  # the text of an error box Flower's CLI draws (e.g. "SuperLink unavailable")
        )
        self.failed = False
        self.run_id: int | None = None

    def line(self, line: str) -> None:
        self.log_file.write(line)
        self.log_file.flush()
        started = RUN_STARTED.search(line)
        if started and self.run_id is None:
            self.run_id = int(started.group(1))
        match = ROUND_LINE.search(line)
        if match:
            self.echo(match.group(0))
        elif "rejected" in line or "excluded" in line or "Traceback" in line or "ERROR" in line:
            self.echo(line.rstrip())
            self.failed = self.failed or "Traceback" in line
        if "\u256d\u2500 Error" in line:
            self.box = []
        elif self.box is not None and line.lstrip().startswith("\u2502"):
            self.box.append(line.strip().strip("\u2502").strip())
        elif self.box is not None:
            self.last_exception, self.box = " ".join(self.box), None
        if EXCEPTION_LINE.match(line):
            self.last_exception = line.strip()
        elif "ERROR" in line:
            self.last_error = line.strip()

    def follow(self, cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, bool]:
        """Run ``cmd``, reading its output line by line for at most ``timeout`` s: ``(exit status,
        expired)``."""
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,
        )
        # The clock, not the output, ends an overdue run: a run waiting for a node that never comes
        # prints nothing.
        expired = Deadline(proc, max(timeout, 0.0))
        expired.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.line(line)
            proc.wait()
        finally:
            expired.cancel()
            if proc.poll() is None:
                signal_group(proc, signal.SIGTERM)
                proc.wait(timeout=10)
        return proc.returncode, expired.fired.is_set()


def run_federation_command(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout: float,
    echo: Callable[[str], None],
    connection: str | None = None,
) -> None:
    """Run ``flwr run --stream``, echo round lines and warnings, keep the full log.

    Raises ``RuntimeError`` when the run fails, whatever ``flwr run``'s exit status (it is 0 when
    the ServerApp raised): the message carries the last error line of the log (the exception that
    ended the ServerApp), so the operator sees why without opening the log. Raises
    :class:`RunTimeout` (a ``TimeoutError``) once it has run ``timeout`` s (the command is stopped
    then, whether or not it prints anything).

    ``connection``: the SuperLink connection the run was submitted to. Then the end of the log
    stream is not taken for the end of the run: the run's status is read from the SuperLink
    (:mod:`cli.run_status`); a run still going is followed again (``flwr log --stream``), and one
    that ended ``finished:failed`` or ``finished:stopped`` raises ``RuntimeError`` ("the run failed
    (finished:stopped): ..."), however the stream ended.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log_file:
        log = _RunLog(log_file, echo)
        returncode, expired = log.follow(cmd, env, timeout)
        status = None
        while connection is not None and log.run_id is not None and not expired:
            status = run_status(env, connection, log.run_id)
            if not status.unfinished:
                break
            echo(
                f"the run's log stream ended while run {log.run_id} is {status.status}; following "
                "it again"
            )
            _, expired = log.follow(
                ["flwr", "log", str(log.run_id), connection, "--stream"],
                env,
                deadline - time.monotonic(),
            )
            if not expired:
                time.sleep(2.0)  # a stream that ends at once must not turn into a busy loop
    if expired:
        raise RunTimeout(
            f"the run exceeded {timeout:.0f} s and was stopped; see {log_path}", log.run_id
        )
    if status is not None and status.finished and not status.succeeded:
        why = log.last_exception or status.details or log.last_error
        raise RuntimeError(f"the run failed ({status.status}): {why}\n(full log: {log_path})")
    if status is not None and status.status == "unknown":
        echo(
            f"warning: the run's final status could not be read ({status.details}); judged by its "
            "log"
        )
    if returncode != 0 or log.failed:
        if log.box:
            log.last_exception = " ".join(log.box)
        why = log.last_exception or log.last_error or f"flwr run exited with status {returncode}"
        raise RuntimeError(f"the run failed: {why}\n(full log: {log_path})")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos local``; also ``python -m cli.launcher``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--capacities",
        type=parse_capacities,
        default=list(DEFAULT_CAPACITIES),
        help="comma-separated capacities, one SuperNode each (default: 1,1/2,1/4,1/4,1/8,1/16)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="number of rounds (default: the app's num-rounds)",
    )
    parser.add_argument("--results", type=Path, default=Path("results/demo"), help="output folder")
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="extra run-config overrides, e.g. -c 'lr=0.1'",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=3600.0,
        help="seconds the run may take, counted by the clock from its submission; then every "
        "process is stopped",
    )
    parser.add_argument(
        "--delays",
        default="",
        help="test/benchmark knob: bench-delay-s per SuperNode (extra seconds per local epoch), "
        "e.g. 0,0,3,8",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="times a failed run (its ServerApp or the SuperLink lost) is resumed from its "
        "checkpoint without a person; 0 = never (default: 3)",
    )
    parser.add_argument(
        "--node-restarts",
        type=int,
        default=5,
        help="times each SuperNode that exits during the launch is started again; 0 = never "
        "(default: 5)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=positive_seconds,
        default=2.0,
        help="seconds before a first restart; each later one of the same thing waits twice as "
        "long, at most 60 s (default: 2)",
    )
    parser.add_argument(
        "--devices",
        default="",
        help="comma-separated training device per SuperNode (auto, cpu, cuda, mps), e.g. "
        "cuda,cpu,cpu; default: auto on every node",
    )
    parser.add_argument(
        "--data-paths",
        default="",
        help='with -c dataset="node": comma-separated folders, one per SuperNode, each read as '
        "that node's own "
        "data (an image folder, a save_to_disk folder, Parquet/CSV files, or label<TAB>text lines)",
    )
    parser.add_argument(
        "--superlink-database",
        type=superlink_database,
        default=None,
        metavar="memory|PATH",
        help="where the SuperLink keeps its state: memory (no SQLite file; advised on a loaded "
        "machine), or a SQLite file (kept after the run); default: a file of this launch under "
        "RESULTS/.flwr, removed at the end",
    )
    args = parser.parse_args(argv)
    delays = [float(v) for v in args.delays.split(",") if v.strip()]
    if delays and len(delays) != len(args.capacities):
        parser.error(f"--delays has {len(delays)} entries for {len(args.capacities)} capacities")
    data_paths = [v.strip() for v in args.data_paths.split(",") if v.strip()]
    devices = [v.strip() for v in args.devices.split(",") if v.strip()]
    for flag, value in (("--restarts", args.restarts), ("--node-restarts", args.node_restarts)):
        if value < 0:
            parser.error(f"{flag} {value}: give 0 (never) or more")
    if devices and len(devices) != len(args.capacities):
        parser.error(f"--devices has {len(devices)} entries for {len(args.capacities)} capacities")
    if set(devices) - set(DEVICES):
        parser.error(f"--devices {args.devices!r}: allowed values are {', '.join(DEVICES)}")
    if data_paths and len(data_paths) != len(args.capacities):
        parser.error(
            f"--data-paths has {len(data_paths)} entries for {len(args.capacities)} capacities"
        )
    started = time.monotonic()
    try:
        # Everything is checked before any process starts: a bad setting costs no SuperLink
        # start-up.
        flags = (
            {} if args.rounds is None else {"num-rounds": (f"--rounds {args.rounds}", args.rounds)}
        )
        overrides = merge_flag_settings(parse_overrides(args.run_config), flags)
        federation = LocalFederation(
            args.capacities,
            args.results,
            delays=delays,
            data_paths=data_paths,
            database=args.superlink_database,
            devices=devices,
            node_restarts=RestartPolicy(args.node_restarts, args.restart_backoff)
            if args.node_restarts
            else None,
        )
        federation.run_overrides(overrides, args.results)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with federation:
            metrics = federation.run_healing(
                overrides,
                args.results,
                timeout=args.timeout,
                restarts=RestartPolicy(args.restarts, args.restart_backoff),
            )
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as err:  # TimeoutError is an OSError; an OSError names its file
        print(f"error: {err}", file=sys.stderr)
        return 1
    print()
    print(summary_table(metrics))
    plot = write_accuracy_plot(metrics, args.results / "accuracy.png")
    print(f"\n{len(metrics['rounds']) - 1} rounds in {time.monotonic() - started:.0f} s")
    print(
        f"metrics: {args.results / 'metrics.json'}\nplot:    {plot}\nmodel:   "
        f"{args.results / 'model.pt'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
