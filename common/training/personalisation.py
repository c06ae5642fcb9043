"""Personalised evaluation: a few local SGD steps on a node's training split before it evaluates.

A federation's model is judged on the server's test set; the owner of a device judges it on their
own data, after it has had a moment to adapt. With ``adapt-steps = s`` every node, in every
evaluation round, evaluates the submodel it would train next twice on its own test split: as
received, and after ``s`` steps of the run's optimiser on its own training split (a meta-learned
model: of its inner step). The adapted model never leaves the node; only its accuracy does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.nn.utils import prune

from common.config.node import NodeConfig
from common.config.run import RunConfig
from common.data.arrays import ArrayDataset
from common.models.layout import ParamLayout
from common.training.loop import TrainConfig, attach_masks, round_train_config, train_loop

#: Added to a round's minibatch seed for its adaptation, so adapting draws other batches than
#: training.
ADAPT_SEED_OFFSET = 7919


def adaptation_examples(
    num_examples: int, steps: int, batch_size: int, seed: int
) -> NDArray[np.int64]:
    """The ``steps * batch_size`` training examples of an adaptation, in passes over the split.

    Each pass is a seeded permutation of all ``num_examples`` examples, so every example is used
    once before any is used twice; one epoch over the result is then exactly ``steps`` minibatches.

    Parameters
    ----------
    num_examples : int
        Examples in the node's training split (at least 1).
    steps : int
        SGD steps of the adaptation.
    batch_size : int
        Examples per step.
    seed : int
        Seed of the permutations.
    """
    if num_examples < 1 or steps < 0 or batch_size < 1:
        raise ValueError(f"num_examples={num_examples}, steps={steps}, batch_size={batch_size}")
    need = steps * batch_size
    rng = np.random.default_rng(seed)
    passes = -(-need // num_examples)
    order = np.concatenate(
        [rng.permutation(num_examples) for _ in range(passes)] or [np.zeros(0, np.int64)]
    )
    return order[:need].astype(np.int64)


def adapt_config(run: RunConfig, node: NodeConfig, server_round: int) -> TrainConfig:
    """The adaptation's optimiser settings: the round's training settings, one pass over the chosen
    examples, no FedProx pull toward the received model (adapting is meant to move away from it), no
    statistics.

    A model meta-learned with ``meta-learning = "fomaml"`` is adapted as its meta steps adapted it:
    plain SGD steps of ``meta-inner-lr`` (no momentum, no weight decay), the step it was trained to
    be a good start for; any other model by ordinary steps of the run's optimiser.
    """
    cfg = round_train_config(run, node, max(server_round, 1))
    steps = {"epochs": 1, "proximal_mu": 0.0, "fisher_batches": 0, "meta_inner_lr": 0.0}
    if run.meta_learning == "fomaml":
        steps |= {"optimizer": "sgd", "lr": run.meta_inner_lr, "momentum": 0.0, "weight_decay": 0.0}
    return dataclasses.replace(cfg, seed=cfg.seed + ADAPT_SEED_OFFSET, **steps)


def adapt(
    model: nn.Module,
    train: ArrayDataset,
    steps: int,
    cfg: TrainConfig,
    device: torch.device,
    gate: tuple[ParamLayout, NDArray[np.bool_]] | None = None,
) -> nn.Module:
    """``model`` after ``steps`` SGD steps on ``train`` (in place), in evaluation mode.

    Parameters
    ----------
    model : nn.Module
        The received submodel (its trainable parameters are adapted).
    train : ArrayDataset
        The node's training split.
    steps : int
        SGD steps (0: the model as received).
    cfg : TrainConfig
        The optimiser settings (:func:`adapt_config`); ``cfg.epochs`` is ignored (one pass).
    device : torch.device
        Where to train.
    gate : tuple, optional
        ``(layout, mask)`` of an element-wise submodel: positions outside ``mask`` stay zero (masks
        attached with ``torch.nn.utils.prune`` for the steps).
    """
    model.to(device)
    if steps > 0 and len(train) > 0:
        subset = train.subset(adaptation_examples(len(train), steps, cfg.batch_size, cfg.seed))
        gated = attach_masks(model, *gate) if gate is not None else []
        train_loop(model, subset, dataclasses.replace(cfg, epochs=1), device)
        for module, tensor_name in gated:
            prune.remove(module, tensor_name)
    return model.eval()
