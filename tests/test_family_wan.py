"""Wan 2.1 / 2.2 (qkrope/families/wan) on diffusers' tiny test config (tests/_families.py):
the caches are WanRotaryPosEmbed's float64 tables bit for bit; the patched model is bit-exact
with diffusers' own forward in fp32, bf16 and fp16 (the row-scope node with rounding 2 is Wan's
eager order); the export has one row-scope node per block and Wan's inputs; ONNX Runtime runs it
at untraced shapes through the drop-in; WanPipeline runs end to end on it, with Wan 2.2's two
experts and its boundary switch; Wan 2.1 I2V / FLF2V (the CLIP image branch) likewise, with
WanImageToVideoPipeline end to end on a CLIP image encoder built in code; the refusals are one
line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _families import BUILDERS, WAN_CONFIG, wan_transformer  # noqa: E402
from qkrope import contract  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.wan import WAN, wan_axes  # noqa: E402
from qkrope.families.wan.dropin import pack, unpack  # noqa: E402

PATCH = tuple(WAN_CONFIG["patch_size"])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("wan")


@pytest.fixture(scope="module")
def exported(root):
    """The tiny model (seed 0) exported in fp32 at a traced grid of (2, 4, 6) patches, 7 text
    tokens, batch 2; and a second expert (seed 1) for Wan 2.2's transformer_2."""
    from qkrope.export.onnx_export import export_transformer

    out = {}
    for seed in (0, 1):
        folder = root / f"wan-{seed}"
        wan_transformer(seed).save_pretrained(str(folder))
        path = root / f"wan-{seed}.onnx"
        export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                           progress=False)
        out[seed] = (folder, path)
    return out


def _stock(folder, dtype=torch.float32):
    return diffusers.WanTransformer3DModel.from_pretrained(str(folder), torch_dtype=dtype).eval()


def _setting(max_positions=WAN_CONFIG["rope_max_seq_len"], head_dim=12):
    from qkrope.runtime.caches import checked_setting

    return checked_setting(WAN.scheme, wan_axes(head_dim), WAN.theta,
                           max_positions=max_positions, scale_rope=False, rotated=WAN.rotated,
                           precision=WAN.rope_precision)


# --------------------------------------------------------------------------------------------
# The caches
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,max_positions,grid", [
    (12, 32, (32, 5, 7)),       # the tiny model: every frame position its tables hold
    (128, 1024, (21, 45, 80)),  # Wan 14B at 720p, 81 frames: 75,600 tokens
    (128, 1024, (2, 3, 1024)),  # the last table row
])
def test_caches_are_wans_float64_rope_bit_for_bit(head_dim, max_positions, grid):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from qkrope.runtime.caches import build_rope_caches

    rope = WanRotaryPosEmbed(head_dim, PATCH, max_positions)
    assert (rope.t_dim, rope.h_dim, rope.w_dim) == wan_axes(head_dim)
    f, h, w = grid
    cos, sin = rope(torch.zeros(1, 1, f, h * PATCH[1], w * PATCH[2]))
    want = torch.cat([cos[0, :, 0, 0::2], sin[0, :, 0, 1::2]], -1)
    caches = build_rope_caches(WAN.scheme, {"img_shapes": [grid], "txt_seq_len": 5},
                               _setting(max_positions, head_dim))
    assert torch.equal(caches.img, want)
    # the text is not rotated: identity rows (cos 1, sin 0)
    assert torch.equal(caches.txt[:, :head_dim // 2], torch.ones(5, head_dim // 2))
    assert not caches.txt[:, head_dim // 2:].any()


def test_a_grid_past_the_tables_is_refused_in_one_line():
    from qkrope.runtime.caches import RopeCacheOverflowError, build_rope_caches

    with pytest.raises(RopeCacheOverflowError,
                       match=r"image 0 has shape \(33, 2, 2\).*32 positions") as e:
        build_rope_caches(WAN.scheme, {"img_shapes": [(33, 2, 2)], "txt_seq_len": 4},
                          _setting())
    assert "\n" not in str(e.value)


def test_caches_for_reads_the_setting_from_the_sidecar(exported):
    from qkrope.runtime.caches import build_rope_caches, caches_for

    _, path = exported[0]
    got = caches_for(path, [(3, 4, 5)], 9)
    want = build_rope_caches(WAN.scheme, {"img_shapes": [(3, 4, 5)], "txt_seq_len": 9},
                             _setting())
    assert torch.equal(got.img, want.img)


# --------------------------------------------------------------------------------------------
# The patched model against diffusers' own forward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patched_model_is_bit_exact_with_diffusers(root, dtype):
    """The cache-input wrapper (fused row-scope node, rounding 2; attn2 as diffusers) on the
    packed patches gives diffusers' bits, loaded as a pipeline loads it (the fp32 modules kept
    in fp32), in every dtype: rounding 2 on the row is Wan's eager order (spec 3.2)."""
    from qkrope.families.wan.export import WanCacheInputTransformer
    from qkrope.runtime.caches import build_rope_caches

    folder = root / "bitexact"
    if not folder.exists():
        wan_transformer(0).save_pretrained(str(folder))
    stock = _stock(folder, dtype)
    ours = WanCacheInputTransformer(_stock(folder, dtype)).eval()
    g = torch.Generator().manual_seed(3)
    grid = (3, 4, 5)
    latent = torch.randn(2, 4, 3, 8, 10, generator=g).to(dtype)
    text = torch.randn(2, 9, 16, generator=g).to(dtype)
    t = torch.tensor([700.0, 31.5])
    caches = build_rope_caches(WAN.scheme, {"img_shapes": [grid], "txt_seq_len": 9}, _setting())
    with torch.no_grad():
        want = stock(latent, t, text, return_dict=False)[0]
        got = unpack(ours(pack(latent, PATCH), text, t, caches.img), grid, PATCH)
    assert got.dtype == dtype and torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------------------------

def test_graph(exported):
    import onnx
    from onnx import numpy_helper

    from qkrope.export.onnx_function import FunctionVariant, function_variant
    from qkrope.sidecars import ModelInfo

    folder, path = exported[0]
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_TYPE]
    assert len(nodes) == WAN_CONFIG["num_layers"]  # attn1 of each block; attn2 unfused
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert (attrs["norm_scope"], attrs["rounding"], attrs["interleaved"]) == (
            contract.NORM_SCOPE_ROW, contract.ROUNDING_TWO_STEPS, 1)
        assert attrs["epsilon"] == pytest.approx(1e-6)
    assert function_variant(model) == FunctionVariant(True, 2, False, contract.NORM_SCOPE_ROW)
    assert contract.validate_qknorm_rope_nodes(model, where=str(path)) == len(nodes)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}
    width = WAN_CONFIG["in_channels"] * int(np.prod(PATCH))
    assert dims == {"hidden_states": ["batch", "img_tokens", width],
                    "encoder_hidden_states": ["batch", "txt_tokens", 16],
                    "timestep": ["batch"], "img_cos_sin_cache": ["img_cache_rows", 12]}
    assert [i.type.tensor_type.elem_type for i in model.graph.input if i.name == "timestep"] \
        == [onnx.TensorProto.FLOAT]
    for value in list(model.graph.value_info) + list(model.graph.input):
        assert value.type.tensor_type.elem_type != onnx.TensorProto.DOUBLE, value.name
    info = ModelInfo.load(path)
    assert info.config.family == "wan" and info.config.axes_dims_rope == list(wan_axes(12))
    assert info.node_attributes == contract.NodeAttributes(1e-6, True, 2,
                                                           contract.NORM_SCOPE_ROW)
    side = json.loads(path.with_name(path.name + ".json").read_text())
    assert side["node_attributes"]["norm_scope"] == 1
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    state = _stock(folder).state_dict()
    assert info.config.parameters_not_in_graph == []
    for key, tensor in state.items():
        np.testing.assert_array_equal(inits[key], tensor.numpy(), err_msg=key)
    onnx.checker.check_model(str(path), full_check=True)


def _call(seed, grid, batch, txt):
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    latent = torch.randn(batch, 4, f * PATCH[0], h * PATCH[1], w * PATCH[2], generator=g)
    return latent, torch.randn(batch, txt, 16, generator=g), torch.rand(batch, generator=g) * 999


def _stock_ort_error(stock, latent, t, text, ref64, image=None, **extra) -> float:
    """The error against float64 of diffusers' own model exported by torch.onnx (its RoPE in
    the graph, float64) and run by ONNX Runtime at this call's shape: the rounding ONNX
    Runtime's kernels add to this function. ``image``: Wan 2.1 I2V's CLIP image tokens;
    ``extra``: other tensor arguments of its forward by name (Wan-VACE's control inputs)."""
    import warnings

    import onnxruntime as ort

    class Stock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = stock

        def forward(self, hidden_states, timestep, encoder_hidden_states, *rest):
            return self.model(hidden_states, timestep, encoder_hidden_states,
                              **dict(zip(names[3:], rest)), return_dict=False)[0]

    import tempfile

    args = (latent, t, text) + (() if image is None else (image,))
    names = ["hidden_states", "timestep", "encoder_hidden_states",
             "encoder_hidden_states_image"][:len(args)] + list(extra)
    args += tuple(extra.values())
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        path = f"{d}/stock.onnx"
        torch.onnx.export(Stock(), args, dynamo=True, verbose=False,
                          input_names=names).save(path)
        out = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(
            None, {n: a.numpy() for n, a in zip(names, args)})[0]
    return float(np.abs(out - ref64.numpy()).max())


def test_ort_dropin_at_untraced_shapes(exported):
    """The drop-in (ONNX Runtime) at a grid, batch and text length the export never traced,
    against diffusers' forward in float64: <= 2 x the error of diffusers' own model exported by
    torch.onnx and run by ONNX Runtime at this shape. Both graphs are the same fp32 arithmetic
    but for the norm + RoPE step (the node's body vs torch's decomposition, the same function
    bit for bit in fp32 eager: test above), so their errors are ONNX Runtime's kernels'
    rounding of one function; the factor 2 leaves the body at most as much rounding again as
    the whole graph has."""
    from qkrope.runtime import load_transformer

    folder, path = exported[0]
    dropin = load_transformer(path)
    stock = _stock(folder)
    latent, text, t = _call(5, (3, 5, 3), 3, 11)
    with torch.no_grad():
        ref32 = stock(latent, t, text, return_dict=False)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               return_dict=False)[0]
    stock.float()
    out = dropin(hidden_states=latent, timestep=t, encoder_hidden_states=text,
                 return_dict=False)[0]
    assert out.shape == ref32.shape == (3, 4, 3, 10, 6) and out.dtype == torch.float32
    stock_err = _stock_ort_error(stock, latent, t, text, ref64)
    ours = float((out.double() - ref64).abs().max())
    assert 0 < stock_err and ours <= 2 * stock_err, (ours, stock_err)
    # return_dict: diffusers' output type
    assert torch.equal(dropin(latent, t, text).sample, out)


# --------------------------------------------------------------------------------------------
# The pipelines
# --------------------------------------------------------------------------------------------

def _pipeline(transformer, transformer_2=None, cls=None):
    cls = cls or diffusers.WanPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=None,
               scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
               transformer=transformer, transformer_2=transformer_2,
               boundary_ratio=0.5 if transformer_2 is not None else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _counted(module, calls, name):
    forward = module.forward

    def wrapped(*a, **k):
        calls.append(name)
        return forward(*a, **k)

    module.forward = wrapped
    return module


STEPS, GUIDANCE = 4, 3.0


def _run(pipe, frames=9, height=48, width=32):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 11, 16, generator=g)
    negative = torch.randn(2, 11, 16, generator=g)
    return pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=height,
                width=width, num_frames=frames, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, output_type="latent",
                generator=torch.Generator().manual_seed(1)).frames


def _pipeline_bound(per_call: float) -> float:
    """Euler steps x += dsigma * v with CFG v = u + g (c - u): a per-call difference d moves v
    by <= (1 + 2g) d and x by |dsigma| (1 + 2g) d; over the steps sum |dsigma| <= 1; the
    model's own response to the moved x (its Lipschitz factor) gets a factor 2."""
    return 2 * (1 + 2 * GUIDANCE) * per_call


def _per_call(folder, path) -> float:
    """What one call may differ by on a call of the pipeline's size: torch's fp32 error vs
    float64 plus the drop-in's (<= 2 x ONNX Runtime's own on diffusers' export:
    test_ort_dropin_at_untraced_shapes), bounded here by the stock ORT export measured."""
    stock = _stock(folder)
    latent, text, t = _call(7, (3, 3, 2), 2, 11)
    with torch.no_grad():
        ref32 = stock(latent, t, text, return_dict=False)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               return_dict=False)[0]
    stock.float()
    e32 = float((ref32.double() - ref64).abs().max())
    return e32 + 2 * _stock_ort_error(stock, latent, t, text, ref64)


def test_wan_pipeline_end_to_end(exported):
    """WanPipeline (true CFG, a 9-frame 48x32 video: a grid of (3, 3, 2) patches, untraced)
    on the export against the same pipeline on diffusers' model."""
    from qkrope.runtime import load_transformer

    folder, path = exported[0]
    want = _run(_pipeline(_stock(folder)))
    calls = []
    got = _run(_pipeline(_counted(load_transformer(path), calls, "t1")))
    assert len(calls) == 2 * STEPS  # conditional and unconditional, every step
    assert got.shape == want.shape == (2, 4, 3, 6, 4)
    assert float((got - want).abs().max()) <= _pipeline_bound(_per_call(folder, path))


def test_wan22_two_experts_and_the_boundary_switch(exported):
    """Wan 2.2 A14B: transformer (high noise) and transformer_2 (low noise) are two exports;
    the pipeline's boundary_ratio switch calls each on its steps, as with diffusers' models."""
    from qkrope.runtime import load_transformer

    (f0, p0), (f1, p1) = exported[0], exported[1]
    stock_calls, calls = [], []
    want = _run(_pipeline(_counted(_stock(f0), stock_calls, "high"),
                          _counted(_stock(f1), stock_calls, "low")))
    got = _run(_pipeline(_counted(load_transformer(p0), calls, "high"),
                         _counted(load_transformer(p1), calls, "low")))
    assert calls == stock_calls and {"high", "low"} == set(calls)
    bound = _pipeline_bound(max(_per_call(f0, p0), _per_call(f1, p1)))
    assert float((got - want).abs().max()) <= bound


def test_video_to_video_pipeline(exported):
    """WanVideoToVideoPipeline: the input video's latents (VAE-free here: passed as latents)
    denoised on the export at an untraced grid."""
    from qkrope.runtime import load_transformer

    folder, path = exported[0]
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 4, 2, 8, 6, generator=g)
    embeds = torch.randn(1, 11, 16, generator=g)

    def run(transformer):
        pipe = diffusers.WanVideoToVideoPipeline(
            tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial = 4, 8
        return pipe(latents=latents.clone(), prompt_embeds=embeds, guidance_scale=1.0,
                    num_inference_steps=STEPS, strength=0.6, height=64, width=48,
                    output_type="latent").frames

    try:
        want = run(_stock(folder))
    except Exception as exc:  # noqa: BLE001 - the VAE-free call is not one diffusers supports
        pytest.skip(f"WanVideoToVideoPipeline needs its VAE in this diffusers "
                    f"({type(exc).__name__}: {str(exc)[:80]})")
    got = run(load_transformer(path))
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= _pipeline_bound(_per_call(folder, path))


def _i2v_frames(pipe, image, text_tokens: int):
    """An image-to-video pipeline's latent frames for ``image``: random prompt and negative
    embeddings of ``text_tokens`` (seed 0), 5 frames of 32 x 48, STEPS steps with CFG."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, text_tokens, 16, generator=g)
    negative = torch.randn(1, text_tokens, 16, generator=g)
    return pipe(image=image, prompt_embeds=embeds, negative_prompt_embeds=negative,
                height=32, width=48, num_frames=5, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, output_type="latent",
                generator=torch.Generator().manual_seed(1)).frames


def test_wan22_image_to_video_pipeline(root):
    """WanImageToVideoPipeline with a Wan 2.2 I2V-A14B-shaped model (the image's VAE latent and
    the first-frame mask enter as latent channels: in_channels 16 + 4 + 16 = 36), diffusers'
    tiny AutoencoderKLWan built in code, true CFG, a 5-frame 32x48 video (grid (2, 2, 3),
    untraced), on the export against the same pipeline on diffusers' model."""
    import PIL.Image

    from qkrope.export.onnx_export import export_transformer
    from qkrope.runtime import load_transformer

    folder, path = root / "wan-i2v", root / "wan-i2v.onnx"
    wan_transformer(0, in_channels=36, out_channels=16).save_pretrained(str(folder))
    export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                       progress=False)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                     num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    image = PIL.Image.fromarray(
        (np.random.RandomState(0).rand(32, 48, 3) * 255).astype("uint8"))

    def run(transformer):
        pipe = diffusers.WanImageToVideoPipeline(
            tokenizer=None, text_encoder=None, vae=vae, image_processor=None, image_encoder=None,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        return _i2v_frames(pipe, image, 11)

    want = run(_stock(folder))
    got = run(load_transformer(path))
    assert got.shape == want.shape == (1, 16, 2, 4, 6)
    stock = _stock(folder)
    g = torch.Generator().manual_seed(9)
    latent, text, t = (torch.randn(1, 36, 2, 4, 6, generator=g),
                       torch.randn(1, 11, 16, generator=g), torch.tensor([500.0]))
    with torch.no_grad():
        ref32 = stock(latent, t, text, return_dict=False)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               return_dict=False)[0]
    stock.float()
    per_call = float((ref32.double() - ref64).abs().max()) + 2 * _stock_ort_error(
        stock, latent, t, text, ref64)
    assert float((got - want).abs().max()) <= _pipeline_bound(per_call)


# --------------------------------------------------------------------------------------------
# Wan 2.1 I2V / FLF2V: the CLIP image branch
# --------------------------------------------------------------------------------------------

#: Wan 2.1 I2V's tiny model: diffusers' I2V pipeline-test transformer (tests/pipelines/wan/
#: test_wan_image_to_video.py: in_channels 16 + 4 + 16 = 36, out_channels 16, image_dim 4) on
#: the sizes above, with the attention's image branch (added_kv_proj_dim: the model width,
#: 2 x 12, as Wan 2.1 I2V-14B's 5120); FLF2V adds the image position embedding (two images of
#: 3 tokens side by side)
I2V = dict(in_channels=36, out_channels=16, image_dim=4, added_kv_proj_dim=24)
I2V_VARIANTS = {"i2v": I2V, "flf2v": dict(I2V, pos_embed_seq_len=6)}
TEXT = 512  # the I2V attention's text length (qkrope.families.wan.I2V_TEXT_TOKENS)


def i2v_transformer(seed=0, **config):
    """The tiny I2V / FLF2V model; FLF2V's position embedding random (diffusers zeroes it)."""
    model = wan_transformer(seed, **config)
    pos = model.condition_embedder.image_embedder.pos_embed
    if pos is not None:
        with torch.no_grad():
            pos.copy_(torch.randn(pos.shape, generator=torch.Generator().manual_seed(seed + 7)))
    return model


@pytest.fixture(scope="module")
def i2v_exported(root):
    """The tiny I2V and FLF2V models exported in fp32 (grid (2, 4, 6), batch 2; the text set
    to 512 tokens by the export, the image tokens 257 / FLF2V's 6)."""
    from qkrope.export.onnx_export import export_transformer

    out = {}
    for name, config in I2V_VARIANTS.items():
        folder, path = root / f"wan-{name}", root / f"wan-{name}.onnx"
        i2v_transformer(0, **config).save_pretrained(str(folder))
        export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                           progress=False)
        out[name] = (folder, path)
    return out


def _i2v_call(seed, name, grid, batch, image_tokens):
    """A call's latent, text (512 tokens), timestep and CLIP tokens (FLF2V: two images per
    item, [2 * batch, tokens, 4], as the pipeline passes them)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    latent = torch.randn(batch, 36, f * PATCH[0], h * PATCH[1], w * PATCH[2], generator=g)
    pair = 2 if "pos_embed_seq_len" in I2V_VARIANTS[name] else 1
    return (latent, torch.randn(batch, TEXT, 16, generator=g),
            torch.rand(batch, generator=g) * 999,
            torch.randn(pair * batch, image_tokens, 4, generator=g))


@pytest.mark.parametrize("name", list(I2V_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_i2v_patched_model_is_bit_exact_with_diffusers(i2v_exported, name, dtype):
    """The wrapper with the image branch (the image tokens embedded and joined before the
    text; the cross-attention's add_k_proj / norm_added_k / add_v_proj attention added to the
    text's) gives diffusers' bits at 512 text tokens, in every dtype."""
    from qkrope.families.wan.export import WanCacheInputTransformer
    from qkrope.runtime.caches import build_rope_caches

    folder, _ = i2v_exported[name]
    stock = _stock(folder, dtype)
    ours = WanCacheInputTransformer(_stock(folder, dtype)).eval()
    grid = (3, 4, 5)
    latent, text, t, image = (x.to(dtype) if x.is_floating_point() and x.dim() > 1 else x
                              for x in _i2v_call(3, name, grid, 2, 3))
    caches = build_rope_caches(WAN.scheme, {"img_shapes": [grid], "txt_seq_len": TEXT},
                               _setting())
    with torch.no_grad():
        want = stock(latent, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = unpack(ours(pack(latent, PATCH), text, t, caches.img, image.reshape(2, -1, 4)),
                     grid, PATCH)
    assert got.dtype == dtype and torch.equal(got, want)


def test_i2v_graph_and_inputs(i2v_exported):
    """The I2V graph: T2V's inputs and encoder_hidden_states_image [batch, image_embed_tokens,
    image_dim] (FLF2V: a static 2 x 3 tokens), one fused node per block (attn1; attn2 and its
    image branch unfused), the sample's text 512 tokens; make_inputs gives the image tokens at
    the export's length."""
    import onnx

    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    for name, tokens in (("i2v", "image_embed_tokens"), ("flf2v", 6)):
        _, path = i2v_exported[name]
        model = onnx.load(str(path))
        assert len([n for n in model.graph.node if n.op_type == contract.OP_TYPE]) == 2
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                for i in model.graph.input}
        assert dims == {"hidden_states": ["batch", "img_tokens", 36 * 4],
                        "encoder_hidden_states": ["batch", "txt_tokens", 16],
                        "timestep": ["batch"], "img_cos_sin_cache": ["img_cache_rows", 12],
                        "encoder_hidden_states_image": ["batch", tokens, 4]}
        info = ModelInfo.load(path)
        assert info.role_of("encoder_hidden_states_image") == "encoder_hidden_states_image"
        assert info.sample["txt_len"] == TEXT
        feeds = make_inputs(info, [(2, 3, 2)], batch=3)
        assert feeds["encoder_hidden_states_image"].shape == (
            (3, 257, 4) if name == "i2v" else (3, 6, 4))
        assert feeds["encoder_hidden_states"].shape == (3, TEXT, 16)


@pytest.mark.parametrize("name,image_tokens", [("i2v", 9), ("flf2v", 3)])
def test_i2v_ort_dropin_at_untraced_shapes(i2v_exported, name, image_tokens):
    """The drop-in with the CLIP tokens (I2V: 9 of them, untraced; FLF2V: [2 * batch, 3, 4])
    at an untraced grid and batch, against diffusers' forward in float64: <= 2 x the error of
    diffusers' own model exported by torch.onnx and run by ONNX Runtime at this shape (the
    bound of test_ort_dropin_at_untraced_shapes, same derivation)."""
    from qkrope.runtime import load_transformer

    folder, path = i2v_exported[name]
    dropin = load_transformer(path)
    stock = _stock(folder)
    latent, text, t, image = _i2v_call(5, name, (3, 5, 3), 3, image_tokens)
    with torch.no_grad():
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               encoder_hidden_states_image=image.double(),
                               return_dict=False)[0]
    stock.float()
    out = dropin(hidden_states=latent, timestep=t, encoder_hidden_states=text,
                 encoder_hidden_states_image=image, return_dict=False)[0]
    assert out.shape == ref64.shape == (3, 16, 3, 10, 6) and out.dtype == torch.float32
    stock_err = _stock_ort_error(stock, latent, t, text, ref64, image)
    ours = float((out.double() - ref64).abs().max())
    assert 0 < stock_err and ours <= 2 * stock_err, (ours, stock_err)


@pytest.mark.parametrize("name", list(I2V_VARIANTS))
def test_i2v_qkrope_check(i2v_exported, name, tmp_path, capsys):
    """``qkrope check`` on the I2V / FLF2V exports (its default text: 512 tokens, the model's
    reference hook) passes, whole and ``--blocks`` (each block's output: the image tokens are
    split off the joined context before the blocks, so each block has its one output);
    another text length is refused in one line (diffusers' forward, the reference, reads the
    image tokens only at 512)."""
    from qkrope.cli import main

    _, path = i2v_exported[name]
    rc = main(["check", str(path), "--img-shape", "3", "4", "5", "--workdir",
               str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert rc == 0 and "512 text tokens" in out and "PASSED" in out, out
    rc = main(["check", str(path), "--blocks", "--img-shape", "2", "3", "2", "--workdir",
               str(tmp_path / "c")])
    out = capsys.readouterr().out
    rows = [line.split()[2] for line in out.splitlines() if line.startswith("onnxrt")]
    assert rc == 0 and rows == ["sample", "block0.img", "block1.img"] and "PASSED" in out, out
    assert main(["check", str(path), "--txt-len", "9", "--workdir", str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err
    assert "--txt-len 512" in err and len(err.strip().splitlines()) == 1, err


def test_image_dim_without_the_branch(root):
    """diffusers' own I2V pipeline-test config (image_dim 4, no added_kv_proj_dim): the image
    tokens embedded and joined before the text, the cross-attention over both (no image
    branch, so no 512-token split): bit-exact with diffusers (bf16) and the drop-in at an
    untraced shape and an 11-token text within 2 x the stock ORT export's error."""
    from qkrope.export.onnx_export import export_transformer
    from qkrope.families.wan.export import WanCacheInputTransformer
    from qkrope.runtime import load_transformer
    from qkrope.runtime.caches import build_rope_caches

    folder, path = root / "wan-image-only", root / "wan-image-only.onnx"
    wan_transformer(0, in_channels=36, out_channels=16, image_dim=4).save_pretrained(str(folder))
    g = torch.Generator().manual_seed(4)
    latent, text, t, image = (torch.randn(2, 36, 3, 8, 10, generator=g),
                              torch.randn(2, 11, 16, generator=g), torch.tensor([700.0, 31.5]),
                              torch.randn(2, 5, 4, generator=g))
    caches = build_rope_caches(WAN.scheme, {"img_shapes": [(3, 4, 5)], "txt_seq_len": 11},
                               _setting())
    b16 = [x.to(torch.bfloat16) for x in (latent, text, image)]
    with torch.no_grad():
        want = _stock(folder, torch.bfloat16)(b16[0], t, b16[1], b16[2], return_dict=False)[0]
        ours = WanCacheInputTransformer(_stock(folder, torch.bfloat16)).eval()
        got = unpack(ours(pack(b16[0], PATCH), b16[1], t, caches.img, b16[2]), (3, 4, 5), PATCH)
    assert torch.equal(got, want)
    export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                       progress=False)
    stock = _stock(folder)
    with torch.no_grad():
        ref64 = stock.double()(latent.double(), t.double(), text.double(), image.double(),
                               return_dict=False)[0]
    stock.float()
    out = load_transformer(path)(latent, t, text, image, return_dict=False)[0]
    ours_err = float((out.double() - ref64).abs().max())
    stock_err = _stock_ort_error(stock, latent, t, text, ref64, image)
    assert 0 < stock_err and ours_err <= 2 * stock_err, (ours_err, stock_err)


@pytest.mark.slow
def test_i2v_fp8(i2v_exported, tmp_path, capsys):
    """FP8 on Wan 2.1 I2V (the slow step, as tests/test_families_fp8.py): calibration calls
    recorded with the CLIP tokens, ``qkrope quantize``, ``export --quant fp8`` (the image
    branch's projections quantised like the others; the fused nodes kept) and its check
    against ModelOpt's fake-quant model pass."""
    pytest.importorskip("modelopt.torch.quantization", reason="requires the fp8 extra")
    from qkrope.cli import main
    from qkrope.export import quantize
    from qkrope.export.patch_diffusers import load_transformer
    from qkrope.runtime.onnx_file import count_plugin_nodes

    folder, flt = i2v_exported["i2v"]
    model = load_transformer(str(folder))
    with quantize.CalibrationRecorder(model) as rec, torch.no_grad():
        for seed in range(2):
            latent, text, t, image = _i2v_call(seed, "i2v", (2, 3, 2), 1, 9)
            model(hidden_states=latent, timestep=t, encoder_hidden_states=text,
                  encoder_hidden_states_image=image, return_dict=False)
    rec.save(tmp_path / "calib.pt")
    qdir, out = tmp_path / "fp8", tmp_path / "fp8.onnx"
    assert main(["quantize", "--diffusers", str(folder), "--calibration",
                 str(tmp_path / "calib.pt"), "--out", str(qdir), "--device", "cpu"]) == 0
    assert main(["export", "--model", "transformer", "--diffusers", str(qdir), "--quant", "fp8",
                 "--dtype", "fp32", "--out", str(out)]) == 0
    from qkrope.sidecars import ModelInfo

    linears = ModelInfo.load(out).config.quantization["quantized_linears"]
    assert any("add_k_proj" in n for n in linears) and any("add_v_proj" in n for n in linears)
    assert len(list(count_plugin_nodes(out))) == len(list(count_plugin_nodes(flt))) == 2
    capsys.readouterr()
    assert main(["check", str(out), "--workdir", str(tmp_path / "c")]) == 0
    out_text = capsys.readouterr().out
    assert "PASSED" in out_text and "0 elements differ" in out_text, out_text


@pytest.mark.parametrize("name,change,match", [
    ("i2v", dict(encoder_hidden_states_image=None), "needs encoder_hidden_states_image"),
    ("i2v", dict(encoder_hidden_states_image=torch.zeros(2, 5, 4)), r"must be \[1, "),
    ("i2v", dict(encoder_hidden_states_image=torch.zeros(1, 5, 8)), r"must be \[1, "),
    ("i2v", dict(encoder_hidden_states_image=torch.zeros(5, 4)), "must be a 3-D tensor"),
    ("i2v", dict(encoder_hidden_states=torch.zeros(1, 11, 16)), "pad the prompt embeddings"),
    ("flf2v", dict(encoder_hidden_states_image=torch.zeros(1, 3, 4)), "FLF2V"),
])
def test_i2v_dropin_refusals_are_one_line(i2v_exported, name, change, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(i2v_exported[name][1])
    call = dict(hidden_states=torch.zeros(1, 36, 2, 4, 6), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.zeros(1, TEXT, 16),
                encoder_hidden_states_image=torch.zeros(2 if name == "flf2v" else 1, 3, 4),
                return_dict=False)
    call.update(change)
    with pytest.raises(InputError, match=match) as e:
        dropin(**call)
    assert "\n" not in str(e.value)


def test_wan21_image_to_video_pipeline(i2v_exported):
    """WanImageToVideoPipeline with Wan 2.1 I2V: the CLIP image tokens from a tiny
    CLIPVisionModelWithProjection and CLIPImageProcessor built in code (32 x 32 crops of 8 x 8
    patches: 17 tokens of width 4, untraced), the image's latent channels from diffusers' tiny
    AutoencoderKLWan, 512-token prompt embeddings, true CFG, a 5-frame 32x48 video (grid
    (2, 2, 3), untraced), on the export against the same pipeline on diffusers' model, within
    the bound of the Wan pipeline tests (_pipeline_bound of a per-call difference measured at
    this call's sizes)."""
    import PIL.Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    from qkrope.runtime import load_transformer

    folder, path = i2v_exported["i2v"]
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                     num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=8)).eval()
    processor = CLIPImageProcessor(crop_size=32, size=32)
    image = PIL.Image.fromarray(
        (np.random.RandomState(0).rand(32, 48, 3) * 255).astype("uint8"))
    seen = []

    def run(transformer):
        pipe = diffusers.WanImageToVideoPipeline(
            tokenizer=None, text_encoder=None, vae=vae, image_processor=processor,
            image_encoder=encoder, transformer=transformer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        forward = transformer.forward

        def counted(*a, **k):
            seen.append(tuple(k["encoder_hidden_states_image"].shape))
            return forward(*a, **k)

        transformer.forward = counted
        return _i2v_frames(pipe, image, TEXT)

    want = run(_stock(folder))
    got = run(load_transformer(path))
    assert got.shape == want.shape == (1, 16, 2, 4, 6)
    assert set(seen) == {(1, 17, 4)} and len(seen) == 4 * STEPS
    stock = _stock(folder)
    g = torch.Generator().manual_seed(9)
    latent, text, t, clip = (torch.randn(1, 36, 2, 4, 6, generator=g),
                             torch.randn(1, TEXT, 16, generator=g), torch.tensor([500.0]),
                             torch.randn(1, 17, 4, generator=g))
    with torch.no_grad():
        ref32 = stock(latent, t, text, clip, return_dict=False)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(), clip.double(),
                               return_dict=False)[0]
    stock.float()
    per_call = float((ref32.double() - ref64).abs().max()) + 2 * _stock_ort_error(
        stock, latent, t, text, ref64, clip)
    assert float((got - want).abs().max()) <= _pipeline_bound(per_call)


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(encoder_hidden_states_image=torch.zeros(1, 257, 8)), "this export has no image "
                                                               "branch"),
    (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
    (dict(timestep=torch.tensor([[500.0] * 12 + [0.0] * 12])), "expand_timesteps"),
    (dict(hidden_states=torch.zeros(1, 4, 2, 5, 4)), "height axis .5. is not a whole number"),
    (dict(hidden_states=torch.zeros(1, 24, 16)), "must be a 5-D tensor"),
    (dict(img_ids=torch.zeros(3, 3)), "received img_ids"),
])
def test_dropin_refusals_are_one_line(exported, kwargs, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported[0][1])
    call = dict(hidden_states=torch.zeros(1, 4, 2, 4, 6), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.zeros(1, 5, 16), return_dict=False)
    call.update(kwargs)
    with pytest.raises(InputError, match=match) as e:
        dropin(**call)
    assert "\n" not in str(e.value)


def test_uniform_per_token_timesteps_are_one_per_sample(exported):
    """TI2V-5B's text-to-video passes [batch, tokens] equal timesteps: the same as [batch]."""
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported[0][1])
    latent, text, _ = _call(3, (2, 2, 3), 1, 5)
    one = dropin(latent, torch.tensor([321.0]), text, return_dict=False)[0]
    per_token = dropin(latent, torch.full((1, 12), 321.0), text, return_dict=False)[0]
    assert torch.equal(one, per_token)


def test_export_refusals(tmp_path):
    """An image branch in the attention without the image embedder (added_kv_proj_dim without
    image_dim: diffusers' forward cannot feed it) or of another width than the model's, FLF2V's
    position embedding without the image embedder, and a derivative class the folder cannot
    serve (Wan-Animate, in its REFUSED): one line each, before any work."""
    from qkrope.export.onnx_export import export_transformer

    for i, (config, match) in enumerate([
            (dict(added_kv_proj_dim=24), "added_kv_proj_dim 24 with image_dim None"),
            (dict(image_dim=4, added_kv_proj_dim=12), "added_kv_proj_dim 12 with image_dim 4"
                                                      ".*model width 24"),
            (dict(pos_embed_seq_len=6), "pos_embed_seq_len 6 without image_dim")]):
        folder = tmp_path / f"i2v-{i}"
        wan_transformer(0, **config).save_pretrained(str(folder))
        with pytest.raises(InputError, match=match) as e:
            export_transformer(tmp_path / "x.onnx", folder, progress=False)
        assert "\n" not in str(e.value)
    animate = tmp_path / "animate"
    animate.mkdir()
    (animate / "config.json").write_text(
        json.dumps({"_class_name": "WanAnimateTransformer3DModel"}))
    with pytest.raises(InputError, match="WanAnimateTransformer3DModel.*face") as e:
        export_transformer(tmp_path / "y.onnx", animate, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x.onnx").exists() and not (tmp_path / "y.onnx").exists()


def test_the_builder_is_registered():
    assert BUILDERS["wan"].record is WAN and WAN.blocks is True
    assert [tuple(b) for b in WAN.block_lists] == [("blocks", "num_layers", ("img",), True)]


def test_layers_and_blocks(exported, tmp_path, capsys):
    """``--blocks`` and ``--layers`` on Wan (the record's one list, ``blocks``, each returning
    the video tokens): check --blocks at an untraced grid compares each block's output with
    the one-block-resident reference; export --layers 1 keeps one block (one fused node) and
    the model's head, and its check passes with the default one-grid sample; --layers past
    the model's blocks is refused in one line before any work."""
    import onnx

    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    folder, path = exported[0]
    rc = main(["check", str(path), "--blocks", "--img-shape", "3", "4", "5", "--txt-len", "9",
               "--workdir", str(tmp_path / "a")])
    out = capsys.readouterr().out
    rows = [line.split()[2] for line in out.splitlines() if line.startswith("onnxrt")]
    assert rc == 0 and rows == ["sample", "block0.img", "block1.img"] and "PASSED" in out, out
    one = tmp_path / "l1.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--dtype",
                 "fp32", "--layers", "1", "--out", str(one)]) == 0
    capsys.readouterr()
    assert ModelInfo.load(one).config.num_layers_exported == 1
    nodes = [n for n in onnx.load(str(one), load_external_data=False).graph.node
             if n.op_type == contract.OP_TYPE]
    assert len(nodes) == 1
    assert main(["check", str(one), "--workdir", str(tmp_path / "b")]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers",
                 "3", "--out", str(tmp_path / "l3.onnx")]) != 0
    err = capsys.readouterr().err
    assert "--layers 3: the model has 2 blocks" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "l3.onnx").exists()


def test_qkrope_check(exported, tmp_path, capsys):
    """``qkrope check`` on a Wan export: diffusers' forward on the 5-D latent of the grid, its
    output in the graph's packed layout (reference.graph_output), ONNX Runtime's run within
    check's tolerance."""
    from qkrope.cli import main

    _, path = exported[0]
    rc = main(["check", str(path), "--img-shape", "3", "4", "5", "--txt-len", "9",
               "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "WanTransformer3DModel.forward" in out and "PASSED" in out, out
