"""Label masking (``label-mask``): a client trains only the logits of the classes it holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.data.datasets import load_dataset
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.loop import TrainConfig, local_classes, local_logits, train_masked
from common.training.structured import train_small

CPU = torch.device("cpu")


def _two_class_client(n: int = 64) -> ArrayDataset:
    data = load_dataset("digits", 0.2, 0).train
    keep = np.flatnonzero(np.isin(data.y, [3, 7]))[:n]
    return ArrayDataset(data.x[keep], data.y[keep], 10)


def test_absent_logits_are_zero_and_get_no_gradient():
    out = torch.randn(4, 5, requires_grad=True)
    labels = torch.tensor([1, 3, 3, 1, 1])
    assert local_classes(labels, 5, True).tolist() == [False, True, False, True, False]
    masked = local_logits(out, local_classes(labels, 5, True))
    assert torch.all(masked[:, [0, 2, 4]] == 0) and torch.equal(masked[:, [1, 3]], out[:, [1, 3]])
    torch.nn.functional.cross_entropy(masked, torch.tensor([1, 3, 1, 3])).backward()
    assert torch.all(out.grad[:, [0, 2, 4]] == 0) and torch.all(out.grad[:, [1, 3]] != 0)
    assert local_classes(labels, 5, False) is None and local_logits(out, None) is out


def _classifier_rows(layout, flat, name):
    return layout.unflatten(flat)[name]


@pytest.mark.parametrize("label_mask", [False, True])
def test_masked_training_leaves_absent_classifier_rows_alone(label_mask):
    data = _two_class_client()
    model = build_model("cnn", 10, 1, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    mask = np.ones(layout.size, dtype=bool)
    cfg = TrainConfig(epochs=1, batch_size=16, lr=0.1, momentum=0.0, label_mask=label_mask)
    res = train_masked(build_model("cnn", 10, 1, 1), layout, x, mask, data, cfg, CPU)
    head_w, head_b = layout.names[-2], layout.names[-1]  # the classifier is the last layer
    absent = [c for c in range(10) if c not in (3, 7)]
    for name in (head_w, head_b):
        before, after = (
            _classifier_rows(layout, x, name),
            _classifier_rows(layout, res.params, name),
        )
        moved = np.any(before[absent] != after[absent])
        assert moved != label_mask  # without masking every absent class is pushed toward "no"
        assert np.any(before[[3, 7]] != after[[3, 7]])
    fisher_head = _classifier_rows(layout, res.fisher, head_w)
    assert np.all(fisher_head[absent] == 0) == label_mask


def test_structured_training_masks_too():
    data = _two_class_client()
    model = build_model("cnn", 10, 1, 0)
    head = list(model.state_dict())[-1]
    before = model.state_dict()[head].clone()
    train_small(model, data, TrainConfig(epochs=1, batch_size=16, lr=0.1, label_mask=True), CPU)
    after = model.state_dict()[head]
    absent = [c for c in range(10) if c not in (3, 7)]
    assert torch.equal(before[absent], after[absent]) and not torch.equal(
        before[[3, 7]], after[[3, 7]]
    )


def test_label_mask_config():
    assert parse_run_config({"label-mask": True}).label_mask is True
    assert parse_run_config({}).label_mask is False
    with pytest.raises(ConfigError, match="label-mask"):
        parse_run_config({"label-mask": "yes"})
