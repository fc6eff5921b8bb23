"""Make a diffusers ``QwenImageTransformer2DModel`` exportable: RoPE as two 2-D cache inputs.

diffusers' Qwen-Image RoPE is complex-valued (``QwenEmbedRope`` returns complex frequencies and
``apply_rotary_emb_qwen`` multiplies complex tensors), which neither torch.onnx exporter can
translate. Here:

- :class:`QKNormRoPEAttnProcessor` replaces ``QwenDoubleStreamAttnProcessor2_0`` on every joint
  attention (through diffusers' ``set_attn_processor``): it takes ``image_rotary_emb`` as the
  ``(img_cache, txt_cache)`` pair and runs per-head RMSNorm + RoPE as one
  ``qkrope.export.qk_norm_rope`` call per stream (one ``QKNormRoPE`` ONNX node per stream).
- :class:`CacheInputTransformer` wraps the model with a ``forward`` whose inputs are the graph
  inputs (``hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
  img_cos_sin_cache, txt_cos_sin_cache``); ``pos_embed`` (the complex RoPE) is never called, so it
  is not in the graph. It replicates ``QwenImageTransformer2DModel.forward`` for the standard
  Qwen-Image configuration (no ``zero_cond_t``, no additional t-cond, no layer-3D RoPE, no
  controlnet residuals).

diffusers is imported lazily (it is optional).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope.errors import InputError, InputFileNotFoundError
from qkrope._deps import require

from qkrope import contract
from .attention import joint_attention


class QKNormRoPEAttnProcessor:
    """Drop-in for diffusers' ``QwenDoubleStreamAttnProcessor2_0`` taking 2-D RoPE caches."""

    def __init__(self, *, interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING):
        self.interleaved = contract.check_interleaved(interleaved)
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}  # per module eps

    def attributes(self, eps: float) -> contract.NodeAttributes:
        """The node values for an attention module whose RMSNorm epsilon is ``eps``."""
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, self.interleaved, self.rounding)
        return self._attributes[eps]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None:
            raise InputError("QKNormRoPEAttnProcessor requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise InputError("QKNormRoPEAttnProcessor takes encoder_hidden_states_mask, not an "
                             "external attention_mask")
        if image_rotary_emb is None:
            raise InputError("QKNormRoPEAttnProcessor needs image_rotary_emb=(img_cache, "
                             "txt_cache); build them with qkrope.runtime.build_qwen_rope_caches")
        img_cache, txt_cache = image_rotary_emb
        return joint_attention(attn, hidden_states, encoder_hidden_states, img_cache, txt_cache,
                               encoder_hidden_states_mask, head_dim=attn.inner_dim // attn.heads,
                               attributes=self.attributes(float(attn.norm_q.eps)))


def check_supported(transformer: nn.Module) -> None:
    """Raise ValueError for configurations CacheInputTransformer does not reproduce."""
    cfg = transformer.config
    for key in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        if cfg.get(key, False):
            raise InputError(f"the diffusers config sets {key}=True, which qkrope's transformer "
                             f"export does not support yet (standard Qwen-Image only)")
    head_dim = cfg["attention_head_dim"]
    if sum(cfg["axes_dims_rope"]) > head_dim:
        raise InputError(f"axes_dims_rope {tuple(cfg['axes_dims_rope'])} sums to more than "
                         f"attention_head_dim={head_dim}")


def patch_transformer(transformer: nn.Module, *,
                      interleaved: bool = contract.DEFAULT_INTERLEAVED,
                      rounding: int = contract.DEFAULT_ROUNDING) -> nn.Module:
    """Swap every joint attention processor for :class:`QKNormRoPEAttnProcessor` (in place)."""
    require("diffusers", "exporting a diffusers transformer")
    check_supported(transformer)
    transformer.set_attn_processor(QKNormRoPEAttnProcessor(interleaved=interleaved,
                                                           rounding=rounding))
    return transformer


class CacheInputTransformer(nn.Module):
    """``QwenImageTransformer2DModel`` with the RoPE caches as inputs (see module docstring).

    ``forward(hidden_states [B, S_img, in_channels], encoder_hidden_states [B, S_txt,
    joint_attention_dim], encoder_hidden_states_mask [B, S_txt] bool, timestep [B],
    img_cos_sin_cache [R_img, rd] fp32, txt_cos_sin_cache [R_txt, rd] fp32) -> sample``.
    ``num_layers`` keeps the first N blocks (all by default).
    """

    def __init__(self, transformer: nn.Module, num_layers: int | None = None, *,
                 interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING):
        super().__init__()
        patch_transformer(transformer, interleaved=interleaved, rounding=rounding)
        total = len(transformer.transformer_blocks)
        if num_layers is not None and not 1 <= num_layers <= total:
            raise InputError(f"--layers must be between 1 and {total} (the model's num_layers); "
                             f"got {num_layers}")
        self.num_layers = total if num_layers is None else num_layers
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        hidden_states = t.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        encoder_hidden_states = t.txt_in(t.txt_norm(encoder_hidden_states))
        mask = encoder_hidden_states_mask.to(torch.bool)
        temb = t.time_text_embed(timestep, hidden_states)
        rope = (img_cos_sin_cache, txt_cos_sin_cache)
        for block in t.transformer_blocks[:self.num_layers]:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rope)
        hidden_states = t.norm_out(hidden_states, temb)
        return t.proj_out(hidden_states)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def _physical_memory() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_memory(what: str, nbytes: int, fix: str) -> None:
    """An InputError when ``what`` needs more bytes than this machine has (torch would fail
    with an overflow, a MemoryError or the OOM killer instead); ``fix``: what to give instead."""
    memory = _physical_memory()
    if memory is not None and nbytes > memory:
        raise InputError(f"{what} needs {nbytes / 2**30:.3g} GiB, more than this machine's "
                         f"{memory / 2**30:.3g} GiB of memory. Fix: {fix}")


#: QwenImageTransformer2DModel's config fields qkrope reads sizes from: positive ints, the
#: output channels may be null (= in_channels)
_POSITIVE_INT_FIELDS = ("attention_head_dim", "in_channels", "joint_attention_dim",
                        "num_attention_heads", "num_layers", "patch_size")
_BOOL_FIELDS = ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope", "zero_cond_t")


def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True) -> dict:
    """The folder's ``config.json`` as ``model_class`` would take it (its defaults for what it
    omits), refused in one line before diffusers builds anything when it is not a JSON object,
    a size is not a positive int, a flag not a bool, ``axes_dims_rope`` not three positive even
    ints summing to ``attention_head_dim`` (diffusers asserts it), or the weights would not fit
    in this machine's memory (``memory``; the streamed export, which never holds them, passes
    False). Qwen-Image's fields; FLUX's config is left to diffusers' own checks."""
    import inspect
    import json
    import os

    path = os.path.join(directory, "config.json")
    fix = (f"Fix: save the model again with save_pretrained, or correct {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path} is not readable JSON ({type(exc).__name__}). {fix}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path} holds a JSON {type(raw).__name__}, not the object of a "
                         f"model's config. {fix}")
    defaults = {name: p.default for name, p in
                inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    cfg = {**defaults, **raw}

    def bad(key: str, want: str):
        value = json.dumps(cfg[key]) if not isinstance(cfg[key], tuple) else str(cfg[key])
        raise InputError(f"{path}: {key!r} must be {want}, got {value[:60]}. {fix}")

    for key in _POSITIVE_INT_FIELDS:
        v = cfg.get(key)
        if key in cfg and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            bad(key, "a positive int")
    v = cfg.get("out_channels")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        bad("out_channels", "a positive int or null")
    for key in _BOOL_FIELDS:
        if key in cfg and not isinstance(cfg[key], bool):
            bad(key, "true or false")
    axes = cfg.get("axes_dims_rope")
    if "axes_dims_rope" in cfg:
        if not (isinstance(axes, (list, tuple)) and len(axes) == 3 and all(
                isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % 2 == 0
                for a in axes)):
            bad("axes_dims_rope", "three positive even ints")
        head_dim = cfg.get("attention_head_dim")
        if isinstance(head_dim, int) and sum(axes) != head_dim:
            bad("axes_dims_rope", f"three widths summing to attention_head_dim {head_dim}")
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
    layers = cfg.get("num_layers")
    sizes = [cfg.get(k) for k in ("num_attention_heads", "attention_head_dim", "num_layers",
                                  "in_channels", "joint_attention_dim", "patch_size")]
    if memory and all(isinstance(v, int) for v in sizes):
        heads, head_dim, layers, in_ch, txt_dim, patch = sizes
        dim = heads * head_dim
        out_ch = cfg.get("out_channels") or in_ch
        # each block: attention (Q, K, V, out of both streams) and two 4x MLPs: ~24 dim^2; the
        # input projections and the output projection (patch x patch x out_channels wide)
        params = layers * 24 * dim * dim + dim * (in_ch + txt_dim + patch * patch * out_ch)
        check_fits_in_memory(f"{path} ({layers} blocks of width {dim})",
                             params * itemsize(dtype), "check its sizes (num_layers, "
                             "num_attention_heads, attention_head_dim, the channels)")
    return cfg


def model_folder(directory: str) -> str:
    """The folder of a saved diffusers transformer: ``directory``, or its ``transformer/``
    subfolder (a pipeline folder); an InputFileNotFoundError otherwise."""
    import os

    if not directory or not os.path.isdir(directory):
        raise InputFileNotFoundError(
            f"--diffusers {directory!r} is not a directory: give the local folder of a saved "
            f"diffusers transformer (the one with config.json and the weights; for a "
            f"pipeline folder, its transformer/ subfolder). Nothing is downloaded.")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        sub = os.path.join(directory, "transformer")
        if os.path.isfile(os.path.join(sub, "config.json")):
            return sub
        raise InputFileNotFoundError(f"--diffusers {directory!r} has no config.json (nor a "
                                     f"transformer/config.json): not a saved diffusers model")
    return directory


def folder_family(directory: str):
    """The model family (:data:`qkrope.model_io.FAMILIES`) of a saved diffusers transformer,
    from its config.json's ``_class_name``; any other class is refused with the list."""
    import json
    import os

    from qkrope import model_io

    path = os.path.join(model_folder(directory), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InputError(f"--diffusers {directory!r}: cannot read {path} ({exc}). Fix: give "
                         f"the folder of a saved diffusers transformer") from None
    if not isinstance(config, dict):
        raise InputError(f"--diffusers {directory!r}: {path} holds a JSON "
                         f"{type(config).__name__}, not the object of a model's config. Fix: "
                         f"save the model again with save_pretrained, or correct {path}")
    return model_io.family_of(config, source=f"--diffusers {path}")


def _checked_folder(directory: str, quant: str | None, variant: str | None):
    """``(folder, family)``: the folder with config.json (``directory`` or its
    ``transformer/``), its family, its weight files (one file, or every shard its index names
    and no other) and quantizer state checked."""
    from qkrope.diffusers_weights import weight_files
    from qkrope.quantization import check_folder

    family = folder_family(directory)
    directory = model_folder(directory)
    weight_files(directory, variant=variant)  # a missing or extra shard: said before loading
    check_folder(directory, quant)  # before loading: diffusers would drop quantizer tensors
    return directory, family


def load_transformer(directory: str, *, dtype: torch.dtype = torch.float32,
                     quant: str | None = None, variant: str | None = None) -> nn.Module:
    """``<class>.from_pretrained(directory, variant=variant)`` for the diffusers class its
    config.json names (a family of :data:`qkrope.model_io.FAMILIES`: Qwen-Image, FLUX.1,
    FLUX.2), local files only; the weight files (one file, or every shard its index names and
    no other) are checked first (:func:`qkrope.diffusers_weights.weight_files`).

    A folder carrying ModelOpt quantizer state is refused unless ``quant`` says how to export it
    (:func:`qkrope.quantization.check_folder`); with ``quant="fp8"`` the quantizers are restored
    with ModelOpt (:func:`qkrope.export.quantize.restore_quantized`)."""
    diffusers = require("diffusers", "exporting a diffusers transformer (--model transformer)")
    directory, family = _checked_folder(directory, quant, variant)
    if family.class_name == "QwenImageTransformer2DModel":
        check_config(directory, diffusers.QwenImageTransformer2DModel, dtype)
    # diffusers advises installing `accelerate` on every load; that is not an error here.
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    from qkrope.diffusers_weights import ShardChangedError, unchanged_while_read, weight_files

    try:
        with unchanged_while_read(weight_files(directory, variant=variant)[0]):  # not re-saved
            model = getattr(diffusers, family.class_name).from_pretrained(
                directory, torch_dtype=dtype, local_files_only=True, variant=variant)
    except ShardChangedError:
        raise
    except (RuntimeError, ValueError, TypeError, AssertionError, OSError) as exc:
        # weights of other shapes than the config says (size mismatch), a config diffusers
        # refuses: the folder's own inconsistency, said in one line
        text = " ".join(str(exc).split())
        raise InputError(f"--diffusers {directory} cannot be loaded as its config.json "
                         f"describes it ({type(exc).__name__}: "
                         f"{text[:200] + '...' if len(text) > 200 else text}). Fix: save the "
                         f"model again with save_pretrained") from None
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    if quant is not None:
        from .quantize import restore_quantized

        model = restore_quantized(model, directory)
    return model.eval()


def skeleton_transformer(directory: str, *, dtype: torch.dtype = torch.float32,
                         quant: str | None = None, variant: str | None = None):
    """What the streamed export traces and writes: ``(transformer, weights)``, the
    diffusers transformer of ``directory``'s config.json (its family's class) with placeholder
    parameters
    (:func:`qkrope.export.streaming.placeholder_module`; nothing of the weights in memory) and
    the :class:`~qkrope.export.streaming.DiskWeights` of its state dict, every key checked
    against the shards' headers. The folder checks are :func:`load_transformer`'s; with
    ``quant="fp8"`` the quantizers are restored (their calibrated amax read, nothing else)."""
    from qkrope.diffusers_weights import tensor_headers
    from qkrope.quantization import QUANTIZER_MARK

    from .streaming import DiskWeights, SizeError, check_config_sizes, placeholder_module

    diffusers = require("diffusers", "exporting a diffusers transformer (--model transformer)")
    directory, family = _checked_folder(directory, quant, variant)
    cls = getattr(diffusers, family.class_name)
    if family.class_name == "QwenImageTransformer2DModel":
        check_config(directory, cls, dtype, memory=False)  # the weights stay on disk
    headers = tensor_headers(directory, variant=variant)  # sizes from the files, first
    source = f"--diffusers {directory}"
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        config = cls.load_config(directory, local_files_only=True)
        check_config_sizes(config, headers, source=source)
        model = placeholder_module(lambda: cls.from_config(config), dtype=dtype,
                                   keep_in_fp32=cls._keep_in_fp32_modules or (),
                                   within=headers, source=source)
    except SizeError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, AssertionError) as exc:
        # sizes torch cannot allocate even as placeholders, a config diffusers refuses
        text = " ".join(str(exc).split()).split(" Exception raised from")[0]
        raise InputError(f"--diffusers {directory}: the model its config.json describes cannot "
                         f"be built ({type(exc).__name__}: "
                         f"{text[:160] + '...' if len(text) > 160 else text}). Fix: check its "
                         f"sizes (num_layers, num_attention_heads, attention_head_dim, the "
                         f"channels), or save the model again with save_pretrained") from None
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    if quant is not None:
        from .quantize import restore_quantized

        model = restore_quantized(model, directory, headers=headers)
    weights = DiskWeights.for_module(model, headers, source=f"--diffusers {directory}",
                                     skip=lambda key: QUANTIZER_MARK in key)
    return model.eval(), weights
