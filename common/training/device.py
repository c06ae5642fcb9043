"""Choose the torch device a client trains on."""

from __future__ import annotations

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """The device to train on.

    Parameters
    ----------
    preference : {"auto", "cpu", "cuda", "mps"}
        ``auto`` takes CUDA, then Apple MPS, then the CPU. A fixed choice that
        this machine lacks raises ``RuntimeError`` instead of silently using another.
    """
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if preference == "auto":
        return torch.device("cuda" if cuda else "mps" if mps else "cpu")
    if preference == "cuda" and not cuda:
        raise RuntimeError("node-config device=cuda but no CUDA device is available")
    if preference == "mps" and not mps:
        raise RuntimeError("node-config device=mps but Apple MPS is not available")
    if preference not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={preference!r}: allowed values are auto, cpu, cuda, mps")
    return torch.device(preference)
