"""FLUX.3 (diffusers' Flux3Transformer2DModel): the record. Facts only; the hooks are export.py,
reference.py, dropin.py and tiny.py beside this file.

The model has three token modes: the text context, the noisy image and (image-to-image) the
reference image tokens. Each mode first runs its own per-mode blocks (``txt_mode_blocks``,
``mode_blocks["image"]``, ``mode_blocks["image_cond"]``), whose attention is self-attention
within that one stream, rotated by the stream's own cache; then the joint single blocks run
``[text; image(; image_cond)]`` and rotate it by the joined cache. Every attention is
``Flux3AttnProcessor``: q and k per head through ``norm_q`` / ``norm_k`` (``torch.nn.RMSNorm``,
weights kept in float32 by the class's ``_keep_in_fp32_modules``) on ``query.float()``, the
rotation of interleaved pairs in float32 (``apply_rotary_emb``, ``use_real_unbind_dim=-1``),
one cast to the value dtype: the node's ``ROUNDING_ONE`` (mode 0) with float32 norm weights
under bf16 / fp16 activations. RoPE: 4-axis position ids (t, h, w, l), axes (32, 32, 32, 32),
theta from the config's rope_theta (10000), built as FLUX.2's (float64, then float32: the
"ids" scheme). The pipelines scale the image's h / w ids by 0.5 and put the text's index on l.

Served: the text-to-image graph (text and image streams), and a flow-map model's
(``flow_map=True``, the step-distilled checkpoints: ``target_timestep`` an input after the
timestep, FLUX3_FLOW_MAP). Refused in one line: the reference-image stream
(``image_cond_hidden_states``: the graph declares no input for it).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TARGET_TIMESTEP, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the packed image tokens, the text, the flow timestep in [0, 1], the two caches.
FLUX3_TRANSFORMER = ModelDecl("transformer",
                              (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP,
                               IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                              (SAMPLE,))
#: A flow-map model's graph (flow_map=True, the step-distilled checkpoints that
#: Flux3DistilledModularPipeline runs): the timestep each step jumps to after the timestep.
FLUX3_FLOW_MAP = ModelDecl("transformer",
                           (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP, TARGET_TIMESTEP,
                            IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                           (SAMPLE,))

#: FP8's default exclusions: the input projections, the timestep embedder and the two sets of
#: per-mode modulation heads (they turn one timestep embedding into every block's shift, scale
#: and gate: FLUX.2's shared modulations), the output AdaLN and projection.
FP8_EXCLUDED = ("x_embedders", "context_embedder", "timestep_embedder",
                "early_stream_modulations", "single_stream_modulations", "norm_out",
                "proj_out")

#: The block lists (qkrope.apps.check_blocks, --layers / --blocks), in the text-to-image
#: forward's execution order: the text per-mode blocks (their output reaches the image only
#: through the joint blocks: a cut within them holds none of them), the image per-mode blocks
#: (a dotted path: a list inside the mode_blocks ModuleDict), the joint blocks. The reference
#: image's per-mode blocks are in none (the text-to-image graph never runs them).
BLOCK_LISTS = (BlockList("txt_mode_blocks", "num_layers", ("txt",), feeds_output=False),
               BlockList("mode_blocks.image", "num_layers", ("img",)),
               BlockList("single_transformer_blocks", "num_single_layers", ("txt", "img")))

#: The node launches at FLUX.3's sizes (24 heads x 128, interleaved pairs over the whole head):
#: a 1024 x 1024 image (64 x 64 tokens) in its per-mode blocks, 512 text tokens in theirs, and
#: the joint blocks' [text; image]; rounding mode 0 (one rounding at the end).
LAUNCHES = tuple(Launch("FLUX.3", stream, seq, 24, roundings=(contract.ROUNDING_ONE,))
                 for stream, seq in (("image 4096", 4096), ("text 512", 512),
                                     ("joint 512+4096", 4096 + 512)))

#: How the FLUX.3 pipelines lay out the ids: the image's (t, h, w, l) = (0, row * 0.5,
#: column * 0.5, 0) (Flux3PrepareLatentsStep's image_rope_scale), the text's (0, 0, 0, index).
IMAGE_ROPE_SCALE = 0.5

FLUX3 = FamilyRecord(
    name="flux3", class_name="Flux3Transformer2DModel", label="FLUX.3 (text-to-image)",
    short="FLUX.3", package="flux3", scheme="ids", axes=(32, 32, 32, 32),
    theta=10000, theta_key="rope_theta", max_positions=None,
    rounding=contract.ROUNDING_ONE, graph=FLUX3_TRANSFORMER, fp8_excluded=FP8_EXCLUDED,
    fp8_excluded_where_built=("target_timestep_embedder",),  # a flow-map model's (flow_map=True)
    blocks=True, block_lists=BLOCK_LISTS, launches=LAUNCHES)

RECORDS = (FLUX3,)
