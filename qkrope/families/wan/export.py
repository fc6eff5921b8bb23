"""Wan's export hooks (export layer): the config check, the attention processor, the
cache-input wrapper, the sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers computes Wan's RoPE tables in float64 (``WanRotaryPosEmbed``) and patchifies the 5-D
latent with a Conv3d. Here:

- :class:`WanAttnProcessor` replaces diffusers' ``WanAttnProcessor`` on every attention. The
  self-attention (``attn1``, the only one with RoPE) runs the cross-head RMSNorm + RoPE of q and
  k as one ``qkrope.export.qk_norm_rope`` call with ``norm_scope`` 1 (one ``QKNormRoPE`` node
  per block). The cross-attention (``attn2``: q from the video, k/v from the text, RMSNorm and
  no RoPE) is left as diffusers computes it (``norm_q`` / ``norm_k`` as torch.nn.RMSNorm): its q
  and k have different token counts, so one node (q and k of one shape) cannot take them, and
  a node per tensor with identity cache rows would read a cache for nothing. Wan 2.1 I2V /
  FLF2V's image branch (``add_k_proj`` / ``norm_added_k`` / ``add_v_proj``: the same q
  attending to the CLIP image tokens, added to the text attention's result) is computed as
  diffusers computes it, the image tokens split off the joined context by their count (the
  graph input's), where diffusers counts the text as 512 tokens (the same split at the
  pipelines' 512; the drop-in refuses another text length with the image).
- :class:`WanCacheInputTransformer` replays ``WanTransformer3DModel.forward`` with the graph
  inputs (:data:`qkrope.families.wan.WAN_TRANSFORMER`): the patches packed as tokens (the
  Conv3d run on each patch: the same products as on the volume), the image cache in place of
  the RoPE module, the packed prediction out (the drop-in unpatchifies). ``--layers K`` runs
  the first K blocks and then the model's own head (final norm and projection).
- :class:`WanVACECacheInputTransformer` (Wan-VACE) also takes the control latent's patches and
  the hints' scales: its control blocks (one fused node each) run before the main blocks, and
  each scaled hint is added to the video tokens after its VACE layer.

diffusers is imported lazily (it is optional).
"""

from __future__ import annotations

from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
import torch
from torch import nn

from qkrope import contract, model_io
from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.finalize import check_no_double
from qkrope.export.conv import patch_conv
from qkrope.export.ops import qk_norm_rope

from . import (I2V_IMAGE_TOKENS, I2V_TEXT_TOKENS, RECORDS, SKIP_FRAMES, WAN, WAN_I2V_TRANSFORMER,
               control_layers, derivative, graph_of, wan_axes)


def _sdpa(q, k, v, head_dim: int) -> torch.Tensor:
    """softmax attention over [B, S, H, D] inputs; returns [B, S, H * D] in q's dtype."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, head_dim)
    return out.transpose(1, 2).flatten(2, 3).type_as(q)


class WanAttnProcessor:
    """Replaces diffusers' ``WanAttnProcessor``: ``rotary_emb`` is the image cache
    ``[rows, head_dim]`` (self-attention, fused) or None (cross-attention, as diffusers; with
    Wan 2.1 I2V's image branch, the embedded image tokens ``image`` attended through
    ``add_k_proj`` / ``norm_added_k`` / ``add_v_proj`` and the result added to the text's;
    diffusers joins them before the text and splits them off again in each attention: the
    wrapper splits them once, before the blocks, the same views, so that no block computes a
    slice the next one reads)."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}
        #: the embedded CLIP image tokens the cross-attention reads (I2V; set by the wrapper
        #: for one call)
        self.image = None

    def attributes(self, eps: float) -> contract.NodeAttributes:
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, True, self.rounding,
                                                            contract.NORM_SCOPE_ROW)
        return self._attributes[eps]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if attention_mask is not None:
            raise InputError("the Wan export takes no attention_mask (Wan attends to every "
                             "token)")
        if getattr(attn, "fused_projections", False):
            raise InputError("the Wan attention has fused QKV projections (fuse_qkv_"
                             "projections()); export the model before fusing them")
        heads = attn.heads
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        image = self.image if encoder_hidden_states is not None else None
        if attn.add_k_proj is not None and encoder_hidden_states is not None and image is None:
            raise InputError("the Wan attention has the I2V image branch (added_kv_proj_dim) "
                             "but the call gives no image tokens")
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = q.shape[-1] // heads
        if rotary_emb is not None:  # attn1: cross-head RMSNorm + RoPE, one node
            q, k = (t.unflatten(2, (heads, -1)) for t in (q, k))
            q, k = qk_norm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, rotary_emb,
                                **self.attributes(float(attn.norm_q.eps)).as_kwargs())
        else:  # attn2: diffusers' RMSNorm, no RoPE (module docstring)
            q, k = (t.unflatten(2, (heads, -1)) for t in (attn.norm_q(q), attn.norm_k(k)))
        v = v.unflatten(2, (heads, -1))
        out = _sdpa(q, k, v, head_dim)
        if image is not None:  # the image branch: its own k (RMSNorm'd) and v, added
            k_img = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (heads, -1))
            v_img = attn.add_v_proj(image).unflatten(2, (heads, -1))
            out = out + _sdpa(q, k_img, v_img, head_dim)
        return attn.to_out[1](attn.to_out[0](out))


def patch_wan(transformer: nn.Module, *, rounding: int) -> nn.Module:
    """Give every attention of a Wan transformer the processor above (in place)."""
    processor = WanAttnProcessor(rounding)
    for block in list(transformer.blocks) + list(getattr(transformer, "vace_blocks", ())):
        block.attn1.set_processor(processor)
        block.attn2.set_processor(processor)
    if not len(transformer.blocks):
        raise InputError("the Wan model has no transformer blocks")
    return transformer


class WanCacheInputTransformer(nn.Module):
    """``WanTransformer3DModel`` with the graph's inputs and output (module docstring):
    ``forward(hidden_states [B, N, C * pt * ph * pw], encoder_hidden_states [B, T, text_dim],
    timestep [B] float32, img_cos_sin_cache [R, head_dim] fp32[, encoder_hidden_states_image
    [B, I, image_dim]]) -> [B, N, pt * ph * pw * out_channels]``, running the first ``kept``
    blocks (every block by default). Wan 2.1 I2V / FLF2V's image tokens are embedded and
    joined before the text as diffusers does, and split off again for the cross-attentions'
    image branch (the processor's ``image``)."""

    def __init__(self, transformer: nn.Module, *, rounding: int = WAN.rounding,
                 kept: int | None = None, record=WAN):
        super().__init__()
        self.rounding = rounding
        patch_wan(transformer, rounding=rounding)
        if derivative(record).time_sincos64:  # SkyReels-V2: no float64 in the graph
            embedder = transformer.condition_embedder
            embedder.timesteps_proj = SinCos64(embedder.timesteps_proj.num_channels)
        self.transformer = transformer
        self.kept = len(transformer.blocks) if kept is None else int(kept)
        # SkyReels-V2's blocks take the self-attention's mask after the RoPE (None: no
        # num_frame_per_block, which the config check asks)
        import inspect

        params = inspect.signature(type(transformer.blocks[0]).forward).parameters \
            if len(transformer.blocks) else {}
        self._block_extra = (None,) if "attention_mask" in params else ()

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                encoder_hidden_states_image=None):
        t = self.transformer
        cfg = t.config
        batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
        patch = tuple(int(p) for p in cfg.patch_size)
        x = hidden_states.reshape(batch * tokens, int(cfg.in_channels), *patch)
        # [B*N, inner, 1, 1, 1]; a bf16 export convolves in float32 (export/conv.py)
        x = patch_conv(t.patch_embedding, x).reshape(batch, tokens, -1)
        temb, timestep_proj, context, _ = t.condition_embedder(timestep, encoder_hidden_states,
                                                               None)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        processor = t.blocks[0].attn2.processor
        processor.image = None
        if encoder_hidden_states_image is not None:  # I2V / FLF2V: joined before the text
            image = image_embedding(t.condition_embedder.image_embedder,
                                    encoder_hidden_states_image)
            context = torch.cat([image, context], dim=1)
            if t.blocks[0].attn2.add_k_proj is not None:  # the image branch: split off again
                n = encoder_hidden_states_image.shape[1]  # (diffusers: before 512 text tokens)
                processor.image, context = context[:, :n], context[:, n:]
        try:
            x = self._blocks(x, context, timestep_proj, img_cos_sin_cache)
        finally:
            processor.image = None
        return self._head(x, temb)

    def _blocks(self, x, context, timestep_proj, cache, hints=None):
        """The first ``kept`` main blocks; ``hints``: block index -> what is added to the video
        tokens after it (Wan-VACE's scaled control hints; a block --layers skips passes the
        tokens through, and its hint is still added, as in the check's reference)."""
        for i, block in enumerate(self.transformer.blocks):
            if i < self.kept:
                x = block(x, context, timestep_proj, cache, *self._block_extra)
            if hints is not None and i in hints:
                x = x + hints[i]
        return x

    def _head(self, x, temb):
        t = self.transformer
        shift, scale = (t.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (t.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return t.proj_out(x)


class WanVACECacheInputTransformer(WanCacheInputTransformer):
    """``WanVACETransformer3DModel`` with the graph's inputs (:data:`qkrope.families.wan.
    WAN_VACE_TRANSFORMER`): Wan's, and the control latent's patches ``control_hidden_states``
    [B, N, vace_in_channels * pt * ph * pw] (on the latent's grid) with the hints' scales
    ``control_hidden_states_scale`` [len(vace_layers)] float32. The control patches go through
    the model's ``vace_patch_embedding`` (the Conv3d on each patch, as for the latent), every
    control block runs (a fused node each) on them, the video tokens after the patch embedding
    and the text, and hint j times scale j (in the model's dtype, as the pipeline passes it) is
    added after the j-th VACE layer in ascending order, as diffusers' forward does."""

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                control_hidden_states, control_hidden_states_scale):
        t = self.transformer
        cfg = t.config
        batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
        patch = tuple(int(p) for p in cfg.patch_size)
        x = patch_conv(t.patch_embedding, hidden_states.reshape(batch * tokens,
                                                                int(cfg.in_channels), *patch))
        x = x.reshape(batch, tokens, -1)
        c = patch_conv(t.vace_patch_embedding, control_hidden_states.reshape(
            batch * tokens, int(cfg.vace_in_channels), *patch)).reshape(batch, tokens, -1)
        temb, timestep_proj, context, _ = t.condition_embedder(timestep, encoder_hidden_states,
                                                               None)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        scales = control_hidden_states_scale.to(x.dtype)
        hints = {}
        for j, (layer, block) in enumerate(zip(control_layers(cfg), t.vace_blocks)):
            hint, c = block(x, context, c, timestep_proj, img_cos_sin_cache)
            hints[layer] = hint * scales[j]
        return self._head(self._blocks(x, context, timestep_proj, img_cos_sin_cache, hints),
                          temb)


class SinCos64(nn.Module):
    """SkyReels-V2's timestep embedding (diffusers' ``get_1d_sincos_pos_embed_from_grid`` with
    ``flip_sin_to_cos``: [cos, sin] of ``t * omega_i``, ``omega_i = 10000 ** (-i / half)``, in
    float64, then float32) in float32 arithmetic only, within a few float32 ulps of it: each
    ``omega_i`` is a float32 ``hi`` plus the float32 rest ``lo``; the angle is ``p = fl(t *
    hi)`` plus its error ``e`` (Dekker's exact product: ``t`` and ``hi`` split into 12-bit
    halves) plus ``t * lo``, and ``sin(p + r) = sin p + r cos p`` (|r| is at most an ulp of
    ``p``, so r^2 / 2 is below float32's resolution of the result)."""

    def __init__(self, num_channels: int):
        super().__init__()
        import numpy as np

        half = int(num_channels) // 2
        omega = 1.0 / 10000.0 ** (np.arange(half, dtype=np.float64) / (num_channels / 2.0))
        hi = omega.astype(np.float32)
        lo = (omega - hi.astype(np.float64)).astype(np.float32)
        self.num_channels = int(num_channels)
        self.register_buffer("hi", torch.from_numpy(hi), persistent=False)
        self.register_buffer("lo", torch.from_numpy(lo), persistent=False)
        self.register_buffer("hi_split", torch.from_numpy(np.stack(_split(hi))),
                             persistent=False)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        t = timestep.reshape(-1, 1).to(torch.float32)
        p = t * self.hi
        t1 = _split_tensor(t)
        t2 = t - t1
        h1, h2 = self.hi_split[0], self.hi_split[1]
        e = ((t1 * h1 - p) + t1 * h2 + t2 * h1) + t2 * h2
        r = e + t * self.lo
        sin, cos = torch.sin(p), torch.cos(p)
        return torch.cat([cos - r * sin, sin + r * cos], dim=1)


_SPLIT = 4097.0  # 2^12 + 1: Veltkamp's splitter of a float32 (24-bit significand)


def _split(x):
    """float32 numpy ``x`` as its high 12 bits and the rest (Veltkamp), both exact."""
    import numpy as np

    c = (np.float32(_SPLIT) * x).astype(np.float32)
    high = (c - (c - x)).astype(np.float32)
    return high, (x - high).astype(np.float32)


def _split_tensor(x: torch.Tensor) -> torch.Tensor:
    """The high 12 bits of float32 ``x`` (Veltkamp)."""
    c = x * _SPLIT
    return c - (c - x)


def image_embedding(embedder: nn.Module, image: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanImageEmbedding`` on the graph's image tokens: FLF2V's learned position
    embedding added (the input is already the two images side by side, [B, 2 * S, D]), then
    LayerNorm (fp32), the GELU MLP, LayerNorm (fp32)."""
    if embedder.pos_embed is not None:
        image = image + embedder.pos_embed
    return embedder.norm2(embedder.ff(embedder.norm1(image)))


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

#: WanTransformer3DModel's config fields this export reads sizes from: positive ints
_POSITIVE_INT_FIELDS = ("attention_head_dim", "in_channels", "num_attention_heads",
                        "num_layers", "text_dim", "freq_dim", "ffn_dim", "rope_max_seq_len")


def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The folder's config.json as WanTransformer3DModel takes it, refused in one line where the
    export cannot reproduce it: an image branch in the attention (``added_kv_proj_dim``) without
    the image embedder (``image_dim``) or of another width than the model's, a q/k norm other
    than the cross-head RMSNorm, a patch size that is not three positive ints, a head too narrow
    for the three RoPE axes, sizes that are not positive ints. Wan 2.1 I2V / FLF2V (``image_dim``
    and ``added_kv_proj_dim`` the model width; FLF2V with ``pos_embed_seq_len``) export."""
    import json

    from qkrope.export.patch_diffusers import check_fits_in_memory, itemsize, read_config

    path, cfg = read_config(directory, model_class)
    fix = f"Fix: save the model again with save_pretrained, or correct {path}"
    record = next((r for r in RECORDS if r.class_name == model_class.__name__), WAN)
    facts = derivative(record)
    for key, default, why in facts.refused_config:
        if cfg.get(key, default) != default:
            raise InputError(f"{path}: {key} {json.dumps(cfg.get(key))[:60]}; the "
                             f"{record.short} export takes {json.dumps(default)} only ({why}). "
                             f"Fix: export a {record.short} model with {key} "
                             f"{json.dumps(default)}, or run this one in PyTorch")
    for key in _POSITIVE_INT_FIELDS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{path}: {key!r} must be a positive int, got {json.dumps(v)[:60]}"
                             f". {fix}")
    for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"{path}: {key!r} must be a positive int or null, got "
                             f"{json.dumps(v)[:60]}. {fix}")
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    added = cfg.get("added_kv_proj_dim")
    if added is not None and (cfg.get("image_dim") is None or added != width):
        raise InputError(f"{path}: added_kv_proj_dim {added} with image_dim "
                         f"{cfg.get('image_dim')}; the Wan 2.1 I2V image branch reads the "
                         f"embedded image tokens (image_dim set, added_kv_proj_dim the model "
                         f"width {width}), which diffusers' forward needs too. {fix}")
    if cfg.get("pos_embed_seq_len") is not None and cfg.get("image_dim") is None:
        raise InputError(f"{path}: pos_embed_seq_len {cfg['pos_embed_seq_len']} without "
                         f"image_dim (FLF2V's image position embedding has no image "
                         f"embedder). {fix}")
    if cfg.get("qk_norm") != "rms_norm_across_heads":
        raise InputError(f"{path}: qk_norm {cfg.get('qk_norm')!r}; the Wan export fuses the "
                         f"cross-head RMSNorm ('rms_norm_across_heads'), what every released Wan "
                         f"model uses. {fix}")
    patch = cfg.get("patch_size")
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3 and all(
            isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in patch)):
        raise InputError(f"{path}: patch_size must be three positive ints (t, h, w), got "
                         f"{json.dumps(patch)[:60]}. {fix}")
    head_dim = cfg["attention_head_dim"]
    if head_dim % 2 or min(wan_axes(head_dim)) < 2 or head_dim > contract.MAX_HEAD_DIM:
        raise InputError(f"{path}: attention_head_dim {head_dim} cannot be split into Wan's "
                         f"three even RoPE axes (frames, rows, columns: {wan_axes(head_dim)}) "
                         f"within the kernel's {contract.MAX_HEAD_DIM}. {fix}")
    if facts.thirds_split and head_dim // 3 != wan_axes(head_dim)[1]:
        raise InputError(f"{path}: attention_head_dim {head_dim}: {record.short} builds its "
                         f"RoPE tables with rows and columns {wan_axes(head_dim)[1]} wide but "
                         f"splits them at {head_dim // 3}, which mixes the axes' frequencies "
                         f"(only a head_dim whose third is even and equals 2 * (head_dim // "
                         f"6), e.g. 128, keeps them apart). {fix}")
    if facts.skip_frames_key is not None:
        skip = cfg.get(facts.skip_frames_key, SKIP_FRAMES)
        if isinstance(skip, bool) or skip != SKIP_FRAMES:
            raise InputError(f"{path}: {facts.skip_frames_key} {json.dumps(skip)[:60]}; the "
                             f"{record.short} export takes {SKIP_FRAMES}, every released "
                             f"model's (qkrope check's sample positions are built from the "
                             f"record, not the config). {fix}")
    if facts.control_layers_key is not None:
        _check_control(path, cfg, facts.control_layers_key, fix)
    if memory:
        dim = cfg["num_attention_heads"] * head_dim
        # each block: self- and cross-attention (8 dim^2; the image branch 2 dim^2 more) and
        # the FFN (2 dim ffn_dim)
        image = 2 if cfg.get("added_kv_proj_dim") is not None else 0
        params = cfg["num_layers"] * ((8 + image) * dim * dim + 2 * dim * cfg["ffn_dim"])
        check_fits_in_memory(f"{path} ({cfg['num_layers']} blocks of width {dim})",
                             params * itemsize(dtype), "check its sizes")
    return cfg


def _check_control(path: str, cfg: dict, key: str, fix: str) -> None:
    """Wan-VACE's control branch as the export takes it: ``key`` (vace_layers) distinct block
    indices within num_layers, 0 among them (diffusers asks both), ``vace_in_channels`` a
    positive int, no CLIP image (``image_dim``: WanVACEPipeline passes none)."""
    import json

    layers, n = cfg.get(key), cfg["num_layers"]
    if not (isinstance(layers, (list, tuple)) and layers and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers)
            and len(set(layers)) == len(layers) and 0 in layers):
        raise InputError(f"{path}: {key} {json.dumps(layers)[:60]}; the control blocks need "
                         f"distinct block indices below num_layers {n}, 0 among them. {fix}")
    v = cfg.get("vace_in_channels")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{path}: 'vace_in_channels' must be a positive int, got "
                         f"{json.dumps(v)[:60]}. {fix}")
    if cfg.get("image_dim") is not None:
        raise InputError(f"{path}: image_dim {cfg['image_dim']} with {key}; the Wan-VACE "
                         f"export takes no CLIP image tokens (WanVACEPipeline passes none). "
                         f"Fix: export a VACE model without image_dim, or run this one in "
                         f"PyTorch")


def post_export(model) -> None:
    """No float64 in the Wan graph (diffusers' RoPE is float64; the caches replace it)."""
    check_no_double(model, "the Wan graph")


def image_tokens(config) -> int:
    """The CLIP image tokens of an I2V / FLF2V export's sample: FLF2V's position embedding
    length (two images' tokens, a static axis), else Wan 2.1 I2V's 257."""
    pos = config.get("pos_embed_seq_len")
    return int(pos) if pos is not None else I2V_IMAGE_TOKENS


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype, record=WAN) -> tuple:
    """The traced sample: random packed patches and text, a float32 timestep, the image cache
    of the sample's grid (the grid scheme's float64 tables); with ``image_dim`` (I2V / FLF2V)
    random CLIP image tokens last (:func:`image_tokens` of them)."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    from .reference import position_request

    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    (f, h, w), = sample.img_shapes[:1]
    patch = tuple(int(p) for p in cfg.patch_size)
    width = int(cfg.in_channels) * patch[0] * patch[1] * patch[2]
    setting = checked_setting(record.scheme, wan_axes(int(cfg.attention_head_dim)),
                              record.theta, max_positions=int(cfg.rope_max_seq_len),
                              scale_rope=False, rotated=record.rotated,
                              precision=record.rope_precision)
    caches = build_rope_caches(record.scheme,
                               position_request(record, cfg, [(f, h, w)], sample.txt_len),
                               setting)
    b = sample.batch
    args = (torch.randn(b, f * h * w, width, generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg.text_dim), generator=g).to(dtype),
            torch.full((b,), 500.0, dtype=torch.float32),
            caches.img.clone())
    if cfg.get("image_dim") is not None:
        args += (torch.randn(b, image_tokens(cfg), int(cfg.image_dim), generator=g).to(dtype),)
    if cfg.get("vace_layers") is not None:  # Wan-VACE: the control patches and hint scales
        control = int(cfg.vace_in_channels) * patch[0] * patch[1] * patch[2]
        args += (torch.randn(b, f * h * w, control, generator=g).to(dtype),
                 0.5 + torch.rand(len(control_layers(cfg)), generator=g))
    return args


def prepare(record, transformer: nn.Module, *, sample, dtype: torch.dtype, layers: int | None,
            rounding: int):
    """The export of ``transformer`` (a placeholder skeleton) with its first ``layers`` blocks
    (every block by default): one fused node per kept block (attn1), the sidecar's axes from
    the head width. Wan 2.1 I2V / FLF2V (``image_dim``): the graph with the image tokens
    (:func:`qkrope.families.wan.graph_of`), their sample length recorded (I2V's dynamic axis),
    and, with the attention's image branch, the sample's text set to 512 tokens
    (:data:`qkrope.families.wan.I2V_TEXT_TOKENS`: the only length at which diffusers' forward,
    the check's reference, reads the image tokens as image tokens)."""
    from qkrope.export.onnx_export import TransformerPlan

    if len(sample.img_shapes) != 1:
        raise InputError(f"a Wan sample is one video grid (frames, height, width in patches); "
                         f"got {sample.img_shapes}")
    cfg = dict(transformer.config)
    decl, axis_values = graph_of(cfg), None
    if cfg.get("added_kv_proj_dim") is not None:
        sample.txt_len = I2V_TEXT_TOKENS
    if decl is WAN_I2V_TRANSFORMER:
        axis_values = {model_io.IMAGE_EMBED_TOKENS: image_tokens(cfg)}
    axes = wan_axes(int(cfg["attention_head_dim"]))
    kept, = record.kept_blocks(cfg, layers)
    control = len(getattr(transformer, "vace_blocks", ()))  # Wan-VACE's control blocks
    wrapper = (WanVACECacheInputTransformer if control else WanCacheInputTransformer)(
        transformer, rounding=rounding, kept=kept, record=record).eval()
    n = len(transformer.blocks)
    eps = float(transformer.blocks[0].attn1.norm_q.eps)
    return TransformerPlan(
        wrapper=wrapper, args=sample_args(transformer, sample, dtype, record), decl=decl,
        axis_values=axis_values,
        axes=axes, theta=record.theta, rounding=rounding, nodes=kept + control,
        num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {n} blocks"
               + (f" and {control} control blocks" if control else ""),
        attributes=wrapper.transformer.blocks[0].attn1.processor.attributes(eps))
