"""cli.app_bundle: the staged folder gives ``flwr run`` the bundle the checkout would, byte for
byte."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from cli.app_bundle import BundleError, app_files, stage_app
from cli.launcher import APP_DIR

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "mini-app"
version = "1.0.0"
dependencies = ["flwr>=1.42"]

[tool.flwr.app]
publisher = "tests"
fab-include = ["pkg/**/*.py", "results.py"]

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"

[tool.flwr.app.config]
num-rounds = 1
"""


def _names(fab: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        return archive.namelist()


def test_a_staged_app_holds_the_bundles_files_and_nothing_else(tmp_path: Path) -> None:
    app = tmp_path / "app"
    for name in [
        # the bundle
        "pkg/__init__.py", "pkg/server.py", "pkg/client.py", "pkg/sub/deep.py", "results.py",
        ".venv/lib/site.py", "results/run/metrics.py", "build/stale.py", "notes.txt",
        "pkg/__pycache__/x.py",
    ]:  # fmt: skip
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(f"# {name}\n")
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / ".gitignore").write_text("build/\n")
    (app / "pkg" / "linked.py").symlink_to(
        app / "pkg" / "server.py"
    )  # Flower's walk skips symlinks too
    # Pruned folders are never walked: none of their files is even a candidate.
    assert not any(
        p.startswith((".venv/", "results/")) or "__pycache__" in p for p in app_files(app)
    )

    staged = stage_app(app, tmp_path / "staged")
    held = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert held == [
        "pkg/__init__.py",
        "pkg/client.py",
        "pkg/server.py",
        "pkg/sub/deep.py",
        "pyproject.toml",
        "results.py",
    ]
    assert (
        staged / "pyproject.toml"
    ).read_text() == PYPROJECT  # as it is, not as Flower rewrites it
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)

    (app / "pkg" / "server.py").write_text(
        "# changed\n"
    )  # staging again reflects the app as it is now
    assert (stage_app(app, tmp_path / "staged") / "pkg" / "server.py").read_text() == "# changed\n"


def test_this_checkouts_staged_bundle_is_the_one_flwr_builds_from_it(tmp_path: Path) -> None:
    """The anchor: the product's own app, with its virtual environment and results beside it."""
    staged = stage_app(APP_DIR, tmp_path / "staged")
    from_checkout = build_fab_from_disk(APP_DIR)
    from_staged = build_fab_from_disk(staged)
    assert hashlib.sha256(from_staged).hexdigest() == hashlib.sha256(from_checkout).hexdigest()
    assert "server/app.py" in _names(from_staged) and "client/app.py" in _names(from_staged)


def test_an_app_flower_refuses_is_named_and_nothing_is_staged(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        PYPROJECT.replace('publisher = "tests"\n', "")
    )  # a required key gone
    with pytest.raises(BundleError, match=f"the app in {app} cannot be bundled: "):
        stage_app(app, tmp_path / "staged")
    assert not (tmp_path / "staged").exists()
