"""The input forms each family's diffusers forward accepts (issue 36 item 4), keyed by the family
record's name, beside the tiny builders of tests/_families.py: tests/test_input_forms.py feeds
every form to the stock model and to the drop-in.

A family's entry gives, for a tiny model and a batch size:

- ``base``: the forward's keyword arguments in the pipelines' own form;
- ``same``: other forms of the same call (``(id, kwargs)``): diffusers must read each exactly as
  ``base`` (the test checks the stock model's bits first, so a form listed here that diffusers
  reads differently fails the test data, not the drop-in), and the drop-in must too;
- ``refused``: forms diffusers takes but reads wrongly for some batch items (it applies item 0's
  positions to every item, with a warning): the drop-in refuses them in one line.

A new family adds its entry here (tests/test_input_forms.py requires one per record).
"""

from __future__ import annotations

from typing import Callable

import torch

Forms = dict  # {"base": kwargs, "same": [(id, kwargs)], "refused": [(id, kwargs)]}


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose last axis has stride 2 (not contiguous)."""
    wide = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)
    out = wide[..., ::2]
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def qwen_image(model, batch: int, g: torch.Generator) -> Forms:
    cfg = model.config
    h, w, txt = 4, 6, 7
    base = {
        "hidden_states": torch.randn(batch, h * w, cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, cfg.joint_attention_dim, generator=g),
        "encoder_hidden_states_mask": torch.ones(batch, txt, dtype=torch.int64),
        "timestep": torch.full((batch,), 0.5),
        "img_shapes": [[(1, h, w)]] * batch,  # the pipelines' form: one list per batch item
        "return_dict": False,
    }
    same = [
        # diffusers' own model test: a flat list, one (f, h, w) per batch item
        ("img_shapes flat per item", dict(base, img_shapes=[(1, h, w)] * batch)),
        ("img_shapes one triple in a list", dict(base, img_shapes=[(1, h, w)])),
        ("img_shapes a bare triple", dict(base, img_shapes=(1, h, w))),
        ("mask bool", dict(base, encoder_hidden_states_mask=torch.ones(batch, txt,
                                                                       dtype=torch.bool))),
        ("mask none", dict(base, encoder_hidden_states_mask=None)),
        ("non-contiguous tensors",
         dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
              encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"]))),
    ]
    refused = []
    if batch > 1:
        other = [(1, h, w)] * (batch - 1) + [(1, w, h)]
        refused = [("img_shapes differ per item (flat)", dict(base, img_shapes=other)),
                   ("img_shapes differ per item (lists)",
                    dict(base, img_shapes=[[s] for s in other]))]
    return {"base": base, "same": same, "refused": refused}


def _flux(model, batch: int, g: torch.Generator, *, pooled: bool, guidance: bool,
          sample_ids: Callable) -> Forms:
    cfg = model.config
    h, w, txt = 4, 6, 5
    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids([(1, h, w)], txt))
    base = {
        "hidden_states": torch.randn(batch, h * w, cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, cfg.joint_attention_dim, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": img_ids, "txt_ids": txt_ids,
        "return_dict": False,
    }
    if pooled:
        base["pooled_projections"] = torch.randn(batch, cfg.pooled_projection_dim, generator=g)
    if guidance:
        base["guidance"] = torch.full((batch,), 3.5)
    same = [
        # diffusers' deprecated 3-D ids: [batch, tokens, axes], item 0 used
        ("ids 3-D per item", dict(base, img_ids=img_ids.expand(batch, -1, -1).clone(),
                                  txt_ids=txt_ids.expand(batch, -1, -1).clone())),
        ("ids 3-D expanded (stride 0)", dict(base, img_ids=img_ids.expand(batch, -1, -1),
                                             txt_ids=txt_ids.expand(batch, -1, -1))),
        ("ids int64", dict(base, img_ids=img_ids.long(), txt_ids=txt_ids.long())),
        ("ids non-contiguous", dict(base, img_ids=_noncontiguous(img_ids),
                                    txt_ids=_noncontiguous(txt_ids))),
        ("non-contiguous tensors",
         dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
              encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"]))),
    ]
    refused = []
    if batch > 1:
        shifted = img_ids.expand(batch, -1, -1).clone()
        shifted[-1, :, -1] += 1  # the last item's image one column to the right
        refused = [("img_ids differ per item", dict(base, img_ids=shifted))]
    return {"base": base, "same": same, "refused": refused}


def flux1(model, batch: int, g: torch.Generator) -> Forms:
    from qkrope.families.flux.dropin import flux_sample_ids

    return _flux(model, batch, g, pooled=True, guidance=bool(model.config.guidance_embeds),
                 sample_ids=lambda shapes, txt: flux_sample_ids("flux1", shapes, txt))


def flux2(model, batch: int, g: torch.Generator) -> Forms:
    from qkrope.families.flux.dropin import flux_sample_ids

    return _flux(model, batch, g, pooled=False, guidance=bool(model.config.guidance_embeds),
                 sample_ids=lambda shapes, txt: flux_sample_ids("flux2", shapes, txt))


def z_image(model, batch: int, g: torch.Generator) -> Forms:
    """Lists of per-sample latents and captions (the pipelines' form; captions of different
    lengths, so the drop-in makes one call per padded length). diffusers reads every sample's
    own positions, so no form is read wrongly for some items: nothing to refuse."""
    cfg = model.config
    x = [torch.randn(cfg.in_channels, 1, 8, 12, generator=g) for _ in range(batch)]
    caps = [torch.randn(n, cfg.cap_feat_dim, generator=g) for n in (40, 7, 21)[:batch]]
    base = {"x": x, "t": torch.full((batch,), 0.5), "cap_feats": caps, "return_dict": False}
    same = [
        ("x one 5-D tensor", dict(base, x=torch.stack(x))),
        ("tuples", dict(base, x=tuple(x), cap_feats=tuple(caps))),
        ("non-contiguous tensors", dict(base, x=[_noncontiguous(a) for a in x],
                                        cap_feats=[_noncontiguous(c) for c in caps])),
    ]
    return {"base": base, "same": same, "refused": []}


def cosmos(model, batch: int, g: torch.Generator) -> Forms:
    """Video2World's call (16-channel latent and a condition mask, per-frame timesteps as the
    pipeline expands them, the padding mask at pixel size, fps); no form carries per-item
    positions (the grid is the latent's own), so none is refused."""
    cfg = model.config
    frames, h, w, txt = 2, 4, 6, 5
    latent = torch.randn(batch, cfg.in_channels - 1, frames, h, w, generator=g)
    cond = (torch.rand(batch, 1, frames, h, w, generator=g) > 0.5).float()
    t = torch.rand(1, generator=g)
    base = {"hidden_states": latent, "condition_mask": cond,
            "timestep": t.view(1, 1, 1, 1, 1).expand(batch, -1, frames, -1, -1).contiguous(),
            "encoder_hidden_states": torch.randn(batch, txt, cfg.text_embed_dim, generator=g),
            "padding_mask": torch.zeros(1, 1, 8 * h, 8 * w), "fps": 16, "return_dict": False}
    same = [
        ("timestep expanded (stride 0)",
         dict(base, timestep=t.view(1, 1, 1, 1, 1).expand(batch, -1, frames, -1, -1))),
        ("padding_mask at the latent's size", dict(base, padding_mask=torch.zeros(1, 1, h, w))),
        ("fps a float", dict(base, fps=16.0)),
        ("non-contiguous tensors",
         dict(base, hidden_states=_noncontiguous(latent),
              encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"]))),
    ]
    return {"base": base, "same": same, "refused": []}


def chroma(model, batch: int, g: torch.Generator) -> Forms:
    """Chroma: FLUX.1's ids (its pipelines lay them out as FLUX.1's), no pooled projections or
    guidance; the prompt mask is left out here (its forms are tests/test_family_chroma.py's)."""
    from qkrope.families.flux.dropin import flux_sample_ids

    return _flux(model, batch, g, pooled=False, guidance=False,
                 sample_ids=lambda shapes, txt: flux_sample_ids("flux1", shapes, txt))


def hunyuan_image(model, batch: int, g: torch.Generator) -> Forms:
    """HunyuanImage-2.1: the pipeline's 4-D latent (the model patchifies it), the text mask as
    1/0 integers (the last item padded); the positions are the latent's own grid, so no form
    is read wrongly for some items."""
    cfg = model.config
    h, w, txt = 5, 7, 9
    mask = torch.ones(batch, txt, dtype=torch.int64)
    mask[-1, txt - 3:] = 0
    base = {"hidden_states": torch.randn(batch, cfg.in_channels, h, w, generator=g),
            "timestep": torch.linspace(300.0, 700.0, batch),
            "encoder_hidden_states": torch.randn(batch, txt, cfg.text_embed_dim, generator=g),
            "encoder_attention_mask": mask, "return_dict": False}
    same = [("mask bool", dict(base, encoder_attention_mask=mask.bool())),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


def wan(model, batch: int, g: torch.Generator) -> Forms:
    """Wan: the 5-D latent [B, C, F, H, W] (the model patchifies it), a [batch] timestep; the
    positions are the latent's own grid, so no form is read wrongly for some items."""
    cfg = model.config
    pf, ph, pw = cfg.patch_size
    base = {"hidden_states": torch.randn(batch, cfg.in_channels, 2 * pf, 3 * ph, 2 * pw,
                                         generator=g),
            "timestep": torch.rand(batch, generator=g) * 999,
            "encoder_hidden_states": torch.randn(batch, 5, cfg.text_dim, generator=g),
            "return_dict": False}
    same = [("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


def chronoedit(model, batch: int, g: torch.Generator) -> Forms:
    """ChronoEdit: Wan's forms with its Wan 2.1 I2V inputs: 512 text tokens (the length at
    which its attention reads the image tokens) and the CLIP image tokens."""
    forms = wan(model, batch, g)
    base = dict(forms["base"],
                encoder_hidden_states=torch.randn(batch, 512, model.config.text_dim,
                                                  generator=g),
                encoder_hidden_states_image=torch.randn(batch, 3, model.config.image_dim,
                                                        generator=g))
    same = [("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states_image=_noncontiguous(
                      base["encoder_hidden_states_image"])))]
    return {"base": base, "same": same, "refused": []}


#: family name -> its forms
def _hunyuan(variant: str):
    def forms(model, batch: int, g: torch.Generator) -> Forms:
        import _hunyuan_video_models as hvm

        base = dict(hvm.inputs(variant, batch=batch, seed=int(torch.randint(0, 1000, (1,),
                                                                             generator=g))),
                    return_dict=False)
        masks = [k for k in base if "mask" in k]
        same = [("masks bool", dict(base, **{k: base[k].bool() for k in masks})),
                ("masks int64", dict(base, **{k: base[k].to(torch.int64) for k in masks})),
                ("non-contiguous text",
                 dict(base, encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
        return {"base": base, "same": same, "refused": []}
    return forms


FORMS: dict[str, Callable[..., Forms]] = {"qwen-image": qwen_image, "flux1": flux1,
                                          "flux2": flux2, "chroma": chroma,
                                          "hunyuan-video-1.5": _hunyuan("hunyuan-video-1.5"),
                                          "hunyuan-video": _hunyuan("hunyuan-video"),
                                          "z-image": z_image, "cosmos-predict2": cosmos,
                                          "hunyuan-image": hunyuan_image, "wan": wan,
                                          "skyreels-v2": wan, "chronoedit": chronoedit}


def _dual_stream_ids(spec):
    from qkrope.runtime.dual_stream import sample_ids

    return lambda shapes, txt: sample_ids(spec.ids, shapes, txt)


def longcat_image(model, batch: int, g: torch.Generator) -> Forms:
    """LongCat-Image: FLUX's forms with its pipelines' ids, no pooled projections or guidance;
    diffusers' forward takes 2-D ids only (no 3-D form, so none to refuse)."""
    from qkrope.families.longcat_image import DUAL_STREAM

    forms = _flux(model, batch, g, pooled=False, guidance=False,
                  sample_ids=_dual_stream_ids(DUAL_STREAM))
    forms["same"] = [(n, kw) for n, kw in forms["same"] if not n.startswith("ids 3-D")]
    return dict(forms, refused=[])


def ovis_image(model, batch: int, g: torch.Generator) -> Forms:
    """Ovis-Image: FLUX's forms with its pipeline's ids, no pooled projections or guidance."""
    from qkrope.families.ovis_image import DUAL_STREAM

    return _flux(model, batch, g, pooled=False, guidance=False,
                 sample_ids=_dual_stream_ids(DUAL_STREAM))


def bria(model, batch: int, g: torch.Generator) -> Forms:
    """Bria 3.2: FLUX.1's forms and ids, no pooled projections or guidance."""
    from qkrope.families.bria import DUAL_STREAM

    return _flux(model, batch, g, pooled=False, guidance=False,
                 sample_ids=_dual_stream_ids(DUAL_STREAM))


FORMS.update({"longcat-image": longcat_image, "ovis-image": ovis_image, "bria": bria})


def joyimage_edit(model, batch: int, g: torch.Generator) -> Forms:
    """JoyImage Edit: the 5-D latent [B, C, F, H, W] (the model patchifies it), a [batch]
    timestep and the text; the positions are the latent's own grid (the edit pipeline's 6-D
    form is tests/test_family_joyimage.py's)."""
    cfg = model.config
    pf, ph, pw = cfg.patch_size
    base = {"hidden_states": torch.randn(batch, cfg.in_channels, 2 * pf, 3 * ph, 2 * pw,
                                         generator=g),
            "timestep": torch.rand(batch, generator=g) * 999,
            "encoder_hidden_states": torch.randn(batch, 5, cfg.text_dim, generator=g),
            "return_dict": False}
    same = [("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"joyimage-edit": joyimage_edit})


def motif_video(model, batch: int, g: torch.Generator) -> Forms:
    """Motif-Video: the 5-D latent [B, C, F, H, W] (the model patchifies it), a [batch]
    timestep, the text and its mask (the pipeline's int64 from the tokenizer; a bool mask and
    no mask with every token real read the same); the positions are the latent's own grid."""
    cfg = model.config
    p, pt = cfg.patch_size, cfg.patch_size_t
    base = {"hidden_states": torch.randn(batch, cfg.in_channels, 2 * pt, 3 * p, 2 * p,
                                         generator=g),
            "timestep": torch.rand(batch, generator=g) * 999,
            "encoder_hidden_states": torch.randn(batch, 5, cfg.text_embed_dim, generator=g),
            "encoder_attention_mask": torch.ones(batch, 5, dtype=torch.int64),
            "return_dict": False}
    mask = base["encoder_attention_mask"]
    same = [("mask bool", dict(base, encoder_attention_mask=mask.bool())),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"motif-video": motif_video})


def wan_vace(model, batch: int, g: torch.Generator) -> Forms:
    """Wan-VACE: Wan's forms with WanVACEPipeline's control latent (on the latent's grid) and
    one scale per control block."""
    forms = wan(model, batch, g)
    latent = forms["base"]["hidden_states"]
    control = torch.randn(batch, model.config.vace_in_channels, *latent.shape[2:], generator=g)
    base = dict(forms["base"], control_hidden_states=control,
                control_hidden_states_scale=0.5 + torch.rand(len(model.config.vace_layers),
                                                             generator=g))
    same = [("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  control_hidden_states=_noncontiguous(control)))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"wan-vace": wan_vace})


def hunyuan_video_framepack(model, batch: int, g: torch.Generator) -> Forms:
    """HunyuanVideo FramePack: HunyuanVideoFramepackPipeline's call (the history latents and
    the frame indices of every part); the masks as bool or int64, non-contiguous text and
    history, the indices as int32 read as the pipeline's int64."""
    import _hunyuan_video_models as hvm

    base = dict(hvm.framepack_inputs(batch=batch, seed=int(torch.randint(0, 1000, (1,),
                                                                         generator=g))),
                return_dict=False)
    mask = base["encoder_attention_mask"]
    same = [("mask bool", dict(base, encoder_attention_mask=mask.bool())),
            ("mask int64", dict(base, encoder_attention_mask=mask.to(torch.int64))),
            ("non-contiguous text and history",
             dict(base, encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"]),
                  latents_history_4x=_noncontiguous(base["latents_history_4x"]))),
            ("indices int32", dict(base, **{k: base[k].to(torch.int32)
                                            for k in hvm.FRAMEPACK_INDICES}))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"hunyuan-video-framepack": hunyuan_video_framepack})


def kandinsky5(model, batch: int, g: torch.Generator) -> Forms:
    """Kandinsky 5: the channels-last latent [B, F, H, W, C] (the model patchifies it), the
    Qwen text, the pooled CLIP embedding, a [batch] timestep, the positions the pipelines pass
    (each visual axis and the text counted from 0) and the video pipelines' angle divisors;
    a list or a tuple of positions and of divisors read the same (return_dict left True: with
    False diffusers returns the bare sample)."""
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    f, h, w, txt = 2, 3, 2, 5
    base = {"hidden_states": torch.randn(batch, f * pt, h * ph, w * pw, cfg.in_visual_dim,
                                         generator=g),
            "encoder_hidden_states": torch.randn(batch, txt, cfg.in_text_dim, generator=g),
            "timestep": torch.rand(batch, generator=g) * 999,
            "pooled_projections": torch.randn(batch, cfg.in_text_dim2, generator=g),
            "visual_rope_pos": [torch.arange(f), torch.arange(h), torch.arange(w)],
            "text_rope_pos": torch.arange(txt), "scale_factor": (1, 2, 2)}
    same = [("positions a tuple, divisors a list",
             dict(base, visual_rope_pos=tuple(base["visual_rope_pos"]),
                  scale_factor=[1.0, 2.0, 2.0])),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"kandinsky5": kandinsky5})


def prx(model, batch: int, g: torch.Generator) -> Forms:
    """PRX: the 4-D latent [B, C, H, W] (the model patchifies it), the pipelines' float32
    timestep in [0, 1], the text and its bool mask (an int64 mask and no mask with every token
    real read the same); the positions are the latent's own patch grid."""
    cfg = model.config
    p = cfg.patch_size
    base = {"hidden_states": torch.randn(batch, cfg.in_channels, 3 * p, 2 * p, generator=g),
            "timestep": torch.rand(batch, generator=g),
            "encoder_hidden_states": torch.randn(batch, 5, cfg.context_in_dim, generator=g),
            "attention_mask": torch.ones(batch, 5, dtype=torch.bool),
            "return_dict": False}
    mask = base["attention_mask"]
    same = [("mask int64", dict(base, attention_mask=mask.long())),
            ("mask none", dict(base, attention_mask=None)),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"prx": prx})


def flux3(model, batch: int, g: torch.Generator) -> Forms:
    """FLUX.3: FLUX.2's forms without guidance, on the FLUX.3 pipelines' ids (h / w scaled by
    0.5, the text's index on the fourth axis)."""
    from qkrope.families.flux3.dropin import pipeline_ids

    forms = _flux(model, batch, g, pooled=False, guidance=False,
                  sample_ids=lambda shapes, txt: pipeline_ids(shapes[0], txt))
    # Flux3PosEmbed takes [tokens, 4] ids only (no deprecated 3-D form, which the drop-in's
    # shared ids check still accepts when every item is the same); int64 ids would truncate
    # the image's half-integer positions
    forms["same"] = [(i, kw) for i, kw in forms["same"]
                     if not i.startswith("ids 3-D") and i != "ids int64"]
    forms["refused"] = []
    return forms


FORMS.update({"flux3": flux3})


def minimax_h3(model, batch: int, g: torch.Generator) -> Forms:
    """MiniMax-H3: the transformer's own call (diffusers has no pipeline): video, audio and
    text rows, the distinct timesteps and per packed row its level, tag and position, the three
    index tensors (the family's sample layout, the video rows placed last); integer
    position_ids (the model converts them to float32) and non-contiguous streams read the
    same."""
    from qkrope.families.minimax_h3.dropin import packed_layout

    cfg = model.config
    grid, txt, audio = (2, 3, 4), 5, 6
    lay = packed_layout(grid, txt, audio)
    p = cfg.patch_size
    base = {"hidden_states": torch.randn(batch, 24, cfg.in_channels * p[0] * p[1] * p[2],
                                         generator=g),
            "audio_hidden_states": torch.randn(batch, audio, cfg.audio_in_channels, generator=g),
            "encoder_hidden_states": torch.randn(batch, txt, cfg.text_dim, generator=g),
            "timestep": torch.tensor([0.625, 0.0]), **lay, "return_dict": False}
    same = [("position_ids int64", dict(base, position_ids=lay["position_ids"].long())),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  audio_hidden_states=_noncontiguous(base["audio_hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": []}


FORMS.update({"minimax-h3": minimax_h3})


def ideogram4(model, batch: int, g: torch.Generator) -> Forms:
    """Ideogram 4: Ideogram4Pipeline's conditional call, its packed [left padding][text][image]
    sequence laid out by the pipeline's own _prepare_ids (prompts of different lengths where
    the batch has several items: one graph call per group); the model masks the latent's text
    rows and the features' image rows (any values there read the same), and int32 index tensors
    read as int64. A row packing two samples (a second segment) is refused."""
    from diffusers import Ideogram4Pipeline

    cfg = model.config
    lengths = [3 + 2 * (i % 2) for i in range(batch)]
    pos, seg, ind = Ideogram4Pipeline._prepare_ids(lengths, 2, 3, 6, "cpu")
    length = pos.shape[1]
    text = torch.randn(batch, length, cfg.llm_features_dim, generator=g) * (ind == 3)[..., None]
    latent = torch.randn(batch, length, cfg.in_channels, generator=g) * (ind == 2)[..., None]
    base = {"hidden_states": latent, "timestep": torch.rand(batch, generator=g),
            "encoder_hidden_states": text, "position_ids": pos, "segment_ids": seg,
            "indicator": ind, "return_dict": False}
    noise = dict(base, hidden_states=latent + torch.randn(latent.shape, generator=g)
                 * (ind != 2)[..., None],
                 encoder_hidden_states=text + torch.randn(text.shape, generator=g)
                 * (ind != 3)[..., None])
    packed = seg.clone()
    packed[:, -2:] = 7
    same = [("values where the model masks", noise),
            ("int32 index tensors", dict(base, position_ids=pos.int(), segment_ids=seg.int(),
                                         indicator=ind.int())),
            ("non-contiguous tensors",
             dict(base, hidden_states=_noncontiguous(base["hidden_states"]),
                  encoder_hidden_states=_noncontiguous(base["encoder_hidden_states"])))]
    return {"base": base, "same": same, "refused": [("two samples in a row",
                                                     dict(base, segment_ids=packed))]}


FORMS.update({"ideogram4": ideogram4})
