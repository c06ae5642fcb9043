"""Where a pretrained model's ``model-path`` points: a local folder or a hub id, checked without
loading anything.

Kept apart from :mod:`common.models.hf` so that the launcher refuses a bad path before importing
torch.
"""

from __future__ import annotations

import os

from common.config.schema import ConfigError


def _looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a folder (a hub id is ``name`` or ``org/name``)."""
    return (
        path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
    )


def resolve_model_path(path: str) -> str:
    """The folder or hub id to load, or a :class:`ConfigError` naming ``model-path``.

    Parameters
    ----------
    path : str
        The run's ``model-path``.
    """
    if not path:
        raise ConfigError("model-path is empty: model='hf' needs a local model folder or a hub id")
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ConfigError(f"model-path={path!r}: the folder holds no model (no config.json)")
        return local
    if os.path.exists(local) or _looks_local(path):
        raise ConfigError(f"model-path={path!r}: no such model folder")
    return path
