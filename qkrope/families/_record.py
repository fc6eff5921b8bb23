"""The record of one model family: the facts qkrope knows about a diffusers transformer class
(no torch, nothing heavy). Each family folder (``qkrope/families/<package>/__init__.py``) holds
its records in ``RECORDS``; the registry (:mod:`qkrope.families`) collects them. Generic code asks
a record, never a family by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from qkrope.model_io import GUIDANCE, ModelDecl

#: The position schemes (qkrope.runtime.schemes): "grid" builds the RoPE caches from image grid
#: shapes and a text length, "ids" from per-token position ids, "table" from per-token integer
#: ids into per-axis RoPE tables (diffusers' RopeEmbedder), "patch-grid" from the token grid of
#: one latent the model patchifies (float32 angles, the text not rotated), "scaled_grid" from a
#: video's token grid with a base per axis and frame positions scaled to a frame rate,
#: "divided_grid" from a video's token grid with per-call angle divisors and a 1-D text,
#: "ids-float32" from per-token position ids as "ids" does, in float32 arithmetic.
#: The runtime's registry (qkrope.runtime.schemes.SCHEMES) holds the same names, one module
#: each (tests/test_family_contract.py holds the two equal: this list stays torch-free).
SCHEMES = ("grid", "ids", "table", "patch-grid", "scaled_grid", "divided_grid", "ids-float32")
#: The latent layouts a family's transformer takes: "packed-tokens" = [batch, tokens, features]
#: (the pipeline packs the latent patches); "video-5d" = [batch, channels, frames, height,
#: width], patchified by the model (qkrope.runtime.latents).
LATENT_KINDS = ("packed-tokens", "video-5d")


#: What a block returns, stream by stream: "img" (the image tokens, diffusers' hidden_states),
#: "txt" (the text tokens, encoder_hidden_states) or "joined" (one stream of the text and image
#: tokens, in the order the model joins them: text then image, or image then text; the check
#: compares it in that layout on both sides). The per-block check names its rows after them
#: (qkrope.apps.check_blocks).
BLOCK_STREAMS = ("img", "txt", "joined")
#: The argument of a block's forward each returned stream is the running value of (a block
#: skipped by --layers passes it through unchanged).
STREAM_ARGUMENT = {"img": "hidden_states", "txt": "encoder_hidden_states",
                   "joined": "hidden_states"}


class BlockList(NamedTuple):
    """One list of a transformer's blocks: the module path that holds it (an attribute, or a
    dotted path into a ModuleDict such as FLUX.3's ``mode_blocks.image``), the config key of
    its length, and what each of its blocks returns (stream names, in return order: a pair such
    as FLUX's ``(encoder_hidden_states, hidden_states)`` is ``("txt", "img")``; one tensor is
    a one-name tuple); and whether the model's output layer reads its blocks' outputs
    (``feeds_output``: False for a list whose outputs only later lists read, e.g. text blocks
    that only the image blocks' cross-attention reads; a graph cut inside it holds none of its
    blocks)."""

    attr: str
    key: str
    returns: tuple[str, ...] = ("txt", "img")
    feeds_output: bool = True


#: The block lists of a transformer with double-stream blocks, then single-stream ones that
#: return the pair too (FLUX.1; in execution order): a FamilyRecord's ``block_lists``.
DOUBLE_THEN_SINGLE_BLOCKS = (BlockList("transformer_blocks", "num_layers"),
                             BlockList("single_transformer_blocks", "num_single_layers"))
#: The same with single-stream blocks that return the joined stream (FLUX.2, Chroma).
DOUBLE_THEN_JOINED_BLOCKS = (BlockList("transformer_blocks", "num_layers"),
                             BlockList("single_transformer_blocks", "num_single_layers",
                                       ("joined",)))


@dataclass(frozen=True)
class Launch:
    """One shape of the fused node a family's export launches at its usual sizes: what the
    kernel report (qkrope.apps.kernel_report) plans with the real launcher on each modelled
    device, checks against its static targets, and what the kernel tests run the head layout of.
    ``model`` and ``stream`` name it in the report ("FLUX.2 dev", "image 4096"); ``seq`` is the
    tokens per batch item of one launch; ``roundings`` the node rounding modes it is planned
    with (the family's export default first)."""

    model: str
    stream: str
    seq: int
    heads: int
    head_dim: int = 128
    rotary_dim: int | None = None  # None: the full head
    interleaved: bool = True  # RoPE pairing: interleaved pairs (True) or NeoX halves (False)
    batches: tuple[int, ...] = (1, 2)
    roundings: tuple[int, ...] = (0,)
    # What one RMSNorm spans (qkrope.contract NORM_SCOPE_*): 0 each head, weight [head_dim];
    # 1 the token's heads * head_dim values (Wan), weight [heads * head_dim].
    norm_scope: int = 0

    def __post_init__(self) -> None:
        if self.seq < 1 or self.heads < 1 or self.head_dim < 2 or not self.batches \
                or not self.roundings or self.norm_scope not in (0, 1):
            raise ValueError(f"{self.model} {self.stream}: a launch needs seq, heads, head_dim, "
                             f"batches, roundings and a norm_scope of 0 or 1; got {self}")

    @property
    def rotary(self) -> int:
        """The rotated width (the cache width)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


@dataclass(frozen=True)
class FamilyRecord:
    """One diffusers transformer class qkrope exports: what ``config.json``'s ``_class_name``
    names, what a user calls it, its RoPE (scheme, axes and theta by default; the axes are
    always in the config's ``axes_dims_rope`` where it holds them), the node rounding it is
    exported with, its graph, its FP8 default exclusions and whether ``--layers`` /
    ``--blocks`` apply to it."""

    name: str  # the sidecar's config.family (never changes: old sidecars name it)
    class_name: str  # diffusers' class (config.json "_class_name")
    label: str  # what a user calls it, with the checkpoints it covers
    short: str  # its name in messages ("FLUX.1")
    package: str  # the folder its hooks live in (qkrope.families.<package>)
    scheme: str  # the position scheme (SCHEMES)
    axes: tuple[int, ...]  # the RoPE width of each axis diffusers builds it with by default
    theta: int  # the RoPE base diffusers builds the model with by default
    theta_key: str | None  # the config key that overrides theta (None: fixed in diffusers' code)
    max_positions: int | None  # positions per axis the RoPE tables hold (None: no table)
    rounding: int  # the QKNormRoPE rounding attribute its export uses
    graph: ModelDecl  # its transformer graph, guidance included where it has one
    fp8_excluded: tuple[str, ...]  # top-level modules FP8 keeps in high precision by default
    blocks: bool  # whether --layers (export, check) and --blocks (check) apply
    # pixels per image token side: the VAE's spatial downscale times the patch size (8 x 2 for
    # every family so far); --resolutions presets are multiples of it
    pixels_per_token: int = 16
    # the token streams the model rotates ("img", "txt"); one normalised but not rotated gets
    # identity cache rows (qkrope.runtime.schemes.Setting.rotated)
    rotated: tuple[str, ...] = ("img", "txt")
    latent: str = "packed-tokens"  # LATENT_KINDS
    # top-level modules FP8 also keeps in high precision where a config flag builds them (the
    # default --exclude of a loaded model adds those it has: qkrope.quantization.default_excluded)
    fp8_excluded_where_built: tuple[str, ...] = ()
    # grid scheme: height / width positions centred on the image (Qwen-Image) or counted from 0
    # (a video latent's own grid: HunyuanVideo)
    blocks_key: str = "num_layers"  # the config key of its transformer_blocks count
    # its block lists in execution order (BlockList: module attribute, config count key, what a
    # block returns): what the check's reference streams one block at a time
    # (qkrope.apps.check_blocks) and --layers K counts through. None: one list,
    # transformer_blocks of blocks_key, where ``blocks``, else none listed (the reference loaded
    # whole).
    block_lists: tuple[BlockList, ...] | None = None
    # the grid scheme's numbers: centred height / width (scale_rope) and the tables' precision
    # (qkrope.runtime.schemes.Setting.precision: "float32" or "float64")
    scale_rope: bool = True
    rope_precision: str = "float32"
    # the config key that overrides max_positions (None: fixed in diffusers' code)
    max_positions_key: str | None = None
    # a function of the family's record module (no torch) whose call on the diffusers config
    # gives the RoPE Setting's family-specific fields (per-axis bases, table size, ...)
    rope_rule: str | None = None
    # the node launches of its export at its usual sizes (the kernel report and kernel tests)
    launches: tuple[Launch, ...] = ()
    # the dtype ("bf16", "fp16") the model rounds its rotated q/k to in every export dtype (None:
    # the export's own dtype); the check's tolerance is then that of the coarser of the two
    # (qkrope.apps.check.tolerances)
    qk_round_dtype: str | None = None
    # a dual-stream clone's differences (qkrope.families._dual_stream.DualStream): a hook kind
    # its folder has no module for is the shared dual-stream one (SHARED_HOOKS there), so a
    # FLUX-like class is its record and its tiny builder
    dual_stream: Any = None
    # the pipeline's text encoders and VAE as its pipelines read them (qkrope.stages.
    # PipelineStages, or a tuple of them where pipeline classes read the same components
    # otherwise: qkrope.stages.stages_for picks by class): what `qkrope export --model
    # pipeline` exports beside the transformer (None: not yet declared; that export is refused
    # for the family in one line)
    stages: Any = None

    def __post_init__(self) -> None:
        if self.qk_round_dtype not in (None, "bf16", "fp16"):
            raise ValueError(f"{self.name}: qk_round_dtype {self.qk_round_dtype!r} is not None, "
                             f"'bf16' or 'fp16'")
        if self.scheme not in SCHEMES:
            raise ValueError(f"{self.name}: scheme {self.scheme!r} is not one of {SCHEMES}")
        if self.latent not in LATENT_KINDS:
            raise ValueError(f"{self.name}: latent {self.latent!r} is not one of {LATENT_KINDS}")
        if self.block_lists is None:
            object.__setattr__(self, "block_lists",
                               (BlockList("transformer_blocks", self.blocks_key),)
                               if self.blocks else ())
        for blocks in self.block_lists:
            if not isinstance(blocks, BlockList) or not blocks.returns or any(
                    s not in BLOCK_STREAMS for s in blocks.returns):
                raise ValueError(f"{self.name}: block list {blocks!r} is not a BlockList "
                                 f"returning streams of {BLOCK_STREAMS}")
        if self.blocks and not self.block_lists:
            raise ValueError(f"{self.name}: --layers/--blocks need the record's block_lists")

    def block_counts(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        """The length of each of its block lists in a diffusers ``config`` (config.json)."""
        return tuple(int(config.get(blocks.key, 0)) for blocks in self.block_lists)

    def kept_blocks(self, config: Mapping[str, Any], layers: int | None) -> tuple[int, ...]:
        """How many blocks of each list the first ``layers`` blocks in execution order take
        (every block where ``layers`` is None): FLUX.1-dev's (19, 38) at 21 is (19, 2)."""
        counts = self.block_counts(config)
        if layers is None:
            return counts
        kept, left = [], int(layers)
        for count in counts:
            kept.append(min(count, max(left, 0)))
            left -= kept[-1]
        return tuple(kept)

    def least_layers(self, config: Mapping[str, Any]) -> int:
        """The fewest blocks ``--layers`` can keep in an export: enough to reach the first block
        list the output layer reads (1 where the first list feeds it)."""
        before = 0
        for blocks, count in zip(self.block_lists, self.block_counts(config)):
            if blocks.feeds_output:
                return before + 1
            before += count
        return 1

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
