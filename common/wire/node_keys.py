"""Key files both sides make: a SuperNode's authentication key pair, written with private
permissions.

Used by the operator's credential tool (:mod:`cli.credentials`) and by a joining client
(:mod:`cli.join`), which makes its own key pair on its own machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


def write_file(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` (parents created); ``private`` files are readable by their owner
    only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def make_node_keys(out: Path, name: str) -> Path:
    """Create a SuperNode key pair ``<name>`` (private, PEM) and ``<name>.pub`` (OpenSSH); returns
    the public key."""
    key = ec.generate_private_key(ec.SECP384R1())
    write_file(
        out / name,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    pub = out / f"{name}.pub"
    write_file(
        pub,
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        ),
    )
    return pub
