"""Add a real client to a running federation: key pair, registration, SuperNode, in one command.

    fibos join --name lab-pi-1 --superlink fleet.example.org:8000 \\
        --root-certificates ca.crt --control-api 127.0.0.1:9093 \\
        --partition-id 4 --num-partitions 5 --capacity auto

(or ``--data-path /srv/images`` instead of the partition, for a run on the nodes' own data)

1. makes the node's ECDSA key pair in ``--keys/<name>`` (kept if it exists, so a
   restart presents the same identity);
2. registers the public key with the SuperLink's Control API (``flwr supernode
   register``), unless ``--no-register`` (then the operator registers the
   printed ``.pub`` file); a SuperLink that is not up yet is waited for, up to
   ``--wait`` seconds;
3. checks that ``--superlink`` resolves and answers with a certificate that verifies against
   ``--root-certificates`` and names it (:mod:`cli.preflight`; waited for up to ``--wait`` seconds);
4. replaces itself with ``flower-supernode`` dialling ``--superlink`` over TLS,
   authenticated by the key, with the node config built from the options. The
   SuperNode keeps retrying until the SuperLink answers.

The Control API is published on the SuperLink host's loopback only (see
docker-compose.yml), so ``--control-api`` is usually an SSH tunnel:
``ssh -N -L 9093:127.0.0.1:9093 operator@fleet.example.org``. The same command
runs inside the project's images (``docker run ... --entrypoint python
fibos-fl/app:cpu -m cli.join ...``; docs/guide/real-client.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from cli.preflight import PreflightError, check_ca_certificate, check_coordinator
from common.config.node import parse_node_config
from common.config.schema import ConfigError
from common.training.catalog import DEVICES


def node_config(args: argparse.Namespace) -> str:
    """The ``--node-config`` string (TOML values, strings quoted), validated like the ClientApp
    does.

    With ``--data-path`` the node trains on that folder of its own in ``dataset = "node"`` runs;
    with ``--partition-id`` / ``--num-partitions`` on that partition of a run's shared dataset (a
    node may have both).
    """
    capacity = '"auto"' if args.capacity == "auto" else args.capacity
    raw: dict[str, object] = {
        "capacity": args.capacity if args.capacity == "auto" else float(args.capacity),
        "client-id": args.name,
        "device": args.device,
    }
    where = []
    for key, value in (
        ("partition-id", args.partition_id),
        ("num-partitions", args.num_partitions),
    ):
        if value is not None:
            raw[key] = value
            where.append(f"{key}={value}")
    if args.data_path:
        raw["data-path"] = args.data_path
        where.append(f"data-path={json.dumps(args.data_path)}")
    parse_node_config(raw)  # fail here, before registering anything, on a bad value
    return f'{" ".join(where)} capacity={capacity} client-id="{args.name}" device="{args.device}"'


def supernode_command(args: argparse.Namespace, key: Path) -> list[str]:
    """The ``flower-supernode`` command line this node runs."""
    return [
        shutil.which("flower-supernode") or "flower-supernode",
        "--root-certificates",
        str(args.root_certificates),
        "--superlink",
        args.superlink,
        "--auth-supernode-private-key",
        str(key),
        "--port",
        str(args.runtime_port),
        "--node-config",
        node_config(args),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos join``; also ``python -m cli.join``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--name", required=True, help="this client's name (key file, registration, client-id)"
    )
    ap.add_argument(
        "--superlink",
        required=True,
        help="HOST:PORT of the Fleet API (the compose gateway: port 8000)",
    )
    ap.add_argument(
        "--root-certificates",
        type=Path,
        required=True,
        help="the federation's CA certificate (ca.crt)",
    )
    ap.add_argument(
        "--control-api", help="HOST:PORT of the SuperLink's Control API, to register the key"
    )
    ap.add_argument(
        "--no-register", action="store_true", help="the operator registers the key; just start"
    )
    ap.add_argument(
        "--partition-id", type=int, help="this node's partition of the run's shared dataset"
    )
    ap.add_argument(
        "--num-partitions", type=int, help="partitions the shared dataset is split into"
    )
    ap.add_argument(
        "--data-path",
        help='this node\'s own data, for dataset = "node" runs (instead of a partition): an image '
        "folder, a "
        "save_to_disk folder, Parquet/CSV files or label<TAB>text lines, on this machine",
    )
    ap.add_argument(
        "--capacity",
        default="auto",
        help="share of the model in (0, 1], or auto (measure the device)",
    )
    ap.add_argument(
        "--device", default="auto", choices=DEVICES, help="training device (auto: cuda, mps, cpu)"
    )
    ap.add_argument(
        "--keys", type=Path, default=Path.home() / ".fibos-fl" / "keys", help="folder for key pairs"
    )
    ap.add_argument(
        "--wait",
        type=float,
        default=300.0,
        help="seconds to wait for the SuperLink's Control API to answer",
    )
    ap.add_argument(
        "--runtime-port", type=int, default=9094, help="the SuperNode's local ClientApp port"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="print the commands instead of running them"
    )
    args = ap.parse_args(argv)

    if not args.root_certificates.is_file():
        ap.error(f"--root-certificates {args.root_certificates}: no such file")
    try:
        check_ca_certificate(args.root_certificates)
    except PreflightError as err:
        ap.error(str(err))
    if not (args.control_api or args.no_register):
        ap.error(
            "give --control-api HOST:PORT to register the key, or --no-register if the operator did"
        )
    try:
        node_config(args)
    except (ConfigError, ValueError) as err:
        ap.error(str(err))
    if args.data_path and not Path(args.data_path).expanduser().exists():
        # The SuperNode runs its ClientApp here: a wrong path would surface only in the server's
        # log, as this node excluded from each round. A dry run may be prepared for another machine:
        # there it is a warning.
        missing = f"--data-path {args.data_path}: no such file or folder on this machine"
        if not args.dry_run:
            ap.error(missing)
        print(f"warning: {missing}", file=sys.stderr)

    key = args.keys / args.name
    pub = key.with_name(f"{args.name}.pub")
    if pub.exists() and key.exists():
        print(f"using the existing key pair {key}")
    elif args.dry_run:
        print(f"would make the key pair {key} / {pub}")
    else:
        from common.wire.node_keys import make_node_keys

        make_node_keys(args.keys, args.name)
        print(f"made the key pair {key} (public key: {pub})")

    if args.no_register:
        print(f"not registering: the operator runs `flwr supernode register {pub} <connection>`")
    else:
        register = [
            sys.executable,
            "-m",
            "cli.control",
            "register",
            "--superlink",
            args.control_api,
            "--root-certificates",
            str(args.root_certificates),
            "--wait",
            repr(args.wait),
            str(pub),
        ]
        if args.dry_run:
            print("$ " + shlex.join(register))
        else:
            done = subprocess.run(register)
            if done.returncode != 0:
                print("registration failed; nothing was started", file=sys.stderr)
                return done.returncode

    cmd = supernode_command(args, key)
    print("$ " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    # the SuperNode itself would retry a wrong CA or an unknown name forever, saying so only in its
    # log
    try:
        check_coordinator(args.superlink, args.root_certificates, args.wait)
    except PreflightError as err:
        print(f"error: {err}; the SuperNode was not started", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 0  # not reached: execvp replaces this process


if __name__ == "__main__":
    sys.exit(main())
