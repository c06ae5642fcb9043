"""docker-compose.yml's exact service commands, each in its own network namespace, complete a
federation.

TLS and SuperNode authentication as composed; the SuperNodes reach the
SuperLink only through the Fleet gateway. Needs root, iproute2 and nginx
(``make test`` installs the latter two on Debian when run as root). In CI
(``CI`` set, or root) a missing capability fails the test with the reason;
elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.compose_topology import ComposeTopology, namespace_support

pytestmark = pytest.mark.federation

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
# Where a SuperNode and a control one-shot find the CA certificate (each mounts only its own
# credentials).
NODE_CA = "/credentials/node/ca.crt"
PUBLIC_CA = "/credentials/public/ca.crt"


def _require_namespaces() -> None:
    reason = namespace_support()
    if reason is None:
        return
    if os.environ.get("CI") or os.geteuid() == 0:
        pytest.fail(f"compose topology test cannot run: {reason}")
    pytest.skip(reason)


def _https_status(topo: ComposeTopology, service: str, url: str, cafile: str) -> str:
    """HTTP status of ``url`` fetched from inside ``service`` with the deployment's CA (its copy),
    or the error."""
    code = (
        "import ssl,sys,urllib.request,urllib.error\n"
        f"ctx=ssl.create_default_context(cafile={cafile!r})\n"
        "try:\n"
        f"    print(urllib.request.urlopen({url!r},context=ctx,timeout=5).status)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    done = topo.exec(service, ["python", "-c", code])
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]


@pytest.mark.timeout(1500)
def test_compose_federation_over_tls_with_authenticated_supernodes(tmp_path: Path) -> None:
    _require_namespaces()
    env = {"FIBOS_NUM_ROUNDS": "2", "FIBOS_RUN_CONFIG": "eval-every=2"}
    # Every process shares this machine's two cores: one intra-op thread each avoids
    # oversubscription.
    with ComposeTopology(COMPOSE, tmp_path, env, {"OMP_NUM_THREADS": "1"}) as topo:
        assert set(topo.services) >= {
            "superlink",
            "fleet-gateway",
            "submit",
            "supernode-4",
            "clientapp-4",
        }
        assert "supernode-gpu" not in topo.services  # the gpu profile is off by default
        topo.up(timeout=300)

        # The edge network reaches the Fleet API through the gateway, and nothing else.
        assert (
            _https_status(
                topo, "supernode-1", "https://fleet-gateway:8443/v1/control/list-runs", NODE_CA
            )
            == "403"
        )
        assert (
            _https_status(
                topo, "supernode-1", "https://fleet-gateway:8443/v1/runtime/anything", NODE_CA
            )
            == "403"
        )
        control_ip = topo.reachable_address("superlink", "control")
        blocked = _https_status(
            topo, "supernode-1", f"https://{control_ip}:8000/v1/control/list-runs", NODE_CA
        )
        assert blocked not in {"200", "401", "403", "404", "405"}, (
            blocked
        )  # no route: not even a TLS handshake
        assert (
            _https_status(topo, "supernode-1", "https://superlink:8000/", NODE_CA) == "URLError"
        )  # name unknown there
        # ... while the control network does reach the SuperLink itself (so the check above is
        # meaningful).
        assert _https_status(
            topo, "register", "https://superlink:8000/v1/control/nothing", PUBLIC_CA
        ) in {"404", "405"}

        rc = topo.wait_exit("submit", timeout=1200)
        assert rc == 0, "\n".join(
            topo.tail(s) for s in ("submit", "superexec-serverapp", "superlink", "supernode-1")
        )

    results = tmp_path / "volumes" / "results" / "default"
    metrics = json.loads((results / "metrics.json").read_text())
    start, *rounds = metrics["rounds"]
    assert start["round"] == 0
    assert [r["round"] for r in rounds] == [1, 2]
    assert (results / "model.pt").exists()
    for record in rounds:
        assert record["replies"] == 4, record
        sources = sorted(c["capacity_source"] for c in record["clients"])
        assert sources == ["auto", "node-config", "node-config", "node-config"]
    capacities = sorted(
        c["capacity"] for c in rounds[-1]["clients"] if c["capacity_source"] == "node-config"
    )
    assert capacities == [0.25, 0.5, 1.0]
    assert (
        rounds[-1]["global"]["accuracy"] > start["global"]["accuracy"] + 0.05
    )  # the federation learned
    # The one-shot services left the state a second `docker compose up` reuses.
    volumes = tmp_path / "volumes"
    assert {"ca.crt", "ca.key", "server.pem", "supernode-4.pub", "superexec.secret"} <= {
        p.name for p in (volumes / "credentials").iterdir()
    }
    # ... and dealt each consumer only its own files.
    assert sorted(p.name for p in (volumes / "node-4").iterdir()) == ["ca.crt", "supernode-4"]
    assert sorted(p.name for p in (volumes / "link-tls").iterdir()) == [
        "ca.crt",
        "server.key",
        "server.pem",
    ]
    assert sorted(p.name for p in (volumes / "executor-secret").iterdir()) == ["superexec.secret"]
    assert (tmp_path / "volumes" / "superlink-state" / "state.db").exists()
