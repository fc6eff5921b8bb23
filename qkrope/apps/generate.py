"""``qkrope generate``: a saved diffusers pipeline folder from a prompt to an image (or video)
file, the transformer on an export or engine (the drop-in, :func:`qkrope.runtime.load_transformer`)
and the rest (text encoders, scheduler, VAE) in PyTorch, with the time of each stage.

    qkrope generate PIPELINE_DIR --transformer transformer.onnx --prompt "a cat" -o cat.png

The pipeline is loaded with ``DiffusionPipeline.from_pretrained(PIPELINE_DIR, transformer=None)``
(its own transformer is never read; ``--transformer pytorch`` loads and runs it instead, the
baseline) and called with what it takes of ``--steps``, ``--height``, ``--width``,
``--guidance-scale``, ``--true-cfg-scale``, ``--negative-prompt`` and the seed. The stages are
timed as TensorRT's diffusion demo reports them: the text encoders (every ``text_encoder*``
component's forward), the denoising loop (each step, from the pipeline's
``callback_on_step_end``, and the transformer's calls), the VAE (its ``decode``), and the whole
call; on CUDA each time is taken after a synchronise. Loading the pipeline and the transformer is
timed apart from the call.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qkrope.errors import InputError

from . import _args

#: output suffixes: an image file per image, or frames to an animated/video file
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".gif", ".mp4")
PYTORCH = "pytorch"  # --transformer value: the pipeline's own transformer (the baseline)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        description="qkrope generate: run a saved diffusers pipeline folder from a prompt to an "
                    "image or video file, the transformer on an export or engine (the "
                    "drop-in) and the rest in PyTorch, and print the time of each stage (text "
                    "encoders, denoising steps, VAE).")
    p.add_argument("pipeline", metavar="PIPELINE_DIR",
                   help="local folder of a saved diffusers pipeline (model_index.json; nothing "
                        "is downloaded)")
    p.add_argument("--transformer", required=True, metavar="M.onnx|M.engine|pytorch",
                   help="the exported transformer (ONNX Runtime) or engine (TensorRT) that "
                        "stands in for the pipeline's; 'pytorch': the pipeline's own (baseline)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--out", "-o", required=True,
                   help=f"the file to write: {', '.join(IMAGE_SUFFIXES)} (one image; several "
                        f"are numbered NAME_1.png, ...) or {', '.join(VIDEO_SUFFIXES)} (a "
                        f"video pipeline's frames)")
    p.add_argument("--steps", type=int, default=None,
                   help="num_inference_steps (default: the pipeline's)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--guidance-scale", type=float, default=None,
                   help="guidance_scale, where the pipeline takes it")
    p.add_argument("--true-cfg-scale", type=float, default=None,
                   help="true_cfg_scale, where the pipeline takes it")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--device", default=None,
                   help="device of the PyTorch parts and of the drop-in's outputs (default: "
                        "cuda where available, else cpu)")
    _args.add_dtype(p, "dtype of the PyTorch parts (default: the export's; with --transformer "
                       "pytorch: fp32)", default=None)
    from qkrope.runtime.plugin_build import DEFAULT_PLUGIN_HELP

    _args.add_plugin(p, f"for an engine ({DEFAULT_PLUGIN_HELP})")
    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

@dataclass
class StageTimes:
    """Seconds per stage of one pipeline call (lists: one entry per call or step)."""

    load_pipeline: float = 0.0
    load_transformer: float = 0.0
    text_encoders: list = field(default_factory=list)
    transformer_calls: list = field(default_factory=list)
    transformer_starts: list = field(default_factory=list)  # clock time of each call's start
    steps: list = field(default_factory=list)
    vae: list = field(default_factory=list)
    total: float = 0.0

    def table(self) -> list[str]:
        ms = lambda s: f"{1e3 * s:10.1f} ms"  # noqa: E731
        denoise = sum(self.steps)
        rows = [("load pipeline (PyTorch parts)", ms(self.load_pipeline), ""),
                ("load transformer", ms(self.load_transformer), ""),
                ("text encoders", ms(sum(self.text_encoders)),
                 f"{len(self.text_encoders)} call(s)"),
                ("denoising", ms(denoise),
                 f"{len(self.steps)} step(s), {1e3 * denoise / max(len(self.steps), 1):.1f} "
                 f"ms/step; transformer {1e3 * sum(self.transformer_calls):.1f} ms in "
                 f"{len(self.transformer_calls)} call(s)"),
                ("VAE decode", ms(sum(self.vae)), f"{len(self.vae)} call(s)"),
                ("pipeline call", ms(self.total), "")]
        return [f"  {name:<30}{value}  {note}".rstrip() for name, value, note in rows]


class _Clock:
    """``now()``: seconds, after a CUDA synchronise when the work runs on CUDA (kernels are
    asynchronous: a time taken before they finish measures their launch)."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)).startswith("cuda")

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


def _timed(fn: Callable, into: list, clock: _Clock, starts: list | None = None) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = clock.now()
        if starts is not None:
            starts.append(t0)
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(clock.now() - t0)

    return wrapper


def _module_call(owner) -> bool:
    """Whether calling ``owner`` goes through torch's Module.__call__ (and so runs its forward
    hooks)."""
    import torch

    return getattr(type(owner), "__call__", None) is torch.nn.Module.__call__


@contextlib.contextmanager
def timing_hooks(pipe, times: StageTimes, clock: _Clock):
    """Time the pipeline's stages while the context is open: the text encoders' forward (torch
    hooks), the transformer's calls and the VAE's ``decode`` (wrapped on the instance)."""
    undo = []
    for name, component in pipe.components.items():
        if not name.startswith("text_encoder") or component is None:
            continue
        if hasattr(component, "register_forward_pre_hook"):
            start = {}

            def pre(module, args, start=start):
                start["t"] = clock.now()

            def post(module, args, output, start=start):
                times.text_encoders.append(clock.now() - start.pop("t"))

            undo += [component.register_forward_pre_hook(pre).remove,
                     component.register_forward_hook(post).remove]
    for owner, attr, into, starts in (
            (pipe.transformer, "forward", times.transformer_calls, times.transformer_starts),
            (pipe.vae, "decode", times.vae, None)):
        if owner is None or not hasattr(owner, attr):
            continue
        if hasattr(owner, "register_forward_pre_hook") and attr == "forward" \
                and _module_call(owner):  # a drop-in's own __call__ skips torch's hooks
            start = {}

            def pre(module, args, start=start, starts=starts):
                start["t"] = clock.now()
                starts.append(start["t"])

            def post(module, args, output, start=start, into=into):
                into.append(clock.now() - start.pop("t"))

            undo += [owner.register_forward_pre_hook(pre).remove,
                     owner.register_forward_hook(post).remove]
            continue
        had = attr in vars(owner)
        original = getattr(owner, attr)
        setattr(owner, attr, _timed(original, into, clock, starts))

        def restore(owner=owner, attr=attr, had=had, original=original):
            if had:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)

        undo.append(restore)
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def _call_kwargs(pipe, options: dict) -> dict:
    """The options the pipeline's ``__call__`` takes (None: left to the pipeline); one it does
    not take is refused naming the flag."""
    params = inspect.signature(pipe.__call__).parameters
    kwargs = {}
    for (flag, name), value in options.items():
        if value is None:
            continue
        if name not in params:
            raise InputError(f"{type(pipe).__name__} takes no {name}, so {flag} does not apply "
                             f"to it. Fix: leave {flag} out")
        kwargs[name] = value
    return kwargs


def generate(pipeline_dir: str | Path, transformer: str | Path, prompt: str, *,
             negative_prompt: str | None = None, steps: int | None = None,
             height: int | None = None, width: int | None = None,
             guidance_scale: float | None = None, true_cfg_scale: float | None = None,
             seed: int = 0, device: str | None = None, dtype: str | None = None,
             plugin: str | None = None, output_type: str = "pil", log=print):
    """Run the pipeline in ``pipeline_dir`` once with ``transformer`` (an export or engine path,
    or ``"pytorch"``); returns ``(the pipeline's output, StageTimes, the pipeline)``."""
    import torch

    from qkrope._deps import require

    diffusers = require("diffusers", "qkrope generate")
    from qkrope import dtypes
    from qkrope.runtime.caches import checked_device

    transformer = str(transformer)
    dev = checked_device(device if device is not None
                         else ("cuda" if torch.cuda.is_available() else "cpu"))
    times = StageTimes()
    clock = _Clock(dev)
    dropin = None
    if transformer != PYTORCH:
        from qkrope.runtime import load_transformer

        t0 = clock.now()
        dropin = load_transformer(transformer, plugin=plugin, device=dev)
        times.load_transformer = clock.now() - t0
    if dtype is None:  # the export's (the drop-in's inputs), else fp32
        dtype = dtypes.SHORT_BY_NAME.get(str(dropin.dtype).replace("torch.", ""), "fp32") \
            if dropin is not None else "fp32"
    t0 = clock.now()
    extra = {} if dropin is None else {"transformer": None}
    try:
        with warnings.catch_warnings():  # diffusers 0.42 renames torch_dtype; 0.36 has only it
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = diffusers.DiffusionPipeline.from_pretrained(
                str(pipeline_dir), torch_dtype=dtypes.TORCH_BY_SHORT[dtype], **extra)
    except (OSError, ValueError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(f"{pipeline_dir} is not a loadable diffusers pipeline folder ({first}). "
                         f"Fix: pass the folder a pipeline was saved to (save_pretrained: "
                         f"model_index.json and its components)") from None
    pipe.to(dev)
    times.load_pipeline = clock.now() - t0
    if dropin is not None:
        pipe.transformer = dropin
    pipe.set_progress_bar_config(disable=True)
    options = {("--negative-prompt", "negative_prompt"): negative_prompt,
               ("--steps", "num_inference_steps"): steps, ("--height", "height"): height,
               ("--width", "width"): width, ("--guidance-scale", "guidance_scale"): guidance_scale,
               ("--true-cfg-scale", "true_cfg_scale"): true_cfg_scale}
    kwargs = _call_kwargs(pipe, options)
    marks: list[float] = []
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        def on_step_end(_pipe, _i, _t, callback_kwargs):
            marks.append(clock.now())
            return callback_kwargs

        kwargs["callback_on_step_end"] = on_step_end
    where = "PyTorch" if transformer == PYTORCH else Path(transformer).name
    log(f"qkrope generate: {type(pipe).__name__} from {pipeline_dir} on {dev} ({dtype}), "
        f"transformer: {where}")
    with timing_hooks(pipe, times, clock), torch.no_grad():
        start = clock.now()
        output = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed),
                      output_type=output_type, **kwargs)
        times.total = clock.now() - start
    if marks and times.transformer_starts:
        # each step: from the end of the one before, the first from the transformer's first call
        times.steps = [b - a for a, b in zip([times.transformer_starts[0]] + marks[:-1], marks)]
    else:
        times.steps = list(times.transformer_calls)
    return output, times, pipe


def _save_image(image, path: Path, **params) -> None:
    """``image`` (PIL) to ``path`` atomically (encoded in memory, then a temp file renamed), in
    the format its suffix names."""
    import io

    from PIL import Image

    from qkrope._fileio import write_atomic

    buf = io.BytesIO()
    image.save(buf, format=Image.registered_extensions()[path.suffix.lower()], **params)
    write_atomic(path, buf.getbuffer())


def write_output(output, out: Path) -> list[Path]:
    """The images (``output.images``) or frames (``output.frames``) to ``out``, each file
    written whole or not at all (a temp name renamed)."""
    import os

    frames = getattr(output, "frames", None)
    images = getattr(output, "images", None)
    suffix = out.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        seq = list(frames[0] if frames is not None else images)
        if suffix == ".gif":
            _save_image(seq[0], out, save_all=True, append_images=seq[1:], duration=100, loop=0)
        else:
            from diffusers.utils import export_to_video

            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp{out.suffix}")
            try:
                export_to_video(seq, str(tmp))
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
        return [out]
    if images is None:
        images = [f for video in frames for f in video]
    written = []
    for i, image in enumerate(images):
        path = out if len(images) == 1 else out.with_name(f"{out.stem}_{i + 1}{out.suffix}")
        _save_image(image, path)
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre

    pre.input_dir(args.pipeline, flag="PIPELINE_DIR",
                  fix="pass the local folder of a saved diffusers pipeline (model_index.json)")
    if not (Path(args.pipeline) / "model_index.json").is_file():
        raise InputError(f"PIPELINE_DIR {args.pipeline} has no model_index.json, so it is no "
                         f"saved diffusers pipeline. Fix: pass the folder "
                         f"pipe.save_pretrained(...) wrote (a transformer alone goes to "
                         f"`qkrope export`)")
    _args.check_plugin(args)
    if args.transformer != PYTORCH:
        pre.input_file(args.transformer, flag="--transformer",
                       fix="pass an export (.onnx) or engine (.engine) of the pipeline's "
                           "transformer, or 'pytorch'")
    out = Path(args.out)
    if out.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise InputError(f"--out must end in one of {', '.join(IMAGE_SUFFIXES + VIDEO_SUFFIXES)}"
                         f"; got {args.out!r}. Fix: --out {out.with_suffix('.png')}")
    pre.file_to_write(args.out, flag="--out", example="image.png")
    for flag, value in (("--steps", args.steps), ("--height", args.height),
                        ("--width", args.width)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive integer; got {value}")

    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    from qkrope._progress import is_terminal

    if not is_terminal(sys.stderr):  # a log: lines only, no progress bars
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        try:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        except ImportError:
            pass
    output, times, _ = generate(
        args.pipeline, args.transformer, args.prompt, negative_prompt=args.negative_prompt,
        steps=args.steps, height=args.height, width=args.width,
        guidance_scale=args.guidance_scale, true_cfg_scale=args.true_cfg_scale, seed=args.seed,
        device=args.device, dtype=args.dtype, plugin=args.plugin, log=log)
    log("qkrope generate: stage timings")
    for line in times.table():
        log(line)
    for path in write_output(output, out):
        print(path)
    return 0


__all__ = ["StageTimes", "generate", "timing_hooks", "write_output"]
