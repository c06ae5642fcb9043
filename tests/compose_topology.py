"""Run docker-compose.yml's services as local processes, each in its own Linux network namespace.

No Docker engine runs where the tests run, so this harness reproduces what
Compose would set up, as closely as processes allow:

* networks: one Linux bridge per compose network (inside a private "switch"
  namespace); every service gets its own network namespace with one interface
  per network it joins, so a service reaches exactly the services it shares a
  network with, as in Docker;
* names: each namespace's ``/etc/hosts`` (via ``ip netns exec``'s
  ``/etc/netns/<ns>/hosts``) maps the service names reachable from it;
* volumes: named volumes are folders of the test; they and bind mounts are
  bind-mounted at the container paths inside each service's private mount
  namespace (read-only where the compose file says ``:ro``), so every command
  line, config file and run-config path is used exactly as written;
* order: ``depends_on`` with ``service_started``, ``service_healthy`` (the
  service's own ``healthcheck`` command, run inside its namespace) and
  ``service_completed_successfully``;
* variables: ``${VAR:-default}`` / ``${VAR}`` interpolation, as Compose does.

What it cannot reproduce (documented in docs/guide/deployment.md): the images
themselves (the commands run from this checkout's virtual environment, as
root, with ``HOME``/cache folders of the test), restart policies, published
ports, resource reservations (GPUs) and profiles other than the default.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cli.launcher import ProcessGroup

VENV_BIN = Path(sys.executable).parent
# ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR, $$, and ${VAR:?message} / ${VAR?message} (required:
# an error).
_VAR = re.compile(
    r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(?::?-([^}]*))|(?::?\?([^}]*)))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


class TopologyError(RuntimeError):
    """The topology could not be built or a service failed; the message says which and why."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose variable interpolation on every string of a parsed compose document."""
    if isinstance(value, str):

        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(4)
            default = m.group(2)
            current = env.get(name)
            if m.group(3) is not None and not current:
                raise TopologyError(f"required variable {name} is missing a value: {m.group(3)}")
            if default is not None:
                return current if current else default
            return current or ""

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


@dataclass
class Service:
    """One compose service, as the harness runs it."""

    name: str
    argv: list[str]
    environment: dict[str, str]
    volumes: list[
        tuple[str, str, bool]
    ]  # (source: volume name or ./path, container path, read-only)
    networks: list[str]
    depends_on: dict[str, str]
    healthcheck: list[str] | None
    built: bool  # image built from this repository (so /app holds the project, as in the image)
    working_dir: str = "/app"
    proc: subprocess.Popen | None = field(default=None, repr=False)


def load_services(
    compose_file: Path, env: dict[str, str], profiles: set[str] | frozenset = frozenset()
) -> dict:
    """Parse ``compose_file`` into :class:`Service` objects (only the active profiles)."""
    doc = interpolate(yaml.safe_load(compose_file.read_text()), env)
    # Services that run an image another service builds (Compose builds it once) hold the project
    # too.
    built_images = {spec.get("image") for spec in doc["services"].values() if "build" in spec}
    services = {}
    for name, spec in doc["services"].items():
        if spec.get("profiles") and not set(spec["profiles"]) & set(profiles):
            continue
        entrypoint = _argv(spec.get("entrypoint"))
        if not entrypoint:
            raise TopologyError(
                f"service {name!r} has no explicit entrypoint: its command line would be unknown"
            )
        environment = spec.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        volumes = []
        for item in spec.get("volumes") or []:
            source, target, *mode = item.split(":")
            volumes.append((source, target, "ro" in mode))
        if spec.get("network_mode") == "none":
            networks: list[str] = []
        else:
            networks = list(spec.get("networks") or ["default"])
        deps = spec.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: "service_started" for d in deps}
        else:
            deps = {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}
        health = None
        test = (spec.get("healthcheck") or {}).get("test")
        if test:
            kind, *rest = test
            health = (
                rest if kind == "CMD" else ["sh", "-c", rest[0]] if kind == "CMD-SHELL" else None
            )
        services[name] = Service(
            name=name,
            argv=entrypoint + _argv(spec.get("command")),
            environment={k: str(v) for k, v in environment.items()},
            volumes=volumes,
            networks=networks,
            depends_on=deps,
            healthcheck=health,
            built="build" in spec or spec.get("image") in built_images,
            working_dir=spec.get("working_dir", "/app"),
        )
    for svc in services.values():
        missing = set(svc.depends_on) - set(services)
        if missing:
            raise TopologyError(
                f"service {svc.name!r} depends on inactive or unknown services {sorted(missing)}"
            )
    return services


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise TopologyError(
            f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}"
        )


def namespace_support() -> str | None:
    """``None`` if network namespaces, veth pairs and bridges can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    for tool in ("ip", "mount", "nginx", "wget"):
        if shutil.which(tool) is None:
            return (
                f"`{tool}` is not installed (Debian: apt-get install iproute2 mount nginx-light "
                "wget)"
            )
    probe = f"fbprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    except TopologyError as err:
        return f"cannot create network namespaces, bridges or veth pairs here: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class ComposeTopology:
    """Start a compose file's services in network namespaces; stop and remove everything on exit.

    Parameters
    ----------
    compose_file : Path
        The docker-compose.yml to run.
    workdir : Path
        Folder for the named volumes, logs and per-service home folders.
    env : dict
        Variables for interpolation (like the shell environment of ``docker compose up``).
    service_env : dict
        Extra environment for every process (test-only knobs such as thread counts).
    """

    SUBNET = "10.77"

    def __init__(
        self, compose_file: Path, workdir: Path, env: dict[str, str], service_env: dict[str, str]
    ):
        self.repo = compose_file.parent.resolve()
        self.workdir = workdir
        self.services = load_services(compose_file, env)
        self.service_env = service_env
        self.tag = uuid.uuid4().hex[:4]
        self.switch = f"fb{self.tag}sw"
        self.netns: dict[str, str] = {}
        self.addresses: dict[str, dict[str, str]] = {}
        self.created_paths: list[Path] = []
        self.group = ProcessGroup(f"FIBOS_TOPOLOGY={self.tag}")
        self.networks = sorted({n for s in self.services.values() for n in s.networks})

    # ----------------------------------------------------------------- network
    def __enter__(self) -> ComposeTopology:
        try:
            self._build_network()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build_network(self) -> None:
        _run("ip", "netns", "add", self.switch)
        for k in range(len(self.networks)):
            _run("ip", "-n", self.switch, "link", "add", f"br{k}", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", f"br{k}", "up")
        for i, svc in enumerate(self.services.values()):
            ns = f"fb{self.tag}s{i}"
            _run("ip", "netns", "add", ns)
            self.netns[svc.name] = ns
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.addresses[svc.name] = {}
            for net in svc.networks:
                k = self.networks.index(net)
                inner, outer = f"f{self.tag}{i}n{k}a", f"f{self.tag}{i}n{k}b"
                _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "link", "set", outer, "netns", self.switch)
                _run("ip", "-n", self.switch, "link", "set", outer, "master", f"br{k}")
                _run("ip", "-n", self.switch, "link", "set", outer, "up")
                address = f"{self.SUBNET}.{k}.{i + 10}"
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
                _run("ip", "-n", ns, "link", "set", inner, "up")
                self.addresses[svc.name][net] = address
        for svc in self.services.values():
            hosts = ["127.0.0.1 localhost", "::1 localhost"]
            for other in self.services.values():
                shared = [n for n in svc.networks if n in other.networks]
                if other is not svc and shared:
                    hosts.append(f"{self.addresses[other.name][shared[0]]} {other.name}")
            etc = Path("/etc/netns") / self.netns[svc.name]
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(hosts) + "\n")

    def reachable_address(self, service: str, network: str) -> str:
        """The address ``service`` has on ``network``."""
        return self.addresses[service][network]

    # ---------------------------------------------------------------- services
    def _mount_point(self, target: str, is_file: bool) -> None:
        path = Path(target)
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for p in reversed(missing):
            self.created_paths.append(p)
        if is_file:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        else:
            path.mkdir(parents=True, exist_ok=True)

    def _mounts(self, svc: Service) -> list[tuple[Path, str, bool]]:
        mounts = []
        for source, target, ro in svc.volumes:
            if source.startswith((".", "/")):
                host = (self.repo / source).resolve()
                if not host.exists():
                    raise TopologyError(
                        f"service {svc.name!r}: bind-mount source {source!r} does not exist"
                    )
            else:
                host = self.workdir / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            mounts.append((host, target, ro))
        if not any(t == svc.working_dir for _, t, _ in mounts):
            # The project's images hold the app at /app; Flower's own images have an empty /app.
            workdir = self.repo if svc.built else self.workdir / "app" / svc.name
            workdir.mkdir(parents=True, exist_ok=True)
            mounts.append((workdir, svc.working_dir, False))
        return mounts

    def wrapped(self, svc: Service, argv: list[str]) -> list[str]:
        """``argv`` run inside ``svc``'s network namespace with its volumes mounted."""
        script = ["set -e"]
        for host, target, ro in self._mounts(svc):
            self._mount_point(target, host.is_file())
            script.append(f"mount --bind {shlex.quote(str(host))} {shlex.quote(target)}")
            if ro:
                script.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        script.append(f"cd {shlex.quote(svc.working_dir)}")
        script.append('exec "$@"')
        return [
            "ip",
            "netns",
            "exec",
            self.netns[svc.name],
            "sh",
            "-c",
            "\n".join(script),
            svc.name,
            *argv,
        ]

    def env_for(self, svc: Service) -> dict[str, str]:
        home = self.workdir / "home" / svc.name
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "FIBOS_"))}
        env.update(
            PATH=os.pathsep.join([str(VENV_BIN), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
            HOME=str(home),
            FIBOS_CACHE_DIR=str(home / "cache"),
            PYTHONUNBUFFERED="1",
            **self.service_env,
            **svc.environment,
        )
        env.pop("FLWR_HOME", None)
        return env

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.log(name)
        text = (
            path.read_text(errors="replace").splitlines()[-lines:]
            if path.exists()
            else ["(no log)"]
        )
        return f"--- {name} ---\n" + "\n".join(text)

    def start(self, name: str) -> None:
        svc = self.services[name]
        svc.proc = self.group.start(self.wrapped(svc, svc.argv), self.log(name), self.env_for(svc))

    def exec(
        self, name: str, argv: list[str], timeout: float = 30.0
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside a service's namespaces (like ``docker compose exec``)."""
        svc = self.services[name]
        return subprocess.run(
            self.wrapped(svc, argv),
            env=self.env_for(svc),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def healthy(self, name: str) -> bool:
        svc = self.services[name]
        if svc.healthcheck is None:
            raise TopologyError(f"{name!r} is a service_healthy dependency but has no healthcheck")
        try:
            return self.exec(name, svc.healthcheck, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_condition(self, dep: str, condition: str, timeout: float) -> None:
        svc = self.services[dep]
        deadline = time.monotonic() + timeout
        while True:
            assert svc.proc is not None
            rc = svc.proc.poll()
            if condition == "service_completed_successfully":
                if rc == 0:
                    return
                if rc is not None:
                    raise TopologyError(f"{dep} exited with {rc}\n{self.tail(dep)}")
            elif rc is not None:
                raise TopologyError(
                    f"{dep} stopped (exit {rc}) while others depend on it\n{self.tail(dep)}"
                )
            elif condition == "service_started" or self.healthy(dep):
                return
            if time.monotonic() > deadline:
                raise TopologyError(
                    f"{dep} did not reach {condition} within {timeout:.0f} s\n{self.tail(dep)}"
                )
            time.sleep(1.0)

    def up(self, timeout: float = 300.0, echo=print) -> None:
        """Start every service once its dependencies meet their conditions (compose's order)."""
        started: set[str] = set()
        pending = dict(self.services)
        while pending:
            ready = [s for s in pending.values() if set(s.depends_on) <= started]
            if not ready:
                raise TopologyError(f"dependency cycle among {sorted(pending)}")
            for svc in ready:
                for dep, condition in svc.depends_on.items():
                    self.wait_condition(dep, condition, timeout)
                self.start(svc.name)
                echo(f"started {svc.name} in {self.netns[svc.name]} {self.addresses[svc.name]}")
                started.add(svc.name)
                del pending[svc.name]

    def wait_exit(self, name: str, timeout: float) -> int:
        """Wait for a one-shot service to finish; its exit status."""
        proc = self.services[name].proc
        assert proc is not None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TopologyError(
                f"{name} did not finish within {timeout:.0f} s\n{self.tail(name)}"
            ) from None

    def __exit__(self, *exc: object) -> None:
        self.group.stop()
        for ns in [*self.netns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for path in reversed(self.created_paths):
            try:
                path.unlink() if path.is_file() else path.rmdir()
            except OSError:
                pass
