"""Local deployment launcher: a real SuperLink and N SuperNodes on loopback, one ``flwr run``.

Starts ``flower-superlink`` and ``flower-supernode`` processes (each SuperNode
with its own capacity), submits the app with ``flwr run``, prints one progress
line per round, then a summary table, writes ``accuracy.png`` next to
``metrics.json`` and always stops every process it started (also on failure,
Ctrl-C or SIGTERM).

Usage::

    python -m server.launcher --capacities 1,0.5,0.25,0.25,0.125,0.0625 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from types import FrameType

from common.config import ConfigError, parse_capacity_list
from server.tools.report import summary_table, write_accuracy_plot

DEFAULT_CAPACITIES = (1.0, 0.5, 0.25, 0.25, 0.125, 0.0625)
APP_DIR = Path(__file__).resolve().parents[1]
ROUND_LINE = re.compile(r"\[(?:round|update) \d+/\d+\].*")


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
            raise RuntimeError(f"process {proc.args[0]} exited with code {proc.returncode} before listening")
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
    """A console script of the running interpreter's environment (works without an activated venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


class ProcessGroup:
    """Processes started in their own sessions, stopped together with every descendant.

    Flower's daemons start ``flower-superexec`` / ``flwr-serverapp`` / ``flwr-clientapp``
    in sessions of their own, which a process-group signal misses. Every process
    the launcher starts carries ``marker`` (the private FLWR_HOME) in its
    environment, and so does everything they spawn: stopping signals all of them.

    Parameters
    ----------
    marker : str
        An ``KEY=value`` environment entry unique to this federation.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker.encode()
        self.procs: list[subprocess.Popen] = []

    def start(self, args: Sequence[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        """Start ``args`` with stdout and stderr in ``log_path``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                list(args), stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def members(self) -> list[int]:
        """PIDs of live processes that carry the marker (Linux ``/proc``; elsewhere the direct children)."""
        proc_dir = Path("/proc")
        if not proc_dir.is_dir():
            return [p.pid for p in self.procs if p.poll() is None]
        found = []
        for entry in proc_dir.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if self.marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM everything (newest first), then SIGKILL what is left after ``grace`` s."""
        for proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        for pid in self.members():
            _signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for proc in self.procs:
                proc.poll()  # reap our direct children so they do not linger as zombies
            if not self.members():
                break
            time.sleep(0.2)
        for proc in self.procs:
            _signal_group(proc, signal.SIGKILL)
        for pid in self.members():
            _signal_pid(pid, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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


class LocalFederation:
    """A SuperLink and its SuperNodes (or virtual ones) on loopback, for one or more ``flwr run``.

    Use as a context manager: entering starts the daemons, leaving stops every
    process they started, also on errors, Ctrl-C and SIGTERM.

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
        key pairs are made in ``home/certs`` (:mod:`server.credentials`) and each
        node's public key is registered with ``flwr supernode register``.
    unregistered : Sequence[int]
        With ``secure``, SuperNodes whose key is *not* registered (they must be refused).
    delays : Sequence[float]
        Test/benchmark knob: extra seconds per local epoch for SuperNode ``i``
        (``bench-delay-s``), to emulate slower devices; empty = none.
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
    ) -> None:
        if secure and simulation:
            raise ValueError("the Simulation Engine runs without TLS or SuperNode authentication")
        self.secure = secure
        self.unregistered = set(unregistered)
        if delays and (simulation or len(delays) != len(capacities)):
            raise ValueError("delays need one entry per SuperNode process (not available in simulation)")
        self.delays = list(delays)
        self.capacities = list(capacities)
        self.home = home.resolve()
        self.simulation = simulation
        self.echo = echo
        self.logs = self.home / "logs"
        self.certs = self.home / "certs"
        self.flwr_home = self.home / ".flwr"
        self.env = flower_env(self.flwr_home)
        self.group = ProcessGroup(f"FLWR_HOME={self.flwr_home}")
        self.runs = 0
        self.nodes: dict[int, subprocess.Popen] = {}
        self.link_port = 0
        self._old_term = None

    def __enter__(self) -> LocalFederation:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def _start(self) -> None:
        link_port = free_port()
        if self.secure:
            from common.node_keys import make_node_keys
            from server.credentials import make_ca, make_server_cert

            make_server_cert(self.certs, *make_ca(self.certs), ["localhost", "127.0.0.1"])
            for i in range(len(self.capacities)):
                make_node_keys(self.certs, f"node-{i}")
            transport = [
                "--ssl-ca-certfile",
                str(self.certs / "ca.crt"),
                "--ssl-certfile",
                str(self.certs / "server.pem"),
                "--ssl-keyfile",
                str(self.certs / "server.key"),
                "--enable-supernode-auth",
            ]
        else:
            transport = ["--insecure"]
        superlink = self.group.start(
            [
                _bin("flower-superlink"),
                *transport,
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(link_port),
                "--database",
                str(self.flwr_home / "state.db"),
                *(["--simulation"] if self.simulation else []),
            ],
            self.logs / "superlink.log",
            self.env,
        )
        wait_for_port(link_port, 60, superlink)
        self.echo(f"SuperLink on 127.0.0.1:{link_port} (logs in {self.logs})")
        self.link_port = link_port
        trust = f'root-certificates = "{self.certs / "ca.crt"}"' if self.secure else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{link_port}"\n{trust}\n'
        )
        for i in range(0 if self.simulation else len(self.capacities)):
            if self.secure and i not in self.unregistered:
                self.register_node(i)
            self.start_node(i)

    def register_node(self, i: int) -> None:
        """Register SuperNode ``i``'s public key with the SuperLink (``flwr supernode register``)."""
        cmd = [_bin("flwr"), "supernode", "register", str(self.certs / f"node-{i}.pub"), "local", "--name", f"node-{i}"]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"registering node-{i} failed: {done.stdout}{done.stderr}")
        self.echo(f"registered node-{i}")

    def start_node(self, i: int) -> None:
        """Start SuperNode ``i`` (partition ``i``, capacity ``capacities[i]``); also restarts a stopped one."""
        gamma = self.capacities[i]
        node_config = f"partition-id={i} num-partitions={len(self.capacities)} capacity={gamma!r}"
        if self.delays and self.delays[i]:
            node_config += f" bench-delay-s={float(self.delays[i])!r}"
        self.nodes[i] = self.group.start(
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
                node_config,
            ],
            self.logs / f"supernode-{i}.log",
            # Every node shares this machine's cores: one intra-op thread each avoids oversubscription.
            {**self.env, "OMP_NUM_THREADS": "1"},
        )
        self.echo(f"SuperNode {i}: capacity {gamma:g}")

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and its process group, as a crash or power loss would."""
        proc = self.nodes.pop(i)
        _signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=10)

    def run(
        self, run_config: dict[str, object], results_dir: Path, app_dir: Path = APP_DIR, timeout: float = 3600.0
    ) -> dict:
        """Submit the app with ``flwr run --stream`` and wait for it; returns the parsed metrics.json.

        Parameters
        ----------
        run_config : dict
            Run-config overrides (``results-dir`` is set to ``results_dir``).
        results_dir : Path
            Output folder (metrics.json, model.pt, fisher_state.npz, checkpoint.npz).
        app_dir : Path
            The Flower app (folder with pyproject.toml).
        timeout : float
            Seconds the run may take before it is stopped.
        """
        results_dir = results_dir.resolve()
        self.runs += 1
        overrides = {**run_config, "results-dir": str(results_dir)}
        cmd = [_bin("flwr"), "run", str(app_dir), "local", "--stream", "-c"]
        if self.simulation:
            overrides["capacity-mix"] = ",".join(repr(float(c)) for c in self.capacities)
            cmd = [*cmd[:-1], "--federation-config", f"num-supernodes={len(self.capacities)}", "-c"]
            self.echo(
                f"Simulation Engine: {len(self.capacities)} virtual SuperNodes, capacities {overrides['capacity-mix']}"
            )
        cmd.append(toml_overrides(overrides))
        self.echo("$ " + shlex.join(cmd))
        log = self.logs / ("serverapp.log" if self.runs == 1 else f"serverapp-{self.runs}.log")
        run_federation_command(cmd, self.env, log, timeout, self.echo)
        metrics_path = results_dir / "metrics.json"
        if not metrics_path.exists():
            raise RuntimeError(f"the run wrote no {metrics_path}; see {log}")
        if not (results_dir / "model.pt").exists():
            raise RuntimeError(f"the run did not finish (no model.pt); see {log}")
        return json.loads(metrics_path.read_text())


def run_local_federation(
    capacities: Sequence[float],
    results_dir: Path,
    run_config: dict[str, object],
    app_dir: Path = APP_DIR,
    timeout: float = 3600.0,
    echo=print,
    simulation: bool = False,
    delays: Sequence[float] = (),
) -> dict:
    """Start a :class:`LocalFederation` in ``results_dir``, run the app once, stop everything.

    ``delays`` (test/benchmark knob): extra seconds per local epoch per SuperNode.
    Returns the parsed metrics.json (see :meth:`LocalFederation.run`).
    """
    with LocalFederation(capacities, results_dir, simulation, echo, delays=delays) as federation:
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


def run_federation_command(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float, echo) -> None:
    """Run ``flwr run --stream``, echo round lines and warnings, keep the full log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,
        )
        failed = False
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                log_file.flush()
                match = ROUND_LINE.search(line)
                if match:
                    echo(match.group(0))
                elif "rejected" in line or "excluded" in line or "Traceback" in line or "ERROR" in line:
                    echo(line.rstrip())
                    failed = failed or "Traceback" in line
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run exceeded {timeout:.0f} s")
            proc.wait()
        finally:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                proc.wait(timeout=10)
    if proc.returncode != 0 or failed:
        raise RuntimeError(f"flwr run failed (exit {proc.returncode}); see {log_path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos-local`` / ``python -m server.launcher``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        type=float,
        default=3600.0,
        help="seconds before the run is stopped",
    )
    parser.add_argument(
        "--delays",
        default="",
        help="test/benchmark knob: bench-delay-s per SuperNode (extra seconds per local epoch), e.g. 0,0,3,8",
    )
    args = parser.parse_args(argv)
    delays = [float(v) for v in args.delays.split(",") if v.strip()]
    if delays and len(delays) != len(args.capacities):
        parser.error(f"--delays has {len(delays)} entries for {len(args.capacities)} capacities")
    overrides = parse_overrides(args.run_config)
    if args.rounds is not None:
        overrides["num-rounds"] = args.rounds
    signal.signal(signal.SIGINT, _raise_interrupt)
    started = time.monotonic()
    try:
        metrics = run_local_federation(args.capacities, args.results, overrides, timeout=args.timeout, delays=delays)
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print()
    print(summary_table(metrics))
    plot = write_accuracy_plot(metrics, args.results / "accuracy.png")
    print(f"\n{len(metrics['rounds']) - 1} rounds in {time.monotonic() - started:.0f} s")
    print(f"metrics: {args.results / 'metrics.json'}\nplot:    {plot}\nmodel:   {args.results / 'model.pt'}")
    return 0


def parse_overrides(text: str | Sequence[str]) -> dict[str, object]:
    """``"lr=0.1 partitioner='dirichlet'"`` -> ``{"lr": 0.1, "partitioner": "dirichlet"}`` (TOML values).

    A sequence is the values of a repeated ``-c`` flag, merged in order (a later key wins), as ``flwr run -c`` does.
    """
    import tomllib

    out: dict[str, object] = {}
    for pair in (p for item in ([text] if isinstance(text, str) else text) for p in shlex.split(item)):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"run-config override {pair!r} is not key=value")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out


if __name__ == "__main__":
    sys.exit(main())
