"""Ideogram 4 (Ideogram4Transformer2DModel, qkrope/families/ideogram4): the host caches within one
float32 ulp of diffusers' Ideogram4MRoPE (tiny and real config, the pipeline's layouts); the
cache-input wrapper bit for bit diffusers' forward on diffusers' own tables (fp32 with the node,
bf16 / fp16 with diffusers' eager rotation in its place); the node against the model's own
norm_q + rotate_half: bit for bit in fp32, within the bound derived in docs/spec.md section 6e
in bf16 / fp16 (where no rounding mode is bit-exact); the export at untraced shapes in ONNX
Runtime through the drop-in, for the two calls Ideogram4Pipeline makes (the conditional one with
prompts of different lengths: one graph call per group; the image-only unconditional one),
within the FLUX tests' per-call bound; Ideogram4Pipeline on the drop-ins of its two
transformers (the tiny pipeline); the refusals. The tiny transformer is the family's tiny recipe
(2 blocks, 2 heads x 256 with diffusers' MRoPE, MLP 64, text features 24)."""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import torch  # noqa: E402

from qkrope import contract, families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

IDEOGRAM4 = families.by_name("ideogram4")
TINY = families.hooks(IDEOGRAM4, "tiny")
#: the per-call bound of an export in fp32 (tests/_flux_models.py: its derivation)
PARITY = 5e-4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(dtype=torch.float32, seed=0):
    """The tiny model in ``dtype`` as from_pretrained(torch_dtype=...) gives it: the RoPE
    frequencies stay float32 (``.to(dtype)`` alone would round that buffer too)."""
    model = TINY.build_transformer(IDEOGRAM4, seed)
    inv = model.rotary_emb.inv_freq.clone()
    model = model.to(dtype)
    model.rotary_emb.inv_freq = inv
    return model


def _pipeline_call(model, text_lengths=(5, 3), grid=(3, 5), max_text=7, seed=3):
    """The conditional call Ideogram4Pipeline makes (its own _prepare_ids layout: left padding,
    text, image), at an untraced size."""
    from diffusers import Ideogram4Pipeline

    pos, seg, ind = Ideogram4Pipeline._prepare_ids(list(text_lengths), grid[0], grid[1],
                                                   max_text, "cpu")
    g = torch.Generator().manual_seed(seed)
    batch, length = pos.shape[:2]
    cfg, dtype = model.config, model.dtype
    text = torch.randn(batch, length, cfg.llm_features_dim, generator=g)
    text[:, max_text:] = 0
    text[ind != 3] = 0
    latents = torch.randn(batch, grid[0] * grid[1], cfg.in_channels, generator=g)
    hidden = torch.cat([torch.zeros(batch, max_text, cfg.in_channels), latents], dim=1)
    return dict(hidden_states=hidden.to(dtype), timestep=torch.rand(batch, generator=g).to(dtype),
                encoder_hidden_states=text.to(dtype), position_ids=pos, segment_ids=seg,
                indicator=ind)


def _unconditional_call(call, max_text=7):
    """The pipeline's unconditional call: the image region alone, text features zero."""
    image = call["hidden_states"][:, max_text:]
    return dict(hidden_states=image, timestep=call["timestep"],
                encoder_hidden_states=torch.zeros(image.shape[0], image.shape[1],
                                                  call["encoder_hidden_states"].shape[-1],
                                                  dtype=image.dtype),
                position_ids=call["position_ids"][:, max_text:],
                segment_ids=call["segment_ids"][:, max_text:],
                indicator=call["indicator"][:, max_text:])


def _host_cache(config, position_ids, txt):
    """The drop-in's joined cache ``[text region; image]`` of one item's positions."""
    from qkrope.families.ideogram4 import dropin
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    head_dim = int(config["attention_head_dim"])
    setting = checked_setting("ids", (2,) * (head_dim // 2), float(config["rope_theta"]))
    caches = build_rope_caches("ids", dropin.request(position_ids, txt, config), setting)
    return torch.cat([caches.txt[:txt], caches.img])


def _diffusers_cache(rope, position_ids):
    """diffusers' own float32 cos / sin of ``position_ids [L, 3]`` as a ``[L, head_dim]`` cache
    (its duplicated halves: the first half of each)."""
    cos, sin = rope(position_ids[None])
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=1)


@pytest.mark.parametrize("which", ["small", "real"])
def test_host_caches_are_within_one_float32_ulp_of_diffusers(which):
    """The angles are diffusers' float32 products bit for bit; the scheme's cos / sin of them
    are the correctly rounded values, torch's float32 cos / sin within one ulp of those. At the
    tiny model's sizes and at the pipeline's 2048 x 2048 with long prompts."""
    from diffusers.models.transformers.transformer_ideogram4 import Ideogram4MRoPE
    from diffusers import Ideogram4Pipeline

    if which == "small":
        config, grid, lengths, max_text = dict(TINY.CONFIG), (6, 9), (5, 11), 16
    else:  # diffusers' defaults, the pipeline's 2048 x 2048 (128 x 128 patches)
        config = {"attention_head_dim": 256, "rope_theta": 5_000_000,
                  "mrope_section": (24, 20, 20)}
        grid, lengths, max_text = (128, 128), (40, 300), 512
    rope = Ideogram4MRoPE(int(config["attention_head_dim"]), config["rope_theta"],
                          tuple(config["mrope_section"]))
    pos, _, _ = Ideogram4Pipeline._prepare_ids(list(lengths), grid[0], grid[1], max_text, "cpu")
    worst, unequal, total = 0, 0, 0
    for item, txt in ((pos[0], max_text), (pos[1], max_text), (pos[0, max_text:], 0)):
        want = _diffusers_cache(rope, item)
        got = _host_cache(config, item, txt)
        ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
        worst = max(worst, int(ulps.max()))
        unequal += int((ulps > 0).sum())
        total += ulps.numel()
    assert worst <= 1, worst
    print(f"{which}: {unequal} of {total} cache values 1 ulp from diffusers', the rest equal")


class _EagerRotation:
    """diffusers' own norm + rotation (cos / sin cast to the activation dtype, rotate_half in
    it) from the wrapper's joined cache, in place of the node: the wrapper's every other step
    compared bit for bit in bf16 / fp16."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_ideogram4 import _rotate_half

        from qkrope.export.attention import _attention

        shape = (attn.num_heads, attn.head_dim)
        q = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, shape))
        k = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, shape))
        v = attn.to_v(hidden_states).unflatten(-1, shape)
        half = image_rotary_emb.shape[-1] // 2
        cos = image_rotary_emb[:, :half].repeat(1, 2).to(q.dtype)[:, None]
        sin = image_rotary_emb[:, half:].repeat(1, 2).to(q.dtype)[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         attention_mask, attn.head_dim)
        return attn.to_out[0](out.transpose(1, 2).flatten(2, 3))


@pytest.mark.parametrize("name", list(DTYPES))
def test_wrapper_is_bit_exact_with_diffusers(name):
    """The wrapper on one item's layout (two left-padding tokens), on diffusers' own tables:
    fp32 with the node, bf16 / fp16 with diffusers' rotation in the node's place."""
    from qkrope.families.ideogram4 import export

    dtype = DTYPES[name]
    model = _model(dtype)
    call = _pipeline_call(model, text_lengths=(5, 5))
    txt = 7
    with torch.no_grad():
        want = model(**call, return_dict=False)[0][:, txt:]
        wrapper = export.Ideogram4CacheInputTransformer(copy.deepcopy(model), IDEOGRAM4,
                                                        IDEOGRAM4.rounding)
        if dtype != torch.float32:
            for block in wrapper.transformer.layers:
                block.attention.set_processor(_EagerRotation())
        cache = _diffusers_cache(model.rotary_emb, call["position_ids"][0])
        mask = (call["indicator"][:, :txt] == 3).long()
        # the graph's inputs are contiguous tensors (the drop-in copies views)
        got = wrapper(call["hidden_states"][:, txt:].contiguous(),
                      call["encoder_hidden_states"][:, :txt].contiguous(), mask,
                      call["timestep"].float(), cache[txt:], cache[:txt])
    assert torch.equal(got, want), float((got - want).abs().max())


def derived_steps(dtype) -> float:
    """The node (rounding 1) against diffusers' bf16 / fp16 rotation, in steps of eps x the
    row's largest reference value: (1 + sqrt(2)) (1 + 3 eps) (docs/spec.md section 6e)."""
    eps = torch.finfo(dtype).eps
    return (1 + math.sqrt(2)) * (1 + 3 * eps)


@pytest.mark.parametrize("name", list(DTYPES))
def test_the_node_against_the_models_norm_and_rope(name):
    """diffusers' norm_q then rotate_half with its own tables against the node in the record's
    rounding: bit for bit in fp32; in bf16 / fp16 within the derived bound, and no rounding
    mode bit-exact (diffusers rounds cos, sin, both products and their sum)."""
    from diffusers.models.transformers.transformer_ideogram4 import _rotate_half

    from qkrope.export.ops import qk_norm_rope

    dtype = DTYPES[name]
    model = _model(dtype)
    norm = model.layers[0].attention.norm_q
    pos = _pipeline_call(model, text_lengths=(6, 6), grid=(8, 9), max_text=9)["position_ids"]
    cache = _diffusers_cache(model.rotary_emb, pos[0])
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, pos.shape[1], 2, 256, generator=g) * 3).to(dtype)
    cos = cache[:, :128].repeat(1, 2).to(dtype)[:, None]
    sin = cache[:, 128:].repeat(1, 2).to(dtype)[:, None]
    with torch.no_grad():
        y = norm(q)
        want = y * cos + _rotate_half(y) * sin
        outs = {mode: qk_norm_rope(q, q, norm.weight, norm.weight, cache, eps=norm.eps,
                                   interleaved=False, rounding=mode)[0]
                for mode in contract.ROUNDING_MODES}
    got = outs[IDEOGRAM4.rounding]
    if dtype == torch.float32:
        assert torch.equal(got, want), float((got - want).abs().max())
        return
    assert not any(torch.equal(o, want) for o in outs.values())
    eps = torch.finfo(dtype).eps
    rowmax = want.float().abs().amax(dim=-1, keepdim=True)
    steps = ((got.float() - want.float()).abs() / (eps * rowmax)).max()
    assert float(steps) <= derived_steps(dtype), float(steps)
    print(f"{name}: worst {float(steps):.3f} steps (bound {derived_steps(dtype):.4f})")


def test_another_head_width_is_refused_in_one_line():
    """The sidecar records the cache as 128 one-pair axes: a model of another head width is
    refused before tracing."""
    from qkrope.families.ideogram4 import export

    model = TINY.build_transformer(IDEOGRAM4, 0, attention_head_dim=64)
    with pytest.raises(InputError, match="attention_head_dim is 64") as e:
        export.check_supported(model)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.api import export_transformer

    root = tmp_path_factory.mktemp("ideogram4")
    _model().save_pretrained(str(root / "diffusers"))
    export_transformer(root / "diffusers", root / "ideogram4.onnx", dtype="fp32", progress=False)
    return root / "ideogram4.onnx"


@pytest.mark.slow  # the module's export
def test_onnxruntime_through_the_dropin_at_untraced_shapes(exported):
    """Both calls of the pipeline at untraced sizes, the conditional one with prompts of
    different lengths (two graph calls) and with equal ones (one), the unconditional one image
    only: the image rows within PARITY x max|out| of diffusers', the text rows zero."""
    import onnx

    from qkrope.runtime import load_transformer

    nodes = [n for n in onnx.load(str(exported)).graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == 2  # one per block
    attrs = {a.name: a for a in nodes[0].attribute}
    assert attrs["interleaved"].i == 0 and attrs["rounding"].i == IDEOGRAM4.rounding
    model = _model()
    dropin = load_transformer(exported)
    for lengths, grid, max_text in (((5, 3), (6, 4), 7), ((4, 4, 2), (3, 7), 9)):
        cond = _pipeline_call(model, lengths, grid, max_text, seed=11)
        for call, txt in ((cond, max_text), (_unconditional_call(cond, max_text), 0)):
            with torch.no_grad():
                want = model(**call, return_dict=False)[0]
            got = dropin(**call, return_dict=False)[0]
            assert got.shape == want.shape
            assert not bool(got[:, :txt].any())
            err = float((got[:, txt:] - want[:, txt:]).abs().max())
            scale = float(want[:, txt:].abs().max())
            assert 0 < err <= PARITY * scale, (lengths, txt, err, scale)
            print(f"{lengths} text region {txt}: {err / scale:.2e} x max|out| ({scale:.3g})")


@pytest.mark.slow  # two exports and four pipeline runs
def test_pipeline_on_the_dropins(tmp_path):
    """The tiny Ideogram4Pipeline (a Qwen3-VL encoder tapped at its 13 layers) at 12 x 8 pixels
    (untraced), two prompts of different lengths (the conditional call: two graph calls), CFG
    3, 2 steps: both transformers swapped for drop-ins of their exports, the latents within
    tiny_pipeline.latent_bound of the stock pipeline's (|3| + |1 - 3| = 5 <= 1 + 2 x 3)."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.export.api import export_transformer
    from qkrope.runtime import load_transformer

    pipe = TINY.build_pipeline(IDEOGRAM4, 0)
    paths = {}
    for name in ("transformer", "unconditional_transformer"):
        getattr(pipe, name).save_pretrained(str(tmp_path / name))
        paths[name] = tmp_path / f"{name}.onnx"
        export_transformer(tmp_path / name, paths[name], dtype="fp32", progress=False)
    call = dict(prompt=["a cat", "a red dog on a green hill"], height=12, width=8,
                num_inference_steps=2, guidance_scale=3.0, guidance_schedule=None,
                max_sequence_length=64, output_type="latent")
    want = pipe(generator=torch.Generator().manual_seed(0), **call).images
    for name, path in paths.items():
        setattr(pipe, name, load_transformer(path))
    got = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert 0 < diff <= tp.latent_bound(want, 3.0, parity=PARITY), diff
    print(f"pipeline latents: {diff:.3e} (bound {tp.latent_bound(want, 3.0, parity=PARITY):.3e})")


def _refused_forms():
    call = _pipeline_call(_model())
    packed = call["segment_ids"].clone()
    packed[0, -3:] = 2
    pad_in_text = call["segment_ids"].clone()
    pad_in_text[1, 0] = 1
    moved = call["indicator"].clone()
    moved[0, 0] = 2
    return [(dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
            (dict(timestep=torch.rand(2, call["hidden_states"].shape[1])), "per token"),
            (dict(segment_ids=packed), "one segment"),
            (dict(segment_ids=pad_in_text), "padding tokens"),
            (dict(indicator=moved), "suffix"),
            (dict(position_ids=call["position_ids"][:, 1:]), "one length")]


@pytest.mark.slow  # the module's export
@pytest.mark.parametrize("index", range(6))
def test_refusals(exported, index):
    from qkrope.runtime import load_transformer

    extra, match = _refused_forms()[index]
    dropin = load_transformer(exported)
    kw = dict(_pipeline_call(_model()), **extra)
    with pytest.raises(InputError, match=match) as e:
        dropin(**kw)
    assert "\n" not in str(e.value)
