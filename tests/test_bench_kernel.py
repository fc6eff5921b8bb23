"""scripts/bench_kernel.py and qkrope.apps.kernel_bench: what runs without a GPU (arguments,
the bytes formula, buffer rotation, peak lookup, the timing loop against a fake torch.cuda, the
no-CUDA exit, the JSON rows, the table). The GPU path itself runs in scripts/gpu_check.sh."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkrope.apps import bench, measure
from qkrope.apps import kernel_bench as kb
from qkrope.runtime import kernels

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_kernel.py"
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("bench_kernel_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- bytes, rates, peak -------------------------------------------------------------------------

def test_bytes_formula_by_hand():
    # 1024x1024 (4096 image tokens) + 512 text tokens, batch 1, 24 heads x 128, bf16, fp32 cache
    act = 4 * 4608 * 24 * 128 * 2          # q, k read + q_out, k_out written: 113,246,208
    cache = 4608 * 128 * 4                 # one fp32 row of 128 per token:     2,359,296
    weights = 2 * 2 * 128 * 2              # q and k weights of both streams:       1,024
    block = kb.Case(1024, 1, "block")
    assert block.tokens == 4608 and block.bytes == act + cache + weights == 115_606_528
    assert round(block.bytes / 1e6, 1) == 115.6
    assert round(block.bytes / 4.8e12 * 1e6, 1) == 24.1          # 24.1 us at 4.8 TB/s
    img, txt = kb.Case(1024, 1, "img"), kb.Case(1024, 1, "txt")
    assert img.bytes == 4 * 4096 * 24 * 128 * 2 + 4096 * 128 * 4 + 2 * 128 * 2
    assert txt.bytes == 4 * 512 * 24 * 128 * 2 + 512 * 128 * 4 + 2 * 128 * 2
    assert img.bytes + txt.bytes == block.bytes
    # one formula: qkrope bench's block bytes are the same numbers
    assert measure.qknorm_rope_bytes(4096, 512, 24, 128) == block.bytes
    assert measure.qknorm_rope_bytes(4096, 512, 24, 128, batch=2) == kb.Case(1024, 2, "block").bytes
    # batch 2 doubles the activations only; 512x512 has 1024 image tokens
    assert kb.Case(1024, 2, "img").bytes == 2 * 4 * 4096 * 24 * 128 * 2 + 4096 * 128 * 4 + 512
    assert kb.Case(512, 1, "img").tokens == 1024
    with pytest.raises(ValueError):
        kb.Case(1024, 1, "both")
    with pytest.raises(ValueError):
        kb.Case(500, 1, "img")


def test_rates_and_peak_table():
    gbs, pct = kb.rates(115_606_528, 115_606_528 / 4.8e12 * 1e6, 4800.0)
    assert gbs == pytest.approx(4800.0) and pct == pytest.approx(100.0)
    assert kb.rates(1000, 1.0, None) == (pytest.approx(1.0), None)
    assert kb.rates(1000, None, 4800.0) == (None, None)
    for name, peak in (("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0),
                       ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
                       ("NVIDIA B200", 8000.0), ("NVIDIA L40S", 864.0)):
        assert measure.peak_gbps(name) == peak, name
    assert measure.peak_gbps("Some Future GPU") is None
    assert measure.peak_gbps("NVIDIA H200", override=4000) == 4000.0


# ---- buffer rotation and graph size ---------------------------------------------------------------

def test_rotation_sets_exceed_twice_the_l2():
    l2 = 50 * 2**20                        # what an H100/H200 reports (L2_cache_size)
    txt = kb.Case(1024, 1, "txt").bytes    # 12,845,568 B
    k = kb.rotation_sets(txt, l2)
    assert k == 9                          # 8 x 12.8 MB = 102.8 MB <= 104.9 MB < 9 x 12.8 MB
    for case in kb.default_cases():
        k = kb.rotation_sets(case.bytes, l2)
        assert k * case.bytes > 2 * l2
        assert k == kb.MIN_SETS or (k - 1) * case.bytes <= 2 * l2   # the smallest such count
        assert k >= kb.MIN_SETS
    assert kb.rotation_sets(300 * 2**20, l2) == kb.MIN_SETS == 2   # one set alone > 2 x L2
    assert kb.rotation_sets(1, l2) == kb.MAX_SETS                  # capped
    assert kb.rotation_sets(10, 100, factor=1.0) == 11
    with pytest.raises(ValueError):
        kb.rotation_sets(0, l2)


def test_graph_launches_are_a_multiple_of_the_sets():
    assert kb.graph_launches(20, 9) == 27
    assert kb.graph_launches(20, 5) == 20
    assert kb.graph_launches(20, 2) == 20
    assert kb.graph_launches(3, 9) == 9
    with pytest.raises(ValueError):
        kb.graph_launches(0, 2)


# ---- the raw launch's arguments are the validated call's ------------------------------------------

def test_launch_args_are_the_validated_calls_arguments():
    q = torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)
    k, qo, ko = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
    qw, kw = torch.ones(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    cache = torch.zeros(5, 6)
    seen = []
    kernels._call(lambda *a: seen.append(a) or 0, None, "x", q, k, qw, kw, cache, qo, ko,
                  1e-6, False, 1)
    args = kb.launch_args(kb.StreamTensors(q, k, qw, kw, cache, qo, ko), eps=1e-6,
                          interleaved=False, rounding=1)
    assert args == seen[0]
    # + norm_scope and the weights' dtype; the stream per launch
    assert len(args) == len(kernels._ARGTYPES) + 2
    assert args[7:13] == (2, 3, 4, 8, 6, 5)
    assert args[-2:] == (kernels.DTYPE_CODES[torch.bfloat16],) * 2
    fp32_weights = kb.launch_args(kb.StreamTensors(q, k, qw.float(), kw.float(), cache, qo, ko),
                                  eps=1e-6, interleaved=False, rounding=1)
    assert fp32_weights[-1] == kernels.DTYPE_CODES[torch.float32]


# ---- the timing loop, against a fake torch.cuda ---------------------------------------------------

class FakeCuda:
    """Enough of torch.cuda for time_launches: a clock that advances 1 ms per executed launch
    unit, graphs that record the units issued while capturing and replay them."""

    def __init__(self, capture_fails: bool = False):
        self.clock = 0.0
        self.mode = "main"
        self.capturing = None
        self.calls = []
        self.replays = 0
        self.capture_fails = capture_fails
        cuda = self

        class Stream:
            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def __init__(self):
                self.units = []

            def replay(self):
                cuda.replays += 1
                cuda.clock += len(self.units)

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                self.t = cuda.clock

            def elapsed_time(self, end):
                return end.t - self.t

        self.Stream, self.CUDAGraph, self.Event = Stream, CUDAGraph, Event

    def current_stream(self):
        return self.Stream()

    @contextlib.contextmanager
    def stream(self, s):
        self.mode = "side"
        yield
        self.mode = "main"

    @contextlib.contextmanager
    def graph(self, g):
        self.capturing = g
        try:
            yield
        finally:
            self.capturing = None
        if self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")

    def synchronize(self):
        pass

    def step(self, i):
        if self.capturing is not None:
            self.capturing.units.append(i)
        else:
            self.calls.append((self.mode, i))
            self.clock += 1.0


def test_time_launches_captures_a_graph_cycling_over_the_sets():
    fake = FakeCuda()
    captured = []
    orig = fake.CUDAGraph

    class Recording(orig):
        def __init__(self):
            super().__init__()
            captured.append(self)

    fake.CUDAGraph = Recording
    t = kb.time_launches(fake.step, sets=3, launches=6, iters=4, warmup=2, cuda=fake)
    assert fake.calls == [("side", 0), ("side", 1), ("side", 2)]      # each set warmed once
    assert captured[0].units == [0, 1, 2, 0, 1, 2]                      # the graph: N units, K sets
    assert fake.replays == 2 + 4                                        # warm-up + timed replays
    assert t.graph and t.times_ms == [1.0] * 4                          # elapsed / N per unit
    assert t.launches == 6 and t.sets == 3
    assert "CUDA graph of 6 launch units over 3 buffer sets" in t.method
    st = t.summary()
    assert st["median_ms"] == 1.0 and st["n"] == 4


def test_time_launches_falls_back_to_direct_launches_and_says_so():
    fake = FakeCuda(capture_fails=True)
    t = kb.time_launches(fake.step, sets=2, launches=4, iters=3, warmup=1, cuda=fake)
    assert not t.graph and t.times_ms == [1.0] * 3
    assert "capture failed: RuntimeError: operation not permitted" in t.method
    assert "host overhead included" in t.method
    direct = [c for c in fake.calls if c[0] == "main"]
    assert len(direct) == (1 + 3) * 4 and [i for _, i in direct[:4]] == [0, 1, 0, 1]


# ---- the CLI ------------------------------------------------------------------------------------

def test_arguments(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    a = cli.parse_args([])
    assert (a.iters, a.warmup, a.launches, a.rounding, a.no_compile) == (30, 5, 20, 0, False)
    assert a.shape_list == [(512, 1), (512, 2), (1024, 1), (1024, 2)]
    assert a.stream_list == ["img", "txt", "block"]
    assert a.json == tmp_path / "bench_kernel.json"
    q = cli.parse_args(["--quick"])
    assert (q.shape_list, q.iters, q.warmup, q.launches) == ([(1024, 1)], 5, 2, 8)
    q = cli.parse_args(["--quick", "--iters", "9", "--launches-per-graph", "40", "--no-compile",
                        "--rounding", "1", "--json", str(tmp_path / "x.json")])
    assert (q.iters, q.launches, q.no_compile, q.rounding) == (9, 40, True, 1)
    assert q.json == tmp_path / "x.json"
    s = cli.parse_args(["--shapes", "512:2, 1024x1024", "--streams", "block,img"])
    assert s.shape_list == [(512, 2), (1024, 1), (1024, 2)]
    assert s.stream_list == ["img", "block"]
    assert cli.parse_args(["--peak-gbs", "4000"]).peak_gbs == 4000.0


@pytest.mark.parametrize("argv", [["--shapes", "500"], ["--shapes", "512x256"],
                                  ["--shapes", "512:0"], ["--shapes", ","],
                                  ["--streams", "both"], ["--rounding", "3"],
                                  ["--iters", "0"], ["--launches-per-graph", "0"]])
def test_bad_arguments_exit_2(cli, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_no_cuda_exit(cli, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert cli.main(["--quick", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device visible to PyTorch" in err and "NVIDIA GPU" in err
    assert not out.exists()
    # the script itself, as gpu_check.sh runs it
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "no CUDA device visible to PyTorch" in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and "--launches-per-graph" in res.stdout


# ---- rows, JSON, table ----------------------------------------------------------------------------

def _ok(case, backend, us, graph=True):
    gbs, pct = kb.rates(case.bytes, us, 4800.0)
    return kb.result_row(case, backend, median_us=us, p10_us=us * 0.9, p90_us=us * 1.1,
                         gbs=gbs, pct_peak=pct, method="m", graph=graph, sets=2,
                         launches_per_graph=20, max_rel_err=1e-3)


def test_json_is_rewritten_after_every_row(tmp_path):
    path = tmp_path / "sub" / "bench_kernel.json"
    rec = kb.Recorder(path, meta={"peak_gbs": 4800.0})
    rec.save("starting")
    assert json.loads(path.read_text()) == {"peak_gbs": 4800.0, "phase": "starting", "rows": []}
    block = kb.Case(1024, 1, "block")
    rec.add(_ok(block, "fused", 30.0), phase="fused rows")
    data = json.loads(path.read_text())
    assert data["phase"] == "fused rows" and len(data["rows"]) == 1
    assert data["rows"][0]["bytes"] == 115_606_528 and data["rows"][0]["backend"] == "fused"
    rec.add(kb.result_row(block, "compile", status="failed", reason="boom"), phase="compile")
    data = json.loads(path.read_text())
    assert [r["backend"] for r in data["rows"]] == ["fused", "compile"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["bench_kernel.json"]  # no temp left


def test_markdown_table(cli):
    block, txt = kb.Case(1024, 1, "block"), kb.Case(1024, 1, "txt")
    rows = [_ok(block, "fused", 30.0), _ok(block, "eager", 120.0),
            kb.result_row(block, "compile", status="failed", reason="torch.compile failed: X"),
            _ok(txt, "fused", 4.0, graph=False),
            kb.result_row(txt, "eager", status="skipped", reason="--budget-s 10 s spent")]
    md = kb.format_markdown(rows, peak=4800.0, header=["## t", ""])
    lines = md.splitlines()
    assert lines[0] == "## t"
    head = next(x for x in lines if x.startswith("| shape"))
    assert "fused GB/s" in head and "eager % peak" in head and "fused vs compile" in head
    line = next(x for x in lines if x.startswith("| 1024x1024 | 1 | block |"))
    assert "| 4608 | 115.6 |" in line and "30.0 (27.0-33.0)" in line
    assert "| 3854 | 80.3 |" in line                    # 115.6 MB / 30 us, of 4800 GB/s
    assert "| failed | - | - |" in line and "4.00x" in line
    txt_line = next(x for x in lines if x.startswith("| 1024x1024 | 1 | txt |"))
    assert "4.0 (3.6-4.4) *" in txt_line and "| skipped | - | - |" in txt_line
    assert any("not in a CUDA graph" in x for x in lines)
    assert "- 1024x1024 B=1 block compile: failed, torch.compile failed: X" in md
    assert "- 1024x1024 B=1 txt eager: skipped, --budget-s 10 s spent" in md
    assert "unknown" in kb.format_markdown(rows, peak=None)
    assert "fused" in cli._line(rows[0]) and "failed: torch.compile failed" in cli._line(rows[2])


# ---- one home for the method ----------------------------------------------------------------------

def test_one_kernel_timing_method():
    assert not hasattr(bench, "_graph_or_direct") and not hasattr(bench, "time_cuda")
    assert "kernel_bench" in inspect.getsource(bench._bench_kernel)
    src = SCRIPT.read_text()
    for private in ("CUDAGraph", "Event(", "elapsed_time", "data_ptr", "import ctypes"):
        assert private not in src, private          # the script is a CLI over kernel_bench
    core = inspect.getsource(kb)
    assert "kernels._load(" in core and "cuda_qk_norm_rope(" in core   # the project's loader


# ---- scripts/gpu_check.sh -----------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses_and_stays_within_8_outputs():
    res = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = GPU_CHECK.read_text()
    outputs = set(re.findall(r'\$OUT/([A-Za-z0-9_.-]+)', text))
    assert outputs <= {"gpu_check.log", "build.log", "pytest.log", "pytest.xml", "kernel_report.json",
                       "bench.log", "bench_kernel.json", "bandwidth.json"}, outputs
    assert 'run(command="bash scripts/gpu_check.sh", carry=["build/gpu_pydeps"' in text
    assert "scripts/bandwidth_check.py" in text and "scripts/copy128.cu" in text
    assert "scripts/bench_kernel.py" in text and "--budget-s" in text


# ---- the GPU path's logic, run on the CPU build of the kernel ------------------------------------

@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """measure() on CPU tensors: the CPU build of the kernel (same C ABI without the stream)
    stands in for libqkrope_kernels.so, a fake torch.cuda for the graph and the events."""
    if kernels.host_library_path() is None:
        pytest.skip(f"{kernels.HOST_LIB_NAME} not built ({kernels.HOST_BUILD_COMMAND})")
    host = kernels._load(kernels.HOST_LIB_ENV, kernels.HOST_LIB_NAME, kernels.HOST_BUILD_COMMAND,
                         "qkrope_host_run_v3", "qkrope_host_status_string", cuda=False)
    launched = []

    class Lib:
        @staticmethod
        def qkrope_launch_v3(*args):
            assert isinstance(args[-1], ctypes.c_void_p)   # the stream handle
            launched.append(args[:-1])
            return host.qkrope_host_run_v3(*args[:-1])

        qkrope_status_string = host.qkrope_host_status_string
        qkrope_host_run_v3 = host.qkrope_host_run_v3  # the validated (host) call's own
        qkrope_host_status_string = host.qkrope_host_status_string

    def validated(*a, **kw):
        launched.append("validated")
        return kernels.host_qk_norm_rope(*a, **kw)

    monkeypatch.setattr(kernels, "_load", lambda *a, **kw: Lib)
    monkeypatch.setattr(kernels, "cuda_qk_norm_rope", validated)

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    fake = FakeCuda()
    real = kb.time_launches
    monkeypatch.setattr(kb, "time_launches", lambda step, **kw: real(
        lambda i: (step(i), fake.step(i)), cuda=fake, **kw))
    return launched


@pytest.mark.parametrize("rounding", [0, 1])
def test_measure_fused_and_eager_rows(cpu_as_cuda, rounding):
    case = kb.Case(64, 2, "block", heads=2, head_dim=64, txt_tokens=8)
    opts = kb.Options(iters=3, warmup=1, launches=4, rounding=rounding)
    l2 = 3 * case.bytes                     # -> 7 sets, 7 launch units per graph
    row = kb.measure(case, "fused", opts, device=torch.device("cpu"), peak=100.0, l2=l2)
    assert row["status"] == "ok", row
    assert (row["sets"], row["launches_per_graph"], row["iters"]) == (7, 7, 3)
    assert row["median_us"] == pytest.approx(1000.0)          # 1 ms per unit on the fake clock
    assert row["gbs"] == pytest.approx(case.bytes / 1e-3 / 1e9)
    assert row["pct_peak"] == pytest.approx(row["gbs"])       # of 100 GB/s
    assert row["max_rel_err"] <= 1e-2 and row["graph"] and "CUDA graph" in row["method"]
    # one validated call per stream, then only raw launches (2 per unit: img and txt)
    assert cpu_as_cuda[:2] == ["validated", "validated"]
    assert "validated" not in cpu_as_cuda[2:]
    # raw check on set 0, warm-up of each set, the 7 units issued while capturing
    assert len(cpu_as_cuda) == 2 + 2 * (1 + 7 + 7)
    assert {a[8] for a in cpu_as_cuda[2:]} == {16, 8}        # img and txt tokens
    assert len({a[0] for a in cpu_as_cuda[2:]}) == 2 * 7     # distinct q buffers per set
    eager = kb.measure(case, "eager", opts, device=torch.device("cpu"), peak=None, l2=l2)
    assert eager["status"] == "ok" and eager["pct_peak"] is None, eager
    bad = kb.measure(case, "nope", opts, device=torch.device("cpu"), peak=None, l2=l2)
    assert bad["status"] == "failed" and "backend must be one of" in bad["reason"]


def test_measure_refuses_wrong_output(cpu_as_cuda, monkeypatch):
    monkeypatch.setattr(kb, "REL_TOL", {**kb.REL_TOL, "bfloat16": 1e-9})
    case = kb.Case(64, 1, "img", heads=2, head_dim=64)
    row = kb.measure(case, "fused", kb.Options(iters=1, warmup=0, launches=1),
                     device=torch.device("cpu"), peak=None, l2=0)
    assert row["status"] == "failed" and "BenchCheckError" in row["reason"]
    assert row["median_us"] is None


def test_gpu_details_from_properties_and_nvidia_smi(monkeypatch, tmp_path):
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                            total_memory=143771 * 2**20, L2_cache_size=50 * 2**20,
                            memory_bus_width=6144, uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "--id=GPU-1234-abcd" ] || exit 6\n'
                   'echo "570.86.15, 1980, 1980, 3201, 3201"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    info = measure.gpu_details(torch.device("cuda", 0))
    assert info == {"sm_count": "132", "l2_mib": "50", "compute_capability": "9.0",
                    "gpu_memory_gib": "140", "memory_bus_bits": "6144", "driver": "570.86.15",
                    "clocks_mhz": "sm 1980/1980 max, mem 3201/3201 max"}
    smi.write_text("#!/bin/sh\nexit 9\n")                 # nvidia-smi fails: no clocks, no error
    assert "clocks_mhz" not in measure.gpu_details(torch.device("cuda", 0))


def test_device_peak_sources(monkeypatch):
    from types import SimpleNamespace

    name = {"v": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name["v"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        memory_clock_rate=2_619_000, memory_bus_width=5120))       # kHz, bits (H100 SXM-like)
    assert kb.device_peak(0) == (4800.0, "data sheet (NVIDIA H200)")
    assert kb.device_peak(0, 4000.0) == (4000.0, "--peak-gbs")
    name["v"] = "NVIDIA Future GPU"
    peak, src = kb.device_peak(0)
    assert peak == pytest.approx(2 * 2.619e9 * 640 / 1e9) and "bus width" in src
