"""The TensorRT loader of :func:`qkrope.runtime.load`, and the TensorRT helpers it shares with
``qkrope build`` (:mod:`qkrope.runtime.engine`) and ``qkrope refit``: importing TensorRT (with its
version check), loading the QKNormRoPE plugin library, and :func:`engine_from_path`, which
deserialises an engine for :class:`~qkrope.runtime.runner_tensorrt.TensorRTRunner`.

Imports neither torch nor TensorRT at module level (TensorRT when a function needs it, torch
when an engine is deserialised), so the builder imports it before either.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkrope import contract
from qkrope._deps import MissingDependencyError, require
from qkrope.errors import InputFileNotFoundError, QkropeError
from qkrope.sidecars import EngineInfo, engine_sidecar_path

MIN_TRT_MAJOR = 10


class EngineBuildError(QkropeError, RuntimeError):
    """TensorRT could not build an engine, or cannot be set up for one (too old a version, a
    plugin library that does not load or register); the message says why and what to do."""


def import_tensorrt(feature: str = "qkrope build (TensorRT engine building)"):
    """``import tensorrt`` or MissingDependencyError with the install hint; checks the version."""
    trt = require("tensorrt", feature)
    check_trt_version(getattr(trt, "__version__", "0"))
    return trt


def check_trt_version(version: str) -> tuple[int, int]:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return (0, 0)
    if major < MIN_TRT_MAJOR:
        raise EngineBuildError(
            f"TensorRT {version} is too old: qkrope needs TensorRT {MIN_TRT_MAJOR}.x or newer "
            f"(IPluginV3 plugins, strongly typed networks, the parser preferring a registered "
            f"plugin over an ONNX local function from 10.7). Fix: install TensorRT 10.7+ or use "
            f"an NGC TensorRT container")
    return major, minor


def load_plugin_library(trt, path: str | os.PathLike, *, version_compatible: bool = False,
                        registry=None) -> Any:
    """Load the plugin library so its creators are registered, then check QKNormRoPE is there.

    The regular library registers its creator when loaded (a static initialiser calling
    ``getPluginRegistry()->registerCreator``), so ``dlopen`` with RTLD_GLOBAL is enough (this is
    also what Triton's TensorRT backend and ``trtexec --staticPlugins`` do). The VC library
    exports ``getCreators``/``setLoggerFinder`` instead and must go through
    ``IPluginRegistry.load_library`` so that TensorRT can serialise it into a VC engine.
    """
    path = str(Path(path).resolve())
    if not os.path.exists(path):
        raise InputFileNotFoundError(f"plugin library {path} does not exist. Fix: build it with "
                                f"`qkrope build-plugin` and pass its path (--plugin PATH, or "
                                f"plugin= in Python)")
    registry = registry if registry is not None else trt.get_plugin_registry()
    if version_compatible:
        handle = registry.load_library(path)
        if handle is None:
            raise EngineBuildError(
                f"TensorRT could not load the version-compatible plugin library {path} with "
                f"IPluginRegistry.load_library (see TensorRT's log above). Fix: pass the VC "
                f"library (the one exporting getCreators), e.g. the output of "
                f"`qkrope build-plugin` named *_vc.so")
    else:
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise EngineBuildError(f"could not load the plugin library {path}: {exc}. Fix: check "
                                   f"it was built for this TensorRT/CUDA and that "
                                   f"LD_LIBRARY_PATH reaches libnvinfer") from exc
    creator = registry.get_creator(contract.PLUGIN_NAME, contract.PLUGIN_VERSION,
                                   contract.PLUGIN_NAMESPACE)
    if creator is None:
        raise EngineBuildError(
            f"{path} loaded, but TensorRT's plugin registry has no creator "
            f"{contract.PLUGIN_NAME!r} version {contract.PLUGIN_VERSION!r} in namespace "
            f"{contract.PLUGIN_NAMESPACE!r}. Fix: pass qkrope's plugin library "
            f"({'the VC build' if version_compatible else 'the self-registering build'}; "
            f"`qkrope build-plugin` makes both)")
    return handle


class HostCodeNotAllowedError(QkropeError, PermissionError):
    """A version-compatible engine carries host code (its plugin library) that TensorRT would run
    on deserialisation; the caller did not allow it (``allow_host_code=True``,
    ``--allow-host-code``)."""


#: --help of ``--allow-host-code`` (the commands that deserialise an engine)
ALLOW_HOST_CODE_HELP = ("run the host code a version-compatible engine carries (its plugin "
                        "library, which TensorRT loads with the engine): only for an engine you "
                        "trust; without it such an engine is refused")


def check_host_code(sidecar: EngineInfo | None, path: str | os.PathLike,
                    allow_host_code: bool) -> bool:
    """Whether TensorRT is to be allowed to run the engine's host code: only when the caller
    allowed it. A sidecar saying the engine is version-compatible (it carries its plugin library,
    code a file brought) without that is :class:`HostCodeNotAllowedError`, one line."""
    if sidecar is not None and sidecar.version_compatible and not allow_host_code:
        raise HostCodeNotAllowedError(
            f"{path} is a version-compatible engine: it carries its plugin library as host code "
            f"that TensorRT runs when it loads the engine, and qkrope runs no code a file brings. "
            f"Fix: if you trust {path}, pass allow_host_code=True (--allow-host-code), or "
            f"rebuild it without --version-compatible")
    return bool(allow_host_code)


def trt_major(trt) -> int:
    try:
        return int(str(getattr(trt, "__version__", "0")).split(".")[0])
    except ValueError:
        return 0



@dataclass
class LoadedEngine:
    """A deserialised engine with what a runner needs beside it: the ``tensorrt`` module, the
    engine's sidecar (None without one), the file, the plugin library loaded for it, and the
    ``trt.Runtime`` and logger it was deserialised with (kept alive as long as the engine)."""

    engine: Any
    trt: Any
    sidecar: EngineInfo | None = None
    path: str = ""
    plugin_path: str | None = None
    runtime: Any = None
    logger: Any = None


def engine_from_path(path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
                     verbose: bool = False, allow_host_code: bool = False,
                     plugin_layers: bool = True, sha256: str | None = None) -> LoadedEngine:
    """Deserialise the engine at ``path`` for the TensorRT runner: its sidecar first (a pair
    that does not identify itself is refused without TensorRT, and so is a version-compatible
    engine unless ``allow_host_code``), then TensorRT and a CUDA GPU, the plugin library and
    the engine. The plugin library is the caller's: ``plugin``, else ``QKROPE_PLUGIN_LIB`` or
    what ``qkrope build-plugin`` built (:func:`~qkrope.runtime.plugin_build.resolve_plugin_library`;
    the library the sidecar records only checks it, by sha256, and is never loaded because the
    sidecar names it). A version-compatible engine carries its own library, which TensorRT runs
    only with ``allow_host_code=True``. A failed deserialisation is one line saying which
    TensorRT and GPU built the engine.

    ``plugin_layers=False``: an engine of a graph without QKNormRoPE nodes (a pipeline stage's:
    its text encoder, VAE), so no plugin library is loaded for it. ``sha256``: the engine's
    recorded digest, compared with the bytes read before TensorRT sees them (one line on a
    mismatch: the file changed after its build)."""
    from .plugin_build import resolve_plugin_library
    from .runner import RunnerError

    sidecar = EngineInfo.load(path) if engine_sidecar_path(path).exists() else None
    host_code = check_host_code(sidecar, path, allow_host_code)
    trt = import_tensorrt("the TensorRT runner (qkrope.runtime.load of an engine)")
    import torch

    if not torch.cuda.is_available():
        raise MissingDependencyError(
            "the TensorRT runner needs a CUDA GPU and a CUDA build of torch; none is "
            "available here. Fix: run on a GPU machine (e.g. an NGC TensorRT container), or "
            "load the .onnx file to use ONNX Runtime")
    vc = bool(sidecar and sidecar.version_compatible)
    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    plugin_path = None
    if host_code:
        # the caller allowed it: TensorRT may run the host code serialised in the engine (a
        # version-compatible engine's VC plugin library, loaded on deserialisation)
        runtime.engine_host_code_allowed = True
    if not vc and plugin_layers:
        # the caller's library (plugin=, QKROPE_PLUGIN_LIB, build/plugins), never the one the
        # sidecar names; a warning if it is not the one the engine was built with
        plugin_path = str(resolve_plugin_library(
            plugin, sidecar.plugin if sidecar else None, kind="plugin", check_hash="warn",
            source=path))
        load_plugin_library(trt, plugin_path, version_compatible=False)
    blob = Path(path).read_bytes()
    if sha256 is not None:
        import hashlib

        if hashlib.sha256(blob).hexdigest() != sha256:
            raise RunnerError(f"{path} is not the engine its build recorded (its sha256 "
                              f"differs): it was changed after the build. Fix: rebuild it with "
                              f"`qkrope build`")
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        side = sidecar
        raise RunnerError(
            f"TensorRT could not deserialise {path} (see its log above): it was built by "
            f"TensorRT {side.tensorrt_version if side else '?'} for "
            f"{((side.gpu if side else None) or {}).get('name', '?')}; engines only load on the "
            f"same TensorRT version and GPU (or, built with `qkrope build --version-compatible`, "
            f"on later TensorRT versions). Fix: rebuild it with `qkrope build`")
    return LoadedEngine(engine, trt, sidecar, str(path), plugin_path, runtime, logger)


__all__ = ["ALLOW_HOST_CODE_HELP", "EngineBuildError", "HostCodeNotAllowedError", "LoadedEngine",
           "MIN_TRT_MAJOR", "check_host_code", "check_trt_version", "engine_from_path",
           "import_tensorrt", "load_plugin_library", "trt_major"]
