"""PRX (diffusers' PRXTransformer2DModel, Photoroom's text-to-image model): the record. Facts
only; the hooks are export.py, reference.py, dropin.py and tiny.py beside this file.

One stream of image tokens: each block's attention takes its queries from the image tokens
alone and its keys and values from ``[text; image]`` (the text is read, never updated). The
image's q and k are normalised per head by diffusers' RMSNorm (float32, rounded, times the
weight and rounded in bf16 / fp16) and rotated in float32 as interleaved pairs, rounded again:
``contract.ROUNDING_EACH_STEP``, one node per block over the image cache. The text keys are
normalised (``norm_added_k``) but not rotated and have no queries: that norm stays as diffusers
computes it, outside the node, and the graph has no text cache. The RoPE is the image's
(row, column) patch grid from 0 over the config's ``axes_dim`` (two axes filling the head) with
base ``theta``, built in float64 from the position ids: the "ids" scheme with two axes.

The model patchifies its 4-D latent itself; the graph takes the packed patches
(``[batch, tokens, channels x p x p]``, each patch in (channel, row, column) order: diffusers'
``img2seq``) and returns them, which the drop-in packs and unpacks. Refused by the config
check: ``resolution_embeds`` (PRX-7B's embedding of the latent's height and width, which the
packed tokens do not carry).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord
from qkrope.model_io import (ENCODER_ATTENTION_MASK, ENCODER_HIDDEN_STATES, HIDDEN_STATES,
                             IMG_COS_SIN_CACHE, SAMPLE, TIMESTEP, ModelDecl)

#: The graph: the packed latent patches, the text and its int64 mask (1 = a real token), the
#: timestep as the pipelines pass it (float32, t / num_train_timesteps) and the image cache;
#: the output is the packed prediction.
PRX_TRANSFORMER = ModelDecl("transformer", (HIDDEN_STATES, ENCODER_HIDDEN_STATES,
                                            ENCODER_ATTENTION_MASK, TIMESTEP,
                                            IMG_COS_SIN_CACHE), (SAMPLE,))

#: One block list, ``blocks`` (the config's ``depth``), each returning the image tokens.
PRX_BLOCKS = (BlockList("blocks", "depth", ("img",)),)

PRX = FamilyRecord(
    name="prx", class_name="PRXTransformer2DModel", label="PRX (text-to-image)", short="PRX",
    package="prx", scheme="ids", axes=(32, 32), theta=10000, theta_key="theta",
    max_positions=None, rounding=contract.ROUNDING_EACH_STEP, graph=PRX_TRANSFORMER,
    fp8_excluded=("img_in", "time_in", "txt_in", "final_layer"), blocks=True,
    block_lists=PRX_BLOCKS, blocks_key="depth", rotated=("img",))

RECORDS = (PRX,)
