"""ctypes bindings to the kernel libraries built from ``plugins/kernel``.

- :func:`host_qk_norm_rope` runs ``libqkrope_kernel_host.so``: the kernel's own arithmetic
  (``plugins/kernel/qknorm_rope_math.h``) compiled for the CPU, on torch CPU tensors. The tests use
  it to check the kernel maths against :func:`qkrope.export.qk_norm_rope_reference` without a GPU.
- :func:`cuda_qk_norm_rope` launches the CUDA kernel from ``libqkrope_kernels.so`` on torch CUDA
  tensors, on the current stream (no TensorRT needed).

Library lookup: the environment variables ``QKROPE_KERNEL_HOST_LIB`` / ``QKROPE_KERNELS_LIB``
(a file path), else ``<repo>/build/plugins/`` then ``<repo>/build/kernel/``. Build them with::

    cmake -S plugins/kernel -B build/kernel && cmake --build build/kernel -j2          # CPU library
    cmake -S plugins/kernel -B build/kernel -DQKROPE_WITH_CUDA=ON && cmake --build build/kernel -j2

(or through ``plugins/CMakeLists.txt``: ``cmake -S plugins -B build/plugins``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from qkrope.export.reference import check_tensor_layout

__all__ = [
    "KernelLibraryError",
    "KernelStatusError",
    "host_qk_norm_rope",
    "cuda_qk_norm_rope",
    "host_library_path",
    "cuda_library_path",
    "DTYPE_CODES",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST_LIB_ENV = "QKROPE_KERNEL_HOST_LIB"
CUDA_LIB_ENV = "QKROPE_KERNELS_LIB"
HOST_LIB_NAME = "libqkrope_kernel_host.so"
CUDA_LIB_NAME = "libqkrope_kernels.so"
_SEARCH_DIRS = ("build/plugins", "build/kernel")

HOST_BUILD_COMMAND = ("cmake -S plugins/kernel -B build/kernel && cmake --build build/kernel -j2")
# The architecture is spelled out: CMAKE_CUDA_ARCHITECTURES=native needs CMake >= 3.24 (see
# cuda_arch_for_cmake); 90 = Hopper (H100/H200), 100 = Blackwell, 89 = Ada, 80/86 = Ampere.
CUDA_BUILD_COMMAND = ("cmake -S plugins/kernel -B build/kernel -DQKROPE_WITH_CUDA=ON "
                      "-DCMAKE_CUDA_ARCHITECTURES=<sm, e.g. 90> && cmake --build build/kernel -j2")


def cuda_arch_for_cmake(cmake: str | None = None) -> str:
    """A CMAKE_CUDA_ARCHITECTURES value for this machine: the current GPU's compute capability
    (e.g. "90") when PyTorch sees one, else "native" if cmake is >= 3.24 (which understands it),
    else "90"."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    import re
    import shutil
    import subprocess
    exe = cmake or shutil.which("cmake")
    if exe:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
            m = re.search(r"(\d+)\.(\d+)", out)
            if m and (int(m.group(1)), int(m.group(2))) >= (3, 24):
                return "native"
        except OSError:
            pass
    return "90"

# qkrope::DataType
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 512


class KernelLibraryError(RuntimeError):
    """A kernel library is missing or cannot be loaded."""


class KernelStatusError(RuntimeError):
    """The library refused the call (a non-zero qkrope::Status)."""

    def __init__(self, status: int, text: str, what: str):
        super().__init__(f"{what} failed with status {status}: {text}")
        self.status = status


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}

_ARGTYPES = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int32] * 3


def _find(env: str, name: str) -> Path | None:
    explicit = os.environ.get(env)
    if explicit:
        return Path(explicit)
    for d in _SEARCH_DIRS:
        p = REPO_ROOT / d / name
        if p.is_file():
            return p
    return None


def host_library_path() -> Path | None:
    """Where the CPU library would be loaded from (None if not found)."""
    return _find(HOST_LIB_ENV, HOST_LIB_NAME)


def cuda_library_path() -> Path | None:
    """Where the CUDA launcher library would be loaded from (None if not found)."""
    return _find(CUDA_LIB_ENV, CUDA_LIB_NAME)


def _load(env: str, name: str, build: str, run_fn: str, status_fn: str, cuda: bool) -> ctypes.CDLL:
    path = _find(env, name)
    if path is None or not path.is_file():
        where = (f"{env}={os.environ[env]!r}" if os.environ.get(env) else
                 " or ".join(str(REPO_ROOT / d / name) for d in _SEARCH_DIRS))
        raise KernelLibraryError(
            f"{name} not found (looked at {where}). Build it from the repository root with: "
            f"{build}   or point {env} at the file.")
    key = str(path.resolve())
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            try:
                lib = ctypes.CDLL(key)
            except OSError as exc:
                raise KernelLibraryError(f"cannot load {key}: {exc}. Rebuild it with: {build}") from exc
            fn = getattr(lib, run_fn)
            fn.restype = ctypes.c_int32
            fn.argtypes = _ARGTYPES + ([ctypes.c_void_p] if cuda else [])
            st = getattr(lib, status_fn)
            st.restype = ctypes.c_char_p
            st.argtypes = [ctypes.c_int32]
            _loaded[key] = lib
    return lib


def _check_args(q, k, q_weight, k_weight, cache, device_type: str) -> None:
    tensors = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight, "cos_sin_cache": cache}
    for n, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != device_type:
            raise ValueError(f"{n} must be on a {device_type} device, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{n} must be contiguous (call .contiguous()); got strides {t.stride()}")
    if device_type == "cuda" and len({t.device for t in tensors.values()}) != 1:
        raise ValueError("q, k, weights and cache must all be on the same CUDA device; got "
                         + ", ".join(f"{n}={t.device}" for n, t in tensors.items()))
    check_tensor_layout(q, k, q_weight, k_weight, cache)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def _check_out(out, q, k, q_weight, k_weight, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``out=(q_out, k_out)`` before anything is launched (the kernels write
    q.numel() elements of q's dtype through each pointer, unchecked).

    Each output must be a contiguous tensor of q's shape, dtype and device. The kernels read
    every element of a row before writing that row's elements, and each (token, head) row is
    owned by one thread group, so ``q_out`` may be exactly ``q`` and ``k_out`` exactly ``k``
    (in place); any other overlap with an input or between the two outputs is rejected."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"out must be a pair (q_out, k_out) of tensors, got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    q_out, k_out = out
    for n, t in (("q_out", q_out), ("k_out", k_out)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"out: {n} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"out: {n} has shape {tuple(t.shape)}, expected q's shape {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"out: {n} has dtype {t.dtype}, expected q's dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"out: {n} is on {t.device}, expected q's device {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"out: {n} must be contiguous; got strides {t.stride()}")
    if _overlaps(q_out, k_out):
        raise ValueError("out: q_out and k_out overlap in memory; pass two separate tensors")
    inputs = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight, "cos_sin_cache": cache}
    for n, t, own in (("q_out", q_out, "q"), ("k_out", k_out, "k")):
        for m, src in inputs.items():
            if not _overlaps(t, src):
                continue
            if m == own and t.data_ptr() == src.data_ptr() and t.numel() == src.numel():
                continue  # exact alias of its own input: in-place update, supported
            raise ValueError(f"out: {n} overlaps {m} in memory (only {n} = {own} exactly, an "
                             f"in-place update, is allowed); pass a separate output tensor")
    return q_out, k_out


def _call(fn, status_fn, what, q, k, q_weight, k_weight, cache, q_out, k_out, eps, interleaved,
          rounding, extra=()):
    b, s, h, d = q.shape
    rows, rot = cache.shape
    status = fn(q.data_ptr(), k.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(),
                cache.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), b, s, h, d, rot, rows,
                float(eps), int(bool(interleaved)), int(rounding), DTYPE_CODES[q.dtype], *extra)
    if status != 0:
        text = status_fn(status).decode()
        raise KernelStatusError(
            status, text,
            f"{what}(q {tuple(q.shape)} {q.dtype}, cache {tuple(cache.shape)}, eps={eps}, "
            f"interleaved={interleaved}, rounding={rounding})")


def host_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *, eps: float = 1e-6,
                      interleaved: bool = True, rounding: int = 0,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """QKNormRoPE through the CPU build of the kernel arithmetic (torch CPU tensors).

    ``out`` may be ``(q, k)`` for an in-place update; otherwise two separate contiguous tensors
    of q's shape, dtype and device (checked, ``ValueError`` before anything runs)."""
    lib = _load(HOST_LIB_ENV, HOST_LIB_NAME, HOST_BUILD_COMMAND, "qkrope_host_run",
                "qkrope_host_status_string", cuda=False)
    _check_args(q, k, q_weight, k_weight, cos_sin_cache, "cpu")
    q_out, k_out = (_check_out(out, q, k, q_weight, k_weight, cos_sin_cache) if out is not None
                    else (torch.empty_like(q), torch.empty_like(k)))
    _call(lib.qkrope_host_run, lib.qkrope_host_status_string, "qkrope_host_run", q, k, q_weight,
          k_weight, cos_sin_cache, q_out, k_out, eps, interleaved, rounding)
    return q_out, k_out


def cuda_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *, eps: float = 1e-6,
                      interleaved: bool = True, rounding: int = 0,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """QKNormRoPE through the fused CUDA kernel on the current CUDA stream (torch CUDA tensors).

    ``out`` may be ``(q, k)`` for an in-place update; otherwise two separate contiguous tensors
    of q's shape, dtype and device (checked, ``ValueError`` before anything is launched)."""
    lib = _load(CUDA_LIB_ENV, CUDA_LIB_NAME, CUDA_BUILD_COMMAND, "qkrope_launch",
                "qkrope_status_string", cuda=True)
    _check_args(q, k, q_weight, k_weight, cos_sin_cache, "cuda")
    q_out, k_out = (_check_out(out, q, k, q_weight, k_weight, cos_sin_cache) if out is not None
                    else (torch.empty_like(q), torch.empty_like(k)))
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        _call(lib.qkrope_launch, lib.qkrope_status_string, "qkrope_launch", q, k, q_weight,
              k_weight, cos_sin_cache, q_out, k_out, eps, interleaved, rounding,
              extra=(ctypes.c_void_p(stream),))
    return q_out, k_out
