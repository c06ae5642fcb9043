"""Write a one-layer image archive for ``docker load`` from a root file system tarball.

``docker import`` would do, but the Docker 20.10 engine Debian 12 ships records the host's
architecture on imported images whatever ``--platform`` says, so an arm64 root file system
imported on an x86 host is labelled amd64 and ``platform: linux/arm64`` never finds it. This
writes the image configuration itself, with the architecture given.

Usage::

    tar -C ROOTFS --numeric-owner -cf layer.tar .
    python3 rootfs_image.py --layer layer.tar --arch arm64 --tag NAME:TAG \\
        --label KEY=VALUE --env PATH=... --out image.tar
    docker load -i image.tar
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path


def _sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_archive(
    layer: Path,
    arch: str,
    tag: str,
    labels: dict[str, str],
    env: list[str],
    cmd: list[str],
    out: Path,
) -> None:
    """Write the ``docker load`` archive.

    Args:
        layer: uncompressed tarball of the root file system (the image's only layer).
        arch: Debian/OCI architecture name recorded in the image, e.g. ``amd64`` or ``arm64``.
        tag: ``name:tag`` the loaded image gets.
        labels: image labels.
        env: ``KEY=VALUE`` environment of the image.
        cmd: the image's default command.
        out: the archive to write.
    """
    diff_id = "sha256:" + _sha256(layer)
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {"Env": env, "Cmd": cmd, "Labels": labels},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "debootstrap (docker/standins/build.sh)"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": ["layer/layer.tar"]}]
    with tarfile.open(out, "w") as archive:
        archive.add(layer, arcname="layer/layer.tar")
        for name, data in (
            (config_name, config_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layer", type=Path, required=True, help="tarball of the root file system")
    ap.add_argument(
        "--arch", required=True, help="architecture recorded in the image (amd64, arm64, ...)"
    )
    ap.add_argument("--tag", required=True, help="name:tag of the image")
    ap.add_argument("--label", action="append", default=[], help="KEY=VALUE image label (repeat)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE environment (repeat)")
    ap.add_argument("--cmd", default="bash", help="default command (one word)")
    ap.add_argument("--out", type=Path, required=True, help="archive to write")
    args = ap.parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)
    write_archive(args.layer, args.arch, args.tag, labels, args.env, [args.cmd], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
