"""FLUX.1 (diffusers' FluxTransformer2DModel) and FLUX.2 (Flux2Transformer2DModel): the records.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._dual_stream import DualStream, IdsLayout, launches
from qkrope.families._record import (DOUBLE_THEN_JOINED_BLOCKS, DOUBLE_THEN_SINGLE_BLOCKS,
                                     FamilyRecord)
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (ENCODER_HIDDEN_STATES, GUIDANCE, HIDDEN_STATES, IMG_COS_SIN_CACHE,
                             POOLED_PROJECTIONS, SAMPLE, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The FLUX transformers' graphs (kind "transformer"): FLUX's inputs with the two caches in place
#: of txt_ids/img_ids and no mask; ``guidance`` only where the config has guidance_embeds
#: (:meth:`FamilyRecord.decl`).
FLUX1_TRANSFORMER = ModelDecl("transformer",
                              (HIDDEN_STATES, ENCODER_HIDDEN_STATES, POOLED_PROJECTIONS, TIMESTEP,
                               GUIDANCE, IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                              (SAMPLE,))
FLUX2_TRANSFORMER = ModelDecl("transformer",
                              (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP, GUIDANCE,
                               IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                              (SAMPLE,))

#: FP8's default exclusions in FLUX.1's names: the image and text embedders, the
#: timestep/guidance/pooled-text embedder, the final AdaLN and the output projection. The
#: TensorRT demo's FLUX filter is a substring regex that cannot name the top-level proj_out
#: without every single block's proj_out, so it quantises it; excluding by top-level name keeps
#: it in high precision, as for Qwen-Image, and the blocks' proj_out in FP8.
FLUX1_EXCLUDED = ("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out")
#: FLUX.2: as FLUX.1, with its timestep/guidance embedder and the three shared modulation
#: projections, which turn the timestep embedding into every block's shift, scale and gate once
#: per step (batch-many rows: FP8 would save nothing and its error would reach every block, like
#: the embedders' it stands for in FLUX.1's per-block AdaLN input).
FLUX2_EXCLUDED = ("x_embedder", "context_embedder", "time_guidance_embed",
                  "double_stream_modulation_img", "double_stream_modulation_txt",
                  "single_stream_modulation", "norm_out", "proj_out")

# FLUX's eager order (torch's RMSNorm rounds x*inv*w once, diffusers rotates in fp32 and rounds
# again): bit-exact with the stock model in bf16/fp16 (qkrope.contract.ROUNDING_TWO_STEPS). The
# caches are computed from position ids (no table, so no position limit). --layers K keeps the
# first K blocks in execution order (double-stream, then single-stream); --blocks compares each
# block's outputs: image and text (FLUX.1's single-stream blocks return the pair too), or the
# joined stream FLUX.2's single-stream blocks return.
#: FluxPipeline's other stages: CLIP's pooled output and T5's last hidden state, both called
#: with the token ids alone; the 2-D AutoencoderKL, its encoder for image to image and Kontext.
FLUX1_STAGES = PipelineStages(
    pipelines=("FluxPipeline",),
    text_encoders={"text_encoder": TextEncoderStage(reads=("pooler_output",),
                                                    inputs=("input_ids",), tokens=77),
                   "text_encoder_2": TextEncoderStage(reads=("last_hidden_state",),
                                                      inputs=("input_ids",))},
    vae=VaeStage("image", encode=("FluxImg2ImgPipeline", "FluxKontextPipeline")))
FLUX1 = FamilyRecord(
    name="flux1", class_name="FluxTransformer2DModel", label="FLUX.1 (dev, schnell, Kontext)",
    short="FLUX.1", package="flux", scheme="ids", axes=(16, 56, 56),
    theta=10000, theta_key=None,  # diffusers fixes FluxPosEmbed(theta=10000)
    max_positions=None, rounding=contract.ROUNDING_TWO_STEPS, graph=FLUX1_TRANSFORMER,
    fp8_excluded=FLUX1_EXCLUDED, blocks=True,
    block_lists=DOUBLE_THEN_SINGLE_BLOCKS, launches=launches("FLUX.1", 24),
    stages=FLUX1_STAGES)
#: Flux2KleinPipeline's other stages: its Qwen3 encoder's hidden states 9, 18 and 27 (the
#: pipeline's default text_encoder_out_layers, joined on the channel axis by the pipeline),
#: called with the ids and mask at 512 tokens; the 2-D AutoencoderKLFlux2, whose encoder codes
#: the reference images, and the latent batch-norm statistics the pipeline reads off the VAE
#: (``vae.bn.running_mean`` / ``running_var``) to normalise and unnormalise the latents.
#: FLUX.2 [dev]'s Flux2Pipeline reads the same VAE, and of its Mistral3 vision-language
#: encoder (Mistral Small 3.1, called on the text alone: its language model) the hidden states
#: 10, 20 and 30 (its default text_encoder_out_layers), the prompt in its chat template padded
#: to 512 tokens.
KLEIN_LAYERS = (9, 18, 27)
DEV_LAYERS = (10, 20, 30)
FLUX2_STAGES = tuple(
    PipelineStages(pipelines=(pipeline,),
                   text_encoders={"text_encoder": TextEncoderStage(
                       reads=tuple(f"hidden_states[{k}]" for k in layers))},
                   vae=VaeStage("image", encode=(pipeline,),
                                tensors=("bn.running_mean", "bn.running_var")))
    for pipeline, layers in (("Flux2KleinPipeline", KLEIN_LAYERS),
                             ("Flux2Pipeline", DEV_LAYERS)))
FLUX2 = FamilyRecord(
    name="flux2", class_name="Flux2Transformer2DModel", label="FLUX.2 (dev, klein)",
    short="FLUX.2", package="flux", scheme="ids", axes=(32, 32, 32, 32),
    theta=2000, theta_key="rope_theta",  # the config's defaults
    max_positions=None, rounding=contract.ROUNDING_TWO_STEPS, graph=FLUX2_TRANSFORMER,
    fp8_excluded=FLUX2_EXCLUDED, blocks=True, block_lists=DOUBLE_THEN_JOINED_BLOCKS,
    # klein 4B has FLUX.1's 24 heads (the same launches); klein 9B 32, dev 48
    launches=launches("FLUX.2 klein 9B", 32) + launches("FLUX.2 dev", 48),
    stages=FLUX2_STAGES)

RECORDS = (FLUX1, FLUX2)

#: What the FLUX pipelines call on their transformer (both models' arguments: the drop-in's).
FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                "img_ids", "txt_ids", "guidance", "joint_attention_kwargs",
                "controlnet_block_samples", "controlnet_single_block_samples", "return_dict",
                "controlnet_blocks_repeat", "kv_cache", "kv_cache_mode", "num_ref_tokens",
                "ref_fixed_timestep")
PIPELINES = "FluxPipeline, FluxKontextPipeline, Flux2Pipeline, Flux2KleinPipeline"
#: How the two models differ as dual-stream transformers (qkrope.families._dual_stream): FLUX.1
#: embeds timestep, guidance and the pooled text in time_text_embed, its single-stream blocks
#: take the (text, image) pair, its pipelines put a Kontext condition image at first axis 1 and
#: every text id at 0; a guidance value for a model without guidance embeddings (schnell) is
#: refused, as the stock model would use it. FLUX.2 embeds timestep and guidance, its single-
#: stream blocks run the joined sequence (the export's own blocks), reference image k is at
#: first axis 10 * k, the text's token index on the 4th axis; klein ignores guidance, as
#: diffusers' model does.
DUAL_STREAM = {
    FLUX1.name: DualStream(temb="time_text_embed", ids=IdsLayout(n_axes=3, image_step=1),
                           forward_args=FORWARD_ARGS, pipelines=PIPELINES,
                           unguided_guidance="refuse"),
    FLUX2.name: DualStream(temb="time_guidance_embed",
                           ids=IdsLayout(n_axes=4, image_step=10, text_axes=(3,)),
                           forward_args=FORWARD_ARGS, pipelines=PIPELINES, single_pair=False),
}
