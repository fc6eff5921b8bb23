"""Mutants of the kernel source (compiled from a temporary copy, linked with the objects of the
emulated build in build/kernel-simt) that the emulated checks catch and the CPU build cannot see."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

# Each kernel mutant through the SIMT emulation:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow
import torch

from _kernel_cases import assert_bit_exact, make_inputs, row_weights
from _simt import BUILD_DIR, DEFAULT_DEVICE, KERNEL_SRC, SIMT_SRC, _tools, run_checked
from _simt import device, libs  # noqa: F401 (pytest fixtures)
from qkrope.runtime import kernels


# ---- mutants: kernel bugs the emulated checks catch and the CPU build cannot see ---------------------------
# (description, file, regex, replacement, check): the regexes target qknorm_rope.cu (or the
# headers it includes); a mutant whose regex no longer matches is skipped with a message.
MUTANTS = [
    ("xor reduction over half the row group (shuffle width kLanes / 2)", "qknorm_rope.cu",
     r"__shfl_xor_sync\(kFullMask, sumSq\[u\], offset, kLanes\)",
     "__shfl_xor_sync(kFullMask, sumSq[u], offset, kLanes / 2)", "fast"),
    ("NeoX partner shuffle width 32 instead of the row group (kLanes)", "qknorm_rope.cu",
     r"__shfl_sync\(kFullMask, y\[i\], partner, kLanes\)",
     "__shfl_sync(kFullMask, y[i], partner, 32)", "neox"),
    ("general path: __syncwarp before the shared-memory pair exchange dropped", "qknorm_rope.cu",
     r"(\n\s*)__syncwarp\(\);(?!\s*//)", r"\1/* __syncwarp() removed */", "general"),
    ("lanes past the rotary part skip the NeoX shuffle (a lane skipping a shuffle)", "qknorm_rope.cu",
     r"float const other = __shfl_sync\(kFullMask, y\[i\], partner, kLanes\);",
     "float const other = (lane * kVec >= rot) ? y[i] : __shfl_sync(kFullMask, y[i], partner, kLanes);",
     "neox_partial"),
    ("prefetch ring: the cp.async wait dropped (a token reads its stage before its copies land)",
     "qknorm_rope.cu", r"__pipeline_wait_prior\(kPrefetch\);", "/* wait dropped */", "ring"),
    ("prefetch ring: the wait one group short (wait_group kPrefetch + 1: this token's group may "
     "still be in flight)", "qknorm_rope.cu", r"__pipeline_wait_prior\(kPrefetch\);",
     "__pipeline_wait_prior(kPrefetch + 1);", "ring"),
    ("prefetch ring: wrong stage index (a token reads the stage of the token two ahead)",
     "qknorm_rope.cu", r"readRows\(kStage, cur\);", "readRows(kAhead, cur);", "ring"),
    ("prefetch ring: wrong stage index (the copies two tokens ahead overwrite the stage being read)",
     "qknorm_rope.cu", r"issueRows\(in \+ kPrefetch \* stepElems, kAhead\);",
     "issueRows(in + kPrefetch * stepElems, kStage);", "ring"),
    ("dropped row: the general path's token loop stops one token early", "qknorm_rope.cu",
     r"for \(; t < a\.numTokens; t \+= a\.tokenStep\)",
     "for (; t < a.numTokens - 1; t += a.tokenStep)", "general"),
    ("fast path, FLUX's order: x * inv * w not rounded before the rotation (rounding=2 runs as 0)",
     "qknorm_rope.cu", r"if constexpr \(ROUNDING != math::kRoundingOne\)",
     "if constexpr (ROUNDING == math::kRoundingDiffusers)", "flux"),
    # norm_scope 1 (qkNormRopeRowKernel): the row's sum spans the warps of the block
    ("row scope: each warp adds only the head sums of its own heads (a partial cross-warp "
     "reduction)", "qknorm_rope.cu",
     r"if \(h < numHeads\)\n(\s*)\{\n(\s*)rowSum = ",
     r"if (h < numHeads && h / (32 / kLanes * ROWS) == tid / 32)\n\1{\n\2rowSum = ", "row"),
    ("row scope: the cross-head butterfly stops at offset 8 (lanes 16-31's head sums are lost)",
     "qknorm_rope.cu", r"for \(int offset = 16; offset > 0; offset /= 2\)\n(\s*)\{\n(\s*)rowSum",
     r"for (int offset = 8; offset > 0; offset /= 2)\n\1{\n\2rowSum", "row"),
    # float32 norm weights under 16-bit activations (FLUX.3): each kernel reads them as float32
    ("fast path: float32 weights read as the activation type", "qknorm_rope.cu",
     r"loadWeight<T>\(weight, elem\(v, i\), a\.weightsFp32\)",
     "loadWeight<T>(weight, elem(v, i), false)", "fp32w_fast"),
    ("row scope: float32 weights read as the activation type", "qknorm_rope.cu",
     r"loadWeight<T>\(weight, hh \* HEAD_DIM \+ elem\(v, i\), a\.weightsFp32\)",
     "loadWeight<T>(weight, hh * HEAD_DIM + elem(v, i), false)", "fp32w_row"),
    ("general paths: float32 weights read as the activation type", "qknorm_rope.cu",
     r"loadWeight<T>\(weight, at \+ e, weightsFp32\)", "loadWeight<T>(weight, at + e, false)",
     "fp32w_general"),
]

MUTANT_CASES = {
    "fp32w_fast": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3,
                        weights_fp32=True)],
    "fp32w_row": [dict(dtype=torch.bfloat16, head_dim=64, rotary_dim=64, heads=20, seq=4,
                       norm_scope=1, weights_fp32=True)],
    "fp32w_general": [dict(dtype=torch.float16, head_dim=96, rotary_dim=96, heads=3, seq=3,
                           interleaved=False, weights_fp32=True)],
    # 20 heads x 64 (bf16: 8 lanes per head): 2 or more warps per block, head sums in 20 lanes
    "row": [dict(dtype=torch.bfloat16, head_dim=64, rotary_dim=64, heads=20, seq=4, norm_scope=1)],
    "fast": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3),
             dict(dtype=torch.float32, head_dim=64, rotary_dim=64, heads=3, seq=3)],
    "neox": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3,
                  interleaved=False),
             dict(dtype=torch.float16, head_dim=64, rotary_dim=32, heads=3, seq=3,
                  interleaved=False)],
    # enough tokens that every row group walks several: a lane that skipped the shuffle of one
    # token arrives at the next token's reduction while its group still waits in the shuffle
    "neox_partial": [dict(dtype=torch.float16, head_dim=128, rotary_dim=64, heads=2, seq=64,
                          interleaved=False)],
    # every row group walks more than three tokens, so the ring turns over at least once
    "ring": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=2, seq=160)],
    # FLUX's layout and order, both 16-bit dtypes (the mutant only changes rounding=2 instances)
    "flux": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3, rounding=2),
             dict(dtype=torch.float16, head_dim=128, rotary_dim=128, heads=3, seq=3, rounding=2)],
    "general": [dict(dtype=torch.bfloat16, head_dim=96, rotary_dim=96, heads=3, seq=3,
                     interleaved=False),
                dict(dtype=torch.float32, head_dim=48, rotary_dim=48, heads=2, seq=3)],
}


def _compile_mutant(tmp: Path, src_name: str, text: str) -> Path:
    """The mutated source compiled on its own (-O0: the fastest compile), linked with the build's
    other objects."""
    cxx, _ = _tools()
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / src_name).write_text(text)
    main = tmp / "qknorm_rope.cu"
    if src_name != "qknorm_rope.cu":
        shutil.copy(KERNEL_SRC / "qknorm_rope.cu", main)
    # the build's other objects: the launcher and the check of the emulated library, the emulator
    objs = []
    # (by target folder as a whole path component, and the emulator's objects one per source it
    # has now, so objects an older layout left in the build folder are never linked in)
    for pat in ("qknorm_rope_capi.cu.cpp.o", "qknorm_rope_check.cpp.o"):
        hits = [p for p in BUILD_DIR.rglob(pat) if "qkrope_kernels_simt.dir" in p.parts]
        assert hits, f"{pat} not found under {BUILD_DIR}"
        objs.append(str(hits[0]))
    runtime = []
    for src in sorted((SIMT_SRC / "src").glob("*.cpp")):
        hits = [p for p in BUILD_DIR.rglob(f"{src.name}.o")
                if "simt_runtime.dir" in p.parts and p.parent.name == "src"]
        assert len(hits) == 1, f"the emulator's object for {src.name} (simt_runtime) under {BUILD_DIR}: {hits}"
        runtime.append(str(hits[0]))
    objs += runtime
    obj = tmp / "mutant.o"
    flags = ["-std=c++17", "-O0", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             "-D__CUDACC__", "-D__CUDA_ARCH__=900", "-DSIMT_EMULATION=1", "-ffp-contract=off",
             "-fno-fast-math", "-fno-strict-aliasing", "-w",
             f"-I{tmp}", f"-I{SIMT_SRC}", f"-I{KERNEL_SRC}"]
    res = subprocess.run([cxx, *flags, "-x", "c++", "-c", str(main), "-o", str(obj)],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"mutant does not compile:\n{res.stderr[-3000:]}"
    lib = tmp / "libqkrope_kernels_simt.so"
    res = subprocess.run([cxx, "-shared", "-o", str(lib), str(obj), *objs, "-ldl"],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"mutant does not link:\n{res.stderr[-3000:]}"
    return lib


def _emulated_checks(case_key) -> str | None:
    """The emulated checks on the mutant's cases: None if all pass, else the first failure."""
    for case in MUTANT_CASES[case_key]:
        c = dict(case)
        try:
            run_checked(c.pop("dtype"), c.pop("head_dim"), c.pop("rotary_dim"), batch=1,
                        grid=True, seed=4, **c)
        except (AssertionError, kernels.KernelStatusError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
    return None


def _host_checks(case_key):
    """What the CPU-build tests check (against the Python reference): unaffected by the .cu."""
    from _kernel_cases import reference
    for case in MUTANT_CASES[case_key]:
        c = dict(case)
        inputs = make_inputs(c["dtype"], c["head_dim"], c["rotary_dim"], batch=1, seq=c["seq"],
                             heads=c["heads"], grid=True, seed=4,
                             weights_fp32=c.get("weights_fp32", False))
        if c.get("norm_scope", 0) == 1:
            inputs = row_weights(inputs)
        kw = dict(interleaved=c.get("interleaved", True), rounding=c.get("rounding", 0),
                  norm_scope=c.get("norm_scope", 0))
        assert_bit_exact(kernels.host_qk_norm_rope(*inputs, **kw), reference(*inputs, **kw))


@pytest.fixture(scope="module")
def mutant_libs(libs, tmp_path_factory):
    """{description: library path | None (regex no longer matches) | Exception}, compiled two at
    a time (the compile dominates this part's time)."""
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("mutants")
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i, (desc, src_name, pattern, repl, _) in enumerate(MUTANTS):
            mutated, n = re.subn(pattern, repl, (KERNEL_SRC / src_name).read_text(), count=1)
            jobs[desc] = (pool.submit(_compile_mutant, root / f"m{i}", src_name, mutated)
                          if n else None)
        out = {}
        for desc, job in jobs.items():
            try:
                out[desc] = job.result() if job is not None else None
            except Exception as exc:  # reported by the mutant's test
                out[desc] = exc
    return out


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m[0][:40])
def test_mutant_caught_by_emulation_not_by_host_build(mutant_libs, device, monkeypatch, mutant):
    desc, src_name, _, _, case_key = mutant
    lib = mutant_libs[desc]
    if lib is None:
        pytest.skip(f"mutant '{desc}': its regex no longer matches {src_name} (update MUTANTS)")
    if isinstance(lib, Exception):
        raise lib
    assert _emulated_checks(case_key) is None, "the unmutated kernel must pass these checks"
    monkeypatch.setenv(kernels.SIMT_LIB_ENV, str(lib))
    kernels.simt_configure(**DEFAULT_DEVICE, dry_run=False)
    failure = _emulated_checks(case_key)
    _host_checks(case_key)  # the CPU build never compiles the .cu: it cannot see the mutant
    print(f"\nmutant: {desc}\n  caught: {failure}")
    assert failure is not None, f"mutant '{desc}' survived the emulated checks"
