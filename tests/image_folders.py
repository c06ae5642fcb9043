"""Generated node data for the tests: scikit-learn's digits written out as an image folder, a table,
text lines."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import NDArray


def digits_arrays() -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """The 1797 8x8 digits as uint8 grey images in [0, 255], and their labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images * (255.0 / 16.0)).round().astype(np.uint8), bunch.target.astype(np.int64)


def write_image_folder(root: Path, per_class: Mapping[int, int], offset: int = 0) -> Path:
    """``root/<digit>/<i>.png`` with ``per_class[digit]`` images of that digit (from ``offset`` on
    in the data)."""
    from PIL import Image

    images, labels = digits_arrays()
    for digit, count in per_class.items():
        folder = root / str(digit)
        folder.mkdir(parents=True, exist_ok=True)
        idx = np.flatnonzero(labels == digit)[offset : offset + count]
        for i in idx:
            Image.fromarray(images[i], mode="L").save(folder / f"{i}.png")
    return root
