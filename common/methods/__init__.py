"""One module per method behind one interface, and the registry the method key selects from.

Adding a method is a new module here with a :class:`~common.methods.base.Method` subclass that sets
``name``, and its module's name in :data:`BUILTIN`; nothing else in the product changes (README, "Adding a
method"). :func:`register` is the same registration for a method defined elsewhere (a test, a plug-in).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.methods.base import Method

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Make ``cls`` selectable as ``method = cls.name`` (the built-in methods: by :data:`BUILTIN`)."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a method from the registry (tests that define their own)."""
    _REGISTRY.pop(name, None)


def registry() -> Mapping[str, type[Method]]:
    """Every registered method by name, in registration order (read-only view)."""
    return MappingProxyType(_REGISTRY)


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``; ``KeyError`` listing the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; registered: {', '.join(_REGISTRY)}") from None


def create_method(run: RunConfig) -> Method:
    """An instance of the run's method."""
    return method_class(run.method)(run)


#: The built-in methods' modules, in the order the README's table lists them. Each module's own
#: :class:`~common.methods.base.Method` subclasses that set ``name`` are registered (a base class a module
#: imports, or one without a name, is not).
BUILTIN = ("fedfibos", "fiarse", "heterofl", "fedrolex", "fedavg", "fedavg_drop", "fedgmr", "cahfp", "lora")


def _register_module(module: ModuleType) -> None:
    from common.methods.base import Method

    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Method) and value.__module__ == module.__name__ and value.name:
            register(value)


for _module in BUILTIN:
    _register_module(import_module(f"{__name__}.{_module}"))
