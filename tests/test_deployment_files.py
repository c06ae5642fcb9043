"""The promises docker-compose.yml and the Dockerfiles make, checked on the files themselves.

(The topology test runs the compose commands; hadolint and the compose-spec
schema run in ``make lint``. These tests pin down the security and layout
properties a reviewer would otherwise have to re-read the files for.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.compose_topology import interpolate, load_services

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))
# The images must run the Flower these tests run against.
FLWR_VERSION = version("flwr")


@pytest.fixture(scope="module")
def doc() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), {})


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_control_api_only_on_the_control_network_and_host_loopback(doc: dict) -> None:
    link = doc["services"]["superlink"]
    assert link["networks"] == ["control"]
    assert all(p.startswith("127.0.0.1:") for p in link["ports"]), link["ports"]
    gateway = doc["services"]["fleet-gateway"]
    assert set(gateway["networks"]) == {"control", "edge"}
    conf = (REPO / "docker" / "fleet-gateway.conf").read_text()
    locations = re.findall(r"location\s+(=?\s*\S+)\s*\{", conf)
    proxied = re.findall(r"location\s+(\S+)\s*\{[^}]*proxy_pass", conf)
    assert proxied == ["/v1/fleet/"], "the gateway must forward the Fleet API only"
    assert "/" in locations and re.search(r"location / \{\s*return 403", conf)
    assert "proxy_ssl_verify on" in conf


def test_superlink_runs_tls_with_node_auth(doc: dict) -> None:
    services = load_services(COMPOSE, {})
    argv = services["superlink"].argv
    assert "--insecure" not in argv
    assert {
        "--enable-supernode-auth",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--ssl-ca-certfile",
    } <= set(argv)
    assert "--disable-runtime-dependency-installation" in argv  # no download at run start
    assert _arg(argv, "--database").startswith("/state/")
    assert any(t == "/state" for s, t, _ in services["superlink"].volumes if s == "superlink-state")


def test_every_supernode_is_keyed_registered_and_served(doc: dict) -> None:
    services = load_services(COMPOSE, {}, profiles={"gpu"})
    creds = services["credentials"].argv
    made = {creds[i + 1] for i, a in enumerate(creds) if a == "--node"}
    registered = {Path(a).stem for a in services["register"].argv if a.endswith(".pub")}
    nodes = {n: s for n, s in services.items() if s.argv[0] == "flower-supernode"}
    assert len(nodes) >= 4
    for name, svc in nodes.items():
        argv = svc.argv
        assert "--insecure" not in argv
        assert _arg(argv, "--superlink") == "fleet-gateway:8443", name
        key = Path(_arg(argv, "--auth-supernode-private-key")).name
        assert key in made and key in registered, name
        assert svc.networks == ["edge"], name
        port = _arg(argv, "--port")
        executors = [s for s in services.values() if "--runtime-api-address" in s.argv]
        assert any(_arg(s.argv, "--runtime-api-address") == f"{name}:{port}" for s in executors), (
            name
        )
        assert svc.healthcheck is not None
    gpu = doc["services"]["clientapp-gpu"]
    # The GPU image is the CPU image's file with PyPI's CUDA torch; NVIDIA's base stays an option.
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["dockerfile"] == "docker/app.Dockerfile"
    assert gpu["build"]["args"]["REQUIRE_CUDA"] == "1" and gpu["build"]["args"]["TORCH_INDEX"] == ""
    assert (REPO / "docker" / "app-cuda-nvidia.Dockerfile").is_file()
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def _dealt(services: dict) -> dict[str, set[str]]:
    """Volume name -> the files the `credentials` one-shot deals into it (its ``--deal
    /deal/VOLUME=FILES``)."""
    argv = services["credentials"].argv
    specs = [argv[i + 1] for i, a in enumerate(argv) if a == "--deal"]
    return {
        Path(folder).name: set(files.split(","))
        for folder, files in (spec.split("=", 1) for spec in specs)
    }


def _credential_files(svc, dealt: dict[str, set[str]]) -> dict[str, str]:
    """Path in the container -> file name, for every credential file the service can see."""
    return {
        f"{target}/{name}": name
        for source, target, _ in svc.volumes
        if source in dealt
        for name in dealt[source]
    }


# What each kind of service may hold: the least it needs to do its work.
EXPECTED_CREDENTIALS = {
    "superlink": {"ca.crt", "server.pem", "server.key", "superexec.secret"},
    "fleet-gateway": {"ca.crt", "server.pem", "server.key"},  # it terminates TLS as the SuperLink
    "superexec-serverapp": "public+secret",
    "register": "public",
    "submit": "public",
}


@pytest.mark.parametrize(
    "compose_file", [COMPOSE, REPO / "docker" / "compose.arm64.yml"], ids=lambda p: p.name
)
def test_each_service_mounts_only_the_credentials_it_needs_read_only(
    compose_file: Path, tmp_path: Path
) -> None:
    main = load_services(COMPOSE, {}, profiles={"gpu"})
    services = main
    if (
        compose_file != COMPOSE
    ):  # an override file adds services to the main file's (as `docker compose -f -f`)
        merged = yaml.safe_load(COMPOSE.read_text())
        merged["services"] |= yaml.safe_load(compose_file.read_text())["services"]
        (tmp_path / "merged.yml").write_text(yaml.safe_dump(merged))
        services = {
            k: v for k, v in load_services(tmp_path / "merged.yml", {}).items() if k not in main
        }
    dealt = _dealt(main)
    public = dealt["public"]
    assert public == {"ca.crt"} | {
        f"{n}.pub" for n in ("supernode-1", "supernode-2", "supernode-3", "supernode-4")
    } | {"supernode-gpu.pub"}
    for name, svc in services.items():
        if name == "credentials":
            continue
        # The volume with the CA key and every original is the one-shot's alone.
        assert not any(source == "credentials" for source, _, _ in svc.volumes), name
        assert all(ro for source, _, ro in svc.volumes if source in dealt), (
            f"{name}: a credential volume is writable"
        )
        files = _credential_files(svc, dealt)
        held = set(files.values())
        if svc.argv[0] == "flower-supernode":
            key = Path(_arg(svc.argv, "--auth-supernode-private-key")).name
            assert held == {"ca.crt", key, "superexec.secret"}, name  # its own key, no other node's
        elif "--insecure" in svc.argv and "--runtime-api-address" in svc.argv:
            assert held == {"superexec.secret"}, (
                name
            )  # a ClientApp executor runs the app's code: no key at all
        elif EXPECTED_CREDENTIALS.get(name) == "public":
            assert held <= public, name
        elif EXPECTED_CREDENTIALS.get(name) == "public+secret":
            assert held <= public | {"superexec.secret"}, name
        else:
            assert held == EXPECTED_CREDENTIALS[name], name
        # Every credential path the service's command names is one it holds.
        named = [a for a in svc.argv if a.startswith("/credentials/")]
        assert named or name == "fleet-gateway", (
            name
        )  # nginx names its files in its configuration (below)
        assert set(named) <= set(files), f"{name}: {sorted(set(named) - set(files))} not mounted"
    # The gateway's nginx configuration names the files of its mount.
    conf = (REPO / "docker" / "fleet-gateway.conf").read_text()
    gateway = _credential_files(main["fleet-gateway"], dealt)
    for path in re.findall(r"(/credentials/\S+);", conf):
        assert path in gateway, path


def test_images_are_pinned_to_the_projects_flower(doc: dict) -> None:
    for name, spec in doc["services"].items():
        image = spec.get("image", "")
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image!r}"
        if image.startswith("flwr/"):
            assert image.split(":")[1].startswith(FLWR_VERSION + "-") or image.endswith(
                ":" + FLWR_VERSION
            ), name
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert re.search(
            rf"(flwr/superexec:{re.escape(FLWR_VERSION)}|FLWR_VERSION={re.escape(FLWR_VERSION)})",
            text,
        )
        assert "latest" not in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_layers_and_user(dockerfile: Path) -> None:
    lines = [
        ln.strip()
        for ln in dockerfile.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] == "49999:49999", (
        "containers must end as the non-root uid of Flower's images"
    )
    first_code_copy = next(
        i for i, ln in enumerate(lines) if re.match(r"COPY .*\b(common|client|server)\b", ln)
    )
    deps = next(
        i
        for i, ln in enumerate(lines)
        if "pip install" in ln and "--no-deps" not in ln and "torch" not in ln
    )
    assert deps < first_code_copy, (
        "dependencies must be installed before the code is copied (layer reuse)"
    )
    assert lines[-1].startswith("ENTRYPOINT")


def test_schema_check_is_not_vacuous(tmp_path: Path) -> None:
    """The compose-spec validation ``make lint`` runs rejects a malformed file."""
    bad = tmp_path / "compose.yml"
    bad.write_text(
        "services:\n  x:\n    image: busybox:1\n    depends_on:\n      y: {condition: sometimes}\n"
    )
    checker = Path(sys.executable).parent / "check-jsonschema"
    cmd = [str(checker), "--builtin-schema", "vendor.compose-spec"]
    assert subprocess.run([*cmd, str(COMPOSE)], capture_output=True).returncode == 0
    assert subprocess.run([*cmd, str(bad)], capture_output=True).returncode != 0


def _volume_sources(spec: dict) -> dict[str, bool]:
    """A service's mounts as {source: read-only}, in either of Compose's volume syntaxes."""
    mounts = {}
    for item in spec.get("volumes") or []:
        if isinstance(item, dict):
            mounts[item["source"]] = bool(item.get("read_only"))
        else:
            source, _, *mode = item.split(":")
            mounts[source] = "ro" in mode
    return mounts


def test_a_remote_node_holds_its_own_key_and_its_executor_none() -> None:
    """docker/node.yml: the node's private key is made on the node, and only its SuperNode mounts
    it."""
    env = {
        "FIBOS_NODE_NAME": "lab-pi-1",
        "FIBOS_SUPERLINK": "fleet.example.org:8000",
        "FIBOS_CA_CERT": "/ca.crt",
    }
    services = interpolate(yaml.safe_load((REPO / "docker" / "node.yml").read_text()), env)[
        "services"
    ]
    assert set(services) == {"node-key", "preflight", "supernode", "clientapp"}
    assert (
        services["supernode"]["depends_on"]["preflight"]["condition"]
        == "service_completed_successfully"
    )
    assert _volume_sources(services["preflight"]) == {
        "/ca.crt": True
    }  # checks the CA and the address, no key
    maker = services["node-key"]
    assert "--node" in maker["command"] and "--san" not in maker["command"]  # a key pair, no CA
    assert [a for a in maker["command"] if a.startswith("/deal/key=")] == [
        "/deal/key=lab-pi-1"
    ]  # the key alone
    assert maker["network_mode"] == "none"
    mounts = {name: _volume_sources(spec) for name, spec in services.items()}
    assert [name for name, m in mounts.items() if "keys" in m] == ["node-key"]  # the originals
    assert [name for name, m in mounts.items() if "key" in m] == ["node-key", "supernode"]
    assert mounts["supernode"] == {"/ca.crt": True, "key": True, "executor-secret": True}
    assert (
        _arg(services["supernode"]["command"], "--auth-supernode-private-key")
        == "/credentials/key/lab-pi-1"
    )
    assert _arg(services["supernode"]["command"], "--superlink") == "fleet.example.org:8000"
    assert "--insecure" not in services["supernode"]["command"]  # TLS to the coordinator
    executor = mounts["clientapp"]
    assert executor.pop("executor-secret") is True and all(executor.values()), (
        executor
    )  # data read-only, no key
    gpu = yaml.safe_load((REPO / "docker" / "node.gpu.yml").read_text())["services"]
    assert (
        set(gpu) == {"clientapp"} and "volumes" not in gpu["clientapp"]
    )  # the GPU changes no mount
    # the same image as the one-host stack's GPU executor
    assert (
        gpu["clientapp"]["build"]["args"]
        == yaml.safe_load(COMPOSE.read_text())["services"]["clientapp-gpu"]["build"]["args"]
    )


def test_the_coordinator_issues_no_node_key_and_shares_the_demo_services() -> None:
    """docker/coordinator.yml: the SuperLink side of docker-compose.yml, holding public keys
    only."""
    doc = interpolate(yaml.safe_load((REPO / "docker" / "coordinator.yml").read_text()), {})
    services = doc["services"]
    demo = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, spec in services.items():
        if "extends" in spec:  # the same service as the demo's, not a copy that could drift from it
            assert (
                spec["extends"] == {"file": "../docker-compose.yml", "service": name}
                and name in demo
            )
    assert {n for n, s in services.items() if "extends" in s} == {
        "superlink", "superexec-serverapp", "fleet-gateway", "submit"}  # fmt: skip
    assert services["submit"]["profiles"] == [
        "run"
    ]  # submitted when the nodes are there, not by `up`
    maker = services["credentials"]["command"]
    assert "--node" not in maker and _arg(maker, "--deal") and "/deal/public=ca.crt" in maker
    for name, spec in services.items():
        if name != "credentials":
            assert "credentials" not in _volume_sources(spec), (
                name
            )  # the CA key stays in the one-shot's volume
    register = _volume_sources(services["register"])
    assert register == {"public": True, "./node-keys": True}, register
    assert services["register"]["command"][-1] == "/node-keys"
    assert (REPO / "docker" / "node-keys" / "README.md").is_file()
