"""The traced sample: its sizes (:class:`Sample`, checked: torch.export fixes an axis whose
sample size is 0 or 1), the seeded sample inputs with their RoPE caches, and what the sidecar
records of them (``sample``, the dynamic axes' export values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from qkrope import model_io
from qkrope.errors import InputError

from .patch_diffusers import check_fits_in_memory as _check_fits_in_memory, itemsize as _itemsize

DEFAULT_ATTENTION_SAMPLE = dict(img_shapes=[(1, 16, 16)], txt_len=32, batch=2)
DEFAULT_TRANSFORMER_SAMPLE = dict(img_shapes=[(1, 8, 8)], txt_len=16, batch=2)

@dataclass
class Sample:
    img_shapes: list[tuple[int, int, int]]
    txt_len: int
    batch: int

    @property
    def img_tokens(self) -> int:
        return sum(f * h * w for f, h, w in self.img_shapes)


def _sample(img_shapes, txt_len, batch, defaults) -> Sample:
    shapes = [tuple(int(v) for v in s) for s in (img_shapes or defaults["img_shapes"])]
    txt_len = int(txt_len if txt_len is not None else defaults["txt_len"])
    batch = int(batch if batch is not None else defaults["batch"])
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise InputError(f"--img-shape takes three positive integers F H W (latent patches); "
                             f"got {s}")
    if batch < 1:
        raise InputError(f"--batch must be >= 1; got {batch}")
    if txt_len < 2:
        raise InputError(f"--txt-len must be >= 2 for tracing (torch.export fixes axes whose "
                         f"sample size is 0 or 1); got {txt_len}")
    sample = Sample(shapes, txt_len, max(batch, 2))
    if sample.img_tokens < 2:
        raise InputError(f"the sample image must have >= 2 tokens for tracing; got {shapes}")
    return sample


def one_image(sample: Sample, short: str) -> tuple[int, int]:
    """The ``(height, width)`` in tokens of a family whose sample is one image grid (``(1, h,
    w)``); anything else is refused naming ``short``."""
    if len(sample.img_shapes) != 1 or int(sample.img_shapes[0][0]) != 1:
        raise InputError(f"a {short} sample is one image grid (1, height, width in patches); "
                         f"got {sample.img_shapes}")
    _, h, w = (int(v) for v in sample.img_shapes[0])
    return h, w


def check_layers(layers: int | None, total: int, what: str) -> None:
    """``--layers`` within 1..``total`` (``what``: the config key or blocks it counts)."""
    if layers is not None and not 1 <= layers <= total:
        raise InputError(f"--layers must be between 1 and {total} (the model's {what}); got "
                         f"{layers}. Fix: pass --layers 1 to {total}")


def one_grid(sample: Sample, short: str) -> tuple[int, int, int]:
    """The latent grid ``(frames, height, width)`` in tokens of a family whose sample is one
    grid (a video latent: ``short`` names the family in the refusals). torch.export fixes an axis
    traced at size 1, so a one-frame grid (an image) is traced with two frames (the sample is
    updated: the frames axis stays dynamic), and a grid narrower than 2 tokens is refused."""
    if len(sample.img_shapes) != 1:
        raise InputError(f"a {short} sample is one latent grid (frames, height, width in "
                         f"tokens); got {len(sample.img_shapes)}: {sample.img_shapes}")
    f, h, w = (int(v) for v in sample.img_shapes[0])
    if min(h, w) < 2:
        raise InputError(f"--img-shape {f} {h} {w}: a {short} export traces a latent of at "
                         f"least 2 tokens per axis (torch.export fixes an axis of size 1). "
                         f"Fix: pass --img-shape 2 8 8 or larger")
    sample.img_shapes = [(max(f, 2), h, w)]
    return sample.img_shapes[0]


#: torch.Generator.manual_seed takes seeds below 2**64; the sample generator is seeded seed + 1
MAX_SEED = 2**63 - 1


def _sample_args(sample: Sample, dtype: torch.dtype, feat_img: int, feat_txt: int,
                 axes_dim: Sequence[int], with_timestep: bool, seed: int, *, record=None):
    """The traced sample's inputs in graph order (hidden states, text, mask, the timestep with
    ``with_timestep``, the two caches), seeded by ``seed``. The caches are the "grid" scheme's
    (image shapes and a text length) for ``axes_dim`` and the RoPE base and position limit of
    ``record`` (a family record; None: the attention block's,
    :data:`qkrope.model_io.ATTENTION_BLOCK`)."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    _check_fits_in_memory(
        f"the export sample (batch {sample.batch}, {sample.img_tokens} image and "
        f"{sample.txt_len} text tokens)",
        sample.batch * (sample.img_tokens * feat_img + sample.txt_len * feat_txt)
        * _itemsize(dtype) * 4,  # the inputs, and the activations the trace keeps of them
        "give smaller --batch / --img-shape / --txt-len")

    g = torch.Generator().manual_seed(seed + 1)
    rope = record if record is not None else model_io.ATTENTION_BLOCK
    setting = checked_setting("grid", tuple(axes_dim), rope.theta,
                              max_positions=rope.max_positions)
    caches = build_rope_caches("grid", {"img_shapes": sample.img_shapes,
                                        "txt_seq_len": sample.txt_len}, setting)
    hs = torch.randn(sample.batch, sample.img_tokens, feat_img, generator=g).to(dtype)
    ehs = torch.randn(sample.batch, sample.txt_len, feat_txt, generator=g).to(dtype)
    mask = torch.ones(sample.batch, sample.txt_len, dtype=torch.bool)
    mask[-1, -1] = False
    args = [hs, ehs, mask]
    if with_timestep:
        args.append(torch.full((sample.batch,), 0.5, dtype=dtype))
    args += [caches.img.clone(), caches.txt.clone()]
    return tuple(args)

def _sample_dict(sample: Sample) -> dict:
    return {"img_shapes": [list(s) for s in sample.img_shapes], "txt_len": sample.txt_len,
            "batch": sample.batch}


def _axis_values(sample: Sample) -> dict[str, int]:
    return {model_io.BATCH: sample.batch, model_io.IMG_TOKENS: sample.img_tokens,
            model_io.TXT_TOKENS: sample.txt_len, model_io.IMG_CACHE_ROWS: sample.img_tokens,
            model_io.TXT_CACHE_ROWS: sample.txt_len}
