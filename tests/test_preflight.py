"""cli.preflight against a real TLS listener: each misconfiguration a node can arrive with,
named."""

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

from cli.credentials import make_ca, make_server_cert
from cli.launcher import free_port
from cli.preflight import (
    PreflightError,
    check_ca_certificate,
    check_coordinator,
    check_private_key,
    main,
    split_address,
)
from common.wire.node_keys import make_node_keys


class TlsListener:
    """A TLS server on loopback that completes handshakes with ``server.pem`` and closes (a
    coordinator's port)."""

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
    with pytest.raises(
        PreflightError, match="does not verify against FIBOS_CA_CERT .*other/ca.crt.*is it this"
    ):
        check_coordinator(address, tmp_path / "other" / "ca.crt", ca_setting="FIBOS_CA_CERT")


def test_a_name_missing_from_the_certificate_says_how_to_add_it(
    coordinator: tuple[str, Path],
) -> None:
    address, ca = coordinator
    port = address.rsplit(":", 1)[1]
    with pytest.raises(
        PreflightError, match="does not name 'localhost'.*FIBOS_PUBLIC_NAMES=localhost"
    ):
        check_coordinator(f"localhost:{port}", ca)


def test_a_name_that_does_not_resolve_fails_at_once_even_with_a_wait(
    coordinator: tuple[str, Path],
) -> None:
    _, ca = coordinator
    started = time.monotonic()
    with pytest.raises(
        PreflightError, match="FIBOS_SUPERLINK fleet.invalid:8000: 'fleet.invalid' does not resolve"
    ):
        check_coordinator("fleet.invalid:8000", ca, wait=60, setting="FIBOS_SUPERLINK")
    assert time.monotonic() - started < 30  # not the wait


def test_a_coordinator_not_up_yet_is_waited_for(tmp_path: Path) -> None:
    certs = tmp_path / "late"
    ca_cert, ca_key = make_ca(certs)
    make_server_cert(certs, ca_cert, ca_key, ["127.0.0.1"])
    port = free_port()
    started = time.monotonic()
    with pytest.raises(
        PreflightError, match=f"127.0.0.1:{port}: the coordinator did not answer within 1 s"
    ):
        check_coordinator(f"127.0.0.1:{port}", certs / "ca.crt", wait=1, poll=0.2)
    assert time.monotonic() - started >= 1
    timer = threading.Timer(1.0, lambda: listeners.append(TlsListener(certs, port)))
    listeners: list[TlsListener] = []
    timer.start()
    try:
        check_coordinator(
            f"127.0.0.1:{port}", certs / "ca.crt", wait=60, poll=0.2
        )  # answers after about 1 s
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
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(PreflightError, match="pem: not an unencrypted OpenSSH private key"):
        check_private_key(pem)
    rsa_key = tmp_path / "rsa"
    rsa_key.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(PreflightError, match="rsa: not an elliptic-curve key"):
        check_private_key(rsa_key)


@pytest.mark.parametrize(
    "address", ["fleet.example.org", "fleet.example.org:", ":8000", "host:0", "host:99999"]
)
def test_malformed_addresses_are_named(address: str) -> None:
    with pytest.raises(PreflightError, match=f"--superlink {address!r}: expected HOST:PORT"):
        split_address(address)
    assert split_address("[::1]:8000") == ("::1", 8000)


def test_the_command_names_the_settings_the_user_gave(tmp_path: Path, capsys) -> None:
    make_ca(tmp_path)
    argv = [
        "--superlink",
        "fleet.invalid:8000",
        "--root-certificates",
        str(tmp_path / "ca.crt"),
        "--wait",
        "0",
    ]
    argv += ["--names", "superlink=FIBOS_SUPERLINK,root-certificates=FIBOS_CA_CERT"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(
        "error: FIBOS_SUPERLINK fleet.invalid:8000: 'fleet.invalid' does not"
    )
    (tmp_path / "ca.crt").write_text("not a certificate")
    assert main(argv) == 2
    assert (
        f"error: FIBOS_CA_CERT {tmp_path / 'ca.crt'}: not a PEM certificate"
        in capsys.readouterr().err
    )


def test_an_unknown_setting_name_is_refused(tmp_path: Path, capsys) -> None:
    make_ca(tmp_path)
    argv = [
        "--superlink",
        "h:1",
        "--root-certificates",
        str(tmp_path / "ca.crt"),
        "--names",
        "superlnk=X",
    ]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert (
        refused.value.code == 2
        and "--names 'superlnk=X': expected OPTION=NAME" in capsys.readouterr().err
    )


# docker/supernode.sh: flower-supernode as it is, plus a message naming the key when the SuperLink
# refuses it.
WRAPPER = Path(__file__).resolve().parents[1] / "docker" / "supernode.sh"
FLOWER_REFUSAL = """\
ERROR :     Exit Code: 305
Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.
"""


def _fake_supernode(folder: Path, body: str) -> dict[str, str]:
    """An environment whose ``flower-supernode`` is a shell script running ``body``."""
    import os

    folder.mkdir(exist_ok=True)
    script = folder / "flower-supernode"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_the_wrapper_names_the_key_and_its_setting_when_flower_refuses_it(tmp_path: Path) -> None:
    import subprocess

    env = _fake_supernode(tmp_path / "bin", f"cat <<'X'\n{FLOWER_REFUSAL}X\nexit 1\n")
    argv = [
        "sh",
        str(WRAPPER),
        "--superlink",
        "h:1",
        "--auth-supernode-private-key",
        "/keys/lab-1",
        "--insecure",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert (
        done.returncode == 1
    )  # the SuperNode's own status: a restart policy sees what it saw before
    assert FLOWER_REFUSAL in done.stdout  # Flower's lines pass through, in order
    assert done.stderr.startswith(
        "error: the SuperLink refused this node's key /keys/lab-1, set by "
        "--auth-supernode-private-key /keys/lab-1:"
    ), done.stderr
    assert "another SuperNode with the same key is connected" in done.stderr
    assert "Each\nmachine needs its own key pair" in done.stderr
    named = subprocess.run(argv, env={**env, "FIBOS_KEY_SETTING": "FIBOS_NODE_NAME=lab-1"},
                           capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert "set by FIBOS_NODE_NAME=lab-1:" in named.stderr, named.stderr


def test_the_wrapper_adds_nothing_to_other_exits_and_passes_their_status(tmp_path: Path) -> None:
    import subprocess

    env = _fake_supernode(tmp_path / "bin", 'echo "args: $*"; echo oops >&2; exit 7\n')
    done = subprocess.run(
        ["sh", str(WRAPPER), "--a", "b c"], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (7, "args: --a b c\noops\n", "")
    env = _fake_supernode(tmp_path / "bin", "exit 0\n")
    assert (
        subprocess.run(["sh", str(WRAPPER)], env=env, capture_output=True, timeout=60).returncode
        == 0
    )


def test_the_wrapper_hands_a_stop_signal_to_the_supernode(tmp_path: Path) -> None:
    """``docker stop`` signals the container's first process, the shell: the SuperNode must get it
    too."""
    import signal
    import subprocess

    env = _fake_supernode(
        tmp_path / "bin",
        "trap 'echo stopped by TERM; exit 0' TERM\necho started\nwhile :; do sleep 0.1; done\n",
    )
    proc = subprocess.Popen(["sh", str(WRAPPER)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout.read() == "stopped by TERM\n"


@pytest.mark.federation
def test_a_supernode_started_with_a_connected_nodes_key_is_told_why(tmp_path: Path) -> None:
    """A real secure federation: a second SuperNode with node 0's key while node 0 is connected."""
    import subprocess

    from cli.launcher import LocalFederation

    with LocalFederation(
        (1.0,), tmp_path / "federation", echo=lambda line: None, secure=True
    ) as fed:
        # Node 0 must hold the key first: started at once, the second SuperNode could win the race
        # and be let in.
        deadline = time.monotonic() + 120
        while (
            "[Fleet.ActivateNode] Activated node_id" not in (fed.logs / "superlink.log").read_text()
        ):
            assert time.monotonic() < deadline, "node 0 was not activated within 120 s"
            assert fed.nodes[0].poll() is None, (fed.logs / "supernode-0.log").read_text()
            time.sleep(0.5)
        argv = ["sh", str(WRAPPER), "--root-certificates", str(fed.certs / "ca.crt"), "--superlink",
                f"127.0.0.1:{fed.link_port}", "--auth-supernode-private-key",
                str(fed.certs / "node-0"),
                "--port", str(free_port()), "--node-config", "partition-id=0 "
                "num-partitions=1"]  # fmt: skip
        log = tmp_path / "clone.log"
        with open(log, "w") as out:
            status = subprocess.Popen(argv, env=fed.env, stdout=out, stderr=subprocess.STDOUT).wait(
                timeout=180
            )
        text = log.read_text()
        assert status != 0 and "Failed to activate SuperNode" in text, text
        assert f"error: the SuperLink refused this node's key {fed.certs / 'node-0'}" in text, text
        assert fed.nodes[0].poll() is None  # the node that holds the key is unaffected
