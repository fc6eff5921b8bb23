"""``qkrope quantize``: FP8 calibration of a diffusers transformer with NVIDIA ModelOpt, over
:mod:`qkrope.export.quantize`."""

from __future__ import annotations

import argparse
from pathlib import Path

from qkrope import families
from qkrope.errors import InputError
from qkrope.quantization import default_excluded

from . import _args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize",
        description="Calibrate a diffusers "
                    + _args.or_list(f"{r.class_name} ({r.short})" for r in families.records())
                    + " to per-tensor FP8 (e4m3) with NVIDIA ModelOpt (max calibration) from transformer inputs recorded in "
                    "your own pipeline runs (qkrope.export.quantize.CalibrationRecorder), and "
                    "save it as a diffusers folder with ModelOpt's modelopt_state.pth. Export "
                    "it with `qkrope export --model transformer --diffusers QDIR --quant fp8`. "
                    "Needs the fp8 extra: pip install 'qkrope[fp8]'.")
    p.add_argument("--diffusers", metavar="DIR", required=True,
                   help=f"local folder of the float transformer "
                        f"({_args.or_list(r.short for r in families.records())}; or its pipeline)")
    p.add_argument("--calibration", metavar="CALIB.pt", required=True,
                   help="recorded transformer calls (CalibrationRecorder.save)")
    p.add_argument("--out", "-o", metavar="QDIR", required=True,
                   help="output folder, replaced as a whole (in one step, the old one kept on "
                        "any failure); an existing folder is replaced only when it is a "
                        "previous quantised model (config.json + modelopt_state.pth) or empty, "
                        "and never when it holds --diffusers or --calibration")
    p.add_argument("--batches", type=int, default=None,
                   help="use the first N recorded calls (default: all)")
    _args.add_dtype(p, "dtype the transformer is loaded, calibrated and saved in",
                    default="fp32")
    p.add_argument("--device", default=None,
                   help="torch device of the calibration: cpu, cuda or cuda:N (default: cuda "
                        "when available)")
    p.add_argument("--exclude", nargs="*", metavar="MODULE", default=None,
                   help="modules left unquantised, by name (top-level or dotted, e.g. "
                        "transformer_blocks.0.attn; fnmatch patterns allowed), each must name "
                        "a module of the transformer (default, TensorRT's diffusion demo "
                        "selection in the model's names: "
                        + "; ".join(f"{r.class_name}: {' '.join(r.fp8_excluded)}"
                                    + "".join(f" ({n} where built)"
                                              for n in r.fp8_excluded_where_built)
                                    for r in families.records()) + ")")
    p.set_defaults(func=run)
    return p


def model_folder(diffusers: Path) -> Path:
    """The folder the transformer is read from: ``--diffusers`` itself, or a pipeline folder's
    ``transformer/`` (as :func:`qkrope.export.patch_diffusers.load_transformer` takes it)."""
    if not (diffusers / "config.json").is_file() and (diffusers / "transformer").is_dir():
        return diffusers / "transformer"
    return diffusers


def check_paths(args: argparse.Namespace) -> Path:
    """The inputs exist and ``--out`` may be written (:func:`qkrope._fileio.check_outputs`: not
    an input, containing none, a previous quantised model or new), before torch is imported.
    Returns ``--out``."""
    from qkrope import _preflight as pre
    from qkrope._fileio import QUANTIZED_MODEL, check_output_folder, check_outputs

    diffusers = pre.input_dir(args.diffusers, flag="--diffusers",
                              fix="pass the local folder of a saved diffusers transformer "
                                  "(config.json + weights) or of its pipeline")
    pre.input_file(args.calibration, flag="--calibration",
                   fix="record one with qkrope.export.quantize.CalibrationRecorder")
    if args.batches is not None and args.batches < 1:
        raise InputError(f"--batches must be >= 1; got {args.batches}")
    out = Path(args.out)
    check_output_folder(out.parent)
    check_outputs([(out, QUANTIZED_MODEL)], _inputs(args, diffusers))
    return out


def _inputs(args: argparse.Namespace, diffusers: Path) -> list[Path]:
    """What quantize reads: the folders and their weight/config files (a symlink into --out
    counts where it points) and the calibration file."""
    from qkrope.runtime.state_dict import model_folder_files

    return [diffusers, model_folder(diffusers), *model_folder_files(diffusers),
            Path(args.calibration)]


def run(args: argparse.Namespace) -> int:
    out = check_paths(args)  # before the heavy imports: a wrong path answers at once

    from qkrope import dtypes
    from qkrope.export import quantize
    from qkrope.export.patch_diffusers import load_transformer

    device = quantize.resolve_device(args.device)
    folder = model_folder(Path(args.diffusers))
    exclude = None if args.exclude is None else tuple(args.exclude)
    cls = quantize.folder_class_name(folder)
    if exclude is None and cls is not None:
        exclude = default_excluded(cls)  # refuses a class qkrope has no selection for
    if exclude is not None:
        quantize.check_exclude_in_folder(folder, exclude)
    batches = quantize.load_calibration(args.calibration)[:args.batches]
    transformer = load_transformer(args.diffusers, dtype=dtypes.TORCH_BY_SHORT[args.dtype])
    quantize.check_loaded_weights(transformer, source=f"--diffusers {folder}", dtype=args.dtype)
    if args.exclude is None:  # the loaded model's: with the modules its config flags built
        exclude = default_excluded(transformer)
    config = quantize.fp8_config(exclude, model=transformer)  # and the model loaded
    transformer.to(device)
    quantize.calibrate(transformer, batches, config=config, progress=True)
    out = quantize.save_quantized(transformer.to("cpu"), out,
                                  inputs=_inputs(args, Path(args.diffusers)))
    n = len(quantize.fp8_quantizers(transformer))
    print(f"calibrated {n} FP8 quantizers over {len(batches)} recorded call(s); wrote {out}")
    print(f"next: qkrope export --model transformer --diffusers {out} --quant fp8")
    return 0
