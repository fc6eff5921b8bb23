"""ONNX export of the attention block (export/attention_export.py, annotate.py, finalize.py):
node contract, sidecar and metadata, checker/shape inference, ONNX Runtime parity with the
PyTorch module and with diffusers.
Tiny sizes (2 heads x 64) except one export at Qwen-Image's default sizes. The op's function
body: test_onnx_function.py; the command line: test_export_cli.py; failures on disk:
test_export_files.py."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from qkrope.cli import main
from qkrope import contract, model_io
from qkrope.export.onnx_export import ATTENTION_FORMS, build_attention, export_attention
from qkrope.export.onnx_function import FunctionVariant, function_variant
from qkrope.runtime.inputs import from_ort_value, make_inputs, to_ort_value, to_torch
from qkrope.sidecars import ModelInfo

HEADS, HEAD_DIM = 2, 64
ONNX_TYPES = {"FLOAT": onnx.AttributeProto.FLOAT, "INT": onnx.AttributeProto.INT,
              "STRING": onnx.AttributeProto.STRING}


def _session(path, providers=("CPUExecutionProvider",)):
    return ort.InferenceSession(str(path), providers=list(providers))


def _run(path, feeds, providers=("CPUExecutionProvider",)):
    sess = _session(path, providers)
    outs = sess.run_with_ort_values(None, {k: to_ort_value(v) for k, v in feeds.items()})
    return [from_ort_value(o) for o in outs]


def _ref(info, feeds):
    module = build_attention(info)
    t = {k: to_torch(v) for k, v in feeds.items()}
    with torch.no_grad():
        return module(t["hidden_states"], t["encoder_hidden_states"],
                      (t["img_cos_sin_cache"], t["txt_cos_sin_cache"]),
                      t["encoder_hidden_states_mask"])


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("attn") / "attn.onnx"
    export_attention(out, heads=HEADS, head_dim=HEAD_DIM)
    return out


@pytest.fixture(scope="module")
def form_models(tmp_path_factory):
    """export_attention(dtype, attention form), exported once per pair."""
    cache = {}

    def get(dtype, form):
        if (dtype, form) not in cache:
            out = tmp_path_factory.mktemp(f"attn_{dtype}_{form}") / "attn.onnx"
            export_attention(out, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, attention=form)
            cache[dtype, form] = out
        return cache[dtype, form]

    return get


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("attn16") / "attn16.onnx"
    export_attention(out, heads=HEADS, head_dim=HEAD_DIM, dtype="fp16")
    return out


# ------------------------------------------------------------------------- node contract
def test_node_contract(fp32_model):
    model = onnx.load(str(fp32_model))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_TYPE]
    assert len(nodes) == 2, "one QKNormRoPE node per stream"
    for node in nodes:
        assert node.domain == contract.DOMAIN
        assert len(node.input) == len(contract.INPUTS) and len(node.output) == 2
        attrs = {a.name: a for a in node.attribute}
        # every attribute of the contract, but those left off at their default (norm_scope 0)
        assert sorted(attrs) == sorted(a.name for a in contract.ATTRIBUTES
                                       if not getattr(a, "omitted_at_default", False))
        for spec in contract.ATTRIBUTES:
            if spec.name in attrs:
                assert attrs[spec.name].type == ONNX_TYPES[spec.onnx_type], spec.name
        values = {k: onnx.helper.get_attribute_value(a) for k, a in attrs.items()}
        values = {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}
        expected = contract.node_attributes()
        assert values["interleaved"] == 1 and values["rounding"] == 0
        assert values["plugin_version"] == "1" and values["plugin_namespace"] == "qkrope"
        assert values["epsilon"] == pytest.approx(expected["epsilon"])
    # the cache inputs of the two nodes are the two graph inputs
    assert {n.input[4] for n in nodes} == {"img_cos_sin_cache", "txt_cos_sin_cache"}
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports[contract.DOMAIN] == contract.DOMAIN_VERSION and imports[""] == 18
    fns = [f for f in model.functions if (f.domain, f.name) == (contract.DOMAIN, contract.OP_TYPE)]
    assert len(fns) == 1
    assert list(fns[0].input) == list(contract.INPUTS)
    assert list(fns[0].output) == list(contract.OUTPUTS)
    assert model.ir_version == 10


def test_caches_are_2d_fp32_inputs_and_no_complex(fp32_model):
    model = onnx.load(str(fp32_model))
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert list(inputs) == ["hidden_states", "encoder_hidden_states",
                            "encoder_hidden_states_mask", "img_cos_sin_cache",
                            "txt_cos_sin_cache"]
    for name, rows in (("img_cos_sin_cache", "img_cache_rows"),
                       ("txt_cos_sin_cache", "txt_cache_rows")):
        tt = inputs[name]
        assert tt.elem_type == onnx.TensorProto.FLOAT
        assert [d.dim_param or d.dim_value for d in tt.shape.dim] == [rows, HEAD_DIM]
    assert inputs["encoder_hidden_states_mask"].elem_type == onnx.TensorProto.BOOL
    assert [d.dim_param for d in inputs["hidden_states"].shape.dim[:2]] == ["batch", "img_tokens"]
    inferred = onnx.shape_inference.infer_shapes(model)
    complex_types = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
    values = (list(inferred.graph.input) + list(inferred.graph.output)
              + list(inferred.graph.value_info))
    assert all(v.type.tensor_type.elem_type not in complex_types for v in values)
    assert all(t.data_type not in complex_types for t in model.graph.initializer)


def test_checker_and_shape_inference(fp32_model):
    onnx.checker.check_model(str(fp32_model), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(fp32_model)), strict_mode=True,
                                                 data_prop=True)
    for out in inferred.graph.output:
        dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert len(dims) == 3 and all(dims), (out.name, dims)


def test_sidecar(fp32_model):
    info = ModelInfo.load(fp32_model)
    assert info.model == "attention" and info.dtype == "fp32" and info.opset == 18
    assert info.ir_version == 10 and info.output_names == ["img_out", "txt_out"]
    assert set(info.dynamic_axes) == {"batch", "img_tokens", "txt_tokens", "img_cache_rows",
                                      "txt_cache_rows"}
    assert info.node_attributes == contract.NodeAttributes()
    assert info.node_attributes.to_node() == contract.node_attributes()
    assert info.config.heads == HEADS and info.config.head_dim == HEAD_DIM
    assert info.input_shape("img_cos_sin_cache", batch=3, img_tokens=7, txt_tokens=5) == (7, 64)
    assert info.input_shape("hidden_states", batch=3, img_tokens=7, txt_tokens=5) == (3, 7, 128)
    assert oct(os.stat(str(fp32_model) + ".json").st_mode & 0o777) != "0o600"
    # each tensor as qkrope/model_io.py declares it: name, role, named axes
    decl = model_io.ATTENTION
    assert [(t.name, t.role) for t in info.inputs + info.outputs] == \
        [(t.name, t.role) for t in decl.inputs + decl.outputs]
    for got, want in zip(info.inputs + info.outputs, decl.inputs + decl.outputs):
        assert [d if isinstance(d, str) else None for d in got.shape] == list(want.axes)
    assert function_variant(onnx.load(str(fp32_model), load_external_data=False)) == \
        FunctionVariant(interleaved=True, rounding=0, partial=False)


def test_metadata_props_and_input_docs(fp32_model):
    """The ONNX file says what it is: qkrope and node-contract versions, model kind,
    dtype, config as JSON, and a doc string on every input (shapes, cache format, mask)."""
    import json

    import qkrope

    model = onnx.load(str(fp32_model), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["qkrope.version"] == qkrope.__version__
    assert props["qkrope.contract_version"] == contract.CONTRACT_VERSION
    assert props["qkrope.model"] == "attention" and props["qkrope.dtype"] == "fp32"
    config = json.loads(props["qkrope.config"])
    assert config == ModelInfo.load(fp32_model).config.to_dict()
    assert config["heads"] == HEADS and config["head_dim"] == HEAD_DIM
    docs = {i.name: i.doc_string for i in model.graph.input}
    assert all(docs.values()), docs
    for name in ("img_cos_sin_cache", "txt_cos_sin_cache"):
        assert "cos half then the sin half" in docs[name] and "float32" in docs[name]
        assert "one row per token" in docs[name]
    assert "True = attend" in docs["encoder_hidden_states_mask"]
    assert "[batch, img_tokens" in docs["hidden_states"]


def test_sidecar_missing_is_clear(tmp_path):
    with pytest.raises(ValueError, match="qkrope export"):
        ModelInfo.load(tmp_path / "nothing.onnx")


# ------------------------------------------------------------------------- ORT parity
CASES = [  # img_shapes, txt_len, batch: all differ from the export sample
    ([(1, 6, 5)], 9, 2),
    ([(1, 4, 6), (1, 3, 4), (1, 2, 2)], 13, 2),  # edit: generated image + two condition images
    ([(1, 5, 5)], 3, 1),
]


@pytest.mark.parametrize("form", ATTENTION_FORMS)
@pytest.mark.parametrize("img_shapes,txt_len,batch", CASES)
def test_ort_matches_module_fp32(form_models, form, img_shapes, txt_len, batch):
    path = form_models("fp32", form)
    info = ModelInfo.load(path)
    assert info.config.attention == form
    feeds = make_inputs(info, img_shapes, txt_len, batch, seed=1)
    if batch == 2:
        assert not feeds["encoder_hidden_states_mask"].all()  # a text mask is exercised
    outs = _run(path, feeds)
    # ONNX Runtime and PyTorch compute the same fp32 sums in other orders (and ORT's Attention
    # kernel its own). A reordered sum of n terms moves by about sqrt(n) unit roundoffs of the
    # magnitude it sums (Higham & Mary's probabilistic analysis); the weights are scaled by
    # 1/sqrt(fan-in), so each stage's magnitude is the output's, and the stages add: the
    # projections (n = C), the RMS over D, the scores (n = D), the softmax sum and P.V (n = S
    # tokens), the output projection (n = C): 49-54 u here. Observed: at most 13 u (onnx23), in
    # line with the estimate, which is not a worst-case bound (that grows like n u per stage).
    u, c, s_tok = 2.0 ** -24, HEADS * HEAD_DIM, sum(f * h * w for f, h, w in img_shapes) + txt_len
    tol = u * (2 * np.sqrt(c) + 2 * np.sqrt(HEAD_DIM) + 2 * np.sqrt(s_tok))
    for got, ref in zip(outs, _ref(info, feeds)):
        err = np.abs(got - ref.numpy()).max()
        assert err <= tol * max(1.0, np.abs(ref.numpy()).max()), (err, tol)


@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_ort_matches_module_fp16(form_models, form):
    path = form_models("fp16", form)
    info = ModelInfo.load(path)
    feeds = make_inputs(info, [(1, 6, 5), (1, 3, 4)], 9, 2, seed=2)
    for got, ref in zip(_run(path, feeds), _ref(info, feeds)):
        ref = ref.float().numpy()
        scale = np.abs(ref).max()
        ulp = 2.0 ** (np.floor(np.log2(scale)) - 10)
        # bound: 2 fp16 ulps of the output scale (observed: 1 ulp)
        assert np.abs(got.astype(np.float32) - ref).max() <= 2 * ulp


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="requires onnxruntime-gpu and a CUDA GPU: ONNX Runtime's CPU provider "
                           "has no bf16 MatMul (on the CPU, bf16 is covered by "
                           "test_function_body_variants and the runner's clear-error test)")
def test_ort_matches_module_bf16_cuda(tmp_path):
    out = tmp_path / "attn_bf16.onnx"
    info, _ = export_attention(out, heads=HEADS, head_dim=HEAD_DIM, dtype="bf16")
    feeds = make_inputs(info, [(1, 6, 5), (1, 3, 4)], 9, 2, seed=2)
    got_all = _run(out, feeds, providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    for got, ref in zip(got_all, _ref(info, feeds)):
        ref = ref.float().numpy()
        ulp = 2.0 ** (np.floor(np.log2(np.abs(ref).max())) - 7)
        # bound: 2 bf16 ulps of the output scale, the same reasoning as the fp16 test
        assert np.abs(got.astype(np.float32) - ref).max() <= 2 * ulp


@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_ort_matches_diffusers(tmp_path, form):
    """Weights from a diffusers Attention (--weights), compared with diffusers' own forward
    (complex RoPE) at sizes other than the export size, batch 2, a text mask, edit images."""
    from safetensors.torch import save_file

    from _diffusers_ref import diffusers_freqs, qwen_attention

    attn = qwen_attention(HEADS, HEAD_DIM, seed=3)
    weights = tmp_path / "attn.safetensors"
    save_file({k: v.contiguous() for k, v in attn.state_dict().items()}, str(weights))
    out = tmp_path / "d.onnx"
    info, _ = export_attention(out, heads=HEADS, head_dim=HEAD_DIM, weights=weights,
                               attention=form)
    img_shapes, txt_len = [(1, 4, 5), (1, 2, 3)], 7
    feeds = make_inputs(info, img_shapes, txt_len, 2, seed=4)
    axes = tuple(info.config.axes_dims_rope)
    freqs = diffusers_freqs(img_shapes, txt_len, axes)
    with torch.no_grad():
        ref = attn(hidden_states=torch.from_numpy(feeds["hidden_states"]),
                   encoder_hidden_states=torch.from_numpy(feeds["encoder_hidden_states"]),
                   encoder_hidden_states_mask=torch.from_numpy(
                       feeds["encoder_hidden_states_mask"]),
                   image_rotary_emb=freqs)
    for got, r in zip(_run(out, feeds), ref):
        assert np.abs(got - r.numpy()).max() <= 1e-5 * max(1.0, np.abs(r.numpy()).max())



# ------------------------------------------------------------------------- default sizes
@pytest.mark.slow
def test_export_default_qwen_sizes(tmp_path):
    out = tmp_path / "qwen.onnx"
    assert main(["export", "--out", str(out)]) == 0
    info = ModelInfo.load(out)
    assert (info.config.heads, info.config.head_dim, info.config.dim) == (24, 128, 3072)
    assert info.config.axes_dims_rope == [16, 56, 56]
    assert out.stat().st_size > 6 * 3072 * 3072 * 4  # eight C x C fp32 linears, >= six counted



@pytest.mark.parametrize("change, match", [
    (lambda n: _set(n, "interleaved", 5), r"'interleaved' = 5 is invalid"),
    (lambda n: _set(n, "rounding", "0"), r"'rounding' has type STRING, expected INT"),
    (lambda n: _drop(n, "plugin_namespace"), r"has no attribute 'plugin_namespace'"),
    (lambda n: _set(n, "epsilon", -1.0), r"'epsilon' = -1.0 is invalid"),
    (lambda n: _set(n, "epsilon", 1e-50), r"'epsilon' = 0.0 is invalid"),
    (lambda n: _set(n, "plugin_version", "2"), r"'plugin_version' = '2' is invalid"),
    (lambda n: _set(n, "theta", 1.0), r"unknown attribute 'theta'"),
    (lambda n: n.input.pop(), r"has inputs .* expected 5"),
    (lambda n: setattr(n, "domain", "trt.plugins"), r"has domain 'trt.plugins'"),
])
def test_validate_qknorm_rope_nodes_names_node_and_attribute(fp32_model, change, match):
    model = onnx.load(str(fp32_model))
    assert contract.validate_qknorm_rope_nodes(model, where=str(fp32_model)) == 2
    node = next(n for n in model.graph.node if n.op_type == contract.OP_TYPE)
    change(node)
    with pytest.raises(contract.NodeContractError, match=match) as exc:
        contract.validate_qknorm_rope_nodes(model, where="m.onnx")
    assert f"'{node.name}'" in str(exc.value) and "m.onnx" in str(exc.value)


def _drop(node, name):
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep)


def _set(node, name, value):
    _drop(node, name)
    node.attribute.append(onnx.helper.make_attribute(name, value))

