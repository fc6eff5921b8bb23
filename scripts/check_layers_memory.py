#!/usr/bin/env python
"""Peak memory and time of checking the first blocks of a real-size transformer on a small
machine (not a test): ``qkrope export --layers N`` then ``qkrope check --layers N``, or with
``--export-only`` the export alone (the streamed export's memory per real-width block).

The folder has the real model's config and shard layout (5 GiB shards, an index): every header
is real, the tensors outside the blocks and those of the first N blocks hold random bf16 values
(variance 1/fan_in for a weight, norms near 1), and every later block's data is a hole of a
sparse file (no disk used). So the export reads and writes N blocks, and the check's two sides
run those N blocks on real numbers: ONNX Runtime on the export cut after block N-1, the reference
(diffusers' forward of the whole model, blocks past N passing their streams through) reading one
block at a time from the shards. Each step runs in a child process whose own peak RSS
(``qkrope.apps.measure.run_peak_rss``: the child's alone) and wall time are printed::

    python scripts/check_layers_memory.py                       # FLUX.1-dev, --layers 2
    python scripts/check_layers_memory.py --layers 1,2 --dtype fp32
    python scripts/check_layers_memory.py --class FluxTransformer2DModel \\
        --config '{"guidance_embeds": true}' --work /data/tmp
    python scripts/check_layers_memory.py --export-only --dtype bf16 --layers 1,2,4 \\
        --class WanTransformer3DModel --config '{}'

``--class`` / ``--config``: the diffusers class and the keyword arguments its constructor takes
on top of its defaults (FLUX.1-dev by default: diffusers' defaults are its widths, 19 double +
38 single blocks, with guidance embeddings). ``--dtype`` fp32 by default: ONNX Runtime's CPU
provider runs no bf16 MatMul. Disk: the random part of the folder (~0.7 GiB per FLUX block in
bf16) and the export (twice that in fp32), removed at the end unless ``--keep``. Linux only
(``ru_maxrss`` in KiB).

One folder serves every count of ``--layers``: it is built once with values in the first
max(N) blocks (the export and the check of N blocks read no later block). ``--export-only``
(meant with ``--dtype bf16``, as the README's Qwen-Image table) prints, per N, the folder's
weights (all, and those of the N blocks), the export's peak RSS, wall time and bytes written,
then with two or more counts a least-squares line in N and its value at the model's own block
count. Each export is removed once measured unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_BUILD = r"""
import json, struct, sys
from pathlib import Path
import torch
import diffusers

out, cls, kwargs, layers = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
with torch.device("meta"):
    model = getattr(diffusers, cls)(**kwargs)
model.save_config(str(out))
from qkrope import families
record = families.by_class(cls)
kept, index = [], 0  # the key prefixes of the first `layers` blocks in execution order
for blocks in record.block_lists:
    for j in range(len(model.get_submodule(blocks.attr))):
        if index < layers:
            kept.append(f"{blocks.attr}.{j}.")
        index += 1
inside = tuple(f"{b.attr}." for b in record.block_lists)
state = model.state_dict()
shards, part, size = [], {}, 0
for key, value in state.items():
    n = value.numel() * 2  # bf16
    if part and size + n > 5 << 30:
        shards.append(part)
        part, size = {}, 0
    part[key], size = value, size + n
shards.append(part)
g = torch.Generator().manual_seed(0)
weight_map, written = {}, 0
for i, part in enumerate(shards, 1):
    name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
    header, offset, spans = {}, 0, []
    for key, value in part.items():
        n = value.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(value.shape),
                       "data_offsets": [offset, offset + n]}
        spans.append((key, value.shape, offset))
        offset += n
        weight_map[key] = name
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out / name, "wb") as f:  # the header, a hole of the data's size, some values
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)
        for key, shape, at in spans:
            if key.startswith(inside) and not key.startswith(tuple(kept)):
                continue  # a later block: the hole reads as zeros
            leaf = key.rsplit(".", 1)[-1]
            if len(shape) >= 2:
                v = torch.randn(shape, generator=g) / shape[-1] ** 0.5
            elif "norm" in key and leaf == "weight":
                v = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                v = 0.02 * torch.randn(shape, generator=g)
            f.seek(8 + len(text) + at)
            f.write(v.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            written += v.numel() * 2
(out / "diffusion_pytorch_model.safetensors.index.json").write_text(
    json.dumps({"metadata": {}, "weight_map": weight_map}))
block_bytes = []  # bf16 bytes of each block, in execution order
for blocks in record.block_lists:
    for j in range(len(model.get_submodule(blocks.attr))):
        prefix = f"{blocks.attr}.{j}."
        block_bytes.append(sum(v.numel() * 2 for k, v in state.items() if k.startswith(prefix)))
print(f"{sum(v.numel() for v in state.values()) / 1e9:.2f} B parameters, "
      f"{written / 2**20:.0f} MiB of values written")
print("INFO " + json.dumps({"params": sum(v.numel() for v in state.values()),
                            "bytes": sum(v.numel() * 2 for v in state.values()),
                            "shards": len(shards), "block_bytes": block_bytes}))
"""


def _measured(argv: list[str]) -> tuple[int, float, float, str]:
    """Run ``argv``: (exit status, its own peak RSS in MiB, wall s, output tail), the peak of the
    child alone (:func:`qkrope.apps.measure.run_peak_rss`)."""
    from qkrope.apps.measure import run_peak_rss

    with tempfile.TemporaryFile("w+") as log:
        run = run_peak_rss(argv, stdout=log, stderr=subprocess.STDOUT)
        log.seek(0)
        tail = log.read()[-4000:]
    return run.returncode, run.peak_mib, run.wall_s, tail


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--class", dest="cls", default="FluxTransformer2DModel",
                    help="the diffusers transformer class (default FluxTransformer2DModel)")
    ap.add_argument("--config", default='{"guidance_embeds": true}',
                    help="JSON keyword arguments on top of the class defaults (default: "
                         "FLUX.1-dev's guidance embeddings; '{}' for the bare defaults)")
    ap.add_argument("--layers", default="2", help="comma-separated block counts (default 2)")
    ap.add_argument("--dtype", default="fp32", help="--dtype of the export (default fp32)")
    ap.add_argument("--opset", default=None,
                    help="--opset of the export (default: qkrope's; bf16 Conv needs 22)")
    ap.add_argument("--export-only", action="store_true",
                    help="run the export alone (no check); print the weights, bytes written "
                         "and a line fitted in the block count (use with --dtype bf16)")
    ap.add_argument("--work", default=None, help="folder for the model (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the folders and exports")
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="qkrope_check_layers_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        folder = work / "model"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        rc, peak, wall, tail = _measured([sys.executable, "-c", _BUILD, str(folder),
                                          args.cls, args.config, str(max(layers))])
        if rc:
            print(tail, file=sys.stderr)
            return 2
        lines = tail.strip().splitlines()
        info = json.loads(next(line for line in lines if line.startswith("INFO "))[5:])
        print(f"<!-- {args.cls} {args.config}: {lines[-2]}; {len(info['block_bytes'])} blocks; "
              f"folder built in {wall:.0f} s -->", flush=True)
        if args.export_only:
            print("| blocks | weights (shards) | in the blocks | peak RSS | wall time | written |")
            print("|---|---|---|---|---|---|")
        else:
            print("| step | peak RSS | wall time |")
            print("|---|---|---|")
        rows = []
        for n in layers:
            out_dir = work / f"l{n}"
            shutil.rmtree(out_dir, ignore_errors=True)
            out_dir.mkdir()
            out = out_dir / f"l{n}.onnx"
            steps = [("export", ["export", "--model", "transformer", "--diffusers", str(folder),
                                 "--dtype", args.dtype, "--layers", str(n), "--out", str(out),
                                 *(["--opset", args.opset] if args.opset else [])])]
            if not args.export_only:
                steps.append(("check", ["check", str(out), "--layers", str(n),
                                        "--workdir", str(work / f"l{n}.check")]))
            for what, argv in steps:
                rc, peak, wall, tail = _measured([sys.executable, "-m", "qkrope", *argv])
                if rc:
                    print(f"{what} --layers {n} failed (exit {rc}):", file=sys.stderr)
                    print(tail, file=sys.stderr)
                    return 2
                if what == "check":
                    print(f"| check --layers {n} | {peak:.0f} MiB | {wall:.0f} s |", flush=True)
                    print("\n".join("    " + line for line in tail.strip().splitlines()
                                    if line.startswith(("compared", "onnxrt", "PASSED",
                                                        "FAILED"))), flush=True)
                elif not args.export_only:
                    print(f"| export --layers {n} | {peak:.0f} MiB | {wall:.0f} s |", flush=True)
                else:
                    files = [f for f in out_dir.iterdir() if f.is_file()]
                    written = sum(f.stat().st_size for f in files)
                    extra = [f for f in files if f.suffix not in (".onnx", ".json")]
                    rows.append((n, peak, wall))
                    print(f"| {n} | {_mib(info['bytes'])} ({info['shards']}) "
                          f"| {_mib(sum(info['block_bytes'][:n]))} | {peak:.0f} MiB "
                          f"| {wall:.0f} s | {_mib(written)} "
                          f"({'+ external data' if extra else 'one file'}) |", flush=True)
            if args.export_only and not args.keep:
                shutil.rmtree(out_dir, ignore_errors=True)
        if len(rows) >= 2:
            total = len(info["block_bytes"])
            a, b = _fit([r[0] for r in rows], [r[1] for r in rows])
            c, d = _fit([r[0] for r in rows], [r[2] for r in rows])
            print(f"fitted: peak RSS = {a:.0f} MiB + {b:.1f} MiB x blocks, "
                  f"time = {c:.0f} s + {d:.1f} s x blocks; at {total} blocks "
                  f"(the whole model, {_mib(info['bytes'])}): {a + b * total:.0f} MiB, "
                  f"{(c + d * total) / 60:.1f} min", flush=True)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
