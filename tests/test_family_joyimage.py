"""JoyImage Edit (qkrope/families/joyimage): the grid caches against diffusers'
get_rotary_pos_embed, the fused q/k against the model's own modules (bf16, fp16, fp32), the
cache-input wrapper against the stock forward, the export on ONNX Runtime and the drop-in at
untraced shapes (the edit pipeline's 6-D latent included), and the refusals, on the tiny
config of qkrope/families/joyimage/tiny.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import diffusers.models.transformers.transformer_joyimage as tj  # noqa: E402

from qkrope import contract  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families import joyimage  # noqa: E402
from qkrope.families.joyimage import export as jexport  # noqa: E402
from qkrope.families.joyimage.tiny import JOYIMAGE_CONFIG, build_transformer  # noqa: E402

RECORD = joyimage.JOYIMAGE_EDIT


def _tiny(dtype=torch.float32, **overrides):
    return build_transformer(RECORD, 0, **overrides).to(dtype)


def _caches(model, grid, txt_len):
    axes, theta = jexport.rope_setting(model)
    return jexport.sample_caches(RECORD, grid, txt_len, axes, theta)


def _stock_cache(model, grid):
    """diffusers' own image tables (get_rotary_pos_embed) as the node's cache: each frequency
    once (diffusers repeats it per pair), the cos half then the sin half."""
    cos, sin = model.get_rotary_pos_embed(list(grid))[0]
    assert torch.equal(cos[:, ::2], cos[:, 1::2]) and torch.equal(sin[:, ::2], sin[:, 1::2])
    return torch.cat([cos[:, ::2], sin[:, ::2]], dim=1).contiguous()


@pytest.mark.parametrize("grid", [(1, 4, 6), (3, 5, 2), (2, 64, 64)])
def test_caches_are_diffusers_within_one_ulp(grid):
    """The "grid" scheme's image cache (uncentred, float32 frequencies, the released axes
    (16, 56, 56) and theta 256) against diffusers' tables: the angles are the same float32
    products, but diffusers takes ``Tensor.cos()`` / ``.sin()`` (torch's vectorised kernels)
    where the scheme evaluates the C library's cosf / sinf, which differ by at most one float32
    ulp (measured: on a minority of entries); the text rows are the identity (cos 1, sin 0)."""
    model = _tiny(rope_dim_list=[16, 56, 56], hidden_size=256)
    want = _stock_cache(model, grid).numpy()
    img, txt = _caches(model, grid, 5)
    assert img.shape == want.shape
    ulps = np.abs(img.numpy().view(np.int32).astype(np.int64) - want.view(np.int32))
    assert ulps.max() <= 1 and (ulps > 0).mean() < 0.1
    assert torch.equal(txt, torch.cat([torch.ones(5, 64), torch.zeros(5, 64)], dim=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_fused_q_and_k_are_the_models_bit_for_bit(dtype, monkeypatch):
    """The node's reference with the record's rounding (2) on both streams gives the q and k
    that the model's own modules hand to the attention, bit for bit; modes 0 and 1 do not in
    half precision (the test can tell them apart)."""
    from qkrope.export.reference import qk_norm_rope_reference

    model = _tiny(dtype)
    attn = model.double_blocks[0].attn
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 24, 64, generator=g) * 3).to(dtype)
    t = (torch.randn(2, 5, 64, generator=g) * 3).to(dtype)
    img, txt = _stock_cache(model, (2, 3, 4)), _caches(model, (2, 3, 4), 5)[1]
    seen = []
    real = tj.dispatch_attention_fn
    monkeypatch.setattr(tj, "dispatch_attention_fn",
                        lambda q, k, v, **kw: (seen.append((q, k)), real(q, k, v, **kw))[1])
    cos = torch.repeat_interleave(img[:, :16], 2, dim=1)
    sin = torch.repeat_interleave(img[:, 16:], 2, dim=1)
    with torch.no_grad():
        attn(x, t, ((cos, sin), None))
        (q_model, k_model), = seen
        iq, ik, _ = jexport._heads(attn.img_attn_qkv(x), 2)
        tq, tk, _ = jexport._heads(attn.txt_attn_qkv(t), 2)
        exact = []
        for mode in contract.ROUNDING_MODES:
            kw = dict(eps=1e-6, interleaved=True, rounding=mode)
            a, b = qk_norm_rope_reference(iq, ik, attn.img_attn_q_norm.weight,
                                          attn.img_attn_k_norm.weight, img, **kw)
            c, d = qk_norm_rope_reference(tq, tk, attn.txt_attn_q_norm.weight,
                                          attn.txt_attn_k_norm.weight, txt, **kw)
            exact.append(torch.equal(torch.cat([a, c], 1), q_model)
                         and torch.equal(torch.cat([b, d], 1), k_model))
    assert exact[RECORD.rounding]
    if dtype != torch.float32:
        assert not exact[contract.ROUNDING_ONE] and not exact[contract.ROUNDING_EACH_STEP]


def _inputs(dtype, batch=2, frames=2, height=8, width=12, txt=7, seed=3, items=None):
    g = torch.Generator().manual_seed(seed)
    lead = (batch, items) if items else (batch,)
    latent = torch.randn(*lead, 16, frames, height, width, generator=g).to(dtype)
    text = torch.randn(batch, txt, JOYIMAGE_CONFIG["text_dim"], generator=g).to(dtype)
    ts = torch.rand(batch, generator=g).mul(1000).to(dtype)
    return latent, ts, text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_is_the_stock_forward_bit_for_bit(dtype):
    """The cache-input wrapper (two fused nodes per block, rounding 2) given diffusers' own
    tables equals the stock forward exactly in fp32, bf16 and fp16."""
    stock = _tiny(dtype)
    wrapper = jexport.JoyImageCacheInputTransformer(_tiny(dtype), rounding=RECORD.rounding)
    latent, ts, text = _inputs(dtype)
    img, txt = _stock_cache(stock, (2, 4, 6)), _caches(stock, (2, 4, 6), 7)[1]
    with torch.no_grad():
        ref = stock(latent, ts, text, return_dict=False)[0]
        out = wrapper(latent, ts, text, img, txt)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_refusals_are_one_line():
    """mrope (rotated text) and RoPE axes that miss the head are refused by the export in one
    line; Edit-Plus is refused by class with its reason."""
    from qkrope import families

    for overrides, match in ((dict(rope_type="mrope"), "mrope"),
                             (dict(rope_dim_list=[8, 8, 8]), "adding up to the head")):
        with pytest.raises(InputError, match=match) as e:
            jexport.JoyImageCacheInputTransformer(_tiny(**overrides), rounding=2)
        assert "\n" not in str(e.value)
    assert "JoyImageEditPlusTransformer3DModel" in joyimage.REFUSED
    with pytest.raises(InputError, match="one cache per call") as e:
        families.family_of({"_class_name": "JoyImageEditPlusTransformer3DModel"})
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny model saved and exported (fp32, the default sample: traced with 2 frames)."""
    from qkrope.export.onnx_export import export_transformer

    root = tmp_path_factory.mktemp("joyimage")
    _tiny().save_pretrained(str(root / "tiny"))
    info, _ = export_transformer(root / "m.onnx", root / "tiny", dtype="fp32", progress=False)
    return root / "m.onnx", info


def test_export_graph_and_sidecar(exported):
    """Two fused nodes per block (interleaved, rounding 2), the 5-D latent axes by name, the
    sidecar's family and RoPE axes."""
    import onnx

    path, info = exported
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == 2 * JOYIMAGE_CONFIG["num_layers"]
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["interleaved"] == 1 and attrs["rounding"] == 2
    shapes = {t.name: t.shape for t in info.inputs + info.outputs}
    assert shapes["latent"] == ["batch", 16, "latent_frames", "latent_height", "latent_width"]
    assert info.config.family == "joyimage-edit" and info.config.axes_dims_rope == [8, 12, 12]


# fp32 sums in another order (ORT's kernels) and caches within one ulp of diffusers' (each
# rotated value moves by about 2^-23 of the normalised |q| ~ 1) move the output by a few
# float32 ulps of its scale per block (measured 2^-21 relative in torch with qkrope's caches,
# 2^-19.5 on ONNX Runtime with timesteps below 1), which the attention and two blocks carry at
# the same relative order: 2^-16 of the largest value, 128 times 2^-23. The timestep
# sinusoid adds its own term: at the pipelines' timesteps (up to 1000) ONNX Runtime's Sin / Cos
# differ from torch's by up to one ulp of the angle (6.1e-5 at 1000, measured), what moving
# the timestep by one ulp of itself moves the angles by; :func:`_bound` adds twice the stock
# model's response to that move.
BOUND = 2.0 ** -16


def _bound(stock, latent, ts, text, ref) -> float:
    """BOUND of the output's scale plus twice the stock output's change when every timestep
    moves by one ulp (the sinusoid term above)."""
    with torch.no_grad():
        moved = stock(latent, torch.nextafter(ts, ts + 1), text, return_dict=False)[0]
    ref = torch.as_tensor(ref)
    # the same layout as ref (a 5-D output against a 6-D one would broadcast into a bound of
    # the output's own scale)
    assert moved.shape == ref.shape, (tuple(moved.shape), tuple(ref.shape))
    return float(ref.abs().max()) * BOUND + 2 * float((moved - ref).abs().max())


@pytest.mark.parametrize("batch,frames,height,width,txt",
                         [(1, 1, 6, 10, 5), (3, 3, 10, 6, 9)], ids=["image-b1", "b3-f3"])
def test_onnxruntime_at_untraced_shapes(exported, batch, frames, height, width, txt):
    """ONNX Runtime on the export, at batches, frame counts, resolutions and text lengths other
    than the traced ones, with qkrope's caches, against the stock forward within BOUND."""
    ort = pytest.importorskip("onnxruntime")
    path, _ = exported
    stock = _tiny()
    latent, ts, text = _inputs(torch.float32, batch, frames, height, width, txt)
    with torch.no_grad():
        ref = stock(latent, ts, text, return_dict=False)[0].numpy()
    img, tcache = _caches(stock, (frames, height // 2, width // 2), txt)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"latent": latent.numpy(), "timestep": ts.numpy(),
                          "encoder_hidden_states": text.numpy(),
                          "img_cos_sin_cache": img.numpy(),
                          "txt_cos_sin_cache": tcache.numpy()})[0]
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= _bound(stock, latent, ts, text, ref)


def test_dropin_takes_the_edit_pipelines_call(exported):
    """load_transformer's drop-in takes what JoyImageEditPipeline passes (the 6-D latent of a
    reference image and the target, keyword arguments, return_dict=False) and a 5-D latent, at
    shapes other than the traced one, within BOUND of the stock forward; a latent of another
    rank is refused in one line (within the ORT bound above)."""
    from qkrope.runtime import load_transformer

    path, _ = exported
    stock, dropin = _tiny(), load_transformer(path)
    six, ts, text = _inputs(torch.float32, 2, 1, 8, 10, 6, items=2)
    five, _, _ = _inputs(torch.float32, 1, 3, 6, 8, 6, seed=5)
    for latent, t, txt in ((six, ts, text), (five, ts[:1], text[:1])):
        kw = dict(hidden_states=latent, timestep=t, encoder_hidden_states=txt,
                  return_dict=False)
        with torch.no_grad():
            ref = stock(**kw)[0]
        out = dropin(**kw)[0]
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= _bound(stock, latent, t, txt, ref)
    with pytest.raises(InputError, match="hidden_states must be") as e:
        dropin(hidden_states=five[:, :, 0], timestep=ts[:1], encoder_hidden_states=text[:1])
    assert "\n" not in str(e.value)


def test_qkrope_check_passes_against_diffusers_forward(exported, capsys):
    """``qkrope check`` on the export against diffusers' own forward: PASSED."""
    from qkrope.cli import main

    path, _ = exported
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "latent_sample" in out and "PASSED" in out


@pytest.mark.slow
def test_edit_pipeline_on_the_dropin(exported, tmp_path):
    """JoyImageEditPipeline's edit call (a reference image, prompt_embeds; the processor is None,
    see tiny.py) at its 1024 bucket (two items of 64 x 64 tokens, 8192 in all), 2 steps, on the
    drop-in against the stock transformer: every transformer call replayed within _bound, the
    latents within the tiny pipeline's latent_bound. The reference latent is a sample of the VAE
    posterior drawn from torch's global RNG (the pipeline's generator draws only the noise), so
    both runs seed it alike: unseeded, the runs denoise from different reference latents
    (measured 0.05 to 0.07 apart on latents up to 7.7, no fault of the drop-in)."""
    from PIL import Image

    from qkrope.apps.tiny_pipeline import latent_bound, save_tiny_pipeline
    from qkrope.runtime import load_transformer

    pipe = diffusers_pipeline(save_tiny_pipeline(RECORD.name, tmp_path / "pipe"))
    stock, dropin = pipe.transformer, load_transformer(exported[0])
    calls = []
    hook = stock.register_forward_pre_hook(
        lambda m, a, kw: calls.append({k: getattr(v, "clone", lambda: v)() for k, v in kw.items()}),
        with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (48, 64, 3), generator=g,
                                          dtype=torch.uint8).numpy())
    text = torch.randn(1, 7, JOYIMAGE_CONFIG["text_dim"], generator=g)
    runs = []
    for transformer in (stock, dropin):
        pipe.transformer = transformer
        torch.manual_seed(0)  # the reference latent's posterior sample
        with torch.no_grad():
            runs.append(pipe(image=image, prompt_embeds=text,
                             prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long),
                             num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                             generator=torch.Generator().manual_seed(1)).images)
    hook.remove()
    assert len(calls) == 2 and calls[0]["hidden_states"].shape[1:3] == (2, 16)
    for kw in calls:
        with torch.no_grad():
            ref = stock(**kw)[0]
        out = dropin(**kw)[0]
        assert (out - ref).abs().max() <= _bound(stock, kw["hidden_states"], kw["timestep"],
                                                 kw["encoder_hidden_states"], ref)
    ref, out = runs
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= latent_bound(ref)


def diffusers_pipeline(directory):
    """The tiny JoyImageEditPipeline folder loaded (no processor: tiny.py)."""
    from diffusers import JoyImageEditPipeline

    return JoyImageEditPipeline.from_pretrained(str(directory), processor=None)
