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
        raise RuntimeError(
            f"node-config device=cuda but torch sees no CUDA device: {cuda_absence()}"
        )
    if preference == "mps" and not mps:
        raise RuntimeError("node-config device=mps but Apple MPS is not available")
    if preference not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={preference!r}: allowed values are auto, cpu, cuda, mps")
    return torch.device(preference)


def cuda_absence() -> str:
    """Why torch sees no CUDA device, and what to do: a CPU-only torch build, or a build with no GPU
    visible."""
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build "
            "(PyPI's Linux x86_64 wheel, or the GPU image fibos-fl/app:cuda)"
        )
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU; check "
        "the driver (nvidia-smi) and, in a container, the NVIDIA Container Toolkit and the GPU "
        "reservation (docker/node.gpu.yml), or set device=cpu"
    )
