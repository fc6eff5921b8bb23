"""Wan 2.1 / 2.2 (diffusers' WanTransformer3DModel, with its WanRotaryPosEmbed): the record.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file.

Wan normalises q and k with one ``torch.nn.RMSNorm(heads * head_dim)`` over the token's flat
row before the head split: the node's ``norm_scope`` 1 (qkrope.contract.NORM_SCOPE_ROW,
docs/spec.md section 3.2), with FLUX's rounding order (torch's RMSNorm rounds once, the fp32
rotation again): bit-exact with the stock attention in bf16/fp16. Its RoPE is a (frame, row,
column) grid from 0, not centred, computed in float64 (``get_1d_rotary_pos_embed(...,
freqs_dtype=float64)``) over tables of ``rope_max_seq_len`` positions: the "grid" scheme with
``scale_rope=False`` and float64 tables. The text is not rotated (cross-attention ``attn2`` has
no RoPE): the graph has no text cache input.

Derivatives: the folder runs Wan 2.1 T2V (1.3B, 14B), Wan 2.1 I2V-14B (480p, 720p) and
FLF2V-14B, Wan 2.2 T2V-A14B and I2V-A14B (both experts) and TI2V-5B text-to-video. Wan 2.1 I2V
/ FLF2V (config ``image_dim``, attention ``added_kv_proj_dim``): the graph takes the CLIP image
tokens ``encoder_hidden_states_image`` too (:data:`WAN_I2V_TRANSFORMER`; FLF2V's two images
side by side, a static length: :data:`WAN_FLF2V_TRANSFORMER`), embeds them and joins them before
the text; the cross-attention's image branch (``add_k_proj``, ``norm_added_k``, ``add_v_proj``,
its attention added to the text's) is computed as diffusers does, unfused; the self-attention
stays the fused node. diffusers' attention splits the image tokens off at 512 text tokens
(hardcoded, :data:`I2V_TEXT_TOKENS`), so such an export's sample and check take 512 text tokens
and the drop-in refuses another text length with the image.

The same folder serves three classes built on Wan's blocks as records of their own
(:data:`SKYREELS_V2`, :data:`CHRONOEDIT`, :data:`WAN_VACE`), what they do differently told once
in :data:`DERIVATIVES` and read by the same hooks: SkyReels-V2's float64 timestep sinusoid
(computed in float32 with the angle's rounding error carried), its diffusion-forcing call
(per-frame timesteps equal within a sample); ChronoEdit's two-frame edit at frame positions 0
and 7 (the "ids" scheme; Wan 2.1 I2V's image branch); Wan-VACE's control branch (its control
latent and hint scales two more graph inputs). Refused in one line: Animate
(WanAnimateTransformer3DModel), Helios and SANA-Video by their class (:data:`REFUSED`); SkyReels-V2 with ``inject_sample_info`` or
``num_frame_per_block`` > 1 and ChronoEdit with another temporal skip or a head whose third
differs from Wan's row axis by the config check; an attention image branch
without the image embedder or of another width (``added_kv_proj_dim`` without ``image_dim`` or
other than the model width) by the config check, TI2V-5B's image-to-video (per-token
timesteps) and an I2V text of other than 512 tokens by the drop-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.stages import ImageEncoderStage, PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (CONTROL_HIDDEN_STATES, CONTROL_HIDDEN_STATES_SCALE,
                             ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_IMAGE,
                             ENCODER_HIDDEN_STATES_IMAGE_PAIR, HIDDEN_STATES, IMG_COS_SIN_CACHE,
                             SAMPLE, TIMESTEP, ModelDecl)

#: Wan's graph: the latent's patches packed as tokens (hidden_states [batch, img_tokens,
#: in_channels * pt * ph * pw], each patch in (channel, t, h, w) order, the Conv3d weight's),
#: the text embeddings, the timestep (float32, as the pipelines pass it) and the image cache;
#: the output is the packed prediction [batch, img_tokens, pt * ph * pw * out_channels] (each
#: patch in (t, h, w, channel) order: diffusers' unpatchify). The drop-in packs and unpacks.
WAN_TRANSFORMER = ModelDecl("transformer",
                            (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP, IMG_COS_SIN_CACHE),
                            (SAMPLE,))
#: Wan 2.1 I2V's graph (config ``image_dim``): the T2V inputs and the CLIP image tokens
#: ``encoder_hidden_states_image`` [batch, image_embed_tokens, image_dim], which the model
#: embeds and joins before the text for the cross-attention; FLF2V's (``pos_embed_seq_len``):
#: the two images' tokens side by side, a static length (:mod:`.export`).
WAN_I2V_TRANSFORMER = ModelDecl("transformer", WAN_TRANSFORMER.inputs
                                + (ENCODER_HIDDEN_STATES_IMAGE,), (SAMPLE,))
WAN_FLF2V_TRANSFORMER = ModelDecl("transformer", WAN_TRANSFORMER.inputs
                                  + (ENCODER_HIDDEN_STATES_IMAGE_PAIR,), (SAMPLE,))

#: The text length diffusers' Wan 2.1 I2V cross-attention assumes: it splits the joined
#: [image; text] context at ``length - 512`` (umT5's padded length, hardcoded), so its image
#: branch reads the image tokens only when the text has 512 tokens, as the pipelines pad it.
I2V_TEXT_TOKENS = 512
#: The image tokens of Wan 2.1 I2V's CLIP ViT-H/14 at 224 x 224 (16 x 16 patches and the class
#: token): the export sample's.
I2V_IMAGE_TOKENS = 257

#: Wan-VACE's graph (config ``vace_layers``): T2V's inputs and the control latent's patches
#: ``control_hidden_states`` [batch, img_tokens, vace_in_channels * pt * ph * pw] (packed as
#: the latent, on its grid) with the scale of each control block's hint
#: ``control_hidden_states_scale`` [len(vace_layers)] float32.
WAN_VACE_TRANSFORMER = ModelDecl("transformer", WAN_TRANSFORMER.inputs
                                 + (CONTROL_HIDDEN_STATES, CONTROL_HIDDEN_STATES_SCALE),
                                 (SAMPLE,))


def graph_of(config) -> ModelDecl:
    """The graph of a Wan config: T2V's, I2V's (``image_dim``), FLF2V's (and
    ``pos_embed_seq_len``) or VACE's (``vace_layers``)."""
    if config.get("vace_layers") is not None:
        return WAN_VACE_TRANSFORMER
    if config.get("image_dim") is None:
        return WAN_TRANSFORMER
    if config.get("pos_embed_seq_len") is not None:
        return WAN_FLF2V_TRANSFORMER
    return WAN_I2V_TRANSFORMER

#: FP8's default exclusions: the patch embedding, the timestep/text(/image) embedder, the final
#: AdaLN's projection (TensorRT's Wan demo keeps the embedders and the head in high precision).
FP8_EXCLUDED = ("patch_embedding", "condition_embedder", "proj_out")

# The kernel launches of Wan's fused node (issue 33 item 2): one row-scope node per block, q
# and k of [batch, tokens, heads, 128], rounding 2, norm_scope 1. Wan's pipelines run the
# conditional and unconditional predictions as two calls of batch 1. Tokens per launch: 720p
# (1280 x 720) at 81 frames is 21 latent frames x 45 x 80 patches = 75,600; 480p (832 x 480)
# at 81 frames 21 x 30 x 52 = 32,760; TI2V-5B's 704 x 1280 at 121 frames (16x VAE) 31 x 22 x
# 40 = 27,280.
WAN_LAUNCHES = (
    Launch("Wan 2.1/2.2 14B 720p 81f", "video 75600", 75600, 40, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.1/2.2 14B 480p 81f", "video 32760", 32760, 40, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.1 1.3B 480p 81f", "video 32760", 32760, 12, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.2 TI2V-5B 720p 121f", "video 27280", 27280, 24, batches=(1,),
           roundings=(2,), norm_scope=1),
)

#: diffusers' WanRotaryPosEmbed: theta fixed at 10000, tables of rope_max_seq_len positions
#: (1024 in every released config); axes for head_dim 128: frames 44, rows 42, columns 42
#: (h = w = 2 * (head_dim // 6), t the rest: :func:`wan_axes`). One block list, ``blocks`` (its
#: length the config's num_layers), each ``WanTransformerBlock`` returning the video tokens
#: alone (hidden_states; the text is read by the cross-attention, never changed): --layers
#: keeps the first blocks, --blocks compares each one's output, the check's reference streams
#: one block at a time. Wan 2.2's second expert is its own folder and export.
#: the Wan folder's encoders: UMT5 (its last hidden state, of the ids and mask) and Wan 2.1
#: I2V's CLIP image encoder (its second-to-last hidden state)
UMT5 = {"text_encoder": TextEncoderStage(reads=("last_hidden_state",))}
CLIP_IMAGE = {"image_encoder": ImageEncoderStage(reads=("hidden_states[-2]",))}
#: WanPipeline's other stages (text to video; Wan 2.2 A14B's second expert is the pipeline's
#: transformer_2): UMT5's last hidden state, called with the ids and mask; the causal video VAE,
#: decoded latent frame by latent frame with its feature cache, and its encoder for image to
#: video; Wan 2.1 I2V's CLIP image encoder (its second-to-last hidden state, of the 224 x 224
#: crop its image processor makes; Wan 2.2's I2V has none, and exports without it).
STAGES = PipelineStages(
    pipelines=("WanPipeline",), text_encoders=UMT5,
    vae=VaeStage("causal-video", encode=("WanImageToVideoPipeline",)),
    image_encoders=CLIP_IMAGE, size=(480, 832))  # the pipelines' height and width defaults
WAN = FamilyRecord(
    name="wan", class_name="WanTransformer3DModel",
    label="Wan 2.1 / 2.2 (T2V 1.3B / 14B, I2V / FLF2V-14B, T2V-A14B, I2V-A14B, TI2V-5B)",
    short="Wan",
    package="wan", scheme="grid", axes=(44, 42, 42), theta=10000, theta_key=None,
    max_positions=1024, rounding=contract.ROUNDING_TWO_STEPS, graph=WAN_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("blocks", "num_layers", ("img",)),), rotated=("img",),
    scale_rope=False, launches=WAN_LAUNCHES,
    rope_precision="float64", max_positions_key="rope_max_seq_len", stages=STAGES)


def wan_axes(head_dim: int) -> tuple:
    """The (frames, rows, columns) RoPE widths of a head_dim, as WanRotaryPosEmbed splits it."""
    h = w = 2 * (int(head_dim) // 6)
    return (int(head_dim) - h - w, h, w)


# --------------------------------------------------------------------------------------------
# Wan's derivatives: the same blocks, attention and graph; what differs is record data here
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Derivative:
    """What a class built on Wan's blocks does differently, read by the folder's one set of
    hooks (export, reference, drop-in): nothing, for Wan itself.

    - ``time_sincos64``: the sinusoidal timestep embedding is ``get_1d_sincos_pos_embed_from_
      grid`` in float64 (SkyReels-V2), which the export computes in float32 with the rounding
      error of the angle carried separately (:func:`qkrope.families.wan.export.sincos64`);
    - ``skip_frames_key``: the config key of ChronoEdit's temporal skip: a latent of exactly two
      frames (the edit's input and output frame) takes frame positions 0 and skip - 1, so its
      caches come from per-token positions (the "ids" scheme: :func:`frame_positions`);
    - ``thirds_split``: the class splits each RoPE table row at ``head_dim // 3`` (ChronoEdit)
      while building the tables at ``2 * (head_dim // 6)``: the two agree only where those are
      equal (every released config: 128), which the config check asks;
    - ``forward_extras``: arguments its pipelines pass beyond Wan's (the drop-in takes them and
      refuses what the export cannot honour);
    - ``refused_config``: config keys whose non-default value the export refuses, with why;
    - ``control_layers_key``: the config key of the main blocks after which a control
      block's hint is added (Wan-VACE's ``vace_layers``): the model runs its control blocks
      (``vace_blocks``, fused nodes too) on the patch-embedded control latent first, and adds
      hint j, times its scale, after the j-th of those blocks in ascending order."""

    time_sincos64: bool = False
    skip_frames_key: str | None = None
    thirds_split: bool = False
    forward_extras: tuple = ()
    refused_config: tuple = ()
    control_layers_key: str | None = None


#: SkyReels-V2 (SkyReelsV2Transformer3DModel): Wan 2.1's blocks with a float64 sinusoidal
#: timestep embedding; its diffusion-forcing pipelines pass per-frame timesteps with
#: ``enable_diffusion_forcing`` and an ``fps`` index that only ``inject_sample_info`` models
#: read; ``num_frame_per_block`` > 1 makes the self-attention block-causal over frames.
SKYREELS_V2 = FamilyRecord(
    name="skyreels-v2", class_name="SkyReelsV2Transformer3DModel",
    label="SkyReels-V2 (T2V / I2V / DF 1.3B / 14B, 540P / 720P)", short="SkyReels-V2",
    package="wan", scheme="grid", axes=(44, 42, 42), theta=10000, theta_key=None,
    max_positions=1024, rounding=contract.ROUNDING_TWO_STEPS, graph=WAN_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("blocks", "num_layers", ("img",)),), rotated=("img",),
    scale_rope=False, rope_precision="float64", max_positions_key="rope_max_seq_len",
    # 540P (544 x 960) at 97 frames: 25 latent frames x 34 x 60 patches = 51,000 tokens
    launches=(Launch("SkyReels-V2 14B 540P 97f", "video 51000", 51000, 40, batches=(1,),
                     roundings=(2,), norm_scope=1),
              Launch("SkyReels-V2 1.3B 540P 97f", "video 51000", 51000, 12, batches=(1,),
                     roundings=(2,), norm_scope=1)),
    # its text to video pipeline's stages: Wan's encoder and VAE, at 544 x 960 (its defaults);
    # the image to video and diffusion-forcing pipelines are not declared
    stages=PipelineStages(pipelines=("SkyReelsV2Pipeline",), text_encoders=UMT5,
                          vae=VaeStage("causal-video"), size=(544, 960)))

#: ChronoEdit (ChronoEditTransformer3DModel): Wan 2.1 I2V-14B's blocks, graph and image
#: branch; its RoPE puts a two-frame latent's frames at positions 0 and
#: ``rope_temporal_skip_len`` - 1 (the "ids" scheme, float64 like Wan's tables).
CHRONOEDIT = FamilyRecord(
    name="chronoedit", class_name="ChronoEditTransformer3DModel",
    label="ChronoEdit (14B image editing, temporal reasoning)", short="ChronoEdit",
    package="wan", scheme="ids", axes=(44, 42, 42), theta=10000, theta_key=None,
    max_positions=1024, rounding=contract.ROUNDING_TWO_STEPS, graph=WAN_I2V_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("blocks", "num_layers", ("img",)),), rotated=("img",),
    scale_rope=False, rope_precision="float64", max_positions_key="rope_max_seq_len",
    # the edit: 2 latent frames at 480 x 832 (30 x 52 patches) = 3,120 tokens; temporal
    # reasoning's 81 frames: 21 x 30 x 52 = 32,760
    launches=(Launch("ChronoEdit-14B 480p edit", "video 3120", 3120, 40, batches=(1,),
                     roundings=(2,), norm_scope=1),
              Launch("ChronoEdit-14B 480p reasoning 81f", "video 32760", 32760, 40,
                     batches=(1,), roundings=(2,), norm_scope=1)),
    # the edit pipeline's stages: Wan 2.1 I2V's (UMT5, the CLIP image encoder, the causal
    # VAE, whose encoder codes the input image)
    stages=PipelineStages(pipelines=("ChronoEditPipeline",), text_encoders=UMT5,
                          image_encoders=CLIP_IMAGE,
                          vae=VaeStage("causal-video", encode=("ChronoEditPipeline",)),
                          size=(480, 832)))

#: Wan-VACE (WanVACETransformer3DModel): Wan 2.1's blocks and graph with a control branch:
#: ``vace_blocks`` (Wan blocks with an input projection on the first and an output projection
#: on each) run on the control latent's own patch embedding (``vace_patch_embedding``), and
#: their hints, scaled, are added to the video tokens after the blocks ``vace_layers`` names.
#: --layers K keeps the first K of the main blocks (the later ones pass the tokens through, as
#: the check's reference skips them) and the whole control branch.
WAN_VACE = FamilyRecord(
    name="wan-vace", class_name="WanVACETransformer3DModel",
    label="Wan-VACE (Wan 2.1 VACE 1.3B / 14B)", short="Wan-VACE",
    package="wan", scheme="grid", axes=(44, 42, 42), theta=10000, theta_key=None,
    max_positions=1024, rounding=contract.ROUNDING_TWO_STEPS, graph=WAN_VACE_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED + ("vace_patch_embedding",), blocks=True,
    block_lists=(BlockList("blocks", "num_layers", ("img",)),), rotated=("img",),
    scale_rope=False, rope_precision="float64", max_positions_key="rope_max_seq_len",
    # the node runs in the control blocks too, at the video's shape: Wan 2.1's sizes
    launches=(Launch("Wan-VACE 14B 720p 81f", "video 75600", 75600, 40, batches=(1,),
                     roundings=(2,), norm_scope=1),
              Launch("Wan-VACE 1.3B 480p 81f", "video 32760", 32760, 12, batches=(1,),
                     roundings=(2,), norm_scope=1)),
    # its pipeline's stages: Wan's, the VAE encoder coding the control video (zeros when
    # none is given) and the reference images
    stages=PipelineStages(pipelines=("WanVACEPipeline",), text_encoders=UMT5,
                          vae=VaeStage("causal-video", encode=("WanVACEPipeline",)),
                          size=(480, 832)))

#: record name -> its differences from Wan (the hooks' one table)
DERIVATIVES = {
    WAN.name: Derivative(),
    SKYREELS_V2.name: Derivative(
        time_sincos64=True, forward_extras=("enable_diffusion_forcing", "fps"),
        refused_config=(("inject_sample_info", False, "its fps embedding is an input the "
                         "export does not have"),
                        ("num_frame_per_block", 1, "its block-causal frame mask is not in "
                         "the export"))),
    CHRONOEDIT.name: Derivative(skip_frames_key="rope_temporal_skip_len", thirds_split=True),
    WAN_VACE.name: Derivative(control_layers_key="vace_layers"),
}

#: ChronoEdit's default temporal skip (diffusers' ``rope_temporal_skip_len``)
SKIP_FRAMES = 8


def derivative(record) -> Derivative:
    """What ``record``'s class does differently from Wan (:class:`Derivative`)."""
    return DERIVATIVES[record.name]


def control_layers(config) -> list:
    """The main blocks after which Wan-VACE adds its hints, in the order its hints are taken
    (diffusers takes them in ascending block order, each listed block once)."""
    return sorted({int(i) for i in config["vace_layers"]})


def frame_positions(frames: int, skip: int | None) -> list:
    """The RoPE frame position of each latent frame: 0 .. frames - 1, except a two-frame latent
    of a class with a temporal skip (ChronoEdit), whose frames sit at 0 and ``skip`` - 1."""
    if skip is not None and int(frames) == 2:
        return [0, int(skip) - 1]
    return list(range(int(frames)))


RECORDS = (WAN, SKYREELS_V2, CHRONOEDIT, WAN_VACE)

#: The classes built on Wan's blocks that this folder cannot serve, with why (the registry
#: refuses them by class in one line: qkrope.families.family_of).
REFUSED = {
    "SanaVideoTransformer3DModel":
        "its self-attention is linear attention: it applies ReLU to q and k between the "
        "RMSNorm and the rotation and normalises by the unrotated q and k, which a "
        "norm-then-rotate node feeding softmax attention cannot express",
    "HeliosTransformer3DModel":
        "its frame positions come per sample (indices_hidden_states [batch, frames]), which "
        "the RoPE caches (no batch axis) cannot hold, it joins three history latents (short, "
        "mid, long, each with its own patch embedding and positions) to the video tokens, and "
        "it scales the history tokens' keys after the rotation (is_amplify_history)",
    "WanAnimateTransformer3DModel":
        "it runs a motion encoder and a face encoder on its pose and face inputs "
        "(pose_hidden_states, face_pixel_values) and adds face-adapter cross-attention blocks "
        "between Wan's blocks, inputs and modules the Wan export does not have",
}
