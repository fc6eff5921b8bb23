"""FLUX.3 (Flux3Transformer2DModel, qkrope/families/flux3): its cache-input wrapper bit for bit
diffusers' forward (fp32, and bf16 / fp16 with norm_q / norm_k in float32 as the class keeps
them); the node bit for bit diffusers' Flux3AttnProcessor norm + RoPE in the record's rounding
(mode 0, float32 norm weights) and in no other mode; the caches bit for bit diffusers'
Flux3PosEmbed on the pipelines' ids (h / w scaled by 0.5); the export (one node per attention,
float32 norm initializers in a bf16 graph) in ONNX Runtime at untraced shapes through the
drop-in, within the FLUX tests' per-call bound (fp32: ONNX Runtime's CPU provider has no bf16
kernels); diffusers' modular denoiser step (Flux3LoopDenoiser, classifier-free guidance) on the
drop-in; the refusals, one line each. The tiny transformer is the family's tiny hook's (1 + 1
per-mode blocks and 1 joint block, 2 heads x 16, RoPE axes (4, 4, 4, 4))."""

from __future__ import annotations

import copy
import inspect
import json

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import torch  # noqa: E402

from qkrope import contract, families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

FLUX3 = families.by_name("flux3")
TINY = families.hooks(FLUX3, "tiny")
#: the per-call bound of an fp32 export relative to max|output| (tests/_flux_models.py: its
#: derivation for the dual-stream models, whose attention and node order this graph shares)
PARITY = 5e-4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(dtype=torch.float32, seed=0):
    model = TINY.build_transformer(FLUX3, seed)
    return TINY.keep_in_fp32(model.to(dtype)) if dtype != torch.float32 else model


def _ids(h, w, txt):
    from qkrope.families.flux3.dropin import pipeline_ids

    return tuple(torch.from_numpy(a) for a in pipeline_ids((1, h, w), txt))


def _inputs(dtype, batch=2, h=5, w=6, txt=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    txt_ids, img_ids = _ids(h, w, txt)
    return dict(hidden_states=torch.randn(batch, h * w, 4, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=g).to(dtype),
                timestep=torch.rand(batch, generator=g).to(dtype), img_ids=img_ids,
                txt_ids=txt_ids)


def _caches(kw):
    from qkrope.runtime.dual_stream import caches_from_ids

    return caches_from_ids("FLUX.3", kw["txt_ids"], kw["img_ids"], axes_dims=(4, 4, 4, 4),
                           theta=10000, head_dim=16)


@pytest.mark.parametrize("name", DTYPES)
def test_wrapper_is_bit_exact_with_diffusers(name):
    from qkrope.families.flux3 import export

    model = _model(DTYPES[name])
    assert model.txt_mode_blocks[0].attn.norm_q.weight.dtype == torch.float32
    kw = _inputs(DTYPES[name])
    caches = _caches(kw)
    wrapper = export.Flux3CacheInputTransformer(copy.deepcopy(model), rounding=FLUX3.rounding)
    with torch.no_grad():
        want = model(**kw, return_dict=False)[0]
        got = wrapper(kw["hidden_states"], kw["encoder_hidden_states"], kw["timestep"],
                      caches.img, caches.txt)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_node_is_the_models_norm_and_rope_in_its_rounding(name):
    """Flux3AttnProcessor's steps (norm_q on q.float() with its float32 weight, apply_rotary_emb
    with the model's own tables, one cast to the value dtype): bit for bit the node with the
    float32 weight in rounding mode 0, and in no other mode."""
    from diffusers.models.embeddings import apply_rotary_emb

    from qkrope.export.ops import qk_norm_rope

    dtype = DTYPES[name]
    model = _model(dtype)
    norm = model.single_transformer_blocks[0].attn.norm_q
    h, w, txt = 6, 5, 9
    txt_ids, img_ids = _ids(h, w, txt)
    ids = torch.cat([txt_ids, img_ids])
    tables = model.pos_embed(ids)
    caches = _caches(dict(txt_ids=txt_ids, img_ids=img_ids))
    cache = torch.cat([caches.txt, caches.img])
    q = (torch.randn(2, ids.shape[0], 2, 16, generator=torch.Generator().manual_seed(0))
         * 3).to(dtype)
    with torch.no_grad():
        want = apply_rotary_emb(norm(q.float()), tables, sequence_dim=1).to(dtype)
        exact = {mode for mode in contract.ROUNDING_MODES if torch.equal(
            qk_norm_rope(q, q, norm.weight, norm.weight, cache, eps=norm.eps,
                         rounding=mode)[0], want)}
    assert exact == {FLUX3.rounding} == {contract.ROUNDING_ONE}


@pytest.mark.parametrize("size", [(8, 8, 16), (64, 48, 512), (5, 7, 3)])
def test_caches_are_bit_equal_to_diffusers(size):
    """The "ids" scheme on the pipelines' ids (fractional h / w positions) against diffusers'
    Flux3PosEmbed at FLUX.3's real axes and theta."""
    from diffusers.models.transformers.transformer_flux3 import Flux3PosEmbed

    from qkrope.runtime.dual_stream import caches_from_ids

    h, w, txt = size
    txt_ids, img_ids = _ids(h, w, txt)
    pos = Flux3PosEmbed(theta=10000, axes_dim=list(FLUX3.axes))
    caches = caches_from_ids("FLUX.3", txt_ids, img_ids, axes_dims=FLUX3.axes, theta=10000,
                             head_dim=128)
    for ids, cache in ((txt_ids, caches.txt), (img_ids, caches.img)):
        cos, sin = pos(ids)
        assert torch.equal(cache, torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=1))
        # diffusers repeats each pair's angle (interleaved pairs): the two halves agree
        assert torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2],
                                                                          sin[:, 1::2])


def test_the_flow_map_wrapper_is_bit_exact_with_diffusers():
    """A flow-map model (flow_map=True: target_timestep's embedding added to every mode's): the
    flow-map wrapper (target_timestep after the timestep) bit for bit diffusers' forward, in
    fp32 and in bf16 with the float32 norms; and the jump matters (another target_timestep,
    other outputs)."""
    from qkrope.families.flux3 import export

    for dtype in (torch.float32, torch.bfloat16):
        model = TINY.build_transformer(FLUX3, 2, flow_map=True)
        model = TINY.keep_in_fp32(model.to(dtype)) if dtype != torch.float32 else model
        kw = _inputs(dtype)
        target = torch.tensor([0.25, 0.1]).to(dtype)
        caches = _caches(kw)
        wrapper = export.Flux3FlowMapCacheInputTransformer(copy.deepcopy(model),
                                                           rounding=FLUX3.rounding)
        with torch.no_grad():
            want = model(**kw, target_timestep=target, return_dict=False)[0]
            got = wrapper(kw["hidden_states"], kw["encoder_hidden_states"], kw["timestep"],
                          target, caches.img, caches.txt)
            other = wrapper(kw["hidden_states"], kw["encoder_hidden_states"], kw["timestep"],
                            target * 0, caches.img, caches.txt)
        assert got.dtype == want.dtype and torch.equal(got, want), dtype
        assert not torch.equal(other, got)


def test_fp8_keeps_a_flow_map_models_target_timestep_embedder_in_high_precision():
    """The default FP8 selection of a loaded model adds the modules its config flags built: a
    flow-map model's target_timestep_embedder (an embedding, as timestep_embedder) stays in
    high precision; a model without one gets the record's list alone, which check_exclude
    (every name must be a module) accepts."""
    pytest.importorskip("modelopt", reason="requires nvidia-modelopt (pip install -e '.[fp8]')")
    from qkrope.export import quantize
    from qkrope.quantization import default_excluded

    flow_map = TINY.build_transformer(FLUX3, 2, flow_map=True)
    plain = _model()
    assert default_excluded(flow_map) == FLUX3.fp8_excluded + ("target_timestep_embedder",)
    assert default_excluded(plain) == default_excluded(FLUX3.class_name) == FLUX3.fp8_excluded
    rules = quantize.fp8_config(default_excluded(flow_map), model=flow_map)["quant_cfg"]
    assert {"quantizer_name": "target_timestep_embedder.*", "enable": False} in rules
    quantize.fp8_config(default_excluded(plain), model=plain)  # no missing-module refusal


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.api import export_transformer

    root = tmp_path_factory.mktemp("flux3")
    _model().save_pretrained(str(root / "diffusers"))
    TINY.build_transformer(FLUX3, 2, flow_map=True).save_pretrained(str(root / "flow-map-d"))
    out = {}
    for name, folder, dtype in (("fp32", "diffusers", "fp32"), ("bf16", "diffusers", "bf16"),
                                ("flow-map", "flow-map-d", "fp32")):
        out[name] = root / name / "flux3.onnx"
        out[name].parent.mkdir()
        export_transformer(root / folder, out[name], dtype=dtype, progress=False)
    out["diffusers"] = root / "diffusers"
    out["flow-map-diffusers"] = root / "flow-map-d"
    return out


@pytest.mark.slow  # the module's three exports (~15 s on 2 cores)
def test_one_node_per_attention_and_float32_norm_weights(exported):
    import onnx

    for name in ("fp32", "bf16"):
        graph = onnx.load(str(exported[name])).graph
        nodes = [n for n in graph.node if n.op_type == "QKNormRoPE"]
        # text per-mode, image per-mode, joint: one node each
        assert len(nodes) == 3
        assert all({a.name: a.i for a in n.attribute}["rounding"] == contract.ROUNDING_ONE
                   for n in nodes)
        types = {i.name: i.data_type for i in graph.initializer}
        norms = {k: v for k, v in types.items() if k.endswith(("norm_q.weight",
                                                                  "norm_k.weight"))}
        assert len(norms) == 6 and set(norms.values()) == {onnx.TensorProto.FLOAT}
        others = {v for k, v in types.items() if k.endswith("to_q.weight")}
        assert others == {onnx.TensorProto.FLOAT if name == "fp32"
                          else onnx.TensorProto.BFLOAT16}


@pytest.mark.slow  # the module's exports
def test_onnxruntime_at_untraced_shapes(exported):
    """The drop-in (ONNX Runtime) at sizes the trace never saw: fp32 within the per-call bound
    of the stock model (ONNX Runtime's CPU provider has no bfloat16 kernels: a bf16 export's
    parity is a GPU check)."""
    import diffusers

    from qkrope.runtime import load_transformer

    stock = diffusers.Flux3Transformer2DModel.from_pretrained(str(exported["diffusers"])).eval()
    dropin = load_transformer(exported["fp32"])
    for size in ((7, 9, 11), (4, 12, 3)):
        kw = _inputs(torch.float32, h=size[0], w=size[1], txt=size[2], seed=11)
        with torch.no_grad():
            want = stock(**kw, return_dict=False)[0]
        got = dropin(**kw, return_dict=False)[0]
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert got.shape == want.shape and 0 < err <= PARITY * scale, (size, err, scale)


@pytest.mark.slow  # the module's exports
def test_the_modular_denoiser_on_the_dropin(exported):
    """diffusers' Flux3LoopDenoiser (classifier-free guidance 3.5, the fields it forwards by the
    transformer's signature), the drop-in set into a Flux3ModularPipeline with
    update_components: its prediction within the per-call bound times the guidance's
    (1 + 2 x 3.5) of the stock model's."""
    import diffusers
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported["fp32"])
    params = inspect.signature(dropin.forward).parameters
    assert tuple(params) == type(dropin).FORWARD_ARGS and "img_ids" in params
    stock = diffusers.Flux3Transformer2DModel.from_pretrained(str(exported["diffusers"]))
    kw = _inputs(torch.float32, batch=1, h=6, w=10, txt=5, seed=2)
    neg = _inputs(torch.float32, batch=1, h=6, w=10, txt=3, seed=4)
    # the drop-in enters a real Flux3ModularPipeline the way the README says
    pipe = diffusers.Flux3AutoBlocks().init_pipeline()
    pipe.update_components(transformer=dropin, guider=ClassifierFreeGuidance(guidance_scale=3.5))
    assert pipe.transformer is dropin
    preds = []
    for components in (type("Components", (), dict(
            transformer=stock.eval(), guider=ClassifierFreeGuidance(guidance_scale=3.5)))(),
                       pipe):
        state = BlockState(latents=kw["hidden_states"], num_inference_steps=2,
                           denoiser_input_fields=dict(
                               prompt_embeds=kw["encoder_hidden_states"],
                               negative_prompt_embeds=neg["encoder_hidden_states"],
                               txt_ids=kw["txt_ids"], negative_txt_ids=neg["txt_ids"],
                               img_ids=kw["img_ids"]))
        _, state = Flux3LoopDenoiser()(components, state, 0, torch.tensor(700.0))
        preds.append(state.noise_pred)
    want, got = preds
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert got.shape == want.shape and 0 < err <= PARITY * (1 + 2 * 3.5) * scale, (err, scale)


@pytest.mark.slow  # the module's exports
def test_the_distilled_denoiser_on_a_flow_map_dropin(exported):
    """A flow-map export (target_timestep an input after the timestep) in diffusers'
    Flux3DistilledLoopDenoiser, which passes the next scheduler timestep as target_timestep:
    the drop-in's prediction within the per-call bound of the stock flow-map model's (no
    guidance: distilled); the export's sidecar and graph hold the input; a call without
    target_timestep is refused in one line, and the text-to-image export refuses one."""
    import diffusers
    import onnx
    from diffusers.modular_pipelines.flux3.denoise import Flux3DistilledLoopDenoiser
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    from qkrope.families.flux3.dropin import TARGET_TIMESTEP_MISSING, TARGET_TIMESTEP_REFUSED
    from qkrope.runtime import load_transformer

    names = [i.name for i in onnx.load(str(exported["flow-map"]),
                                       load_external_data=False).graph.input]
    assert names[:4] == ["hidden_states", "encoder_hidden_states", "timestep",
                         "target_timestep"]
    dropin = load_transformer(exported["flow-map"])
    stock = diffusers.Flux3Transformer2DModel.from_pretrained(
        str(exported["flow-map-diffusers"])).eval()
    kw = _inputs(torch.float32, batch=1, h=6, w=10, txt=5, seed=2)
    preds = []
    for transformer in (stock, dropin):
        components = type("Components", (), dict(transformer=transformer))()
        state = BlockState(latents=kw["hidden_states"],
                           timesteps=torch.tensor([700.0, 300.0]),
                           denoiser_input_fields=dict(prompt_embeds=kw["encoder_hidden_states"],
                                                      txt_ids=kw["txt_ids"],
                                                      img_ids=kw["img_ids"]))
        _, state = Flux3DistilledLoopDenoiser()(components, state, 0, torch.tensor(700.0))
        preds.append(state.noise_pred)
    want, got = preds
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert got.shape == want.shape and 0 < err <= PARITY * scale, (err, scale)
    with pytest.raises(InputError) as e:
        dropin(**kw, return_dict=False)
    assert str(e.value) == TARGET_TIMESTEP_MISSING
    with pytest.raises(InputError) as e:
        load_transformer(exported["fp32"])(**kw, target_timestep=torch.zeros(1),
                                           return_dict=False)
    assert str(e.value) == TARGET_TIMESTEP_REFUSED


REFUSED = [(dict(image_cond_hidden_states=torch.zeros(2, 4, 4),
                 image_cond_ids=torch.zeros(4, 4)), "image_cond"),
           (dict(target_timestep=torch.zeros(2)), "target_timestep"),
           (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
           (dict(encoder_hidden_states=torch.zeros(1, 7, 32)), "batch"),
           (dict(img_ids=torch.zeros(29, 4)), "img_ids"),
           (dict(guidance=torch.ones(2)), "guidance")]


@pytest.mark.slow  # the module's exports
@pytest.mark.parametrize("extra, match", REFUSED, ids=[m for _, m in REFUSED])
def test_refusals(exported, extra, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported["fp32"])
    kw = dict(_inputs(torch.float32), **extra)
    with pytest.raises(InputError, match=match) as e:
        dropin(**kw)
    assert "\n" not in str(e.value)


def test_the_tiny_pipeline_is_refused_in_one_line(tmp_path):
    with pytest.raises(InputError, match="modular") as e:
        TINY.save_pipeline(FLUX3, tmp_path / "p")
    assert "\n" not in str(e.value) and not (tmp_path / "p").exists()


def test_the_streamed_reference_keeps_the_float32_norms(tmp_path):
    """``qkrope check``'s streamed reference (one block resident, qkrope.apps.check_blocks) of a
    bf16 check: the class's _keep_in_fp32_modules (norm_q, norm_k) read in float32 from the
    shards, as diffusers' from_pretrained(torch_dtype=bf16) keeps them, so the two forwards
    agree bit for bit; a reference that cast the norms to bf16 would not (checked: it differs)."""
    import diffusers

    from qkrope.apps.check_blocks import StreamedTransformer

    _model(seed=5).save_pretrained(str(tmp_path / "f3"))
    stock = diffusers.Flux3Transformer2DModel.from_pretrained(
        str(tmp_path / "f3"), torch_dtype=torch.bfloat16).eval()
    assert stock.txt_mode_blocks[0].attn.norm_q.weight.dtype == torch.float32
    streamed = StreamedTransformer(tmp_path / "f3", dtype=torch.bfloat16,
                                   class_name=FLUX3.class_name)
    kw = {**_inputs(torch.bfloat16), "return_dict": False}
    with torch.no_grad():
        want = stock(**kw)[0]
        got = streamed(**kw)[0]
        for name, p in stock.named_parameters():
            if "norm_q" in name or "norm_k" in name:
                p.data = p.data.to(torch.bfloat16)
        cast = stock(**kw)[0]
    assert torch.equal(got, want)
    assert not torch.equal(cast, want)
