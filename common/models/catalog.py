"""The names the run config accepts for models, kept free of torch so that checking a configuration
never loads it."""

from __future__ import annotations

MODELS: tuple[str, ...] = ("cnn-bn", "cnn-gn", "cnn", "resnet18", "fasttext", "hf")
TEXT_MODELS: tuple[str, ...] = ("fasttext", "hf")  # models whose input is token ids, not images
PRETRAINED_MODELS: tuple[str, ...] = ("hf",)  # models loaded from the run's model-path
#: Models whose norms use the statistics of the whole minibatch (one example's output depends on the
#: others).
BATCH_STATISTICS_MODELS: tuple[str, ...] = ("cnn-bn", "resnet18")
#: ``hf-embeddings``: the pretrained embedding tables stay frozen on every node, or are federated.
EMBEDDING_RULES: tuple[str, ...] = ("frozen", "trained")
