"""A tiny randomly initialised BERT and a generated 4-topic news set, written to disk for the text
tests.

Nothing is downloaded: the model is built from a ``transformers`` config (2 layers, 16 wide, a
40-word vocabulary) and saved with its tokenizer as a ``model-path`` folder; the news set has AG
News' schema and is saved as a ``data-path`` folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOPICS = {
    0: ["election", "minister", "treaty", "summit", "vote"],
    1: ["team", "wins", "league", "coach", "season"],
    2: ["stocks", "profit", "merger", "shares", "bank"],
    3: ["chip", "software", "startup", "internet", "robot"],
}
FILLER = ["the", "a", "of", "new", "after", "report", "says", "in"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_bert(folder: Path, seed: int = 0, extra_tokens: int = 0, hidden: int = 16) -> Path:
    """Save a 2-layer BERT sequence classifier and its WordPiece tokenizer in ``folder``.

    Parameters
    ----------
    folder : Path
        Where to save (created).
    seed : int
        Seed of the random weights.
    extra_tokens : int
        Words added to the tokenizer beyond the model's embedding table (a mismatched pair when >
        0).
    hidden : int
        Hidden width (attention heads: 2).
    """
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    words = SPECIAL + sorted({w for ws in TOPICS.values() for w in ws} | set(FILLER))
    vocab = len(words)
    words += [f"extra{i}" for i in range(extra_tokens)]
    folder.mkdir(parents=True, exist_ok=True)
    BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(str(folder))
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(str(folder))
    return folder


def news_texts(n: int, rng: np.random.Generator, words: int = 10) -> tuple[list[str], list[int]]:
    """``n`` texts of ``words`` words with topic words that make the 4-way label learnable."""
    labels = rng.integers(0, 4, n)
    texts = [" ".join(rng.choice(TOPICS[int(y)] + FILLER, words)) for y in labels]
    return texts, [int(y) for y in labels]


def news_dataset(folder: Path, train: int = 160, test: int = 40, seed: int = 0) -> Path:
    """Save a generated AG-News-shaped ``DatasetDict`` (``text``, 4-class ``label``) in
    ``folder``."""
    import datasets

    rng = np.random.default_rng(seed)
    feats = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(num_classes=4)}
    )
    splits = {}
    for name, n in (("train", train), ("test", test)):
        texts, labels = news_texts(n, rng)
        splits[name] = datasets.Dataset.from_dict({"text": texts, "label": labels}, feats)
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def tiny_text_run(model_path: str, data_path: str, **extra: object) -> dict:
    """Run config of a small, fast text federation on :func:`tiny_bert` and :func:`news_dataset`
    (``extra`` wins)."""
    return {
        "dataset": "ag_news",
        "data-path": data_path,
        "model": "hf",
        "model-path": model_path,
        "text-length": 12,
        "batch-size": 16,
        "lr": 0.05,
        "local-epochs": 1,
        "seed": 3,
        **extra,
    }
