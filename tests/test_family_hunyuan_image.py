"""HunyuanImage-2.1 (qkrope/families/hunyuan_image) on diffusers' own test config
(tests/_families.py): the fused wrapper against the stock forward (fp32, bf16, fp16), the
patch-grid caches against diffusers' RoPE, the export on ONNX Runtime at untraced shapes, the
pipeline end to end on the export through the drop-in, and the refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime")

import torch  # noqa: E402

from _families import BUILDERS  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime.caches import build_rope_caches, checked_setting  # noqa: E402
from qkrope.runtime.latents import pack_patches, unpack_patches  # noqa: E402

BUILDER = BUILDERS["hunyuan-image"]
RECORD = BUILDER.record


def _inputs(dtype, b=2, h=5, w=7, s=9):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, 4, h, w, generator=g).to(dtype)
    ehs = torch.randn(b, s, 32, generator=g).to(dtype)
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[-1, s - 3:] = 0  # the last item's last tokens are padding
    ts = torch.tensor([300.0, 700.0][:b]).to(dtype)
    return x, ehs, mask, ts


def _setting():
    return checked_setting("patch-grid", RECORD.axes[:0] + (4, 4), 256.0, rotated=("img",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_fused_wrapper_is_bit_exact_with_the_stock_forward(dtype):
    """The cache-input wrapper (every attention through qk_norm_rope with the family's rounding,
    ROUNDING_EACH_STEP) fed diffusers' own RoPE values equals the stock forward bit for bit in
    each dtype: the node's mode 1 is diffusers' RMSNorm order and its fp32 rotation, and the
    text's identity rows leave the normalised text exactly as it is."""
    from qkrope.families.hunyuan_image.export import cache_input_hunyuan_image

    model = BUILDER.build(0).to(dtype)
    x, ehs, mask, ts = _inputs(dtype)
    with torch.no_grad():
        ref = model(x, ts, ehs, mask, return_dict=False)[0]
        cos, sin = model.rope(x)  # diffusers' own float32 values, repeated per pair
        stock = torch.cat([cos[:, ::2], sin[:, ::2]], 1)
        wrapper = cache_input_hunyuan_image(copy.deepcopy(model), RECORD)
        tokens, grid = pack_patches(x, (1, 1))
        txt = build_rope_caches("patch-grid", {"img_shapes": [(1, 5, 7)], "txt_seq_len": 9},
                                _setting()).txt
        out = unpack_patches(wrapper.run(tokens, ehs, mask.bool(), ts, stock, txt), grid,
                             (1, 1))
    assert out.dtype == dtype and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_glyph_text_wrapper_is_bit_exact_with_the_stock_forward(dtype):
    """The byT5 glyph stream (issue 44 item 5): with encoder_hidden_states_2 whose mask marks
    real tokens (a prompt with quoted text; a different count per item, one item with none),
    the wrapper's run (the glyph projection, the stable partition of [glyph; text] by the
    masks, text cache rows for both) equals diffusers' forward bit for bit, as without glyph
    text; and the glyph changes the image (the test would pass on a wrapper ignoring it
    otherwise)."""
    from qkrope.families.hunyuan_image.export import cache_input_hunyuan_image

    model = BUILDER.build(0).to(dtype)
    x, ehs, mask, ts = _inputs(dtype)
    g = torch.Generator().manual_seed(4)
    glyph = torch.randn(2, 6, 32, generator=g).to(dtype)
    glyph_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        ref = model(x, ts, ehs, mask, encoder_hidden_states_2=glyph,
                    encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
        plain = model(x, ts, ehs, mask, return_dict=False)[0]
        cos, sin = model.rope(x)
        stock = torch.cat([cos[:, ::2], sin[:, ::2]], 1)
        wrapper = cache_input_hunyuan_image(copy.deepcopy(model), RECORD)
        tokens, grid = pack_patches(x, (1, 1))
        txt = build_rope_caches("patch-grid", {"img_shapes": [(1, 5, 7)], "txt_seq_len": 9 + 6},
                                _setting()).txt
        out = unpack_patches(wrapper.run(tokens, ehs, mask.bool(), ts, stock, txt,
                                         encoder_hidden_states_2=glyph,
                                         encoder_attention_mask_2=glyph_mask), grid, (1, 1))
    assert out.dtype == dtype and torch.equal(out, ref)
    assert not torch.equal(ref[0], plain[0])


def test_patch_grid_caches_against_diffusers_rope():
    """The numpy caches: frequencies and float32 angles bit-equal to diffusers'; cos/sin by the
    C library's cosf/sinf, which differ from torch's vectorised float32 cos/sin by at most one
    float32 ulp (the bound: both are within one ulp of the exact value, libm's within half).
    The text rows are identity rows (cos 1, sin 0)."""
    from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageRotaryPosEmbed

    for axes, (h, w) in (((4, 4), (5, 7)), ((64, 64), (64, 48))):
        setting = checked_setting("patch-grid", axes, 256.0, rotated=("img",))
        caches = build_rope_caches("patch-grid", {"img_shapes": [(1, h, w)], "txt_seq_len": 3},
                                   setting)
        cos, sin = HunyuanImageRotaryPosEmbed((1, 1), list(axes), 256.0)(
            torch.zeros(1, 1, h, w))
        stock = torch.cat([cos[:, ::2], sin[:, ::2]], 1).numpy()
        ours = caches.img.numpy()
        assert ours.shape == stock.shape
        ulp = np.spacing(np.abs(stock).astype(np.float32))
        assert (np.abs(ours - stock) <= ulp).all()
        assert np.array_equal(caches.txt.numpy()[:, :sum(axes) // 2], np.ones((3, sum(axes) // 2)))
        assert not caches.txt.numpy()[:, sum(axes) // 2:].any()


def test_pack_patches_is_the_convolution_layout():
    conv = torch.nn.Conv2d(3, 5, 2, 2)
    x = torch.randn(2, 3, 4, 6)
    tokens, grid = pack_patches(x, (2, 2))
    assert grid == (2, 3) and tuple(tokens.shape) == (2, 6, 12)
    assert torch.equal(unpack_patches(tokens, grid, (2, 2)), x)
    ref = conv(x).flatten(2).transpose(1, 2)
    # one float32 GEMM against the convolution: sums of 12 products, a few ulps of their scale
    assert torch.allclose(tokens @ conv.weight.reshape(5, -1).T + conv.bias, ref, atol=1e-5)
    with pytest.raises(InputError, match="whole number"):
        pack_patches(torch.randn(1, 3, 5, 6), (2, 2))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.cli import main

    root = tmp_path_factory.mktemp("hyimage")
    out = root / "hunyuan-image.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(BUILDER.saved(root)),
                 "--out", str(out)]) == 0
    return root, out


def test_export_has_the_fused_nodes_and_no_double(exported):
    import onnx

    _, out = exported
    model = onnx.load(str(out))
    nodes = [n for n in model.graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == 3  # 2 for the double-stream block, 1 for the single-stream one
    names = [i.name for i in model.graph.input]
    assert names == ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                     "encoder_hidden_states_2", "encoder_attention_mask_2", "timestep",
                     "img_cos_sin_cache", "txt_cos_sin_cache"]


@pytest.mark.parametrize("b,h,w,s", [(1, 3, 4, 5), (3, 6, 5, 11)])
def test_dropin_on_onnxruntime_at_untraced_shapes(exported, b, h, w, s):
    """The drop-in (ONNX Runtime) against the stock fp32 forward at shapes other than the traced
    (batch 2, 8x8, 16 text tokens). Bound: 1e-4 (the caches' last-bit cos/sin and ORT's op
    order through 2 blocks, measured ~5e-5 at t=100) plus what the timestep embedding adds: its
    sin/cos arguments t * freq carry float32 spacing up to t * 2^-23, where ORT's and torch's
    Sin/Cos may differ, amplified by the embedding MLP and AdaLN (measured 4.5e-7 * t, i.e.
    gain ~4; the bound allows 16)."""
    from qkrope.runtime import load_transformer

    root, out = exported
    model = BUILDER.build(0)
    t = load_transformer(out)
    x, ehs, mask, ts = _inputs(torch.float32, b, h, w, s)
    if b == 3:
        ts = torch.tensor([100.0, 500.0, 900.0])
    with torch.no_grad():
        ref = model(x, ts, ehs, mask, return_dict=False)[0]
    got = t(hidden_states=x, timestep=ts, encoder_hidden_states=ehs,
            encoder_attention_mask=mask, return_dict=False)[0]
    assert got.shape == ref.shape
    bound = 1e-4 + 16 * float(ts.max()) * 2.0 ** -23
    assert (got - ref).abs().max().item() < bound


@pytest.mark.parametrize("glyph_tokens", [3, 8])
def test_dropin_with_glyph_text_on_onnxruntime(exported, glyph_tokens):
    """The byT5 glyph stream through the export (issue 44 item 5): quoted-text glyph tokens
    (other counts than the traced 5, one item with none) against the stock fp32 forward given
    the same glyph text, within the bound of the test above (the glyph projection is one more
    MLP on the text, which reaches the image only through attention as the text does); the
    glyph changes the image by far more than that bound (so it is not ignored)."""
    from qkrope.runtime import load_transformer

    _, out = exported
    model = BUILDER.build(0)
    t = load_transformer(out)
    x, ehs, mask, ts = _inputs(torch.float32)
    g = torch.Generator().manual_seed(6)
    glyph = torch.randn(2, glyph_tokens, 32, generator=g)
    glyph_mask = torch.zeros(2, glyph_tokens, dtype=torch.int64)
    glyph_mask[0, :2] = 1
    with torch.no_grad():
        ref = model(x, ts, ehs, mask, encoder_hidden_states_2=glyph,
                    encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
        plain = model(x, ts, ehs, mask, return_dict=False)[0]
    got = t(hidden_states=x, timestep=ts, encoder_hidden_states=ehs, encoder_attention_mask=mask,
            encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
            return_dict=False)[0]
    bound = 1e-4 + 16 * float(ts.max()) * 2.0 ** -23
    assert got.shape == ref.shape and (got - ref).abs().max().item() < bound
    assert (ref[0] - plain[0]).abs().max().item() > 100 * bound


@pytest.mark.parametrize("quoted", [False, True], ids=["no-quoted-text", "quoted-text"])
def test_pipeline_end_to_end_on_the_export(exported, quoted):
    """HunyuanImagePipeline with the tiny transformer, prompt embeddings given (no text encoders
    downloaded), byT5 zeros as the pipeline makes them for a prompt without quoted text, or
    glyph embeddings with three real tokens (a prompt with quoted text), latent output: the
    export through the drop-in against the stock transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline

    from qkrope.runtime import load_transformer

    _, out = exported
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(1, 6, 32, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    glyph, glyph_mask = torch.zeros(1, 4, 32), torch.zeros(1, 4, dtype=torch.int64)
    if quoted:
        glyph, glyph_mask = torch.randn(1, 4, 32, generator=g), torch.tensor([[1, 1, 1, 0]])
    call = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, prompt_embeds_2=glyph,
                prompt_embeds_mask_2=glyph_mask, height=160, width=96,
                num_inference_steps=2, output_type="latent")
    results = []
    for transformer in (BUILDER.build(0), load_transformer(out)):
        pipe = HunyuanImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None,
                                    tokenizer_2=None, transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        results.append(pipe(generator=torch.Generator().manual_seed(0), **call).images)
    assert results[0].shape == results[1].shape == (1, 4, 5, 3)
    # the two steps' timesteps are 1000 and 500: the bound of the test above at t = 1000
    assert (results[0] - results[1]).abs().max().item() < 1e-4 + 16 * 1000 * 2.0 ** -23


@pytest.mark.parametrize("bad,match", [
    (dict(timestep_r=torch.tensor([0.5, 0.5])), "timestep_r"),
    (dict(encoder_attention_mask_2=torch.ones(2, 4, dtype=torch.int64)),
     "encoder_attention_mask_2 was given without encoder_hidden_states_2"),
    (dict(encoder_hidden_states_2=torch.zeros(2, 4, 32),
          encoder_attention_mask_2=torch.ones(2, 3, dtype=torch.int64)),
     r"encoder_attention_mask_2 \[2, 3\] must be"),
    (dict(encoder_hidden_states_2=torch.zeros(2, 4, 16),
          encoder_attention_mask_2=torch.ones(2, 4, dtype=torch.int64)),
     r"encoder_hidden_states_2 \[2, 4, 16\] and"),
    (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
    (dict(encoder_attention_mask=None), "needs encoder_attention_mask"),
    (dict(hidden_states=torch.zeros(2, 20, 4)), "4-D tensor"),
    (dict(txt_ids=torch.zeros(3, 3)), "received txt_ids"),
])
def test_refusals(exported, bad, match):
    from qkrope.runtime import load_transformer

    t = load_transformer(exported[1])
    x, ehs, mask, ts = _inputs(torch.float32)
    call = dict(hidden_states=x, timestep=ts, encoder_hidden_states=ehs,
                encoder_attention_mask=mask)
    call.update(bad)
    with pytest.raises(InputError, match=match) as e:
        t(**call)
    assert "\n" not in str(e.value)


def test_meanflow_model_is_refused_at_export(tmp_path):
    import json

    from qkrope.cli import main

    folder = BUILDER.saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["use_meanflow"] = True
    bad = tmp_path / "meanflow"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["export", "--model", "transformer", "--diffusers", str(bad),
                 "--out", str(tmp_path / "m.onnx")]) != 0


# --------------------------------------------------------------------------------------------
# The tools: qkrope check, the data loader, qkrope build (fake TensorRT), qkrope triton-repo
# --------------------------------------------------------------------------------------------

def test_check_against_diffusers_forward_and_its_one_image(exported, tmp_path, capsys):
    """`qkrope check`: ONNX Runtime vs diffusers' own forward (the latent unpacked from the
    tokens, diffusers' sample packed back: reference.graph_output), by default on one image;
    other weights fail (exit 1); two images are refused in one line (exit 2)."""
    import io

    from qkrope.apps.check import check_model
    from qkrope.cli import main

    root, out = exported
    buf = io.StringIO()
    passed, rows = check_model(out, workdir=tmp_path / "a", out=buf)
    assert passed, buf.getvalue()
    assert [(r.runner, r.output) for r in rows] == [("onnxrt", "sample")] and rows[0].max_abs > 0
    other = tmp_path / "other"
    BUILDER.build(1).save_pretrained(str(other))
    assert main(["check", str(out), "--diffusers", str(other), "--workdir",
                 str(tmp_path / "b")]) == 1
    capsys.readouterr()
    assert main(["check", str(out), "--img-shape", "1", "6", "5", "--img-shape", "1", "4", "4",
                 "--workdir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "one token grid" in err


def test_data_loader_feeds_the_patch_grid_caches(exported, monkeypatch):
    from qkrope.apps import polygraphy_data_loader as dl
    from qkrope.families.hunyuan_image.export import GLYPH_TOKENS

    _, out = exported
    monkeypatch.setenv("QKROPE_MODEL", str(out))
    monkeypatch.setenv("QKROPE_IMG_SHAPES", "1x6x5")
    monkeypatch.setenv("QKROPE_TXT_LEN", "7")
    monkeypatch.setenv("QKROPE_BATCH", "3")
    feeds = next(dl.load_data())
    assert feeds["hidden_states"].shape == (3, 30, 4)
    assert feeds["encoder_hidden_states_mask"].shape == (3, 7)
    # the glyph tokens keep the export sample's count; the text cache covers text and glyph
    glyph = GLYPH_TOKENS
    assert feeds["encoder_hidden_states_2"].shape == (3, glyph, 32)
    assert feeds["encoder_attention_mask_2"].shape == (3, glyph)
    want = build_rope_caches("patch-grid", {"img_shapes": [(1, 6, 5)],
                                            "txt_seq_len": 7 + glyph}, _setting())
    assert np.array_equal(feeds["img_cos_sin_cache"], want.img.numpy())
    assert np.array_equal(feeds["txt_cos_sin_cache"], want.txt.numpy())


def test_fake_build_has_one_plugin_layer_per_node(exported, tmp_path, monkeypatch, capsys):
    """Profiles per preset at 32 pixels per token (a 32x VAE, 1x1 patches), no position limit
    on the text, one QKNormRoPE plugin layer per node (2 + 1)."""
    from _tiny_model import fake_tensorrt

    from qkrope.cli import main
    from qkrope.runtime.onnx_file import count_plugin_nodes
    from qkrope.sidecars import EngineInfo

    _, out = exported
    nodes = list(count_plugin_nodes(out))
    assert len(nodes) == 3
    trt, state, lib = fake_tensorrt(monkeypatch, tmp_path)
    engine = tmp_path / "hy.engine"
    rc = main(["build", str(out), "-o", str(engine), "--plugin", str(lib), "--resolutions",
               "1024x1024,2048x2048", "--txt-tokens", "1:1000", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert [layer[1] for layer in state.network.layers] == nodes
    for p, n in zip(state.profiles, (1024, 4096)):  # (1024 / 32)^2, (2048 / 32)^2 tokens
        assert p["hidden_states"] == ((1, 1, 4), (2, n, 4), (2, n, 4))
        assert p["txt_cos_sin_cache"] == ((1, 8), (1000, 8), (1000, 8))
    assert EngineInfo.load(engine).config.family == "hunyuan-image"


def test_triton_repo_rope_model_gives_the_checked_caches(exported, tmp_path, monkeypatch,
                                                         capsys):
    """The ensemble over the ONNX export: clients send img_shapes (the latent's token grid) in
    place of the caches; the rope model's caches equal make_inputs' bit for bit."""
    pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")
    from _triton_helpers import Tensor, load_rope_model

    from qkrope.cli import main
    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    _, out = exported
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(out), "-o",
                 str(repo), "--name", "hy"]) == 0
    capsys.readouterr()
    feeds = make_inputs(ModelInfo.load(out), [(1, 6, 5)], 7, 2)
    model, pb = load_rope_model(repo / "hy_rope", monkeypatch)
    resp = model.execute([pb.InferenceRequest([
        Tensor("img_shapes", np.array([[1, 6, 5]], np.int64)),
        Tensor("hidden_states", feeds["hidden_states"]),
        Tensor("encoder_hidden_states_mask", feeds["encoder_hidden_states_mask"]),
        # the glyph tokens: the text cache has a row for each (the joined text stream)
        Tensor("encoder_hidden_states_2", feeds["encoder_hidden_states_2"])])])[0]
    assert resp.error is None
    for name in ("img_cos_sin_cache", "txt_cos_sin_cache"):
        assert np.array_equal(pb.get_output_tensor_by_name(resp, name).as_numpy(), feeds[name])


# --------------------------------------------------------------------------------------------
# The refiner: the same class with a 3-D patch, three RoPE axes and a 5-D latent
# --------------------------------------------------------------------------------------------

def _refiner(seed: int = 0):
    """diffusers' test sizes with the refiner's layout: a (1, 1, 1) patch, RoPE axes over
    (frame, row, column) summing to the head, twice the latent channels in (the noisy and the
    condition latents), guidance embeddings (the refiner is guidance-distilled), no byT5."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(seed)
    model = HunyuanImageTransformer2DModel(
        in_channels=8, out_channels=4, num_attention_heads=4, attention_head_dim=8,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1, 1),
        guidance_embeds=True, text_embed_dim=32, rope_axes_dim=(2, 2, 4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def test_refiner_pipeline_end_to_end_on_the_export(tmp_path):
    """HunyuanImageRefinerPipeline (latent image in, prompt embeddings given, latent out) on the
    export of a refiner-shaped model: the drop-in packs its [B, C, 1, H, W] latent; within the
    bound of the ORT test above at t = 1000. A guidance-distilled export without guidance is
    refused in one line."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanImageRefinerPipeline

    from qkrope.cli import main
    from qkrope.runtime import load_transformer

    folder, out = tmp_path / "refiner", tmp_path / "refiner.onnx"
    _refiner().save_pretrained(str(folder))
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--out",
                 str(out)]) == 0
    g = torch.Generator().manual_seed(5)
    call = dict(prompt_embeds=torch.randn(1, 6, 32, generator=g),
                prompt_embeds_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]),
                image=torch.randn(1, 4, 1, 4, 3, generator=g), height=64, width=48,
                num_inference_steps=2, distilled_guidance_scale=3.25, output_type="latent")
    results = []
    for transformer in (_refiner(), load_transformer(out)):
        pipe = HunyuanImageRefinerPipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                                           vae=None, text_encoder=None, tokenizer=None,
                                           transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        results.append(pipe(generator=torch.Generator().manual_seed(0), **call).images)
    assert results[0].shape == results[1].shape == (1, 4, 1, 4, 3)
    assert (results[0] - results[1]).abs().max().item() < 1e-4 + 16 * 1000 * 2.0 ** -23
    t = load_transformer(out)
    with pytest.raises(InputError, match="needs guidance") as e:
        t(hidden_states=torch.zeros(1, 8, 1, 4, 3), timestep=torch.tensor([500.0]),
          encoder_hidden_states=torch.zeros(1, 6, 32),
          encoder_attention_mask=torch.ones(1, 6, dtype=torch.int64))
    assert "\n" not in str(e.value)


def _compared(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("onnxrt")]


def test_layers_and_blocks_on_the_refiner(tmp_path, capsys):
    """Issue 35 on the refiner's layout (5-D latent, guidance; the image layout, and export
    --layers, are tests/test_check_blocks_families.py's): `check --blocks` compares both
    streams of the double-stream block and the image stream of the single-stream one (it splits
    its [image; text] sequence back; the last text output is unused and absent from the graph),
    and `check --layers 1` the double-stream block's two streams (the graph cut after it, the
    reference's single-stream block passing its streams through)."""
    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    folder, out = tmp_path / "refiner", tmp_path / "refiner.onnx"
    _refiner().save_pretrained(str(folder))
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--out",
                 str(out)]) == 0
    assert "1 of 1 double + 1 of 1 single blocks" in capsys.readouterr().err
    assert ModelInfo.load(out).config.num_layers_exported == 2
    for flags, expected in ((["--blocks"], ["sample", "block0.img", "block0.txt", "block1.img"]),
                            (["--layers", "1"], ["block0.img", "block0.txt"])):
        assert main(["check", str(out), *flags, "--workdir", str(tmp_path / flags[-1])]) == 0
        text = capsys.readouterr().out
        assert _compared(text) == expected, (flags, text)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_exports(dtype, tmp_path):
    """fp16 and bf16 exports pass onnx's checks (bf16: ONNX's Conv has no bfloat16 before
    opset 22, so the patch embedding convolves in float32 in the graph) with their 3 fused
    nodes; the fp16 export passes `qkrope check` against diffusers' fp16 forward (ONNX
    Runtime's CPU provider has no bf16 MatMul: a bf16 check needs a GPU)."""
    import io

    import onnx

    from qkrope.apps.check import check_model
    from qkrope.cli import main

    out = tmp_path / f"m_{dtype}.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(BUILDER.saved(tmp_path)),
                 "--dtype", dtype, "--out", str(out)]) == 0
    graph = onnx.load(str(out)).graph
    assert sum(n.op_type == "QKNormRoPE" for n in graph.node) == 3
    conv = [n for n in graph.node if n.op_type == "Conv"]
    assert len(conv) == 1
    if dtype == "fp16":
        buf = io.StringIO()
        passed, _ = check_model(out, workdir=tmp_path / "w", out=buf)
        assert passed, buf.getvalue()
