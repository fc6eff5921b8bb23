"""ctypes bindings to the kernel libraries built from ``plugins/kernel``.

- :func:`host_qk_norm_rope` runs ``libqkrope_kernel_host.so``: the kernel's own arithmetic
  (``plugins/kernel/qknorm_rope_math.h``) compiled for the CPU, on torch CPU tensors. The tests use
  it to check the kernel maths against :func:`qkrope.export.qk_norm_rope_reference` without a GPU.
- :func:`cuda_qk_norm_rope` launches the CUDA kernel from ``libqkrope_kernels.so`` on torch CUDA
  tensors, on the current stream (no TensorRT needed).

Library lookup (:mod:`qkrope.runtime.toolchain`): the environment variables
``QKROPE_KERNEL_HOST_LIB`` / ``QKROPE_KERNELS_LIB`` (a file path), else ``<repo>/build/plugins/``
then ``<repo>/build/kernel/``. Build them with::

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

from qkrope.errors import InputError, QkropeError
from qkrope import contract
from qkrope.runtime import toolchain
from qkrope.layout import check_tensor_layout

__all__ = [
    "KernelLibraryError",
    "KernelStatusError",
    "host_qk_norm_rope",
    "cuda_qk_norm_rope",
    "host_library_path",
    "cuda_library_path",
    "DTYPE_CODES",
]

REPO_ROOT = toolchain.REPO_ROOT
HOST_LIB_NAME, HOST_LIB_ENV = toolchain.LIBRARIES["kernel_host"][:2]
CUDA_LIB_NAME, CUDA_LIB_ENV = toolchain.LIBRARIES["kernels"][:2]

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
MAX_HEAD_DIM = contract.MAX_HEAD_DIM


class KernelLibraryError(QkropeError, RuntimeError):
    """A kernel library is missing or cannot be loaded."""


class KernelStatusError(QkropeError, RuntimeError):
    """The library refused the call (a non-zero qkrope::Status)."""

    def __init__(self, status: int, text: str, what: str):
        super().__init__(f"{what} failed with status {status}: {text}")
        self.status = status


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}

# ..., interleaved, rounding, dtype; the *_scoped entry points (C ABI version 2) add norm_scope
# before dtype, the *_v3 ones (version 3) norm_scope before and weight_dtype after it
_ARGTYPES = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int32] * 3
NORM_SCOPES = (0, 1)  # 0: RMSNorm per head, weights [head_dim]; 1: per token row, [heads * head_dim]


_KINDS = {lib.env: kind for kind, lib in toolchain.LIBRARIES.items()}  # env variable -> kind


def _find(env: str, name: str) -> Path | None:
    """The library ``name`` (overridden by ``env``), by the toolchain's one lookup rule."""
    return toolchain.find_library(_KINDS[env])


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
                 " or ".join(str(p) for p in toolchain.library_candidates(_KINDS[env])))
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
            _loaded[key] = lib
        base = run_fn.removesuffix("_scoped").removesuffix("_v3")
        if getattr(lib, base + "_v3", None) is None:
            raise KernelLibraryError(f"{key} predates the C ABI's {base}_v3 (version 3: float32 "
                                     f"weights under any activation dtype): rebuild it with: "
                                     f"{build}")
        # every version's entry point, for raw callers: v1 (norm_scope 0, weights in q's dtype),
        # _scoped (v2: + norm_scope), _v3 (+ weight_dtype); the wrappers call _v3
        for suffix, extra in (("", []), ("_scoped", [ctypes.c_int32]),
                              ("_v3", [ctypes.c_int32] * 2)):
            fn = getattr(lib, base + suffix, None)
            if fn is not None:
                fn.restype = ctypes.c_int32
                fn.argtypes = _ARGTYPES[:-1] + extra + _ARGTYPES[-1:] + (
                    [ctypes.c_void_p] if cuda else [])
        st = getattr(lib, status_fn)
        st.restype = ctypes.c_char_p
        st.argtypes = [ctypes.c_int32]
    return lib


def _check_args(q, k, q_weight, k_weight, cache, device_type: str, norm_scope: int = 0) -> None:
    if isinstance(norm_scope, bool) or not isinstance(norm_scope, int) or norm_scope not in NORM_SCOPES:
        raise InputError(f"norm_scope must be one of {NORM_SCOPES} (0: per head, 1: over the token's "
                         f"heads); got {norm_scope!r}")
    tensors = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight, "cos_sin_cache": cache}
    for n, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != device_type:
            raise InputError(f"{n} must be on a {device_type} device, got {t.device}")
        if not t.is_contiguous():
            raise InputError(f"{n} must be contiguous (call .contiguous()); got strides {t.stride()}")
    if device_type == "cuda" and len({t.device for t in tensors.values()}) != 1:
        raise InputError("q, k, weights and cache must all be on the same CUDA device; got "
                         + ", ".join(f"{n}={t.device}" for n, t in tensors.items()))
    check_tensor_layout(q, k, q_weight, k_weight, cache, norm_scope=norm_scope)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def _outputs(out, q, k, q_weight, k_weight, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(q_out, k_out)`` like q and k when ``out`` is None, else ``out`` checked."""
    if out is None:
        return torch.empty_like(q), torch.empty_like(k)
    return _check_out(out, q, k, q_weight, k_weight, cache)


def _check_out(out, q, k, q_weight, k_weight, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``out=(q_out, k_out)`` before anything is launched (the kernels write
    q.numel() elements of q's dtype through each pointer, unchecked).

    Each output must be a contiguous tensor of q's shape, dtype and device. The kernels read
    every element of a row before writing that row's elements, and each (token, head) row is
    owned by one thread group, so ``q_out`` may be exactly ``q`` and ``k_out`` exactly ``k``
    (in place); any other overlap with an input or between the two outputs is rejected."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError(f"out must be a pair (q_out, k_out) of tensors, got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    q_out, k_out = out
    for n, t in (("q_out", q_out), ("k_out", k_out)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"out: {n} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
        if tuple(t.shape) != tuple(q.shape):
            raise InputError(f"out: {n} has shape {tuple(t.shape)}, expected q's shape {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise InputError(f"out: {n} has dtype {t.dtype}, expected q's dtype {q.dtype}")
        if t.device != q.device:
            raise InputError(f"out: {n} is on {t.device}, expected q's device {q.device}")
        if not t.is_contiguous():
            raise InputError(f"out: {n} must be contiguous; got strides {t.stride()}")
    if _overlaps(q_out, k_out):
        raise InputError("out: q_out and k_out overlap in memory; pass two separate tensors")
    inputs = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight, "cos_sin_cache": cache}
    for n, t, own in (("q_out", q_out, "q"), ("k_out", k_out, "k")):
        for m, src in inputs.items():
            if not _overlaps(t, src):
                continue
            if m == own and t.data_ptr() == src.data_ptr() and t.numel() == src.numel():
                continue  # exact alias of its own input: in-place update, supported
            raise InputError(f"out: {n} overlaps {m} in memory (only {n} = {own} exactly, an "
                             f"in-place update, is allowed); pass a separate output tensor")
    return q_out, k_out


def _call(fn, status_fn, what, q, k, q_weight, k_weight, cache, q_out, k_out, eps, interleaved,
          rounding, norm_scope=0, extra=()):
    b, s, h, d = q.shape
    rows, rot = cache.shape
    status = fn(q.data_ptr(), k.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(),
                cache.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), b, s, h, d, rot, rows,
                float(eps), int(bool(interleaved)), int(rounding), int(norm_scope),
                DTYPE_CODES[q.dtype], DTYPE_CODES[q_weight.dtype], *extra)
    if status != 0:
        text = status_fn(status).decode()
        raise KernelStatusError(
            status, text,
            f"{what}(q {tuple(q.shape)} {q.dtype}, weights {q_weight.dtype}, cache "
            f"{tuple(cache.shape)}, eps={eps}, "
            f"interleaved={interleaved}, rounding={rounding}, norm_scope={norm_scope})")


def host_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                      eps: float = contract.DEFAULT_EPS,
                      interleaved: bool = contract.DEFAULT_INTERLEAVED,
                      rounding: int = contract.DEFAULT_ROUNDING,
                      norm_scope: int = 0,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """QKNormRoPE through the CPU build of the kernel arithmetic (torch CPU tensors).

    ``out`` may be ``(q, k)`` for an in-place update; otherwise two separate contiguous tensors
    of q's shape, dtype and device (checked, ``ValueError`` before anything runs)."""
    lib = _load(HOST_LIB_ENV, HOST_LIB_NAME, HOST_BUILD_COMMAND, "qkrope_host_run_v3",
                "qkrope_host_status_string", cuda=False)
    _check_args(q, k, q_weight, k_weight, cos_sin_cache, "cpu", norm_scope)
    q_out, k_out = _outputs(out, q, k, q_weight, k_weight, cos_sin_cache)
    _call(lib.qkrope_host_run_v3, lib.qkrope_host_status_string, "qkrope_host_run", q, k,
          q_weight, k_weight, cos_sin_cache, q_out, k_out, eps, interleaved, rounding, norm_scope)
    return q_out, k_out


def cuda_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                      eps: float = contract.DEFAULT_EPS,
                      interleaved: bool = contract.DEFAULT_INTERLEAVED,
                      rounding: int = contract.DEFAULT_ROUNDING,
                      norm_scope: int = 0,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """QKNormRoPE through the fused CUDA kernel on the current CUDA stream (torch CUDA tensors).

    ``out`` may be ``(q, k)`` for an in-place update; otherwise two separate contiguous tensors
    of q's shape, dtype and device (checked, ``ValueError`` before anything is launched)."""
    lib = _load(CUDA_LIB_ENV, CUDA_LIB_NAME, CUDA_BUILD_COMMAND, "qkrope_launch_v3",
                "qkrope_status_string", cuda=True)
    _check_args(q, k, q_weight, k_weight, cos_sin_cache, "cuda", norm_scope)
    q_out, k_out = _outputs(out, q, k, q_weight, k_weight, cos_sin_cache)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        _call(lib.qkrope_launch_v3, lib.qkrope_status_string, "qkrope_launch", q, k,
              q_weight, k_weight, cos_sin_cache, q_out, k_out, eps, interleaved, rounding,
              norm_scope, extra=(ctypes.c_void_p(stream),))
    return q_out, k_out


# ---- SIMT emulation of the CUDA kernel (plugins/simt) -----------------------------------------------
# libqkrope_kernels_simt.so is the unchanged qknorm_rope.cu compiled with the host C++ compiler on
# stand-in CUDA headers: every CUDA thread of a block runs as a fiber, warp shuffles and barriers
# are real barriers (a lane that skips one is reported, not hung on). Same C ABI as
# libqkrope_kernels.so on host pointers, plus the emulator's simt_* controls
# (plugins/simt/simt_capi.h: device shape, scheduling seed, per-launch records, the emulator's
# error message).

SIMT_LIB_NAME, SIMT_LIB_ENV = toolchain.LIBRARIES["kernels_simt"][:2]
SIMT_BUILD_COMMAND = ("cmake -S plugins/kernel -B build/kernel && "
                      "cmake --build build/kernel --target qkrope_kernels_simt -j2")


class SimtLaunchError(KernelStatusError):
    """The emulated launch failed (e.g. a deadlock or a misaligned access): ``emulator_message``
    says where (kernel instance, block, warp, lanes, intrinsic, source line)."""

    def __init__(self, status: int, text: str, what: str, emulator_message: str):
        super().__init__(status, f"{text}; emulator: {emulator_message}" if emulator_message
                         else text, what)
        self.emulator_message = emulator_message


def simt_library_path() -> Path | None:
    """Where the SIMT emulation library would be loaded from (None if not found)."""
    return _find(SIMT_LIB_ENV, SIMT_LIB_NAME)


def _simt_lib() -> ctypes.CDLL:
    lib = _load(SIMT_LIB_ENV, SIMT_LIB_NAME, SIMT_BUILD_COMMAND, "qkrope_launch_v3",
                "qkrope_status_string", cuda=True)
    if not getattr(lib, "_simt_ready", False):
        if not hasattr(lib, "simt_configure"):
            raise KernelLibraryError(
                f"{simt_library_path()} predates the emulator's simt_* control functions "
                f"(it exports only the former qkrope_simt_* names). Rebuild it with: "
                f"{SIMT_BUILD_COMMAND}")
        with _lock:
            lib.simt_configure.restype = ctypes.c_int32
            lib.simt_configure.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
            for name in ("simt_config_json", "simt_last_error", "simt_launches_json"):
                getattr(lib, name).restype = ctypes.c_char_p
                getattr(lib, name).argtypes = []
            lib.simt_symbols_json.restype = ctypes.c_char_p
            lib.simt_symbols_json.argtypes = [ctypes.c_char_p]
            lib.simt_reset.restype = None
            lib.simt_reset.argtypes = []
            lib.simt_set_dry_run.restype = None
            lib.simt_set_dry_run.argtypes = [ctypes.c_int32]
            lib.simt_set_stack_size.restype = ctypes.c_int32
            lib.simt_set_stack_size.argtypes = [ctypes.c_int64]
            lib.simt_configure_model.restype = ctypes.c_int32
            lib.simt_configure_model.argtypes = [ctypes.c_int32] * 7 + [ctypes.c_char_p,
                                                                       ctypes.c_int64]
            lib._simt_ready = True
    return lib


def simt_configure(num_sms: int | None = None, blocks_per_sm: int | None = None,
                   seed: int | None = None, dry_run: bool | None = None) -> dict:
    """Shape the emulated device (None keeps a value): ``num_sms`` (cudaDevAttrMultiProcessorCount),
    ``blocks_per_sm`` (what the occupancy query returns), ``seed`` (0: round-robin order of
    fibers and blocks, else a seeded random order), ``dry_run`` (record launches without running
    them). Each distinct device shape is its own device id (the launcher caches per device).
    Returns the configuration now in effect."""
    import json
    lib = _simt_lib()
    dev = lib.simt_configure(-1 if num_sms is None else int(num_sms),
                             -1 if blocks_per_sm is None else int(blocks_per_sm),
                             -1 if seed is None else int(seed))
    if dev < 0:
        raise InputError(f"simt_configure: invalid device shape num_sms={num_sms}, "
                         f"blocks_per_sm={blocks_per_sm} (1..1024 SMs, 1..64 blocks per SM, seed >= 0)")
    if dry_run is not None:
        lib.simt_set_dry_run(int(bool(dry_run)))
    return json.loads(lib.simt_config_json().decode())


def simt_configure_model(*, num_sms: int, max_threads_per_sm: int, compute_capability: tuple[int, int],
                         clock_khz: int, mem_clock_khz: int, bus_width_bits: int,
                         occupancy: dict[str, int] | None = None, seed: int | None = None,
                         dry_run: bool | None = None) -> dict:
    """Make a modelled GPU the emulated device: what ``cudaDeviceGetAttribute`` answers (SMs,
    threads per SM, compute capability, SM and memory clocks in kHz, bus width) and, in
    ``occupancy``, the resident blocks per SM that the occupancy query returns for each kernel
    instance (demangled name, as :func:`simt_last_launches` reports it; e.g. from ptxas's register
    counts). With ``dry_run`` the real launcher chooses and records its launches without running
    them, which is how its plan is read for a device this machine does not have."""
    import json
    if any("\t" in name or "\n" in name for name in (occupancy or {})):
        raise InputError("simt_configure_model: a kernel name holds a tab or newline")
    lines = "".join(f"{name}\t{int(blocks)}\n" for name, blocks in (occupancy or {}).items())
    major, minor = compute_capability
    dev = _simt_lib().simt_configure_model(int(num_sms), int(max_threads_per_sm), int(major),
                                           int(minor), int(clock_khz), int(mem_clock_khz),
                                           int(bus_width_bits), lines.encode(),
                                           -1 if seed is None else int(seed))
    if dev < 0:
        raise InputError(f"simt_configure_model: invalid device model num_sms={num_sms}, "
                         f"max_threads_per_sm={max_threads_per_sm}, cc={major}.{minor}, "
                         f"clock_khz={clock_khz}, mem_clock_khz={mem_clock_khz}, "
                         f"bus_width_bits={bus_width_bits} or an occupancy outside 0..64")
    if dry_run is not None:
        _simt_lib().simt_set_dry_run(int(bool(dry_run)))
    return json.loads(_simt_lib().simt_config_json().decode())


def simt_last_launches() -> list[dict]:
    """The emulated launches since the last :func:`simt_reset`, oldest first: ``kernel`` (the
    demangled instance), ``grid``, ``block``, ``num_sms``, ``blocks_per_sm``, ``seed``,
    ``status`` (cudaError_t), ``error``, ``blocks_run``, ``collectives``, ``barriers``."""
    import json
    return json.loads(_simt_lib().simt_launches_json().decode())


def simt_reset() -> None:
    """Forget the recorded launches and the last error message."""
    _simt_lib().simt_reset()


def simt_last_error() -> str:
    """The emulator's message for the last failed launch ("" if none since the last reset)."""
    return _simt_lib().simt_last_error().decode()


def simt_kernel_symbols(substring: str) -> list[str]:
    """Demangled names of the library's function symbols containing ``substring``: the kernel
    template instances compiled into it."""
    import json
    return json.loads(_simt_lib().simt_symbols_json(substring.encode()).decode())


def simt_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                      eps: float = contract.DEFAULT_EPS,
                      interleaved: bool = contract.DEFAULT_INTERLEAVED,
                      rounding: int = contract.DEFAULT_ROUNDING,
                      norm_scope: int = 0,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """QKNormRoPE through the emulated CUDA kernel and launcher (torch CPU tensors).

    ``out`` may be ``(q, k)`` for an in-place update; otherwise two separate contiguous tensors
    of q's shape, dtype and device. A failed emulated launch raises :class:`SimtLaunchError`."""
    lib = _simt_lib()
    _check_args(q, k, q_weight, k_weight, cos_sin_cache, "cpu", norm_scope)
    q_out, k_out = _outputs(out, q, k, q_weight, k_weight, cos_sin_cache)
    try:
        _call(lib.qkrope_launch_v3, lib.qkrope_status_string, "qkrope_launch (simt)", q, k,
              q_weight, k_weight, cos_sin_cache, q_out, k_out, eps, interleaved, rounding,
              norm_scope, extra=(ctypes.c_void_p(None),))
    except KernelStatusError as exc:
        raise SimtLaunchError(exc.status, lib.qkrope_status_string(exc.status).decode(),
                              "qkrope_launch (simt)", simt_last_error()) from None
    return q_out, k_out


__all__ += ["SimtLaunchError", "simt_qk_norm_rope", "simt_configure", "simt_configure_model",
            "simt_last_launches",
            "simt_reset", "simt_last_error", "simt_kernel_symbols", "simt_library_path"]
