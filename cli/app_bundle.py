"""The app's own files, staged in a folder of their own for ``flwr run``.

``flwr run APP`` builds the app bundle (FAB) by walking every file under ``APP`` and then filtering
them by the app's ``.gitignore`` and ``fab-include`` patterns. Run from a checkout, ``APP`` also
holds the virtual environment and the benchmark results: the walk visits tens of thousands of files
to keep about two hundred, and took 8.8 s of each submission on a 2-core machine (``flwr build --app
.``; 0.04 s from the staged folder, which takes about 1 s to stage). Staging walks the checkout with
the folders that hold no app file pruned, lets Flower's own FAB builder pick the files, and copies
exactly those, so the bundle ``flwr run`` builds from the staged folder is the one it would build
from the checkout, byte for byte (same content hash).
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path


class BundleError(RuntimeError):
    """Flower's builder refused the app (its message says why); nothing was submitted."""


# Folders that never hold a file of the app bundle: environments, caches, VCS data, run outputs.
PRUNED = frozenset(
    {
        ".git",
        ".venv",
        "venv",
        "__pycache__",
        "node_modules",
        ".flwr",
        ".hypothesis",
        ".pytest_cache",
        ".ruff_cache",
        ".mypy_cache",
        "results",
    }
)


def app_files(app_dir: Path) -> dict[str, Path]:
    """Files under ``app_dir`` that may belong to its bundle, by POSIX path relative to it.

    The walk skips :data:`PRUNED` folders and, like Flower's own walk, symlinks (``os.walk`` does
    not enter a linked folder); the app's ``.gitignore`` is among the files, and Flower's builder
    applies it.
    """
    root = app_dir.resolve()
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if d not in PRUNED]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                files[(rel_dir / name).as_posix()] = path
    return files


def bundle_names(app_dir: Path) -> list[str]:
    """The paths Flower's FAB builder puts in ``app_dir``'s bundle, its own manifest aside."""
    from flwr.cli.build import build_fab_from_files

    files = app_files(app_dir)
    try:
        fab, _ = build_fab_from_files(files)
    except ValueError as err:
        raise BundleError(f"the app in {app_dir} cannot be bundled: {err}") from None
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        return [name for name in archive.namelist() if name in files]


def stage_app(app_dir: Path, dest: Path) -> Path:
    """Copy ``app_dir``'s bundle files (and its ``pyproject.toml`` as it is) into ``dest``, emptied
    first.

    Parameters
    ----------
    app_dir : Path
        The Flower app: a folder with ``pyproject.toml``.
    dest : Path
        A folder of the launcher's own (removed and made again).

    Returns
    -------
    Path
        ``dest``, to give ``flwr run`` instead of ``app_dir``.

    Raises
    ------
    BundleError
        When Flower's builder refuses the app, with its reason.
    """
    names = bundle_names(app_dir)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in {"pyproject.toml", *names}:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(app_dir / name, target)
    return dest
