#!/usr/bin/env python
"""Peak memory and time of the pipeline's stage exports at the real width (not a test): the
text encoders and VAEs that ``qkrope export --model pipeline`` exports beside the transformer,
streamed from their safetensors (export/stages/streamed.py), on folders of the released
models' widths.

Cases (``--cases``, comma-separated; the stage each exports is its family's declaration,
``qkrope.families`` ``stages``):

- ``qwen2.5-vl-7b``: Qwen-Image's text encoder, Qwen2_5_VLForConditionalGeneration at
  Qwen2.5-VL-7B's widths (hidden 3584, intermediate 18944, 28 heads, 4 KV heads, vocabulary
  152064; its 32-block vision tower), ``num_hidden_layers`` = N; the released key layout
  (``model.layers.*``, ``visual.*``, ``lm_head``).
- ``umt5-xxl``: Wan's text encoder, UMT5EncoderModel at umt5-xxl's widths (d_model 4096, d_ff
  10240, 64 heads of 64, vocabulary 256384), ``num_layers`` = N.
- ``wan-vae``: Wan 2.1's AutoencoderKLWan (diffusers' default config), its causal decoder (two
  graphs), and with ``--encode`` its encoder too (two more, as an image-to-video pipeline).
- ``flux-vae``: FLUX.1's AutoencoderKL (16 latent channels, block_out_channels 128, 256, 512,
  512), its decoder, and with ``--encode`` its encoder.
- ``qwen3-8b``: FLUX.2 klein 9B's text encoder, Qwen3ForCausalLM at Qwen3-8B's widths (hidden
  4096, intermediate 12288, 32 heads of 128, 8 KV heads, vocabulary 151936),
  ``num_hidden_layers`` = N (the released 36; klein reads hidden states 9, 18 and 27).
- ``mistral-small-3.1``: FLUX.2 [dev]'s text encoder, Mistral3ForConditionalGeneration at
  Mistral Small 3.1 24B's widths (hidden 5120, intermediate 32768, 32 heads of 128, 8 KV
  heads, vocabulary 131072; its 24-block Pixtral vision tower), ``num_hidden_layers`` = N (the
  released 40; Flux2Pipeline reads hidden states 10, 20 and 30, so N >= 31 for the whole read:
  the export of fewer layers reads what exists up to N, see ``--layers``); the released key
  layout (``language_model.model.*``, ``vision_tower.*``).
- ``clip-vit-h``: Wan 2.1 I2V's image encoder, CLIPVisionModel at ViT-H/14's widths (hidden
  1280, intermediate 5120, 16 heads, 224 px in 14 px patches), ``num_hidden_layers`` = N (the
  released 32).
- ``flux2-vae``: FLUX.2's AutoencoderKLFlux2 (diffusers' default config: 32 latent channels),
  its decoder, its batch-norm statistics, and with ``--encode`` its encoder (klein's reference
  images).
- ``hunyuan-image-vae``: HunyuanImage-2.1's AutoencoderKLHunyuanImage (64 latent channels, 32x;
  the config diffusers' conversion script writes), its decoder.

Each folder holds the real config.json and safetensors (5 GiB shards and an index where the
weights are larger) with random bf16 values (variance 1/fan_in for a weight, norms near 1) in
every tensor the graph reads; tensors it never reads (Qwen2.5-VL's vision tower and lm_head)
are holes of a sparse file. For the text encoders one folder is built per N of ``--layers``
(default 1,2,4), exported, and removed before the next (disk: the folder plus the export, about
twice N layers and the embedding); the VAEs are built once. Each build and each export runs in
a child process started through ``qkrope.apps.measure.run_peak_rss`` (its own peak RSS) and the
export's peak RSS, wall time and bytes written are printed as a table, then for two or more N
a least-squares line in N and its value at the whole encoder's layer count::

    python scripts/stage_memory.py                              # every case, N = 1, 2, 4
    python scripts/stage_memory.py --cases umt5-xxl --layers 1,2,4,8
    python scripts/stage_memory.py --cases wan-vae,flux-vae --encode
    python scripts/stage_memory.py --cases qwen2.5-vl-7b --layers 1 --mode in-memory

``--mode in-memory`` measures the export as it was before streaming (the component loaded whole
with from_pretrained, the weights in memory, the graph optimised with them), for contrast.
``--dtype`` bf16 and ``--opset`` 22 by default (ONNX's Conv takes bfloat16 from opset 22: a
bf16 VAE needs it, and a pipeline export gives its stages the transformer's opset). Linux only
(``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SHARD_BYTES = 5 << 30
CHUNK = 1 << 24  # elements generated and written at a time


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------

def _qwen25_vl_config(layers: int):
    import transformers

    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=layers, num_attention_heads=28,
                         num_key_value_heads=4, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                         tie_word_embeddings=False, use_sliding_window=False,
                         sliding_window=32768),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           in_chans=3, out_hidden_size=3584, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                           hidden_act="silu"),
        tie_word_embeddings=False, vision_start_token_id=151652, vision_end_token_id=151653,
        image_token_id=151655, video_token_id=151656)


def _umt5_xxl_config(layers: int):
    import transformers

    return transformers.UMT5Config(
        vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers,
        num_decoder_layers=layers, num_heads=64, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)


def _qwen3_8b_config(layers: int):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", tie_word_embeddings=False)


def _mistral_small_31_config(layers: int):
    import transformers

    return transformers.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120,
                         intermediate_size=32768, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=1000000000.0, hidden_act="silu", sliding_window=None,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, head_dim=64,
                           image_size=1540, patch_size=14, rope_theta=10000.0),
        image_token_index=10, spatial_merge_size=2, multimodal_projector_bias=False,
        projector_hidden_act="gelu", vision_feature_layer=-1)


def _mistral3_saved_key(key: str) -> str:
    """The released checkpoint's key of a module key (transformers 5 renames on load)."""
    for module, saved in (("model.language_model.", "language_model.model."),
                          ("model.vision_tower.", "vision_tower."),
                          ("model.multi_modal_projector.", "multi_modal_projector."),
                          ("lm_head.", "language_model.lm_head.")):
        if key.startswith(module):
            return saved + key[len(module):]
    return key


def _clip_vit_h_config(layers: int):
    import transformers

    return transformers.CLIPVisionConfig(
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=layers,
        num_attention_heads=16, image_size=224, patch_size=14, projection_dim=1024,
        hidden_act="gelu", layer_norm_eps=1e-5)


def _qwen25_vl_saved_key(key: str) -> str:
    """The released checkpoint's key of a module key (transformers 5 renames on load)."""
    for module, saved in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(module):
            return saved + key[len(module):]
    return key


@dataclass(frozen=True)
class Case:
    library: str
    cls: str
    family: str
    component: str  # the pipeline component (its stage is the family's declaration)
    config: Callable | None = None  # layers -> transformers config (text encoders)
    vae_kwargs: dict = field(default_factory=dict)  # the diffusers constructor's arguments
    layers: int | None = None  # the whole encoder's layer count
    saved_key: Callable[[str], str] = lambda key: key
    unread: tuple[str, ...] = ()  # checkpoint key prefixes no graph reads: sparse holes
    pipeline: str | None = None  # the pipeline class whose stages apply (None: the family's
    #                              first declared ones)


CASES = {
    "qwen2.5-vl-7b": Case("transformers", "Qwen2_5_VLForConditionalGeneration", "qwen-image",
                          "text_encoder", config=_qwen25_vl_config, layers=28,
                          saved_key=_qwen25_vl_saved_key, unread=("visual.", "lm_head.")),
    "umt5-xxl": Case("transformers", "UMT5EncoderModel", "wan", "text_encoder",
                     config=_umt5_xxl_config, layers=24),
    "wan-vae": Case("diffusers", "AutoencoderKLWan", "wan", "vae"),
    "flux-vae": Case("diffusers", "AutoencoderKL", "flux1", "vae", vae_kwargs=dict(
        in_channels=3, out_channels=3, latent_channels=16,
        block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        act_fn="silu", norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)),
    "qwen3-8b": Case("transformers", "Qwen3ForCausalLM", "flux2", "text_encoder",
                     config=_qwen3_8b_config, layers=36, pipeline="Flux2KleinPipeline",
                     unread=("lm_head.",)),
    "mistral-small-3.1": Case("transformers", "Mistral3ForConditionalGeneration", "flux2",
                              "text_encoder", config=_mistral_small_31_config, layers=40,
                              saved_key=_mistral3_saved_key, pipeline="Flux2Pipeline",
                              unread=("vision_tower.", "multi_modal_projector.",
                                      "language_model.lm_head.")),
    "clip-vit-h": Case("transformers", "CLIPVisionModel", "wan", "image_encoder",
                       config=_clip_vit_h_config, layers=32),
    "flux2-vae": Case("diffusers", "AutoencoderKLFlux2", "flux2", "vae"),
    "hunyuan-image-vae": Case("diffusers", "AutoencoderKLHunyuanImage", "hunyuan-image", "vae",
                              vae_kwargs=dict(
        in_channels=3, out_channels=3, latent_channels=64,
        block_out_channels=[128, 256, 512, 512, 1024, 1024], layers_per_block=2,
        spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)),
}


# --------------------------------------------------------------------------------------------
# Building a folder (a child process)
# --------------------------------------------------------------------------------------------

def _values(key: str, shape, g):
    """Chunks of random values for a tensor (bf16): weights ~ N(0, 1/fan_in), norm weights
    near 1, other vectors small."""
    import torch

    count = math.prod(shape)
    leaf = key.rsplit(".", 1)[-1]
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        v = torch.randn(n, generator=g)
        if len(shape) >= 2:
            v /= math.prod(shape[1:]) ** 0.5
        elif "norm" in key and leaf in ("weight", "gamma") or leaf == "running_var":
            v = 1.0 + 0.1 * v
        else:
            v *= 0.02
        yield v.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _write_folder(folder: Path, tensors: dict[str, tuple], *, stem: str, unread=(),
                  ints=frozenset()) -> dict:
    """safetensors shards of ``tensors`` (checkpoint key -> shape, bf16; int64 zeros for the
    keys of ``ints``, a batch norm's counter) in ``folder``: one ``{stem}.safetensors``, or
    ``{stem}-0000i-of-0000n.safetensors`` and an index past :data:`SHARD_BYTES`; keys under
    ``unread`` left as holes. Returns sizes for the report."""
    import struct

    import torch

    def nbytes(key, shape):
        return math.prod(shape) * (8 if key in ints else 2)

    shards, part, size = [], {}, 0
    for key, shape in tensors.items():
        n = nbytes(key, shape)
        if part and size + n > SHARD_BYTES:
            shards.append(part)
            part, size = {}, 0
        part[key], size = shape, size + n
    shards.append(part)
    g = torch.Generator().manual_seed(0)
    weight_map, written, total = {}, 0, 0
    for i, part in enumerate(shards, 1):
        name = (f"{stem}.safetensors" if len(shards) == 1
                else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors")
        header, offset = {}, 0
        for key, shape in part.items():
            n = nbytes(key, shape)
            header[key] = {"dtype": "I64" if key in ints else "BF16", "shape": list(shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = name
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.truncate(8 + len(text) + offset)  # a hole the size of the data
            for key, shape in part.items():
                at = header[key]["data_offsets"][0]
                total += nbytes(key, shape)
                if key.startswith(tuple(unread)) or key in ints:  # holes read as zeros
                    continue
                f.seek(8 + len(text) + at)
                for chunk in _values(key, shape, g):
                    f.write(chunk)
                    written += len(chunk)
    if len(shards) > 1:
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}))
    largest = max(tensors, key=lambda k: math.prod(tensors[k]))
    return {"bytes": total, "written": written, "shards": len(shards),
            "largest": [largest, math.prod(tensors[largest]) * 2]}


def build(case_name: str, layers: int, folder: Path) -> None:
    import torch

    case = CASES[case_name]
    folder.mkdir(parents=True, exist_ok=True)
    if case.library == "transformers":
        import transformers

        config = case.config(layers)
        config.dtype = torch.bfloat16
        with torch.device("meta"):
            model = getattr(transformers, case.cls)(config)
        config.save_pretrained(str(folder))
        stem = "model"
    else:
        import diffusers

        with torch.device("meta"):
            model = getattr(diffusers, case.cls)(**case.vae_kwargs)
        model.save_config(str(folder))
        stem = "diffusion_pytorch_model"
    tensors, seen, ints = {}, set(), set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied alias: saved once, under its first key
            continue
        seen.add(id(value))
        tensors[case.saved_key(key)] = tuple(value.shape)
        if not value.dtype.is_floating_point:
            ints.add(case.saved_key(key))
    info = _write_folder(folder, tensors, stem=stem, unread=case.unread, ints=frozenset(ints))
    per_layer = [sum(math.prod(s) * 2 for k, s in tensors.items()
                     if f".layers.{i}." in k or f".block.{i}." in k) for i in range(layers)]
    info.update(params=sum(math.prod(s) for s in tensors.values()), layer_bytes=per_layer)
    print("INFO " + json.dumps(info))


# --------------------------------------------------------------------------------------------
# Exporting one stage (a child process)
# --------------------------------------------------------------------------------------------

def export(case_name: str, folder: Path, out: Path, mode: str, dtype: str, opset: int,
           encode: bool) -> None:
    import inspect

    import torch

    from qkrope import dtypes, families
    from qkrope.export.stages import pipeline
    from qkrope.export.stages.text_encoder import export_image_encoder, export_text_encoder
    from qkrope.export.stages.vae import export_vae

    case = CASES[case_name]
    tdtype = dtypes.TORCH_BY_SHORT[dtype]
    from qkrope.stages import declared_stages, stages_for

    declared = families.by_name(case.family).stages
    stages = (stages_for(declared, case.pipeline) if case.pipeline
              else declared_stages(declared)[0])
    t0 = time.perf_counter()
    if mode == "streamed":
        model = pipeline._load(case.library, case.cls, folder, tdtype)
    else:  # the component loaded whole, as the stage export did before streaming
        cls = pipeline._model_class(case.library, case.cls)
        kw = {"dtype": tdtype} if case.library == "transformers" else {"torch_dtype": tdtype}
        model = cls.from_pretrained(str(folder), local_files_only=True, **kw)
    loaded = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if case.component == "vae":
            extra = ({"encode": encode} if "encode" in inspect.signature(export_vae).parameters
                     else {})
            fields = export_vae(model, stages.vae, out, opset=opset, dtype=tdtype, **extra)
        elif case.component in stages.image_encoders:
            fields = export_image_encoder(model, stages.image_encoders[case.component], out,
                                          opset=opset, dtype=tdtype)
        else:
            stage = stages.text_encoders[case.component]
            stage = _reads_within(stage, model.config.get_text_config().num_hidden_layers)
            fields = export_text_encoder(model, stage, out, opset=opset, dtype=tdtype)
    print("INFO " + json.dumps({"load_s": loaded, "graphs": sorted(fields["graphs"]),
                                "files": {k: v["size"] for k, v in fields["files"].items()}}))


def _reads_within(stage, layers: int):
    """``stage`` with each hidden-state read past an N-layer folder's last layer read at its
    last (``hidden_states[N]``): a folder of N < 31 layers of Mistral3 has no hidden_states[30]
    (nor one of N < 27 layers of Qwen3 klein's hidden_states[27]);
    the memory is that of streaming the N layers' weights, whichever layer the graph returns."""
    import dataclasses

    from qkrope.stages import hidden_index

    reads = []
    for read in stage.reads:
        k = hidden_index(read)
        if k is not None and k > layers:
            read = f"hidden_states[{layers}]"
        if read not in reads:
            reads.append(read)
    return dataclasses.replace(stage, reads=tuple(reads))


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------

def _measured(argv: list[str]) -> tuple[int, float, float, str]:
    """Run ``argv`` in a child: (exit status, its own peak RSS in MiB, wall s, output tail)."""
    from qkrope.apps.measure import run_peak_rss

    with tempfile.TemporaryFile("w+") as log:
        run = run_peak_rss(argv, stdout=log, stderr=subprocess.STDOUT)
        log.seek(0)
        tail = log.read()[-6000:]
    return run.returncode, run.peak_mib, run.wall_s, tail


def _info(tail: str) -> dict:
    return json.loads(next(ln for ln in reversed(tail.splitlines())
                           if ln.startswith("INFO "))[5:])


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def measure(case_name: str, counts: list[int | None], args, work: Path) -> int:
    case = CASES[case_name]
    me = str(Path(__file__).resolve())
    rows = []
    print(f"\n### {case_name} ({case.library}.{case.cls}, {case.family}'s {case.component}; "
          f"{args.mode}, {args.dtype}, opset {args.opset}"
          f"{', with the encoder' if args.encode and case.component == 'vae' else ''})")
    print("| layers | weights (shards) | in the N layers | largest tensor | peak RSS "
          "| wall time | written |")
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        folder, out = work / f"{case_name}-{n}", work / f"{case_name}-{n}-onnx"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        try:
            rc, _, build_s, tail = _measured([sys.executable, me, "build", case_name,
                                              str(n or 0), str(folder)])
            if rc:
                print(tail, file=sys.stderr)
                return 2
            info = _info(tail)
            rc, peak, wall, tail = _measured([
                sys.executable, me, "export", case_name, str(folder), str(out), args.mode,
                args.dtype, str(args.opset), "1" if args.encode else "0"])
            if rc:
                print(f"{case_name} export (N={n}) failed (exit {rc}):", file=sys.stderr)
                print(tail, file=sys.stderr)
                return 2
            done = _info(tail)
            written = sum(done["files"].values())
            extra = any(name.endswith(".data") for name in done["files"])
            rows.append((n, peak, wall))
            largest, largest_bytes = info["largest"]
            in_layers = _mib(sum(info["layer_bytes"])) if n is not None else "-"
            print(f"| {n if n is not None else '-'} | {_mib(info['bytes'])} ({info['shards']}) "
                  f"| {in_layers} | {largest} ({_mib(largest_bytes)}) "
                  f"| {peak:.0f} MiB | {wall:.0f} s | {_mib(written)} "
                  f"({', '.join(done['graphs'])}; "
                  f"{'+ external data' if extra else 'one file each'}) |", flush=True)
            print(f"<!-- built in {build_s:.0f} s ({_mib(info['written'])} of values); "
                  f"{info['params'] / 1e9:.2f} B parameters; load step {done['load_s']:.1f} s -->",
                  flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
    if len(rows) >= 2 and case.layers:
        a, b = _fit([r[0] for r in rows], [r[1] for r in rows])
        c, d = _fit([r[0] for r in rows], [r[2] for r in rows])
        print(f"fitted: peak RSS = {a:.0f} MiB + {b:.1f} MiB x layers, time = {c:.0f} s + "
              f"{d:.1f} s x layers; at {case.layers} layers (the whole encoder): "
              f"{a + b * case.layers:.0f} MiB, {(c + d * case.layers) / 60:.1f} min", flush=True)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "build":
        build(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        case, folder, out, mode, dtype, opset, encode = sys.argv[2:9]
        export(case, Path(folder), Path(out), mode, dtype, int(opset), encode == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    ap.add_argument("--layers", default="1,2,4",
                    help="the text encoders' layer counts (default 1,2,4)")
    ap.add_argument("--mode", choices=("streamed", "in-memory"), default="streamed")
    ap.add_argument("--dtype", default="bf16", help="the stages' dtype (default bf16)")
    ap.add_argument("--opset", type=int, default=22, help="the graphs' opset (default 22)")
    ap.add_argument("--encode", action="store_true",
                    help="the VAEs' encoder graphs too (an image-to-image pipeline's export)")
    ap.add_argument("--work", default=None, help="folder for the models (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the folders and exports")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}: one of {', '.join(CASES)}")
    counts = [int(v) for v in args.layers.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="qkrope_stage_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for case in cases:
            rc = measure(case, counts if CASES[case].layers else [None], args, work)
            if rc:
                return rc
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
