"""The parts of the docs that the code defines, generated from it: config reference, method table,
layout.

* ``pyproject.toml``'s ``[tool.flwr.app.config]`` block and the run-config and node-config tables of
  ``docs/guide/configuration.md``, from the schemas (:mod:`common.config.run` and each method's
  options model, :mod:`common.config.node`): a key is declared once, in the schema;
* README's method table, from each registered method's ``summary``;
* README's layout section, from the first line of every module's docstring;
* README's headline results table, from the results.csv its marker names
  (:mod:`benchmarks.headline`).

``fibos docs`` (``--check``, the default) fails when a file differs from what the code says; ``fibos
docs --write`` rewrites them. A test runs the check.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from benchmarks.headline import headline_block
from common.config.node import NodeConfig
from common.config.parse import key_groups
from common.config.run import RunConfig, common_keys
from common.config.schema import KeyGroup, kebab
from common.methods import registry

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_START = "[tool.flwr.app.config]\n"
RUN_TABLE_START = "| key | default | allowed | meaning |\n"
NODE_START = "| key | required | allowed | meaning |\n"
METHODS_START = "| `method` | submodel of a client with capacity `gamma` |\n"
LAYOUT_START = "## Layout\n"
#: How to read the house, above the generated list of packages.
LAYOUT_GUIDE = (
    "The ServerApp (`server/app.py`) runs rounds through the strategy (`server/strategy.py`), "
    "which asks the run's method (`common/methods/`) what each node is sent and how replies change "
    "the global model; the ClientApp (`client/app.py`) asks the same method how a node trains. The "
    "rest of `common/` is what methods are built from, grouped by concern; operator commands and "
    "benchmarks sit apart from the apps, in `cli/` and `benchmarks/`, and are not in the Flower "
    "app bundle. `tests/test_architecture.py` holds the rules: `server/` and `client/` never "
    "import each other, `common/` imports neither, the three import nothing from `cli/` or "
    "`benchmarks/`, no import cycle (type-only imports included), the shared layers "
    "(`common/config`, `common/wire`, `common/training`) import no method, the config schema loads "
    "neither torch nor the methods, a method's spec loads no torch, the server and the ClientApp "
    "each call only their own side of a method, and no folder holds more than 15 modules.\n"
)
#: The packages of the layout section, in reading order: the apps first, then what they share, then
#: the tools.
PACKAGES = (
    "server",
    "server/strategy_core",
    "server/clustering",
    "client",
    "common",
    "common/methods",
    "common/methods/contract",
    "common/methods/specs",
    "common/config",
    "common/data",
    "common/models",
    "common/training",
    "common/fisher",
    "common/submodels",
    "common/aggregation",
    "common/wire",
    "common/privacy",
    "cli",
    "benchmarks",
    "benchmarks/privacy",
    "benchmarks/ranking",
    "benchmarks/vs_flower",
)


def _fields() -> Iterator[tuple[str, FieldInfo, KeyGroup | None]]:
    """``(key, field, owning group)`` for every run-config key: common keys first, then each key
    group's."""
    keys = common_keys()
    for name, field in RunConfig.model_fields.items():
        if kebab(name) in keys:
            yield kebab(name), field, None
    for group in key_groups().values():
        for name, field in group.model.model_fields.items():
            yield group.prefix + kebab(name), field, group


def _bound(field: FieldInfo, attr: str) -> float | None:
    return next(
        (getattr(m, attr) for m in field.metadata if getattr(m, attr, None) is not None), None
    )


def allowed(key: str, field: FieldInfo) -> str:
    """What a key accepts, in the configuration reference's words (from the field's type and
    bounds)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return str(extra["allowed"])
    if key == "method":
        return ", ".join(f"`{m}`" for m in registry())
    if get_origin(field.annotation) is Literal:
        return ", ".join(f"`{v}`" for v in get_args(field.annotation))
    if field.annotation is bool:
        return "true, false"
    ge, gt, le, lt = (_bound(field, a) for a in ("ge", "gt", "le", "lt"))
    lo = ge if ge is not None else gt
    hi = le if le is not None else lt
    if lo is None and hi is None:
        return "text"
    if hi is None or hi >= 1_000_000:
        return f"{'>=' if ge is not None else '>'} {lo:g}"
    return f"{'[' if ge is not None else '('}{lo:g}, {hi:g}{']' if le is not None else ')'}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _markdown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def manifest_block() -> str:
    """``[tool.flwr.app.config]`` with every key at its default and its meaning as a comment."""
    lines = [MANIFEST_START.rstrip("\n")]
    owner_seen: set[str] = set()
    for key, field, owner in _fields():
        if owner is not None and owner.name not in owner_seen:
            owner_seen.add(owner.name)
            if owner.name in registry():
                lines.append(f"# {owner.name} (method = {json.dumps(owner.name)}): its own keys")
            else:
                lines.append(f"# {owner.title} ({', '.join(_owners(owner))})")
        lines.append(f"{key} = {_toml(field.default)}  # {field.description}")
    return "\n".join(lines) + "\n"


def _owners(group: KeyGroup) -> list[str]:
    """The registered methods that own ``group``."""
    return [
        name
        for name, cls in registry().items()
        if any(g.name == group.name for g in cls.key_groups())
    ]


def readme_table() -> str:
    """The configuration reference's run-config table: key, default, allowed values, meaning."""
    rows = [RUN_TABLE_START, "|---|---|---|---|\n"]
    for key, field, owner in _fields():
        meaning = field.description or ""
        if owner is not None:
            meaning = f"({', '.join(f'`{m}`' for m in _owners(owner))}) {meaning}"
        rows.append(
            f"| `{key}` | {_markdown(field.default)} | {allowed(key, field)} | {meaning} |\n"
        )
    return "".join(rows)


def node_table() -> str:
    """The configuration reference's node-config table: key, when it is required, allowed values,
    meaning."""
    rows = [NODE_START, "|---|---|---|---|\n"]
    for name, field in NodeConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        rows.append(
            f"| `{kebab(name)}` | {extra['required']} | {extra['allowed']} | {field.description} "
            "|\n"
        )
    return "".join(rows)


def methods_table() -> str:
    """README's table of methods, from each registered method's ``summary``."""
    rows = [METHODS_START, "|---|---|\n"]
    rows += [f"| `{name}` | {cls.summary} |\n" for name, cls in registry().items()]
    return "".join(rows)


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def layout_section() -> str:
    """README's layout section: each package with the first line of its docstring, and its modules'
    names."""
    lines = [LAYOUT_START, "\n", textwrap.fill(LAYOUT_GUIDE, 110) + "\n", "\n", "```\n"]
    # The names' column is as wide as the longest folder name, so no description runs into its
    # folder's name.
    width = max(len(folder) for folder in PACKAGES) + 2
    indent = " " * width

    def entry(name: str, text: str) -> str:
        return (
            textwrap.fill(
                text,
                118,
                initial_indent=f"{name:<{width}}",
                subsequent_indent=indent,
                break_on_hyphens=False,
            )
            + "\n"
        )

    for folder in PACKAGES:
        lines.append(entry(folder + "/", _first_line(ROOT / folder / "__init__.py")))
        names = [p.stem for p in sorted((ROOT / folder).glob("*.py")) if p.name != "__init__.py"]
        if names:  # not a package of packages
            lines.append(
                textwrap.fill(
                    ", ".join(names), 118, initial_indent=indent, subsequent_indent=indent
                )
                + "\n"
            )
    lines.append(
        entry(
            "docker/",
            "app.Dockerfile (CPU, amd64/arm64; GPU with PyPI's CUDA torch), "
            "app-cuda-nvidia.Dockerfile (GPU on NVIDIA's base), fleet-gateway.conf; "
            "docker-compose.yml runs everything on one host, coordinator.yml the coordinator "
            "alone, node.yml (+ node.gpu.yml) one node machine, compose.arm64.yml adds an arm64 "
            "node",
        )
    )
    lines.append(
        entry(
            "tests/",
            "unit tests (brute force + hypothesis), malformed-reply catalogue, in-process and "
            "multi-process federations, compose topology (each compose service in its own network "
            "namespace), Docker end to end",
        )
    )
    lines.append("```\n")
    return "".join(lines)


def _replace_block(text: str, start: str, block: str, end_marker: str) -> str:
    """``text`` with the block from ``start`` up to the next ``end_marker`` replaced by ``block`` +
    one blank line."""
    i = text.index(start)
    j = text.find(end_marker, i + len(start))
    rest = "" if j < 0 else text[j:].lstrip("\n")
    return text[:i] + block + ("\n" + rest if rest else "")


def expected_files() -> dict[Path, str]:
    """pyproject.toml, README.md and the configuration reference as the code says they should
    read."""
    pyproject = ROOT / "pyproject.toml"
    readme = ROOT / "README.md"
    reference = ROOT / "docs" / "guide" / "configuration.md"
    readme_text = _replace_block(readme.read_text(), METHODS_START, methods_table(), "\n\n")
    readme_text = _replace_block(readme_text, LAYOUT_START, layout_section(), "\n## ")
    reference_text = _replace_block(reference.read_text(), RUN_TABLE_START, readme_table(), "\n\n")
    return {
        pyproject: _replace_block(pyproject.read_text(), MANIFEST_START, manifest_block(), "\n["),
        readme: headline_block(readme_text, ROOT),
        reference: _replace_block(reference_text, NODE_START, node_table(), "\n\n"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``--check`` (default) or ``--write``."""
    ap = argparse.ArgumentParser(prog="fibos docs", description=__doc__)
    ap.add_argument(
        "--write",
        action="store_true",
        help="rewrite the generated parts of the manifest and the docs",
    )
    args = ap.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if path.read_text() != text:
            if args.write:
                path.write_text(text)
                print(f"rewrote {path.name}")
            else:
                stale.append(path.name)
    if stale:
        print(f"out of date with the code: {', '.join(stale)}; run `fibos docs --write`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
