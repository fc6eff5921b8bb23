"""Build and locate the native libraries: ``qkrope build-plugin``.

The build itself is ``scripts/build_plugins.sh`` (CMake over ``plugins/``); this module runs it
from Python and finds what it produced:

- ``libqkrope_plugin.so``: the TensorRT plugin that registers itself when loaded (``LD_PRELOAD``,
  ``polygraphy --plugins``, ``trtexec --staticPlugins``, Triton ``plugins=``).
- ``libqkrope_vc_plugin.so``: exports only ``getCreators``/``setLoggerFinder``
  (``trtexec --dynamicPlugins``, ``IPluginRegistry::loadLibrary``, version-compatible engines).
- ``libqkrope_kernels.so`` (CUDA C-ABI launcher) and ``libqkrope_kernel_host.so`` (CPU build).

Lookup order for :func:`find_plugin_library`: the environment variable (``QKROPE_PLUGIN_LIB``,
``QKROPE_VC_PLUGIN_LIB``, ...), then ``<repo>/build/plugins/``.

A library is loaded only because the caller named it: :func:`resolve_plugin_library` never takes
the path an engine sidecar records (a folder someone else wrote can name any file, with any
sha256); the record only checks the caller's library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from qkrope.errors import InputError, QkropeError
from qkrope.runtime import toolchain
from qkrope.sidecars import PluginRecord

__all__ = [
    "PluginBuildError",
    "PluginNotBuiltError",
    "LIBRARY_FILES",
    "DEFAULT_BUILD_DIR",
    "build_command",
    "built_architectures",
    "DEPLOY_ARCH",
    "build_plugins",
    "find_plugin_library",
    "PluginMismatchError",
    "PluginNotNamedError",
    "DEFAULT_PLUGIN_HELP",
    "resolve_plugin_library",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_plugins.sh"
DEFAULT_BUILD_DIR = toolchain.PLUGINS_BUILD_DIR

# kind -> (file name, environment variable overriding the path): the libraries that
# `qkrope build-plugin` builds, from the project's one table (qkrope.runtime.toolchain)
LIBRARY_FILES = {kind: (toolchain.LIBRARIES[kind].file, toolchain.LIBRARIES[kind].env)
                 for kind in ("plugin", "vc", "kernels", "kernel_host", "host_test")}
_ALIASES = {"trt": "plugin", "static": "plugin", "dynamic": "vc", "version_compatible": "vc"}


class PluginBuildError(QkropeError, RuntimeError):
    """The native build failed; the message carries the command and the end of its output."""


class PluginNotBuiltError(QkropeError, FileNotFoundError):
    """A native library was asked for but has not been built; the message says how to build it."""


NVCC_DEFAULT_PATH = toolchain.NVCC_DEFAULT_PATH
# The CUDA compiler the build would use, or None: the one rule (qkrope.runtime.toolchain), which
# the CLI, the main job, the tests and the shell scripts share.
find_nvcc = toolchain.find_nvcc


DEPLOY_ARCH = "all"  # --arch value of the deployable fat binary (plugins/cmake/QkropeCuda.cmake)


def built_architectures(build_dir: str | os.PathLike | None = None) -> str | None:
    """The CUDA architectures a build folder was configured with (CMAKE_CUDA_ARCHITECTURES in its
    CMakeCache.txt: ``native``, ``80-virtual`` where no GPU was visible, or the list asked for),
    or None where there is no CUDA build."""
    cache = Path(build_dir or DEFAULT_BUILD_DIR) / "CMakeCache.txt"
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("CMAKE_CUDA_ARCHITECTURES:"):
            return line.split("=", 1)[1].strip() or None
    return None


def build_command(*, host_only: bool = False, arch: str | None = None, tensorrt_root: str | None = None,
                  build_dir: str | os.PathLike | None = None, jobs: int | None = None,
                  clean: bool = False) -> list[str]:
    """The ``bash scripts/build_plugins.sh ...`` command line for these options."""
    cmd = ["bash", str(BUILD_SCRIPT)]
    if host_only:
        cmd.append("--host-only")
    if arch:
        cmd += ["--arch", str(arch)]
    if tensorrt_root:
        cmd += ["--tensorrt-root", str(tensorrt_root)]
    if build_dir is not None:
        cmd += ["--build-dir", str(build_dir)]
    if jobs is not None:
        cmd += ["--jobs", str(int(jobs))]
    if clean:
        cmd.append("--clean")
    return cmd


def _shell_line(cmd: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def build_plugins(*, host_only: bool = False, arch: str | None = None, tensorrt_root: str | None = None,
                  build_dir: str | os.PathLike | None = None, jobs: int | None = None, clean: bool = False,
                  quiet: bool = False) -> Path:
    """Run ``scripts/build_plugins.sh`` and return the build directory.

    ``quiet`` captures the output (shown only on failure); otherwise it streams to the terminal,
    which is the progress report for a build that takes a minute or more.
    """
    if shutil.which("bash") is None:
        raise PluginBuildError("bash is needed to run scripts/build_plugins.sh")
    if not BUILD_SCRIPT.is_file():
        raise PluginBuildError(f"{BUILD_SCRIPT} not found: build_plugins needs a source checkout of qkrope")
    cmd = build_command(host_only=host_only, arch=arch, tensorrt_root=tensorrt_root, build_dir=build_dir,
                        jobs=jobs, clean=clean)
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)
    if quiet:
        res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stdout + res.stderr)[-4000:]
            raise PluginBuildError(f"native build failed (exit {res.returncode}): {_shell_line(cmd)}\n{tail}")
    else:
        res = subprocess.run(cmd, cwd=REPO_ROOT, env=env)
        if res.returncode != 0:
            raise PluginBuildError(f"native build failed (exit {res.returncode}): {_shell_line(cmd)}; "
                                   "see the output above")
    return Path(build_dir).resolve() if build_dir is not None else DEFAULT_BUILD_DIR


def find_plugin_library(kind: str = "plugin", *, build_dir: str | os.PathLike | None = None) -> Path:
    """Path of a built library: ``kind`` is "plugin" (self-registering), "vc" (version-compatible),
    "kernels", "kernel_host" or "host_test". Raises :class:`PluginNotBuiltError` with the build
    command when it is missing."""
    key = _ALIASES.get(kind, kind)
    if key not in LIBRARY_FILES:
        raise InputError(f"unknown library kind {kind!r}; expected one of {sorted(LIBRARY_FILES)}")
    name, env_var = LIBRARY_FILES[key]
    override = os.environ.get(env_var)
    if override:
        path = Path(override)
        if not path.is_file():
            raise PluginNotBuiltError(f"{env_var}={override} does not name a file")
        return path.resolve()
    base = Path(build_dir) if build_dir is not None else DEFAULT_BUILD_DIR
    path = base / name
    if path.is_file():
        return path.resolve()
    how = "bash scripts/build_plugins.sh --host-only" if key == "kernel_host" else "qkrope build-plugin"
    raise PluginNotBuiltError(
        f"{name} not found in {base}. Build it with `{how}` (same as `bash scripts/build_plugins.sh`"
        f" from the repository root), or set {env_var} to its path.")


#: what ``--plugin`` defaults to where a command loads or serves an engine (its --help)
DEFAULT_PLUGIN_HELP = (
    "default: $QKROPE_PLUGIN_LIB ($QKROPE_VC_PLUGIN_LIB for a version-compatible engine), else "
    "the one `qkrope build-plugin` built; the library the engine's sidecar records is never "
    "loaded because the sidecar names it, only compared with this one (sha256)")


class PluginMismatchError(QkropeError, RuntimeError):
    """The plugin library is not the one the engine was built with (its sha256 differs)."""


class PluginNotNamedError(QkropeError, PermissionError):
    """A file (an engine sidecar) names a plugin library the caller did not give: qkrope loads
    no library because a file names it; the message says how the caller allows it."""


def resolve_plugin_library(explicit: str | os.PathLike | None = None,
                           recorded: PluginRecord | None = None, kind: str = "plugin",
                           *, check_hash: str = "off",
                           build_dir: str | os.PathLike | None = None,
                           source: str | os.PathLike | None = None) -> Path:
    """The plugin library to load, as an absolute path: the one resolver used by ``qkrope
    build``, the TensorRT runner, ``qkrope refit`` and ``qkrope triton-repo``.

    Only a library the caller named: ``explicit`` (``plugin=`` / ``--plugin``; must exist),
    else the library of ``kind`` ("plugin" or "vc") the caller set up
    (:func:`find_plugin_library`: the environment variable ``QKROPE_PLUGIN_LIB`` /
    ``QKROPE_VC_PLUGIN_LIB``, else what ``qkrope build-plugin`` built in this installation's
    ``build/plugins``, a folder no model folder names). The library an engine sidecar records
    (``recorded``, read from ``source``) is never the answer, whatever its sha256: when it names
    an existing file and the caller set up none, :class:`PluginNotNamedError` says in one line
    how to allow it; otherwise :class:`PluginNotBuiltError` (a FileNotFoundError) says how to
    build or pass one.

    ``check_hash`` compares the result with the record's sha256: ``"off"``, ``"warn"`` (a
    RuntimeWarning) or ``"error"`` (:class:`PluginMismatchError`).
    """
    if check_hash not in ("off", "warn", "error"):
        raise InputError(f"check_hash must be 'off', 'warn' or 'error'; got {check_hash!r}")
    if explicit is not None and str(explicit) != "":
        path = Path(explicit)
        if not path.is_file():
            raise PluginNotBuiltError(f"plugin library {path} does not exist. Fix: build it with "
                                      f"`qkrope build-plugin` or pass the path of a built "
                                      f"{LIBRARY_FILES[_ALIASES.get(kind, kind)][0]}")
        path = path.resolve()
    else:
        try:
            path = find_plugin_library(kind, build_dir=build_dir)
        except PluginNotBuiltError:
            env_set = os.environ.get(LIBRARY_FILES[_ALIASES.get(kind, kind)][1])
            if not env_set and recorded is not None and recorded.path and \
                    Path(recorded.path).is_file():
                raise _not_named(recorded.path, kind, source) from None
            raise
    if check_hash != "off" and recorded is not None and recorded.sha256:
        from qkrope._fileio import sha256_file

        actual = sha256_file(path)
        if actual != recorded.sha256:
            if check_hash == "error":
                raise PluginMismatchError(
                    f"plugin library {path} (sha256 {actual[:12]}...) is not the one the engine "
                    f"was built with (sha256 {recorded.sha256[:12]}..., {recorded.path}); an "
                    f"engine must be served with the plugin it was built against. Pass that "
                    f"library, rebuild the engine, or use --no-plugin-hash-check if you know "
                    f"they are compatible")
            import warnings

            warnings.warn(f"the plugin library {path} differs from the one the engine was built "
                          f"with ({recorded.path}, sha256 {recorded.sha256[:12]}...): results "
                          f"may differ or deserialisation may fail; rebuild the engine with this "
                          f"library", RuntimeWarning, stacklevel=3)
    return path


def _not_named(path: str, kind: str, source: str | os.PathLike | None) -> PluginNotNamedError:
    env_var = LIBRARY_FILES[_ALIASES.get(kind, kind)][1]
    where = f"the sidecar of {source}" if source else "the engine's sidecar"
    return PluginNotNamedError(
        f"{where} names the plugin library {path}; qkrope loads no library a file names. Fix: "
        f"if you trust it, pass plugin={str(path)!r} (--plugin) or set {env_var}={path}")
