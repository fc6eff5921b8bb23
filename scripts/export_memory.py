#!/usr/bin/env python
"""Peak memory and time of ``qkrope export`` at Qwen-Image's real width (not a test).

For each block count (default 1, 2 and 4) a random bf16 ``QwenImageTransformer2DModel`` with the
real widths (24 heads x 128, dim 3072, joint_attention_dim 3584, in_channels 64) is built in a
child process, parameter by parameter (a meta skeleton, each weight drawn in bf16; no fp32 copy)
and saved sharded with ``save_pretrained(max_shard_size=...)``. Then the default export::

    qkrope export --model transformer --diffusers DIR --dtype bf16 --out DIR/t.onnx

runs in another child process, and its own peak resident set size (``ru_maxrss`` of that child
alone, ``qkrope.apps.measure.run_peak_rss``) and wall time are recorded. A least-squares line
through (blocks, peak) gives the slope per block and the prediction at 60 blocks (the real model)::

    python scripts/export_memory.py                     # 1, 2, 4 blocks
    python scripts/export_memory.py --blocks 1 --keep   # one folder, left in --work
    python scripts/export_memory.py --blocks 1,2,4 --limit-slope 16 --limit-60 1536
    python scripts/export_memory.py --build-only DIR --blocks 1   # the folder alone (a test)
    python scripts/export_memory.py --of-60 1,2   # --layers N of a 60-block folder (below)

``--of-60 N,M``: the real model's config (60 blocks) and shard layout (5 GiB shards, index),
every header real but the data a sparse file of zeros (no disk used), exported with
``--layers N``: what trying the real model's folder on a small machine costs (the 60-block
skeleton, the headers of all 20.4 B parameters, the first N blocks' weights read and written).

Exit status 0 when the slope and the prediction are within ``--limit-slope`` MiB/block and
``--limit-60`` MiB (the targets of issue 25), 1 otherwise. Disk: about 0.7 GiB per block for the
folder and as much for the export, removed after each row (``--work``, default a temporary
folder). Linux only (``ru_maxrss`` in KiB).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_BUILD = r"""
import sys
import torch
from torch import nn
from diffusers import QwenImageTransformer2DModel

blocks, out, shard = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with torch.device("meta"):
    model = QwenImageTransformer2DModel(num_layers=blocks)  # the real widths are the defaults
g = torch.Generator().manual_seed(blocks)
for module in model.modules():
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        if p.ndim >= 2:  # a weight: variance 1/fan_in, as a trained layer roughly has
            value = torch.randn(p.shape, generator=g, dtype=torch.bfloat16) / p.shape[-1] ** 0.5
        elif "norm" in name or name == "weight":
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.bfloat16)
        else:
            value = 0.02 * torch.randn(p.shape, generator=g, dtype=torch.bfloat16)
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
model.save_pretrained(out, max_shard_size=shard)
"""


_SPARSE_60 = r"""
import json, struct, sys
from pathlib import Path
import torch
from diffusers import QwenImageTransformer2DModel

out = Path(sys.argv[1])
with torch.device("meta"):
    model = QwenImageTransformer2DModel(num_layers=60)
model.save_config(str(out))
shards, part, size = [], {}, 0
for key, value in model.state_dict().items():
    n = value.numel() * 2  # bf16
    if part and size + n > 5 << 30:
        shards.append(part)
        part, size = {}, 0
    part[key], size = value, size + n
shards.append(part)
weight_map = {}
for i, part in enumerate(shards, 1):
    name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
    header, offset = {}, 0
    for key, value in part.items():
        n = value.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(value.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
        weight_map[key] = name
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out / name, "wb") as f:  # the header, then a hole of the data's size
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)
(out / "diffusion_pytorch_model.safetensors.index.json").write_text(
    json.dumps({"metadata": {}, "weight_map": weight_map}))
"""


def _of_60(layers: list[int], work: Path, dtype: str) -> int:
    folder = work / "qwen_60_sparse"
    folder.mkdir()
    rc, _, _, tail = _measured([sys.executable, "-c", _SPARSE_60, str(folder)])
    if rc:
        print(tail, file=sys.stderr)
        return 2
    print("| --layers of a 60-block folder | peak RSS | wall time | written |")
    print("|---|---|---|---|")
    for n in layers:
        out = work / f"l{n}.onnx"
        rc, peak, wall, tail = _measured(
            [sys.executable, "-m", "qkrope", "export", "--model", "transformer", "--diffusers",
             str(folder), "--dtype", dtype, "--layers", str(n), "--out", str(out)])
        if rc:
            print(tail, file=sys.stderr)
            return 2
        written = sum(p.stat().st_size for p in work.glob(f"l{n}.onnx*"))
        print(f"| {n} | {peak:.0f} MiB | {wall:.0f} s | {written / 2**20:.0f} MiB |", flush=True)
        for p in work.glob(f"l{n}.onnx*"):
            p.unlink()
    return 0


def _measured(argv: list[str]) -> tuple[int, float, float, str]:
    """Run ``argv`` and return (exit status, its own peak RSS in MiB, wall s, output tail):
    through :func:`qkrope.apps.measure.run_peak_rss`, so the figure is this child's alone, not
    this script's peak (which ru_maxrss would otherwise inherit at exec) nor earlier children's."""
    from qkrope.apps.measure import run_peak_rss

    with tempfile.TemporaryFile("w+") as log:
        run = run_peak_rss(argv, stdout=log, stderr=subprocess.STDOUT)
        log.seek(0)
        tail = log.read()[-3000:]
    return run.returncode, run.peak_mib, run.wall_s, tail


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="1,2,4", help="comma-separated block counts")
    ap.add_argument("--dtype", default="bf16", help="--dtype of the export (default bf16)")
    ap.add_argument("--shard-size", default="300MB",
                    help="save_pretrained's max_shard_size (default 300MB: several shards even "
                         "at 1 block, as the real model has)")
    ap.add_argument("--work", default=None, help="folder for the models (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the folders and exports")
    ap.add_argument("--extra", default="", help="extra arguments for qkrope export")
    ap.add_argument("--limit-slope", type=float, default=16.0, help="MiB per block")
    ap.add_argument("--limit-60", type=float, default=1536.0, help="MiB at 60 blocks")
    ap.add_argument("--build-only", metavar="DIR", default=None,
                    help="only save the folder of the (first) --blocks count into DIR")
    ap.add_argument("--of-60", metavar="N,M", default=None,
                    help="export --layers N of a 60-block folder with sparse shards instead")
    args = ap.parse_args()
    counts = [int(b) for b in args.blocks.split(",")]
    if args.of_60:
        from qkrope.apps.measure import machine_info

        m = machine_info("cpu")
        print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python "
              f"{m['python']}")
        with tempfile.TemporaryDirectory(prefix="qkrope-mem-", dir=args.work) as tmp:
            return _of_60([int(n) for n in args.of_60.split(",")], Path(tmp), args.dtype)
    if args.build_only:
        rc, _, _, tail = _measured([sys.executable, "-c", _BUILD, str(counts[0]),
                                    args.build_only, args.shard_size])
        if rc:
            print(tail, file=sys.stderr)
        return 2 if rc else 0

    from qkrope.apps.measure import machine_info

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="qkrope-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in counts:
            folder = work / f"qwen_{n}"
            if not (folder / "config.json").is_file():
                rc, _, build_s, tail = _measured([sys.executable, "-c", _BUILD, str(n),
                                                  str(folder), args.shard_size])
                if rc:
                    print(tail, file=sys.stderr)
                    return 2
            weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            shards = len(list(folder.glob("*.safetensors")))
            out = work / f"t{n}.onnx"
            rc, peak, wall, tail = _measured(
                [sys.executable, "-m", "qkrope", "export", "--model", "transformer",
                 "--diffusers", str(folder), "--dtype", args.dtype, "--out", str(out),
                 *args.extra.split()])
            if rc:
                print(tail, file=sys.stderr)
                return 2
            written = sum(p.stat().st_size for p in work.glob(f"t{n}.onnx*"))
            rows.append((n, weights / 2**20, shards, peak, wall, written / 2**20))
            print(f"{n} block(s): peak {peak:.0f} MiB, {wall:.0f} s", file=sys.stderr,
                  flush=True)
            if not args.keep:
                for p in work.glob(f"t{n}.onnx*"):
                    p.unlink()
                shutil.rmtree(folder)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)

    m = machine_info("cpu")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}")
    print(f"command: qkrope export --model transformer --diffusers DIR --dtype {args.dtype} "
          f"{args.extra}".rstrip())
    print()
    print("| blocks | weights (shards) | peak RSS | wall time | written |")
    print("|---|---|---|---|---|")
    for n, w, s, peak, wall, written in rows:
        print(f"| {n} | {w:.0f} MiB ({s}) | {peak:.0f} MiB | {wall:.0f} s | {written:.0f} MiB |")
    ok = True
    if len(rows) >= 2:
        slope, icept = _fit([r[0] for r in rows], [r[3] for r in rows])
        tslope, ticept = _fit([r[0] for r in rows], [r[4] for r in rows])
        at60 = icept + 60 * slope
        print()
        print(f"fit: peak = {icept:.0f} MiB + {slope:.1f} MiB/block; 60 blocks: {at60:.0f} MiB "
              f"({at60 / 1024:.2f} GiB); time = {ticept:.0f} s + {tslope:.1f} s/block")
        ok = slope <= args.limit_slope and at60 <= args.limit_60
        print(f"targets: slope <= {args.limit_slope:g} MiB/block, 60 blocks <= "
              f"{args.limit_60:g} MiB: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
