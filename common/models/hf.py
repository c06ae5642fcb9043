"""Pretrained Hugging Face sequence classifiers (``model = "hf"``) and their tokenizers.

``model-path`` names a local folder (``save_pretrained`` output: ``config.json``, the weights, the
tokenizer files; what an air-gapped site copies in) or a hub id (``org/name``, downloaded once into
the Hugging Face cache). The model is loaded with ``AutoModelForSequenceClassification`` with as
many labels as the dataset has; its classification head is initialised from the run's ``seed``, so
the server and every node build the same initial model. Text is tokenised with the model's own
tokenizer (:func:`tokenize`), padded and truncated to ``text-length`` tokens.

Which tensors are federated (the rule every element-wise method sees):

* **Weight matrices** of attention, feed-forward, pooler and classifier layers are ranked, selected
  and aggregated like any other weight matrix.
* **LayerNorm scales and shifts, and biases** are 1-D: every submodel keeps them (the selection
  guard of every 1-D tensor, :attr:`common.models.layout.ParamLayout.always_kept`).
* **Embeddings** (every ``nn.Embedding``: word, position, token type) follow ``hf-embeddings``:
  ``frozen`` (default) keeps them at their pretrained values on every node, outside the federated
  model (never sent, never trained: for MiniLM they are half of the weights, and a client that
  dropped a word's row would lose that word); ``trained`` puts them in the federated model, ranked
  like any matrix (one row per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.config.schema import ConfigError
from common.models.catalog import EMBEDDING_RULES
from common.models.model_path import resolve_model_path

EmbeddingRule = Literal["frozen", "trained"]


def _quiet() -> None:
    """Silence transformers' load reports and progress bars (a fresh head is expected, not news)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def load_tokenizer(path: str) -> Any:
    """The tokenizer stored with the model at ``model-path`` (``ConfigError`` naming the key if
    none)."""
    from transformers import AutoTokenizer

    _quiet()
    where = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"model-path={path!r}: no tokenizer could be loaded ({err})") from None
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"model-path={path!r}: the tokenizer has no padding token")
    return tokenizer


def tokenize(texts: Sequence[str], path: str, length: int) -> NDArray[np.int64]:
    """Token ids ``(n, length)`` from the model's tokenizer: truncated, padded with its padding id.

    Parameters
    ----------
    texts : Sequence[str]
        The examples.
    path : str
        ``model-path``.
    length : int
        Tokens per example (``text-length``), special tokens included.
    """
    tokenizer = load_tokenizer(path)
    if not texts:
        return np.zeros((0, length), dtype=np.int64)
    ids = tokenizer(list(texts), padding="max_length", truncation=True, max_length=length)[
        "input_ids"
    ]
    return np.asarray(ids, dtype=np.int64)


class HFClassifier(nn.Module):
    """A Hugging Face sequence classifier that takes a batch of token ids and returns logits.

    Parameters
    ----------
    net : nn.Module
        An ``AutoModelForSequenceClassification`` model.
    pad_id : int
        The tokenizer's padding id: those positions are masked out of attention.
    """

    # transformers' attention-mask helpers branch on tensor values, which torch.func.vmap cannot
    # trace.
    vmap_safe = False

    def __init__(self, net: nn.Module, pad_id: int) -> None:
        super().__init__()
        self.net = net
        self.pad_id = int(pad_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        attention = (tokens != self.pad_id).long()
        return self.net(input_ids=tokens, attention_mask=attention).logits


def freeze_embeddings(model: nn.Module) -> int:
    """Take every ``nn.Embedding`` weight out of training (``hf-embeddings = frozen``); returns how
    many."""
    frozen = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
                frozen += 1
    return frozen


def build_hf_model(
    path: str,
    num_classes: int,
    seed: int,
    embeddings: EmbeddingRule = "frozen",
    skeleton: bool = False,
) -> HFClassifier:
    """The pretrained model at ``path`` with a ``num_classes``-way head, initialised from ``seed``.

    Parameters
    ----------
    path : str
        ``model-path``: a local folder or a hub id.
    num_classes : int
        Labels of the dataset (the head's outputs).
    seed : int
        Seed of the new classification head.
    embeddings : {"frozen", "trained"}
        ``hf-embeddings``: whether embedding tables are federated.
    skeleton : bool
        Build the architecture from the config only, without reading weights (for module types and
        names, e.g. on the ``meta`` device).

    Raises
    ------
    ConfigError
        Naming ``model-path`` when it holds no loadable model, or when its tokenizer emits ids
        outside the model's embedding table (a tokenizer and model that do not belong together).
    """
    from transformers import AutoModelForSequenceClassification

    if embeddings not in EMBEDDING_RULES:
        raise ConfigError(
            f"hf-embeddings={embeddings!r}: allowed values are {', '.join(EMBEDDING_RULES)}"
        )
    _quiet()
    where = resolve_model_path(path)
    tokenizer = load_tokenizer(path)
    config = _checked_config(path, where, num_classes, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            if skeleton:
                net = AutoModelForSequenceClassification.from_config(config)
            else:
                net = AutoModelForSequenceClassification.from_pretrained(
                    where, config=config, ignore_mismatched_sizes=True
                )
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"model-path={path!r}: no sequence-classification model could be loaded ({err})"
            ) from None
    if embeddings == "frozen":
        freeze_embeddings(net)
    return HFClassifier(net, tokenizer.pad_token_id)


def _checked_config(path: str, where: str, num_classes: int, tokenizer: Any) -> Any:
    """The model's configuration with a ``num_classes``-way head, checked against its tokenizer.

    Parameters
    ----------
    path : str
        ``model-path`` as the run config gives it (named in errors).
    where : str
        That path resolved: a local folder or a hub id.
    num_classes : int
        Labels of the dataset (the head's outputs).
    tokenizer : Any
        The tokenizer stored with the model; its ids must fit the model's embedding table.

    Raises
    ------
    ConfigError
        Naming ``model-path`` when it holds no loadable configuration, or when the tokenizer has
        more tokens than the embedding table has rows.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(where, num_labels=num_classes)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model-path={path!r}: no model configuration could be loaded ({err})"
        ) from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"model-path={path!r}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"embedding table {vocab} rows: tokenizer and model do not belong together"
        )
    return config
