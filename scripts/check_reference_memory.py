"""Peak RSS of `qkrope check`'s transformer reference at the real width: diffusers' model loaded
whole (what the check did before) against the streamed reference (one block's weights resident at
a time, qkrope.apps.check_blocks.StreamedTransformer), each in a fresh process running one forward
on a few tokens.

    python scripts/check_reference_memory.py [--blocks 3] [--dir build/realwidth_ref]

The folder (real-width Qwen-Image config, random bf16 weights, saved sharded with
save_pretrained) is written once and reused. Prints one row per case: blocks, peak RSS (MiB, the
child's own, qkrope.apps.measure.run_peak_rss: not this script's, whose folder build would
otherwise set the floor). Not a test: the figure depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHILD = r"""
import sys, torch
mode, folder, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
kw = dict(hidden_states=torch.randn(1, 16, 64, dtype=torch.bfloat16),
          encoder_hidden_states=torch.randn(1, 8, 3584, dtype=torch.bfloat16),
          encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.bool),
          timestep=torch.rand(1, dtype=torch.bfloat16), img_shapes=[[(1, 4, 4)]],
          return_dict=False)
with torch.no_grad():
    if mode == "streamed":
        from qkrope.apps.check_blocks import StreamedTransformer
        model = StreamedTransformer(folder, dtype=torch.bfloat16, num_layers=n)
    else:
        from qkrope.export.patch_diffusers import load_transformer
        model = load_transformer(folder, dtype=torch.bfloat16)
        model.transformer_blocks = model.transformer_blocks[:n]
    model(**kw)
"""


def make_folder(folder: Path, blocks: int) -> None:
    import diffusers
    import torch

    if (folder / "config.json").is_file() and json.loads(
            (folder / "config.json").read_text())["num_layers"] == blocks:
        return
    with torch.device("meta"):
        model = diffusers.QwenImageTransformer2DModel(num_layers=blocks)  # the real width
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # bf16 from the start
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    model.save_pretrained(str(folder), max_shard_size="1GB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--dir", default="build/realwidth_ref")
    args = ap.parse_args()
    folder = Path(args.dir)
    make_folder(folder, args.blocks)
    from qkrope.apps.measure import run_peak_rss

    print("reference      blocks  peak RSS MiB")
    for mode, n in (("streamed", 1), ("streamed", args.blocks), ("whole", args.blocks)):
        run = run_peak_rss([sys.executable, "-c", CHILD, mode, str(folder), str(n)])
        if run.returncode:
            raise SystemExit(f"the {mode} reference of {n} blocks failed (exit {run.returncode})")
        print(f"{mode:<14} {n:>6}  {run.peak_mib:>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
