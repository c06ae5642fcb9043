"""The parts of the docs that the code defines, generated from it: config reference, method table, layout.

* ``pyproject.toml``'s ``[tool.flwr.app.config]`` block and README's run-config table, from the schema
  (:mod:`common.config.run`, and each method's options model): a key is declared once, in the schema;
* README's method table, from each registered method's ``summary``;
* README's layout section, from the first line of every module's docstring.

``fibos docs`` (``--check``, the default) fails when a file differs from what the code says; ``fibos docs
--write`` rewrites them. A test runs the check.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from common.config.run import RunConfig, kebab
from common.methods import registry

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_START = "[tool.flwr.app.config]\n"
README_START = "| key | default | allowed | meaning |\n"
METHODS_START = "| `method` | submodel of a client with capacity `gamma` |\n"
LAYOUT_START = "## Layout\n"
#: What each folder holds, above its modules in the layout section.
FOLDERS = {
    "common": "shared by both sides, no Flower: maths on arrays, models, data, configuration, the methods",
    "common/methods": "one module per method (the `method` key) behind one interface, and the registry",
    "client": "the ClientApp and what only a node does",
    "server": "the ServerApp, its strategies, and the operator's local tools",
    "server/strategy_core": "what both strategies are built from: nodes, submodel messages, evaluations, records",
    "server/benchmarks": "benchmarks, analyses and docs generators (not in the Flower app bundle)",
}


def _fields() -> Iterator[tuple[str, FieldInfo, str | None]]:
    """``(key, field, owning method)`` for every run-config key, common keys first, then each method's."""
    for name, field in RunConfig.model_fields.items():
        if name != "method_options":
            yield kebab(name), field, None
    for method in registry().values():
        if method.options is not None:
            for name, field in method.options.model_fields.items():
                yield method.options_prefix + kebab(name), field, method.name


def _bound(field: FieldInfo, attr: str) -> float | None:
    return next((getattr(m, attr) for m in field.metadata if getattr(m, attr, None) is not None), None)


def allowed(key: str, field: FieldInfo) -> str:
    """What a key accepts, in the README's words (from the field's type and bounds)."""
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
        if owner is not None and owner not in owner_seen:
            owner_seen.add(owner)
            lines.append(f"# {owner} (method = {json.dumps(owner)}): its own keys")
        lines.append(f"{key} = {_toml(field.default)}  # {field.description}")
    return "\n".join(lines) + "\n"


def readme_table() -> str:
    """The README's run-config table: key, default, allowed values, meaning."""
    rows = [README_START, "|---|---|---|---|\n"]
    for key, field, owner in _fields():
        meaning = field.description or ""
        if owner is not None:
            meaning = f"(`{owner}`) {meaning}"
        rows.append(f"| `{key}` | {_markdown(field.default)} | {allowed(key, field)} | {meaning} |\n")
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
    """README's layout section: every module of the app packages with the first line of its docstring."""
    lines = [LAYOUT_START, "\n", "```\n"]
    for folder, what in FOLDERS.items():
        lines.append(f"{folder}/  {what}\n")
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name != "__init__.py":
                lines.append(f"    {path.name:<26}{_first_line(path)}\n")
    lines.append(
        "docker/  app.Dockerfile (CPU, amd64/arm64), app-cuda.Dockerfile (NVIDIA), fleet-gateway.conf (nginx)\n"
    )
    lines.append(
        "tests/   unit tests (brute force + hypothesis), malformed-reply catalogue, in-process and multi-process\n"
    )
    lines.append("         federations, compose topology (every compose service in its own network namespace)\n")
    lines.append("```\n")
    return "".join(lines)


def _replace_block(text: str, start: str, block: str, end_marker: str) -> str:
    """``text`` with the block from ``start`` up to the next ``end_marker`` replaced by ``block`` + one blank line."""
    i = text.index(start)
    j = text.find(end_marker, i + len(start))
    rest = "" if j < 0 else text[j:].lstrip("\n")
    return text[:i] + block + ("\n" + rest if rest else "")


def expected_files() -> dict[Path, str]:
    """pyproject.toml and README.md as the schema says they should read."""
    pyproject = ROOT / "pyproject.toml"
    readme = ROOT / "README.md"
    return {
        pyproject: _replace_block(pyproject.read_text(), MANIFEST_START, manifest_block(), "\n["),
        readme: _replace_block(
            _replace_block(
                _replace_block(readme.read_text(), README_START, readme_table(), "\n\n"),
                METHODS_START,
                methods_table(),
                "\n\n",
            ),
            LAYOUT_START,
            layout_section(),
            "\n## ",
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``--check`` (default) or ``--write``."""
    ap = argparse.ArgumentParser(prog="fibos docs", description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite pyproject.toml and README.md from the code")
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
