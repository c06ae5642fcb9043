"""Model architectures the federation trains.

* ``cnn``: a small CNN for single-channel images (8x8 digits, 28x28 MNIST-like).
* ``resnet18``: torchvision's ResNet-18 adapted to 32x32 inputs (3x3 stem, no
  max-pool) with static BatchNorm (no running statistics), as HeteroFL and
  FIARSE use for submodels, whose statistics differ per width.
* ``fasttext``: a bag of hashed-token embeddings and a one-hidden-layer
  classifier (fastText-style) for AG News token ids (``common.hf_datasets``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.layout import ParamLayout

MODELS: tuple[str, ...] = ("cnn", "resnet18", "fasttext")
TEXT_MODELS: tuple[str, ...] = ("fasttext",)  # models whose input is token ids, not images


class SmallCNN(nn.Module):
    """Two 3x3 conv layers, a 2x2 max-pool and two linear layers.

    Parameters
    ----------
    num_classes : int
        Output classes.
    in_channels : int
        Input image channels (1 for grey images).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(4)  # 8x8 and 28x28 inputs both end as 4x4 maps
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(torch.relu(self.fc1(x)))


def resnet18_32x32(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision ResNet-18 for 32x32 inputs with static BatchNorm."""
    from torchvision.models import (
        resnet18,
    )  # imported here: torchvision costs ~1 s per client process

    model = resnet18(
        num_classes=num_classes,
        norm_layer=partial(nn.BatchNorm2d, track_running_stats=False),
    )
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class FastText(nn.Module):
    """Mean of token embeddings (padding id 0 ignored), a hidden layer and the classifier.

    Parameters
    ----------
    num_classes : int
        Output classes.
    vocab : int
        Hashed vocabulary size (token ids are in ``[0, vocab)``, 0 = padding).
    dim : int
        Embedding width.
    hidden : int
        Hidden units between the embedding bag and the classifier.
    """

    def __init__(self, num_classes: int, vocab: int = 2**15, dim: int = 64, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean", padding_idx=0)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(tokens))))


def build_model(name: str, num_classes: int, in_channels: int, seed: int) -> nn.Module:
    """Instantiate a model with deterministic initial weights.

    Parameters
    ----------
    name : {"cnn", "resnet18", "fasttext"}
        Architecture.
    num_classes : int
        Output classes.
    in_channels : int
        Input channels (images); ignored by text models.
    seed : int
        Seed for the initial weights (the server's initial global model).
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "cnn":
            return SmallCNN(num_classes, in_channels)
        if name == "resnet18":
            return resnet18_32x32(num_classes, in_channels)
        if name == "fasttext":
            from common.hf_datasets import TEXT_VOCAB  # the vocabulary the token ids were hashed into

            return FastText(num_classes, TEXT_VOCAB)
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def trainable_arrays(model: nn.Module) -> dict[str, NDArray[np.float32]]:
    """The model's trainable parameters as numpy arrays, in ``state_dict`` order."""
    return {n: p.detach().cpu().numpy().astype(np.float32) for n, p in model.named_parameters() if p.requires_grad}


def model_layout(model: nn.Module) -> ParamLayout:
    """Flat layout of the model's trainable parameters."""
    return ParamLayout.from_arrays(trainable_arrays(model))


def load_flat(model: nn.Module, layout: ParamLayout, flat: NDArray[np.float32]) -> None:
    """Copy a flat vector into the model's parameters in place."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(np.asarray(flat, dtype=np.float32)).items():
            named[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
