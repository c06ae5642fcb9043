"""One module per method behind three contracts, and the registry the method key selects from.

A method ``m`` is two modules of the same name: its spec, ``common/methods/specs/m.py`` (name,
run-config keys, rules across keys; no torch: :class:`~common.methods.contract.spec.MethodSpec`),
and its implementation, ``common/methods/m.py`` (a :class:`~common.methods.contract.method.Method`
that subclasses the spec). The implementation answers two contracts, one per side of the wire: the
server holds it as a :class:`~common.methods.contract.server_side.ServerMethod` (masks, validation,
the fold of replies, state), the ClientApp as a
:class:`~common.methods.contract.client_side.ClientMethod` (train, evaluate, adapt). The registry
holds specs, so a run configuration is checked without importing any training code; the
implementation is imported when a run builds the method (:func:`method_class`).

Adding a method is a spec module in :mod:`common.methods.specs` whose class names its
implementation, the implementation module here, and the spec module's name in :data:`BUILTIN`;
nothing else in the product changes (docs/guide/adding-a-method.md). :func:`register` is the same
registration for a method defined elsewhere (a test, a plug-in), spec or implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING

from common.methods.contract.spec import MethodSpec

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.methods.contract.method import Method

_REGISTRY: dict[str, type[MethodSpec]] = {}


def register(cls: type[MethodSpec]) -> type[MethodSpec]:
    """Make ``cls`` selectable as ``method = cls.name``: a spec, or an implementation (its own
    spec)."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(
            f"method {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}"
        )
    if not cls.is_implementation and ":" not in cls.implementation:
        raise ValueError(
            f"{cls.__qualname__}.implementation must be 'module:Class', not {cls.implementation!r}"
        )
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a method from the registry (tests that define their own)."""
    _REGISTRY.pop(name, None)


def registry() -> Mapping[str, type[MethodSpec]]:
    """Every registered method's spec by name, in registration order (read-only view)."""
    return MappingProxyType(_REGISTRY)


def method_spec(name: str) -> type[MethodSpec]:
    """The spec registered as ``name`` (imports no training code); ``KeyError`` listing the known
    names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; registered: {', '.join(_REGISTRY)}") from None


def method_class(name: str) -> type[Method]:
    """The implementation of the method registered as ``name``, imported on first use."""
    spec = method_spec(name)
    if spec.is_implementation:
        return spec  # type: ignore[return-value]
    module, _, attr = spec.implementation.partition(":")
    cls = getattr(import_module(module), attr)
    if cls.name != name:
        raise TypeError(
            f"{spec.implementation} is method {cls.name!r}, but its spec registers {name!r}"
        )
    return cls


def create_method(run: RunConfig) -> Method:
    """An instance of the run's method."""
    return method_class(run.method)(run)


#: The built-in methods' spec modules (in :mod:`common.methods.specs`), in the order the README's
#: table lists them. Each module's own :class:`~common.methods.contract.spec.MethodSpec` subclasses
#: that set ``name`` are registered (a base class a module imports, or one without a name, is not).
BUILTIN = (
    "fedfibos",
    "fiarse",
    "heterofl",
    "fedrolex",
    "fedavg",
    "fedavg_drop",
    "fedgmr",
    "cahfp",
    "lora",
)


def _register_module(module: ModuleType) -> None:
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, MethodSpec)
            and value.__module__ == module.__name__
            and value.name
        ):
            register(value)


for _module in BUILTIN:
    _register_module(import_module(f"{__name__}.specs.{_module}"))
