"""The operator-side commands the compose services and the join command are made of."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from cryptography import x509

from cli.control import connection_toml
from cli.credentials import main as credentials_main
from cli.credentials import make_ca
from cli.join import main as join_main


def _sans(pem: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + [
        str(v) for v in ext.get_values_for_type(x509.IPAddress)
    ]


def test_credentials_keep_makes_nothing_twice(tmp_path: Path) -> None:
    out = tmp_path / "c"
    args = [
        "--out",
        str(out),
        "--keep",
        "--san",
        "superlink,localhost, ,127.0.0.1,localhost",
        "--node",
        "n1",
    ]
    assert credentials_main([*args, "--secret", "exec.secret"]) == 0
    assert _sans(out / "server.pem") == [
        "superlink",
        "localhost",
        "127.0.0.1",
    ]  # commas split, duplicates dropped
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(bytes.fromhex(first["exec.secret"].decode())) == 32
    assert oct((out / "n1").stat().st_mode & 0o777) == "0o600"
    # a second `docker compose up`: same CA, certificate, keys and secret (registrations stay valid)
    assert credentials_main([*args, "--node", "n2", "--secret", "exec.secret"]) == 0
    again = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {k: again[k] for k in first} == first
    assert {"n2", "n2.pub"} <= set(again)
    # without --keep the certificate is remade
    assert credentials_main(["--out", str(out), "--san", "superlink"]) == 0
    assert (out / "server.pem").read_bytes() != first["server.pem"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_credentials_owner_covers_every_folder(tmp_path: Path) -> None:
    out, state = tmp_path / "c", tmp_path / "state"
    args = ["--out", str(out), "--node", "n1", "--owner", "49999:49999", "--chown", str(state)]
    assert credentials_main(args) == 0
    for path in (out, out / "n1", out / "n1.pub", state):
        assert (path.stat().st_uid, path.stat().st_gid) == (49999, 49999), path


def test_credentials_deal_gives_each_consumer_only_its_files(tmp_path: Path) -> None:
    out, node, link = tmp_path / "ca", tmp_path / "node-1", tmp_path / "link"
    args = [
        "--out",
        str(out),
        "--keep",
        "--san",
        "superlink",
        "--node",
        "n1",
        "--node",
        "n2",
        "--secret",
        "s",
    ]
    deals = ["--deal", f"{node}=ca.crt,n1", "--deal", f"{link}=ca.crt,server.pem,server.key,s"]
    assert credentials_main([*args, *deals]) == 0
    assert sorted(p.name for p in node.iterdir()) == ["ca.crt", "n1"]
    assert sorted(p.name for p in link.iterdir()) == ["ca.crt", "s", "server.key", "server.pem"]
    assert "ca.key" in {p.name for p in out.iterdir()}  # the CA key stays where it was made
    assert (node / "n1").read_bytes() == (out / "n1").read_bytes()
    assert oct((node / "n1").stat().st_mode & 0o777) == "0o600"  # private stays private
    assert oct((node / "ca.crt").stat().st_mode & 0o777) == "0o644"
    # a second run: the same files (kept), and a file no longer dealt to the folder is taken away
    (node / "n2").write_bytes((out / "n2").read_bytes())
    assert credentials_main([*args, *deals]) == 0
    assert sorted(p.name for p in node.iterdir()) == ["ca.crt", "n1"]


@pytest.mark.parametrize(
    ("deal", "message"),
    [
        ("/x", "DIR=FILE"),
        ("=ca.crt", "DIR=FILE"),
        ("/x=", "DIR=FILE"),
        ("/x=../ca.key", "not a plain file name"),
    ],
)
def test_credentials_deal_refuses_a_bad_spec_naming_it(
    deal: str, message: str, tmp_path: Path, capsys
) -> None:
    with pytest.raises(SystemExit):
        credentials_main(["--out", str(tmp_path), "--node", "n", "--deal", deal])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "n").exists()  # refused before anything was made


def test_credentials_deal_of_a_file_never_made_fails_naming_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ca"
    assert (
        credentials_main(["--out", str(out), "--node", "n1", "--deal", f"{tmp_path / 'd'}=n1,n9"])
        == 1
    )
    assert "n9 not in" in capsys.readouterr().err


def test_credentials_refuses_nothing_to_do_and_bad_owner(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        credentials_main(["--out", str(tmp_path)])
    with pytest.raises(ValueError, match="UID:GID"):
        credentials_main(["--out", str(tmp_path), "--node", "n", "--owner", "app"])


def test_connection_toml_is_what_flwr_reads(tmp_path: Path) -> None:
    doc = tomllib.loads(connection_toml("fibos", "superlink:8000", tmp_path / "ca.crt"))
    assert doc["superlink"]["default"] == "fibos"
    assert doc["superlink"]["fibos"] == {
        "address": "superlink:8000",
        "root-certificates": str(tmp_path / "ca.crt"),
    }
    assert tomllib.loads(connection_toml("x", "h:1", None))["superlink"]["x"]["insecure"] is True


def _join(tmp_path: Path, *extra: str) -> list[str]:
    ca = tmp_path / "ca.crt"
    if not ca.exists():
        make_ca(tmp_path)  # a real certificate: join checks the file before anything else
    return [
        "--name",
        "edge-7",
        "--superlink",
        "fleet.example.org:8000",
        "--root-certificates",
        str(ca),
        "--partition-id",
        "4",
        "--num-partitions",
        "5",
        "--keys",
        str(tmp_path / "keys"),
        *extra,
    ]


def test_join_dry_run_prints_the_three_steps(tmp_path: Path, capsys) -> None:
    assert (
        join_main(
            _join(tmp_path, "--control-api", "127.0.0.1:9093", "--capacity", "auto", "--dry-run")
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "would make the key pair" in out
    assert "cli.control register --superlink 127.0.0.1:9093" in out and "edge-7.pub" in out
    assert "--superlink fleet.example.org:8000" in out and "--auth-supernode-private-key" in out
    assert 'capacity="auto" client-id="edge-7"' in out
    assert not (tmp_path / "keys").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--capacity", "2", "--no-register"], "capacity"),
        (["--capacity", "fast", "--no-register"], "capacity"),
        (["--capacity", "0.5"], "--control-api"),
    ],
)
def test_join_fails_fast_before_touching_anything(
    tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        join_main(_join(tmp_path, *extra))
    assert message in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()


def test_join_with_its_own_data_folder_has_no_partition(tmp_path: Path, capsys) -> None:
    args = [a for a in _join(tmp_path) if a not in ("--partition-id", "4", "--num-partitions", "5")]
    assert (
        join_main(
            [
                *args,
                "--data-path",
                "/srv/cam images",
                "--capacity",
                "0.25",
                "--no-register",
                "--dry-run",
            ]
        )
        == 0
    )
    assert 'data-path="/srv/cam images" capacity=0.25 client-id="edge-7"' in capsys.readouterr().out
    assert (
        join_main(
            _join(
                tmp_path, "--data-path", "/srv/x", "--no-register", "--capacity", "1", "--dry-run"
            )
        )
        == 0
    )
    assert (
        'partition-id=4 num-partitions=5 data-path="/srv/x" capacity=1' in capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        join_main([*args, "--no-register"])
    assert "missing 'partition-id'" in capsys.readouterr().err
