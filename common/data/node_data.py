"""A node's own data: a folder on the node's machine, read into the arrays the training loop takes.

The layouts users already have are read with the libraries that define them:

* an **image folder**, one sub-folder per class (torchvision's ``ImageFolder`` layout:
  ``root/cat/001.png``);
* a Hugging Face **``save_to_disk``** folder (a ``Dataset`` or a ``DatasetDict``);
* **Parquet or CSV** files (a file, or a folder of them; files named ``test*`` are the local test
  split), with a label column and an image or text column (an image column may also hold file paths,
  relative to the table);
* **text lines**: ``.txt`` / ``.tsv`` files of ``label<TAB>text`` per line.

Labels are matched by class name against the run's classes (``classes``), which fixes every class's
index for the whole federation: a node whose labels fall outside them, or whose data carries a
different name-to-index mapping (a ``ClassLabel`` feature), cannot take part
(:class:`NodeDataError`). Examples that cannot be read (a corrupt image, a row without a label, an
empty text) are skipped and counted in the :class:`NodeDataReport`, never dropped silently. Images
pass through one transform, :func:`image_to_input`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset

#: Texts -> token ids ``(n, length)`` (the run's text encoder).
TextEncoder = Callable[[Sequence[str]], NDArray[np.int64]]

IMAGE_COLUMNS: tuple[str, ...] = ("image", "img")
TEXT_COLUMNS: tuple[str, ...] = ("text", "sentence", "content")
TABLE_SUFFIXES: dict[str, str] = {".parquet": "parquet", ".csv": "csv"}
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".tsv")


class NodeDataError(ValueError):
    """The node's data cannot take part in the run; the message names the folder or file and why."""


@dataclass(frozen=True)
class InputSpec:
    """How an example becomes model input.

    Parameters
    ----------
    kind : {"image", "text"}
        Images for the image models, texts for the text models.
    image_size : int
        Images are resized to ``image_size`` x ``image_size`` pixels.
    image_channels : int
        1 (grey) or 3 (RGB).
    encode : TextEncoder, optional
        Texts -> token ids (the run's tokenizer); required for ``kind = "text"``.
    """

    kind: Literal["image", "text"]
    image_size: int = 28
    image_channels: int = 1
    encode: TextEncoder | None = None


@dataclass(frozen=True)
class NodeDataReport:
    """What reading the node's data found, for the node's log and the server's ``metrics.json``.

    Parameters
    ----------
    layout : str
        ``image-folder``, ``hf-saved``, ``table`` or ``text-lines``.
    examples : int
        Examples read (train and test together).
    skipped : dict[str, int]
        Examples left out, by reason (``unreadable image``, ``no label``, ...).
    held_classes : tuple[str, ...]
        The run's classes this node holds at least one example of.
    notes : tuple[str, ...]
        Other findings worth an operator's eye (an empty class folder, files that are not images).
    """

    layout: str
    examples: int
    skipped: dict[str, int] = field(default_factory=dict)
    held_classes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeDataReport:
        """The report behind ``dataclasses.asdict(report)`` (e.g. read back from JSON)."""
        return cls(
            d["layout"],
            int(d["examples"]),
            dict(d["skipped"]),
            tuple(d["held_classes"]),
            tuple(d["notes"]),
        )

    def summary(self) -> str:
        """One line: layout, examples, classes held, and every skip and note."""
        parts = [f"{self.layout}: {self.examples} examples of {len(self.held_classes)} classes"]
        parts += [f"skipped {n} ({reason})" for reason, n in sorted(self.skipped.items())]
        parts += list(self.notes)
        return "; ".join(parts)


@dataclass(frozen=True)
class NodeData:
    """A node's examples as arrays: its training part and, when the data names one, its own test
    part."""

    train: ArrayDataset
    test: ArrayDataset | None
    report: NodeDataReport


def image_to_input(image: Any, size: int, channels: int) -> NDArray[np.uint8]:
    """The one image transform: a PIL image -> uint8 ``(channels, size, size)``.

    Grey (``L``) or RGB as the run's ``image-channels`` says, resized (bilinear) to the run's
    ``image-size``. Pixel values stay in [0, 255]; training scales uint8 inputs to [0, 1] per batch,
    as it does for the built-in data.
    """
    from PIL import Image

    img = image.convert("RGB" if channels == 3 else "L")
    if img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.uint8)
    return arr.transpose(2, 0, 1).copy() if arr.ndim == 3 else arr[None].copy()


class LabelSpace:
    """The run's classes, and the rules that map a node's labels into them.

    Parameters
    ----------
    classes : Sequence[str]
        Class names; a class's index is its position.
    """

    def __init__(self, classes: Sequence[str]) -> None:
        self.classes = tuple(classes)
        self.index = {name: i for i, name in enumerate(self.classes)}

    def check_names(self, names: Iterable[str], where: str) -> None:
        """Refuse names that are not classes of the run."""
        outside = sorted({str(n) for n in names} - set(self.index))
        if outside:
            raise NodeDataError(
                f"{where}: label(s) {outside[:10]}{' ...' if len(outside) > 10 else ''} are not "
                f"among the run's classes {list(self.classes)}; this node is left out (nothing of "
                "its data leaves it)"
            )

    def check_mapping(self, names: Sequence[str], where: str) -> None:
        """Refuse a name-to-index mapping (e.g. a ``ClassLabel`` feature) that differs from the
        run's."""
        self.check_names(names, where)
        moved = [(n, i, self.index[n]) for i, n in enumerate(names) if self.index[n] != i]
        if moved:
            shown = ", ".join(f"{n!r} is {i} here but {j} in the run" for n, i, j in moved[:5])
            raise NodeDataError(
                f"{where}: the data's class mapping differs from the run's ({shown}); relabel the "
                "data or list the run's classes in the data's order"
            )

    def indices(
        self, labels: Sequence[Any], where: str, names: Sequence[str] | None = None
    ) -> NDArray[np.int64]:
        """Labels -> class indices; ``-1`` for a missing label (``None``, NaN, empty).

        ``names``: the data's own index-to-name mapping (a ``ClassLabel``), checked against the
        run's. Without it, whole numbers are class indices and anything else a class name.
        """
        if names is not None:
            self.check_mapping(names, where)
        out = np.full(len(labels), -1, dtype=np.int64)
        unknown: set[str] = set()
        for i, label in enumerate(labels):
            if _missing(label):
                continue
            if isinstance(label, (int, np.integer)) or (
                isinstance(label, float) and label.is_integer()
            ):
                k = int(label)
                if not 0 <= k < len(self.classes):
                    unknown.add(str(k))
                out[i] = k
            else:
                name = str(label).strip()
                if name not in self.index:
                    unknown.add(name)
                    continue
                out[i] = self.index[name]
        if unknown:
            self.check_names(unknown, where)
        return out


def _missing(label: Any) -> bool:
    return (
        label is None
        or (isinstance(label, float) and math.isnan(label))
        or (isinstance(label, str) and not label.strip())
    )


class _Collector:
    """Examples gathered one by one, with the skips counted by reason."""

    def __init__(self) -> None:
        self.inputs: list[Any] = []
        self.labels: list[int] = []
        self.skipped: Counter[str] = Counter()

    def add(self, x: Any, label: int) -> None:
        self.inputs.append(x)
        self.labels.append(label)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1


def _to_dataset(c: _Collector, spec: InputSpec, num_classes: int) -> ArrayDataset:
    y = np.asarray(c.labels, dtype=np.int64)
    if spec.kind == "text":
        assert spec.encode is not None
        x = spec.encode(list(c.inputs)) if c.inputs else np.zeros((0, 1), np.int64)
    else:
        shape = (spec.image_channels, spec.image_size, spec.image_size)
        x = np.stack(c.inputs) if c.inputs else np.zeros((0, *shape), np.uint8)
    return ArrayDataset(x, y, num_classes)


def read_node_data(
    path: str | Path,
    classes: Sequence[str],
    spec: InputSpec,
    label_column: str = "label",
    input_column: str = "",
) -> NodeData:
    """Read the node's folder (or file) in whichever supported layout it has.

    Parameters
    ----------
    path : str or Path
        The node's ``data-path``.
    classes : Sequence[str]
        The run's class names (a class's index is its position).
    spec : InputSpec
        How examples become model input.
    label_column, input_column : str
        Tables only: the label column, and the image or text column (``""``: the first of
        ``image``/``img``, or of ``text``/``sentence``/``content``, that the table has).

    Raises :class:`NodeDataError` when the data cannot take part (missing or unreadable, no
    supported layout, labels outside the run's classes, a different class mapping, no label or input
    column, no example).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise NodeDataError(f"data-path {str(root)!r}: no such file or folder")
    if not os.access(root, os.R_OK):
        raise NodeDataError(
            f"data-path {str(root)!r}: not readable by this process (uid {os.getuid()})"
        )
    space = LabelSpace(classes)
    layout, (collected, notes) = _read_layout(root, space, spec, label_column, input_column)
    train, test = collected.get("train"), collected.get("test")
    if train is None or not train.labels:
        raise NodeDataError(
            f"data-path {str(root)!r}: no readable example with a label" + _skips(collected)
        )
    report = _report(layout, collected, notes, space)
    n = len(classes)
    return NodeData(
        _to_dataset(train, spec, n),
        _to_dataset(test, spec, n) if test is not None and test.labels else None,
        report,
    )


def _read_layout(
    root: Path, space: LabelSpace, spec: InputSpec, label_column: str, input_column: str
) -> tuple[str, tuple[dict[str, _Collector], list[str]]]:
    """Recognise the layout of ``root`` and read it: ``(layout, (examples by split, notes))``.

    Parameters
    ----------
    root : Path
        The node's data file or folder (it exists and is readable).
    space : LabelSpace
        The run's classes.
    spec : InputSpec
        How examples become model input.
    label_column, input_column : str
        Tables only: the label column and the image or text column (``""``: the default names).
    """
    if root.is_dir() and ((root / "dataset_dict.json").exists() or (root / "state.json").exists()):
        return "hf-saved", _read_saved(root, space, spec, label_column, input_column)
    if (root.is_file() and root.suffix in TABLE_SUFFIXES) or (
        root.is_dir() and _files(root, TABLE_SUFFIXES)
    ):
        return "table", _read_tables(root, space, spec, label_column, input_column)
    if spec.kind == "image" and root.is_dir() and any(p.is_dir() for p in root.iterdir()):
        # Class folders first: a README.txt beside them is not a text dataset.
        return "image-folder", _read_image_folder(root, space, spec)
    if (root.is_file() and root.suffix in TEXT_SUFFIXES) or (
        root.is_dir() and _files(root, TEXT_SUFFIXES)
    ):
        return "text-lines", _read_text_lines(root, space, spec)
    if root.is_dir() and any(p.is_dir() for p in root.iterdir()):
        raise NodeDataError(
            f"data-path {str(root)!r} is an image folder, but the run's model takes text"
        )
    raise NodeDataError(
        f"data-path {str(root)!r} holds no supported layout: an image folder (one sub-folder per "
        "class), a save_to_disk folder, Parquet/CSV files, or .txt/.tsv lines of label<TAB>text"
    )


def _report(
    layout: str,
    collected: dict[str, _Collector],
    notes: list[str],
    space: LabelSpace,
) -> NodeDataReport:
    """The :class:`NodeDataReport` of what was read.

    Parameters
    ----------
    layout : str
        The layout recognised (``image-folder``, ``hf-saved``, ``table``, ``text-lines``).
    collected : dict[str, _Collector]
        The examples read, by split.
    notes : list[str]
        The readers' findings.
    space : LabelSpace
        The run's classes.
    """
    skipped: Counter[str] = Counter()
    for c in collected.values():
        skipped.update(c.skipped)
    held = sorted({k for c in collected.values() for k in c.labels})
    return NodeDataReport(
        layout,
        sum(len(c.labels) for c in collected.values()),
        dict(skipped),
        tuple(space.classes[k] for k in held),
        tuple(notes),
    )


def _skips(collected: dict[str, _Collector]) -> str:
    total: Counter[str] = Counter()
    for c in collected.values():
        total.update(c.skipped)
    return "".join(f"; skipped {n} ({r})" for r, n in sorted(total.items()))


def _files(root: Path, suffixes: Iterable[str]) -> list[Path]:
    wanted = tuple(suffixes)
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in wanted)


def _split_of(path: Path) -> str:
    return "test" if path.name.lower().startswith("test") else "train"


def _read_image_folder(
    root: Path, space: LabelSpace, spec: InputSpec
) -> tuple[dict[str, _Collector], list[str]]:
    from PIL import Image, UnidentifiedImageError
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    names, _ = find_classes(str(root))
    space.check_names(names, f"image folder {str(root)!r}")
    samples = make_dataset(
        str(root), {n: space.index[n] for n in names}, IMG_EXTENSIONS, allow_empty=True
    )
    out = _Collector()
    for file, label in samples:
        try:
            with Image.open(file) as img:
                out.add(image_to_input(img, spec.image_size, spec.image_channels), label)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
            out.skip("unreadable image")
    notes = []
    held = Counter(label for _, label in samples)
    empty = [n for n in names if held[space.index[n]] == 0]
    if empty:
        notes.append(f"class folder(s) {empty} hold no image")
    others = sum(
        1
        for n in names
        for _, _, files in os.walk(root / n)
        for f in files
        if not f.lower().endswith(IMG_EXTENSIONS)
    )
    if others:
        notes.append(
            f"{others} file(s) in class folders are not images ({', '.join(IMG_EXTENSIONS)}) and "
            "were ignored"
        )
    return {"train": out}, notes


def _read_text_lines(
    root: Path, space: LabelSpace, spec: InputSpec
) -> tuple[dict[str, _Collector], list[str]]:
    if spec.kind != "text":
        raise NodeDataError(
            f"data-path {str(root)!r} holds text lines, but the run's model takes images"
        )
    files = [root] if root.is_file() else _files(root, TEXT_SUFFIXES)
    out: dict[str, _Collector] = {}
    for file in files:
        c = out.setdefault(_split_of(file) if root.is_dir() else "train", _Collector())
        rows: list[tuple[str, str]] = []
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                label, tab, text = line.rstrip("\n").partition("\t")
                if not tab or not label.strip():
                    c.skip("line without label<TAB>text")
                elif not text.strip():
                    c.skip("empty text")
                else:
                    rows.append((label, text))
        labels = space.indices([r[0] for r in rows], f"{str(file)!r}")
        for (_, text), k in zip(rows, labels, strict=True):
            c.add(text, int(k))
    return out, []


def _read_saved(
    root: Path, space: LabelSpace, spec: InputSpec, label_column: str, input_column: str
) -> tuple[dict[str, _Collector], list[str]]:
    import datasets

    loaded = datasets.load_from_disk(str(root))
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if "train" not in splits:
        raise NodeDataError(
            f"save_to_disk folder {str(root)!r} has no 'train' split (it has {sorted(splits)})"
        )
    out = {
        name: _read_table(
            ds, space, spec, label_column, input_column, f"{str(root)!r} split {name!r}", root
        )
        for name, ds in splits.items()
        if name in ("train", "test")
    }
    notes = (
        [f"split(s) {sorted(set(splits) - {'train', 'test'})} not read"]
        if set(splits) - {"train", "test"}
        else []
    )
    return out, notes


def _read_tables(
    root: Path, space: LabelSpace, spec: InputSpec, label_column: str, input_column: str
) -> tuple[dict[str, _Collector], list[str]]:
    import datasets

    files = [root] if root.is_file() else _files(root, TABLE_SUFFIXES)
    builders = {TABLE_SUFFIXES[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise NodeDataError(f"data-path {str(root)!r} mixes Parquet and CSV files; keep one format")
    by_split: dict[str, list[str]] = {}
    for f in files:
        by_split.setdefault(_split_of(f) if root.is_dir() else "train", []).append(str(f))
    try:
        loaded = datasets.load_dataset(builders.pop(), data_files=by_split)
    except Exception as err:  # a malformed file: say which folder, keep the library's reason
        raise NodeDataError(
            f"data-path {str(root)!r}: the files cannot be read as a table: {err}"
        ) from None
    base = root if root.is_dir() else root.parent
    return {
        name: _read_table(
            ds, space, spec, label_column, input_column, f"{str(root)!r} split {name!r}", base
        )
        for name, ds in loaded.items()
    }, []


def _read_table(
    ds: Any,
    space: LabelSpace,
    spec: InputSpec,
    label_column: str,
    input_column: str,
    where: str,
    base: Path,
) -> _Collector:
    import datasets
    from PIL import Image, UnidentifiedImageError

    columns = list(ds.column_names)
    if label_column not in columns:
        raise NodeDataError(
            f"{where} has no label column {label_column!r} (columns: {columns}); set label-column"
        )
    candidates = (
        (input_column,)
        if input_column
        else (IMAGE_COLUMNS if spec.kind == "image" else TEXT_COLUMNS)
    )
    column = next((c for c in candidates if c in columns), None)
    if column is None:
        raise NodeDataError(
            f"{where} has no {spec.kind} column {list(candidates)} (columns: {columns}); set "
            "input-column"
        )
    feature = ds.features[label_column]
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    labels = space.indices(list(ds[label_column]), where, names)
    out = _Collector()
    for value, k in zip(ds[column], labels, strict=True):
        if k < 0:
            out.skip("no label")
            continue
        if spec.kind == "text":
            if not isinstance(value, str) or not value.strip():
                out.skip("empty text")
            else:
                out.add(value, int(k))
            continue
        try:
            out.add(_decode_image(value, base, spec), int(k))
        except (
            OSError,
            UnidentifiedImageError,
            ValueError,
            TypeError,
            Image.DecompressionBombError,
        ):
            out.skip("unreadable image")
    return out


def _decode_image(value: Any, base: Path, spec: InputSpec) -> NDArray[np.uint8]:
    """An image cell: a PIL image (``Image`` feature), ``{"bytes", "path"}``, or a file path
    relative to ``base``."""
    import io

    from PIL import Image

    if hasattr(value, "convert"):
        return image_to_input(value, spec.image_size, spec.image_channels)
    if isinstance(value, dict) and value.get("bytes"):
        with Image.open(io.BytesIO(value["bytes"])) as img:
            return image_to_input(img, spec.image_size, spec.image_channels)
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise ValueError("no image in this cell")
    with Image.open(base / value) as img:
        return image_to_input(img, spec.image_size, spec.image_channels)
