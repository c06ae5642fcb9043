"""The base of every configuration model, and the error a bad value raises.

Kept apart from :mod:`common.config.run` so that method modules (:mod:`common.methods`) can declare
their own options models without importing the run configuration, which looks methods up in the
registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the allowed range."""


def kebab(name: str) -> str:
    """``fisher_ema`` -> ``fisher-ema``: the spelling of a key in the run config."""
    return name.replace("_", "-")


class Schema(BaseModel):
    """Base of every configuration model: strict types, kebab-case keys, no unknown keys, immutable.

    Strict: a string is never read as a number, a boolean never as an integer, and ``2.5`` is no
    round count; ``NaN`` and infinities are refused.
    """

    model_config = ConfigDict(
        alias_generator=kebab,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        validate_default=False,
    )


@dataclass(frozen=True)
class KeyGroup:
    """Run-config keys that one or more methods own: an options model whose keys carry a common
    prefix.

    Parameters
    ----------
    name : str
        The group's name: ``RunConfig.options(name)`` returns its validated options (a method's own
        group is named after the method).
    prefix : str
        Prefix of every key of the group in the run config (``gmr-``, ``fisher-``; ``""``: none).
    model : type[Schema]
        The options model; a field ``fisher_ema`` is the key ``<prefix>fisher-ema``.
    title : str
        Heading of the group in the README's configuration reference.
    """

    name: str
    prefix: str
    model: type[Schema]
    title: str

    def keys(self) -> list[str]:
        """The group's run-config keys, prefix included (kebab case)."""
        return [self.prefix + (f.alias or kebab(n)) for n, f in self.model.model_fields.items()]
