"""The cost of Z-Image's per-group calls (docs/spec.md section 6c) at real width: one
diffusers ZImageTransformerBlock (dim 3840, 30 heads x 128, random weights), CFG's two samples
(captions padded to 128 and 32 tokens, a 512x512 image: 1024 image tokens) as one padded
batch-2 call with a key mask (diffusers' way) against two batch-1 calls (the drop-in's groups),
interleaved, min of ``--repeats``.

    python scripts/bench_z_image_groups.py [--threads 2] [--repeats 3] [--image-tokens 1024]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-tokens", type=int, default=1024)
    args = parser.parse_args()
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    block = ZImageTransformerBlock(0, 3840, 30, 30, 1e-5, True).eval()
    n, lengths = args.image_tokens, (128, 32)
    seqs = [torch.randn(1, n + s, 3840) for s in lengths]
    freqs = [torch.polar(torch.ones(n + s, 64), torch.rand(n + s, 64))[None] for s in lengths]
    adaln = torch.randn(2, 256)
    width = n + max(lengths)
    padded_x = torch.zeros(2, width, 3840)
    padded_f = torch.zeros(2, width, 64, dtype=torch.complex64)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for i, (x, f) in enumerate(zip(seqs, freqs)):
        padded_x[i, :x.shape[1]], padded_f[i, :x.shape[1]], mask[i, :x.shape[1]] = x[0], f[0], True

    def padded():
        return block(padded_x, mask, padded_f, adaln)

    def grouped():
        return [block(x, None, f, adaln[i:i + 1]) for i, (x, f) in enumerate(zip(seqs, freqs))]

    times = {"padded batch-2 call": [], "two batch-1 calls": []}
    with torch.no_grad():
        padded(), grouped()  # warm up
        for _ in range(args.repeats):
            for (name, runs), fn in zip(times.items(), (padded, grouped)):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
    for name, runs in times.items():
        print(f"{name}: min {min(runs):.2f} s ({', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
