"""A VAE component to ONNX (qkrope.stages.VaeStage), its decoder, and its encoder where the
family's pipeline encodes images:

- ``image`` (a 2-D autoencoder): one graph each way: ``decode``, latents ``[B, C, H, W]`` to
  the sample, as ``vae.decode(z).sample``; ``encode``, the sample to the latent distribution's
  parameters (``moments``: mean and log-variance on the channel axis), as
  ``vae.encode(x).latent_dist.parameters``.
- ``causal-video`` (Wan's ``AutoencoderKLWan`` and the autoencoders built as it is, Qwen-Image's
  among them): diffusers runs such a VAE chunk by chunk, one latent frame a chunk to decode,
  the first frame then four frames a chunk to encode, each causal convolution reading a cache
  of the frames before it (``feat_cache``). The export makes that cache graph inputs and
  outputs, as the RoPE caches are for the transformer: ``decode`` (``encode``) takes the first
  chunk and returns its output and the cache; ``decode_next`` (``encode_next``) takes a chunk
  and the cache and returns the next output and cache. Each slot of the cache has one fixed
  form, the frames it holds after any later chunk (two for a causal convolution of temporal
  kernel 3, one for a temporal downsampler): diffusers' one-frame entries after the first
  chunk are the same two-frame entry with a zero frame before it (the causal convolution pads
  with zeros what the cache lacks), and the ``"Rep"`` marker of a temporal upsampler is a zero
  cache of its input's shape (its first next-chunk call pads with zeros exactly so). So every
  next-chunk call has the same input shapes, the graph is one, and memory does not grow with
  the number of frames; coding a video is the first graph once and the next graph once per
  later chunk, in diffusers' order of operations (docs/spec.md section 7b).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.stages import DROPIN_CLASSES, TENSORS_FILE, VaeStage

from ._onnx import file_facts, trace
from .text_encoder import widened

#: the traced latent sample: batch, height and width (distinct sizes above 1: dynamic axes)
SAMPLE_BATCH, SAMPLE_HEIGHT, SAMPLE_WIDTH = 2, 6, 10
#: the frames a causal encoder takes per chunk after the first (diffusers' slicing)
ENCODE_CHUNK = 4


class _ImageCoder(nn.Module):
    """The 2-D autoencoder's decode (latents to sample) or encode (sample to the latent
    distribution's parameters, mean and log-variance on the channel axis)."""

    def __init__(self, vae: nn.Module, dtype: torch.dtype, *, decoder: bool):
        super().__init__()
        self.vae, self.dtype, self.decoder = vae, dtype, decoder

    def forward(self, x: torch.Tensor):
        if self.decoder:
            return widened((self.vae.decode(x, return_dict=False)[0],), self.dtype)
        return widened((self.vae.encode(x).latent_dist.parameters,), self.dtype)


def _slots(vae: nn.Module, decoder: bool) -> int:
    vae.clear_cache()
    return len(vae._feat_map if decoder else vae._enc_feat_map)


def _module_function(vae: nn.Module, name: str):
    """The VAE module's own ``patchify`` / ``unpatchify`` where its config patchifies (Wan
    2.2's 5B VAE)."""
    if not vae.config.get("patch_size"):
        return None
    return getattr(sys.modules[type(vae).__module__], name)


class _CausalCoder(nn.Module):
    """One chunk through the causal decoder (one latent frame) or encoder (the first frame,
    then four frames a chunk, as diffusers slices a video) with the feature cache (module
    docstring). ``first``: the first chunk's graph, which starts from an empty cache and
    returns it in the fixed form; ``frames``: each used slot's frames in that form (what the
    slot holds after a later chunk)."""

    def __init__(self, vae: nn.Module, dtype: torch.dtype, *, decoder: bool, first: bool):
        super().__init__()
        self.vae, self.dtype, self.decoder, self.first = vae, dtype, decoder, first
        self.slots = _slots(vae, decoder)
        self.coder = vae.decoder if decoder else vae.encoder
        self.takes_first = decoder and \
            "first_chunk" in inspect.signature(self.coder.forward).parameters
        self.reshape = _module_function(vae, "unpatchify" if decoder else "patchify")
        self.used: list[int] = []  # the slots the coder fills, in order
        self.frames: list[int] = []  # their frames in the fixed form

    def run(self, x: torch.Tensor, cache: list):
        """The chunk as diffusers runs it; ``cache`` (diffusers' list) is updated in place.
        Returns the output and the inputs of the temporal upsamplers by slot."""
        if self.decoder:
            x = self.vae.post_quant_conv(x)
        elif self.reshape is not None:
            x = self.reshape(x, patch_size=self.vae.config.patch_size)
        upsample_inputs: dict[int, torch.Tensor] = {}
        hooks = []
        for m in self.coder.modules():
            if getattr(m, "mode", None) == "upsample3d" and hasattr(m, "time_conv"):
                def pre(m, args, kwargs):
                    bound = inspect.signature(m.forward).bind(*args, **kwargs).arguments
                    upsample_inputs[bound["feat_idx"][0]] = bound["x"]
                hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        extra = {"first_chunk": self.first} if self.takes_first else {}
        try:
            out = self.coder(x, feat_cache=cache, feat_idx=[0], **extra)
        finally:
            for h in hooks:
                h.remove()
        if self.decoder:
            if self.reshape is not None:
                out = self.reshape(out, patch_size=self.vae.config.patch_size)
            out = torch.clamp(out, min=-1.0, max=1.0)
        else:
            out = self.vae.quant_conv(out)  # one frame to one frame: per chunk as on the whole
        return out, upsample_inputs

    def forward(self, x: torch.Tensor, *cache: torch.Tensor):
        if self.first:
            feat: list[Any] = [None] * self.slots
            out, upsample_inputs = self.run(x, feat)
            slots = []
            for i, frames in zip(self.used, self.frames):
                c = feat[i]
                if isinstance(c, str):  # "Rep": a temporal upsampler's zero cache
                    c = torch.zeros_like(upsample_inputs[i][:, :, :1])
                    c = c.repeat(1, 1, frames, 1, 1)
                elif c.shape[2] < frames:  # the zero frames the convolution pads with
                    c = torch.cat([torch.zeros_like(c[:, :, :1]).repeat(
                        1, 1, frames - c.shape[2], 1, 1), c], 2)
                slots.append(c)
            return widened((out, *slots), self.dtype)
        feat = [None] * self.slots
        for i, c in zip(self.used, cache):
            feat[i] = c
        out, _ = self.run(x, feat)
        return widened((out, *(feat[i] for i in self.used)), self.dtype)


def _causal_pair(vae, dtype, decoder: bool, first_sample: torch.Tensor,
                 next_sample: torch.Tensor):
    """The first-chunk and next-chunk modules, with the used slots and their frames learnt from
    one eager first chunk and one eager next chunk on the samples."""
    first = _CausalCoder(vae, dtype, decoder=decoder, first=True)
    step = _CausalCoder(vae, dtype, decoder=decoder, first=False)
    with torch.no_grad():
        feat: list[Any] = [None] * first.slots
        first.run(first_sample, feat)
        used = [i for i, c in enumerate(feat) if c is not None]
        step.run(next_sample, feat)  # "Rep" and one-frame entries take their lasting form
    frames = [int(feat[i].shape[2]) for i in used]
    for m in (first, step):
        m.used, m.frames = used, frames
    return first, step


def _export_causal(vae, dtype, decoder: bool, folder: Path, opset: int) -> tuple[dict, list]:
    """The causal coder's two graphs: ``decode``/``decode_next`` or ``encode``/``encode_next``."""
    auto = torch.export.Dim.AUTO
    g = torch.Generator().manual_seed(0)
    if decoder:
        shape = (SAMPLE_BATCH, int(vae.config.z_dim), 1, SAMPLE_HEIGHT, SAMPLE_WIDTH)
        x0 = torch.randn(shape, generator=g).to(dtype)
        x1 = torch.randn(shape, generator=g).to(dtype)
        name, chunk = "decode", 1
    else:
        scale = int(vae.spatial_compression_ratio if hasattr(vae, "spatial_compression_ratio")
                    else 2 ** len(vae.temperal_downsample))
        side = (SAMPLE_BATCH, int(vae.config.get("in_channels", 3)))
        hw = (SAMPLE_HEIGHT * scale, SAMPLE_WIDTH * scale)
        x0 = torch.randn(*side, 1, *hw, generator=g).to(dtype)
        x1 = torch.randn(*side, ENCODE_CHUNK, *hw, generator=g).to(dtype)
        name, chunk = "encode", ENCODE_CHUNK
    first, step = _causal_pair(vae, dtype, decoder, x0, x1)
    with torch.no_grad():
        _, *cache = first(x0)
    cache = [c.to(dtype) for c in cache]
    inputs = [f"cache_{i}" for i in range(len(cache))]  # outputs: <name>_out
    outs = [f"{n}_out" for n in inputs]
    x_name, y_name = ("latents", "sample") if decoder else ("sample", "moments")
    spatial = {0: auto, 3: auto, 4: auto}
    files = trace(first, (x0,), input_names=[x_name], output_names=[y_name, *outs],
                  dynamic={"x": spatial}, opset=opset, out=folder / f"{name}.onnx")
    files += trace(step, (x1, *cache), input_names=[x_name, *inputs],
                   output_names=[y_name, *outs],
                   dynamic={"x": spatial, "cache": tuple(spatial for _ in cache)},
                   opset=opset, out=folder / f"{name}_next.onnx")
    graphs = {name: {"file": f"{name}.onnx", "inputs": [x_name], "outputs": [y_name, *outs],
                     "frames": 1},
              f"{name}_next": {"file": f"{name}_next.onnx", "inputs": [x_name, *inputs],
                               "outputs": [y_name, *outs], "frames": chunk}}
    return graphs, files


def export_vae(vae: nn.Module, stage: VaeStage, folder: Path, *, opset: int,
               dtype: torch.dtype, encode: bool = False) -> dict[str, Any]:
    """Export ``vae``'s decoder, and its encoder where ``encode`` (the pipeline is one of
    ``stage.encode``), in ``dtype`` and eval mode, into ``folder``; returns the stage record's
    fields."""
    vae = vae.eval()
    auto = torch.export.Dim.AUTO
    g = torch.Generator().manual_seed(0)
    files: list[Path] = []
    graphs: dict[str, Any] = {}
    if stage.layout == "image":
        channels = int(vae.config.latent_channels)
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        z = torch.randn(SAMPLE_BATCH, channels, SAMPLE_HEIGHT, SAMPLE_WIDTH, generator=g)
        files += trace(_ImageCoder(vae, dtype, decoder=True), (z.to(dtype),),
                       input_names=["latents"], output_names=["sample"],
                       dynamic={"x": {0: auto, 2: auto, 3: auto}}, opset=opset,
                       out=folder / "decode.onnx")
        graphs["decode"] = {"file": "decode.onnx", "inputs": ["latents"], "outputs": ["sample"]}
        if encode:
            x = torch.randn(SAMPLE_BATCH, int(vae.config.in_channels), SAMPLE_HEIGHT * scale,
                            SAMPLE_WIDTH * scale, generator=g)
            files += trace(_ImageCoder(vae, dtype, decoder=False), (x.to(dtype),),
                           input_names=["sample"], output_names=["moments"],
                           dynamic={"x": {0: auto, 2: auto, 3: auto}}, opset=opset,
                           out=folder / "encode.onnx")
            graphs["encode"] = {"file": "encode.onnx", "inputs": ["sample"],
                                "outputs": ["moments"]}
    else:
        for decoder in (True, False) if encode else (True,):
            more, written = _export_causal(vae, dtype, decoder, folder, opset)
            graphs.update(more)
            files += written
    fields: dict[str, Any] = {}
    if stage.tensors:
        files.append(save_tensors(vae, stage.tensors, folder / TENSORS_FILE))
        fields["tensors"] = list(stage.tensors)
    return {"class": DROPIN_CLASSES["vae"], "layout": stage.layout, "encode": encode,
            "graphs": graphs, **fields, "files": file_facts(files)}


def save_tensors(vae: nn.Module, keys: tuple[str, ...], out: Path) -> Path:
    """The state-dict tensors ``keys`` of ``vae`` (read from its checkpoint, in the export
    dtype, for a streamed skeleton) saved to ``out`` with safetensors; one line for a key the
    module does not have."""
    from safetensors.torch import save_file

    from .streamed import attached

    state = vae.state_dict()
    missing = [k for k in keys if k not in state]
    if missing:
        raise InputError(f"{type(vae).__name__} has no tensor {missing[0]!r}, which its family's "
                         f"pipeline reads off the VAE. Fix: pass the VAE folder its pipeline was "
                         f"saved with")
    weights = attached(vae)
    if weights is not None:  # a streamed skeleton: each value from the checkpoint, or refused
        unread = [k for k in keys if k not in weights.source]
        if unread:
            raise InputError(f"{weights.where} has no tensor {unread[0]!r}, which its "
                             f"family's pipeline reads off the VAE (from_pretrained would "
                             f"leave its initial value). Fix: pass the VAE folder its pipeline "
                             f"was saved with")
        values = {k: weights.source.tensor(k) for k in keys}
    else:
        values = {k: state[k] for k in keys}
    values = {k: v.detach().clone().contiguous() for k, v in values.items()}
    save_file(values, str(out))
    return out
