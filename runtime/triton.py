"""``qkrope triton-repo``: a Triton Inference Server model repository for a built engine.

Layout written (one model directory, created atomically)::

    REPO/<name>/config.pbtxt             platform "tensorrt_plan", I/O from the engine's sidecar
    REPO/<name>/1/model.plan             copy of the engine
    REPO/<name>/libqkrope_plugin.so      copy of the plugin library (unless --no-copy-plugin);
                                         libqkrope_vc_plugin.so for a version-compatible engine,
                                         nothing for an engine built without the plugin

Only an engine with its engine sidecar (``M.engine.json``, :class:`EngineInfo`) is accepted: an
ONNX model (by suffix or content) is refused, and the plugin library must match the sha256 the
sidecar records (``--no-plugin-hash-check`` to skip). A version-compatible engine carries its VC
plugin; the printed command adds ``--backend-config=tensorrt,version-compatible=true``.

The plugin library is a *file* in the model directory, not a ``REPO/plugins/`` folder: Triton
treats every sub-directory of a model repository as a model and, with the default
``--model-control-mode=none`` and ``--exit-on-error=true``, fails to start on a directory without
a model in it. Files next to ``config.pbtxt`` (like label files) are ignored by Triton's version
scan, so the model directory stays self-contained and moves with one rename.

The TensorRT backend ``dlopen``s the libraries named in ``--backend-config=tensorrt,plugins=...``
before it deserialises any plan, so the library must register its plugin creators when loaded
(the qkrope plugin library does, through its static registrar / ``getCreators`` export).

``max_batch_size`` is 0 by default: TensorRT 10 networks have explicit batch dimensions, and the
attention engine's RoPE cache inputs (``[rows, rotary_dim]``) have no batch axis at all, so
Triton's implicit leading batch dimension (``max_batch_size > 0``) cannot describe them. With
``max_batch_size: 0`` the batch is an ordinary dynamic dim (-1) of the activation inputs, and
clients send full shapes. ``--max-batch-size N > 0`` is accepted only for engines whose every
input and output has a dynamic leading dimension.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from qkrope import dtypes
from qkrope._fileio import staged_outputs
from qkrope.errors import QkropeError
from qkrope.sidecars import EngineInfo

from . import trt_utils as tu
from .plugin_build import LIBRARY_FILES, PluginNotBuiltError, resolve_plugin_library

PLUGIN_FILE_NAME = LIBRARY_FILES["plugin"][0]      # libqkrope_plugin.so
VC_PLUGIN_FILE_NAME = LIBRARY_FILES["vc"][0]       # libqkrope_vc_plugin.so

class TritonRepoError(QkropeError, RuntimeError):
    """Bad input for ``qkrope triton-repo`` (the message says what was found and the fix)."""


def triton_dtype(dtype: Any) -> str:
    """Map a dtype spelling (numpy/torch/TensorRT name, e.g. ``"bfloat16"``, ``"torch.float16"``,
    ``"DataType.BF16"``, ``"HALF"``) to Triton's ``TYPE_*`` name (:mod:`qkrope.runtime.dtypes`)."""
    name = dtypes.canonical(dtype)
    if name.startswith(("float8", "float4", "int4", "fp8", "fp4", "e4m3", "e5m2")):
        raise TritonRepoError(
            f"tensor dtype {dtype!r} has no Triton TYPE_* equivalent; Triton's TensorRT backend "
            "cannot serve engines with such I/O tensors (keep FP8/INT4 inside the network)")
    triton = dtypes.triton_type(name)
    if triton is None:
        raise TritonRepoError(f"unknown tensor dtype {dtype!r} in the engine sidecar; expected one "
                              f"of {sorted(dtypes.TRITON_BY_NAME)}")
    return triton


def default_model_name(engine: os.PathLike | str) -> str:
    """The engine file's stem (:attr:`pathlib.PurePath.stem`): the name without its last suffix,
    ``.engine`` / ``.plan`` (any case) or another (``attn.fp16.engine`` -> ``attn.fp16``,
    ``model.PLAN`` -> ``model``, ``attn`` -> ``attn``)."""
    return Path(engine).stem


def check_engine_file(engine: os.PathLike | str) -> None:
    """Refuse what is not a TensorRT engine: a missing or empty file, an ONNX model
    (:func:`qkrope.runtime.trt_utils.check_engine_file`; Triton's tensorrt_plan platform serves
    serialised engines)."""
    engine = Path(engine)
    if not engine.is_file():
        raise TritonRepoError(f"engine file not found: {engine}. Build one first: "
                              "qkrope build MODEL.onnx -o MODEL.engine --plugin LIB")
    tu.check_engine_file(engine)


def load_engine_sidecar(engine: os.PathLike | str) -> EngineInfo:
    """The engine's sidecar (:meth:`EngineInfo.load`: an engine sidecar, not a model's), after
    checking the engine file is one (:func:`check_engine_file`)."""
    check_engine_file(engine)
    return EngineInfo.load(engine)


def triton_dims(info: EngineInfo) -> dict[str, list[int]]:
    """Every engine tensor's dims as Triton sees them: an axis is -1 when the sidecar's shape
    says -1 or when an optimisation profile lets it vary (min != max)."""
    ranges = info.profile_ranges()
    input_names = {t.name for t in info.inputs}
    out: dict[str, list[int]] = {}
    for t in info.inputs + info.outputs:
        dims = [int(d) for d in t.shape]
        for lo, hi in ranges.get(t.name, []) if t.name in input_names else []:
            if len(lo) != len(dims):
                raise TritonRepoError(
                    f"input {t.name!r}: the sidecar's shape has rank {len(dims)} but a profile "
                    f"gives rank {len(lo)}; the sidecar is inconsistent, rebuild the engine")
            dims = [-1 if (a != b) else d for d, a, b in zip(dims, lo, hi)]
        out[t.name] = dims
    return out


def _pb_str(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid protobuf text-format string


def render_config(name: str, info: EngineInfo, *, max_batch_size: int = 0, instances: int = 1,
                  gpus: Iterable[int] | None = None) -> str:
    """config.pbtxt text for a ``tensorrt_plan`` model."""
    if instances < 1:
        raise TritonRepoError(f"--instances must be >= 1, got {instances}")
    if max_batch_size < 0:
        raise TritonRepoError(f"--max-batch-size must be >= 0, got {max_batch_size}")
    dims = triton_dims(info)
    tensors = {kind: [(t.name, triton_dtype(t.dtype), dims[t.name]) for t in items]
               for kind, items in (("input", info.inputs), ("output", info.outputs))}
    if max_batch_size > 0:
        bad = [t.name for t in info.inputs + info.outputs if not dims[t.name]
               or dims[t.name][0] != -1]
        # Named axes (qkrope build records the exporter's names under "axes") settle it.
        bad += [t.name for t in info.inputs + info.outputs
                if t.axes and t.axes[0] not in (None, "batch") and t.name not in bad]
        # Otherwise the leading axis is a batch axis only if every input's profile gives it the same range
        # (a cache's row count, [1, max_tokens], is not the batch range).
        lead = {}
        for name, ranges in info.profile_ranges().items():
            if ranges and ranges[0][0]:
                lead[name] = (ranges[0][0][0], ranges[0][1][0])
        if len(set(lead.values())) > 1:
            common = max(set(lead.values()), key=list(lead.values()).count)
            bad += [n for n, r in lead.items() if r != common and n not in bad]
        batch_max = min((hi for _, hi in lead.values()), default=None)
        if not bad and batch_max is not None and max_batch_size > batch_max:
            raise TritonRepoError(f"--max-batch-size {max_batch_size} exceeds the engine "
                                  f"profile's largest batch {batch_max}; rebuild the engine "
                                  "with a larger --max-batch or lower --max-batch-size")
        if bad:
            raise TritonRepoError(
                f"--max-batch-size {max_batch_size} needs a dynamic leading batch dim on every "
                f"input and output, but {bad} have none (the RoPE caches [rows, rotary_dim] are "
                "shared across the batch). Use --max-batch-size 0: the batch stays an explicit, "
                "dynamic dim of hidden_states / encoder_hidden_states")
        tensors = {k: [(n, dt, d[1:]) for n, dt, d in v] for k, v in tensors.items()}
    lines = [f"name: {_pb_str(name)}", 'platform: "tensorrt_plan"',
             f"max_batch_size: {max_batch_size}",
             'default_model_filename: "model.plan"']
    for kind, specs in tensors.items():
        for t_name, t_dtype, t_dims in specs:
            text = ", ".join(str(d) for d in t_dims)
            lines.append(f"{kind} {{\n  name: {_pb_str(t_name)}\n  data_type: {t_dtype}\n"
                         f"  dims: [ {text} ]\n}}")
    group = f"instance_group {{\n  count: {instances}\n  kind: KIND_GPU\n"
    if gpus:
        group += f"  gpus: [ {', '.join(str(int(g)) for g in gpus)} ]\n"
    lines.append(group + "}")
    return "\n".join(lines) + "\n"


def parse_config(text: str):
    """Parse config.pbtxt text into ``tritonclient``'s ``ModelConfig`` protobuf (schema check)."""
    from qkrope._deps import require

    pb = require("tritonclient.grpc.model_config_pb2", "checking a Triton model config")
    text_format = require("google.protobuf.text_format", "checking a Triton model config")
    return text_format.Parse(text, pb.ModelConfig())


@dataclass
class RepoResult:
    model_dir: Path
    config_path: Path
    plan_path: Path
    plugin_path: Path | None  # None: a function-body engine, no plugin
    command: str
    version_compatible: bool = False


def server_command(repo: Path, plugin_path: Path | None, *,
                   version_compatible: bool = False, plugin_in_engine: bool = False) -> str:
    """The tritonserver line: the plugin library for the TensorRT backend to dlopen (not for a
    version-compatible engine that carries its plugin, nor for an engine without one), and
    ``version-compatible=true`` for a version-compatible engine (TensorRT must be allowed to run
    the host code serialised in it)."""
    parts = [f"tritonserver --model-repository={repo.resolve()}"]
    if plugin_path is not None and not (version_compatible and plugin_in_engine):
        parts.append(f"--backend-config=tensorrt,plugins=\"{plugin_path.resolve()}\"")
    if version_compatible:
        parts.append("--backend-config=tensorrt,version-compatible=true")
    return " ".join(parts)


def resolve_engine_plugin(info: EngineInfo, plugin: os.PathLike | str | None, *,
                          check_plugin_hash: bool = True) -> Path | None:
    """The plugin library to serve ``info``'s engine with, checked against the engine sidecar's
    record (sha256) unless ``check_plugin_hash`` is False; None for an engine built without the
    plugin. A version-compatible engine takes the VC library."""
    if info.plugin is None:
        if info.plugin_layers:
            raise TritonRepoError(
                f"{info.source}: the engine has {info.plugin_layers} plugin layers but its "
                f"sidecar records no plugin library, so the library to serve it with cannot be "
                f"checked. Fix: rebuild the engine with `qkrope build`")
        if plugin is not None:
            raise TritonRepoError(f"the engine was built without the plugin ({info.source} "
                                  f"records none); drop --plugin")
        return None
    if check_plugin_hash and not info.plugin.sha256:
        raise TritonRepoError(
            f"{info.source} records no sha256 of the plugin library the engine was built with, "
            f"so the library to serve it with cannot be checked. Fix: rebuild the engine with "
            f"`qkrope build` (it records the hash), or pass --no-plugin-hash-check if you know "
            f"the library is the right one")
    kind = "vc" if info.version_compatible else "plugin"
    try:
        return resolve_plugin_library(None if plugin is None else str(plugin), info.plugin,
                                      kind=kind,
                                      check_hash="error" if check_plugin_hash else "off")
    except PluginNotBuiltError as exc:
        raise TritonRepoError(f"plugin library not found: {exc}") from None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot, so the caller falls back to two renames."""
    import ctypes
    import errno

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(staged: Path, target: Path) -> None:
    """Put the directory ``staged`` at ``target``: a rename when there is none; else one
    atomic exchange (the old directory ends up at ``staged``, inside the staging folder that is
    removed afterwards), so a reader or a kill never sees ``target`` missing or half-written.
    Without an atomic exchange: two renames, the old directory put back on any failure."""
    if not target.exists():
        os.rename(staged, target)
        return
    if _exchange(staged, target):
        return
    old = staged.with_name(staged.name + ".old")
    os.rename(target, old)
    try:
        os.rename(staged, target)
    except BaseException:
        if not target.exists():
            os.rename(old, target)  # put the previous model back before staging is removed
        raise


def write_repository(engine: os.PathLike | str, repo: os.PathLike | str, *,
                     plugin: os.PathLike | str | None = None, name: str | None = None,
                     max_batch_size: int = 0, instances: int = 1, force: bool = False,
                     copy_plugin: bool = True, check_plugin_hash: bool = True) -> RepoResult:
    """Write ``repo/<name>`` for ``engine``. The model directory is assembled in a staging
    folder next to ``repo`` (:func:`qkrope._fileio.staged_outputs`: removed on any failure or
    SIGTERM, and by the next run after a SIGKILL) and swapped in whole (:func:`swap_in`), so a
    reader sees the old model or the new one, never a mix; an existing model directory is
    replaced only with ``force``. Write failures are one-line OutputWriteErrors."""
    engine = Path(engine)
    repo = Path(repo)
    info = load_engine_sidecar(engine)
    name = name or default_model_name(engine)
    if not name or "/" in name or name.startswith("."):
        raise TritonRepoError(f"invalid model name {name!r}: Triton model names are directory "
                              "names; pass --name")
    plugin_src = resolve_engine_plugin(info, plugin, check_plugin_hash=check_plugin_hash)
    vc = bool(info.version_compatible)
    plugin_name = VC_PLUGIN_FILE_NAME if vc else PLUGIN_FILE_NAME
    copy_plugin = copy_plugin and plugin_src is not None
    text = render_config(name, info, max_batch_size=max_batch_size, instances=instances)
    try:
        parse_config(text)  # fail here, not in tritonserver, if the text is not a ModelConfig
    except ImportError as exc:  # MissingDependencyError is an ImportError
        print(f"warning: config.pbtxt not checked against Triton's ModelConfig schema "
              f"({str(exc).splitlines()[0] if str(exc) else 'tritonclient not installed'}); "
              f"install tritonclient[grpc] to check it", file=sys.stderr)

    target = repo / name
    if target.exists() and not force:
        raise TritonRepoError(f"{target} already exists; pass --force to replace it or "
                              "--name to write another model")
    if repo.exists() and not repo.is_dir():
        raise TritonRepoError(f"{repo} exists and is not a directory")
    if target.exists() and (target.is_symlink() or not target.is_dir()):
        raise TritonRepoError(f"{target} exists and is not a model directory; remove it or "
                              f"pass --name")
    # Assembled in a staging folder next to the repository (not inside it: Triton takes every
    # sub-directory of a repository for a model), then swapped in whole.
    with staged_outputs(repo.parent, [], flag="--output") as st:
        staged = st.dir / name
        (staged / "1").mkdir(parents=True)
        shutil.copyfile(engine, staged / "1" / "model.plan")
        (staged / "config.pbtxt").write_text(text)
        if copy_plugin:
            shutil.copy2(plugin_src, staged / plugin_name)
        repo.mkdir(parents=True, exist_ok=True)
        swap_in(staged, target)
    plugin_final = (target / plugin_name) if copy_plugin else plugin_src
    in_engine = bool(info.plugin and info.plugin.serialized_in_engine)
    return RepoResult(target, target / "config.pbtxt", target / "1" / "model.plan",
                      plugin_final.resolve() if plugin_final is not None else None,
                      server_command(repo, plugin_final, version_compatible=vc,
                                     plugin_in_engine=in_engine), version_compatible=vc)
