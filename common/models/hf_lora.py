"""LoRA adapters (``peft``) on the pretrained model of ``model = "hf"``, at one rank or a rank per
layer.

``peft`` adapts the layers its defaults name for the architecture (for BERT-like encoders the
attention ``query`` and ``value`` projections) and trains the classification head alongside
(``modules_to_save``); every other weight of the pretrained model is frozen, read from
``model-path`` on each node and never sent. Every adapter is scaled by ``lora-alpha /
lora-max-rank`` whatever its rank (peft's ``alpha_pattern``), so a rank-``r`` adapter computes what
the rank-``lora-max-rank`` adapter with zero trailing components computes, and zero-padded factors
of different clients add up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from common.config.schema import ConfigError
from common.models.hf import HFClassifier

#: Prefix peft puts before the adapted model's module names inside :class:`HFClassifier`.
PEFT_PREFIX = "net.base_model.model."


def add_lora(
    model: HFClassifier,
    max_rank: int,
    alpha: float,
    seed: int,
    ranks: Mapping[str, int] | None = None,
) -> HFClassifier:
    """Wrap ``model``'s network with LoRA adapters in place (the base frozen); returns ``model``.

    Parameters
    ----------
    model : HFClassifier
        The pretrained classifier (:func:`common.models.hf.build_hf_model`).
    max_rank : int
        ``lora-max-rank``: the rank of every adapter unless ``ranks`` says otherwise; fixes the
        scaling.
    alpha : float
        ``lora-alpha``: adapters are scaled by ``alpha / max_rank``.
    seed : int
        Seed of the adapters' initial ``A`` factors (``B`` starts at zero).
    ranks : Mapping[str, int], optional
        Rank per adapted layer, by its name in the federated vector
        (``net.base_model.model.<module>``).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if not isinstance(model, HFClassifier):
        raise ConfigError(
            f"method='lora' adapts a pretrained Hugging Face model (model='hf'), not {type(model)}"
        )
    rank_pattern, alpha_pattern = {}, {}
    for layer, r in (ranks or {}).items():
        key = re.escape(layer.removeprefix(PEFT_PREFIX))
        rank_pattern[key] = int(r)
        alpha_pattern[key] = alpha * int(r) / max_rank  # scaling alpha_r / r = alpha / max_rank
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=max_rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            model.net = get_peft_model(model.net, config)
        except ValueError as err:  # e.g. an architecture peft has no default target layers for
            raise ConfigError(f"method='lora': peft cannot adapt this model ({err})") from None
    return model


def adapter_scaling(model: nn.Module) -> set[float]:
    """The distinct scalings of the model's LoRA layers (one value when every adapter shares it)."""
    return {
        float(s)
        for m in model.modules()
        if isinstance(getattr(m, "scaling", None), dict)
        for s in m.scaling.values()
    }
