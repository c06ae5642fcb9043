"""Model architectures the federation trains.

* ``cnn-bn``: a small CNN for single-channel images (8x8 digits, 28x28 MNIST-like)
  with static BatchNorm after each convolution (the benchmark's default).
* ``cnn-gn``: the same CNN with GroupNorm over all of a layer's channels in place of BatchNorm:
  its statistics are each example's own, so one example's output and gradient do not depend on
  the rest of its minibatch, which clipping an example's gradient (``dp-epsilon``) needs.
* ``cnn``: the same CNN without normalisation (the model of earlier results).
* ``resnet18``: torchvision's ResNet-18 adapted to 32x32 inputs (3x3 stem, no
  max-pool) with static BatchNorm.

*Static* BatchNorm keeps no running statistics (``track_running_stats=False``):
it normalises with the statistics of the batch it sees, in training and in
evaluation alike. Submodels of different widths produce differently scaled
activations, so statistics averaged across widths would fit none of them;
HeteroFL's and FedRolex's published models build their norms the same way
(``momentum=None, track_running_stats=track`` with ``track=False`` for training).

Every convolution is followed by a *scaler* (:class:`Scaler`, or
:class:`ScaledBatchNorm2d` in ResNet-18, where each scaler precedes a norm as in
the published ResNet): in training it divides the layer's output by the width
rate of the client's submodel, so a submodel holding a share ``r`` of a layer's
input channels sees activations of the full model's magnitude; in evaluation it
is the identity. The CNNs' hidden linear layer ``fc1`` also has one, marked
``hidden_linear``: HeteroFL's published convolutional model scales only its
conv blocks (conv -> scaler -> norm, the norm an identity without normalisation)
and has no hidden linear layer, so that scaler stays at rate 1 unless asked for.
The rate is 1 (a no-op) unless a width method sets it (:func:`set_scaler_rate`).
* ``fasttext``: a bag of hashed-token embeddings and a one-hidden-layer
  classifier (fastText-style) for AG News token ids (``common.data.hub``).
* ``hf``: a pretrained Hugging Face sequence classifier loaded from ``model-path``
  (:mod:`common.models.hf`), for token ids of its own tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.models.catalog import MODELS, PRETRAINED_MODELS
from common.models.inert import inert_parameters
from common.models.layout import ParamLayout

if TYPE_CHECKING:
    from common.config.run import RunConfig


class Scaler(nn.Module):
    """Divides its input by ``rate`` in training mode; the identity in evaluation mode.

    HeteroFL's ``modules.Scaler`` (``input / self.rate if self.training else input``).

    Parameters
    ----------
    hidden_linear : bool
        It scales a hidden linear layer (no norm after it), not a convolution:
        :func:`set_scaler_rate` leaves it at 1 unless asked to scale such layers too.

    Attributes
    ----------
    rate : float
        The width rate of the submodel being trained, in (0, 1] (1 = no-op).
    """

    def __init__(self, hidden_linear: bool = False) -> None:
        super().__init__()
        self.rate = 1.0
        self.hidden_linear = hidden_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training and self.rate != 1.0 else x


class ScaledBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d whose input first passes a :class:`Scaler` (``norm(scaler(x))`` as one module).

    Keeps ``BatchNorm2d``'s parameter names, so the layout, the channel graph and stored models of
    the ResNet are unchanged; ``rate`` is the scaler's (1 = plain BatchNorm2d).
    """

    def __init__(self, num_features: int, **kwargs: object) -> None:
        super().__init__(num_features, **kwargs)  # type: ignore[arg-type]
        self.rate = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x / self.rate if self.training and self.rate != 1.0 else x)


def set_scaler_rate(model: nn.Module, rate: float, hidden_linear: bool = False) -> int:
    """Set the rate of the scalers of ``model``; returns how many were set to ``rate``.

    Parameters
    ----------
    model : nn.Module
        A model of this module.
    rate : float
        Width rate of the submodel, in (0, 1].
    hidden_linear : bool
        Also scale the hidden linear layers (:attr:`Scaler.hidden_linear`); otherwise their scalers
        are set to 1, as HeteroFL's published convolutional model scales only its conv blocks.
    """
    if not 0 < rate <= 1:
        raise ValueError(f"scaler rate must be in (0, 1], got {rate}")
    count = 0
    for m in model.modules():
        if isinstance(m, (Scaler, ScaledBatchNorm2d)):
            scaled = hidden_linear or not getattr(m, "hidden_linear", False)
            m.rate = float(rate) if scaled else 1.0
            count += scaled
    return count


def static_bn(channels: int) -> nn.BatchNorm2d:
    """BatchNorm without running statistics (batch statistics in training and evaluation)."""
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=False)


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
        self.scale1, self.scale2, self.scale3 = Scaler(), Scaler(), Scaler(hidden_linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.scale1(self.conv1(x)))
        x = torch.relu(self.scale2(self.conv2(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(torch.relu(self.scale3(self.fc1(x))))


class SmallBNCNN(nn.Module):
    """:class:`SmallCNN` with static BatchNorm after each convolution.

    Each block is conv -> scaler -> norm -> ReLU, the order of HeteroFL's ``models/conv.py``; the
    hidden linear layer has no norm, and its scaler is a ``hidden_linear`` one (rate 1 unless
    :func:`set_scaler_rate` is asked to scale it). BatchNorm weights start at 1 and biases at 0.

    Parameters
    ----------
    num_classes : int
        Output classes.
    in_channels : int
        Input image channels (1 for grey images).
    norm : Callable[[int], nn.Module]
        Builds the norm of a layer of that many channels (default: static BatchNorm).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        norm: Callable[[int], nn.Module] = static_bn,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.bn1 = norm(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = norm(64)
        self.pool = nn.AdaptiveMaxPool2d(4)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.scale1, self.scale2, self.scale3 = Scaler(), Scaler(), Scaler(hidden_linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.scale1(self.conv1(x))))
        x = torch.relu(self.bn2(self.scale2(self.conv2(x))))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(torch.relu(self.scale3(self.fc1(x))))


def one_group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with one group: each example normalised over all of its channels and positions."""
    return nn.GroupNorm(1, channels)


class SmallGNCNN(SmallBNCNN):
    """:class:`SmallBNCNN` with ``GroupNorm(1, channels)`` in place of each BatchNorm.

    One group per layer normalises each example over all of its channels and positions, so an
    example's output depends on that example alone (per-example gradients mean something to clip),
    and any number of kept channels forms whole groups: a width submodel of any rate is valid. The
    norms keep the attribute names ``bn1`` and ``bn2`` so that both CNNs share one parameter layout
    and one channel graph (a norm's scale and shift belong to the channels it normalises). Scale
    starts at 1 and shift at 0, as BatchNorm's.

    Parameters
    ----------
    num_classes : int
        Output classes.
    in_channels : int
        Input image channels (1 for grey images).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__(num_classes, in_channels, norm=one_group_norm)


def resnet18_32x32(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision ResNet-18 for 32x32 inputs with static BatchNorm, each norm preceded by a
    scaler."""
    from torchvision.models import (
        resnet18,
    )  # imported here: torchvision costs ~1 s per client process

    model = resnet18(
        num_classes=num_classes,
        norm_layer=partial(ScaledBatchNorm2d, track_running_stats=False),
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

    def __init__(
        self, num_classes: int, vocab: int = 2**15, dim: int = 64, hidden: int = 64
    ) -> None:
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
    name : {"cnn-bn", "cnn-gn", "cnn", "resnet18", "fasttext"}
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
        if name == "cnn-bn":
            return SmallBNCNN(num_classes, in_channels)
        if name == "cnn-gn":
            return SmallGNCNN(num_classes, in_channels)
        if name == "cnn":
            return SmallCNN(num_classes, in_channels)
        if name == "resnet18":
            return resnet18_32x32(num_classes, in_channels)
        if name == "fasttext":
            from common.data.hub import TEXT_VOCAB  # the vocabulary the token ids were hashed into

            return FastText(num_classes, TEXT_VOCAB)
    if name in PRETRAINED_MODELS:
        raise ValueError(f"model {name!r} is loaded from a model-path: use build_run_model")
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def build_run_model(
    run: RunConfig, num_classes: int, in_channels: int, skeleton: bool = False
) -> nn.Module:
    """The run's model: :func:`build_model`, or the pretrained model at ``model-path`` for ``model =
    "hf"``.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration (``model``, ``seed``, ``model-path``, ``hf-embeddings``).
    num_classes : int
        Output classes (the dataset's labels).
    in_channels : int
        Input channels (images); ignored by text models.
    skeleton : bool
        Only the architecture is needed (module types and names): a pretrained model is built from
        its configuration without reading its weights.
    """
    if run.model == "hf":
        from common.models.hf import (
            build_hf_model,
        )  # transformers costs seconds to import: only when used

        return build_hf_model(run.model_path, num_classes, run.seed, run.hf_embeddings, skeleton)
    return build_model(run.model, num_classes, in_channels, run.seed)


def trainable_arrays(model: nn.Module) -> dict[str, NDArray[np.float32]]:
    """The model's trainable parameters as numpy arrays, in ``state_dict`` order."""
    return {
        n: p.detach().cpu().numpy().astype(np.float32)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def model_layout(model: nn.Module) -> ParamLayout:
    """Flat layout of the model's trainable parameters, with the ones that cannot learn marked
    inert."""
    return ParamLayout.from_arrays(trainable_arrays(model), inert_parameters(model))


def load_flat(model: nn.Module, layout: ParamLayout, flat: NDArray[np.float32]) -> None:
    """Copy a flat vector into the model's parameters in place."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(np.asarray(flat, dtype=np.float32)).items():
            named[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
