"""Parsing a whole run configuration: the common keys and every key group the registered methods
own.

The one place that needs the method registry: :mod:`common.config.run` (the common keys) stays free
of it. The registry holds the methods' specs (:mod:`common.methods.specs`), so parsing imports no
torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from common.config.run import RunConfig, common_keys, describe_error
from common.config.schema import ConfigError, KeyGroup, kebab
from common.methods import method_spec, registry

#: Keys that were merged into or renamed to another: refused with the new name, so that an old
#: setting is never silently ignored.
RENAMED_KEYS: dict[str, str] = {
    "heterofl-clip-grad": "clip-grad-norm",
    "fedrolex-clip-grad": "clip-grad-norm",
    "heterofl-label-mask": "label-mask",
    "fedrolex-label-mask": "label-mask",
    "gmr-server-lr": "server-lr",
    "gmr-capacity-kind": "capacity-kind",
    **{
        f"{m}-{k}": f"width-{k}"
        for m in ("heterofl", "fedrolex")
        for k in ("scaler", "scaler-linear", "label-split")
    },
    "heterofl-weighting": "width-weighting",
    "fedrolex-weighting": "width-weighting",
    "fedrolex-roll": "width-roll",
}


def key_groups() -> dict[str, KeyGroup]:
    """Every key group of the registered methods by name, in registration order (a shared group
    once)."""
    groups: dict[str, KeyGroup] = {}
    for cls in registry().values():
        for group in cls.key_groups():
            groups.setdefault(group.name, group)
    return groups


def run_config_keys() -> set[str]:
    """Every run-config key: the common ones and every key group's, with its prefix."""
    return common_keys() | {k for group in key_groups().values() for k in group.keys()}


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate a run configuration (e.g. ``context.run_config``).

    Unknown keys are rejected, so a typo never silently falls back to a default. The keys of every
    registered method's groups are validated (Flower passes the manifest's defaults for all of
    them), whichever method is selected; then the selected method's own rules across keys
    (:meth:`~common.methods.contract.spec.MethodSpec.check_run`).
    """
    groups = key_groups()
    owner_of = {key: name for name, group in groups.items() for key in group.keys()}
    common = common_keys()
    values: dict[str, dict[str, Any]] = {name: {} for name in groups}
    unknown = []
    renamed = sorted(k for k in raw if k in RENAMED_KEYS)
    if renamed:
        raise ConfigError(
            "; ".join(
                f"{k} is now {RENAMED_KEYS[k]}: set {RENAMED_KEYS[k]} instead" for k in renamed
            )
        )
    for key, value in raw.items():
        if key in common:
            continue
        owner = owner_of.get(key)
        if owner is None:
            unknown.append(key)
        else:
            values[owner][key.removeprefix(groups[owner].prefix)] = value
    if unknown:
        raise ConfigError(
            f"unknown run-config key(s) {sorted(unknown)}; known keys: {sorted(run_config_keys())}"
        )
    options = {}
    for name, group in groups.items():
        try:
            options[name] = group.model.model_validate(values[name])
        except ValidationError as err:
            raise ConfigError(describe_error(err, raw, group.prefix)) from None
    prefixes = {name: group.prefix for name, group in groups.items()}
    try:
        run = RunConfig.model_validate(
            {k: v for k, v in raw.items() if k in common}
            | {"method_options": options, "option_prefixes": prefixes}
        )
    except ValidationError as err:
        raise ConfigError(describe_error(err, raw)) from None
    if run.method not in registry():
        raise ConfigError(f"method={run.method!r}: allowed values are {', '.join(registry())}")
    cls = method_spec(run.method)
    auto = {k: v for k, v in cls.auto_settings(run).items() if getattr(run, k) == "auto"}
    run = run.model_copy(update=auto)
    try:
        cls.check_run(run)
        cls.check_safeguards(run)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return run


def config_from_flat(flat: Mapping[str, Any]) -> RunConfig:
    """The run configuration behind a :meth:`RunConfig.flat` dict (e.g. the settings in a
    metrics.json).

    Entries that are not run-config keys (``d``, ``upload_encoding``, ...) are ignored.
    """
    known = run_config_keys()
    return parse_run_config({kebab(k): v for k, v in flat.items() if kebab(k) in known})


def default_run_config() -> RunConfig:
    """The run configuration with every key at its default."""
    return parse_run_config({})
