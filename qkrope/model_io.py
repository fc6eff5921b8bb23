"""The I/O of the models ``qkrope export`` writes, told once: the tensor names, what each one
is to the runner (its role), the named axes of each dimension, the attention block's shape
record (heads x head_dim, RoPE axes, theta); the model families a transformer export takes are in
:mod:`qkrope.families`. The exporter names its graph from here, writes each
tensor's role into the sidecar (:class:`qkrope.sidecars.TensorInfo`), and the runtime reads the
roles back; :func:`assign_roles` guesses them only for a model that has no sidecar.

Also the runtime's description of a loaded model (:class:`TensorSpec`, :class:`ModelIO`), which
the ONNX Runtime and TensorRT sides both build (:mod:`qkrope.runtime.io_specs`).

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


# --------------------------------------------------------------------------------------------
# The attention block's shape record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The attention shape and RoPE setting of one model family."""

    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]  # RoPE widths of the frame, height and width axes
    theta: int  # the RoPE base
    max_positions: int  # positions the RoPE tables hold per axis and sign

    @property
    def dim(self) -> int:
        """The model width C = heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return sum(self.axes_dims_rope)


#: The joint attention block ``qkrope export --model attention`` exports by default, and its
#: RoPE setting (the "grid" scheme): Qwen-Image's (diffusers' QwenImageTransformer2DModel and its
#: QwenEmbedRope; the qwen_image family record takes its RoPE numbers from here).
ATTENTION_BLOCK = ModelShape(heads=24, head_dim=128, axes_dims_rope=(16, 56, 56), theta=10000,
                             max_positions=4096)

# --------------------------------------------------------------------------------------------
# Axes and roles
# --------------------------------------------------------------------------------------------

BATCH, IMG_TOKENS, TXT_TOKENS = "batch", "img_tokens", "txt_tokens"
IMG_CACHE_ROWS, TXT_CACHE_ROWS = "img_cache_rows", "txt_cache_rows"
#: The axes of a 5-D latent the model patchifies itself ([batch, channels, frames, height,
#: width], qkrope.runtime.latents): latent frames, rows and columns, before patchifying.
LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH = "latent_frames", "latent_height", "latent_width"
#: A packed sequence (one attention document holding the rows of several streams: text, video
#: and audio rows scattered by index tensors): its rows, the audio rows among them, and the
#: distinct noise levels its rows are at (one timestep value each).
PACKED_ROWS, AUDIO_TOKENS, NOISE_LEVELS = "packed_rows", "audio_tokens", "noise_levels"
#: The token axes whose rows a packed sequence holds, each row once (its rows are their sum).
PACKED_FROM = (TXT_TOKENS, IMG_TOKENS, AUDIO_TOKENS)
#: The lengths of a second text stream (HunyuanVideo-1.5's ByT5 tokens) and of image
#: embeddings (its SigLIP tokens) a model joins to its text.
TXT2_TOKENS, IMAGE_EMBED_TOKENS = "txt2_tokens", "image_embed_tokens"
#: The token axes of the condition inputs a model joins to its text stream (the text cache's
#: rows cover them too; a packed sequence's audio rows: its text cache holds the text rows,
#: then the audio rows).
JOINED_TEXT_AXES = (TXT2_TOKENS, IMAGE_EMBED_TOKENS, AUDIO_TOKENS)
#: The frames of history latents a model joins before its latent (HunyuanVideo FramePack's:
#: clean frames, and the frames of its 2x and 4x downsampled history), at the latent's height
#: and width.
CLEAN_FRAMES, HISTORY_2X_FRAMES, HISTORY_4X_FRAMES = (
    "clean_frames", "history_2x_frames", "history_4x_frames")
#: The history axes: a sample of other latent sizes (a check's) keeps their export values (the
#: family's sample request lays out the history frames the export traced).
HISTORY_AXES = (CLEAN_FRAMES, HISTORY_2X_FRAMES, HISTORY_4X_FRAMES)
#: The dynamic axes of the exported models, as the exporter names them.
AXES = (BATCH, IMG_TOKENS, TXT_TOKENS, IMG_CACHE_ROWS, TXT_CACHE_ROWS, LATENT_FRAMES,
        LATENT_HEIGHT, LATENT_WIDTH, TXT2_TOKENS, IMAGE_EMBED_TOKENS) + HISTORY_AXES + (
        PACKED_ROWS, AUDIO_TOKENS, NOISE_LEVELS)
#: A cache's rows axis -> the token axis of its stream.
CACHE_ROWS_FOR = {IMG_CACHE_ROWS: IMG_TOKENS, TXT_CACHE_ROWS: TXT_TOKENS}

#: What each input is to the runner: the names of its call arguments.
ROLES = ("hidden_states", "encoder_hidden_states", "img_cache", "txt_cache",
         "encoder_hidden_states_mask", "timestep", "pooled_projections", "guidance",
         "padding_mask", "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds",
         "encoder_hidden_states_image", "control_hidden_states", "control_hidden_states_scale",
         "latents_clean", "latents_history_2x", "latents_history_4x", "target_timestep",
         "audio_hidden_states", "timestep_indices", "token_tags", "video_indices",
         "audio_indices", "text_indices")
#: What each output is.
OUTPUT_ROLES = ("img_out", "txt_out", "sample", "audio_sample")


@dataclass(frozen=True)
class TensorDecl:
    """One graph input or output of an exported model: its name, role, the axis name of each
    dimension (None: a static size, e.g. the features), and the doc string the ONNX file gets."""

    name: str
    role: str
    axes: tuple[str | None, ...]
    doc: str = ""


_CACHE_DOC = ("RoPE cache, float32, one row per token: the cos half then the sin half of the "
              "rotary dimension ([rows, rotary_dim]; build both for this model with "
              "qkrope.runtime.caches_for(model_path, img_shapes, txt_seq_len))")

HIDDEN_STATES = TensorDecl(
    "hidden_states", "hidden_states", (BATCH, IMG_TOKENS, None),
    "image tokens, [batch, img_tokens, features] (packed latent patches for the transformer)")
ENCODER_HIDDEN_STATES = TensorDecl(
    "encoder_hidden_states", "encoder_hidden_states", (BATCH, TXT_TOKENS, None),
    "text tokens (prompt embeddings), [batch, txt_tokens, features]")
ENCODER_HIDDEN_STATES_MASK = TensorDecl(
    "encoder_hidden_states_mask", "encoder_hidden_states_mask", (BATCH, TXT_TOKENS),
    "text mask, bool [batch, txt_tokens]: True = attend to that text token, False = padding")
TIMESTEP = TensorDecl(
    "timestep", "timestep", (BATCH,),
    "diffusion timestep per sample, [batch] (diffusers' timestep / 1000 scale as the pipeline "
    "passes it)")
IMG_COS_SIN_CACHE = TensorDecl(
    "img_cos_sin_cache", "img_cache", (IMG_CACHE_ROWS, None),
    _CACHE_DOC + " for the image tokens, [img_cache_rows, rotary_dim]")
TXT_COS_SIN_CACHE = TensorDecl(
    "txt_cos_sin_cache", "txt_cache", (TXT_CACHE_ROWS, None),
    _CACHE_DOC + " for the text tokens, [txt_cache_rows, rotary_dim]")
POOLED_PROJECTIONS = TensorDecl(
    "pooled_projections", "pooled_projections", (BATCH, None),
    "pooled prompt embedding (FLUX.1's CLIP projection), [batch, pooled_projection_dim]")
GUIDANCE = TensorDecl(
    "guidance", "guidance", (BATCH,),
    "distilled guidance scale per sample, [batch] (as the FLUX pipelines pass it; the model "
    "multiplies it by 1000); only in models whose config has guidance_embeds")
TARGET_TIMESTEP = TensorDecl(
    "target_timestep", "target_timestep", (BATCH,),
    "the flow timestep each denoising step jumps to, per sample, [batch] (a flow-map model's, "
    "as its step-distilled pipeline passes it)")
IMG_OUT = TensorDecl("img_out", "img_out", (BATCH, IMG_TOKENS, None))
TXT_OUT = TensorDecl("txt_out", "txt_out", (BATCH, TXT_TOKENS, None))
SAMPLE = TensorDecl("sample", "sample", (BATCH, IMG_TOKENS, None))
# A 5-D latent the model patchifies itself (qkrope.runtime.latents "video-5d"): the image
# stream's input and output under their own names (a name has one shape), with per-frame
# timesteps and the padding mask a video model concatenates as a channel.
_VIDEO_AXES = (BATCH, None, LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH)
LATENT = TensorDecl(
    "latent", "hidden_states", _VIDEO_AXES,
    "the latent, [batch, channels, latent_frames, latent_height, latent_width] (patchified "
    "by the model; a condition-mask channel concatenated where the model takes one)")
FRAME_TIMESTEP = TensorDecl(
    "frame_timestep", "timestep", (BATCH, LATENT_FRAMES),
    "diffusion timestep per sample and latent frame, [batch, latent_frames] (a pipeline's "
    "[batch] timestep repeated over the frames)")
PADDING_MASK = TensorDecl(
    "padding_mask", "padding_mask", (None, None, LATENT_HEIGHT, LATENT_WIDTH),
    "padding mask at the latent's size, [1, 1, latent_height, latent_width] (the pipeline's "
    "mask resized with nearest neighbours), concatenated to every frame as a channel")
LATENT_SAMPLE = TensorDecl("latent_sample", "sample", _VIDEO_AXES)
# The text mask under diffusers' HunyuanVideo name, and HunyuanVideo-1.5's second text stream
# (ByT5 glyph tokens), its mask and the image embeddings, which the model joins to its text.
ENCODER_ATTENTION_MASK = TensorDecl(
    "encoder_attention_mask", "encoder_hidden_states_mask", (BATCH, TXT_TOKENS),
    "text mask, int64 [batch, txt_tokens]: 1 = a real token, 0 = padding")
ENCODER_HIDDEN_STATES_2 = TensorDecl(
    "encoder_hidden_states_2", "encoder_hidden_states_2", (BATCH, TXT2_TOKENS, None),
    "second text stream (ByT5 glyph-text embeddings), [batch, txt2_tokens, features]")
ENCODER_ATTENTION_MASK_2 = TensorDecl(
    "encoder_attention_mask_2", "encoder_attention_mask_2", (BATCH, TXT2_TOKENS),
    "second text stream's mask, int64 (HunyuanVideo-1.5) or bool (HunyuanImage-2.1) [batch, "
    "txt2_tokens]: 1 / True = a real token, 0 / False = padding")
IMAGE_EMBEDS = TensorDecl(
    "image_embeds", "image_embeds", (BATCH, IMAGE_EMBED_TOKENS, None),
    "image embeddings, [batch, image_embed_tokens, features] (all zeros: text-to-video)")
#: Wan 2.1 I2V / FLF2V's CLIP image tokens, which the model joins before the text in its
#: cross-attention (their axis is a joined text axis); FLF2V's two images' tokens side by side
#: (a static axis: the model adds a learned position embedding of that length).
ENCODER_HIDDEN_STATES_IMAGE = TensorDecl(
    "encoder_hidden_states_image", "encoder_hidden_states_image",
    (BATCH, IMAGE_EMBED_TOKENS, None),
    "CLIP image embeddings (the image encoder's penultimate hidden states), [batch, "
    "image_embed_tokens, image_dim]; joined before the text in the cross-attention")
ENCODER_HIDDEN_STATES_IMAGE_PAIR = TensorDecl(
    ENCODER_HIDDEN_STATES_IMAGE.name, ENCODER_HIDDEN_STATES_IMAGE.role, (BATCH, None, None),
    "CLIP image embeddings of the first and the last frame side by side (FLF2V: diffusers' "
    "[2 * batch, tokens, image_dim] viewed as [batch, 2 * tokens, image_dim], the model's "
    "pos_embed_seq_len), joined before the text in the cross-attention")

#: A control latent (Wan-VACE's: the video to keep and its mask), packed as the latent is
#: (the model patchifies it with a patch embedding of its own, on the latent's grid: one token
#: per latent token), and the scale of each control block's hint.
CONTROL_HIDDEN_STATES = TensorDecl(
    "control_hidden_states", "control_hidden_states", (BATCH, IMG_TOKENS, None),
    "control latent patches, [batch, img_tokens, control_channels * patch volume] (packed as "
    "hidden_states, on its grid)")
CONTROL_HIDDEN_STATES_SCALE = TensorDecl(
    "control_hidden_states_scale", "control_hidden_states_scale", (None,),
    "the scale of each control block's hint, float32 [control_blocks] (the pipeline's "
    "conditioning_scale)")

#: History latents a model patchifies itself and joins before its latent's tokens (HunyuanVideo
#: FramePack's: [4x; 2x; clean; latent]), each at the latent's height and width with frames of
#: its own; each has a patch convolution of its own, so its frames and the latent's height and
#: width are whole patches of it (the pipeline pads them by repetition).
LATENTS_CLEAN = TensorDecl(
    "latents_clean", "latents_clean", (BATCH, None, CLEAN_FRAMES, LATENT_HEIGHT, LATENT_WIDTH),
    "clean history latents (the first frame and the newest history), [batch, channels, "
    "clean_frames, latent_height, latent_width]; patchified at (1, 2, 2)")
LATENTS_HISTORY_2X = TensorDecl(
    "latents_history_2x", "latents_history_2x",
    (BATCH, None, HISTORY_2X_FRAMES, LATENT_HEIGHT, LATENT_WIDTH),
    "2x history latents, [batch, channels, history_2x_frames, latent_height, latent_width]; "
    "padded by repetition to whole (2, 4, 4) patches")
LATENTS_HISTORY_4X = TensorDecl(
    "latents_history_4x", "latents_history_4x",
    (BATCH, None, HISTORY_4X_FRAMES, LATENT_HEIGHT, LATENT_WIDTH),
    "4x history latents, [batch, channels, history_4x_frames, latent_height, latent_width]; "
    "padded by repetition to whole (4, 8, 8) patches")
#: The history latents' roles, in the order of their frame axes (HISTORY_AXES). The image
#: cache holds one row per token of each at the latent's own patch (its frames x the latent's
#: token rows x columns), in the model's sequence order before the latent's rows: a model that
#: joins coarser patches of them pools their rows itself.
HISTORY_ROLES = (LATENTS_CLEAN.role, LATENTS_HISTORY_2X.role, LATENTS_HISTORY_4X.role)

#: A packed sequence's inputs (model_io.PACKED_ROWS): a second latent stream (audio rows), the
#: distinct timestep values of the sequence, per packed row its noise level (an index into
#: them) and its stream tag, and where each stream's rows sit in the sequence. Their caches
#: are the two cache inputs: the image cache for the video rows, the text cache for the text
#: rows then the audio rows (audio_tokens is a joined-text axis).
AUDIO_HIDDEN_STATES = TensorDecl(
    "audio_hidden_states", "audio_hidden_states", (BATCH, AUDIO_TOKENS, None),
    "audio latent rows, [batch, audio_tokens, audio_channels], in the order of audio_indices")
TIMESTEP_LEVELS = TensorDecl(
    "timestep_levels", "timestep", (NOISE_LEVELS,),
    "the distinct timestep values of the packed sequence, [noise_levels] (shared by the "
    "batch; every packed row names one by timestep_indices)")
TIMESTEP_INDICES = TensorDecl(
    "timestep_indices", "timestep_indices", (PACKED_ROWS,),
    "int64 [packed_rows]: per packed row, the index of its value in timestep_levels")
TOKEN_TAGS = TensorDecl(
    "token_tags", "token_tags", (PACKED_ROWS,),
    "int64 [packed_rows]: per packed row, its stream tag (the model's modulation row)")
VIDEO_INDICES = TensorDecl(
    "video_indices", "video_indices", (IMG_TOKENS,),
    "int64 [img_tokens]: the packed row of each row of hidden_states")
AUDIO_INDICES = TensorDecl(
    "audio_indices", "audio_indices", (AUDIO_TOKENS,),
    "int64 [audio_tokens]: the packed row of each row of audio_hidden_states")
TEXT_INDICES = TensorDecl(
    "text_indices", "text_indices", (TXT_TOKENS,),
    "int64 [txt_tokens]: the packed row of each row of encoder_hidden_states")
AUDIO_SAMPLE = TensorDecl("audio_sample", "audio_sample", (BATCH, AUDIO_TOKENS, None))
#: The packed-sequence inputs a runner call passes by role (beside the latent, text, timestep
#: and caches).
PACKED_ROLES = (AUDIO_HIDDEN_STATES.role, TIMESTEP_INDICES.role, TOKEN_TAGS.role,
                VIDEO_INDICES.role, AUDIO_INDICES.role, TEXT_INDICES.role)

#: The two cache inputs, image first.
CACHE_INPUTS = (IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE)


@dataclass(frozen=True)
class ModelDecl:
    """The graph inputs and outputs of one exported model kind, in graph order."""

    kind: str
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


ATTENTION = ModelDecl("attention",
                      (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK,
                       IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                      (IMG_OUT, TXT_OUT))
TRANSFORMER = ModelDecl("transformer",
                        (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK,
                         TIMESTEP, IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                        (SAMPLE,))
MODELS = {m.kind: m for m in (ATTENTION, TRANSFORMER)}
#: Every tensor any exported model may have, by name (the families' graphs, in
#: qkrope/families/<family>/__init__.py, are made of these).
TENSORS = {t.name: t for t in (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK,
                               TIMESTEP, POOLED_PROJECTIONS, GUIDANCE, IMG_COS_SIN_CACHE,
                               TXT_COS_SIN_CACHE, IMG_OUT, TXT_OUT, SAMPLE, LATENT,
                               FRAME_TIMESTEP, PADDING_MASK, LATENT_SAMPLE,
                               ENCODER_ATTENTION_MASK, ENCODER_HIDDEN_STATES_2,
                               ENCODER_ATTENTION_MASK_2, IMAGE_EMBEDS,
                               ENCODER_HIDDEN_STATES_IMAGE, CONTROL_HIDDEN_STATES,
                               CONTROL_HIDDEN_STATES_SCALE, LATENTS_CLEAN, LATENTS_HISTORY_2X,
                               LATENTS_HISTORY_4X, TARGET_TIMESTEP, AUDIO_HIDDEN_STATES,
                               TIMESTEP_LEVELS, TIMESTEP_INDICES, TOKEN_TAGS, VIDEO_INDICES,
                               AUDIO_INDICES, TEXT_INDICES, AUDIO_SAMPLE)}

def role_of(name: str) -> str | None:
    """The role of a tensor the exporter names ``name`` (None for another name)."""
    decl = TENSORS.get(name)
    return decl.role if decl is not None else None


# --------------------------------------------------------------------------------------------
# What a loaded model accepts (built by qkrope.runtime.io_specs for an ONNX file or an engine)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``dims[i] = (lo, hi)``; ``hi`` None = unbounded; static dims
    have lo == hi. ``axes[i]`` names a dynamic dimension shared between tensors (or None)."""

    name: str
    dtype: str
    dims: tuple[tuple[int, int | None], ...]
    axes: tuple[str | None, ...]

    @property
    def rank(self) -> int:
        return len(self.dims)

    def describe(self) -> str:
        parts = []
        for (lo, hi), ax in zip(self.dims, self.axes):
            if lo == hi:
                parts.append(str(lo))
            else:
                rng = f"{lo}..{hi if hi is not None else ''}"
                parts.append(f"{ax}={rng}" if ax else rng)
        return f"[{', '.join(parts)}] {self.dtype}"


@dataclass
class ModelIO:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    head_dim: int | None
    roles: dict[str, str] = field(default_factory=dict)  # role -> input name
    source: str = ""
    # the exporter's model config (a qkrope.sidecars.ModelConfig, empty without a sidecar; the
    # readers in qkrope.runtime.io_specs always set it)
    config: Any = None
    # True when the dims' (lo, hi) bounds come from a TensorRT optimisation profile (a range the
    # engine was built for), False for an ONNX model (any size >= 1)
    profile_bounds: bool = False

    def input(self, name: str) -> TensorSpec:
        return next(s for s in self.inputs if s.name == name)


def spec_from_shape(name: str, dtype: str, shape: Sequence, *,
                    bounds: tuple[Sequence[int], Sequence[int]] | None = None) -> TensorSpec:
    """A TensorSpec from a sidecar/ONNX shape (ints, axis names, -1/None) and optional profile
    (min, max) shapes."""
    from qkrope import dtypes

    dims, axes = [], []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d >= 0:
            dims.append((d, d))
            axes.append(None)
        else:
            lo, hi = 1, None
            if bounds is not None:
                lo, hi = int(bounds[0][i]), int(bounds[1][i])
            dims.append((lo, hi))
            axes.append(d if isinstance(d, str) else None)
    return TensorSpec(name, dtypes.canonical(dtype, source="name"), tuple(dims), tuple(axes))


def _has(name: str, *words: str) -> bool:
    return any(w in name for w in words)


def assign_roles(specs: Sequence[TensorSpec]) -> dict[str, str]:
    """Guess the runner's arguments' model input names, for a model without a sidecar that
    records them: by exact names first, then by axis names (``img_cache_rows`` /
    ``txt_cache_rows``), then by name patterns."""
    exact = {t.name for t in TENSORS.values() if t.role == t.name}
    roles: dict[str, str] = {}
    for s in specs:
        low = s.name.lower()
        if low in exact and low in ROLES:
            roles[low] = s.name
    for s in specs:
        low = s.name.lower()
        if s.name in roles.values():
            continue
        first_axis = s.axes[0] if s.axes else None
        if first_axis == IMG_CACHE_ROWS or (
                _has(low, "img", "image") and _has(low, "cache", "rope", "rotary", "cos_sin")):
            roles.setdefault(IMG_COS_SIN_CACHE.role, s.name)
        elif first_axis == TXT_CACHE_ROWS or (
                _has(low, "txt", "text") and _has(low, "cache", "rope", "rotary", "cos_sin")):
            roles.setdefault(TXT_COS_SIN_CACHE.role, s.name)
        elif "mask" in low:
            roles.setdefault(ENCODER_HIDDEN_STATES_MASK.role, s.name)
        elif "timestep" in low:
            roles.setdefault(TIMESTEP.role, s.name)
    return roles
