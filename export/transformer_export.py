"""The whole-transformer export (``qkrope export --model transformer``) of any family the
registry knows: the streamed skeleton, the family's export plan (:class:`TransformerPlan`,
given by its hook ``prepare``), the trace, the FP8 Q/DQ, and :func:`export_transformer`."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from qkrope import contract, model_io, quantization
from qkrope._progress import Steps
from qkrope.sidecars import ModelConfig

from . import latent_axes
from .annotate import _versions
from .arguments import _check_dtype, _check_opset, _check_out, _check_quant_opset, default_opset
from .attention import DEFAULT_ATTENTION_FORM, check_attention_form
from .finalize import check_parameters, finalize_model, ir_version_for
from .sample import DEFAULT_TRANSFORMER_SAMPLE, _axis_values, _sample, _sample_dict
from .save import _write_outputs
from .trace import _torch_export

# the graph's input and output names (qkrope/model_io.py)
TRANSFORMER_INPUTS = model_io.TRANSFORMER.input_names
TRANSFORMER_OUTPUTS = model_io.TRANSFORMER.output_names

def diffusers_config_record(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sidecar's ``diffusers_config``: the model's config without diffusers' private keys
    (but its class and version), tuples as lists."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()
            if not k.startswith("_") or k in ("_class_name", "_diffusers_version")}


def _skeleton(steps: Steps, diffusers_dir, what: str, tdtype: torch.dtype,
              quant: str | None, variant: str | None):
    """The streamed export's first step, for every family: ``(transformer, weights,
    fp8_table)``, the placeholder skeleton and its shard-backed weights
    (:func:`qkrope.export.patch_diffusers.skeleton_transformer`) and, with ``quant``, the
    quantised Linear layers' FP8 table."""
    from .patch_diffusers import skeleton_transformer

    with steps.step(f"reading {diffusers_dir}'s config and weight headers ({what}; the "
                    f"weights stay on disk)"):
        transformer, weights = skeleton_transformer(str(diffusers_dir), dtype=tdtype,
                                                    quant=quant, variant=variant)
    fp8_table = None
    if quant is not None:
        from . import quantize

        fp8_table = quantize.linear_fp8_table(transformer)
    return transformer, weights, fp8_table


@dataclass
class TransformerPlan:
    """What a family's export hook (``qkrope/families/<family>/export.py``, ``prepare``) gives
    :func:`export_transformer`: the cache-input wrapper whose ``forward`` arguments are the
    graph inputs in graph order (the diffusers model as its ``transformer`` attribute), the
    traced sample arguments, the graph's declaration, the RoPE setting recorded in the sidecar,
    the node rounding, the QKNormRoPE node count the graph must have, the blocks exported
    (``num_layers_exported``: None when every block is, and the record has no ``blocks``) and a
    phrase naming the blocks for the progress line.

    The hook module also has ``check_config(directory, model_class, dtype, *, memory)`` (before
    diffusers builds the model; :mod:`qkrope.export.patch_diffusers`) and ``post_export(model)``
    (checks of the traced graph, before the FP8 Q/DQ and the function body)."""

    wrapper: nn.Module
    args: tuple
    decl: model_io.ModelDecl
    axes: tuple[int, ...]
    theta: float
    rounding: int
    nodes: int
    num_layers_exported: int | None
    blocks: str
    # the attention shape and the nodes' RMSNorm epsilon, for a family whose config does not
    # name them as diffusers' usual keys (None: attention_head_dim, num_attention_heads and
    # transformer_blocks[0].attn.norm_q.eps)
    heads: int | None = None
    head_dim: int | None = None
    eps: float | None = None
    # the nodes' values (None: the first transformer_blocks' attn.norm_q epsilon, pairs, the
    # plan's rounding, head scope)
    attributes: contract.NodeAttributes | None = None
    interleaved: bool = contract.DEFAULT_INTERLEAVED  # the nodes' rotation pairs
    # the sample's value of axes the sample alone does not give (a family's own inputs' axes,
    # qkrope.model_io.AXES), or that the family's graph sizes otherwise (its text cache's rows)
    axis_values: dict | None = None


def export_transformer(out: str | os.PathLike, diffusers_dir: str | os.PathLike, *,
                       layers: int | None = None, dtype: str | None = None,
                       opset: int | None = None, rounding: int | None = None,
                       img_shapes: Sequence[Sequence[int]] | None = None,
                       txt_len: int | None = None, batch: int | None = None,
                       attention: str = DEFAULT_ATTENTION_FORM, progress: bool = True,
                       quant: str | None = None, variant: str | None = None):
    """Export a local diffusers transformer with cache inputs, of any family the registry
    knows (:mod:`qkrope.families`; the family from config.json, refused with the list
    otherwise): the family's export hooks (``qkrope/families/<family>/export.py``) patch its
    attentions and give the wrapper, the sample and the graph (:class:`TransformerPlan`);
    ``rounding`` None: the family's. ``dtype`` None: the checkpoint's
    (:func:`qkrope.export.checkpoint_dtype.checkpoint_dtype`). ``layers``: the first N blocks (families whose record has
    ``blocks``; refused otherwise). ``attention`` and ``opset``: as for
    :func:`export_attention`; ``variant``: diffusers' weights variant, e.g. ``"fp16"``.
    ``quant="fp8"``: a folder quantised with ModelOpt (``qkrope quantize``) exported with FP8
    Q/DQ (:mod:`qkrope.export.quantize`; opset 19 or later); a quantised folder without it is
    refused.

    Streamed: the graph is traced on a skeleton with placeholder parameters and each
    initializer is read from the shards (by its key), converted to ``dtype`` (and quantised,
    FP8) as it is written (:mod:`qkrope.export.streaming`), so the peak memory is the trace's
    plus about one tensor, whatever the model's size."""
    from qkrope import families
    from qkrope.runtime.latents import latent_of
    from qkrope.runtime.state_dict import model_folder_files

    from .patch_diffusers import folder_family

    out = _check_out(out, model_folder_files(diffusers_dir))
    if dtype is not None:
        _check_dtype(dtype)
    opset = _check_opset(default_opset(attention, quant) if opset is None else opset)
    check_attention_form(attention, opset)
    _check_quant_opset(quant, opset)
    sample = _sample(img_shapes, txt_len, batch, DEFAULT_TRANSFORMER_SAMPLE)
    family = folder_family(str(diffusers_dir))  # any other class: refused with the list
    if layers is not None:
        families.check_blocks_option(family, "--layers", layers)
    if dtype is None:  # the checkpoint's (qkrope.export.checkpoint_dtype)
        from .checkpoint_dtype import checkpoint_dtype

        dtype = checkpoint_dtype(diffusers_dir, variant=variant).dtype
    tdtype = _check_dtype(dtype)
    if rounding is not None:
        rounding = contract.check_rounding(rounding, what="--rounding")
    rounding = family.rounding if rounding is None else rounding
    hooks = families.hooks(family, "export")
    t0 = time.perf_counter()
    with Steps("qkrope export", 7 if quant else 6, enabled=progress) as steps:
        transformer, weights, fp8_table = _skeleton(steps, diffusers_dir,
                                                    f"{family.label}, {dtype}", tdtype, quant,
                                                    variant)
        if quant is not None:
            from . import quantize
        cfg = dict(transformer.config)
        plan = hooks.prepare(family, transformer, sample=sample, dtype=tdtype, layers=layers,
                             rounding=rounding)
        head_dim = int(cfg["attention_head_dim"] if plan.head_dim is None else plan.head_dim)
        heads = int(cfg["num_attention_heads"] if plan.heads is None else plan.heads)
        rotary_dim = sum(plan.axes)
        # the nodes' values: the plan's (a family whose blocks are named otherwise, or whose
        # norm spans the row), else its eps or the first block's norm_q epsilon, pairs, the
        # plan's rounding
        latent = latent_of(family, cfg)  # a 5-D latent's patch: its axes (export/latent_axes)
        patch = latent.patch if latent.rank == 5 else None
        attributes = plan.attributes or contract.NodeAttributes(
            float(transformer.transformer_blocks[0].attn.norm_q.eps if plan.eps is None
                  else plan.eps),
            plan.interleaved, plan.rounding)
        with (quantize.quantizers_disabled(transformer) if quant else contextlib.nullcontext()):
            model = _torch_export(   # the float graph; FP8 Q/DQ go in below
                plan.wrapper, plan.args, plan.decl.input_names, plan.decl.output_names, opset,
                parameters_of="transformer", steps=steps, attention=attention,
                what=f"{plan.blocks} (sample {sample.img_shapes}, {sample.txt_len} text "
                     f"tokens, batch {sample.batch}; {attention} attention, opset {opset})",
                weights=weights, patch=patch)
        state = {k: v for k, v in transformer.state_dict().items()
                 if quantization.QUANTIZER_MARK not in k}
        not_in_graph = check_parameters(model, state)
        hooks.post_export(model)
        quant_record = None
        if fp8_table is not None:
            with steps.step(f"FP8 Q/DQ on {len(fp8_table)} quantised Linear layers"):
                quant_record = quantize.apply_fp8(model, transformer, fp8_table,
                                                  weights=weights.tensor)
        with steps.step(f"adding the QKNormRoPE function body ({plan.nodes} nodes)"):
            finalize_model(model, opset=opset, head_dim=head_dim, rotary_dim=rotary_dim,
                           expected_nodes=plan.nodes)
        config = ModelConfig(
            dim=heads * head_dim, heads=heads, head_dim=head_dim, rotary_dim=rotary_dim,
            axes_dims_rope=list(plan.axes), family=family.name, rope_theta=plan.theta, seed=0,
            dtype=dtype, diffusers_dir=str(Path(diffusers_dir).resolve()),
            diffusers_config=diffusers_config_record(cfg),
            num_layers_exported=plan.num_layers_exported, attention=attention,
            # the state-dict keys that are initializers of that name (qkrope build --refit marks
            # them refittable) and those the graph does not use
            parameters=[k for k in state if k not in not_in_graph
                        and (quant_record is None or k in model.graph.initializers)],
            parameters_not_in_graph=not_in_graph)
        if quant_record is not None:
            config.quantization = quant_record
        # their shapes (the shards' headers): qkrope refit refuses a tensor of another shape
        config.parameter_shapes = {k: weights.shape(k) for k in config.parameters}
        info, written = _write_outputs(model, out, dict(
            model="transformer", opset=opset, ir_version=ir_version_for(opset), dtype=dtype,
            dynamic_axes={}, node_attributes=attributes, config=config,
            sample=_sample_dict(sample), versions=_versions(("diffusers",)),
            axis_values={**_axis_values(sample), **latent_axes.axis_values(
                sample.img_shapes[0], patch), **(plan.axis_values or {})}), steps,
            decl=plan.decl)
        steps.note(f"done in {time.perf_counter() - t0:.1f} s: {', '.join(map(str, written))}")
    return info, written
