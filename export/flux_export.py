"""``qkrope export --model transformer`` for a FLUX.1 or FLUX.2 folder (the family dispatch of
:func:`qkrope.export.onnx_export.export_transformer`).

The graph (:data:`qkrope.model_io.FLUX1_TRANSFORMER` / ``FLUX2_TRANSFORMER``) takes FLUX's
inputs with the two RoPE caches in place of ``txt_ids``/``img_ids`` and no mask; every
attention's norm + RoPE is a QKNormRoPE node (:mod:`qkrope.export.patch_flux`), and nothing in
it is float64 (checked: :func:`check_no_double`). The sidecar records the family, the RoPE axes
(3 for FLUX.1, 4 for FLUX.2) and theta (FLUX.1's 10000 is fixed in diffusers' code, FLUX.2's
is the config's ``rope_theta``, 2000 by default), as read from the loaded model.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from qkrope import contract, model_io, quantization
from qkrope._progress import Steps
from qkrope.errors import InputError
from qkrope.sidecars import ModelConfig

from . import onnx_export as ox


def check_no_double(model) -> None:
    """No float64 anywhere in the graph: no DOUBLE input, output, initializer, value or Cast
    (TensorRT's parser demotes DOUBLE to FLOAT, so ONNX Runtime and TensorRT would disagree)."""
    import onnx_ir as ir

    double = ir.DataType.DOUBLE
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
        if node.op_type == "Cast" and "to" in node.attributes and \
                int(node.attributes["to"].value) == int(double):
            raise ox.ExportError(f"node {node.name} casts to DOUBLE: the FLUX graph must have "
                                 f"no float64")
    for value in values:
        if value is not None and value.dtype == double:
            raise ox.ExportError(f"graph value {value.name} is DOUBLE: the FLUX graph must have "
                                 f"no float64")


def sample_ids(family: model_io.ModelFamily, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them, for the traced sample: image k at
    (k, row, column) (FLUX.1: condition images at first axis 1, like Kontext; FLUX.2: a 4th
    axis at 0 and reference images at first axis 10 * k), text at 0 (FLUX.2: its 4th axis the
    token index)."""
    rows = []
    for k, (f, h, w) in enumerate(img_shapes):
        for frame in range(f):
            for y in range(h):
                for x in range(w):
                    first = (k if family is model_io.FLUX1 else 10 * k) + frame
                    rows.append([first, y, x] + ([0] if family is model_io.FLUX2 else []))
    img = torch.tensor(rows, dtype=torch.float32)
    axes = 4 if family is model_io.FLUX2 else 3
    txt = torch.zeros(txt_len, axes)
    if family is model_io.FLUX2:
        txt[:, 3] = torch.arange(txt_len, dtype=torch.float32)
    return txt, img


def _sample_args(family, transformer, sample, dtype, theta, axes, head_dim, guided):
    from qkrope.runtime.flux_transformer import caches_from_ids

    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    txt_ids, img_ids = sample_ids(family, sample.img_shapes, sample.txt_len)
    caches = caches_from_ids(family.name, txt_ids, img_ids, axes_dims=axes, theta=theta,
                             head_dim=head_dim)
    b = sample.batch
    args = [torch.randn(b, sample.img_tokens, int(cfg["in_channels"]), generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg["joint_attention_dim"]),
                        generator=g).to(dtype)]
    if family is model_io.FLUX1:
        args.append(torch.randn(b, int(cfg["pooled_projection_dim"]), generator=g).to(dtype))
    args.append(torch.full((b,), 0.5, dtype=dtype))
    if guided:
        args.append(torch.full((b,), 3.5, dtype=dtype))
    return tuple(args) + (caches.img.clone(), caches.txt.clone())


def export_flux_transformer(out: Path, diffusers_dir: str | os.PathLike, *,
                            family: model_io.ModelFamily, layers: int | None, dtype: str,
                            opset: int, rounding: int | None, sample: "ox.Sample",
                            attention: str, progress: bool, quant: str | None,
                            variant: str | None):
    """Export a FLUX.1/FLUX.2 transformer folder (arguments checked by export_transformer)."""
    from .patch_diffusers import load_transformer
    from .patch_flux import cache_input_flux, flux_node_count, has_guidance

    if layers is not None:
        raise InputError(f"--layers applies to Qwen-Image; a {family.label} export keeps every "
                         f"double- and single-stream block. Fix: drop --layers")
    tdtype = ox.TORCH_DTYPES[dtype]
    t0 = time.perf_counter()
    with Steps("qkrope export", 7 if quant else 6, enabled=progress) as steps:
        with steps.step(f"loading {diffusers_dir} ({family.label}, {dtype})"):
            transformer = load_transformer(str(diffusers_dir), dtype=tdtype, quant=quant,
                                           variant=variant)
        fp8_table = None
        if quant is not None:
            from . import quantize

            fp8_table = quantize.linear_fp8_table(transformer)
        cfg = dict(transformer.config)
        head_dim = int(cfg["attention_head_dim"])
        axes = tuple(int(v) for v in cfg["axes_dims_rope"])
        theta = float(transformer.pos_embed.theta)  # the value diffusers built the model with
        theta = int(theta) if theta.is_integer() else theta
        rotary_dim = sum(axes)
        if rotary_dim != head_dim:
            raise InputError(f"axes_dims_rope {list(axes)} sums to {rotary_dim}, not "
                             f"attention_head_dim={head_dim}: FLUX rotates the whole head")
        guided = has_guidance(transformer)
        decl = family.decl(guided)
        wrapper = cache_input_flux(transformer, family, rounding=rounding)
        n_nodes = flux_node_count(transformer)
        eps = float(transformer.transformer_blocks[0].attn.norm_q.eps)
        args = _sample_args(family, transformer, sample, tdtype, theta, axes, head_dim, guided)
        blocks = (f"{len(transformer.transformer_blocks)} double + "
                  f"{len(transformer.single_transformer_blocks)} single blocks")
        with (quantize.quantizers_disabled(transformer) if quant else contextlib.nullcontext()):
            model = ox._torch_export(
                wrapper, args, decl.input_names, decl.output_names, opset,
                parameters_of="transformer", steps=steps, attention=attention,
                what=f"{family.label}: {blocks} (sample {sample.img_shapes}, {sample.txt_len} "
                     f"text tokens, batch {sample.batch}; {attention} attention, opset {opset})")
        state = {k: v for k, v in transformer.state_dict().items()
                 if quantization.QUANTIZER_MARK not in k}
        not_in_graph = ox.check_parameters(model, state)
        check_no_double(model)
        quant_record = None
        if fp8_table is not None:
            with steps.step(f"FP8 Q/DQ on {len(fp8_table)} quantised Linear layers"):
                quant_record = quantize.apply_fp8(model, transformer, fp8_table)
        with steps.step(f"adding the QKNormRoPE function body ({n_nodes} nodes)"):
            ox.finalize_model(model, opset=opset, head_dim=head_dim, rotary_dim=rotary_dim,
                              expected_nodes=n_nodes)
        attributes = contract.NodeAttributes(eps, contract.DEFAULT_INTERLEAVED, wrapper.rounding)
        config = ModelConfig(
            dim=int(cfg["num_attention_heads"]) * head_dim,
            heads=int(cfg["num_attention_heads"]), head_dim=head_dim, rotary_dim=rotary_dim,
            axes_dims_rope=list(axes), family=family.name, rope_theta=theta, seed=0,
            dtype=dtype, diffusers_dir=str(Path(diffusers_dir).resolve()),
            diffusers_config=ox.diffusers_config_record(cfg), attention=attention,
            parameters=[k for k in state if k not in not_in_graph
                        and (quant_record is None or k in model.graph.initializers)],
            parameters_not_in_graph=not_in_graph)
        if quant_record is not None:
            config.quantization = quant_record
        config.parameter_shapes = ox._shapes(transformer.state_dict(), config.parameters)
        info, written = ox._write_outputs(model, out, dict(
            model="transformer", opset=opset, ir_version=ox.ir_version_for(opset), dtype=dtype,
            dynamic_axes={}, node_attributes=attributes, config=config,
            sample=ox._sample_dict(sample), versions=ox._versions(("diffusers",)),
            axis_values=ox._axis_values(sample)), steps, decl=decl)
        steps.note(f"done in {time.perf_counter() - t0:.1f} s: {', '.join(map(str, written))}")
    return info, written


__all__: Sequence[str] = ["check_no_double", "export_flux_transformer", "sample_ids"]
