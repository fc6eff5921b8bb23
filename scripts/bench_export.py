#!/usr/bin/env python
"""Export benchmark (not a test): export time and file size for the default Qwen-Image attention
block and a 2-layer transformer; ONNX Runtime CPU latency of the attention block at 512x512
(1024 image tokens) and 1024x1024 (4096) vs PyTorch eager of the same module, as a ratio.

    python scripts/bench_export.py [--repeats 3] [--txt-len 512] [--skip-1024] [--threads 1]

Latency: one thread for both torch and ONNX Runtime by default (``--threads`` to change), the two
backends interleaved call by call (``qkrope.apps.measure.time_interleaved``), median reported.

The 2-layer transformer is a random QwenImageTransformer2DModel with Qwen-Image's real widths
(24 x 128 heads, joint_attention_dim 3584, in_channels 64), built in code and saved to a temp dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def size_of(path: Path) -> int:
    total = path.stat().st_size
    data = Path(str(path) + ".data")
    return total + (data.stat().st_size if data.exists() else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--txt-len", type=int, default=512)
    ap.add_argument("--skip-1024", action="store_true")
    ap.add_argument("--skip-transformer", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch and ONNX Runtime (default 1: measures the code, "
                         "not thread-pool contention on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import onnxruntime as ort
    from qkrope.export.onnx_export import build_attention, export_attention, export_transformer
    from qkrope.apps.measure import machine_info, time_interleaved
    from qkrope.runtime.inputs import make_inputs, to_torch
    from qkrope.sidecars import ModelInfo

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        attn_path = tmp / "attn.onnx"
        t = time.perf_counter()
        export_attention(attn_path)
        rows.append(("export attention block (24x128, fp32)", f"{time.perf_counter() - t:.1f} s",
                     f"{size_of(attn_path) / 1e6:.1f} MB"))
        if not args.skip_transformer:
            from diffusers import QwenImageTransformer2DModel

            torch.manual_seed(0)
            model = QwenImageTransformer2DModel(num_layers=2)  # Qwen-Image widths
            model.save_pretrained(str(tmp / "qwen2"))
            del model
            tr_path = tmp / "tr.onnx"
            t = time.perf_counter()
            export_transformer(tr_path, tmp / "qwen2", progress=False)
            rows.append(("export transformer, 2 layers (fp32)",
                         f"{time.perf_counter() - t:.1f} s", f"{size_of(tr_path) / 1e6:.1f} MB"))

        info = ModelInfo.load(attn_path)
        module = build_attention(info)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(attn_path), opts, providers=["CPUExecutionProvider"])
        lat = []
        sizes = [("512x512", (1, 32, 32))] + ([] if args.skip_1024 else
                                              [("1024x1024", (1, 64, 64))])
        for label, shape in sizes:
            feeds = make_inputs(info, [shape], args.txt_len, 1, seed=0)
            tt = {role: to_torch(feeds[name]) for role, name in info.roles().items()}
            with torch.no_grad():
                times = time_interleaved({
                    "ort": lambda: sess.run(None, feeds),
                    "eager": lambda: module(
                        tt["hidden_states"], tt["encoder_hidden_states"],
                        (tt["img_cache"], tt["txt_cache"]),
                        tt["encoder_hidden_states_mask"])}, iters=args.repeats, warmup=1)
            for name, res in times.items():
                if isinstance(res, BaseException):
                    raise res
            t_ort = statistics.median(times["ort"]) / 1e3
            t_eager = statistics.median(times["eager"]) / 1e3
            tokens = shape[0] * shape[1] * shape[2]
            lat.append((f"{label} ({tokens} img + {args.txt_len} txt, batch 1)",
                        f"{t_ort * 1e3:.0f} ms", f"{t_eager * 1e3:.0f} ms",
                        f"{t_ort / t_eager:.2f}x"))

    m = machine_info("cpu")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, onnxruntime "
          f"{m['onnxruntime']}, Python {m['python']}")
    print()
    print(f"{'export':<42} {'time':>8} {'size':>10}")
    for r in rows:
        print(f"{r[0]:<42} {r[1]:>8} {r[2]:>10}")
    print()
    print(f"attention block latency, median of {args.repeats} interleaved calls, {args.threads} "
          f"CPU thread(s) for torch and ORT (ratio = ORT / eager; < 1: ORT faster)")
    print(f"{'size':<42} {'ORT CPU':>9} {'eager':>9} {'ratio':>7}")
    for r in lat:
        print(f"{r[0]:<42} {r[1]:>9} {r[2]:>9} {r[3]:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
