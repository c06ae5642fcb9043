"""client.preflight against a real TLS listener: each misconfiguration a node can arrive with, named."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from client.preflight import (
    PreflightError,
    check_ca_certificate,
    check_coordinator,
    check_private_key,
    main,
    split_address,
)
from common.wire.node_keys import make_node_keys
from server.commands.credentials import make_ca, make_server_cert
from server.commands.launcher import free_port


class TlsListener:
    """A TLS server on loopback that completes handshakes with ``server.pem`` and closes (a coordinator's port)."""

    def __init__(self, certs: Path, port: int) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs / "server.pem", certs / "server.key")
        self.sock = socket.create_server(("127.0.0.1", port))
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                conn.close()  # the client refused our certificate: its side reports why

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``(address, ca.crt)`` of a listener whose certificate names 127.0.0.1 only."""
    certs = tmp_path / "coordinator"
    ca_cert, ca_key = make_ca(certs)
    make_server_cert(certs, ca_cert, ca_key, ["127.0.0.1"])
    port = free_port()
    listener = TlsListener(certs, port)
    try:
        yield f"127.0.0.1:{port}", certs / "ca.crt"
    finally:
        listener.close()


def test_the_right_ca_and_a_name_the_certificate_holds_pass(coordinator: tuple[str, Path]) -> None:
    address, ca = coordinator
    check_coordinator(address, ca)
    assert main(["--superlink", address, "--root-certificates", str(ca), "--wait", "0"]) == 0


def test_another_coordinators_ca_is_named(coordinator: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = coordinator
    make_ca(tmp_path / "other")
    with pytest.raises(PreflightError, match="does not verify against FIBOS_CA_CERT .*other/ca.crt.*is it this"):
        check_coordinator(address, tmp_path / "other" / "ca.crt", ca_setting="FIBOS_CA_CERT")


def test_a_name_missing_from_the_certificate_says_how_to_add_it(coordinator: tuple[str, Path]) -> None:
    address, ca = coordinator
    port = address.rsplit(":", 1)[1]
    with pytest.raises(PreflightError, match="does not name 'localhost'.*FIBOS_PUBLIC_NAMES=localhost"):
        check_coordinator(f"localhost:{port}", ca)


def test_a_name_that_does_not_resolve_fails_at_once_even_with_a_wait(coordinator: tuple[str, Path]) -> None:
    _, ca = coordinator
    started = time.monotonic()
    with pytest.raises(PreflightError, match="FIBOS_SUPERLINK fleet.invalid:8000: 'fleet.invalid' does not resolve"):
        check_coordinator("fleet.invalid:8000", ca, wait=60, setting="FIBOS_SUPERLINK")
    assert time.monotonic() - started < 30  # not the wait


def test_a_coordinator_not_up_yet_is_waited_for(tmp_path: Path) -> None:
    certs = tmp_path / "late"
    ca_cert, ca_key = make_ca(certs)
    make_server_cert(certs, ca_cert, ca_key, ["127.0.0.1"])
    port = free_port()
    started = time.monotonic()
    with pytest.raises(PreflightError, match=f"127.0.0.1:{port}: the coordinator did not answer within 1 s"):
        check_coordinator(f"127.0.0.1:{port}", certs / "ca.crt", wait=1, poll=0.2)
    assert time.monotonic() - started >= 1
    timer = threading.Timer(1.0, lambda: listeners.append(TlsListener(certs, port)))
    listeners: list[TlsListener] = []
    timer.start()
    try:
        check_coordinator(f"127.0.0.1:{port}", certs / "ca.crt", wait=60, poll=0.2)  # answers after about 1 s
    finally:
        timer.join()
        for listener in listeners:
            listener.close()


def test_ca_files_that_are_not_a_certificate_are_named(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=f"FIBOS_CA_CERT {tmp_path}: is a folder"):
        check_ca_certificate(tmp_path, "FIBOS_CA_CERT")
    with pytest.raises(PreflightError, match="no-such.crt: cannot be read"):
        check_ca_certificate(tmp_path / "no-such.crt")
    truncated = tmp_path / "ca.crt"
    truncated.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(PreflightError, match="ca.crt: not a PEM certificate"):
        check_ca_certificate(truncated)


def test_node_keys_are_checked_like_the_supernode_loads_them(tmp_path: Path) -> None:
    make_node_keys(tmp_path, "edge-07")
    check_private_key(tmp_path / "edge-07")
    with pytest.raises(PreflightError, match="edge-07.pub: not an unencrypted OpenSSH private key"):
        check_private_key(tmp_path / "edge-07.pub")
    pem = tmp_path / "pem"  # an EC key, but in PEM: flower-supernode loads OpenSSH only
    pem.write_bytes(
        ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(PreflightError, match="pem: not an unencrypted OpenSSH private key"):
        check_private_key(pem)
    rsa_key = tmp_path / "rsa"
    rsa_key.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
    )
    with pytest.raises(PreflightError, match="rsa: not an elliptic-curve key"):
        check_private_key(rsa_key)


@pytest.mark.parametrize("address", ["fleet.example.org", "fleet.example.org:", ":8000", "host:0", "host:99999"])
def test_malformed_addresses_are_named(address: str) -> None:
    with pytest.raises(PreflightError, match=f"--superlink {address!r}: expected HOST:PORT"):
        split_address(address)
    assert split_address("[::1]:8000") == ("::1", 8000)


def test_the_command_names_the_settings_the_user_gave(tmp_path: Path, capsys) -> None:
    make_ca(tmp_path)
    argv = ["--superlink", "fleet.invalid:8000", "--root-certificates", str(tmp_path / "ca.crt"), "--wait", "0"]
    argv += ["--names", "superlink=FIBOS_SUPERLINK,root-certificates=FIBOS_CA_CERT"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: FIBOS_SUPERLINK fleet.invalid:8000: 'fleet.invalid' does not")
    (tmp_path / "ca.crt").write_text("not a certificate")
    assert main(argv) == 2
    assert f"error: FIBOS_CA_CERT {tmp_path / 'ca.crt'}: not a PEM certificate" in capsys.readouterr().err


def test_an_unknown_setting_name_is_refused(tmp_path: Path, capsys) -> None:
    make_ca(tmp_path)
    argv = ["--superlink", "h:1", "--root-certificates", str(tmp_path / "ca.crt"), "--names", "superlnk=X"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and "--names 'superlnk=X': expected OPTION=NAME" in capsys.readouterr().err
