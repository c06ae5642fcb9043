"""Before a SuperNode starts: the files it was handed and the coordinator it dials, checked, each
failure named.

A SuperNode started with a wrong CA certificate, a coordinator name that does not resolve or is
missing from the coordinator's certificate, or an unreadable key retries its TLS handshake forever
and says so only in gRPC's words, deep in its log. These checks run first (``docker/node.yml``'s
``preflight`` service, and ``fibos join``) and end with one line naming the setting or file and what
to do:

    python -m cli.preflight --superlink fleet.example.org:8000 --root-certificates ca.crt \\
        --key /credentials/key/lab-pi-1 --wait 300

A coordinator that refuses or does not answer yet is waited for, up to ``--wait`` seconds (nodes may
start before it); everything else fails at once.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


class PreflightError(RuntimeError):
    """A check failed; the message names the setting or file and says what to do."""


def split_address(address: str, setting: str = "--superlink") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 literal) as (host, port); a malformed one names
    ``setting``."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PreflightError(
            f"{setting} {address!r}: expected HOST:PORT, e.g. fleet.example.org:8000"
        )
    return host, int(port)


def check_ca_certificate(path: Path, setting: str = "--root-certificates") -> x509.Certificate:
    """The CA certificate in ``path``: a readable PEM X.509 certificate, else an error naming the
    file."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise PreflightError(
            f"{setting} {path}: is a folder, not the coordinator's ca.crt"
        ) from None
    except OSError as err:
        raise PreflightError(f"{setting} {path}: cannot be read ({err.strerror})") from None
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise PreflightError(
            f"{setting} {path}: not a PEM certificate (copy the coordinator's ca.crt, the file "
            "that begins with -----BEGIN CERTIFICATE-----)"
        ) from None


def check_private_key(path: Path, setting: str = "--key") -> None:
    """The node's private key in ``path``: a readable, unencrypted EC key in OpenSSH format, the one
    format ``flower-supernode --auth-supernode-private-key`` loads (``fibos credentials`` and
    ``fibos join`` write it)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise PreflightError(f"{setting} {path}: cannot be read ({err.strerror})") from None
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError):
        raise PreflightError(
            f"{setting} {path}: not an unencrypted OpenSSH private key (the format "
            "flower-supernode loads)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PreflightError(
            f"{setting} {path}: not an elliptic-curve key (SuperNode keys are ECDSA)"
        )


def check_coordinator(
    address: str,
    ca: Path,
    wait: float = 0.0,
    setting: str = "--superlink",
    poll: float = 2.0,
    ca_setting: str = "--root-certificates",
) -> None:
    """Resolve ``address``, connect, and complete a TLS handshake that verifies its certificate
    against ``ca``.

    Parameters
    ----------
    address : str
        ``HOST:PORT`` the SuperNode dials (the coordinator's Fleet gateway or SuperLink).
    ca : Path
        The CA certificate the coordinator's certificate must chain to.
    wait : float
        Seconds to keep retrying while the coordinator refuses or does not answer (it may start
        later); a name that does not resolve and a certificate that does not verify fail at once.
    setting : str
        How the user gave ``address`` (a flag or an environment variable), for the messages.
    poll : float
        Seconds between tries.
    ca_setting : str
        How the user gave ``ca``, for the messages.
    """
    host, port = split_address(address, setting)
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + wait
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise PreflightError(
                f"{setting} {address}: {host!r} does not resolve ({err.strerror})"
            ) from None
        try:
            family, kind, proto, _, target = infos[0]
            with socket.socket(family, kind, proto) as raw:
                raw.settimeout(min(10.0, max(1.0, wait)))
                raw.connect(target)
                with context.wrap_socket(raw, server_hostname=host):
                    return
        except ssl.SSLCertVerificationError as err:
            if err.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
                raise PreflightError(
                    f"{setting} {address}: the coordinator's certificate does not name {host!r}; "
                    f"the coordinator adds it with FIBOS_PUBLIC_NAMES={host} (before its first "
                    "start, or after removing its credentials volume)"
                ) from None
            raise PreflightError(
                f"{setting} {address}: the coordinator's certificate does not verify against "
                f"{ca_setting} {ca} ({err.verify_message}): is it this coordinator's ca.crt?"
            ) from None
        except ssl.SSLError as err:
            why = f"TLS handshake failed ({err.reason}): is it the coordinator's TLS port?"
            raise PreflightError(f"{setting} {address}: {why}") from None
        except OSError as err:
            if time.monotonic() >= deadline:
                waited = f" within {wait:.0f} s" if wait else ""
                raise PreflightError(
                    f"{setting} {address}: the coordinator did not answer{waited} "
                    f"({err.strerror or err})"
                ) from None
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m cli.preflight``): exit 0, or 2 with one line naming the
    problem."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--superlink", required=True, help="HOST:PORT the SuperNode dials")
    ap.add_argument(
        "--root-certificates", type=Path, required=True, help="the coordinator's CA certificate"
    )
    ap.add_argument("--key", type=Path, help="the node's private key (checked when given)")
    ap.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for a coordinator not up yet"
    )
    ap.add_argument(
        "--names",
        default="",
        help="how the user set each value, for the messages: "
        "'superlink=FIBOS_SUPERLINK,root-certificates=...'",
    )
    args = ap.parse_args(argv)
    named = {"superlink": "--superlink", "root-certificates": "--root-certificates", "key": "--key"}
    for item in filter(None, args.names.split(",")):
        option, _, name = item.partition("=")
        if option not in named or not name:
            ap.error(
                f"--names {item!r}: expected OPTION=NAME with OPTION one of {', '.join(named)}"
            )
        named[option] = name
    try:
        check_ca_certificate(args.root_certificates, named["root-certificates"])
        if args.key is not None:
            check_private_key(args.key, named["key"])
        check_coordinator(
            args.superlink,
            args.root_certificates,
            args.wait,
            named["superlink"],
            ca_setting=named["root-certificates"],
        )
    except PreflightError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"coordinator {args.superlink}: reachable, its certificate verifies against "
        f"{args.root_certificates}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
