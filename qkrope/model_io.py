"""The I/O of the models ``qkrope export`` writes, told once: the tensor names, what each one
is to the runner (its role), the named axes of each dimension, the Qwen-Image shape record
(heads x head_dim, RoPE axes, theta) and the model families a transformer export takes
(Qwen-Image, FLUX.1, FLUX.2: :data:`FAMILIES`). The exporter names its graph from here, writes each
tensor's role into the sidecar (:class:`qkrope.sidecars.TensorInfo`), and the runtime reads the
roles back; :func:`assign_roles` guesses them only for a model that has no sidecar.

Also the runtime's description of a loaded model (:class:`TensorSpec`, :class:`ModelIO`), which
the ONNX Runtime and TensorRT sides both build (:mod:`qkrope.runtime.io_specs`).

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from qkrope import contract

# --------------------------------------------------------------------------------------------
# The Qwen-Image shape record
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


#: Qwen-Image (diffusers' QwenImageTransformer2DModel and its QwenEmbedRope). The Triton rope
#: model's numpy module (runtime/rope_tables.py) keeps its own copy of the RoPE numbers, since it
#: runs inside a server without qkrope; a test keeps that copy equal to this one.
QWEN_IMAGE = ModelShape(heads=24, head_dim=128, axes_dims_rope=(16, 56, 56), theta=10000,
                        max_positions=4096)

# --------------------------------------------------------------------------------------------
# Axes and roles
# --------------------------------------------------------------------------------------------

BATCH, IMG_TOKENS, TXT_TOKENS = "batch", "img_tokens", "txt_tokens"
IMG_CACHE_ROWS, TXT_CACHE_ROWS = "img_cache_rows", "txt_cache_rows"
#: The dynamic axes of both models, as the exporter names them.
AXES = (BATCH, IMG_TOKENS, TXT_TOKENS, IMG_CACHE_ROWS, TXT_CACHE_ROWS)
#: A cache's rows axis -> the token axis of its stream.
CACHE_ROWS_FOR = {IMG_CACHE_ROWS: IMG_TOKENS, TXT_CACHE_ROWS: TXT_TOKENS}

#: What each input is to the runner: the names of its call arguments.
ROLES = ("hidden_states", "encoder_hidden_states", "img_cache", "txt_cache",
         "encoder_hidden_states_mask", "timestep", "pooled_projections", "guidance")
#: What each output is.
OUTPUT_ROLES = ("img_out", "txt_out", "sample")


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
IMG_OUT = TensorDecl("img_out", "img_out", (BATCH, IMG_TOKENS, None))
TXT_OUT = TensorDecl("txt_out", "txt_out", (BATCH, TXT_TOKENS, None))
SAMPLE = TensorDecl("sample", "sample", (BATCH, IMG_TOKENS, None))

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
#: The FLUX transformers' graphs (kind "transformer" too): FLUX's inputs with the two caches in
#: place of txt_ids/img_ids and no mask; ``guidance`` only where the config has guidance_embeds
#: (:meth:`ModelFamily.decl`).
FLUX1_TRANSFORMER = ModelDecl("transformer",
                              (HIDDEN_STATES, ENCODER_HIDDEN_STATES, POOLED_PROJECTIONS, TIMESTEP,
                               GUIDANCE, IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                              (SAMPLE,))
FLUX2_TRANSFORMER = ModelDecl("transformer",
                              (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP, GUIDANCE,
                               IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                              (SAMPLE,))
#: Every tensor of any model by name.
TENSORS = {t.name: t for m in (ATTENTION, TRANSFORMER, FLUX1_TRANSFORMER, FLUX2_TRANSFORMER)
           for t in m.inputs + m.outputs}


# --------------------------------------------------------------------------------------------
# The model families `qkrope export --model transformer` takes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFamily:
    """One diffusers transformer class qkrope exports: what ``config.json``'s ``_class_name``
    names, its RoPE (theta where the config does not hold it; the axes are always in the
    config's ``axes_dims_rope``), the node rounding it is exported with, and its graph."""

    name: str  # the sidecar's config.family
    class_name: str  # diffusers' class (config.json "_class_name")
    label: str  # what a user calls it, with the checkpoints it covers
    theta: int  # the RoPE base diffusers builds the model with by default
    theta_key: str | None  # the config key that overrides theta (None: fixed in diffusers' code)
    rounding: int  # the QKNormRoPE rounding attribute its export uses
    graph: ModelDecl  # its transformer graph, guidance included where it has one

    def decl(self, guidance: bool) -> ModelDecl:
        """The transformer graph of a model with (or without) guidance embeddings."""
        if guidance or GUIDANCE not in self.graph.inputs:
            return self.graph
        return ModelDecl(self.graph.kind, tuple(t for t in self.graph.inputs if t != GUIDANCE),
                         self.graph.outputs)

    def rope_theta(self, config: Any) -> int:
        """The RoPE base of a model with this diffusers ``config``."""
        value = config.get(self.theta_key) if self.theta_key else None
        return int(self.theta if value is None else value)


QWEN_IMAGE_FAMILY = ModelFamily(
    "qwen-image", "QwenImageTransformer2DModel", "Qwen-Image (and Qwen-Image-Edit)",
    QWEN_IMAGE.theta, None, 0, TRANSFORMER)
# FLUX's eager order (torch's RMSNorm rounds x*inv*w once, diffusers rotates in fp32 and rounds
# again): bit-exact with the stock model in bf16/fp16 (qkrope.contract.ROUNDING_FLUX)
_FLUX_ROUNDING = contract.ROUNDING_FLUX
FLUX1 = ModelFamily(
    "flux1", "FluxTransformer2DModel", "FLUX.1 (dev, schnell, Kontext)",
    10000, None, _FLUX_ROUNDING, FLUX1_TRANSFORMER)  # diffusers fixes FluxPosEmbed(theta=10000)
FLUX2 = ModelFamily(
    "flux2", "Flux2Transformer2DModel", "FLUX.2 (dev, klein)",
    2000, "rope_theta", _FLUX_ROUNDING, FLUX2_TRANSFORMER)
#: Every family by its diffusers class name.
FAMILIES = {f.class_name: f for f in (QWEN_IMAGE_FAMILY, FLUX1, FLUX2)}
#: ... and by the name the sidecar records.
FAMILY_NAMES = {f.name: f for f in FAMILIES.values()}


def family_of(config: Any, *, source: str = "the diffusers config") -> ModelFamily:
    """The family a diffusers ``config`` (config.json as a mapping) belongs to, from its
    ``_class_name``; an InputError listing the families otherwise."""
    from qkrope.errors import InputError

    name = config.get("_class_name") if hasattr(config, "get") else None
    family = FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        known = "; ".join(f"{f.class_name} ({f.label})" for f in FAMILIES.values())
        raise InputError(f"{source} has _class_name {name!r}, which qkrope does not export. "
                         f"Fix: give the folder of one of {known}")
    return family


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
