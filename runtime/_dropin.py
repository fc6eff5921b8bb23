"""What the diffusers drop-ins (:mod:`qkrope.runtime.transformer` for Qwen-Image,
:mod:`qkrope.runtime.flux_transformer` for FLUX) share: the config they expose, the LoRA-scale
test, the short form of a value in an error message."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch


def short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_one(scale: Any) -> bool:
    """A LoRA scale of exactly 1 (a number or a one-element tensor), which changes nothing."""
    if isinstance(scale, torch.Tensor):
        return scale.numel() == 1 and not scale.is_complex() and float(scale) == 1.0
    return (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
            and float(scale) == 1.0)


def frozen_config(cfg: Mapping[str, Any]):
    """The exported diffusers config as diffusers' FrozenDict (attribute and key access)."""
    try:
        from diffusers.configuration_utils import FrozenDict
    except ImportError:  # diffusers is what uses the config; without it a plain mapping will do
        return dict(cfg)
    return FrozenDict({k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()})
