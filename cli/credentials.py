"""TLS certificates and SuperNode key pairs for a secured federation.

Makes, with the ``cryptography`` package Flower already depends on (no openssl
binary needed, so it also runs in a one-shot container):

* ``ca.crt`` / ``ca.key``: a private certificate authority;
* ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the
  CA, whose subject alternative names cover every address clients dial;
* ``<name>`` / ``<name>.pub``: a SuperNode's ECDSA P-384 key pair (private key
  PEM, public key in OpenSSH format, as ``flwr supernode register`` takes it);
* ``<secret>``: a random shared secret, e.g. for ``--superexec-auth-secret-file``
  (authenticates the SuperExec executors to the SuperLink's and SuperNodes' Runtime API).

With ``--deal``, each consumer gets a folder holding only the files it needs (copies from
``--out``), so that a deployment mounts into each service its own folder and nothing else: the CA
key never leaves ``--out``, a SuperNode sees its own private key and no other.

Usage::

    fibos credentials --out certs --san superlink --san localhost --san 127.0.0.1 --node node1
    fibos credentials --out /ca --node node1 --deal /node1=ca.crt,node1 --deal /link=ca.crt,server.pem,server.key
"""  # noqa: E501

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.wire.node_keys import make_node_keys, write_file

VALID_DAYS = 825  # the longest lifetime current TLS clients accept for a server certificate


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(
    out: Path, name: str = "fibos-fl CA"
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Create ``ca.crt`` and ``ca.key`` in ``out``."""
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA384())
    )
    write_file(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    write_file(out / "ca.key", _key_pem(key), private=True)
    return cert, key


def make_server_cert(
    out: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, names: Sequence[str]
) -> None:
    """Create ``server.pem`` / ``server.key`` valid for every host name or IP address in
    ``names``."""
    if not names:
        raise ValueError(
            "the server certificate needs at least one name (e.g. superlink, localhost, 127.0.0.1)"
        )
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    write_file(out / "server.pem", cert.public_bytes(serialization.Encoding.PEM))
    write_file(out / "server.key", _key_pem(key), private=True)


def make_secret(out: Path, name: str, nbytes: int = 32) -> Path:
    """Create ``<name>``: ``nbytes`` random bytes, hex-encoded (a SuperExec shared secret)."""
    path = out / name
    write_file(path, os.urandom(nbytes).hex().encode("ascii"), private=True)
    return path


def parse_deal(spec: str) -> tuple[Path, list[str]]:
    """``DIR=FILE[,FILE...]`` as (folder, file names); ``ValueError`` naming the flag when
    malformed.

    File names are plain names of files in ``--out`` (no folders), so a deal never reaches outside
    it.
    """
    folder, sep, names = spec.partition("=")
    files = [n.strip() for n in names.split(",") if n.strip()]
    if not sep or not folder or not files:
        raise ValueError(f"--deal {spec!r}: expected DIR=FILE[,FILE...], e.g. /node1=ca.crt,node1")
    bad = [n for n in files if Path(n).name != n or n in (".", "..")]
    if bad:
        raise ValueError(f"--deal {spec!r}: {', '.join(bad)} is not a plain file name in --out")
    return Path(folder), files


def deal(out: Path, folder: Path, names: Sequence[str]) -> list[Path]:
    """Copy ``names`` from ``out`` into ``folder``, private files staying private; files already
    equal are kept.

    Anything else in ``folder`` is removed, so a consumer never keeps a file it was dealt before and
    is not now.

    Parameters
    ----------
    out : Path
        The folder the credentials were made in (holds every file, the CA key included).
    folder : Path
        The consumer's folder (e.g. a volume only that service mounts).
    names : Sequence[str]
        File names in ``out`` the consumer needs.
    """
    missing = [n for n in names if not (out / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--deal {folder}: {', '.join(missing)} not in {out} (make it with --node/--secret)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.iterdir():
        if stale.name not in names:
            if stale.is_dir():
                raise IsADirectoryError(
                    f"--deal {folder}: holds a folder {stale.name!r}; deal into an empty folder"
                )
            stale.unlink()
    written = []
    for name in names:
        src, dest = out / name, folder / name
        data = src.read_bytes()
        private = not (src.stat().st_mode & 0o044)
        mode = 0o600 if private else 0o644
        if not dest.is_file() or dest.read_bytes() != data:
            dest.unlink(missing_ok=True)
            # Created with its final mode: a private key is never readable by others, not even for a
            # moment.
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        dest.chmod(mode)
        written.append(dest)
    return written


def chown_tree(paths: Sequence[Path], owner: str) -> None:
    """Give ``paths`` (recursively) to ``owner`` = ``"UID:GID"``, e.g. the uid Flower's images run
    as."""
    try:
        uid, gid = (int(v) for v in owner.split(":"))
    except ValueError:
        raise ValueError(f"--owner {owner!r}: expected UID:GID, e.g. 49999:49999") from None
    for root in paths:
        root.mkdir(parents=True, exist_ok=True)
        for path in [root, *root.rglob("*")]:
            os.chown(path, uid, gid)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos credentials``; also ``python -m cli.credentials``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for the files")
    ap.add_argument(
        "--san",
        action="append",
        default=[],
        help="name or IP the SuperLink is reached by (repeat, or separate with commas)",
    )
    ap.add_argument(
        "--node",
        action="append",
        default=[],
        help="make a SuperNode key pair with this name (repeat)",
    )
    ap.add_argument(
        "--secret", action="append", default=[], help="make a random shared-secret file (repeat)"
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep files that already exist (a restarted deployment keeps its CA, keys and "
        "registrations)",
    )
    ap.add_argument(
        "--owner",
        metavar="UID:GID",
        help="then chown --out and every --chown folder to UID:GID (Flower's images run as "
        "49999:49999)",
    )
    ap.add_argument(
        "--chown", type=Path, action="append", default=[], help="another folder to create and chown"
    )
    ap.add_argument(
        "--deal",
        action="append",
        default=[],
        metavar="DIR=FILE[,FILE...]",
        help="then copy only these files of --out into DIR (repeat; one folder per consumer; "
        "chowned with --owner)",
    )
    args = ap.parse_args(argv)
    try:
        deals = [parse_deal(spec) for spec in args.deal]
    except ValueError as err:
        ap.error(str(err))
    # Order kept, duplicates and blanks dropped: compose passes a default list plus the operator's
    # names.
    args.san = list(
        dict.fromkeys(n.strip() for item in args.san for n in item.split(",") if n.strip())
    )
    if not (args.san or args.node or args.secret or deals):
        ap.error(
            "nothing to make: give --san (server certificate), --node (SuperNode keys), --secret "
            "and/or --deal"
        )

    def kept(name: str) -> bool:
        if args.keep and (args.out / name).exists():
            print(f"keeping {args.out / name}")
            return True
        return False

    if args.san and not kept("server.pem"):
        ca_cert, ca_key = make_ca(args.out)
        make_server_cert(args.out, ca_cert, ca_key, args.san)
        print(f"CA and server certificate for {', '.join(args.san)} in {args.out}")
    for name in args.node:
        if not kept(f"{name}.pub"):
            print(
                f"SuperNode key pair: {args.out / name} (register {make_node_keys(args.out, name)})"
            )
    for name in args.secret:
        if not kept(name):
            print(f"shared secret: {make_secret(args.out, name)}")
    for folder, names in deals:
        try:
            deal(args.out, folder, names)
        except (FileNotFoundError, IsADirectoryError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"dealt to {folder}: {', '.join(names)}")
    if args.owner:
        owned = [args.out, *args.chown, *(folder for folder, _ in deals)]
        chown_tree(owned, args.owner)
        print(f"owner of {', '.join(str(p) for p in owned)}: {args.owner}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
