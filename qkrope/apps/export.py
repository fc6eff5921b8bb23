"""``qkrope export``: argument handling over :mod:`qkrope.export.onnx_export`."""

from __future__ import annotations

import argparse

from qkrope import contract, families, quantization
from qkrope.model_io import ATTENTION_BLOCK
from qkrope.errors import InputError

from . import _args


def _file_prefix(record) -> str:
    """The default output name's family part: the sidecar's family name, "-" as "_"."""
    return record.name.replace("-", "_")


def _check_family_options(record, args: argparse.Namespace) -> None:
    """The options that depend on the family, checked from its record before the export
    starts: the Python API's check (qkrope.export.api.check_family_options), one home."""
    from qkrope.export import api

    api.check_family_options(record, args.diffusers, args.layers)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        description="qkrope export: the Qwen-Image attention block or a whole diffusers "
                    "transformer to ONNX (writes MODEL.onnx and MODEL.onnx.json), or a whole "
                    "diffusers pipeline to a pipeline folder whose model components are "
                    "exports (--model pipeline).")
    p.add_argument("--model", choices=("attention", "transformer", "pipeline"),
                   default="attention",
                   help="pipeline: every model component of the --diffusers pipeline folder "
                        "(the transformer, the text encoders as the family's pipeline reads "
                        "them, the VAE decoder; a causal video VAE frame by frame with its "
                        "feature cache as graph inputs and outputs) into the folder --out, "
                        "which diffusers loads as the same pipeline (import qkrope.runtime; "
                        "DiffusionPipeline.from_pretrained(OUT)): families "
                        + _args.or_list(r.short for r in families.records()
                                        if r.stages is not None))
    p.add_argument("--out", "-o", default=None,
                   help="output .onnx (default: <family>_<model>_<dtype>.onnx, the family "
                        f"{_args.or_list(_file_prefix(r) for r in families.records())}); "
                        "--model pipeline: the output folder (required; replaced whole, only "
                        "when new, empty or a previous pipeline export)")
    _args.add_dtype(p, "weights and activations (caches stay fp32); the engine's precision. "
                       "Default: a transformer's checkpoint dtype (the dtype its safetensors "
                       "headers store the weights in; mixed: the majority's), printed with the "
                       "reason; fp32 for the attention block",
                    default=None)
    p.add_argument("--opset", type=int, default=None,
                   help=f"ONNX opset, {contract.MIN_OPSET}..{contract.MAX_OPSET} (default "
                        f"{contract.DEFAULT_OPSET}; {contract.ATTENTION_MIN_OPSET['onnx23']} with "
                        f"--attention onnx23)")
    p.add_argument("--attention", choices=contract.ATTENTION_FORMS,
                   default=contract.DEFAULT_ATTENTION_FORM,
                   help="how softmax attention is written: primitive = MatMul, mask bias, "
                        "Softmax, MatMul (the pattern TensorRT fuses; any opset; default), "
                        "onnx23 = one opset-23 Attention node per block (ONNX Runtime 1.23+, "
                        "TensorRT 10.14+)")
    p.add_argument("--img-shape", nargs=3, type=int, action="append", metavar=("F", "H", "W"),
                   help="sample image in latent patches; repeat for edit condition images")
    p.add_argument("--txt-len", type=int, default=None, help="sample text tokens")
    p.add_argument("--batch", type=int, default=None, help="sample batch (traced with >= 2)")
    _args.add_rounding(p, usage="0: one rounding at the end; 1: diffusers' eager order; a "
                                "transformer without it: its model family's")
    p.set_defaults(rounding=None)  # the family's (its record, qkrope.families) unless given
    a = p.add_argument_group("attention block (--model attention)")
    a.add_argument("--heads", type=int, default=None,
                   help=f"default: {ATTENTION_BLOCK.heads} (model_io.ATTENTION_BLOCK)")
    a.add_argument("--head-dim", type=int, default=None,
                   help=f"default: {ATTENTION_BLOCK.head_dim} (model_io.ATTENTION_BLOCK)")
    a.add_argument("--rotary-dim", type=int, default=None, help="default: head_dim")
    a.add_argument("--neox", action="store_true", help="NeoX pairing (j, j + rd/2)")
    a.add_argument("--eps", type=float, default=None,
                   help=f"RMSNorm epsilon (default: {contract.DEFAULT_EPS:g})")
    a.add_argument("--weights", default=None,
                   help="safetensors / torch state dict with diffusers names (default: seeded "
                        "random weights)")
    a.add_argument("--seed", type=int, default=None,
                   help="seed of the random weights (default: 0)")
    t = p.add_argument_group("transformer (--model transformer)")
    t.add_argument("--diffusers", metavar="DIR", default=None,
                   help="(--model pipeline: the saved pipeline folder, model_index.json) "
                        "local folder of a saved diffusers transformer: "
                        + _args.or_list(f"{r.class_name} ({r.short})" for r in families.records()))
    t.add_argument("--layers", type=int, default=None,
                   help=f"keep the first N blocks (default all; "
                        f"{_args.or_list(r.short for r in families.records() if r.blocks)} only). The "
                        "export is "
                        "streamed: the graph is traced without the weights and each initializer "
                        "read from the shards as it is written, so its memory does not grow "
                        "with the model; --layers N of the real model's folder writes (and "
                        "reads) only those blocks' weights: the way to try the real model on a "
                        "small machine or disk")
    t.add_argument("--quant", choices=quantization.QUANT_MODES, default=None,
                   help="fp8: export a folder quantised with ModelOpt (`qkrope quantize`) with "
                        "FP8 Q/DQ (float8e4m3fn weights behind DequantizeLinear; opset >= 19, "
                        "default 19). A quantised folder is refused without it")
    t.add_argument("--variant", default=None, metavar="NAME",
                   help="diffusers weights variant of --diffusers (e.g. fp16: "
                        "diffusion_pytorch_model.fp16.safetensors or its indexed shards)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qkrope import _preflight as pre

    # the arguments, then the paths, all before torch: a mistake answers at once
    attention_only = {"--heads": args.heads, "--head-dim": args.head_dim,
                      "--rotary-dim": args.rotary_dim, "--neox": args.neox or None,
                      "--eps": args.eps, "--weights": args.weights, "--seed": args.seed}
    if args.model == "pipeline":
        return _run_pipeline(args, attention_only)
    if args.model == "transformer":
        given = [flag for flag, value in attention_only.items() if value is not None]
        if given:
            raise InputError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to "
                             f"--model attention only; a transformer's sizes, epsilon and "
                             f"weights come from its --diffusers folder")
        if not args.diffusers:
            raise InputError(f"--model transformer needs --diffusers DIR (a local saved "
                             f"{_args.or_list(r.short for r in families.records())} transformer)")
    elif args.diffusers or args.layers or args.variant or args.quant:
        raise InputError("--diffusers/--layers/--variant/--quant apply to --model transformer")
    pre.input_dir(args.diffusers, flag="--diffusers",
                  fix="pass the local folder of a saved diffusers transformer (config.json "
                      "and its weights; nothing is downloaded)")
    pre.input_file(args.weights, flag="--weights",
                   fix="pass a safetensors file or a torch state dict with diffusers' attention "
                       "names")
    if args.out is not None:
        pre.file_to_write(args.out, flag="--out", example="model.onnx")
        if Path(args.out).suffix.lower() != ".onnx":
            raise InputError(f"--out must end in .onnx; got {args.out!r}. Fix: --out "
                             f"{Path(args.out).with_suffix('.onnx')}")

    if args.model == "transformer":
        from qkrope.diffusers_weights import folder_family

        # the family from config.json (no torch): its options checked before any work
        _check_family_options(folder_family(args.diffusers), args)

    if args.model == "transformer":
        from qkrope.export import api  # the defaults' home, shared with the Python API

        result = api.export_transformer(
            args.diffusers, args.out, dtype=args.dtype, layers=args.layers, opset=args.opset,
            rounding=args.rounding, attention=args.attention, img_shapes=args.img_shape,
            txt_len=args.txt_len, batch=args.batch, quant=args.quant, variant=args.variant,
            progress=True)
        written = result.paths
    else:
        from qkrope.export import onnx_export  # torch, onnx, onnxscript: only when exporting

        dtype = args.dtype or "fp32"
        out = args.out or f"qwen_image_attention_{dtype}.onnx"
        info, written = onnx_export.export_attention(
            out, dtype=dtype, opset=args.opset, img_shapes=args.img_shape, txt_len=args.txt_len,
            batch=args.batch, attention=args.attention,
            heads=ATTENTION_BLOCK.heads if args.heads is None else args.heads,
            head_dim=ATTENTION_BLOCK.head_dim if args.head_dim is None else args.head_dim,
            rotary_dim=args.rotary_dim,
            eps=contract.DEFAULT_EPS if args.eps is None else args.eps,
            interleaved=not args.neox, weights=args.weights,
            seed=0 if args.seed is None else args.seed, progress=True,
            rounding=contract.DEFAULT_ROUNDING if args.rounding is None else args.rounding)
    for path in written:
        print(path)
    return 0


def _run_pipeline(args: argparse.Namespace, attention_only: dict) -> int:
    """--model pipeline: its arguments checked before torch, then the export."""
    from qkrope import _preflight as pre
    from qkrope.export import api

    transformer_only = {"--layers": args.layers, "--quant": args.quant,
                        "--variant": args.variant, "--img-shape": args.img_shape,
                        "--txt-len": args.txt_len, "--batch": args.batch,
                        "--rounding": args.rounding}
    if args.attention != api.DEFAULTS["attention"]:
        transformer_only["--attention"] = args.attention
    given = [f for f, v in {**attention_only, **transformer_only}.items() if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to "
                         f"--model attention or transformer; --model pipeline exports each "
                         f"stage at its defaults. Fix: leave {given[0]} out")
    if not args.diffusers or not args.out:
        raise InputError("--model pipeline needs --diffusers PIPELINE_DIR (a saved diffusers "
                         "pipeline folder) and --out OUT_DIR (the folder to write)")
    pre.input_dir(args.diffusers, flag="--diffusers",
                  fix="pass the local folder of a saved diffusers pipeline (model_index.json "
                      "and its components; nothing is downloaded)")
    from qkrope.export.stages import pipeline

    pipeline.plan(args.diffusers)  # the family, its stages and components: one line, no torch
    from pathlib import Path

    pipeline.check_out(Path(args.diffusers), Path(args.out))
    result = pipeline.export_pipeline(args.diffusers, args.out, dtype=args.dtype,
                                      opset=args.opset, progress=True)
    print(result.out)
    return 0
