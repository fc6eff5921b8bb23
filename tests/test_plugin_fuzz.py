"""Fuzzing the QKNormRoPE plugin's creator, field parsing, deserialisation and tensor-descriptor
entry points under ASan/UBSan (plugins/tests/plugin_fuzz.cpp and its plugin_fuzz_*.cpp pieces, built
by plugins/tests/fuzz/).

The plugin's C++ sources are compiled into the fuzz binary with -fsanitize=address,undefined (no
nvcc, no GPU: the kernel launch is a stub that returns the real checkParams' status). With clang and
libFuzzer the binary is a coverage-guided libFuzzer target run from a small seed corpus written
here; with any other compiler that has the sanitizer runtimes (g++) it is a seeded random loop.
Each run is bounded by an iteration count with a fixed seed, never by wall time, so a slow or busy
machine runs the same inputs and gives the same verdict (the subprocess timeout only guards against
a hang). Mutants of the plugin sources (temporary copies, regex-edited; the real files are never
touched) prove that the fuzzer fails when the plugin is wrong; each has a seed input, written here
and decoded byte by byte in its comment, that reaches its planted bug on the first execution, so
the verdict does not depend on how far the search gets either.

Budget (FUZZ_RUNS, env QKROPE_FUZZ_RUNS to change): 150000 iterations, about 10 s of fuzzing plus
the build (about 10 s with two cores) on an idle machine, and a few seconds per mutant.
"""

from __future__ import annotations

import base64
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FUZZ_SRC = REPO / "plugins" / "tests" / "fuzz"
PLUGINS = REPO / "plugins"
TRT_FALLBACK = REPO / "third_party" / "tensorrt-headers" / "include" / "NvInferRuntime.h"

FUZZ_RUNS = int(os.environ.get("QKROPE_FUZZ_RUNS", "150000"))
MUTANT_RUNS = 20000
HANG_GUARD_SECONDS = 1800  # a subprocess that runs this long is hung; not a budget

SANITIZER_REPORT = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)"
                              r"|runtime error:|INVARIANT VIOLATED")
SANITIZER_ENV = {
    # quarantine_size_mb: ASan's default 256 MiB of freed memory kept poisoned, plus libFuzzer's
    # corpus and ASan's fake stacks, can pass libFuzzer's default 2 GiB RSS limit on a loaded
    # 2-core machine (a spurious "out-of-memory" in CI); leaks are still reported at exit.
    "ASAN_OPTIONS": ("detect_leaks=1:abort_on_error=0:symbolize=1:detect_stack_use_after_return=1:"
                     "quarantine_size_mb=64"),
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


def _sanitizers_link(cxx: str, extra: list[str]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("#include <cstddef>\n#include <cstdint>\n"
                       + ('extern "C" int LLVMFuzzerTestOneInput(uint8_t const*, size_t) { return 0; }\n'
                          if "-fsanitize=fuzzer" in extra else "int main() { return 0; }\n"))
        res = subprocess.run([cxx, *extra, "-fsanitize=address,undefined", str(src), "-o", str(Path(tmp) / "a")],
                             capture_output=True, text=True)
        return res.returncode == 0


def _compiler() -> tuple[str, str]:
    """(compiler, expected engine): clang++ with libFuzzer, else a compiler with ASan/UBSan."""
    explicit = os.environ.get("QKROPE_FUZZ_CXX")
    candidates = [explicit] if explicit else ["clang++", os.environ.get("CXX", ""), "g++", "c++"]
    fallback = None
    for name in filter(None, candidates):
        cxx = shutil.which(name)
        if cxx is None:
            continue
        if _sanitizers_link(cxx, ["-fsanitize=fuzzer"]):
            return cxx, "libfuzzer"
        if fallback is None and _sanitizers_link(cxx, []):
            fallback = cxx
    if fallback is None:
        pytest.skip("requires clang with libFuzzer/ASan (apt-get install clang libclang-rt-dev) or a g++ with the "
                    "ASan/UBSan runtimes (libasan, libubsan): none of " + ", ".join(filter(None, candidates))
                    + " links -fsanitize=address,undefined")
    return fallback, "loop"


def _ensure_trt_headers():
    if TRT_FALLBACK.is_file() or list(Path("/usr/include").glob("*/NvInferRuntime.h")) \
            or Path("/usr/include/NvInferRuntime.h").is_file() or os.environ.get("TensorRT_ROOT"):
        return
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_trt_headers.py")],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0 or not TRT_FALLBACK.is_file():
        pytest.skip("requires TensorRT headers: none installed and scripts/fetch_trt_headers.py could not fetch "
                    f"the pinned ones (is PyPI reachable?): {(res.stdout + res.stderr)[-500:]}")


class FuzzBuild:
    def __init__(self, cxx: str, build_dir: Path):
        self.cxx = cxx
        self.dir = build_dir
        cache = (build_dir / "CMakeCache.txt").read_text()
        m = re.search(r"QKROPE_FUZZ_ENGINE_USED:INTERNAL=(\w+)", cache)
        assert m, "the fuzz build did not record its engine"
        self.engine = m.group(1)

    def configure(self, mutant_dir: Path | str = "") -> None:
        res = subprocess.run(["cmake", "-S", str(FUZZ_SRC), "-B", str(self.dir), f"-DQKROPE_FUZZ_MUTANT_DIR={mutant_dir}"],
                             capture_output=True, text=True)
        assert res.returncode == 0, f"configuring the fuzz build failed:\n{(res.stdout + res.stderr)[-4000:]}"

    def build(self, target: str) -> Path:
        res = subprocess.run(["cmake", "--build", str(self.dir), "--target", target, "-j2"],
                             capture_output=True, text=True)
        assert res.returncode == 0, f"building {target} failed:\n{(res.stdout + res.stderr)[-4000:]}"
        return self.dir / target

    def run(self, binary: Path, workdir: Path, runs: int,
            seeds: dict[str, bytes] | None = None) -> subprocess.CompletedProcess:
        """``runs`` iterations from seed 1 (libFuzzer: ``-runs``/``-seed`` over a corpus written
        here plus ``seeds``; the loop: ``--iterations``/``--seed`` after replaying ``seeds``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SANITIZER_ENV}
        corpus = workdir / "corpus"
        corpus.mkdir(exist_ok=True)
        for name, data in (seeds or {}).items():
            (corpus / name).write_bytes(data)
        if self.engine == "libfuzzer":
            rng = random.Random(1)
            # seeds: empty and all-zero inputs decode to the common valid choices; random ones to the rest
            (corpus / "empty").write_bytes(b"")
            (corpus / "zeros").write_bytes(bytes(64))
            for i in range(24):
                (corpus / f"random-{i}").write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(8, 300))))
            # no RSS limit: libFuzzer reads the process's peak RSS (getrusage), which Linux carries
            # over at exec from the process that spawned it (a pytest worker's peak, GBs after the
            # export tests: a spurious out-of-memory within the first second in CI). The malloc
            # limit still stops any single allocation of 6 GiB or more, and LeakSanitizer reports
            # leaks at exit.
            cmd = [str(binary), f"-runs={runs}", "-seed=1", "-max_len=1024",
                   "-rss_limit_mb=0", "-malloc_limit_mb=6144",
                   f"-artifact_prefix={workdir}/", "-print_final_stats=1", str(corpus)]
        else:
            cmd = [str(binary), "--iterations", str(runs), "--seed", "1", "--max-len", "512",
                   *sorted(str(corpus / name) for name in (seeds or {}))]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env,
                              timeout=HANG_GUARD_SECONDS)


@pytest.fixture(scope="module")
def fuzz_build() -> FuzzBuild:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: the fuzz target cannot be built (pip install cmake)")
    cxx, _ = _compiler()
    _ensure_trt_headers()
    build_dir = REPO / "build" / f"plugin-fuzz-{Path(cxx).name}"
    if not (build_dir / "CMakeCache.txt").is_file():
        res = subprocess.run(["cmake", "-S", str(FUZZ_SRC), "-B", str(build_dir), f"-DCMAKE_CXX_COMPILER={cxx}",
                              "-DQKROPE_FUZZ_MUTANT_DIR="], capture_output=True, text=True)
        if res.returncode != 0 and "no TensorRT headers found" in res.stdout + res.stderr:
            shutil.rmtree(build_dir, ignore_errors=True)
            pytest.skip("requires TensorRT headers (python scripts/fetch_trt_headers.py)")
        assert res.returncode == 0, f"configuring the fuzz build failed:\n{(res.stdout + res.stderr)[-4000:]}"
    fb = FuzzBuild(cxx, build_dir)
    fb.configure("")
    fb.build("qkrope_plugin_fuzz")
    return fb


def _report(res: subprocess.CompletedProcess) -> str:
    return f"exit {res.returncode}\nstdout tail:\n{res.stdout[-3000:]}\nstderr tail:\n{res.stderr[-6000:]}"


# Inputs on which an earlier build of the plugin failed, kept as seeds so each is replayed on every
# run whatever the search reaches (libFuzzer's crash-* units, base64 as libFuzzer prints them).
REGRESSIONS = {
    # getOutputShapes with norm_scope 1 and num_heads near 2^63: num_heads * head_dim overflowed
    # int64 in checkDims (UBSan, qknorm_rope_plugin.cpp); now refused with a message.
    "ubsan-row-width-overflow": base64.b64decode(
        "Bykp/wVKHcIFAAAABRwcHBwcHBwcHBwcHBwcHBwcHBkcHBwcHBwcHB4cHBwcHBzCHB4cHBwcHBzCQJtCaP8FSh3CBQAAAAUcHBwc"
        "HBwcHBwcHBwcHBwcHBwZHBwcHBwcHBweHBwcHBwcwkCbQijsgioHEh9Am0Io7IIqBxJCDx+MEhgAFYw8QJtCKP8FSh3CBQAAAAUc"
        "HBwcHBwcHBwcHBwcHBwcHhwcHBwcHMJAm0Io7IIqBxIfQJtCKOyCKgcSFUIPH4wSGAAVjDxC"),
}


def test_fuzz_finds_nothing(fuzz_build: FuzzBuild, tmp_path):
    # the mutants' seeds are valid inputs for the real plugin: replayed here, they pass; so must
    # every input that once failed
    seeds = {f"mutant-{i}": m[-1] for i, m in enumerate(MUTANTS)} | REGRESSIONS
    res = fuzz_build.run(fuzz_build.dir / "qkrope_plugin_fuzz", tmp_path, FUZZ_RUNS, seeds=seeds)
    out = res.stdout + res.stderr
    assert res.returncode == 0, _report(res)
    assert not SANITIZER_REPORT.search(out), _report(res)
    if fuzz_build.engine == "libfuzzer":
        m = re.search(r"Done (\d+) runs in (\d+) second", out)
        assert m, _report(res)
        runs = int(m.group(1))
        assert runs == FUZZ_RUNS, f"{runs} runs, not {FUZZ_RUNS}:\n{_report(res)}"
        cov = re.findall(r"cov: (\d+)", out)
        print(f"\nlibFuzzer ({fuzz_build.cxx}): {runs} runs in {m.group(2)} s, coverage {cov[-1] if cov else '?'}")
    else:
        m = re.search(r"STATS (.*)", res.stdout)
        assert m and f"{FUZZ_RUNS} iterations" in res.stdout, _report(res)
        stats = dict(kv.split("=") for kv in m.group(1).split())
        # the decoder must reach the accepting paths, not only the refusals
        for key in ("created", "refused", "round_trips", "shapes_ok", "shapes_refused", "configure_ok",
                    "configure_refused", "enqueue_ok", "enqueue_refused", "launches", "formats"):
            assert int(stats[key]) > 0, f"no '{key}' in {FUZZ_RUNS} iterations: {stats}"
        print(f"\nseeded loop ({fuzz_build.cxx}): {FUZZ_RUNS} iterations, seed 1: {stats}")


# ---- mutants: the fuzzer must fail when the plugin is wrong ----------------------------------------
# (description, source under plugins/, pattern, replacement, what must be reported, seed input).
# Applied to a temporary copy with re.subn(count=1); a pattern that no longer matches skips its test.
# Each seed is read by plugin_fuzz.h's Input (one byte per choice, u8() % n for below(n) when
# n <= 256, chance(p) true when the byte is < p); the comments give each byte's choice.

# plugin_version as a kCHAR of length -1 over a 3-byte block without a NUL
NEGATIVE_LENGTH_SEED = bytes([
    12, 1,          # makeCollection: mode 12 (fuzzed fields), below(9) -> 1 field
    4, 200, 0,      # makeField: name choice 4 -> kFIELDS[4] plugin_version; not clean; its type kCHAR
    25,             # length choice 25 -> kLengths[1] = -1
    0, 200, 200,    # stringPayload: the identity "1"; no NUL counted; no NUL inserted
    200,            # data not null
    3, 65, 65, 65,  # the hostile block: 3 bytes "AAA"
    200,            # not the payload instead
    0, 200,         # layer name "fuzz_node_0"; kBUILD
])
# no fields (accepted), then getOutputShapes with the last input (cos_sin_cache) of rank 9: the
# plugin then reads its 9th extent past the end of the exactly-sized descriptor array (an ASan
# report with every compiler, not only clang's array-bounds check)
RANK_NINE_SEED = bytes([
    12, 0, 0,                  # makeCollection: mode 12, 0 fields, fields pointer null
    0, 200,                    # layer name "fuzz_node_0"; kBUILD
    0, 200, 200,               # clone; keep the source; fuzz the source
    0,                         # fuzzPlugin: 1 round
    1, 1, 0, 3, 200, 3, 0,     # makeProblem: batch 1, seq 2, heads 1, head_dim 8, rot 8, rows 2
    2,                         # which 2: getOutputShapes (wildcards allowed)
    200, 0, 4, 0, 1, 200,      # makeDims: 1 perturbation, of d[4]: a rank, kRanks[1] = 9; no -1s
    0, 2, 200,                 # makeTypes: common, kFLOAT; no override
    200,                       # counts 5/2; the input ends: every extent a constant
])
# the parser's form (epsilon, interleaved, rounding, norm_scope) with interleaved given as kFLOAT32 1.0
INT_AS_FLOAT_SEED = bytes([
    0,                         # makeCollection: mode 0, the four attributes in table order
    0, 0, 0,                   # epsilon: forced name, clean, its default
    0, 200, 169, 0, 200, 0, 0,  # interleaved: forced name; not clean; type 169 % 14 = 1 kFLOAT32;
                                # length 1; data not null; a valid value, the default 1 (1.0f)
    0, 0, 0,                   # rounding: forced name, clean, its default
    0, 0, 0,                   # norm_scope: forced name, clean, its default
    0, 200,                    # layer name "fuzz_node_0"; kBUILD
])
MUTANTS = [
    ("string field: negative length not refused (read as a huge size_t)", "plugin/qknorm_rope_fields.cpp",
     r"QKROPE_VALIDATE\(f\.length >= 0,[^;]*;", "", r"AddressSanitizer: heap-buffer-overflow",
     NEGATIVE_LENGTH_SEED),
    ("rank check lets nbDims = 9 through", "plugin/qknorm_rope_plugin.cpp",
     r"return nbDims >= 0 && nbDims <= Dims::MAX_DIMS;", "return nbDims >= 0 && nbDims <= Dims::MAX_DIMS + 1;",
     r"runtime error: index 8 out of bounds|AddressSanitizer|INVARIANT VIOLATED", RANK_NINE_SEED),
    ("an INT field accepts kFLOAT32", "plugin/qknorm_rope_fields.cpp",
     r"(case PluginFieldType::kINT32:\s*return given == PluginFieldType::kINT32)",
     r"\1 || given == PluginFieldType::kFLOAT32", r"INVARIANT VIOLATED|runtime error:", INT_AS_FLOAT_SEED),
]


@pytest.fixture(scope="module")
def mutant_root(fuzz_build: FuzzBuild, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-mutants")
    yield root
    fuzz_build.configure("")  # drop the mutant target from the build's cache


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: re.sub(r"\W+", "_", m[0])[:48])
def test_fuzzer_catches_mutant(fuzz_build: FuzzBuild, mutant_root: Path, mutant):
    desc, src, pattern, repl, expect, seed = mutant
    text = (PLUGINS / src).read_text()
    mutated, n = re.subn(pattern, repl, text, count=1)
    if n == 0:
        pytest.skip(f"mutant '{desc}': its regex no longer matches plugins/{src} (update MUTANTS)")
    mdir = mutant_root / re.sub(r"\W+", "_", desc)[:40]
    mdir.mkdir()
    (mdir / Path(src).name).write_text(mutated)
    fuzz_build.configure(mdir)
    binary = fuzz_build.build("qkrope_plugin_fuzz_mutant")
    # the seed alone reaches the planted bug (one execution: no search involved) ...
    (mdir / "planted").write_bytes(seed)
    alone = subprocess.run([str(binary), str(mdir / "planted")], capture_output=True, text=True,
                           cwd=mdir, env={**os.environ, **SANITIZER_ENV}, timeout=HANG_GUARD_SECONDS)
    assert alone.returncode != 0 and re.search(expect, alone.stdout + alone.stderr), \
        f"mutant '{desc}': its seed does not reach the planted bug:\n{_report(alone)}"
    # ... and the iteration-capped fuzz run over the corpus holding it fails the same way
    res = fuzz_build.run(binary, mdir / "run", MUTANT_RUNS, seeds={"planted": seed})
    out = res.stdout + res.stderr
    assert res.returncode != 0, f"mutant '{desc}' survived the fuzzer:\n{_report(res)}"
    found = re.search(expect, out)
    assert found, f"mutant '{desc}': the fuzzer failed but not with /{expect}/:\n{_report(res)}"
    first = next((line for line in out.splitlines() if SANITIZER_REPORT.search(line)), found.group(0))
    print(f"\nmutant: {desc}\n  caught: {first.strip()[:300]}")
