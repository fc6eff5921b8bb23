"""The pipeline's stage exports streamed (export/stages/streamed.py): each text encoder and VAE
is built as a placeholder skeleton from its saved folder (``pipeline._load``, what
``qkrope export --model pipeline`` runs), traced, and its initializers read from the folder's
safetensors as the graph is written.

For tiny random models built here (nothing downloaded) and saved with ``save_pretrained``:

- the streamed graph, run by ONNX Runtime, agrees with the PyTorch module ``from_pretrained``
  loads (fp32) within the bound the transformer export is held to, 1e-4 x max|output|
  (``qkrope.apps.tiny_pipeline.TRANSFORMER_PARITY``: the fp32 summation orders of ONNX
  Runtime's and PyTorch's kernels);
- every initializer named by a state-dict key holds exactly the checkpoint's tensor of the key
  the loading library maps to it (transformers 5's renames: Qwen2.5-VL's ``model.layers.*`` are
  the module's ``model.language_model.layers.*``; T5's tied ``encoder.embed_tokens`` is the
  checkpoint's ``shared``), bit for bit, and each was read from the shards once;
- the streamed graph gives the very outputs of the in-memory export (the same stage function on
  the loaded module);
- tied weights are tied or not as transformers ties them; a tensor the graph needs that the
  checkpoint lacks, and a folder without safetensors, are refused in one line.

The causal video VAE (AutoencoderKLWan) takes ~40 s to trace twice on 2 cores: slow tier.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="requires transformers (test extras)")
pytest.importorskip("diffusers", reason="requires diffusers (test extras)")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (test extras)")

import numpy as np  # noqa: E402
import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from qkrope.apps.tiny_pipeline import TRANSFORMER_PARITY, randomised  # noqa: E402
from qkrope.export.stages import pipeline, streamed  # noqa: E402
from qkrope.export.stages.text_encoder import _Reads, export_text_encoder  # noqa: E402
from qkrope.export.stages.text_encoder import sample_inputs  # noqa: E402
from qkrope.export.stages.vae import export_vae  # noqa: E402
from qkrope.export.streaming import WeightsMismatchError  # noqa: E402
from qkrope.stages import TextEncoderStage, VaeStage  # noqa: E402

OPSET = 18  # the pipeline export's default (qkrope.contract.DEFAULT_OPSET)
FP32 = torch.float32


# --------------------------------------------------------------------------------------------
# Tiny models (random weights of a non-trivial scale; norms near 1)
# --------------------------------------------------------------------------------------------

def _t5(umt5: bool = False):
    import transformers as tf

    config, cls = ((tf.UMT5Config, tf.UMT5EncoderModel) if umt5
                   else (tf.T5Config, tf.T5EncoderModel))
    return cls(config(vocab_size=1024, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8))


def _clip():
    import transformers as tf

    return tf.CLIPTextModel(tf.CLIPTextConfig(
        vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def _decoder(config_name: str, model_name: str, **extra):
    import transformers as tf

    return getattr(tf, model_name)(getattr(tf, config_name)(
        vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **extra))


def _qwen25_vl():
    """Qwen-Image's text encoder class (the language model and a vision tower the text graph
    does not read), tiny. Its text vocabulary is at least 1000: the stage's sample ids are
    drawn below min(config.vocab_size, 1000), and the composite config has no top-level
    vocab_size."""
    import transformers as tf

    return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=1024, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=16, fullatt_block_indexes=[0], window_size=8,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=1)))


def _strip(prefix: str, into: str = ""):
    return lambda key: into + key[len(prefix):] if key.startswith(prefix) else key


#: name -> (builder, the stage its family declares, module key -> checkpoint key)
TEXT = {
    "t5": (_t5, TextEncoderStage(reads=("last_hidden_state",), inputs=("input_ids",)),
           lambda k: "shared.weight" if k == "encoder.embed_tokens.weight" else k),
    "umt5": (lambda: _t5(umt5=True), TextEncoderStage(reads=("last_hidden_state",)),
             lambda k: "shared.weight" if k == "encoder.embed_tokens.weight" else k),
    "clip": (_clip, TextEncoderStage(reads=("pooler_output",), inputs=("input_ids",)),
             lambda k: k),
    "qwen2": (lambda: _decoder("Qwen2Config", "Qwen2Model"),
              TextEncoderStage(reads=("hidden_states[-1]",)), lambda k: k),
    "qwen3": (lambda: _decoder("Qwen3Config", "Qwen3Model", head_dim=8),
              TextEncoderStage(reads=("hidden_states[-2]",)), lambda k: k),
    "qwen2.5-vl": (_qwen25_vl, TextEncoderStage(reads=("hidden_states[-1]",)),
                   _strip("model.language_model.", "model.")),
}


def _vae_kl():
    import diffusers

    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16],
        layers_per_block=1, latent_channels=4, norm_num_groups=4)


def _vae_wan():
    import diffusers

    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1, temperal_downsample=[False, True, True])


def _saved(model, folder):
    randomised(model, scale=0.2, vector_scale=0.05)
    model.save_pretrained(str(folder))
    return folder


def _library(model) -> str:
    return "transformers" if type(model).__module__.startswith("transformers") else "diffusers"


def _reference(cls, folder, library: str):
    if library == "transformers":
        return cls.from_pretrained(str(folder), dtype=FP32, local_files_only=True).eval()
    return cls.from_pretrained(str(folder), torch_dtype=FP32, local_files_only=True).eval()


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _run(path, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _streamed_keys(weights, path) -> list[str]:
    """The initializers of the graph at ``path`` the streamed weights filled."""
    model = ir.load(str(path))
    return [k for k in model.graph.initializers if k in weights.source]


def _check_initializers(path, checkpoint, key_map, reference) -> int:
    """Every initializer named by a state-dict key is the checkpoint tensor ``key_map`` names
    for it, bit for bit (and so is what from_pretrained loaded). Returns how many."""
    model = ir.load(str(path))
    state = reference.state_dict()
    named = [k for k in model.graph.initializers if k in state]
    for key in named:
        got = model.graph.initializers[key].const_value.numpy()
        want = checkpoint[key_map(key)]
        assert got.dtype == want.numpy().dtype and np.array_equal(got, want.numpy()), key
        assert np.array_equal(got, state[key].numpy()), key
    return len(named)


# --------------------------------------------------------------------------------------------
# Text encoders
# --------------------------------------------------------------------------------------------

#: the cases that also export the loaded module in memory and compare the two graphs' outputs
IN_MEMORY = {"t5"}
#: Qwen2's decoder layers are Qwen2.5-VL's language model's: its own case is in the slow tier
SLOW_TEXT = {"qwen2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TEXT
                                  else n for n in TEXT])
def test_text_encoder_streamed_matches_the_module_and_the_checkpoint(name, tmp_path):
    """The streamed graph against the loaded module (the bound) and the checkpoint (bit for
    bit); for :data:`IN_MEMORY`, also against the in-memory export of the same stage function
    (optimize=True, weights in memory): the same outputs, bit for bit (the graphs differ only
    in where a weight's transpose is folded, which ONNX Runtime does when it loads them)."""
    build, stage, key_map = TEXT[name]
    model = build()
    cls = type(model)
    src = _saved(model, tmp_path / "src")
    skeleton = pipeline._load("transformers", cls.__name__, src, FP32)
    weights = streamed.attached(skeleton)
    assert weights is not None and weights.source.reads == 0  # nothing read yet
    out = tmp_path / "out"
    out.mkdir()
    fields = export_text_encoder(skeleton, stage, out, opset=OPSET, dtype=FP32)
    graph = out / fields["graphs"]["encode"]["file"]
    assert sorted(p.name for p in out.iterdir()) == sorted(fields["files"])  # nothing left over

    reference = _reference(cls, src, "transformers")
    args = sample_inputs(reference, stage)
    with torch.no_grad():
        want = _Reads(reference, stage, FP32)(*args)
    got = _run(graph, {n: a.numpy() for n, a in zip(stage.inputs, args)})
    assert len(got) == len(want) == len(stage.reads)
    for g, w in zip(got, want):
        scale = float(w.abs().max())
        assert g.shape == tuple(w.shape)
        assert float(np.abs(g - w.numpy()).max()) <= TRANSFORMER_PARITY * scale, name

    count = _check_initializers(graph, _checkpoint(src), key_map, reference)
    streamed_keys = _streamed_keys(weights, graph)
    assert count == len(streamed_keys) > 0
    assert weights.source.reads == len(streamed_keys)  # each tensor read from the shards once
    assert fields["hidden_states"] == reference.config.get_text_config().num_hidden_layers + 1
    if name in IN_MEMORY:
        (tmp_path / "m").mkdir()
        memory = export_text_encoder(reference, stage, tmp_path / "m", opset=OPSET, dtype=FP32)
        again = _run(tmp_path / "m" / memory["graphs"]["encode"]["file"],
                     {n: a.numpy() for n, a in zip(stage.inputs, args)})
        assert all(np.array_equal(x, y) for x, y in zip(got, again))


def _write_checkpoint(folder, tensors: dict) -> None:
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


@pytest.mark.parametrize("differ", [False, True])
def test_t5_tied_embeddings_tie_as_transformers_ties_them(differ, tmp_path):
    """A checkpoint holding both ``shared.weight`` and ``encoder.embed_tokens.weight``: one
    tied parameter when their bytes are equal (the initializer named by the pair's first key),
    two when they differ (the encoder reads its own), as from_pretrained leaves them; either way
    the graph gives the loaded module's output from the right tensor."""
    build, stage, _ = TEXT["t5"]
    model = build()
    src = _saved(model, tmp_path / "src")
    tensors = _checkpoint(src)
    other = tensors["shared.weight"].clone()
    if differ:
        other += 0.5
    tensors["encoder.embed_tokens.weight"] = other
    _write_checkpoint(src, tensors)
    skeleton = pipeline._load("transformers", "T5EncoderModel", src, FP32)
    tied = skeleton.shared.weight is skeleton.encoder.embed_tokens.weight
    assert tied is not differ
    out = tmp_path / "out"
    out.mkdir()
    fields = export_text_encoder(skeleton, stage, out, opset=OPSET, dtype=FP32)
    reference = _reference(type(model), src, "transformers")
    assert (reference.shared.weight is reference.encoder.embed_tokens.weight) is not differ
    args = sample_inputs(reference, stage)
    with torch.no_grad():
        (want,) = _Reads(reference, stage, FP32)(*args)
    (got,) = _run(out / fields["graphs"]["encode"]["file"], {"input_ids": args[0].numpy()})
    assert float(np.abs(got - want.numpy()).max()) <= TRANSFORMER_PARITY * float(
        want.abs().max())
    inits = ir.load(str(out / fields["graphs"]["encode"]["file"])).graph.initializers
    # the graph reads the encoder's embedding; tied, it is named by the first key of the pair
    name = "encoder.embed_tokens.weight" if differ else "shared.weight"
    assert [k for k in ("shared.weight", "encoder.embed_tokens.weight") if k in inits] == [name]
    embedding = inits[name].const_value.numpy()
    assert np.array_equal(embedding, (other if differ else tensors["shared.weight"]).numpy())


def _qwen25_vl_saved_key(key: str) -> str:
    """Qwen2.5-VL's checkpoint key of a module key (the released layout, which transformers 5
    writes back on save)."""
    for module, saved in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(module):
            return saved + key[len(module):]
    return key


#: name -> the released checkpoint's key of each module key: Qwen2.5-VL's (Qwen-Image's text
#: encoder), CLIP's ``text_model.`` prefix (FLUX's text_encoder folder)
LEGACY_KEYS = {"qwen2.5-vl": _qwen25_vl_saved_key, "clip": lambda key: "text_model." + key}


@pytest.mark.parametrize("name", list(LEGACY_KEYS))
@pytest.mark.parametrize("layout", ["released", "module"])
def test_checkpoint_key_layouts_map_as_transformers_maps_them(name, layout, tmp_path):
    """A checkpoint in the released key layout or in the module's own: each state-dict key is
    filled from the key transformers' loader maps to it (its conversion mapping), every key
    found, and from_pretrained loads the same tensors."""
    build, _, _ = TEXT[name]
    model = build()
    src = _saved(model, tmp_path / "src")
    saved_key = LEGACY_KEYS[name] if layout == "released" else (lambda key: key)
    state = model.state_dict()
    _write_checkpoint(src, {saved_key(k): v for k, v in state.items()})
    weights = streamed.attached(pipeline._load("transformers", type(model).__name__, src,
                                               FP32))
    assert not weights.missing and sorted(weights.source.keys()) == sorted(state)
    for key in state:
        assert weights.source.headers[key].key == saved_key(key), key
    loaded = _reference(type(model), src, "transformers").state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_tensor_the_graph_reads_that_the_checkpoint_lacks_is_one_line(tmp_path):
    build, stage, _ = TEXT["clip"]
    src = _saved(build(), tmp_path / "src")
    gone = "encoder.layers.1.mlp.fc2.weight"
    _write_checkpoint(src, {k: v for k, v in _checkpoint(src).items() if k != gone})
    skeleton = pipeline._load("transformers", "CLIPTextModel", src, FP32)  # built: fine
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(WeightsMismatchError) as exc:
        export_text_encoder(skeleton, stage, out, opset=OPSET, dtype=FP32)
    text = str(exc.value)
    assert "\n" not in text and gone in text and "Fix:" in text, text


def test_a_folder_without_safetensors_is_one_line(tmp_path):
    build, _, _ = TEXT["qwen2"]
    src = _saved(build(), tmp_path / "src")
    (src / "model.safetensors").replace(src / "pytorch_model.bin")  # any other weights file
    with pytest.raises(Exception) as exc:
        pipeline._load("transformers", "Qwen2Model", src, FP32)
    text = str(exc.value)
    assert "\n" not in text and "safetensors" in text and "Fix:" in text, text


def test_a_shape_the_config_disagrees_with_is_one_line(tmp_path):
    build, _, _ = TEXT["clip"]
    src = _saved(build(), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatchError) as exc:
        pipeline._load("transformers", "CLIPTextModel", src, FP32)
    text = str(exc.value)
    assert "\n" not in text and "fc1.weight" in text and "Fix:" in text, text


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float32])
def test_large_initializers_are_copied_in_chunks(saved_dtype, tmp_path, monkeypatch):
    """Every weight matrix written from its shard in chunks of a few elements (KEEP_BYTES 256,
    so only the norm weights and relative attention biases are read whole; a 256-byte chunk):
    the bytes are the whole tensor converted at once (a bf16 checkpoint exported in fp32:
    from_pretrained's cast), each tensor read once."""
    monkeypatch.setattr(streamed, "KEEP_BYTES", 256)
    monkeypatch.setattr(streamed, "COPY_CHUNK", 256)
    build, stage, key_map = TEXT["t5"]
    model = build()
    src = _saved(model.to(saved_dtype), tmp_path / "src")
    skeleton = pipeline._load("transformers", "T5EncoderModel", src, FP32)
    out = tmp_path / "out"
    out.mkdir()
    fields = export_text_encoder(skeleton, stage, out, opset=OPSET, dtype=FP32)
    graph = out / fields["graphs"]["encode"]["file"]
    reference = _reference(type(model), src, "transformers")
    checkpoint = {k: v.float() for k, v in _checkpoint(src).items()}
    assert _check_initializers(graph, checkpoint, key_map, reference) > 0
    weights = streamed.attached(skeleton)
    assert weights.source.reads == len(_streamed_keys(weights, graph))


def test_a_value_the_dtype_cannot_hold_is_one_line_from_a_chunk(tmp_path, monkeypatch):
    """A NaN in a matrix written in chunks: the export stops with the whole tensor's one-line
    refusal (the same as a tensor read whole)."""
    monkeypatch.setattr(streamed, "KEEP_BYTES", 256)
    monkeypatch.setattr(streamed, "COPY_CHUNK", 256)
    build, stage, _ = TEXT["t5"]
    src = _saved(build(), tmp_path / "src")
    tensors = _checkpoint(src)
    bad = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    tensors[bad][3, 5] = float("nan")
    _write_checkpoint(src, tensors)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Exception) as exc:
        export_text_encoder(pipeline._load("transformers", "T5EncoderModel", src, FP32), stage,
                            out, opset=OPSET, dtype=FP32)
    text = str(exc.value)
    assert "\n" not in text and bad in text and "NaN" in text and "Fix:" in text, text


# --------------------------------------------------------------------------------------------
# VAEs
# --------------------------------------------------------------------------------------------

def _vae_case(build, stage: VaeStage, tmp_path, *, in_memory: bool = False):
    model = build()
    cls = type(model)
    src = _saved(model, tmp_path / "src")
    skeleton = pipeline._load("diffusers", cls.__name__, src, FP32)
    weights = streamed.attached(skeleton)
    out = tmp_path / "out"
    out.mkdir()
    fields = export_vae(skeleton, stage, out, opset=OPSET, dtype=FP32)
    reference = _reference(cls, src, "diffusers")
    checkpoint = _checkpoint(src)
    reads = 0
    for spec in fields["graphs"].values():
        graph = out / spec["file"]
        count = _check_initializers(graph, checkpoint, lambda k: k, reference)
        assert count == len(_streamed_keys(weights, graph)) > 0
        reads += count
    assert weights.source.reads == reads  # each graph's tensors read once
    if in_memory:
        (tmp_path / "m").mkdir()
        export_vae(reference, stage, tmp_path / "m", opset=OPSET, dtype=FP32)
    return reference, fields, out


def test_image_vae_streamed_decodes_as_the_module(tmp_path):
    reference, fields, out = _vae_case(_vae_kl, VaeStage("image"), tmp_path, in_memory=True)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, 4, 5, 7, generator=g)
    with torch.no_grad():
        want = reference.decode(z, return_dict=False)[0]
    (got,) = _run(out / "decode.onnx", {"latents": z.numpy()})
    scale = float(want.abs().max())
    assert float(np.abs(got - want.numpy()).max()) <= TRANSFORMER_PARITY * scale
    (mem,) = _run(tmp_path / "m" / "decode.onnx", {"latents": z.numpy()})
    assert np.array_equal(got, mem)  # the in-memory export's output


@pytest.mark.slow
def test_causal_video_vae_streamed_decodes_as_the_module(tmp_path):
    """Wan's causal VAE: both graphs (first latent frame, next frame with the cache) streamed;
    two frames decoded through them agree with diffusers' decode of the two-frame latent."""
    reference, fields, out = _vae_case(_vae_wan, VaeStage("causal-video"), tmp_path)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, 4, 2, 5, 7, generator=g)
    with torch.no_grad():
        want = reference.decode(z, return_dict=False)[0]
    first, step = (out / fields["graphs"][k]["file"] for k in ("decode", "decode_next"))
    inputs = fields["graphs"]["decode_next"]["inputs"]
    sample, *cache = _run(first, {"latents": z[:, :, :1].numpy()})
    following, *_ = _run(step, dict(zip(inputs, [z[:, :, 1:2].numpy(), *cache])))
    got = np.concatenate([sample, following], axis=2)
    assert got.shape == tuple(want.shape)
    scale = float(want.abs().max())
    assert float(np.abs(got - want.numpy()).max()) <= TRANSFORMER_PARITY * scale


def test_the_module_tensors_a_pipeline_reads_off_the_vae_are_saved_and_offered(tmp_path):
    """VaeStage.tensors (FLUX.2's latent batch-norm statistics): read from the checkpoint with
    the graphs' weights, saved beside them, and offered by the drop-in under the module's
    attribute path, bit for bit; a key the module lacks is one line before anything is saved."""
    import shutil

    from qkrope.errors import InputError
    from qkrope.families.flux import FLUX2_STAGES
    from qkrope.families.flux.tiny import vae as tiny_vae
    from qkrope.runtime.component import ComponentLoadError
    from qkrope.runtime.stages import load_stage
    from qkrope.stages import STAGE_FILE, TENSORS_FILE, stage_record

    model = tiny_vae("flux2")
    g = torch.Generator().manual_seed(3)
    model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape, generator=g))
    model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape, generator=g) + 0.5)
    src = _saved(model, tmp_path / "src")
    skeleton = pipeline._load("diffusers", type(model).__name__, src, FP32)
    stage = FLUX2_STAGES[0].vae  # klein's; [dev]'s declares the same VAE
    out = tmp_path / "vae"
    out.mkdir()
    fields = export_vae(skeleton, stage, out, opset=OPSET, dtype=FP32, encode=True)
    assert fields["tensors"] == list(stage.tensors) and TENSORS_FILE in fields["files"]
    shutil.copyfile(src / "config.json", out / "config.json")
    (out / STAGE_FILE).write_text(json.dumps(stage_record(dtype="fp32", **fields)))
    vae = load_stage(out)
    for key in stage.tensors:
        owner, leaf = key.rsplit(".", 1)
        got = getattr(getattr(vae, owner), leaf)
        want = getattr(getattr(model, owner), leaf)
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert vae.config.batch_norm_eps == model.config.batch_norm_eps  # the config's, as before
    x = torch.rand(2, 3, 8, 12, generator=g) * 2 - 1  # the encoder graph, untraced sizes
    with torch.no_grad():
        want = model.encode(x).latent_dist.parameters
    got = vae.encode(x).latent_dist.parameters
    assert float((got - want).abs().max()) <= TRANSFORMER_PARITY * float(want.abs().max())

    # qkrope check's comparison with the PyTorch VAE: equal, then one value off
    import io

    from qkrope.apps.check_stages import _check_module_tensors

    said = io.StringIO()
    _check_module_tensors(stage.tensors, model, vae, said)
    assert "bit for bit" in said.getvalue()
    other = tiny_vae("flux2")
    other.load_state_dict(model.state_dict())
    other.bn.running_var[0] += 1
    with pytest.raises(InputError, match="bn.running_var differs") as exc:
        _check_module_tensors(stage.tensors, other, vae, io.StringIO())
    assert "\n" not in str(exc.value)

    # saved with the pipeline: the tensors go along and load back
    vae.save_pretrained(tmp_path / "saved")
    again = load_stage(tmp_path / "saved")
    assert torch.equal(again.bn.running_var, model.bn.running_var)
    # a record whose tensors are not its file's, or not keys of a module: one line at load
    record = json.loads((out / STAGE_FILE).read_text())
    for change in ({"tensors": ["bn", "bn.running_mean"]}, {"tensors": ["bn.__class__"]},
                   {"files": {k: v for k, v in record["files"].items() if k != TENSORS_FILE}}):
        shutil.rmtree(tmp_path / "bad", ignore_errors=True)
        shutil.copytree(out, tmp_path / "bad")
        (tmp_path / "bad" / STAGE_FILE).write_text(json.dumps({**record, **change}))
        with pytest.raises(ComponentLoadError) as exc:
            load_stage(tmp_path / "bad")
        text = str(exc.value)
        assert "\n" not in text and "Fix:" in text, text
    shutil.rmtree(tmp_path / "bad")
    shutil.copytree(out, tmp_path / "bad")
    values = load_file(str(out / TENSORS_FILE))
    values["bn.running_mean"] = values["bn.running_mean"] + 1  # same size, other values
    save_file(values, str(tmp_path / "bad" / TENSORS_FILE))
    with pytest.raises(ComponentLoadError, match="changed after the export"):
        load_stage(tmp_path / "bad")

    bad = VaeStage("image", tensors=("bn.running_median",))
    (tmp_path / "bad-export").mkdir()
    with pytest.raises(InputError) as exc:
        export_vae(skeleton, bad, tmp_path / "bad-export", opset=OPSET, dtype=FP32)
    text = str(exc.value)
    assert "\n" not in text and "bn.running_median" in text and "Fix:" in text, text


def test_an_image_encoder_streams_and_its_dropin_is_called_as_the_pipeline_calls_it(tmp_path):
    """A CLIP vision tower (Wan 2.1 I2V's image encoder, tiny): its graph streams the checkpoint
    and returns hidden_states[-2] as the module does at another batch than the traced one; the
    drop-in refuses another image size and a text call in one line."""
    import shutil

    from transformers import CLIPVisionConfig, CLIPVisionModel

    from qkrope.export.stages.text_encoder import export_image_encoder
    from qkrope.families.wan.tiny import CLIP
    from qkrope.runtime.component import ComponentError
    from qkrope.runtime.stages import ImageEncoderExport, load_stage
    from qkrope.stages import STAGE_FILE, ImageEncoderStage, stage_record

    torch.manual_seed(0)
    src = _saved(CLIPVisionModel(CLIPVisionConfig(**CLIP)).eval(), tmp_path / "src")
    skeleton = pipeline._load("transformers", "CLIPVisionModel", src, FP32)
    weights = streamed.attached(skeleton)
    out = tmp_path / "image_encoder"
    out.mkdir()
    fields = export_image_encoder(skeleton, ImageEncoderStage(reads=("hidden_states[-2]",)),
                                  out, opset=OPSET, dtype=FP32)
    reference = _reference(CLIPVisionModel, src, "transformers")
    count = _check_initializers(out / "encoder.onnx", _checkpoint(src), lambda k: k, reference)
    assert count == weights.source.reads > 0
    shutil.copyfile(src / "config.json", out / "config.json")
    (out / STAGE_FILE).write_text(json.dumps(stage_record(dtype="fp32", **fields)))
    encoder = load_stage(out)
    assert isinstance(encoder, ImageEncoderExport)
    side = CLIP["image_size"]
    x = torch.rand(3, 3, side, side, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = reference(pixel_values=x, output_hidden_states=True).hidden_states[-2]
    got = encoder(pixel_values=x, output_hidden_states=True).hidden_states[-2]
    scale = float(want.abs().max())
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= TRANSFORMER_PARITY * scale
    for call in (lambda: encoder(pixel_values=x[:, :, :16, :16]),
                 lambda: encoder(input_ids=torch.zeros(1, 4, dtype=torch.int64)),
                 lambda: encoder(pixel_values=x).hidden_states[-1]):
        with pytest.raises(ComponentError) as exc:
            call()
        text = str(exc.value)
        assert "\n" not in text and "Fix:" in text, text
