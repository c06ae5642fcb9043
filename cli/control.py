"""What an operator does through a SuperLink's Control API: register SuperNode keys, submit a run.

The compose deployment runs both as one-shot services; an engineer adding a
real client runs ``register`` from a machine that can reach the Control API.
Both write a connection named ``--connection`` (default ``fibos``) into
``$FLWR_HOME/config.toml`` and then call Flower's own CLI, so nothing here
reimplements Flower's protocol.

Usage::

    fibos control register --superlink superlink:8000 --root-certificates ca.crt node1.pub node2.pub
    fibos control submit --superlink superlink:8000 --root-certificates ca.crt --app . \\
        --run-config "num-rounds=10 min-nodes=4"

Both wait up to ``--wait`` seconds for the SuperLink to answer (it may still be starting).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cli.app_bundle import BundleError, stage_app
from cli.launcher import (
    RunTimeout,
    check_run_config,
    flower_env,
    parse_overrides,
    positive_seconds,
    run_federation_command,
    toml_overrides,
)
from cli.restarts import RestartPolicy
from common.config.schema import ConfigError


def connection_toml(name: str, superlink: str, root_certificates: Path | None) -> str:
    """A ``config.toml`` with one SuperLink connection (TLS unless ``root_certificates`` is
    None)."""
    if root_certificates is None:
        trust = "insecure = true"
    else:
        trust = f'root-certificates = "{root_certificates.resolve()}"'
    return (
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{superlink}"\n{trust}\n'
    )


def control_env(args: argparse.Namespace, home: Path) -> dict[str, str]:
    """Flower environment whose FLWR_HOME is ``home`` (a fresh folder, so the user's own
    config.toml is never rewritten), holding the connection to ``args.superlink``."""
    certs = None if args.insecure else args.root_certificates
    if certs is None and not args.insecure:
        raise SystemExit(
            "error: give --root-certificates CA.crt (TLS), or --insecure for a SuperLink without "
            "TLS"
        )
    if certs is not None and not certs.is_file():
        # flwr would report it only as a SuperLink that does not answer, after the whole --wait.
        raise SystemExit(f"error: --root-certificates {certs}: no such file")
    (home / "config.toml").write_text(connection_toml(args.connection, args.superlink, certs))
    return flower_env(home)


def _flwr(env: dict[str, str], *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(["flwr", *argv], env=env, capture_output=True, text=True, timeout=timeout)


def unanswered(done: subprocess.CompletedProcess) -> str:
    """Why ``flwr supernode list --format json`` got no answer from the SuperLink ("" when it got
    one).

    The exit status alone does not tell: an unreachable SuperLink gives status 0 with ``{"success":
    false}``.
    """
    text = " ".join((done.stdout + done.stderr).split())
    if done.returncode != 0:
        return text or f"flwr exited with status {done.returncode}"
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        return f"an unreadable reply: {text[:300]}"
    if isinstance(reply, dict) and reply.get("success") is True:
        return ""
    return " ".join(
        str(reply.get("error-message", text) if isinstance(reply, dict) else text).split()
    )


def wait_for_control_api(
    env: dict[str, str], connection: str, timeout: float, superlink: str = ""
) -> None:
    """Retry ``flwr supernode list`` until the SuperLink's Control API answers; exit after
    ``timeout`` s.

    Parameters
    ----------
    env : dict
        Flower environment whose ``config.toml`` holds ``connection``.
    connection : str
        The connection name to ask through.
    timeout : float
        Seconds to keep trying (0: one try).
    superlink : str
        The SuperLink's address, for the messages.
    """
    deadline = time.monotonic() + timeout
    where = f" at {superlink}" if superlink else ""
    said = False
    while True:
        # A try is bounded by the wait too (a black-holed address could hold one for minutes);
        # starting flwr takes a few seconds, so the last try gets at least 10.
        budget = max(10.0, deadline - time.monotonic())
        try:
            why = unanswered(
                _flwr(env, "supernode", "list", connection, "--format", "json", timeout=budget)
            )
        except subprocess.TimeoutExpired:
            why = "no reply"
        if not why:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(
                f"error: the SuperLink's Control API{where} did not answer within {timeout:.0f} s: "
                f"{why}"
            )
        if not said:
            print(
                f"waiting up to {timeout:.0f} s for the SuperLink's Control API{where}: {why}",
                file=sys.stderr,
            )
            said = True
        time.sleep(min(2.0, left))


def public_key_files(paths: Sequence[Path]) -> list[Path]:
    """The key files ``paths`` name: a file as given, a folder as every ``*.pub`` in it (sorted by
    name).

    A folder may be empty: the coordinator's ``register`` one-shot reads a folder that holds no key
    until the first node's operator sends one. A path that is neither a file nor a folder is
    refused, naming it, before anything is registered (a wrong path must not cost ``--wait``
    seconds, nor register the other keys).
    """
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SystemExit(f"error: no such public key file or folder: {', '.join(missing)}")
    found: list[Path] = []
    for path in paths:
        found += sorted(path.glob("*.pub")) if path.is_dir() else [path]
    return found


def register(args: argparse.Namespace) -> int:
    """Register each public key; a key the SuperLink already holds counts as registered (reruns are
    safe)."""
    args.public_keys = public_key_files(args.public_keys)
    if not args.public_keys:
        print("no public keys to register yet (a folder holds no *.pub file)")
        return 0
    with tempfile.TemporaryDirectory(prefix="fibos-control-") as home:
        return _register(args, control_env(args, Path(home)))


def _register(args: argparse.Namespace, env: dict[str, str]) -> int:
    wait_for_control_api(env, args.connection, args.wait, args.superlink)
    for pub in args.public_keys:
        name = pub.stem if pub.suffix == ".pub" else pub.name
        done = _flwr(env, "supernode", "register", str(pub), args.connection, "--name", name)
        text = " ".join((done.stdout + done.stderr).split())
        if done.returncode == 0:
            print(f"{name}: registered")
        elif "already in use" in text:
            print(f"{name}: already registered")
        else:
            print(f"{name}: registration failed: {text}", file=sys.stderr)
            return 1
    return 0


def submit(args: argparse.Namespace) -> int:
    """``flwr run APP --stream`` with the given run-config overrides; fails if the run fails.

    The run's outcome is the SuperLink's record of it, not the end of the log stream: a stream that
    breaks while the run goes on is followed again, and a run that ended failed or stopped exits 1.

    The run config is validated first, with the schema the ServerApp uses: a bad value is refused
    with the message that names the key, before anything is sent. The full log stays in a fresh
    ``fibos-control-*`` folder (printed at the end).
    """
    overrides = parse_overrides(args.run_config)
    try:
        check_run_config(overrides, args.app)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = control_env(args, Path(tempfile.mkdtemp(prefix="fibos-control-")))
    try:  # a checkout holds far more than the app: flwr would walk all of it (cli.app_bundle)
        app = stage_app(args.app, Path(env["FLWR_HOME"]) / "app")
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    policy = RestartPolicy(args.restarts, args.restart_backoff)
    started, made = time.monotonic(), 0
    while True:
        wait_for_control_api(env, args.connection, args.wait, args.superlink)
        cmd = ["flwr", "run", str(app), args.connection, "--stream"]
        if overrides:
            cmd += ["-c", toml_overrides(overrides)]
        print("$ " + " ".join(cmd), flush=True)
        log = Path(env["FLWR_HOME"]) / ("run.log" if made == 0 else f"run-{made + 1}.log")
        left = max(args.timeout - (time.monotonic() - started), 1.0)
        try:
            run_federation_command(
                cmd,
                env,
                log,
                left,
                lambda line: print(line, flush=True),
                connection=args.connection,
            )
        except RunTimeout as err:
            # Stopping `flwr run --stream` only stops following the run: the SuperLink would go on
            # running it.
            stopped = stop_run(env, args.connection, err.run_id)
            print(
                f"error: the run exceeded --timeout {args.timeout:g} s; {stopped}", file=sys.stderr
            )
            print(f"(full log: {log})", file=sys.stderr)
            return 1
        except (RuntimeError, TimeoutError) as err:
            # A resume the ServerApp refuses (no checkpoint yet, a damaged one) says "resume=true:
            # ...": final.
            final = made >= policy.attempts or (
                overrides.get("resume") is True and "resume=true:" in str(err)
            )
            if final:
                print(f"error: {err}", file=sys.stderr)
                print(log.read_text()[-4000:], file=sys.stderr)
                if made:
                    print(f"(not restarted again: {made} restarts made)", file=sys.stderr)
                return 1
            wait = policy.wait_s(made)
            why = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            print(
                f"the run failed ({why}); resubmitting it with resume=true in {wait:.0f} s "
                f"(restart {made + 1} of at most {policy.attempts}; log of this attempt: {log})",
                flush=True,
            )
            time.sleep(wait)
            overrides = {**overrides, "resume": True}
            made += 1
            continue
        print(f"run finished; full log: {log}")
        return 0


def stop_run(env: dict[str, str], connection: str, run_id: int | None) -> str:
    """Stop run ``run_id`` on the SuperLink (``flwr stop``); says what became of it, for the
    operator.

    Parameters
    ----------
    env : dict
        Flower environment whose ``config.toml`` holds ``connection``.
    connection : str
        The connection the run was submitted through.
    run_id : int or None
        The run, or None when its log stream never said its id (then nothing can be stopped).
    """
    if run_id is None:
        return (
            "its run id was never printed, so it could not be stopped: see `flwr ls` on the "
            "SuperLink"
        )
    try:
        why = unanswered(
            _flwr(env, "stop", str(run_id), connection, "--format", "json", timeout=60.0)
        )
    except subprocess.TimeoutExpired:
        why = "no reply within 60 s"
    if not why:
        return f"run {run_id} was stopped on the SuperLink"
    return (
        f"run {run_id} could not be stopped ({why}); it may still run: `flwr stop {run_id}` ends it"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos control``; also ``python -m cli.control``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("register", "register SuperNode public keys"),
        ("submit", "submit a run and follow it"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--superlink", required=True, help="HOST:PORT of the SuperLink's Control API"
        )
        p.add_argument(
            "--root-certificates",
            type=Path,
            help="CA certificate the SuperLink's certificate chains to",
        )
        p.add_argument("--insecure", action="store_true", help="the SuperLink runs without TLS")
        p.add_argument(
            "--connection",
            default="fibos",
            help="connection name written to $FLWR_HOME/config.toml",
        )
        p.add_argument(
            "--wait",
            type=float,
            default=300.0,
            help="seconds to wait for the SuperLink's Control API to answer (default: 300)",
        )
    reg = sub.choices["register"]
    reg.add_argument(
        "public_keys",
        type=Path,
        nargs="+",
        help="OpenSSH public keys (name = file name without .pub), or folders: every *.pub in them",
    )
    sm = sub.choices["submit"]
    sm.add_argument(
        "--app", type=Path, default=Path("."), help="the Flower app folder (with pyproject.toml)"
    )
    sm.add_argument(
        "--run-config", "-c", action="append", default=[], help="run-config overrides 'k=v k2=v2'"
    )
    sm.add_argument(
        "--timeout",
        type=positive_seconds,
        default=86_400.0,
        help="seconds the run may take, counted by the clock; then it is stopped on the SuperLink",
    )
    sm.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="times a failed run is resubmitted with resume=true (once the Control API answers "
        "again, e.g. after the SuperLink's restart); 0 = never (default: 3)",
    )
    sm.add_argument(
        "--restart-backoff",
        type=positive_seconds,
        default=5.0,
        help="seconds before the first resubmission; each later one waits twice as long, at most "
        "60 s (default: 5)",
    )
    args = ap.parse_args(argv)
    if args.command == "submit" and args.restarts < 0:
        ap.error(f"--restarts {args.restarts}: give 0 (never) or more")
    return register(args) if args.command == "register" else submit(args)


if __name__ == "__main__":
    sys.exit(main())
