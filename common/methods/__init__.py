"""One module per method behind one interface, and the registry the method key selects from.

Adding a method is a new module here with a :class:`~common.methods.base.Method` subclass decorated with
:func:`register`, and one import line below; nothing else in the product changes (README,
"Adding a method").
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.methods.base import Method

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` selectable as ``method = cls.name``."""
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


# The built-in methods, imported (and so registered) in the order the README's table lists them.
BUILTIN = ("fedfibos", "fiarse", "heterofl", "fedrolex", "fedavg", "fedavg_drop", "fedgmr", "cahfp", "lora")
for _module in BUILTIN:
    import_module(f"{__name__}.{_module}")
