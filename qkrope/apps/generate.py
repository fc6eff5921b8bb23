"""``qkrope generate``: a saved diffusers pipeline folder from a prompt to an image (or video)
file, the transformer on an export or engine (the drop-in, :func:`qkrope.runtime.load_transformer`)
and the rest (text encoders, scheduler, VAE) in PyTorch, with the time of each stage.

    qkrope generate PIPELINE_DIR --transformer transformer.onnx --prompt "a cat" -o cat.png

The pipeline is loaded with the ``from_pretrained`` of diffusers' own class that model_index.json
names (``WanPipeline.from_pretrained(PIPELINE_DIR, transformer=dropin, ...)``: that class's
optional components take the drop-ins, so no PyTorch transformer is loaded; ``--transformer
pytorch`` loads and runs it instead, the baseline) and called with what it takes of ``--steps``, ``--height``, ``--width``,
``--guidance-scale``, ``--true-cfg-scale``, ``--negative-prompt`` and the seed. The stages are
timed as TensorRT's diffusion demo reports them: the text encoders (every ``text_encoder*``
component's forward; an ``image_encoder*``'s apart), the denoising loop (each step, from the pipeline's
``callback_on_step_end``, and the transformer's calls), the VAE (its ``decode``), and the whole
call; on CUDA each time is taken after a synchronise. Loading the pipeline and the transformer is
timed apart from the call. The denoising steps show as a tqdm bar on a terminal (lines in a log);
a pipeline without ``callback_on_step_end`` reports no steps, so its transformer calls are
counted instead, as calls (under CFG a step can be several).

Before any model is loaded (:func:`preflight`, from the folder's JSON files and the exports'
sidecars), each of these is refused in one line with the fix: a size, ``--num-frames`` or image
token grid past what the export serves (the family's position scheme over the model's own RoPE
tables; an engine's optimisation profiles; each side on its own, a side not given being the
pipeline's ``__call__`` default where that is an int), a side that is no multiple of the family's pixels
per token, frames that are not 1 + a multiple of the VAE's temporal compression, ``--num-frames``
for an image pipeline, an export of another family than the pipeline's transformer (the family
registry), a pipeline with a second transformer component (Wan 2.2's low-noise expert
``transformer_2``, Ideogram 4's ``unconditional_transformer``) whose export was not given with ``--transformer-2`` (no expert runs in PyTorch
beside an export), ``--transformer pytorch`` on a folder saved with the drop-in (it holds an
export, no PyTorch weights), a prompt that is not UTF-8, an output under a file or a numbered
output name that is a folder, an ``--out`` that names a folder, an output folder where no file
can be created (a temporary file is created and removed), a ``--seed`` outside what
``torch.Generator`` takes, ``--steps`` past the scheduler's ``num_train_timesteps``, a
``--dtype`` other than the export's, one export given for two transformer components (or the
other component's export), ``--steps`` other than the length of a call's default per-step
``guidance_schedule`` without ``--guidance-scale`` (Ideogram 4), and an ``.mp4`` without a
video writer (``pip install 'qkrope[video]'``: imageio and imageio-ffmpeg, what diffusers'
``export_to_video`` uses).
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

from qkrope.errors import InputError, QkropeError

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
    p.add_argument("--transformer", default=None, metavar="M.onnx|M.engine|pytorch",
                   help="the exported transformer (ONNX Runtime) or engine (TensorRT) that "
                        "stands in for the pipeline's; 'pytorch': the pipeline's own "
                        "(baseline). Default: the export saved in the folder (a folder `qkrope "
                        "export --model pipeline` wrote, or one saved with the drop-in: every "
                        "model stage then runs on its export, the text encoders and VAE "
                        "included, and no PyTorch model is built)")
    p.add_argument("--transformer-2", dest="transformer_2", default=None,
                   metavar="M2.onnx|M2.engine|pytorch",
                   help="the export or engine of the pipeline's second transformer component "
                        "(Wan 2.2's low-noise expert transformer_2, Ideogram 4's "
                        "unconditional_transformer); required when the "
                        "pipeline has one and --transformer is an export: no expert runs in "
                        "PyTorch unless both are 'pytorch'")
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
    p.add_argument("--num-frames", type=int, default=None,
                   help="frames of a video pipeline (default: the pipeline's); refused for an "
                        "image pipeline")
    p.add_argument("--guidance-scale", type=float, default=None,
                   help="guidance_scale, where the pipeline takes it (where its call also "
                        "takes a per-step guidance_schedule, the constant scale in its place)")
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
    _args.add_allow_host_code(p, "with a version-compatible engine: ")
    p.add_argument("--engines", action="store_true",
                   help="with a pipeline export (the folder `qkrope export --model pipeline` "
                        "wrote) and no --transformer: run every model stage on the TensorRT "
                        "engines `qkrope build OUT_DIR` wrote beside its graphs (the "
                        "transformer's, each text and image encoder's, the VAE's), on a CUDA "
                        "GPU; a missing or stale engine is refused before any model loads")
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
    image_encoders: list = field(default_factory=list)
    transformer_calls: list = field(default_factory=list)
    transformer_starts: list = field(default_factory=list)  # clock time of each call's start
    steps: list = field(default_factory=list)
    vae: list = field(default_factory=list)
    total: float = 0.0

    @property
    def steps_counted(self) -> bool:
        """Whether ``steps`` are the pipeline's denoising steps (its callback_on_step_end);
        without that callback only the transformer's calls are known."""
        return bool(self.steps)

    def table(self) -> list[str]:
        ms = lambda s: f"{1e3 * s:10.1f} ms"  # noqa: E731
        denoise = sum(self.steps)
        rows = [("load pipeline (other components)", ms(self.load_pipeline), ""),
                ("load transformer", ms(self.load_transformer), ""),
                ("text encoders", ms(sum(self.text_encoders)),
                 f"{len(self.text_encoders)} call(s)"),
                *([("image encoders", ms(sum(self.image_encoders)),
                    f"{len(self.image_encoders)} call(s)")] if self.image_encoders else []),
                ("denoising", ms(denoise) if self.steps_counted
                 else ms(sum(self.transformer_calls)),
                 f"{len(self.steps)} step(s), {1e3 * denoise / max(len(self.steps), 1):.1f} "
                 f"ms/step; transformer {1e3 * sum(self.transformer_calls):.1f} ms in "
                 f"{len(self.transformer_calls)} call(s)" if self.steps_counted else
                 f"{len(self.transformer_calls)} transformer call(s) (the pipeline reports no "
                 f"steps)"),
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


def _timed(fn: Callable, into: list, clock: _Clock, starts: list | None = None,
           after: Callable | None = None) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = clock.now()
        if starts is not None:
            starts.append(t0)
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(clock.now() - t0)
            if after is not None:
                after()

    return wrapper


def _module_call(owner) -> bool:
    """Whether calling ``owner`` goes through torch's Module.__call__ (and so runs its forward
    hooks)."""
    import torch

    return getattr(type(owner), "__call__", None) is torch.nn.Module.__call__


@contextlib.contextmanager
def timing_hooks(pipe, times: StageTimes, clock: _Clock, on_call: Callable | None = None):
    """Time the pipeline's stages while the context is open: the text encoders' forward (torch
    hooks), the transformer's calls and the VAE's ``decode`` (wrapped on the instance).
    ``on_call``: called after each transformer call (the progress of a pipeline that reports
    no steps)."""
    undo = []
    for name, component in pipe.components.items():
        kind = next((k for k in ("text_encoder", "image_encoder") if name.startswith(k)), None)
        if kind is None or component is None:
            continue
        if hasattr(component, "register_forward_pre_hook"):
            start = {}

            def pre(module, args, start=start):
                start["t"] = clock.now()

            def post(module, args, output, start=start, into=getattr(times, kind + "s")):
                into.append(clock.now() - start.pop("t"))

            undo += [component.register_forward_pre_hook(pre).remove,
                     component.register_forward_hook(post).remove]
    owners = [(getattr(pipe, name, None), "forward", times.transformer_calls,
               times.transformer_starts) for name in COMPONENT_FLAGS]  # every expert's calls
    for owner, attr, into, starts in owners + [(getattr(pipe, "vae", None), "decode", times.vae,
                                                None)]:
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
                if on_call is not None and into is times.transformer_calls:
                    on_call()

            undo += [owner.register_forward_pre_hook(pre).remove,
                     owner.register_forward_hook(post).remove]
            continue
        had = attr in vars(owner)
        original = getattr(owner, attr)
        setattr(owner, attr, _timed(original, into, clock, starts,
                                    on_call if into is times.transformer_calls else None))

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
# The checks before any work: what the folder, the exports and the options allow
# --------------------------------------------------------------------------------------------

#: the flag of each transformer component a pipeline can hold (diffusers' component names): the
#: second one by the name its pipeline gives it (Wan 2.2's low-noise expert transformer_2,
#: Ideogram 4's unconditional_transformer), --transformer-2 either way
COMPONENT_FLAGS = {"transformer": "--transformer", "transformer_2": "--transformer-2",
                   "unconditional_transformer": "--transformer-2"}
#: the key the exports are given under for the second component, whatever its name
SECOND = "transformer_2"
#: a per-step guidance list a pipeline's call takes with guidance_scale as its alternative (one
#: of the two: Ideogram 4), whose default fixes the number of steps
SCHEDULE = "guidance_schedule"
#: diffusers VAE config keys of the temporal compression (frames per latent frame, after the
#: first); a VAE without one gets no frame-multiple check
TEMPORAL_KEYS = ("scale_factor_temporal", "temporal_compression_ratio")


@dataclass
class PipelinePlan:
    """What a saved pipeline folder says about itself, read from its JSON files (nothing
    imported but diffusers' own pipeline class by the name model_index.json gives)."""

    folder: Path
    class_name: str | None
    params: dict  # the pipeline class's __call__ parameters (empty: unknown)
    transformers: tuple  # its transformer components present (model_index.json), in order
    saved_dropins: tuple  # those saved with the drop-in (qkrope_component.json)
    temporal: int | None  # its VAE's temporal compression, where the VAE config gives one
    pipeline_class: Any = None  # diffusers' own class of _class_name (None: not one)

    @property
    def video(self) -> bool:
        return "num_frames" in self.params

    def default(self, name: str):
        p = self.params.get(name)
        return None if p is None or p.default is inspect.Parameter.empty else p.default

    def int_defaults(self, *names: str) -> dict:
        """The ``__call__`` defaults of ``names`` that are ints (Wan: height 480, width 832)."""
        return {n: v for n in names if isinstance(v := self.default(n), int)
                and not isinstance(v, bool) and v >= 1}

    def config(self, component: str) -> dict | None:
        return _read_json(self.folder / component / "config.json")


def _read_json(path: Path):
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_pipeline(pipeline_dir: str | Path) -> PipelinePlan:
    """The plan of the pipeline folder (:class:`PipelinePlan`), from model_index.json and its
    components' config files."""
    from qkrope.runtime.component import COMPONENT_FILE

    folder = Path(pipeline_dir)
    index = _read_json(folder / "model_index.json")
    if index is None:
        raise InputError(f"{folder}/model_index.json is not a JSON object, so {folder} is no "
                         f"saved diffusers pipeline. Fix: pass the folder "
                         f"pipe.save_pretrained(...) wrote")
    name = index.get("_class_name")
    params = {}
    pipeline_class = None
    if isinstance(name, str) and name.isidentifier():
        import diffusers

        cls = getattr(diffusers, name, None)  # diffusers' own class of that name, no other
        if isinstance(cls, type) and callable(getattr(cls, "__call__", None)):
            params = dict(inspect.signature(cls.__call__).parameters)
        if isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline):
            pipeline_class = cls
    present = tuple(k for k, v in index.items() if k in COMPONENT_FLAGS and isinstance(v, list)
                    and len(v) == 2 and v[1] is not None)
    dropins = tuple(k for k in present if (folder / k / COMPONENT_FILE).exists())
    vae = _read_json(folder / "vae" / "config.json") or {}
    temporal = next((int(vae[k]) for k in TEMPORAL_KEYS if isinstance(vae.get(k), int)
                     and not isinstance(vae.get(k), bool) and vae[k] >= 1), None)
    return PipelinePlan(folder, name if isinstance(name, str) else None, params, present,
                        dropins, temporal, pipeline_class)


def check_text(flag: str, value: str | None) -> None:
    """A prompt is text a tokenizer can take: valid UTF-8 (argv bytes that are not arrive as
    surrogate escapes)."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start:exc.end].encode("utf-8", "surrogateescape")
        raise InputError(f"{flag} is not valid UTF-8 text (byte(s) {bad!r} at character "
                         f"{exc.start}). Fix: pass the {flag[2:].replace('-', ' ')} as UTF-8 "
                         f"text") from None


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_video_writer(out: Path) -> None:
    """An .mp4 is written by diffusers' ``export_to_video``: imageio with its ffmpeg plugin
    (imageio-ffmpeg ships the binary), else OpenCV; refused before any work when neither is
    installed."""
    if out.suffix.lower() != ".mp4":
        return
    if _installed("imageio"):
        missing = [] if _installed("imageio_ffmpeg") else ["imageio-ffmpeg"]
    else:
        missing = [] if _installed("cv2") else ["imageio", "imageio-ffmpeg"]
    if missing:
        raise InputError(f"--out {out}: writing an .mp4 needs a video writer (diffusers' "
                         f"export_to_video: imageio and imageio-ffmpeg), and "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"installed. Fix: pip install 'qkrope[video]' (or pip install "
                         f"{' '.join(missing)}), or write --out {out.with_suffix('.gif')}")


def output_paths(out: Path, count: int) -> list[Path]:
    """The files ``count`` images go to: ``out`` itself for one (or for a video file), else
    ``NAME_1.png`` ... ``NAME_<count>.png`` beside it."""
    if out.suffix.lower() in VIDEO_SUFFIXES or count == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i + 1}{out.suffix}") for i in range(count)]


def check_output_paths(paths) -> None:
    """Every file to write is a file name in a folder that can be one: none is a folder, none
    lies under a file, and the nearest existing folder takes a file (a temporary one is
    created there and removed: a read-only mount or /proc says so before any work)."""
    import os
    import tempfile

    from qkrope import _preflight as pre
    from qkrope._fileio import OutputWriteError, check_output_folder

    probed = set()
    for path in paths:
        pre.file_to_write(path, flag="--out", example="image.png")
        try:
            check_output_folder(path.parent)
        except OutputWriteError as exc:
            raise InputError(f"--out {path}: {exc.strerror or exc}") from None
        folder = path.parent if str(path.parent) else Path(".")
        while not folder.exists() and folder.parent != folder:
            folder = folder.parent
        if folder in probed:
            continue
        probed.add(folder)
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".qkrope-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise InputError(f"--out {path}: cannot create a file in {folder} "
                             f"({exc.strerror or type(exc).__name__}). Fix: choose a writable "
                             f"folder for --out") from None


def _export_info(path: str):
    """The sidecar of an export or engine (None where it has none: loading it says why)."""
    from qkrope import _preflight as pre
    from qkrope.sidecars import EngineInfo, ModelInfo, engine_sidecar_path, sidecar_path

    p = Path(path)
    if p.suffix.lower() in pre.ENGINE_SUFFIXES:
        return EngineInfo.load(p) if engine_sidecar_path(p).is_file() else None
    return ModelInfo.load(p) if sidecar_path(p).is_file() else None


def check_family(plan: PipelinePlan, component: str, path: str, info) -> None:
    """The export's family (its sidecar's) is the pipeline component's (its config.json's
    ``_class_name``, through the family registry)."""
    from qkrope import families
    from qkrope.runtime.caches import record_of

    if info is None:
        return
    if component in plan.saved_dropins:  # the export saved there: its sidecar names the family
        saved = _saved_export_info(plan.folder / component)
        mine = record_of(saved.config, str(saved.source)) if saved is not None else None
    else:
        config = plan.config(component)
        mine = families.by_class(config.get("_class_name")) if config is not None else None
    theirs = record_of(info.config, str(info.source))
    if mine is not None and mine.name != theirs.name:
        flag = COMPONENT_FLAGS[component]
        raise InputError(f"{flag} {path} is a {theirs.short} export, but the pipeline's "
                         f"{component} is {mine.class_name} ({mine.short}). Fix: pass an export "
                         f"of {plan.folder / component} (qkrope export --model transformer "
                         f"--diffusers {plan.folder / component})")


def _saved_export_info(folder: Path):
    """The sidecar of the export a drop-in save left in ``folder`` (its qkrope_component.json
    names the model file; both read as JSON, nothing loaded), or None where unreadable."""
    from qkrope.runtime.component import COMPONENT_FILE

    record = _read_json(folder / COMPONENT_FILE)
    model = record.get("model") if record is not None else None
    if not isinstance(model, str) or not model or Path(model).name != model \
            or model in (".", ".."):
        return None
    try:
        return _export_info(str(folder / model))
    except (QkropeError, OSError, ValueError):
        return None


def check_dtype(flag: str, path: str, info, dtype: str | None) -> None:
    """``--dtype`` is the export's (its sidecar's), where both are known: the pipeline's parts
    feed the transformer in that dtype."""
    theirs = getattr(getattr(info, "config", None), "dtype", None) or getattr(info, "dtype", None)
    if dtype is None or not isinstance(theirs, str) or theirs == dtype:
        return
    raise InputError(f"--dtype {dtype}, but {flag} {path} was exported in {theirs} (its "
                     f"sidecar), so the pipeline would feed it {dtype} tensors. Fix: leave "
                     f"--dtype out (the export's dtype is the default), or export in {dtype}")


def check_distinct_experts(plan: PipelinePlan, exports: dict, infos: dict) -> None:
    """Each transformer component gets its own export: not one export twice (the same file or
    the same recorded hash), and not the export of another component of this pipeline (the
    folder its sidecar records)."""
    seen = {}
    for component, path in exports.items():
        flag = COMPONENT_FLAGS[component]
        info = infos.get(component)
        record = getattr(info, "model_file", None)
        keys = {("path", str(Path(path).resolve()))}
        if getattr(record, "sha256", None):
            keys.add(("sha256", record.sha256))
        for key in keys:
            if key in seen and seen[key] != component:
                other = seen[key]
                raise InputError(f"{flag} {path} is the export given for {other} too "
                                 f"({COMPONENT_FLAGS[other]}): each transformer component has "
                                 f"its own weights. Fix: export {plan.folder / component} "
                                 f"(qkrope export --model transformer --diffusers "
                                 f"{plan.folder / component}) and pass it as {flag}")
            seen[key] = component
        source = getattr(getattr(info, "config", None), "diffusers_dir", None)
        if not isinstance(source, str) or not source:
            continue
        try:
            src = Path(source).resolve()
        except (OSError, RuntimeError):
            continue
        for other in plan.transformers:
            if other != component and src == (plan.folder / other).resolve():
                raise InputError(f"{flag} {path} is the export of {plan.folder / other} (its "
                                 f"sidecar), not of {plan.folder / component}. Fix: export "
                                 f"{plan.folder / component} and pass it as {flag}")


def check_limits(path: str, info, *, height: int | None, width: int | None,
                 frames: int | None, temporal: int | None, defaults: dict | None = None) -> None:
    """The sizes a call asks of an export, within what it can serve, before anything is
    allocated: each side given a multiple of the family's pixels per token; the image's RoPE
    positions within its tables (the position scheme's ``profile_limits``, the model's own
    table size); an engine's image tokens within one of its optimisation profiles. Each side is
    bounded on its own: a side not given is the pipeline's default (``defaults``:
    ``{"height": int, "width": int}`` from its ``__call__``), else one token (the least it can
    be)."""
    from qkrope import model_io
    from qkrope.runtime import schemes
    from qkrope.runtime.caches import _serving_refusal, model_setting, record_of
    from qkrope.runtime.latents import latent_of

    if info is None:
        return
    record = record_of(info.config, str(info.source))
    ppt = record.pixels_per_token
    for flag, value in (("--height", height), ("--width", width)):
        if value is not None and value % ppt:
            lo = max(value // ppt * ppt, ppt)
            raise InputError(f"{flag} {value} is not a multiple of {ppt} pixels ({record.short}: "
                             f"one image token per {ppt}x{ppt} pixels, the VAE's downscale times "
                             f"the patch size). Fix: {flag} {lo} or {lo + ppt}")
    defaults = defaults or {}
    shown = []  # what each side is, and whence: the flag given or the pipeline's default
    for name, value in (("width", width), ("height", height)):
        fallback = defaults.get(name)
        if value is not None:
            shown.append(f"--{name} {value}")
        elif fallback is not None:
            shown.append(f"{name} {fallback} (the pipeline's default)")
    height = height if height is not None else defaults.get("height")
    width = width if width is not None else defaults.get("width")
    if height is None and width is None:
        return
    token_frames = 1
    if frames is not None and temporal:
        cfg = info.config.diffusers_config if isinstance(
            getattr(info.config, "diffusers_config", None), dict) else {}
        patch_t = latent_of(record, cfg).patch[0] if cfg else 1
        token_frames = -(-((frames - 1) // temporal + 1) // patch_t)
    grid = (token_frames, max(height // ppt, 1) if height is not None else 1,
            max(width // ppt, 1) if width is not None else 1)
    setting = model_setting(info.config, record, str(info.source))
    scheme = schemes.scheme(record.scheme)
    limits = getattr(scheme, "profile_limits", None)
    refusal = limits(setting, [grid], 1) if limits is not None else None
    size = ", ".join(shown) + (f", {frames} frames" if frames is not None else "")
    if refusal is not None and refusal[0] == "image":
        _, _, needed, available = refusal
        raise InputError(
            f"{size} needs {needed} RoPE positions on an axis of its token grid "
            f"{list(grid)} (frames, rows, columns), more than the {available} of {path}'s "
            f"{record.short} position tables. Fix: smaller --height/--width"
            + ("/--num-frames" if frames is not None else "") + ", or a model exported with "
            "larger tables")
    profiles = getattr(info, "profiles", None)
    if profiles:
        rows = grid[0] * grid[1] * grid[2]
        need = {(model_io.CACHE_INPUTS[0].name, 0): rows}
        ranges = _serving_refusal(info, need)
        if ranges is not None:
            raise InputError(f"{path} cannot serve {size} ({rows} image tokens): no "
                             f"optimisation profile holds them ({ranges}). Fix: sizes within a "
                             f"profile, or rebuild with `qkrope build --resolutions WxH`")


#: the seeds torch.Generator.manual_seed takes (an unsigned 64-bit integer)
MAX_SEED = 2 ** 64 - 1


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"--seed {seed} is outside the seeds a torch.Generator takes (0 to "
                         f"{MAX_SEED}). Fix: --seed from 0 to {MAX_SEED}")


def by_component(plan: PipelinePlan, given: dict) -> dict:
    """``given`` ({"transformer": ..., "transformer_2": ...}) keyed by the pipeline's own
    component names: the second export under the name its pipeline gives its second transformer
    component (transformer_2 or unconditional_transformer)."""
    second = next((c for c in plan.transformers if c != "transformer"), SECOND)
    return {(second if c == SECOND else c): p for c, p in given.items()}


def stage_engines(pipeline_dir: str | Path, dev) -> dict[str, Path]:
    """``--engines``: the stage folders of the pipeline export in ``pipeline_dir`` (component
    -> folder), every one with its engines built from its graphs as exported now, checked
    without TensorRT; one line for a folder that is no pipeline export, a device that is no
    CUDA one, or the first engine missing or stale."""
    from qkrope.runtime.stages.component import read_stage_record
    from qkrope.runtime.stages.engines import built_engines
    from qkrope.stages import DROPIN_CLASSES

    from .check_stages import read_pipeline_record, stages_of

    record = read_pipeline_record(pipeline_dir, command="generate --engines")
    if dev.type != "cuda":
        raise InputError(f"--engines runs TensorRT engines on a CUDA GPU; this run's device is "
                         f"{dev}. Fix: run on a GPU machine (--device cuda), or drop --engines "
                         f"to run the exports on ONNX Runtime")
    folders = {}
    for name, kind in stages_of(record).items():
        if kind not in DROPIN_CLASSES:
            continue  # a transformer: its engine is saved_transformers' (engines=True)
        folder = Path(pipeline_dir) / name
        built_engines(folder, read_stage_record(folder))
        folders[name] = folder
    return folders


def other_stages(pipe) -> str:
    """Where the pipeline's text and image encoders and VAE run, as loaded: their exports (the
    stage drop-ins of a pipeline export) or PyTorch."""
    from qkrope.runtime.stages import StageComponent

    kinds = ("text_encoder", "image_encoder", "vae")  # listed in this order
    names = sorted((n for n, c in pipe.components.items() if c is not None and (
        n == "vae" or n.startswith(kinds[:2]))),
        key=lambda n: (next(i for i, k in enumerate(kinds) if n.startswith(k)), n))
    exported = [n for n in names if isinstance(getattr(pipe, n), StageComponent)]
    torch_ = [n for n in names if n not in exported]
    backend = ", ".join(sorted({getattr(getattr(pipe, n).__dict__.get("_runner"), "backend",
                                       "onnxruntime") for n in exported}))
    parts = ([f"{', '.join(exported)}: exports ({backend})"] if exported else []) + \
        ([f"{', '.join(torch_)}: PyTorch"] if torch_ else [])
    return "; ".join(parts) or "no text encoder or VAE"


def saved_transformers(pipeline_dir: str | Path, transformer, transformer_2, *,
                       engines: bool = False) -> tuple:
    """``(transformer, transformer_2)`` with the exports saved in the folder where neither was
    given (each transformer component's qkrope_component.json names its model file); one line
    when the folder holds PyTorch weights for one of them. ``engines``: the engines ``qkrope
    build`` wrote beside those exports instead (one line where one is missing)."""
    if engines and (transformer is not None or transformer_2 is not None):
        own = saved_transformers(pipeline_dir, None, None, engines=True)
        for flag, given, mine in (("--transformer", transformer, own[0]),
                                  ("--transformer-2", transformer_2, own[1])):
            if given is not None and (mine is None or Path(given).resolve() != Path(
                    mine).resolve()):
                raise InputError(f"--engines runs the engines qkrope build wrote beside the "
                                 f"pipeline export's graphs, and {flag} names a model of its "
                                 f"own. Fix: drop {flag}, or drop --engines")
        return own
    if transformer is not None or transformer_2 is not None:
        return transformer, transformer_2
    plan = read_pipeline(pipeline_dir)
    unsaved = [c for c in plan.transformers if c not in plan.saved_dropins]
    if unsaved or not plan.transformers:
        raise InputError(f"--transformer was not given and {plan.folder / (unsaved or ['transformer'])[0]} "
                         f"holds no saved export (no qkrope_component.json). Fix: pass "
                         f"--transformer M.onnx (or 'pytorch'), or export the whole pipeline "
                         f"(qkrope export --model pipeline --diffusers {plan.folder} -o OUT_DIR) "
                         f"and run OUT_DIR")
    from qkrope.runtime.component import COMPONENT_FILE

    paths = {}
    for component in plan.transformers:
        record = _read_json(plan.folder / component / COMPONENT_FILE) or {}
        model = record.get("model")
        if not isinstance(model, str) or Path(model).name != model \
                or not (plan.folder / component / model).is_file():
            raise InputError(f"{plan.folder / component / COMPONENT_FILE} names no model file "
                             f"there. Fix: export the pipeline again")
        paths[component] = str(plan.folder / component / model)
        if engines:
            from qkrope.stages import engine_name

            engine = plan.folder / component / engine_name(model)
            if not engine.is_file():
                raise InputError(f"--engines: {engine} is missing (the engine of "
                                 f"{component}/{model}). Fix: qkrope build {plan.folder} (on "
                                 f"the GPU it will run on), or drop --engines to run the "
                                 f"exports on ONNX Runtime")
            paths[component] = str(engine)
    second = next((c for c in plan.transformers if c != "transformer"), None)
    return paths.get("transformer"), paths.get(second) if second else None


def check_schedule(plan: PipelinePlan, steps, guidance_scale) -> None:
    """A call whose default per-step guidance list (``guidance_schedule``) fixes the number of
    steps: ``--steps`` of another count needs ``--guidance-scale`` (a constant scale in place of
    the list, which generate then passes as None)."""
    default = plan.default(SCHEDULE)
    if steps is None or guidance_scale is not None or not isinstance(default, (list, tuple)) \
            or len(default) == steps:
        return
    raise InputError(f"--steps {steps}: {plan.class_name}'s default {SCHEDULE} has "
                     f"{len(default)} entries, one per step. Fix: --steps {len(default)}, or "
                     f"pass --guidance-scale G (a constant scale in place of the schedule)")


def check_steps(plan: PipelinePlan, steps) -> None:
    """``--steps`` within the scheduler's training timesteps (its scheduler_config.json's
    num_train_timesteps), where the folder records them."""
    if steps is None:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"--steps must be a positive integer; got {steps!r}")
    config = _read_json(plan.folder / "scheduler" / "scheduler_config.json") or {}
    limit = config.get("num_train_timesteps")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 and steps > limit:
        raise InputError(f"--steps {steps} is more than the {limit} timesteps the pipeline's "
                         f"scheduler was trained with (scheduler/scheduler_config.json "
                         f"num_train_timesteps). Fix: --steps {limit} or fewer")


def preflight(pipeline_dir: str | Path, transformers: dict, *, height=None, width=None,
              num_frames=None, options: dict | None = None, seed=0, steps=None,
              dtype: str | None = None) -> PipelinePlan:
    """Every check that needs no model: the pipeline folder's plan, its transformer components
    against the exports given (``{component: path or "pytorch"}``: each its own export), each
    export's family, dtype (``dtype``: --dtype, where given) and limits, the seed and steps,
    and the options the pipeline's call takes. Returns the plan."""
    plan = read_pipeline(pipeline_dir)
    transformers = by_component(plan, transformers)
    check_seed(seed)
    check_steps(plan, steps)
    check_schedule(plan, steps, (options or {}).get(("--guidance-scale", "guidance_scale")))
    # a pipeline whose call needs more than a prompt (an image to animate: FramePack) cannot be
    # run from the command line's options
    needed = [n for n, p in plan.params.items() if n not in ("self", "prompt")
              and p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if needed:
        raise InputError(f"{plan.class_name}'s call needs {', '.join(needed)}, which qkrope "
                         f"generate does not take (it runs a pipeline from a prompt). Fix: call "
                         f"the pipeline in Python with the drop-in (pipe.transformer = "
                         f"qkrope.runtime.load_transformer(...))")
    for flag, value in (("--height", height), ("--width", width),
                        ("--num-frames", num_frames)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise InputError(f"{flag} must be a positive integer; got {value!r}")
    if num_frames is not None and plan.params and not plan.video:
        raise InputError(f"{plan.class_name} makes images, so --num-frames does not apply to "
                         f"it. Fix: leave --num-frames out")
    if plan.params and options:
        _call_kwargs(plan, options)
    frames = num_frames if num_frames is not None else (plan.default("num_frames")
                                                         if plan.video else None)
    if frames is not None and plan.temporal and (frames - 1) % plan.temporal:
        lo = (frames - 1) // plan.temporal * plan.temporal + 1
        raise InputError(f"--num-frames {frames}: {plan.class_name} takes 1 + a multiple of "
                         f"{plan.temporal} frames (its VAE's temporal compression). Fix: "
                         f"--num-frames {lo} or {lo + plan.temporal}")
    given = {c: str(p) for c, p in transformers.items() if p is not None}
    for component, path in given.items():
        if component != "transformer" and component not in plan.transformers:
            raise InputError(f"{COMPONENT_FLAGS[component]} {path}: the pipeline in "
                             f"{plan.folder} has no {component}. Fix: leave "
                             f"{COMPONENT_FLAGS[component]} out")
    exports = {c: p for c, p in given.items() if p != PYTORCH}
    for component in plan.transformers:
        flag = COMPONENT_FLAGS[component]
        path = given.get(component)
        if exports and path is None:
            raise InputError(
                f"the pipeline in {plan.folder} has {len(plan.transformers)} transformer "
                f"components ({', '.join(plan.transformers)}) and {flag} was not given: its "
                f"{component} would run in PyTorch beside the export. Fix: export it (qkrope "
                f"export --model transformer --diffusers {plan.folder / component}) and pass "
                f"{flag} M.onnx, or run every one in PyTorch (--transformer pytorch)")
        if exports and path == PYTORCH:
            flags = ", ".join(COMPONENT_FLAGS[c] for c in plan.transformers)
            raise InputError(f"{flag} pytorch beside an export: one expert would run in PyTorch "
                             f"and one on its export. Fix: pass an export for every transformer "
                             f"component ({flags}), or 'pytorch' for all")
        if path == PYTORCH and component in plan.saved_dropins:
            raise InputError(
                f"{flag} pytorch: {plan.folder / component} was saved with the qkrope drop-in "
                f"(its qkrope_component.json), so it holds an export, not the PyTorch weights "
                f"the baseline runs. Fix: pass {flag} with that export, or the folder of a "
                f"pipeline saved with its diffusers transformer")
    infos = {c: _export_info(p) for c, p in exports.items()}
    check_distinct_experts(plan, exports, infos)
    for component, path in exports.items():
        info = infos[component]
        check_family(plan, component, path, info)
        check_dtype(COMPONENT_FLAGS[component], path, info, dtype)
        check_limits(path, info, height=height, width=width, frames=frames,
                     temporal=plan.temporal, defaults=plan.int_defaults("height", "width"))
    return plan


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def _call_kwargs(pipe, options: dict) -> dict:
    """The options the pipeline's ``__call__`` takes (None: left to the pipeline); one it does
    not take is refused naming the flag. ``pipe``: the pipeline or its :class:`PipelinePlan`."""
    if isinstance(pipe, PipelinePlan):
        params, name = pipe.params, pipe.class_name
    else:
        params, name = inspect.signature(pipe.__call__).parameters, type(pipe).__name__
    kwargs = {}
    for (flag, key), value in options.items():
        if value is None:
            continue
        if key not in params:
            raise InputError(f"{name} takes no {key}, so {flag} does not apply to it. Fix: "
                             f"leave {flag} out")
        kwargs[key] = value
    if "guidance_scale" in kwargs and SCHEDULE in params:  # the constant scale in its place
        kwargs[SCHEDULE] = None
    return kwargs


def _options(negative_prompt, steps, height, width, guidance_scale, true_cfg_scale,
             num_frames) -> dict:
    return {("--negative-prompt", "negative_prompt"): negative_prompt,
            ("--steps", "num_inference_steps"): steps, ("--height", "height"): height,
            ("--width", "width"): width, ("--guidance-scale", "guidance_scale"): guidance_scale,
            ("--true-cfg-scale", "true_cfg_scale"): true_cfg_scale,
            ("--num-frames", "num_frames"): num_frames}


def generate(pipeline_dir: str | Path, transformer: str | Path | None, prompt: str, *,
             transformer_2: str | Path | None = None,
             negative_prompt: str | None = None, steps: int | None = None,
             height: int | None = None, width: int | None = None,
             num_frames: int | None = None,
             guidance_scale: float | None = None, true_cfg_scale: float | None = None,
             seed: int = 0, device: str | None = None, dtype: str | None = None,
             plugin: str | None = None, allow_host_code: bool = False,
             output_type: str = "pil", log=print, progress: bool = False,
             served: dict | None = None, pipe=None, engines: bool = False):
    """Run the pipeline in ``pipeline_dir`` once with ``transformer`` (an export or engine path,
    or ``"pytorch"``) and, for a pipeline with a second transformer component, ``transformer_2``
    (its export; every component runs on an export, or every one in PyTorch); returns ``(the
    pipeline's output, StageTimes, the pipeline)``. Everything :func:`preflight` checks is
    refused before any model is loaded. ``progress``: the denoising steps on stderr (a tqdm bar
    on a terminal, lines in a log). ``served``: the pipeline's model components built elsewhere
    (the Triton pipeline model's, whose models run on its server:
    :mod:`qkrope.runtime.stages.served`), put in as they are (``transformer`` is then not
    read); ``pipe``: the pipeline :func:`load_pipeline` (or an earlier call) made with them,
    run again without loading anything. ``engines``: a pipeline export's every model stage on
    the TensorRT engines ``qkrope build`` wrote beside its graphs (``transformer`` not given)."""
    check_text("--prompt", prompt)
    check_text("--negative-prompt", negative_prompt)
    options = _options(negative_prompt, steps, height, width, guidance_scale, true_cfg_scale,
                       num_frames)
    if served is None:
        transformer, transformer_2 = saved_transformers(pipeline_dir, transformer,
                                                        transformer_2, engines=engines)
        given = {"transformer": str(transformer),
                 "transformer_2": None if transformer_2 is None else str(transformer_2)}
    else:
        given = {}
    plan = preflight(pipeline_dir, given, height=height, width=width, num_frames=num_frames,
                     options=options, seed=seed, steps=steps, dtype=dtype)
    given = by_component(plan, given)

    import torch

    from qkrope._deps import require

    require("diffusers", "qkrope generate")
    from qkrope._progress import Steps
    from qkrope.runtime.caches import checked_device

    dev = checked_device(device if device is not None
                         else ("cuda" if torch.cuda.is_available() else "cpu"))
    stage_folders = stage_engines(pipeline_dir, dev) if engines and pipe is None else {}
    times = StageTimes()
    clock = _Clock(dev)
    dropins = dict(served or {})
    exports = {c: p for c, p in given.items() if p is not None and p != PYTORCH}
    if exports and pipe is None:
        from qkrope.runtime import load_transformer

        t0 = clock.now()
        for component, path in exports.items():
            dropins[component] = load_transformer(path, plugin=plugin, device=dev,
                                                  allow_host_code=allow_host_code)
        times.load_transformer = clock.now() - t0
    t0 = clock.now()
    if stage_folders:
        from qkrope.runtime.stages import load_stage

        for component, folder in stage_folders.items():
            dropins[component] = load_stage(folder, backend="tensorrt", device=dev)
    if pipe is None:
        pipe, dtype = _load(pipeline_dir, plan, dropins, dtype, dev)
    times.load_pipeline = clock.now() - t0
    for component, dropin in dropins.items():
        setattr(pipe, component, dropin)
    pipe.set_progress_bar_config(disable=True)  # qkrope's own bar below: one per run
    kwargs = _call_kwargs(pipe, options)
    total = steps if steps is not None else plan.default("num_inference_steps")
    marks: list[float] = []
    counter = None
    steps_reported = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
    if steps_reported:
        def on_step_end(_pipe, _i, _t, callback_kwargs):
            marks.append(clock.now())
            if counter is not None:
                counter.update(1)
            return callback_kwargs

        kwargs["callback_on_step_end"] = on_step_end
    if served is not None:
        where = "transformers: served (Triton)"
    elif not exports:
        where = "transformer: PyTorch"
    elif list(exports) == ["transformer"]:
        where = f"transformer: {Path(exports['transformer']).name}"
    else:
        where = "transformers: " + ", ".join(f"{c}: {Path(p).name}" for c, p in exports.items())
    log(f"qkrope generate: {type(pipe).__name__} from {pipeline_dir} on {dev} "
        f"({dtype or str(pipe.dtype).removeprefix('torch.')}), {where}; {other_stages(pipe)}")

    def on_call():  # a pipeline without callback_on_step_end: its transformer calls, as calls
        if counter is not None:
            counter.update(1)

    what, unit = ("denoising", "step") if steps_reported else ("transformer", "call")
    with Steps("qkrope generate", 1, enabled=progress, heartbeat=0) as bar, \
            timing_hooks(pipe, times, clock, None if steps_reported else on_call), \
            torch.no_grad():
        with bar.step("running the pipeline"), \
                bar.counter(what, total=total if steps_reported else None, unit=unit,
                            every=1) as counter:
            start = clock.now()
            output = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed),
                          output_type=output_type, **kwargs)
            times.total = clock.now() - start
    if marks and times.transformer_starts:
        # each step: from the end of the one before, the first from the transformer's first call
        times.steps = [b - a for a, b in zip([times.transformer_starts[0]] + marks[:-1], marks)]
    # else no steps are known: the table counts the transformer's calls as calls
    return output, times, pipe


def load_pipeline(pipeline_dir: str | Path, served: dict, *, device: str = "cpu",
                  dtype: str | None = None):
    """The pipeline of ``pipeline_dir`` with ``served`` as its model components (generate()'s
    ``served``), loaded once for :func:`generate`'s ``pipe``."""
    from qkrope.runtime.caches import checked_device

    plan = read_pipeline(pipeline_dir)
    return _load(pipeline_dir, plan, dict(served), dtype, checked_device(device))[0]


def _load(pipeline_dir, plan: PipelinePlan, dropins: dict, dtype: str | None, dev):
    """The pipeline of ``pipeline_dir`` with ``dropins`` as components, on ``dev``, and the
    dtype it runs in (``dtype``, else the transformer export's, else fp32)."""
    from qkrope import dtypes
    from qkrope._deps import require

    diffusers = require("diffusers", "qkrope generate")
    first = dropins.get("transformer")
    if dtype is None:  # the export's (the drop-in's inputs), else fp32
        dtype = dtypes.SHORT_BY_NAME.get(str(first.dtype).replace("torch.", ""), "fp32") \
            if first is not None else "fp32"
    # the drop-ins go in as the components (a pipeline's __init__ may read its transformer's
    # config: HunyuanVideo-1.5's image-embedding width), so no PyTorch transformer is loaded
    extra = dict(dropins)
    # components the folder was saved without (model_index.json's [null, null], e.g. JoyImage
    # Edit's processor): diffusers' from_pretrained wants them named, as None
    index = _read_json(Path(pipeline_dir) / "model_index.json") or {}
    extra.update({k: None for k, v in index.items() if k not in extra and v == [None, None]})
    # the class model_index.json names, diffusers' own (plan.pipeline_class): its
    # from_pretrained takes the drop-ins for its optional components (Wan's experts), where
    # DiffusionPipeline.from_pretrained reads only its own optional components and would load
    # the PyTorch transformers the drop-ins stand in for
    loader = plan.pipeline_class or diffusers.DiffusionPipeline
    try:
        with warnings.catch_warnings():  # diffusers 0.42 renames torch_dtype; 0.36 has only it
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = loader.from_pretrained(
                str(pipeline_dir), torch_dtype=dtypes.TORCH_BY_SHORT[dtype], **extra)
    except QkropeError:
        raise  # already one line with its fix
    except (OSError, ValueError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(f"{pipeline_dir} is not a loadable diffusers pipeline folder "
                         f"({first_line}). Fix: pass the folder a pipeline was saved to "
                         f"(save_pretrained: model_index.json and its components)") from None
    except ImportError as exc:  # a pipeline class that needs a package (Cosmos: its guardrail)
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:300].rstrip(". ")
        raise InputError(f"the pipeline in {pipeline_dir} cannot be built here: {first_line}. "
                         f"Fix: install the package it names") from None
    pipe.to(dev)
    return pipe, dtype


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
    written whole or not at all (a temp name renamed); the names (:func:`output_paths`) are
    checked before the first is written."""
    import os

    frames = getattr(output, "frames", None)
    images = getattr(output, "images", None)
    suffix = out.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        check_output_paths([out])
        check_video_writer(out)
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
    paths = output_paths(out, len(images))
    check_output_paths(paths)
    for image, path in zip(images, paths):
        _save_image(image, path)
    return paths


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre
    from qkrope._fileio import OutputWriteError

    pre.input_dir(args.pipeline, flag="PIPELINE_DIR",
                  fix="pass the local folder of a saved diffusers pipeline (model_index.json)")
    if not (Path(args.pipeline) / "model_index.json").is_file():
        raise InputError(f"PIPELINE_DIR {args.pipeline} has no model_index.json, so it is no "
                         f"saved diffusers pipeline. Fix: pass the folder "
                         f"pipe.save_pretrained(...) wrote (a transformer alone goes to "
                         f"`qkrope export`)")
    check_text("--prompt", args.prompt)
    check_text("--negative-prompt", args.negative_prompt)
    _args.check_plugin(args)
    for flag, value in (("--transformer", args.transformer),
                        ("--transformer-2", args.transformer_2)):
        if value is not None and value != PYTORCH:
            pre.input_file(value, flag=flag,
                           fix="pass an export (.onnx) or engine (.engine) of the pipeline's "
                               "transformer, or 'pytorch'")
    out = Path(args.out)
    if out.name in ("", ".", "..") or out.is_dir():
        raise InputError(f"--out {args.out!r} is a folder, not a file name. Fix: --out "
                         f"{out / 'image.png'}")
    if out.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise InputError(f"--out must end in one of {', '.join(IMAGE_SUFFIXES + VIDEO_SUFFIXES)}"
                         f"; got {args.out!r}. Fix: --out {out.with_suffix('.png')}")
    for flag, value in (("--steps", args.steps), ("--height", args.height),
                        ("--width", args.width), ("--num-frames", args.num_frames)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive integer; got {value}")
    check_video_writer(out)
    args.transformer, args.transformer_2 = saved_transformers(
        args.pipeline, args.transformer, args.transformer_2, engines=args.engines)
    # the folder and the exports before the outputs: how many files a video's frames make
    plan = preflight(args.pipeline, {"transformer": args.transformer,
                                     "transformer_2": args.transformer_2},
                     height=args.height, width=args.width, num_frames=args.num_frames,
                     options=_options(args.negative_prompt, args.steps, args.height, args.width,
                                      args.guidance_scale, args.true_cfg_scale, args.num_frames),
                     seed=args.seed, steps=args.steps, dtype=args.dtype)
    frames = args.num_frames if args.num_frames is not None else plan.default("num_frames")
    count = frames if plan.video and isinstance(frames, int) else 1
    check_output_paths(output_paths(out, count))

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
        args.pipeline, args.transformer, args.prompt, transformer_2=args.transformer_2,
        negative_prompt=args.negative_prompt, steps=args.steps, height=args.height,
        width=args.width, num_frames=args.num_frames, guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale, seed=args.seed, device=args.device,
        dtype=args.dtype, plugin=args.plugin, allow_host_code=args.allow_host_code, log=log,
        progress=True, engines=args.engines)
    log("qkrope generate: stage timings")
    for line in times.table():
        log(line)
    try:
        written = write_output(output, out)
    except QkropeError:
        raise
    except OSError as exc:  # a disk that filled or a folder made read-only during the run
        raise OutputWriteError(exc.errno or 0, f"--out {out}: writing failed "
                               f"({exc.strerror or type(exc).__name__}"
                               + (f": {exc.filename}" if exc.filename else "") + "); nothing "
                               "was replaced. Fix: free space or choose a writable folder for "
                               "--out, and run again") from None
    for path in written:
        print(path)
    return 0


__all__ = ["PipelinePlan", "StageTimes", "check_limits", "generate", "output_paths", "preflight",
           "read_pipeline", "timing_hooks", "write_output"]
