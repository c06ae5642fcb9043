"""Flat parameter layout: one index space over a model's trainable tensors.

Masks, Fisher vectors, updates and wire payloads all refer to positions in this
flat space, so the server (which holds every value) and a client (which holds
only its submodel) agree on what position ``j`` means without sending names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the layout.

    Parameters
    ----------
    name : str
        The tensor's name in the model's ``state_dict``.
    shape : tuple[int, ...]
        The tensor's shape.
    """

    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of scalar entries."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def rows(self) -> int:
        """Output units: the first dimension for >=2-D tensors, one row otherwise."""
        return int(self.shape[0]) if len(self.shape) >= 2 else 1


@dataclass(frozen=True)
class ParamLayout:
    """Ordered trainable tensors of a model and their offsets in the flat vector.

    Parameters
    ----------
    tensors : tuple[TensorSpec, ...]
        Trainable tensors in canonical (``state_dict``) order.
    inert : frozenset[str]
        Names of tensors that cannot learn (e.g. a bias that feeds a BatchNorm, whose gradient is
        always zero): Fisher-ranked submodels never spend budget on them
        (:func:`common.models.inert.inert_parameters`).
    """

    tensors: tuple[TensorSpec, ...]
    inert: frozenset[str] = frozenset()

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, NDArray], inert: frozenset[str] = frozenset()
    ) -> ParamLayout:
        """Build a layout from named arrays, keeping their order (``inert``: tensors that cannot
        learn)."""
        unknown = inert - set(arrays)
        if unknown:
            raise ValueError(f"inert tensors {sorted(unknown)} are not among the arrays")
        return cls(
            tuple(TensorSpec(n, tuple(int(s) for s in a.shape)) for n, a in arrays.items()),
            frozenset(inert),
        )

    @property
    def names(self) -> list[str]:
        """Tensor names in order."""
        return [t.name for t in self.tensors]

    @cached_property
    def offsets(self) -> NDArray[np.int64]:
        """Start offset of each tensor; the last entry is the total size ``d``."""
        return np.concatenate([[0], np.cumsum([t.size for t in self.tensors])]).astype(np.int64)

    @property
    def size(self) -> int:
        """Total number of trainable scalars ``d``."""
        return int(self.offsets[-1])

    @cached_property
    def row_ids(self) -> NDArray[np.int64]:
        """Global row (output unit) id of every flat position, length ``d``."""
        parts = []
        base = 0
        for t in self.tensors:
            per_row = t.size // t.rows
            parts.append(base + np.repeat(np.arange(t.rows, dtype=np.int64), per_row))
            base += t.rows
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        """Total number of rows over all tensors."""
        return int(sum(t.rows for t in self.tensors))

    @cached_property
    def always_kept(self) -> NDArray[np.bool_]:
        """Positions of 1-D tensors (biases, norm scales), which every submodel keeps."""
        keep = np.zeros(self.size, dtype=bool)
        for t, start in zip(self.tensors, self.offsets[:-1]):
            if len(t.shape) < 2:
                keep[start : start + t.size] = True
        return keep

    @cached_property
    def inert_mask(self) -> NDArray[np.bool_]:
        """Positions of the :attr:`inert` tensors (they cannot learn)."""
        out = np.zeros(self.size, dtype=bool)
        for t, start in zip(self.tensors, self.offsets[:-1]):
            if t.name in self.inert:
                out[start : start + t.size] = True
        return out

    def count_per_tensor(self, mask: NDArray[np.bool_]) -> dict[str, int]:
        """Positions of ``mask`` (length ``d``) in each tensor, by name."""
        if mask.shape != (self.size,):
            raise ValueError(f"mask has shape {mask.shape}, expected ({self.size},)")
        bounds = self.offsets.tolist()
        return {
            t.name: int(np.count_nonzero(mask[a:b]))
            for t, a, b in zip(self.tensors, bounds[:-1], bounds[1:])
        }

    def flatten(self, arrays: Mapping[str, NDArray]) -> NDArray[np.float32]:
        """Concatenate named arrays into one float32 vector in layout order.

        Raises ``ValueError`` naming the tensor when one is missing or misshapen.
        """
        out = np.empty(self.size, dtype=np.float32)
        for t, start in zip(self.tensors, self.offsets[:-1]):
            if t.name not in arrays:
                raise ValueError(f"missing tensor {t.name!r}")
            a = np.asarray(arrays[t.name])
            if tuple(a.shape) != t.shape:
                raise ValueError(
                    f"tensor {t.name!r} has shape {tuple(a.shape)}, expected {t.shape}"
                )
            out[start : start + t.size] = a.reshape(-1)
        return out

    def unflatten(self, flat: NDArray) -> dict[str, NDArray]:
        """Split a flat vector of length ``d`` back into named arrays (views)."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat vector has shape {flat.shape}, expected ({self.size},)")
        return {
            t.name: flat[start : start + t.size].reshape(t.shape)
            for t, start in zip(self.tensors, self.offsets[:-1])
        }
