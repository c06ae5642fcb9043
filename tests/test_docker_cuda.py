"""The GPU executor image, built for real from PyPI's CUDA torch, checked on a machine without a
GPU.

Runs only when requested (``FIBOS_DOCKER_CUDA=1``, as ``make test-docker-cuda`` sets it; the image
is several gigabytes, so it is not part of ``make test-docker``). Then a missing engine fails the
test, it never skips:

* ``docker compose --profile gpu build clientapp-gpu``: the compose file's own build of
  ``fibos-fl/app:cuda`` (``docker/app.Dockerfile`` with torch from pip's default index and
  ``REQUIRE_CUDA=1``, no NVIDIA base image);
* in the image, torch is a CUDA build (``torch.version.cuda`` set) and, with no GPU, sees none;
* in the image, ``fibos check-gpu`` checks the CPU side and a node configured with ``device="cuda"``
  refuses at discovery with the reason instead of crashing (exit status 0);
* the seconds a fresh process of the image takes to import the ClientApp (what each Flower message
  pays), and how much of it is torch, Flower and the project, printed for the deployment docs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IMAGE = "fibos-fl/app:cuda"
PROJECT = "fibos-cudatest"

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        os.environ.get("FIBOS_DOCKER_CUDA") != "1",
        reason="the CUDA image (gigabytes): `make test-docker-cuda` runs it (sets "
        "FIBOS_DOCKER_CUDA=1; root)",
    ),
]


def _docker(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if done.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args[:4])} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    return done


def _in_image(
    *argv: str, entrypoint: str = "python", timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``argv`` in a fresh container of the image, without a network (nothing it checks needs
    one)."""
    return _docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        entrypoint,
        IMAGE,
        *argv,
        timeout=timeout,
    )


def import_breakdown(stderr: str) -> dict[str, float]:
    """Cumulative import seconds of ``torch``, ``flwr`` and the whole ``client.app`` from ``-X
    importtime`` output."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", line)
        if m and m.group(3) in ("torch", "flwr", "client.app") and m.group(3) not in out:
            out[m.group(3)] = int(m.group(1)) / 1e6
    return out


@pytest.fixture(scope="module")
def image() -> str:
    """Build the GPU executor as docker-compose.yml builds it."""
    env = {
        **os.environ,
        "FIBOS_CUDA_TORCH_INDEX": os.environ.get("FIBOS_CUDA_TORCH_INDEX", ""),
        "FIBOS_BUILD_NETWORK": os.environ.get("FIBOS_BUILD_NETWORK", "host"),
    }
    t0 = time.monotonic()
    compose = ["compose", "-p", PROJECT, "-f", str(REPO / "docker-compose.yml"), "--profile", "gpu"]
    _docker(*compose, "build", "clientapp-gpu", timeout=5400, env=env)
    size = _docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip()
    print(f"CUDA image build: {time.monotonic() - t0:.0f} s, {int(size) / 1e9:.2f} GB")
    return IMAGE


def test_the_image_holds_a_cuda_build_of_torch(image: str) -> None:
    probe = (
        "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
        "torch.cuda.is_available()]))"
    )
    version, cuda, available = json.loads(_in_image("-c", probe).stdout.strip().splitlines()[-1])
    assert cuda, f"torch {version} in {image} is not a CUDA build"
    assert available is False  # no GPU here, and none reserved for the container
    print(f"torch {version}, CUDA {cuda}")


def test_check_gpu_in_the_image_refuses_a_cuda_node_and_passes_the_cpu_side(image: str) -> None:
    only = "environment,discovery,train-cnn,fisher-cnn,probe"
    done = _in_image("check-gpu", "--only", only, "--out", "/tmp/gpu-check", entrypoint="fibos")
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 5 and all(line.startswith("[   pass]") for line in lines), done.stdout
    refusal = next(line for line in lines if "discovery" in line)
    assert (
        "refuses at discovery" in refusal
        and "built for CUDA" in refusal
        and "Container Toolkit" in refusal
    )


def test_a_fresh_process_imports_the_clientapp_in_seconds(image: str) -> None:
    walls, parts = [], {}
    for _ in range(3):
        t0 = time.monotonic()
        done = _in_image("-X", "importtime", "-c", "import client.app")
        walls.append(time.monotonic() - t0)
        parts = import_breakdown(done.stderr)
    assert {"torch", "flwr", "client.app"} <= set(parts), parts
    assert parts["client.app"] >= parts["torch"]
    own = parts["client.app"] - parts["torch"] - parts["flwr"]
    print(
        f"ClientApp import in {image}: {parts['client.app']:.2f} s (torch {parts['torch']:.2f} s, "
        f"flwr {parts['flwr']:.2f} s, the rest {own:.2f} s); container start to exit "
        f"{min(walls):.1f}-{max(walls):.1f} s"
    )
