"""``qkrope build``: argument handling over :func:`qkrope.runtime.engine.build_engine`; a
pipeline export folder (``qkrope build OUT_DIR``): :mod:`qkrope.apps.build_stages`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from qkrope.runtime import profiles
from qkrope.runtime.engine import MAX_WORKSPACE_MIB
from qkrope.sidecars import LEVELS

from . import _args


def _tokens_help() -> str:
    """The families' pixels per token and RoPE position limits, from their records."""
    from qkrope import families

    records = families.records()
    per = sorted({r.pixels_per_token for r in records})
    text = (f"{per[0]} px per token for every family" if len(per) == 1 else
            "px per token: " + ", ".join(f"{r.short} {r.pixels_per_token}" for r in records))
    limited = [r for r in records if r.max_positions]
    for r in limited:
        text += (f"; a {r.short} model's must fit its {r.max_positions}-position RoPE tables "
                 f"with --txt-tokens' max")
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build",
        description="Build a TensorRT engine from an ONNX model exported by `qkrope export`. "
                    "The QKNormRoPE nodes become the fused plugin (the build fails if TensorRT "
                    "falls back to their function bodies). Profiles come from the model's sidecar "
                    f"(min 1 token, opt = the export sample, max = the --max-* flags or "
                    f"{profiles.DEFAULT_MAX_IMG_TOKENS} image + {profiles.DEFAULT_MAX_TXT_TOKENS} "
                    f"text tokens, batch {profiles.DEFAULT_MAX_BATCH}) unless --min/--opt/--max "
                    f"give them. Given a pipeline export folder (qkrope export --model pipeline "
                    f"-o OUT_DIR), it builds one engine per graph, each beside its ONNX file: "
                    f"the transformer's as above, and every text encoder and VAE graph with "
                    f"profiles over its dynamic axes batch, txt_tokens (min 1, opt = max = "
                    f"the pipeline's padded text length), latent_height and latent_width (min "
                    f"1, opt = max = the pipeline's default size, or each --resolutions preset, "
                    f"over the VAE's pixels per latent); --batch, --txt-tokens, --max-batch and "
                    f"--max-txt-tokens set those ranges too, and --min/--opt/--max take "
                    f"[STAGE.]AXIS:N there (e.g. --max text_encoder.txt_tokens:256).")
    p.add_argument("onnx", metavar="MODEL.onnx|OUT_DIR",
                   help="model written by `qkrope export`, or a pipeline export folder")
    p.add_argument("-o", "--output", metavar="MODEL.engine",
                   help="engine path (default: MODEL.engine next to the ONNX file); a sidecar "
                        "MODEL.engine.json is written next to it")
    _args.add_plugin(p, f"default: the one `qkrope build-plugin` built ({_args.VC_PLUGIN_FILE_NAME} "
                        f"with --version-compatible)")
    for level in LEVELS:
        p.add_argument(f"--{level}", dest=f"{level}_shapes", nargs="+", action="extend",
                       default=[], metavar="NAME:SHAPE",
                       help=f"{level} shape of an input, as NAME:DIMxDIMx... (trtexec's "
                            f"--{level}Shapes syntax) or NAME:[DIM,DIM,...] (polygraphy's "
                            f"--trt-{level}-shapes syntax); overrides the derived profile for "
                            f"that input")
    p.add_argument("--resolutions", metavar="WxH[,WxH...]",
                   help="resolution presets in pixels, e.g. 512x512,1024x1024,1328x1328: one "
                        "optimisation profile each (image tokens = W/16 * H/16: min 1, opt = max "
                        "= the preset); the runner picks the first profile holding a call's "
                        "shapes (" + _tokens_help() + "). Default for a whole transformer: "
                        "1024x1024")
    p.add_argument("--txt-tokens", metavar="MIN:MAX",
                   help=f"text-token range of every profile (default "
                        f"1:{profiles.DEFAULT_MAX_TXT_TOKENS}, or up to the export's text length)")
    p.add_argument("--batch", metavar="MIN:MAX",
                   help=f"batch range of every profile (default 1:{profiles.DEFAULT_MAX_BATCH}, "
                        f"a CFG pair)")
    p.add_argument("--refit", action="store_true",
                   help="build a refittable engine whose weights `qkrope refit` can replace "
                        "by diffusers parameter name (the exported parameters marked with "
                        "BuilderFlag.REFIT_INDIVIDUAL; every weight with BuilderFlag.REFIT where "
                        "that is not possible)")
    p.add_argument("--max-batch", type=int, help=f"profile max batch (default: max(export, "
                                                  f"{profiles.DEFAULT_MAX_BATCH}))")
    p.add_argument("--max-img-tokens", type=int,
                   help=f"profile max image tokens (default: max(export, "
                        f"{profiles.DEFAULT_MAX_IMG_TOKENS}) = 1024x1024)")
    p.add_argument("--max-txt-tokens", type=int,
                   help=f"profile max text tokens (default: max(export, "
                        f"{profiles.DEFAULT_MAX_TXT_TOKENS}))")
    p.add_argument("--timing-cache", metavar="FILE",
                   help="read and update a TensorRT timing cache (faster rebuilds); a file "
                        "that is not one (a model, an engine, a sidecar, text) is refused")
    p.add_argument("--version-compatible", action="store_true",
                   help="build a version-compatible engine with the VC plugin library serialised "
                        "into it")
    p.add_argument("--builder-optimization-level", type=int, choices=range(0, 6), metavar="0-5",
                   help="TensorRT builder optimisation level (default: TensorRT's, 3)")
    p.add_argument("--workspace", type=int, metavar="MiB",
                   help=f"workspace memory pool limit (at most {MAX_WORKSPACE_MIB} MiB = 1 TiB)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even when MODEL.engine is up to date (by default an engine whose "
                        "sidecar records the same model hash, build options, TensorRT version, "
                        "GPU and plugin hash is kept)")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre  # before the heavy imports: a wrong path answers at once

    if os.path.isdir(args.onnx):  # a pipeline export folder: an engine per graph
        from .build_stages import run as run_stages

        return run_stages(args)
    pre.onnx_model(args.onnx, command="build")
    _args.check_plugin(args)
    pre.file_to_write(args.timing_cache, flag="--timing-cache", example="timing.cache")
    pre.file_to_write(args.output, flag="-o", example=Path(args.onnx).with_suffix(".engine").name)

    from qkrope.runtime import engine
    from qkrope.sidecars import engine_sidecar_path

    onnx_path = Path(args.onnx)
    engine_path = Path(args.output) if args.output else onnx_path.with_suffix(".engine")
    opts = engine.BuildOptions(
        plugin=args.plugin,
        min_shapes=profiles.parse_shape_specs(args.min_shapes),
        opt_shapes=profiles.parse_shape_specs(args.opt_shapes),
        max_shapes=profiles.parse_shape_specs(args.max_shapes),
        max_batch=args.max_batch, max_img_tokens=args.max_img_tokens,
        max_txt_tokens=args.max_txt_tokens, timing_cache=args.timing_cache,
        version_compatible=args.version_compatible,
        builder_optimization_level=args.builder_optimization_level,
        workspace_mib=args.workspace, progress=not args.no_progress, verbose=args.verbose,
        resolutions=(profiles.parse_resolutions(args.resolutions)
                     if args.resolutions is not None else None),
        txt_tokens=profiles.parse_range(args.txt_tokens, "--txt-tokens"),
        batch=profiles.parse_range(args.batch, "--batch"), refit=args.refit, force=args.force)
    info = engine.build_engine(onnx_path, engine_path, opts)
    if getattr(info, "reused", False):
        print(f"kept {engine_path}: up to date (same model, build options, TensorRT "
              f"{info.tensorrt_version}, GPU and plugin); pass --force to rebuild it")
        return 0
    gpu = info.gpu or {}
    print(f"wrote {engine_path} (TensorRT {info.tensorrt_version}, "
          f"{gpu.get('name', 'GPU ?')} sm_{gpu.get('compute_capability', '?')}, "
          f"{info.plugin_layers} plugin layers"
          f"{', version-compatible' if info.version_compatible else ''}"
          f"{', refittable' if getattr(info, 'refittable', False) else ''}, "
          f"{len(getattr(info, 'profiles', None) or [0])} profile(s)) and "
          f"{engine_sidecar_path(engine_path)}")
    return 0
