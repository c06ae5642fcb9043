"""``key=value`` run-config settings as typed on a command line (``-c``), read as TOML values.

Kept free of the launcher, so that every command that takes such settings (the server's and the
node's) reads them one way.
"""

from __future__ import annotations

import shlex
import tomllib
from collections.abc import Sequence


def parse_overrides(text: str | Sequence[str]) -> dict[str, object]:
    """``"lr=0.1 partitioner='dirichlet'"`` -> ``{"lr": 0.1, "partitioner": "dirichlet"}`` (TOML
    values).

    A sequence is the values of a repeated ``-c`` flag, merged in order (a later key wins), as
    ``flwr run -c`` does. A pair without ``=`` exits (``SystemExit``) with a message naming it.
    """
    out: dict[str, object] = {}
    for pair in (
        p for item in ([text] if isinstance(text, str) else text) for p in shlex.split(item)
    ):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(
                f"error: run-config override {pair!r} is not key=value (e.g. -c lr=0.1)"
            )
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out
