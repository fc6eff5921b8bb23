"""MiniMax-H3 (diffusers' MiniMaxH3Transformer3DModel, joint video + audio): the record. Facts
only; the hooks are export.py, reference.py, dropin.py and tiny.py beside this file.

One packed sequence per call: the text rows, the video rows (conditioning and target, as
patchified latent rows) and the audio rows, scattered into one buffer by ``text_indices``,
``video_indices`` and ``audio_indices``; every row has its ``(t, h, w)`` position, its stream
tag (``token_tags``) and its noise level (``timestep_indices`` into the distinct ``timestep``
values). Each of the ``num_layers`` blocks has one self-attention over the whole sequence (no
cross-attention, no mask); the text first passes a token refiner whose attentions normalise
q / k per head but do not rotate (left as diffusers computes them).

Attention: ``to_q`` / ``to_k`` -> ``norm_q`` / ``norm_k`` (``torch.nn.RMSNorm`` over the 128-wide
head: torch's ``rms_norm`` normalises and scales in float32 and rounds once) -> the rotation of
the leading ``rotary_dim = 6 * rope_freq_dim`` channels (96) in NeoX halves, pairs ``(j, j + 48)``,
the other 32 channels passed through: the node with ``interleaved=0`` and a 96-wide cache. The
cos / sin are cast to the activation dtype and the rotation runs in that dtype (two products and
a sum, each rounded). In float32 that is the node bit for bit; in bf16 / fp16 no node rounding
mode reproduces it: the export uses ``contract.ROUNDING_TWO_STEPS`` (the norm's rounding
exactly, then one fp32 rotation rounded once), whose difference from the eager rotation is
bounded in docs/spec.md section 6f (at most ``(4u + 5u^2) * |(a, b)|`` per rotated element,
u the dtype's unit roundoff, ``(a, b)`` the normalised pair; the pass-through channels exact).

RoPE: one ``inv_freq`` of ``rope_freq_dim`` (16) float32 frequencies
``1 / rope_theta ** (2i / 32)`` shared by the three axes, each axis's 16 angles ``pos * freq``
in float32, concatenated (t, h, w): the cache of axes (32, 32, 32) under the "ids-float32"
scheme, from the rows' ``position_ids``. The image cache holds the video rows (in
``video_indices`` order), the text cache the text rows then the audio rows; the graph scatters
them into packed order as the model scatters its rows.

Outputs: the video and the audio velocity (two graph outputs; the drop-in returns diffusers'
``MiniMaxH3TransformerOutput``). The checkpoint is mixed precision: ``proj_in``,
``audio_proj_in``, ``time_embedder``, ``proj_out``, ``audio_proj_out`` stay float32 in a bf16 /
fp16 export (the class's ``_keep_in_fp32_modules``, which the streamed skeleton honours).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord
from qkrope.model_io import (AUDIO_HIDDEN_STATES, AUDIO_INDICES, AUDIO_SAMPLE,
                             ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TEXT_INDICES, TIMESTEP_INDICES, TIMESTEP_LEVELS, TOKEN_TAGS,
                             TXT_COS_SIN_CACHE, VIDEO_INDICES, ModelDecl)

#: The graph: diffusers' forward arguments in its order (the timestep values under their own
#: name: a [noise_levels] axis, not a [batch] one), then the two caches in place of
#: ``position_ids``; the outputs are the video and the audio prediction.
MINIMAX_H3_TRANSFORMER = ModelDecl(
    "transformer",
    (HIDDEN_STATES, AUDIO_HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP_LEVELS,
     TIMESTEP_INDICES, TOKEN_TAGS, VIDEO_INDICES, AUDIO_INDICES, TEXT_INDICES,
     IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (SAMPLE, AUDIO_SAMPLE))

#: The blocks: one list, each block returning the packed sequence.
MINIMAX_H3_BLOCKS = (BlockList("transformer_blocks", "num_layers", ("joined",)),)

#: The RoPE axes (t, h, w): 2 * rope_freq_dim channels each (16 frequencies, cos and sin).
AXES = (32, 32, 32)

MINIMAX_H3 = FamilyRecord(
    name="minimax-h3", class_name="MiniMaxH3Transformer3DModel",
    label="MiniMax-H3 (video + audio)", short="MiniMax-H3", package="minimax_h3",
    scheme="ids-float32", axes=AXES, theta=10000, theta_key="rope_theta", max_positions=None,
    rounding=contract.ROUNDING_TWO_STEPS, graph=MINIMAX_H3_TRANSFORMER,
    fp8_excluded=("proj_in", "audio_proj_in", "context_embedder", "time_embedder",
                  "token_refiner", "norm_out", "proj_out", "audio_proj_out"),
    blocks=True, block_lists=MINIMAX_H3_BLOCKS)

RECORDS = (MINIMAX_H3,)
