"""The attention block's export (``qkrope export --model attention``): the block built from its
sidecar (:func:`build_attention`), its weights (a file, or seeded random values drawn again one
tensor at a time), and :func:`export_attention`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from qkrope import contract, model_io, quantization
from qkrope._fileio import sha256_file
from qkrope._progress import Steps
from qkrope.errors import InputError, InputFileNotFoundError
from qkrope.model_io import ATTENTION_BLOCK
from qkrope.runtime.caches import default_axes_dims
from qkrope.sidecars import ModelConfig, ModelInfo

from .annotate import _versions
from .arguments import TORCH_DTYPES, _check_dtype, _check_opset, _check_out, default_opset
from .attention import DEFAULT_ATTENTION_FORM, check_attention_form
from .finalize import ExportError, check_parameters, finalize_model, ir_version_for
from .patch_diffusers import check_fits_in_memory as _check_fits_in_memory, itemsize as _itemsize
from .sample import (DEFAULT_ATTENTION_SAMPLE, MAX_SEED, _axis_values, _sample, _sample_args,
                     _sample_dict)
from .save import _write_outputs
from .trace import _torch_export

# the graph's input and output names (qkrope/model_io.py)
ATTENTION_INPUTS = model_io.ATTENTION.input_names
ATTENTION_OUTPUTS = model_io.ATTENTION.output_names

class CacheInputAttention(nn.Module):
    """QwenImageAttention with the graph's input order and names."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attn = attention

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.attn(hidden_states, encoder_hidden_states,
                         (img_cos_sin_cache, txt_cos_sin_cache), encoder_hidden_states_mask)

def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A safetensors file or a torch-saved state dict (diffusers parameter names); anything else
    is one InputError saying what the file is
    (:func:`qkrope.runtime.state_dict.read_state_dict_file`)."""
    from qkrope.runtime.state_dict import read_state_dict_file

    state = read_state_dict_file(path, what="--weights")
    _refuse_quantized(state, path)
    return state


def _refuse_quantized(keys, path) -> None:
    quantization.refuse_quantized_state_dict(
        keys, source=f"--weights {str(path)!r}",
        fix="the attention-block export has no quantised form: quantise the whole transformer "
            f"(`{quantization.QUANTIZE_COMMAND}`) and export it with "
            f"`{quantization.EXPORT_COMMAND.format(dir='QDIR')}`")


def _attention_module(info: ModelInfo, *, placeholders: bool = False) -> nn.Module:
    """The QwenImageAttention of ``info``'s config and node attributes (float32 parameters as
    nn.Linear initialises them, or placeholders in the export dtype: see
    :func:`qkrope.export.streaming.placeholder_module`)."""
    from .attention import QwenImageAttention
    from .streaming import placeholder_module

    config, attrs = info.config, info.attributes

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init must not move the RNG
            return QwenImageAttention(int(config.dim), int(config.heads), int(config.head_dim),
                                      **attrs.as_kwargs(), validate=False)

    if placeholders:
        return placeholder_module(build, dtype=TORCH_DTYPES[info.dtype])
    return build()


def _random_parameter(name: str, shape, g: torch.Generator) -> torch.Tensor:
    """The seeded random value (float32) of the attention parameter ``name``: the next draw
    of ``g``, RMSNorm weights near 1 (not all 1), the others scaled by 1/sqrt(fan-in)."""
    noise = torch.randn(shape, generator=g)
    if name.startswith("norm"):
        return 1.0 + 0.3 * noise
    return noise / shape[-1] ** 0.5


def _check_attention_weights(keys, state_keys, weights: str) -> None:
    missing = sorted(set(state_keys) - set(keys))
    unexpected = sorted(set(keys) - set(state_keys))
    if missing or unexpected:
        raise InputError(f"--weights {weights!r} does not match the attention block "
                         f"(diffusers names): missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]}")


def build_attention(info: ModelInfo) -> nn.Module:
    """The QwenImageAttention an attention export was made from, rebuilt from its sidecar: the
    config's sizes, the node attributes, the dtype, seeded random weights or the weights file
    the config names."""
    config = info.config
    module = _attention_module(info)
    weights = config.weights
    if weights:
        state = load_state_dict(weights)
        _check_attention_weights(state, module.state_dict(), weights)
        module.load_state_dict(state, strict=False)
    else:
        g = torch.Generator().manual_seed(int(config.seed or 0))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(_random_parameter(name, p.shape, g))
    return module.to(TORCH_DTYPES[info.dtype]).eval()


def _attention_weights(module: nn.Module, info: ModelInfo):
    """The values :func:`build_attention` gives ``module``'s (placeholder) parameters, one
    tensor at a time (:class:`qkrope.export.streaming.TensorSource`): from a safetensors
    ``--weights`` file by its header, from a torch-saved one as ``torch.load`` maps it, or
    drawn again from the seed (the generator's state before each parameter is recorded in one
    pass that draws and drops each)."""
    from qkrope.runtime.state_dict import looks_like_safetensors

    from .streaming import TensorSource

    config, dtype = info.config, TORCH_DTYPES[info.dtype]
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    weights = config.weights
    if weights and looks_like_safetensors(weights):
        from qkrope.diffusers_weights import DiffusersWeightsError, _read_header, read_tensor

        try:
            headers = _read_header(Path(weights))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"--weights {weights!r} is not a readable safetensors file "
                             f"({exc})") from None
        _refuse_quantized(headers, weights)
        _check_attention_weights(headers, shapes, weights)
        for key, header in headers.items():
            if tuple(header.shape) != shapes[key]:
                raise InputError(f"--weights {weights!r}: {key} is {list(header.shape)}, the "
                                 f"attention block has {list(shapes[key])}")

        def value(key: str) -> torch.Tensor:
            try:
                return read_tensor(headers[key])
            except DiffusersWeightsError as exc:
                raise InputError(f"--weights {weights!r}: {exc}") from None
    elif weights:
        state = load_state_dict(weights)
        _check_attention_weights(state, shapes, weights)

        def value(key: str) -> torch.Tensor:
            return state[key]
    else:
        g = torch.Generator().manual_seed(int(config.seed or 0))
        states = {}
        for key, shape in shapes.items():  # named_parameters order (no buffers)
            states[key] = g.get_state()
            torch.randn(shape, generator=g)

        def value(key: str) -> torch.Tensor:
            draw = torch.Generator()
            draw.set_state(states[key])
            return _random_parameter(key, shapes[key], draw)

    from qkrope.weight_values import checked_cast

    # as build_attention: the float32 module's value, then the export dtype (values it
    # cannot hold refused: qkrope.weight_values)
    return TensorSource(lambda key: checked_cast(value(key).to(torch.float32), dtype, name=key,
                                                 source=f"--weights {weights}"), shapes)


def export_attention(out: str | os.PathLike, *, heads: int = ATTENTION_BLOCK.heads,
                     head_dim: int = ATTENTION_BLOCK.head_dim,
                     rotary_dim: int | None = None, dtype: str = "fp32",
                     opset: int | None = None, eps: float = contract.DEFAULT_EPS,
                     interleaved: bool = contract.DEFAULT_INTERLEAVED,
                     rounding: int = contract.DEFAULT_ROUNDING,
                     weights: str | os.PathLike | None = None, seed: int = 0,
                     img_shapes: Sequence[Sequence[int]] | None = None,
                     txt_len: int | None = None, batch: int | None = None,
                     attention: str = DEFAULT_ATTENTION_FORM, progress: bool = False):
    """Export the Qwen-Image attention block; returns ``(ModelInfo, [written paths])``.

    ``attention``: how softmax attention is written (:data:`ATTENTION_FORMS`); ``opset``
    defaults to the lowest that has it (:func:`default_opset`)."""
    out = _check_out(out, [weights])
    tdtype = _check_dtype(dtype)
    opset = _check_opset(default_opset(attention) if opset is None else opset)
    check_attention_form(attention, opset)
    if int(heads) < 1:
        raise InputError(f"--heads must be >= 1; got {heads}")
    contract.check_head_dim(head_dim, what="--head-dim")
    contract.check_epsilon(eps, what="--eps")
    if weights is not None and not os.path.isfile(weights):
        raise InputFileNotFoundError(f"--weights {str(weights)!r} does not exist: give a safetensors "
                                f"file or a torch state dict with diffusers' attention names")
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise InputError(f"--rotary-dim must be even and in (0, head_dim={head_dim}]; got "
                         f"{rotary_dim}")
    attributes = contract.NodeAttributes(eps, interleaved, rounding)  # checked
    if isinstance(seed, bool) or not isinstance(seed, int) or not -MAX_SEED <= seed < MAX_SEED:
        raise InputError(f"--seed must be an integer in {-MAX_SEED}..{MAX_SEED - 1} (torch's "
                         f"generator seeds); got {seed!r}")
    # the block's weights: Q, K, V and out projections of both streams, dim x dim each
    _check_fits_in_memory(f"the attention block of {heads} heads x {head_dim} (width "
                          f"{int(heads) * int(head_dim)})",
                          8 * (int(heads) * int(head_dim)) ** 2 * _itemsize(tdtype),
                          "give smaller --heads / --head-dim")
    axes_dim = default_axes_dims(rotary_dim)
    sample = _sample(img_shapes, txt_len, batch, DEFAULT_ATTENTION_SAMPLE)
    config = ModelConfig(dim=heads * head_dim, heads=int(heads), head_dim=int(head_dim),
                         rotary_dim=rotary_dim, axes_dims_rope=list(axes_dim), seed=int(seed),
                         dtype=dtype, weights=str(Path(weights).resolve()) if weights else None,
                         weights_sha256=sha256_file(weights) if weights else None,
                         attention=attention)
    fields = dict(model="attention", opset=opset, ir_version=ir_version_for(opset), dtype=dtype,
                  dynamic_axes={}, node_attributes=attributes, config=config,
                  sample=_sample_dict(sample))
    t0 = time.perf_counter()
    info = ModelInfo(inputs=[], outputs=[], **fields)
    module = _attention_module(info, placeholders=True)  # traced without its weights
    weights = _attention_weights(module, info)
    args = _sample_args(sample, tdtype, config.dim, config.dim, axes_dim, False, seed)
    with Steps("qkrope export", 5, enabled=progress) as steps:
        model = _torch_export(CacheInputAttention(module), args, ATTENTION_INPUTS,
                              ATTENTION_OUTPUTS, opset, parameters_of="attn", steps=steps,
                              what=f"the attention block ({heads} heads x {head_dim}, {dtype}, "
                                   f"opset {opset}, {attention} attention)",
                              attention=attention, weights=weights)
        not_in_graph = check_parameters(model, module.state_dict())
        if not_in_graph:
            raise ExportError(f"the attention graph does not use the parameters {not_in_graph}")
        config.parameters = list(module.state_dict())  # initializer names (--refit)
        config.parameter_shapes = _shapes(module.state_dict(), config.parameters)
        with steps.step("adding the QKNormRoPE function body"):
            finalize_model(model, opset=opset, head_dim=head_dim, rotary_dim=rotary_dim,
                           expected_nodes=2)
        info, written = _write_outputs(model, out, dict(
            fields, versions=_versions(), axis_values=_axis_values(sample)), steps)
        steps.note(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return info, written


def _shapes(state_dict: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict[str, list[int]]:
    """``config.parameter_shapes``: each exported parameter's shape, as the state dict has it."""
    return {k: [int(d) for d in state_dict[k].shape] for k in keys}
