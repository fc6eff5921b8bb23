"""``qkrope quantize``: FP8 calibration of a diffusers transformer with NVIDIA ModelOpt, over
:mod:`qkrope.export.quantize`."""

from __future__ import annotations

import argparse

from qkrope.errors import InputError
from qkrope.quantization import DEFAULT_EXCLUDED_BY_CLASS, default_excluded

from . import _args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize",
        description="Calibrate a diffusers QwenImageTransformer2DModel to per-tensor FP8 (e4m3) "
                    "with NVIDIA ModelOpt (max calibration) from transformer inputs recorded in "
                    "your own pipeline runs (qkrope.export.quantize.CalibrationRecorder), and "
                    "save it as a diffusers folder with ModelOpt's modelopt_state.pth. Export "
                    "it with `qkrope export --model transformer --diffusers QDIR --quant fp8`. "
                    "Needs the fp8 extra: pip install 'qkrope[fp8]'.")
    p.add_argument("--diffusers", metavar="DIR", required=True,
                   help="local folder of the float QwenImageTransformer2DModel (or its pipeline)")
    p.add_argument("--calibration", metavar="CALIB.pt", required=True,
                   help="recorded transformer calls (CalibrationRecorder.save)")
    p.add_argument("--out", "-o", metavar="QDIR", required=True,
                   help="output folder (replaced as a whole)")
    p.add_argument("--batches", type=int, default=None,
                   help="use the first N recorded calls (default: all)")
    _args.add_dtype(p, "dtype the transformer is loaded, calibrated and saved in",
                    default="fp32")
    p.add_argument("--device", default=None,
                   help="torch device of the calibration (default: cuda when available)")
    p.add_argument("--exclude", nargs="*", metavar="MODULE", default=None,
                   help="top-level modules left unquantised (default, TensorRT's diffusion demo "
                        "selection in the model's names: "
                        + "; ".join(f"{cls}: {' '.join(names)}"
                                    for cls, names in DEFAULT_EXCLUDED_BY_CLASS.items()) + ")")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from qkrope import dtypes
    from qkrope.export import quantize
    from qkrope.export.patch_diffusers import load_transformer

    from pathlib import Path

    if Path(args.out).resolve() == Path(args.diffusers).resolve():
        raise InputError(f"--out {args.out!r} is the float model's folder; write the quantised "
                         f"model to a new folder (the float one is the calibration's source)")
    if args.batches is not None and args.batches < 1:
        raise InputError(f"--batches must be >= 1; got {args.batches}")
    batches = quantize.load_calibration(args.calibration)[:args.batches]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    transformer = load_transformer(args.diffusers, dtype=dtypes.TORCH_BY_SHORT[args.dtype])
    transformer.to(device)
    exclude = default_excluded(transformer) if args.exclude is None else tuple(args.exclude)
    quantize.calibrate(transformer, batches, config=quantize.fp8_config(exclude), progress=True)
    out = quantize.save_quantized(transformer.to("cpu"), args.out)
    n = len(quantize.fp8_quantizers(transformer))
    print(f"calibrated {n} FP8 quantizers over {len(batches)} recorded call(s); wrote {out}")
    print(f"next: qkrope export --model transformer --diffusers {out} --quant fp8")
    return 0
