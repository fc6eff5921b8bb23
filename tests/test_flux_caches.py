"""FLUX.1 / FLUX.2 RoPE caches from position ids (qkrope.runtime.build_flux_rope_caches and
caches_for on a FLUX engine) against diffusers' own pos_embed, bit for bit, on the ids the
pipelines build with their own static helpers; and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkrope.errors import InputError
from qkrope.runtime import build_flux_rope_caches, caches_for
from qkrope.runtime import caches as caches_mod
from qkrope.runtime.schemes import ids as rt
from qkrope.families import by_name

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from diffusers import FluxTransformer2DModel, Flux2Transformer2DModel  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux_kontext import FluxKontextPipeline  # noqa: E402
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline  # noqa: E402


def _flux1_pos_embed():
    """The pos_embed of a FluxTransformer2DModel with FLUX.1's head (128 = 16 + 56 + 56): the
    model, not FluxPosEmbed alone, so that its theta is the one the model builds with."""
    return FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=128,
                                  num_attention_heads=1, in_channels=4, joint_attention_dim=8,
                                  pooled_projection_dim=8).pos_embed


def _flux2_pos_embed():
    return Flux2Transformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=128,
                                   num_attention_heads=1, in_channels=4, joint_attention_dim=8,
                                   timestep_guidance_channels=8).pos_embed


def _cache(freqs) -> np.ndarray:
    """diffusers' (cos, sin) [S, D], each pair's value twice, as the cache: cos half, sin half."""
    cos, sin = freqs
    assert torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2], sin[:, 1::2])
    return torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=1).numpy()


def _bits_equal(got, want: np.ndarray) -> bool:
    g = got.numpy() if isinstance(got, torch.Tensor) else got
    return g.dtype == np.float32 and g.shape == want.shape and np.array_equal(
        g.view(np.int32), want.view(np.int32))


def _flux1_reference(txt_ids, img_ids):
    """FluxTransformer2DModel.forward's way: one pos_embed over cat(txt_ids, img_ids)."""
    both = _cache(_flux1_pos_embed()(torch.cat([txt_ids, img_ids], dim=0)))
    return both[len(txt_ids):], both[:len(txt_ids)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("latent_hw, txt", [((64, 64), 512),   # dev, 1024x1024, 512 tokens
                                             ((48, 80), 256)])  # schnell, 768x1280, 256 tokens
def test_flux1_ids_bit_equal_to_diffusers(latent_hw, txt, dtype):
    img_ids = FluxPipeline._prepare_latent_image_ids(1, *latent_hw, "cpu", dtype)
    txt_ids = torch.zeros(txt, 3).to(dtype=dtype)  # FluxPipeline.encode_prompt's text ids
    want_img, want_txt = _flux1_reference(txt_ids, img_ids)
    got = build_flux_rope_caches(txt_ids, img_ids, axes_dims=by_name('flux1').axes,
                                 theta=by_name('flux1').theta)
    assert _bits_equal(got.img, want_img) and _bits_equal(got.txt, want_txt)
    assert got.img.shape == (latent_hw[0] * latent_hw[1], 128) and got.txt.shape == (txt, 128)


def test_flux1_kontext_condition_image_bit_equal_to_diffusers():
    """FluxKontextPipeline: the condition image's ids have first coordinate 1 and follow the
    generated image's (its own size: 512x768 next to an 832x1216 output)."""
    latent_ids = FluxKontextPipeline._prepare_latent_image_ids(1, 52, 76, "cpu", torch.bfloat16)
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(1, 32, 48, "cpu", torch.bfloat16)
    image_ids[..., 0] = 1
    img_ids = torch.cat([latent_ids, image_ids], dim=0)
    txt_ids = torch.zeros(512, 3, dtype=torch.bfloat16)
    want_img, want_txt = _flux1_reference(txt_ids, img_ids)
    got = build_flux_rope_caches(txt_ids, img_ids, axes_dims=(16, 56, 56), theta=10000)
    assert _bits_equal(got.img, want_img) and _bits_equal(got.txt, want_txt)
    assert not np.array_equal(want_img[:52 * 76][:32 * 48], want_img[52 * 76:])  # frame 1 differs


@pytest.mark.parametrize("pipeline", [Flux2Pipeline, Flux2KleinPipeline])
def test_flux2_ids_with_a_reference_image_bit_equal_to_diffusers(pipeline):
    """Flux2Pipeline / klein: text (0, 0, 0, l), image (0, h, w, 0), reference image k at
    T = 10 + 10k; the batched [B, S, 4] int64 ids as the pipelines pass them."""
    batch = 2
    prompt_embeds = torch.zeros(batch, 512, 8)
    latents = torch.zeros(batch, 4, 64, 48)                       # 1024x768 output
    refs = [torch.zeros(1, 4, 40, 40), torch.zeros(1, 4, 24, 56)]  # two reference images
    txt_ids = pipeline._prepare_text_ids(prompt_embeds)
    latent_ids = pipeline._prepare_latent_ids(latents)
    ref_ids = pipeline._prepare_image_ids(refs).repeat(batch, 1, 1)
    img_ids = torch.cat([latent_ids, ref_ids], dim=1)
    assert txt_ids.shape == (batch, 512, 4) and img_ids.shape == (batch, 64 * 48 + 1600 + 1344, 4)
    pos_embed = _flux2_pos_embed()
    # Flux2Transformer2DModel.forward: item 0 of 3-D ids, one pos_embed per stream
    want_img, want_txt = _cache(pos_embed(img_ids[0])), _cache(pos_embed(txt_ids[0]))
    got = build_flux_rope_caches(txt_ids, img_ids, axes_dims=by_name('flux2').axes,
                                 theta=by_name('flux2').theta)
    assert _bits_equal(got.img, want_img) and _bits_equal(got.txt, want_txt)
    assert not np.array_equal(want_txt[0], want_txt[1])  # FLUX.2 rotates the text


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_every_integer_position_to_4096_bit_equal(family):
    """Each axis of both families over positions 0..4096 (past Qwen-Image's table, which FLUX
    does not have), fractional and negative ones, and -0.0 (whose sine keeps its sign)."""
    n_axes = 3 if family == "flux1" else 4
    pos = np.arange(4097, dtype=np.float32)
    extra = np.array([-0.0, -1.0, -4096.5, 0.25, 1e5 + 0.5, 2.0 ** 24], np.float32)
    ids = torch.from_numpy(np.repeat(np.concatenate([pos, extra])[:, None], n_axes, axis=1))
    pos_embed = _flux1_pos_embed() if family == "flux1" else _flux2_pos_embed()
    want = _cache(pos_embed(ids))
    axes, theta = ((by_name('flux1').axes, by_name('flux1').theta) if family == "flux1"
                   else (by_name('flux2').axes, by_name('flux2').theta))
    got = build_flux_rope_caches(ids[:1], ids, axes_dims=axes, theta=theta)
    assert _bits_equal(got.img, want)
    assert np.signbit(got.img.numpy()[4097, 64]) and not np.signbit(got.img.numpy()[0, 64])


def test_forms_and_memo():
    """Ids as numpy, nested lists, int64 or the batched form give the same caches; equal ids
    are built once (the same tensors back)."""
    img = FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32)
    txt = torch.zeros(4, 3)
    a = build_flux_rope_caches(txt, img, axes_dims=(4, 6, 6), theta=10000)
    for t, i in ((txt.numpy(), img.numpy()), (txt.tolist(), img.long()),
                 (txt.expand(3, -1, -1), img[None].expand(2, -1, -1))):
        b = build_flux_rope_caches(t, i, axes_dims=(4, 6, 6), theta=10000)
        assert torch.equal(a.img, b.img) and torch.equal(a.txt, b.txt)
    assert build_flux_rope_caches(txt.clone(), img.clone(), axes_dims=[4, 6, 6], theta=10000.0).img is a.img
    assert build_flux_rope_caches(txt, img, axes_dims=(4, 6, 6), theta=2000).img is not a.img


@pytest.mark.parametrize("kwargs, match", [
    (dict(txt_ids=np.zeros((5, 4))), r"txt_ids must be \[tokens, 3\].*got shape \[5, 4\] "
                                     r"\(ids of 4 columns are another model's"),
    (dict(img_ids=[[0, 0, 0], [0, 0]]), "img_ids must be .*got list that is no array"),
    (dict(img_ids=np.zeros((7,))), r"img_ids must be \[tokens, 3\].*got shape \[7\]"),
    (dict(txt_ids=np.zeros((0, 3))), r"at least one token; got shape \[0, 3\]"),
    (dict(txt_ids=torch.zeros(2, 3, dtype=torch.bool)), "integers or floats; got dtype bool"),
    (dict(img_ids=np.zeros((2, 3), np.complex64)), "got dtype complex64"),
    (dict(img_ids=np.array([[0, 0, 0], [0, np.inf, 1]])), r"NaN or infinite position \(token 1"),
    (dict(img_ids=np.stack([np.zeros((2, 3)), np.ones((2, 3))])), "different ids per batch item"),
    (dict(img_ids=np.zeros((0, 2, 3))), "no batch item"),
    (dict(txt_ids=None), r"txt_ids must be \[tokens, axes\] position ids.*got None"),
    (dict(img_ids=torch.zeros(4, 3, device="meta")), "dense tensor with values"),
    (dict(axes_dims=(16, 55, 56)), "positive even widths"),
    (dict(axes_dims="16,56,56"), "RoPE width of each axis"),
    (dict(theta=float("nan")), "theta .* finite number > 0"),
    (dict(theta=True), "theta .* finite number > 0"),
])
def test_refusals_are_one_line(kwargs, match):
    args = dict(txt_ids=np.zeros((2, 3)), img_ids=np.zeros((4, 3)), axes_dims=(16, 56, 56),
                theta=10000)
    args.update(kwargs)
    with pytest.raises(InputError, match=match) as info:
        build_flux_rope_caches(**args)
    assert "\n" not in str(info.value)


def test_the_byte_bound_refuses_before_building(monkeypatch):
    """No position limit, but caches above MAX_CACHE_BYTES are refused before any is built."""
    monkeypatch.setattr(caches_mod, "MAX_CACHE_BYTES", 100 * 128 * 4)
    monkeypatch.setattr(rt, "cache", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(InputError, match=r"101 rows x 128 fp32.*MAX_CACHE_BYTES"):
        build_flux_rope_caches(np.zeros((1, 3)), np.full((100, 3), 9000.0), axes_dims=(16, 56, 56),
                               theta=10000)


# --------------------------------------------------------------------------------------------
# caches_for on a FLUX engine (a sidecar as `qkrope build` writes it; the engine is not read)
# --------------------------------------------------------------------------------------------

def _engine(tmp_path, config, width=16, max_img=64, max_txt=8):
    from qkrope.sidecars import EngineInfo, EngineTensor

    shapes = {"hidden_states": ["batch", "img_tokens", 4], "img_cos_sin_cache": ["img_cache_rows", width],
              "txt_cos_sin_cache": ["txt_cache_rows", width]}
    hi = {"batch": 2, "img_tokens": max_img, "img_cache_rows": max_img, "txt_cache_rows": max_txt}

    def dims(shape, level):
        return [d if isinstance(d, int) else 1 if level == "min" else hi[d] for d in shape]

    engine = tmp_path / "flux.engine"
    engine.write_bytes(b"not read by caches_for")
    EngineInfo(tensorrt_version="10.14", onnx="flux.onnx",
               inputs=[EngineTensor(n, "float32", [-1 if isinstance(d, str) else d for d in s],
                                    [d if isinstance(d, str) else None for d in s])
                       for n, s in shapes.items()],
               outputs=[EngineTensor("output", "float32", [-1, -1, 4])],
               profiles=[{n: {lv: dims(s, lv) for lv in ("min", "opt", "max")}
                          for n, s in shapes.items()}],
               plugin=None, plugin_layers=2, version_compatible=False, strongly_typed=True,
               config=config, profile_labels=["tiny"]).save(engine)
    return engine


def test_caches_for_a_flux2_engine_reads_family_axes_and_theta(tmp_path):
    engine = _engine(tmp_path, {"family": "flux2", "axes_dims_rope": [4, 4, 4, 4],
                                "rope_theta": 2000, "head_dim": 16})
    txt_ids = Flux2Pipeline._prepare_text_ids(torch.zeros(2, 6, 8))
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(2, 4, 4, 8))
    got = caches_for(engine, txt_ids=txt_ids, img_ids=img_ids, batch=2)
    want = build_flux_rope_caches(txt_ids, img_ids, axes_dims=(4, 4, 4, 4), theta=2000)
    other = build_flux_rope_caches(txt_ids, img_ids, axes_dims=(4, 4, 4, 4), theta=10000)
    assert torch.equal(got.img, want.img) and torch.equal(got.txt, want.txt)
    assert not torch.equal(got.img, other.img)  # the sidecar's theta was used
    assert got.img.shape == (32, 16) and got.txt.shape == (6, 16)


def test_caches_for_a_flux_engine_refuses_before_building(tmp_path, monkeypatch):
    engine = _engine(tmp_path, {"family": "flux1", "axes_dims_rope": [4, 6, 6]})
    txt, img = np.zeros((4, 3)), FluxPipeline._prepare_latent_image_ids(1, 8, 8, "cpu", torch.float32)
    assert caches_for(engine, txt_ids=txt, img_ids=img).img.shape == (64, 16)  # theta 10000
    monkeypatch.setattr(rt, "cache", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(InputError, match=r"cannot serve 72 image tokens, 4 text tokens.*profile 0 "
                                         r"\(tiny\): img_cos_sin_cache 1..64"):
        caches_for(engine, txt_ids=txt, img_ids=np.zeros((72, 3)))
    with pytest.raises(InputError, match="batch 3"):
        caches_for(engine, txt_ids=txt, img_ids=np.zeros((8, 3)), batch=3)
    with pytest.raises(InputError, match=r"FLUX.1 model: its caches come from txt_ids, img_ids, not img_shapes, txt_seq_len"):
        caches_for(engine, [(1, 8, 8)], 4)
    with pytest.raises(InputError, match="needs txt_ids and img_ids"):
        caches_for(engine, img_ids=img)
    with pytest.raises(InputError, match=r"txt_ids must be \[tokens, 3\]"):
        caches_for(engine, txt_ids=np.zeros((4, 4)), img_ids=img)
    wide = _engine(tmp_path, {"family": "flux1", "axes_dims_rope": [16, 56, 56]})
    with pytest.raises(InputError, match="is 16 wide but its axes_dims_rope"):
        caches_for(wide, txt_ids=txt, img_ids=img)


def test_caches_for_a_qwen_engine_refuses_ids(tmp_path):
    engine = _engine(tmp_path, {"axes_dims_rope": [4, 6, 6]})
    assert caches_for(engine, [(1, 4, 4)], 3).img.shape == (16, 16)
    with pytest.raises(InputError, match="come from img_shapes, txt_seq_len, not txt_ids, img_ids"):
        caches_for(engine, txt_ids=np.zeros((3, 3)), img_ids=np.zeros((16, 3)))
    with pytest.raises(InputError, match="needs img_shapes and txt_seq_len"):
        caches_for(engine, [(1, 4, 4)])


# --------------------------------------------------------------------------------------------
# Triton: the repository's rope model from ids (run with the stand-in Python-backend utils)
# --------------------------------------------------------------------------------------------

FLUX_SETUPS = {"flux1": ([4, 6, 6], None, 10000.0), "flux2": ([4, 4, 4, 4], 2000, 2000.0)}


def _flux_engine_for_triton(tmp_path, family):
    """A FLUX-like transformer engine sidecar (FLUX's inputs, no mask) as `qkrope build` writes
    it, with a plugin recorded by hash; the plan bytes are not read."""
    import hashlib

    from qkrope.sidecars import EngineInfo, EngineTensor, PluginRecord

    axes, theta, _ = FLUX_SETUPS[family]
    shapes = {"hidden_states": ["batch", "img_tokens", 4],
              "encoder_hidden_states": ["batch", "txt_tokens", 8],
              "pooled_projections": ["batch", 8], "timestep": ["batch"],
              "img_cos_sin_cache": ["img_cache_rows", sum(axes)],
              "txt_cos_sin_cache": ["txt_cache_rows", sum(axes)]}
    hi = {"batch": 1, "img_tokens": 128, "txt_tokens": 16, "img_cache_rows": 128,
          "txt_cache_rows": 16}
    plugin = tmp_path / "libqkrope_plugin.so"
    plugin.write_bytes(b"\x7fELF fake plugin")
    config = {"family": family, "axes_dims_rope": axes, "head_dim": sum(axes),
              "diffusers_config": {"axes_dims_rope": axes}}
    if theta is not None:
        config["rope_theta"] = theta
    engine = tmp_path / f"{family}.engine"
    engine.write_bytes(b"not really a TensorRT plan")
    EngineInfo(tensorrt_version="10.14", onnx=f"{family}.onnx",
               inputs=[EngineTensor(n, "float32", [-1 if isinstance(d, str) else d for d in s],
                                    [d if isinstance(d, str) else None for d in s])
                       for n, s in shapes.items()],
               outputs=[EngineTensor("sample", "float32", [-1, -1, 4],
                                     ["batch", "img_tokens", None])],
               profiles=[{n: {lv: [d if isinstance(d, int) else 1 if lv == "min" else hi[d]
                                   for d in s] for lv in ("min", "opt", "max")}
                          for n, s in shapes.items()}],
               plugin=PluginRecord(str(plugin), hashlib.sha256(plugin.read_bytes()).hexdigest()),
               plugin_layers=2, version_compatible=False, strongly_typed=True,
               config=config).save(engine)
    return engine


@pytest.mark.parametrize("family", list(FLUX_SETUPS))
def test_triton_rope_model_from_ids_is_the_runtime_function(family, tmp_path, monkeypatch):
    pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")
    from _triton_helpers import Tensor, io, load_rope_model, parse

    from qkrope.runtime import triton

    engine = _flux_engine_for_triton(tmp_path, family)
    # the plugin is the caller's (the sidecar's record only checks it)
    triton.write_repository(engine, tmp_path / "repo", name="flux",
                            plugin=tmp_path / "libqkrope_plugin.so")
    n_axes = len(FLUX_SETUPS[family][0])
    rope_cfg, ens_cfg = (parse(tmp_path / "repo" / m / "config.pbtxt") for m in ("flux_rope", "flux"))
    assert io(rope_cfg, "input") == [("txt_ids", "TYPE_FP32", [-1, n_axes]),
                                     ("img_ids", "TYPE_FP32", [-1, n_axes]),
                                     ("hidden_states", "TYPE_FP32", [-1, -1, 4]),
                                     ("encoder_hidden_states", "TYPE_FP32", [-1, -1, 8])]
    assert {n for n, _, _ in io(ens_cfg, "input")} == {
        "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "txt_ids",
        "img_ids"}
    rope_step = next(s for s in ens_cfg.ensemble_scheduling.step if s.model_name == "flux_rope")
    assert set(rope_step.input_map) == {"txt_ids", "img_ids", "hidden_states",
                                        "encoder_hidden_states"}
    model, pb = load_rope_model(tmp_path / "repo" / "flux_rope", monkeypatch)

    if family == "flux1":
        img_ids = torch.cat([FluxKontextPipeline._prepare_latent_image_ids(1, 6, 8, "cpu", torch.float32),
                             FluxKontextPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)
                             + torch.tensor([1.0, 0, 0])])
        txt_ids = torch.zeros(16, 3)
    else:
        img_ids = torch.cat([Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 4, 6, 8))[0],
                             Flux2Pipeline._prepare_image_ids([torch.zeros(1, 4, 4, 4)])[0]])
        txt_ids = Flux2Pipeline._prepare_text_ids(torch.zeros(1, 16, 8))[0]

    def request(txt, img, img_tokens=None, txt_tokens=None):
        return pb.InferenceRequest([
            Tensor("txt_ids", np.asarray(txt, np.float32)), Tensor("img_ids", np.asarray(img, np.float32)),
            Tensor("hidden_states", np.zeros((1, img_tokens or len(img), 4), np.float32)),
            Tensor("encoder_hidden_states", np.zeros((1, txt_tokens or len(txt), 8), np.float32))])

    want = build_flux_rope_caches(txt_ids, img_ids, axes_dims=FLUX_SETUPS[family][0],
                                  theta=FLUX_SETUPS[family][2])
    bad = {"axes": (request(np.zeros((16, n_axes + 1)), img_ids), f"txt_ids must be [tokens, {n_axes}]"),
           "nan": (request(txt_ids, np.full((64, n_axes), np.nan)), "NaN or infinite"),
           "rows": (request(txt_ids, img_ids, img_tokens=len(img_ids) + 1), "the ids must be those"),
           "limit": (request(txt_ids, np.zeros((200, n_axes))), "more than the 128")}
    responses = model.execute([request(txt_ids, img_ids)] + [r for r, _ in bad.values()]
                              + [request(txt_ids.numpy(), img_ids.numpy())])
    for resp in (responses[0], responses[-1]):  # the second is the kept caches
        assert resp.error is None
        img = pb.get_output_tensor_by_name(resp, "img_cos_sin_cache").as_numpy()
        txt = pb.get_output_tensor_by_name(resp, "txt_cos_sin_cache").as_numpy()
        assert _bits_equal(img, want.img.numpy())
        assert _bits_equal(txt, want.txt.numpy())
    assert len(model.cache) == 1
    for resp, (_, reason) in zip(responses[1:-1], bad.values()):
        assert resp.error.code() == pb.TritonError.INVALID_ARG and reason in resp.error.message()
