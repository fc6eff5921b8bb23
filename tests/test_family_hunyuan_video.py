"""HunyuanVideo-1.5 and HunyuanVideo (qkrope/families/hunyuan_video): the caches against
diffusers' RoPE, the patched forward bit for bit against diffusers' own in fp32, bf16 and fp16,
HunyuanVideo-1.5's text reorder, qkrope's export run by ONNX Runtime at shapes it never traced,
the drop-in (and the four pipelines on it end to end: HunyuanVideo15Pipeline,
HunyuanVideo15ImageToVideoPipeline, HunyuanVideoPipeline, HunyuanVideoImageToVideoPipeline)
and the refusals. Tiny models at diffusers' own test sizes (tests/_hunyuan_video_models.py);
the pipelines' other models (VAEs, a SigLIP image encoder) built from configs in code."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import _hunyuan_video_models as hvm  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.hunyuan_video import HUNYUAN_VIDEO, HUNYUAN_VIDEO15  # noqa: E402
from qkrope.families.hunyuan_video import export as hx  # noqa: E402

RECORDS = {"hunyuan-video-1.5": HUNYUAN_VIDEO15, "hunyuan-video": HUNYUAN_VIDEO}
VARIANTS = list(RECORDS)


def _text_tokens(kw: dict) -> int:
    """The text stream's tokens: HunyuanVideo-1.5 joins MLLM, ByT5 and image tokens."""
    return sum(int(kw[n].shape[1]) for n in ("encoder_hidden_states", "encoder_hidden_states_2",
                                             "image_embeds") if n in kw)


def _diffusers_cache(model, latent) -> torch.Tensor:
    """diffusers' own RoPE tables of this latent as the node's cache: its (cos, sin) pairs are
    repeated per pair (interleaved), so every second column is the cos / sin half."""
    cos, sin = model.rope(latent)
    return torch.cat([cos[:, ::2], sin[:, ::2]], dim=1).float().contiguous()


def _graph_args(record, kw, img, txt) -> list:
    """The graph's inputs from diffusers' forward keywords (its ``latent`` is diffusers'
    ``hidden_states``), then the two caches."""
    names = [t.name for t in record.decl(True).inputs][:-2]
    return [kw["hidden_states" if n == "latent" else n] for n in names] + [img, txt]


# --------------------------------------------------------------------------------------------
# The caches
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_caches_are_diffusers_tables_within_one_float32_ulp(variant):
    """The angles (float32 frequencies 1 / theta ** (2i / d) and their float32 products with the
    positions) are diffusers'; their cos and sin are the C library's cosf / sinf, diffusers'
    are torch's vectorised CPU cos / sin (MKL or SLEEF by CPU dispatch: they differ between
    AVX2 and AVX-512 on one machine), so entries may differ by one float32 ulp and by no more.
    The text rows are the identity (cos 1, sin 0): the text is normalised, not rotated."""
    record = RECORDS[variant]
    model = hvm.transformer(variant)
    axes, theta = hx.rope_setting(model)
    assert tuple(model.config["rope_axes_dim"]) == axes and theta == 256
    for f, h, w in [(1, 8, 8), (3, 4, 6), (31, 45, 80)]:
        latent = torch.zeros(1, 1, f, h, w)
        ref = _diffusers_cache(model, latent).numpy()
        img, txt = hx.sample_caches(record, (f, h, w), 5, axes, theta)
        img = img.numpy()
        assert img.shape == ref.shape == (f * h * w, sum(axes))
        ulp = np.spacing(np.abs(ref).astype(np.float32))
        assert (np.abs(img - ref) <= ulp).all()
        half = sum(axes) // 2
        assert (txt[:, :half] == 1).all() and (txt[:, half:] == 0).all()


def test_a_long_text_needs_no_position_table():
    """The text is not rotated, so no table bounds its length (the grid scheme's text check is
    for a rotated text); the latent grid is bounded by the record's table (1024 per axis)."""
    from qkrope.runtime.caches import RopeCacheOverflowError

    img, txt = hx.sample_caches(HUNYUAN_VIDEO15, (2, 3, 4), 5000, (2, 2, 4), 256)
    assert txt.shape == (5000, 8)
    with pytest.raises(RopeCacheOverflowError, match="image cache overflow"):
        hx.sample_caches(HUNYUAN_VIDEO15, (1, 2000, 4), 5, (2, 2, 4), 256)


# --------------------------------------------------------------------------------------------
# The patched forward against diffusers'
# --------------------------------------------------------------------------------------------

# HunyuanVideo has no image embeddings (its image-to-video concatenates latents: in_channels)
@pytest.mark.parametrize("variant,i2v", [("hunyuan-video-1.5", False), ("hunyuan-video-1.5", True),
                                         ("hunyuan-video", False)],
                         ids=["hunyuan-video-1.5-t2v", "hunyuan-video-1.5-i2v", "hunyuan-video"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_patched_forward_is_bit_exact(variant, dtype, i2v):
    """The cache-input wrapper (fused nodes, identity text rows, the reordered text, the
    exported masks' eager form) against diffusers' forward, both given diffusers' own RoPE
    tables: equal bit for bit in fp32, and in bf16 and fp16 with the node's rounding 1
    (ROUNDING_EACH_STEP: diffusers' RMSNorm rounds the normalised value and its product with
    the weight, apply_rotary_emb rotates in fp32 and rounds; the same operations in the same
    order). HunyuanVideo-1.5 with zero (text-to-video) and non-zero image embeddings; padded
    text in one batch item, padded ByT5 tokens in the other."""
    record = RECORDS[variant]
    model = hvm.transformer(variant).to(dtype)
    kw = hvm.inputs(variant, dtype=dtype, i2v=i2v)
    wrapper = hx.cache_input_hunyuan(copy.deepcopy(model), record)
    assert wrapper.rounding == 1
    _, txt = hx.sample_caches(record, (3, 4, 6), _text_tokens(kw), *hx.rope_setting(model))
    with torch.no_grad():
        want = model(**kw, return_dict=False)[0]
        got = wrapper(*_graph_args(record, kw, _diffusers_cache(model, kw["hidden_states"]),
                                   txt))
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_with_qkrope_caches_the_prediction_stays_within_the_cache_ulp(variant):
    """With qkrope's caches in place of diffusers' tables (one float32 ulp apart on some
    entries, test above) the fp32 prediction moves by what that perturbation makes of it: at
    most the effect of a 2^-23 relative change of every rotation, measured here against the
    same model run with the tables perturbed by one ulp everywhere (an upper bound of it)."""
    record = RECORDS[variant]
    model = hvm.transformer(variant)
    kw = hvm.inputs(variant)
    wrapper = hx.cache_input_hunyuan(copy.deepcopy(model), record)
    axes, theta = hx.rope_setting(model)
    img, txt = hx.sample_caches(record, (3, 4, 6), _text_tokens(kw), axes, theta)
    ref = _diffusers_cache(model, kw["hidden_states"])
    bumped = torch.from_numpy(np.nextafter(ref.numpy(), np.float32(2)))
    with torch.no_grad():
        base = wrapper(*_graph_args(record, kw, ref, txt))
        ours = wrapper(*_graph_args(record, kw, img, txt))
        worst = wrapper(*_graph_args(record, kw, bumped, txt))
    bound = float((worst - base).abs().max())
    assert 0 < bound and float((ours - base).abs().max()) <= 2 * bound


def test_text_reorder_is_diffusers_stable_partition():
    """reorder_text against diffusers' per-item boolean indexing, with random masks."""
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        parts = [torch.randn(3, n, 4, generator=g) for n in (3, 5, 7)]
        masks = [torch.rand(3, p.shape[1], generator=g) > 0.4 for p in parts]
        got, mask = hx.reorder_text(parts, masks)
        for b in range(3):
            valid = torch.cat([p[b][m[b]] for p, m in zip(parts, masks)])
            padded = torch.cat([p[b][~m[b]] for p, m in zip(parts, masks)])
            assert torch.equal(got[b], torch.cat([valid, padded]))
            assert mask[b].tolist() == [True] * len(valid) + [False] * len(padded)


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,overrides,match", [
    ("hunyuan-video-1.5", dict(use_meanflow=True), "use_meanflow"),
    ("hunyuan-video", dict(image_condition_type="token_replace", in_channels=2),
     "token_replace"),
])
def test_unsupported_configs_are_refused_in_one_line(variant, overrides, match):
    model = hvm.transformer(variant, **overrides)
    with pytest.raises(InputError, match=match) as e:
        hx.cache_input_hunyuan(model, RECORDS[variant])
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)


def test_the_patched_attention_refuses_diffusers_rope():
    model = hvm.transformer("hunyuan-video-1.5")
    wrapper = hx.cache_input_hunyuan(model, HUNYUAN_VIDEO15)
    attn = wrapper.transformer.transformer_blocks[0].attn
    x = torch.randn(1, 4, 16)
    with pytest.raises(InputError, match="HunyuanRope"):
        attn(x, x, attention_mask=torch.ones(1, 4, dtype=torch.bool), image_rotary_emb=None)


# --------------------------------------------------------------------------------------------
# The ONNX graph, run by ONNX Runtime at untraced shapes
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hunyuan-onnx")
    done: dict = {}

    def get(variant, fused=True):
        """qkrope's export (``export_transformer`` of the saved tiny model, its default
        sample); ``fused=False``: the same export with diffusers' norm and rotation in place of
        the nodes (the family's ``plan(fused=False)``), the reference graph."""
        from unittest import mock

        from qkrope.export.onnx_export import export_transformer

        key = (variant, fused)
        if key not in done:
            path = root / f"{variant}-{'fused' if fused else 'reference'}.onnx"
            folder = root / variant
            if not folder.exists():
                hvm.transformer(variant).save_pretrained(str(folder))
            plan = hx.plan if fused else functools.partial(hx.plan, fused=False)
            with mock.patch.object(hx, "plan", plan):
                info, _ = export_transformer(path, folder, dtype="fp32", progress=False)
            done[key] = (hvm.transformer(variant), RECORDS[variant].decl(True), path, info)
        return done[key]
    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_qkrope_export_writes_the_5d_graph(exported, variant):
    """``export_transformer`` of a HunyuanVideo folder: the record's graph with the 5-D latent
    in and out under its named axes (traced at the default sample, 1 frame traced as 2), the
    ByT5 and image lengths by name, one node per stream per attention, the family's sidecar."""
    model, decl, path, info = exported(variant)
    shapes = {t.name: t.shape for t in info.inputs + info.outputs}
    video = ["batch", 4, "latent_frames", "latent_height", "latent_width"]
    assert [t.name for t in info.inputs] == list(decl.input_names)
    assert shapes["latent"] == shapes["latent_sample"] == video
    assert shapes["encoder_attention_mask"] == ["batch", "txt_tokens"]
    if variant == "hunyuan-video-1.5":
        assert shapes["encoder_hidden_states_2"] == ["batch", "txt2_tokens", 8]
        assert shapes["image_embeds"] == ["batch", "image_embed_tokens", 12]
    assert info.config.family == RECORDS[variant].name
    assert info.config.axes_dims_rope == list(hvm.VARIANTS[variant][1]["rope_axes_dim"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_onnx_runtime_at_untraced_shapes(exported, variant):
    """qkrope's export (traced at batch 2, a 2 x 8 x 8 latent, 16 text tokens) run by ONNX
    Runtime at
    other batches, frame counts, sizes and text lengths, against diffusers' forward in float64
    (its RoPE tables float32, as diffusers computes them): the error is at most twice that of
    the reference graph, the same export with diffusers' norm and rotation in place of the
    nodes, run by ONNX Runtime on the same caches. Both graphs are the same fp32 arithmetic but
    for the norm + RoPE step (the node vs diffusers' operations, equal in fp32 eager: the
    bit-exact test above), so their errors are ONNX Runtime's kernels' rounding of one function
    (about ten times the eager forward's here: its kernels, not the node); the factor 2 leaves
    the node's function body at most as much rounding again. The graph has one node per stream
    per attention and no float64."""
    import onnx
    import onnxruntime as ort

    record = RECORDS[variant]
    model, decl, path, _ = exported(variant)
    _, _, ref_path, _ = exported(variant, fused=False)
    graph = onnx.load(str(path))
    nodes = [n for n in graph.graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == hx.node_count(model)
    assert not [n for n in onnx.load(str(ref_path)).graph.node if n.op_type == "QKNormRoPE"]
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
                for p in (path, ref_path)]
    axes, theta = hx.rope_setting(model)
    for batch, f, h, w, txt in [(1, 2, 6, 4, 9), (3, 5, 3, 5, 4)]:
        kw = hvm.inputs(variant, batch=batch, frames=f, height=h, width=w, txt=txt, txt2=6,
                        image=2, i2v=batch == 3)
        img, txt_cache = hx.sample_caches(record, (f, h, w), _text_tokens(kw), axes, theta)
        feeds = dict(zip(decl.input_names, _graph_args(record, kw, img, txt_cache)))
        feeds = {n: (v.to(torch.int64) if "mask" in n else v).numpy() for n, v in feeds.items()}
        ours, reference = (s.run(None, feeds)[0] for s in sessions)
        with torch.no_grad():
            ref64 = copy.deepcopy(model).double()(
                **{k: v.double() for k, v in kw.items()}, return_dict=False)[0].numpy()
        assert ours.shape == ref64.shape == (batch, 4, f, h, w)
        reference_err = float(np.abs(reference - ref64).max())
        ours_err = float(np.abs(ours - ref64).max())
        assert 0 < reference_err and ours_err <= 2 * reference_err, (ours_err, reference_err)


# --------------------------------------------------------------------------------------------
# The drop-in: its checks (on a stand-in runner), then running the export
# --------------------------------------------------------------------------------------------

def _dropin(variant):
    from types import SimpleNamespace

    from qkrope import families

    record = RECORDS[variant]
    _, cfg = hvm.VARIANTS[variant]
    config = SimpleNamespace(diffusers_config={**cfg, "_class_name": record.class_name},
                             num_layers_exported=None, axes_dims_rope=list(cfg["rope_axes_dim"]),
                             rope_theta=256, family=record.name)
    spec = SimpleNamespace(dtype="fp32")
    io = SimpleNamespace(config=config, roles={"timestep": "timestep",
                                               "hidden_states": "hidden_states"},
                         input=lambda name: spec, head_dim=cfg["attention_head_dim"],
                         source="stand-in.onnx")
    runner = SimpleNamespace(io=io, device=torch.device("cpu"), backend="stand-in")
    return families.hooks(record, "dropin").dropin_class(record)(runner, record)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dropin_maps_a_pipeline_call_onto_the_graph(variant):
    """A pipeline's call is bound to diffusers' argument names, checked, and its caches built
    (the latent's grid, the joined text length)."""
    transformer = _dropin(variant)
    kw = hvm.inputs(variant)
    call = transformer.prepare(**kw)
    assert call.request == {"img_shapes": [(3, 4, 6)], "txt_seq_len": _text_tokens(kw)}
    caches = transformer.rope_caches(call)
    img, txt = hx.sample_caches(RECORDS[variant], (3, 4, 6), _text_tokens(kw),
                                *hx.rope_setting(hvm.transformer(variant)))
    assert torch.equal(caches.img, img) and torch.equal(caches.txt, txt)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_dropin_runs_the_export_at_untraced_shapes(exported, variant):
    """``load_transformer(export)`` called as the pipelines call ``pipe.transformer`` (diffusers'
    keywords, float masks) at a batch, frame count, size and text lengths the export was not
    traced at: its prediction is ONNX Runtime's run of the same graph on the same inputs and
    the caches of the call's grid, bit for bit (the drop-in adds no arithmetic), and diffusers'
    prediction's shape; ``return_dict`` is honoured."""
    import onnxruntime as ort

    from qkrope.runtime import load_transformer

    record = RECORDS[variant]
    model, decl, path, _ = exported(variant)
    dropin = load_transformer(path)
    kw = hvm.inputs(variant, batch=3, frames=5, height=3, width=5, txt=9, txt2=6, image=2)
    ours = dropin(**kw, return_dict=False)[0]
    assert torch.equal(dropin(**kw).sample, ours)
    img, txt = hx.sample_caches(record, (5, 3, 5), _text_tokens(kw), *hx.rope_setting(model))
    feeds = dict(zip(decl.input_names, _graph_args(record, kw, img, txt)))
    feeds = {n: (v.to(torch.int64) if "mask" in n else v).numpy() for n, v in feeds.items()}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = torch.from_numpy(session.run(None, feeds)[0])
    assert torch.equal(ours, expected)
    with torch.no_grad():
        assert ours.shape == model(**kw, return_dict=False)[0].shape == (3, 4, 5, 3, 5)


@pytest.mark.parametrize("variant,change,match", [
    ("hunyuan-video-1.5", dict(timestep_r=torch.ones(2)), "timestep_r"),
    ("hunyuan-video-1.5", dict(image_embeds=None), "image_embeds"),
    ("hunyuan-video-1.5", dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
    ("hunyuan-video", dict(guidance=None), "guidance"),
    ("hunyuan-video", dict(img_ids=torch.zeros(4, 3)), "img_ids"),
    ("hunyuan-video", dict(hidden_states=torch.zeros(2, 72, 4)), "5-D"),
])
def test_dropin_refuses_what_the_graph_cannot_take_in_one_line(variant, change, match):
    transformer = _dropin(variant)
    kw = {**hvm.inputs(variant), **change}
    with pytest.raises(InputError, match=match) as e:
        transformer(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_listed_input_forms_mean_the_same_to_diffusers(variant):
    """tests/_input_forms.py's forms of these families (the drop-in is run on them once the
    export takes 5-D graphs): diffusers reads each as the base call, bit for bit."""
    from _input_forms import FORMS

    model = hvm.transformer(variant)
    forms = FORMS[variant](model, 2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(**forms["base"])[0]
        for name, kwargs in forms["same"]:
            assert torch.equal(model(**kwargs)[0], base), name


def _stock_and_dropin(tmp_path, stock, run, factor):
    """``run(transformer)`` (a pipeline run, output_type="latent", two steps) with the stock
    transformer and with ``load_transformer`` of its qkrope export (fp32, ONNX Runtime), and
    the bound of their difference. The bound: each transformer call of the stock run, replayed
    on the drop-in, differs by at most E (ONNX Runtime's kernels); the guided prediction by at
    most ``factor`` E (CFG's u + s (c - u): 1 + 2 s; no CFG: 1); the Euler steps add it times
    |d sigma|, which sums to 1 over the schedule (sigma 1 -> 0); a factor 2 for the difference
    fed back through the later calls (two steps: one feedback). Returns (ours, ref, the stock
    run's calls, the largest difference, the bound)."""
    from qkrope.export.onnx_export import export_transformer
    from qkrope.runtime import load_transformer

    stock.save_pretrained(str(tmp_path / "t"))
    export_transformer(tmp_path / "t.onnx", tmp_path / "t", dtype="fp32", progress=False)
    dropin = load_transformer(tmp_path / "t.onnx")
    calls = []
    hook = stock.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    with torch.no_grad():
        ref = run(stock)
    hook.remove()
    ours = run(dropin)
    with torch.no_grad():
        per_call = max(float((dropin(**kw)[0] - stock(**kw)[0]).abs().max()) for kw in calls)
    return ours, ref, calls, float((ours - ref).abs().max()), 2 * factor * per_call


@pytest.mark.slow
def test_text_to_video_pipeline_end_to_end(tmp_path):
    """``pipe.transformer = load_transformer(export)`` in HunyuanVideo15Pipeline (text-to-video,
    classifier-free guidance, prompt embeddings given: the text encoders are not run; a tiny
    VAE only for its sizes, output_type="latent") at 9 frames, 48 x 80 pixels (a 3 x 3 x 5
    latent; the export is traced at 2 x 8 x 8) against the stock pipeline, within the bound
    derived in :func:`_stock_and_dropin` (CFG scale 6: 2 (1 + 2 s) E)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance,
                           FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline)

    stock = hvm.transformer("hunyuan-video-1.5", in_channels=9, out_channels=4)  # T2V: 2C + 1
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5,
                                      layers_per_block=1)
    scale = 6.0
    g = torch.Generator().manual_seed(0)
    embeds = dict(
        prompt_embeds=torch.randn(1, 7, 16, generator=g),
        prompt_embeds_mask=torch.tensor([[1] * 5 + [0] * 2]),
        prompt_embeds_2=torch.randn(1, 5, 8, generator=g),
        prompt_embeds_mask_2=torch.tensor([[1] * 3 + [0] * 2]),
        negative_prompt_embeds=torch.randn(1, 4, 16, generator=g),
        negative_prompt_embeds_mask=torch.ones(1, 4, dtype=torch.long),
        negative_prompt_embeds_2=torch.randn(1, 3, 8, generator=g),
        negative_prompt_embeds_mask_2=torch.ones(1, 3, dtype=torch.long))

    def run(transformer):
        pipe = HunyuanVideo15Pipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
            tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=scale))
        pipe.set_progress_bar_config(disable=True)
        return pipe(**embeds, height=48, width=80, num_frames=9, num_inference_steps=2,
                    output_type="latent", generator=torch.Generator().manual_seed(1)).frames

    ours, ref, calls, diff, bound = _stock_and_dropin(tmp_path, stock, run, 1 + 2 * scale)
    assert ours.shape == ref.shape == (1, 4, 3, 3, 5) and len(calls) == 4
    assert 0 < diff <= bound, (diff, bound)


# --------------------------------------------------------------------------------------------
# The other pipelines end to end: HunyuanVideoPipeline, HunyuanVideoImageToVideoPipeline,
# HunyuanVideo15ImageToVideoPipeline (embeddings given, every model built from a config in code)
# --------------------------------------------------------------------------------------------

def _hunyuan_video_vae():
    """A tiny AutoencoderKLHunyuanVideo (diffusers' pipeline test's sizes): 8x spatial, 4x
    temporal; only its sizes (text-to-video) and its image encoding (image-to-video) are
    used, output_type="latent"."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8,) * 4,
                                     layers_per_block=1, norm_num_groups=4).eval()


def _hunyuan_video_embeds(batch: int, cfg: bool) -> dict:
    """HunyuanVideoPipeline's prompt embeddings (Llama [batch, tokens, 16], its mask with a
    padded last item, pooled CLIP [batch, 8]) and, with ``cfg``, the negative ones."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, 7, dtype=torch.long)
    mask[-1, 4:] = 0
    out = dict(prompt_embeds=torch.randn(batch, 7, 16, generator=g),
               pooled_prompt_embeds=torch.randn(batch, 8, generator=g),
               prompt_attention_mask=mask)
    if cfg:
        out.update(negative_prompt_embeds=torch.randn(batch, 4, 16, generator=g),
                   negative_pooled_prompt_embeds=torch.randn(batch, 8, generator=g),
                   negative_prompt_attention_mask=torch.ones(batch, 4, dtype=torch.long))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("batch,cfg,frames,height,width", [
    (1, True, 9, 48, 32), (3, False, 5, 32, 48)], ids=["batch1-true-cfg", "batch3-no-cfg"])
def test_hunyuan_video_pipeline_end_to_end(tmp_path, batch, cfg, frames, height, width):
    """``pipe.transformer = load_transformer(export)`` in HunyuanVideoPipeline (text-to-video,
    the tiny model's guidance embeddings: guidance 6 embedded; prompt embeddings given, the
    text encoders and tokenizers None) at a batch, frame count and size the export was not
    traced at (traced: batch 2, a 2 x 8 x 8 latent, 16 text tokens), with and without true CFG
    (true_cfg_scale 4 and negative embeddings), against the stock pipeline within the bound
    derived in :func:`_stock_and_dropin`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    stock = hvm.transformer("hunyuan-video")
    assert stock.config.guidance_embeds
    vae = _hunyuan_video_vae()
    scale = 4.0 if cfg else 1.0

    def run(transformer):
        pipe = HunyuanVideoPipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
            tokenizer_2=None)
        pipe.set_progress_bar_config(disable=True)
        return pipe(**_hunyuan_video_embeds(batch, cfg), true_cfg_scale=scale,
                    guidance_scale=6.0, height=height, width=width, num_frames=frames,
                    num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(1)).frames

    ours, ref, calls, diff, bound = _stock_and_dropin(tmp_path, stock, run,
                                                      1 + 2 * scale if cfg else 1)
    grid = ((frames - 1) // 4 + 1, height // 8, width // 8)
    assert ours.shape == ref.shape == (batch, 4, *grid)
    assert len(calls) == (4 if cfg else 2)
    assert all(kw["guidance"] is not None for kw in calls)
    assert 0 < diff <= bound, (diff, bound)


@pytest.mark.slow
def test_hunyuan_video_image_to_video_pipeline_end_to_end(tmp_path):
    """``pipe.transformer = load_transformer(export)`` in HunyuanVideoImageToVideoPipeline with
    the latent_concat transformer (HunyuanVideo-I2V's: 2 C + 1 input channels, the image
    latent and its first-frame mask concatenated to the noise latent; no guidance
    embeddings), three images encoded by the tiny VAE, prompt embeddings given (the
    Llava/CLIP encoders and the image processor None), true CFG (scale 4), 9 frames at 48 x 32
    pixels (a 3 x 6 x 4 latent) and batch 3, against the stock pipeline within the bound
    derived in :func:`_stock_and_dropin`. (The token_replace transformer is refused at export:
    test_pipeline_models_the_export_does_not_carry_are_refused_in_one_line.)"""
    import PIL.Image
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoImageToVideoPipeline

    stock = hvm.transformer("hunyuan-video", in_channels=9, guidance_embeds=False,
                            image_condition_type="latent_concat")
    vae = _hunyuan_video_vae()
    rng = np.random.RandomState(0)
    images = [PIL.Image.fromarray((rng.rand(48, 32, 3) * 255).astype(np.uint8))
              for _ in range(3)]
    scale = 4.0

    def run(transformer):
        pipe = HunyuanVideoImageToVideoPipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
            tokenizer_2=None, image_processor=None)
        pipe.set_progress_bar_config(disable=True)
        return pipe(image=images, **_hunyuan_video_embeds(3, True), true_cfg_scale=scale,
                    height=48, width=32, num_frames=9, num_inference_steps=2,
                    output_type="latent", generator=torch.Generator().manual_seed(1)).frames

    ours, ref, calls, diff, bound = _stock_and_dropin(tmp_path, stock, run, 1 + 2 * scale)
    # the output drops the image's latent frame
    assert ours.shape == ref.shape == (3, 4, 2, 6, 4) and len(calls) == 4
    assert all(tuple(kw["hidden_states"].shape) == (3, 9, 3, 6, 4) and kw["guidance"] is None
               for kw in calls)
    assert 0 < diff <= bound, (diff, bound)


@pytest.mark.slow
def test_hunyuan_video15_image_to_video_pipeline_end_to_end(tmp_path):
    """``pipe.transformer = load_transformer(export)`` in HunyuanVideo15ImageToVideoPipeline: a
    tiny SigLIP vision model and image processor built from configs in code (12-wide image
    embeddings, 4 tokens: the export was traced with 3), the tiny VAE encoding the image
    (48 x 80 pixels: the pipeline's crop bucket of target_size 64, a 3 x 3 x 5 latent for 9
    frames), prompt embeddings given (the text encoders None), batch 3, classifier-free
    guidance (the guider, scale 6), against the stock pipeline within the bound derived in
    :func:`_stock_and_dropin`. The transformer calls carry non-zero image_embeds and
    timestep_r=None."""
    import PIL.Image
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance,
                           FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline)
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    stock = hvm.transformer("hunyuan-video-1.5", in_channels=9, out_channels=4, target_size=64,
                            task_type="i2v")
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5,
                                      layers_per_block=1).eval()
    encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=12, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=16, patch_size=8)).eval()
    features = SiglipImageProcessor(size={"height": 16, "width": 16})
    image = PIL.Image.fromarray((np.random.RandomState(0).rand(48, 80, 3) * 255)
                                .astype(np.uint8))
    scale = 6.0
    g = torch.Generator().manual_seed(0)
    embeds = dict(
        prompt_embeds=torch.randn(3, 7, 16, generator=g),
        prompt_embeds_mask=torch.tensor([[1] * 7, [1] * 7, [1] * 5 + [0] * 2]),
        prompt_embeds_2=torch.randn(3, 5, 8, generator=g),
        prompt_embeds_mask_2=torch.tensor([[1] * 3 + [0] * 2] + [[1] * 5] * 2),
        negative_prompt_embeds=torch.randn(3, 4, 16, generator=g),
        negative_prompt_embeds_mask=torch.ones(3, 4, dtype=torch.long),
        negative_prompt_embeds_2=torch.randn(3, 3, 8, generator=g),
        negative_prompt_embeds_mask_2=torch.ones(3, 3, dtype=torch.long))

    def run(transformer):
        pipe = HunyuanVideo15ImageToVideoPipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
            tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=scale),
            image_encoder=encoder, feature_extractor=features)
        pipe.set_progress_bar_config(disable=True)
        return pipe(image=image, **embeds, num_frames=9, num_inference_steps=2,
                    output_type="latent", generator=torch.Generator().manual_seed(1)).frames

    ours, ref, calls, diff, bound = _stock_and_dropin(tmp_path, stock, run, 1 + 2 * scale)
    assert ours.shape == ref.shape == (3, 4, 3, 3, 5) and len(calls) == 4
    assert all(tuple(kw["image_embeds"].shape) == (3, 4, 12) and kw["timestep_r"] is None
               and bool(kw["image_embeds"].any()) for kw in calls)
    assert 0 < diff <= bound, (diff, bound)


@pytest.mark.parametrize("variant,overrides,match", [
    ("hunyuan-video", dict(image_condition_type="token_replace"), "token_replace"),
    ("hunyuan-video-1.5", dict(use_meanflow=True), "use_meanflow"),
])
def test_pipeline_models_the_export_does_not_carry_are_refused_in_one_line(
        tmp_path, variant, overrides, match):
    """What the image-to-video pipelines can run that the export does not carry is refused by
    ``export_transformer`` in one line naming the fix, before tracing: HunyuanVideo's
    token_replace image-to-video transformer (HunyuanVideoImageToVideoPipeline replaces the
    first frame's tokens and runs the blocks' token_replace modulation) and HunyuanVideo-1.5's
    MeanFlow models (the pipelines pass timestep_r; the drop-in refuses it too:
    test_dropin_refuses_what_the_graph_cannot_take_in_one_line)."""
    from qkrope.export.onnx_export import export_transformer

    hvm.transformer(variant, **overrides).save_pretrained(str(tmp_path / "t"))
    with pytest.raises(InputError, match=match) as e:
        export_transformer(tmp_path / "t.onnx", tmp_path / "t", dtype="fp32", progress=False)
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)
    assert not (tmp_path / "t.onnx").exists()
