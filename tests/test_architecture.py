"""The package structure: neither side imports the other, common imports neither, the apps import no
operator tool or benchmark, no import cycle, and no function on the app path over sixty lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "client", "common", "cli", "benchmarks")
APP_PACKAGES = ("server", "client", "common")  # what the FAB carries


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, modules: set[str], type_only: bool = False) -> set[str]:
    """Project modules imported anywhere in ``tree`` (functions included); under ``if
    TYPE_CHECKING`` too with ``type_only``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules}


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {
        name: _imports(ast.parse(path.read_text()), modules, type_only) - {name}
        for name, path in files.items()
    }


def test_server_and_client_do_not_import_each_other_and_common_imports_neither():
    graph = _graph()
    assert len(graph) > 50
    bad = [
        f"{src} -> {dst}"
        for src, targets in graph.items()
        for dst in targets
        if (src.split(".")[0], dst.split(".")[0]) in {("server", "client"), ("client", "server")}
        or (src.startswith("common") and not dst.startswith("common"))
    ]
    assert bad == []


def test_the_apps_import_no_operator_tool_and_no_benchmark():
    graph = _graph(type_only=True)
    bad = [
        f"{src} -> {dst}"
        for src, targets in graph.items()
        for dst in targets
        if src.split(".")[0] in APP_PACKAGES and dst.split(".")[0] not in APP_PACKAGES
    ]
    assert bad == []


def test_fab_include_is_globs_over_the_app_packages():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "fab-include"
    ]
    assert sorted(include) == sorted(f"{pkg}/**/*.py" for pkg in APP_PACKAGES)


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time", "type-only-included"])
def test_no_import_cycle(type_only):
    graph = _graph(type_only)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            walk(start, [start])
    assert cycles == []


def test_the_cycle_check_sees_function_level_imports():
    tree = ast.parse("def f():\n    from common.data.datasets import load_dataset\n")
    assert _imports(tree, {"common.data.datasets"}) == {"common.data.datasets"}
    guarded = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import common.config.run\n"
    )
    assert _imports(guarded, {"common.config.run"}) == set()


def test_the_fab_holds_exactly_what_the_server_and_client_apps_import():
    """Flower's own FAB builder, on this checkout: the apps' import closure, and no operator
    tool."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    graph = _graph()
    needed, todo = set(), ["server.app", "client.app"]
    while todo:
        mod = todo.pop()
        if mod not in needed:
            needed.add(mod)
            todo.extend(graph[mod])
    # A package's __init__ runs before any of its modules; the methods package imports its modules
    # dynamically.
    needed |= {m.rsplit(".", 1)[0] for m in needed if "." in m}
    needed |= {m for m in graph if m.startswith("common.methods.")}
    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    included = {_module_name(ROOT / n) for n in names if n.endswith(".py")}
    assert needed - included == set(), "the apps import modules the FAB lacks"
    assert {m for m in included - needed if not m.startswith("common")} == set(), (
        "operator tools in the FAB"
    )


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {}
    for pkg in PACKAGES:
        for folder in [
            ROOT / pkg,
            *(p for p in (ROOT / pkg).rglob("*") if p.is_dir() and p.name != "__pycache__"),
        ]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > 15:
                crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert crowded == {}


#: The longest a function on the app path may be, in lines (docstring included).
MAX_FUNCTION_LINES = 60
#: The longest the synchronous strategy's class may be, in lines.
MAX_STRATEGY_LINES = 300


def _functions_over(limit: int) -> dict[str, int]:
    """``module:function`` -> lines, for every function of the app packages longer than ``limit``
    lines."""
    long = {}
    for pkg in APP_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        long[f"{_module_name(path)}:{node.name}"] = lines
    return long


def test_no_function_on_the_app_path_is_over_sixty_lines():
    assert _functions_over(MAX_FUNCTION_LINES) == {}


def test_the_function_length_rule_sees_a_long_function():
    assert all(lines > 10 for lines in _functions_over(10).values()) and _functions_over(10)


def test_the_synchronous_strategy_is_at_most_three_hundred_lines():
    tree = ast.parse((ROOT / "server" / "strategy.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SubmodelStrategy"]
    assert cls.end_lineno - cls.lineno + 1 <= MAX_STRATEGY_LINES


def test_the_shared_layers_hold_nothing_method_specific():
    """The wire format, the training loop and the config schema import no method and no submodel
    rule."""
    graph = _graph(type_only=True)
    shared = [m for m in graph if m.startswith(("common.wire", "common.training", "common.config"))]
    bad = {
        m: sorted(d for d in graph[m] if d.startswith(("common.methods", "common.submodels")))
        for m in shared
        if m != "common.config.parse"  # parsing needs the registry (and only the registry)
    }
    assert {m: d for m, d in bad.items() if d} == {}
    assert {d for d in graph["common.config.parse"] if d.startswith("common.methods")} == {
        "common.methods"
    }


def test_the_config_schema_loads_neither_torch_nor_the_methods():
    code = (
        "import sys, common.config.run, common.config.node;"
        "from common.config.run import RunConfig; RunConfig.model_validate({'lr': 0.05});"
        "print(sorted(m for m in ('torch', 'numpy', 'common.methods', 'flwr') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_every_method_spec_loads_without_torch_and_names_an_implementation_of_its_name():
    code = (
        "import sys; from common.methods import registry;"
        "print(len(registry()), sorted(m for m in ('torch', 'common.methods.contract.method') if m "
        "in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split(" ", 1)[1].strip() == "[]"
    from common.methods import method_class, registry

    assert int(out.stdout.split(" ", 1)[0]) == len(registry())
    for name, spec in registry().items():
        cls = method_class(name)
        assert cls.is_implementation and issubclass(cls, spec) and cls.name == name, name


def _method_attributes(package: str) -> dict[str, set[str]]:
    """Attributes read from a method object in ``package``: ``method.x``, ``self.method.x``,
    ``s.method.x`` (names and attributes called ``method``), keyed as ``path:line``."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            named = (isinstance(holder, ast.Name) and holder.id == "method") or (
                isinstance(holder, ast.Attribute) and holder.attr == "method"
            )
            if named:
                found.setdefault(node.attr, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


@pytest.mark.parametrize(
    ("package", "side", "other"),
    [
        ("server", "common.methods.contract.server_side:ServerMethod", "client"),
        ("client", "common.methods.contract.client_side:ClientMethod", "server"),
    ],
)
def test_each_app_calls_only_its_own_side_of_a_method(package: str, side: str, other: str) -> None:
    from importlib import import_module

    module, _, name = side.partition(":")
    contract = getattr(import_module(module), name)
    used = _method_attributes(package)
    outside = {attr: sorted(where) for attr, where in used.items() if not hasattr(contract, attr)}
    assert outside == {}, f"{package}/ reads these from a method, outside {name}"
    assert used, f"the scan found no method attribute in {package}/"


def test_the_two_sides_of_a_method_share_only_the_core_and_stay_small() -> None:
    from common.methods.contract.client_side import ClientMethod
    from common.methods.contract.core import MethodCore
    from common.methods.contract.server_side import ServerMethod

    def own(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n, None))}

    server, client = own(ServerMethod), own(ClientMethod)
    assert server & client == set()
    assert not any(hasattr(ServerMethod, n) for n in client)
    assert not any(hasattr(ClientMethod, n) for n in server)
    assert len(client) <= 10 and len(server) <= 20, (sorted(client), sorted(server))
    assert issubclass(ServerMethod, MethodCore) and issubclass(ClientMethod, MethodCore)


def test_one_spec_module_per_method_named_as_its_implementation_module() -> None:
    from common.methods import BUILTIN, method_class, registry

    spec_modules: dict[str, str] = {}
    for name, spec in registry().items():
        if not spec.__module__.startswith("common.methods.specs."):
            continue  # a method a test registered
        module = spec.__module__.rsplit(".", 1)[1]
        assert module not in spec_modules, (name, spec_modules.get(module))
        spec_modules[module] = name
        assert method_class(name).__module__ == f"common.methods.{module}", name
    assert sorted(spec_modules) == sorted(BUILTIN)
