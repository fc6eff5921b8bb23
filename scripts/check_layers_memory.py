#!/usr/bin/env python
"""Peak memory and time of checking the first blocks of a real-size transformer on a small
machine (not a test): ``qkrope export --layers N`` then ``qkrope check --layers N``.

The folder has the real model's config and shard layout (5 GiB shards, an index): every header
is real, the tensors outside the blocks and those of the first N blocks hold random bf16 values
(variance 1/fan_in for a weight, norms near 1), and every later block's data is a hole of a
sparse file (no disk used). So the export reads and writes N blocks, and the check's two sides
run those N blocks on real numbers: ONNX Runtime on the export cut after block N-1, the reference
(diffusers' forward of the whole model, blocks past N passing their streams through) reading one
block at a time from the shards. Each step runs in a child process whose own peak RSS
(``os.wait4``) and wall time are printed::

    python scripts/check_layers_memory.py                       # FLUX.1-dev, --layers 2
    python scripts/check_layers_memory.py --layers 1,2 --dtype fp32
    python scripts/check_layers_memory.py --class FluxTransformer2DModel \\
        --config '{"guidance_embeds": true}' --work /data/tmp

``--class`` / ``--config``: the diffusers class and the keyword arguments its constructor takes
on top of its defaults (FLUX.1-dev by default: diffusers' defaults are its widths, 19 double +
38 single blocks, with guidance embeddings). ``--dtype`` fp32 by default: ONNX Runtime's CPU
provider runs no bf16 MatMul. Disk: the random part of the folder (~0.7 GiB per FLUX block in
bf16) and the export (twice that in fp32), removed at the end unless ``--keep``. Linux only
(``ru_maxrss`` in KiB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
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
    for j in range(len(getattr(model, blocks.attr))):
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
print(f"{sum(v.numel() for v in state.values()) / 1e9:.2f} B parameters, "
      f"{written / 2**20:.0f} MiB of values written")
"""


def _measured(argv: list[str]) -> tuple[int, float, float, str]:
    """Run ``argv``: (exit status, its own peak RSS in MiB, wall s, output tail)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        log.seek(0)
        tail = log.read()[-4000:]
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024, wall, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--class", dest="cls", default="FluxTransformer2DModel",
                    help="the diffusers transformer class (default FluxTransformer2DModel)")
    ap.add_argument("--config", default='{"guidance_embeds": true}',
                    help="JSON keyword arguments on top of the class defaults (default: "
                         "FLUX.1-dev's guidance embeddings)")
    ap.add_argument("--layers", default="2", help="comma-separated block counts (default 2)")
    ap.add_argument("--dtype", default="fp32", help="--dtype of the export (default fp32)")
    ap.add_argument("--work", default=None, help="folder for the model (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the folders and exports")
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="qkrope_check_layers_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print("| step | peak RSS | wall time |")
        print("|---|---|---|")
        for n in layers:
            folder = work / f"model_l{n}"
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir()
            rc, peak, wall, tail = _measured([sys.executable, "-c", _BUILD, str(folder),
                                              args.cls, args.config, str(n)])
            if rc:
                print(tail, file=sys.stderr)
                return 2
            print(f"<!-- folder: {tail.strip().splitlines()[-1]} -->", flush=True)
            out = work / f"l{n}.onnx"
            steps = [("export", ["export", "--model", "transformer", "--diffusers", str(folder),
                                 "--dtype", args.dtype, "--layers", str(n), "--out", str(out)]),
                     ("check", ["check", str(out), "--layers", str(n),
                                "--workdir", str(work / f"l{n}.check")])]
            for what, argv in steps:
                rc, peak, wall, tail = _measured([sys.executable, "-m", "qkrope", *argv])
                if rc:
                    print(tail, file=sys.stderr)
                    return 2
                print(f"| {what} --layers {n} | {peak:.0f} MiB | {wall:.0f} s |", flush=True)
                if what == "check":
                    print("\n".join("    " + line for line in tail.strip().splitlines()
                                    if line.startswith(("compared", "onnxrt", "PASSED",
                                                        "FAILED"))), flush=True)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
