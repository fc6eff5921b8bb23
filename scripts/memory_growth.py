"""Does resident memory stay bounded across a pipeline's calls with changing shapes?

Runs an exported diffusers transformer through the drop-in (``load_transformer``) as a pipeline
calls it: 12 calls that alternate two image sizes and two text lengths (a true-CFG pair per
step, a second resolution every other step), then prints the peak resident set size after the
first four calls (every combination of shapes seen once) and after all twelve, and the growth
between them. Exit status 0 when the growth is below ``--limit`` (25 %), 1 otherwise.

    python scripts/memory_growth.py                 # exports a tiny random transformer first
    python scripts/memory_growth.py --model transformer.onnx --sizes 64x64,40x80 --txt 300,90
    python scripts/memory_growth.py --mem-pattern   # ONNX Runtime's memory patterns back on

Without ``--model`` a tiny random ``QwenImageTransformer2DModel`` (qkrope.apps.tiny_pipeline)
is saved and exported in a child process (needs diffusers), so that the export's own memory
does not count in this process's peak, and the peak is reset after the model is loaded (the
calls' peak, not the load's). Linux only (``/proc/self/statm``, ``/proc/self/status`` VmHWM).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CALLS = 12
FIRST = 4

_EXPORT = """
import sys
from qkrope.apps import tiny_pipeline as tp
from qkrope.cli import main
tp.save_transformer(tp.tiny_transformer(), sys.argv[1])
raise SystemExit(main(["export", "--model", "transformer", "--diffusers", sys.argv[1],
                       "--out", sys.argv[2]]))
"""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak() -> bool:
    """Reset the kernel's peak RSS of this process (``/proc/self/clear_refs`` 5, Linux 4.0+), so
    that the peak measured is the calls', not the model load's transient (reading the model,
    hashing it, building the session). False where the kernel refuses: the peak is then the
    process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mib() -> float:
    """Peak RSS since the last reset_peak (VmHWM), else since the process started (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pairs(text: str, what: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if len(out) != 2 or any(len(p) != 2 or min(p) < 1 for p in out):
        raise SystemExit(f"{what} must be two HxW latent-patch grids, e.g. 48x48,32x64; got {text!r}")
    return out  # type: ignore[return-value]


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",")]
    except ValueError:
        out = []
    if len(out) != 2 or min(out) < 1:
        raise SystemExit(f"{what} must be two text lengths, e.g. 200,77; got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an exported transformer (.onnx); default: export a tiny one")
    ap.add_argument("--sizes", default="48x48,32x64",
                    help="two image sizes in latent patches HxW (default 48x48,32x64)")
    ap.add_argument("--txt", default="200,77", help="two text lengths (default 200,77)")
    ap.add_argument("--batch", type=int, default=2, help="batch per call (default 2)")
    ap.add_argument("--mem-pattern", action="store_true",
                    help="turn ONNX Runtime's memory patterns on (its own default; qkrope's "
                         "is off) to see the growth they cause")
    ap.add_argument("--limit", type=float, default=25.0, help="allowed growth in %% (default 25)")
    args = ap.parse_args(argv)
    sizes, txts = _pairs(args.sizes, "--sizes"), _ints(args.txt, "--txt")

    with tempfile.TemporaryDirectory(prefix="qkrope-mem-") as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "transformer.onnx")
            subprocess.run([sys.executable, "-c", _EXPORT, str(Path(tmp) / "transformer"), model],
                           check=True, stdout=subprocess.DEVNULL)
        return _run(model, sizes, txts, args.batch, args.mem_pattern, args.limit)


def _run(model: str, sizes, txts, batch: int, mem_pattern: bool, limit: float) -> int:
    import onnxruntime as ort
    import torch

    from qkrope.runtime import load_transformer
    from qkrope.runtime.loader_onnxrt import default_session_options

    so = default_session_options(ort)
    so.enable_mem_pattern = bool(mem_pattern)
    so.intra_op_num_threads = 1
    transformer = load_transformer(model, sess_options=so)
    cfg = transformer.config
    channels, text_dim = int(cfg["in_channels"]), int(cfg["joint_attention_dim"])
    since = "the first call" if reset_peak() else "the process started"
    print(f"{model}: {CALLS} calls, batch {batch}, image sizes {sizes}, text lengths {txts}, "
          f"memory patterns {'on' if mem_pattern else 'off'}; start: RSS {rss_mib():.0f} MiB; "
          f"peaks since {since}")
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for i in range(CALLS):
        (h, w), txt = sizes[i % 2], txts[(i // 2) % 2]
        hidden = torch.randn(batch, h * w, channels, generator=gen)
        text = torch.randn(batch, txt, text_dim, generator=gen)
        (sample,) = transformer(hidden, text, torch.ones(batch, txt, dtype=torch.long),
                                torch.tensor(0.5), img_shapes=[[(1, h, w)]] * batch,
                                return_dict=False)
        del sample
        peaks.append(peak_mib())
        print(f"call {i + 1:2d}: image {h}x{w}, text {txt}: RSS {rss_mib():7.0f} MiB, "
              f"peak {peaks[-1]:7.0f} MiB")
    growth = 100.0 * (peaks[-1] - peaks[FIRST - 1]) / peaks[FIRST - 1]
    ok = growth < limit
    print(f"peak RSS after {FIRST} calls {peaks[FIRST - 1]:.0f} MiB, after {CALLS} "
          f"{peaks[-1]:.0f} MiB: growth {growth:+.1f} % ({'<' if ok else '>='} {limit:g} %)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
