"""``qkrope demo``: the main job on the built-in default, end to end.

1. caches    build Qwen-Image's RoPE caches for a 1024x1024 image + 512 text tokens, spec checks
2. diffusers QwenImageAttention (fused op) vs diffusers' attention, same random weights
3. export    the Qwen-Image attention block (24 heads x 128, --dtype fp32: random weights have
             no stored dtype) to ONNX
4. check     polygraphy: ONNX Runtime vs the PyTorch reference
5. pipeline  a tiny random diffusers QwenImagePipeline (true CFG, non-square) run on the PyTorch
             transformer and on its ONNX export (no --dtype: the checkpoint's, fp32 as the
             tiny model is saved) through load_transformer: latents compared, the
             two images written as PNGs side by side (out/pipeline/image_{pytorch,onnx}.png)
6. fp8       FP8 on the tiny transformer: calibration inputs recorded from a tiny pipeline run
             (CalibrationRecorder), `qkrope quantize` (ModelOpt), `qkrope export --quant fp8`,
             `qkrope check` against ModelOpt's fake-quant model, the tiny pipeline on the export
7. plugin    build the CUDA kernel + TensorRT plugin libraries (CPU kernel build at least)
8. engine    [TensorRT + GPU] engines with the plugin: from the fp32 export, and from a bf16
             export (the deployment precision; TensorRT 11 networks are strongly typed)
9. trt-check [TensorRT + GPU] polygraphy: fp32 engine vs ONNX Runtime vs PyTorch; bf16 engine vs
             PyTorch (and ONNX Runtime when its CUDA provider is installed: its CPU provider
             has no bf16 MatMul)
10. fp8-engine [TensorRT + GPU of compute capability 8.9+] the FP8 export built (strongly typed,
             FP8 and plugin layers verified by the engine inspector)
11. bench    [GPU] fused plugin vs function body vs eager vs torch.compile

Steps that need what this machine lacks are reported as SKIPPED with the reason; a failed step
makes the exit status non-zero.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class StepResult:
    name: str
    status: str  # "ok" | "SKIPPED" | "FAILED"
    seconds: float
    detail: str


class Skip(Exception):
    """Raised by a step that cannot run on this machine; the message is the reason."""


def _cli(argv: list[str]) -> None:
    from qkrope import cli

    print(f"\n$ qkrope {' '.join(argv)}", flush=True)
    code = cli.main(argv)
    if code != 0:
        raise RuntimeError(f"`qkrope {' '.join(argv)}` exited with status {code}")


def gpu_reasons() -> list[str]:
    """Why the TensorRT/GPU steps cannot run here (empty when they can)."""
    reasons = []
    import torch

    if not torch.cuda.is_available():
        reasons.append("requires CUDA (torch.cuda.is_available() is False: no GPU or a CPU build "
                       "of torch)")
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        reasons.append(f"requires TensorRT (import tensorrt failed: {exc}; install TensorRT's "
                       f"Python bindings or use an NGC TensorRT container)")
    return reasons


def step_caches(args) -> str:
    from qkrope.runtime import build_qwen_rope_caches

    caches = build_qwen_rope_caches([(1, 64, 64)], 512)
    small = build_qwen_rope_caches([(1, 4, 4)], 3)
    assert abs(small.img[5, 8].item() - math.cos(-1)) < 1e-7, "spec check value img[5, 8]"
    assert abs(small.img[5, 72].item() - math.sin(-1)) < 1e-7, "spec check value img[5, 72]"
    return (f"img {tuple(caches.img.shape)} + txt {tuple(caches.txt.shape)} fp32 for 1024x1024 + "
            f"512 text tokens; spec check values hold")


def step_diffusers(args) -> str:
    import torch

    from qkrope import contract
    from qkrope._deps import require
    from qkrope.export import QwenImageAttention
    from qkrope.runtime import build_qwen_rope_caches

    qwen = require("diffusers.models.transformers.transformer_qwenimage",
                   "the diffusers parity step")
    from diffusers.models.attention_processor import Attention

    heads, head_dim = args.heads, args.head_dim
    dim = heads * head_dim
    torch.manual_seed(0)
    attn = Attention(query_dim=dim, cross_attention_dim=None, added_kv_proj_dim=dim,
                     dim_head=head_dim, heads=heads, out_dim=dim, context_pre_only=False,
                     bias=True, processor=qwen.QwenDoubleStreamAttnProcessor2_0(),
                     qk_norm="rms_norm", eps=contract.DEFAULT_EPS).eval()
    from qkrope.runtime.caches import default_axes_dims

    axes = default_axes_dims(head_dim)
    shapes, txt = [(1, 8, 8)], 16
    from qkrope.model_io import ATTENTION_BLOCK

    rope = qwen.QwenEmbedRope(theta=ATTENTION_BLOCK.theta, axes_dim=list(axes), scale_rope=True)
    freqs = rope([shapes], max_txt_seq_len=txt, device=torch.device("cpu"))
    hs, ehs = torch.randn(1, 64, dim), torch.randn(1, txt, dim)
    with torch.no_grad():
        ref = attn(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=freqs)
        out = QwenImageAttention.from_diffusers(attn)(
            hs, ehs, build_qwen_rope_caches(shapes, txt, axes_dim=axes))
    err = max((a - b).abs().max().item() for a, b in zip(ref, out))
    if err > 1e-5:
        raise RuntimeError(f"QwenImageAttention differs from diffusers by {err:.3g} (> 1e-5)")
    return f"{heads}x{head_dim} fp32, 64 image + 16 text tokens: max abs error {err:.2g} (<= 1e-5)"


def step_export(args) -> str:
    _cli(["export", "--model", "attention", "--heads", str(args.heads), "--head-dim",
          str(args.head_dim), "--dtype", "fp32", "--out", str(args.onnx)])
    size = sum(p.stat().st_size for p in args.onnx.parent.glob(args.onnx.name + "*"))
    return f"{args.onnx} ({size / 1e6:.0f} MB with its sidecar/data)"


def step_check(args) -> str:
    _cli(["check", str(args.onnx)])
    return "ONNX Runtime matches the PyTorch reference (table above)"


def step_pipeline(args) -> str:
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise Skip(f"requires diffusers and transformers ({exc}; pip install -e '.[test]')") from None
    import torch

    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer

    d = args.out / "pipeline"
    d.mkdir(parents=True, exist_ok=True)
    model = tp.tiny_transformer()
    tp.save_transformer(model, d / "transformer")
    onnx_path = d / "transformer.onnx"
    _cli(["export", "--model", "transformer", "--diffusers", str(d / "transformer"),
          "--out", str(onnx_path)])
    vae = tp.tiny_vae()
    ref, ours = tp.pipeline(model, vae), tp.pipeline(model, vae)
    ours.transformer = load_transformer(onnx_path)
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    ne, nm = tp.prompt_embeds(1, 5, seed=2)
    cfg = 4.0
    kw = dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne,
              negative_prompt_embeds_mask=nm, true_cfg_scale=cfg, height=64, width=96,
              num_inference_steps=4)
    latents, pngs = {}, []
    for name, pipe in (("pytorch", ref), ("onnx", ours)):
        pipe.set_progress_bar_config(disable=True)
        latents[name] = pipe(**kw, output_type="latent",
                             generator=torch.Generator().manual_seed(0)).images
        image = pipe(**kw, output_type="pil", generator=torch.Generator().manual_seed(0)).images[0]
        pngs.append(d / f"image_{name}.png")
        image.save(pngs[-1])
    diff = float((latents["onnx"] - latents["pytorch"]).abs().max())
    bound = tp.latent_bound(latents["pytorch"], cfg)
    if diff > bound:
        raise RuntimeError(f"pipeline latents on the exported transformer differ from PyTorch by "
                           f"{diff:.3g} (bound {bound:.3g})")
    import json

    dtype = json.loads((d / "transformer.onnx.json").read_text())["dtype"]
    return (f"QwenImagePipeline (tiny random, true CFG {cfg:g}, 64x96, 4 steps): the {dtype} "
            f"export (the checkpoint's dtype); pipe.transformer = "
            f"load_transformer({onnx_path.name}) gives latents within {diff:.2g} of PyTorch "
            f"(bound {bound:.2g}); images {pngs[0]} and {pngs[1]}")


def step_fp8(args) -> str:
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
        import modelopt.torch.quantization  # noqa: F401
    except ImportError as exc:
        raise Skip(f"requires diffusers, transformers and nvidia-modelopt ({exc}; pip install "
                   f"-e '.[test]' or '.[fp8]')") from None
    import torch

    from qkrope.apps import tiny_pipeline as tp
    from qkrope.export.quantize import CalibrationRecorder
    from qkrope.runtime import load_transformer

    d = args.out / "fp8"
    d.mkdir(parents=True, exist_ok=True)
    model = tp.tiny_transformer()
    tp.save_transformer(model, d / "transformer")
    vae = tp.tiny_vae()
    pipe = tp.pipeline(model, vae)
    pipe.set_progress_bar_config(disable=True)
    pe, pm = tp.prompt_embeds(2, 7, seed=11, pad=2)
    with CalibrationRecorder(pipe.transformer) as rec:  # the documented calibration hook
        pipe(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32,
             num_inference_steps=4, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    rec.save(d / "calib.pt")
    _cli(["quantize", "--diffusers", str(d / "transformer"), "--calibration",
          str(d / "calib.pt"), "--out", str(d / "transformer_fp8"), "--device", "cpu"])
    args.onnx_fp8 = d / "transformer_fp8.onnx"
    _cli(["export", "--model", "transformer", "--diffusers", str(d / "transformer_fp8"),
          "--quant", "fp8", "--out", str(args.onnx_fp8)])
    _cli(["check", str(args.onnx_fp8)])
    ours = tp.pipeline(model, vae)
    ours.set_progress_bar_config(disable=True)
    ours.transformer = load_transformer(args.onnx_fp8)
    kw = dict(prompt_embeds=pe[:1], prompt_embeds_mask=pm[:1], height=32, width=32,
              num_inference_steps=2, output_type="latent")
    got = ours(**kw, generator=torch.Generator().manual_seed(0)).images
    flt = pipe(**kw, generator=torch.Generator().manual_seed(0)).images
    if not torch.isfinite(got).all():
        raise RuntimeError("the tiny pipeline on the FP8 export produced non-finite latents")
    return (f"{len(rec.batches)} recorded calls -> {args.onnx_fp8.name}: check passed against "
            f"ModelOpt's fake-quant model; tiny pipeline on it: latents differ from the float "
            f"pipeline by {float((got - flt).abs().max()):.3g} (the quantisation, reported)")


def step_fp8_engine(args) -> str:
    _need_gpu()
    onnx_fp8 = getattr(args, "onnx_fp8", None)
    if onnx_fp8 is None or not Path(onnx_fp8).is_file():
        raise Skip("the fp8 step wrote no FP8 export")
    engine = Path(onnx_fp8).with_suffix(".engine")
    _cli(["build", str(onnx_fp8), "-o", str(engine)])
    return f"{engine} (FP8 and plugin layers verified by the engine inspector)"


def step_plugin(args) -> str:
    from qkrope.runtime.plugin_build import (DEPLOY_ARCH, LIBRARY_FILES, built_architectures,
                                             find_nvcc, find_plugin_library)

    nvcc = find_nvcc()
    _cli(["build-plugin"] if nvcc else ["build-plugin", "--host-only"])
    built = []
    for kind in ("plugin", "vc", "kernels", "kernel_host"):
        try:
            built.append(find_plugin_library(kind).name)
        except (FileNotFoundError, ValueError):
            pass
    if not built:
        raise RuntimeError("the build finished but no library was found in build/plugins")
    missing = sorted({LIBRARY_FILES[kind][0] for kind in ("plugin", "vc", "kernels")}
                     - set(built))
    if not nvcc:
        raise Skip(f"requires nvcc (the CUDA toolkit) for {', '.join(missing)}; built only "
                   f"{', '.join(built)} (the CPU build of the kernel arithmetic)")
    if missing:
        raise Skip(f"requires TensorRT headers for {', '.join(missing)} (install TensorRT or let "
                   f"scripts/fetch_trt_headers.py reach PyPI); built {', '.join(built)}")
    archs = built_architectures()
    if archs and "virtual" in archs:
        return (f"{', '.join(built)}; device code: PTX only ({archs}): no GPU here to run SASS on; "
                f"the deployable fat binary: qkrope build-plugin --arch {DEPLOY_ARCH}")
    return f"{', '.join(built)} (CUDA architectures {archs})"


def _need_gpu():
    reasons = gpu_reasons()
    if reasons:
        raise Skip("; ".join(reasons))


def step_engine(args) -> str:
    _need_gpu()
    _cli(["export", "--model", "attention", "--heads", str(args.heads), "--head-dim",
          str(args.head_dim), "--dtype", "bf16", "--out", str(args.onnx_bf16)])
    _cli(["build", str(args.onnx), "-o", str(args.engine_fp32)])
    _cli(["build", str(args.onnx_bf16), "-o", str(args.engine)])
    return f"{args.engine_fp32}, {args.engine}"


def step_trt_check(args) -> str:
    _need_gpu()
    from qkrope.runtime.plugin_build import find_plugin_library

    import onnxruntime as ort

    plugin = str(find_plugin_library("plugin"))
    _cli(["check", str(args.onnx), "--engine", str(args.engine_fp32), "--plugin", plugin])
    argv = ["check", str(args.onnx_bf16), "--engine", str(args.engine), "--plugin", plugin]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        argv += ["--providers", "cuda"]
        against = "ONNX Runtime (CUDA) and the PyTorch reference"
    else:
        # ONNX Runtime's CPU provider has no bf16 MatMul: TensorRT vs PyTorch only
        argv += ["--no-onnxrt"]
        against = "the PyTorch reference (ONNX Runtime has no CUDA provider here)"
    _cli(argv)
    return (f"fp32 engine matches ONNX Runtime and the PyTorch reference; bf16 engine matches "
            f"{against}")


def step_bench(args) -> str:
    import torch

    if not torch.cuda.is_available():
        raise Skip("requires CUDA (the benchmark measures GPU latency and bandwidth; "
                   "`qkrope bench` alone reports the CPU ONNX Runtime numbers)")
    _cli(["bench", "--out", str(args.out / "bench")])
    return f"table and plot in {args.out / 'bench'}"


STEPS: list[tuple[str, Callable]] = [
    ("caches", step_caches),
    ("diffusers", step_diffusers),
    ("export", step_export),
    ("check", step_check),
    ("pipeline", step_pipeline),
    ("fp8", step_fp8),
    ("plugin", step_plugin),
    ("engine", step_engine),
    ("trt-check", step_trt_check),
    ("fp8-engine", step_fp8_engine),
    ("bench", step_bench),
]


def run(args: argparse.Namespace) -> int:
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.onnx = args.out / "qwen_attention.onnx"
    args.onnx_bf16 = args.out / "qwen_attention_bf16.onnx"
    args.engine = args.out / "qwen_attention_bf16.engine"
    args.engine_fp32 = args.out / "qwen_attention.engine"
    skip = set(args.skip or [])
    results: list[StepResult] = []
    failed_before: set[str] = set()
    print(f"qkrope demo: {len(STEPS)} steps into {args.out}: "
          f"{', '.join(name for name, _ in STEPS)}", flush=True)
    for name, fn in STEPS:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        if name in skip:
            results.append(StepResult(name, "SKIPPED", 0.0, "--skip on the command line"))
            print(f"SKIPPED: --skip {name}")
            continue
        needs = {"check": "export", "trt-check": "engine", "fp8-engine": "fp8"}.get(name)
        if needs in failed_before:
            results.append(StepResult(name, "SKIPPED", 0.0, f"step '{needs}' failed"))
            print(f"SKIPPED: step '{needs}' failed")
            continue
        try:
            detail = fn(args)
            status = "ok"
        except Skip as exc:
            status, detail = "SKIPPED", str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the job goes on
            status, detail = "FAILED", f"{type(exc).__name__}: {exc}"
            failed_before.add(name)
        dt = time.perf_counter() - t0
        results.append(StepResult(name, status, dt, detail))
        print(f"{status}: {detail}", flush=True)

    width = shutil.get_terminal_size((100, 20)).columns
    print("\n" + "=" * min(width, 100))
    print("qkrope demo summary")
    for r in results:
        print(f"  {r.name:<10} {r.status:<8} {r.seconds:7.1f} s  {r.detail}")
    failed = [r.name for r in results if r.status == "FAILED"]
    skipped = [r.name for r in results if r.status == "SKIPPED"]
    if skipped:
        print(f"skipped: {', '.join(skipped)} (reasons above)")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out", help="output folder (default: out/)")
    p.add_argument("--heads", type=int, default=24, help="attention heads (default: 24, Qwen-Image)")
    p.add_argument("--head-dim", type=int, default=128,
                   help="head size (default: 128, Qwen-Image)")
    p.add_argument("--skip", action="append", choices=[name for name, _ in STEPS],
                   help="skip a step (repeatable)")
    p.set_defaults(func=run)
    return p
