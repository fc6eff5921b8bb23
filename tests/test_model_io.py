"""qkrope/model_io.py: the models' I/O told once (names, roles, axes, the Qwen-Image shape
record), roles written into the sidecars and read back (guessed only without them), and the
standalone copies (the Triton rope model's files) equal to the contract."""

from __future__ import annotations

import json
from pathlib import Path

import fake_tensorrt as ft
import pytest
from _tiny_model import sidecar_dict, write_tiny_onnx

from qkrope import families, model_io
from qkrope.model_io import ATTENTION_BLOCK
from qkrope.runtime import io_specs
from qkrope.sidecars import (EngineInfo, EngineTensor, ModelInfo, SidecarError, TensorInfo,
                             engine_tensors,
                             sidecar_path)

ROOT = Path(__file__).resolve().parent.parent

# the tiny model's input names -> their roles (what an exporter of other names would record)
TINY_ROLES = {"hidden_states": "hidden_states", "encoder_hidden_states": "encoder_hidden_states",
              "encoder_hidden_states_mask": "encoder_hidden_states_mask",
              "img_cos_sin_cache": "img_cache", "txt_cos_sin_cache": "txt_cache"}


def test_declarations_are_consistent():
    for decl in model_io.MODELS.values():
        roles = [t.role for t in decl.inputs]
        assert len(set(roles)) == len(roles) and set(roles) <= set(model_io.ROLES)
        assert {t.role for t in decl.outputs} <= set(model_io.OUTPUT_ROLES)
        for t in decl.inputs + decl.outputs:
            assert set(a for a in t.axes if a is not None) <= set(model_io.AXES), t.name
    # the transformer is the attention block's inputs plus a timestep
    assert (set(model_io.TRANSFORMER.input_names) - set(model_io.ATTENTION.input_names)
            == {"timestep"})
    assert ATTENTION_BLOCK.dim == 3072 and ATTENTION_BLOCK.rotary_dim == ATTENTION_BLOCK.head_dim


def test_assign_roles_guesses_the_declared_names():
    """The guess (for a model without a sidecar) finds every declared input by its name."""
    for decl in model_io.MODELS.values():
        specs = [model_io.spec_from_shape(t.name, "float32", [a or 4 for a in t.axes])
                 for t in decl.inputs]
        assert model_io.assign_roles(specs) == {t.role: t.name for t in decl.inputs}


def test_standalone_copies_equal_the_contract():
    """runtime/schemes/ and runtime/triton_rope_model.py run inside a Triton server without
    qkrope, so they spell their names themselves (their numbers come as parameters from the
    family records); the names must be these."""
    from qkrope.runtime import schemes, triton_rope_model

    assert triton_rope_model.DEFAULT_NAMES == {
        "txt_tensor": model_io.ENCODER_HIDDEN_STATES_MASK.name,
        "ids_txt_tensor": model_io.ENCODER_HIDDEN_STATES.name,
        "latent_tensor": model_io.HIDDEN_STATES.name,
        "img_output": model_io.IMG_COS_SIN_CACHE.name,
        "txt_output": model_io.TXT_COS_SIN_CACHE.name}
    # the records' RoPE defaults are diffusers' (axes_dims_rope, the theta key's default)
    import inspect

    import diffusers

    for family, cls in ((families.by_name("flux1"), diffusers.FluxTransformer2DModel),
                        (families.by_name("flux2"), diffusers.Flux2Transformer2DModel)):
        default = inspect.signature(cls.__init__).parameters["axes_dims_rope"].default
        assert tuple(family.axes) == tuple(default)
        if family.theta_key:
            assert inspect.signature(cls.__init__).parameters[family.theta_key].default == \
                family.theta
    # they stay standalone: no qkrope import at all (the schemes import each other relatively)
    files = [Path(triton_rope_model.__file__)] + sorted(Path(schemes.__file__).parent.glob("*.py"))
    for path in files:
        assert "import qkrope" not in path.read_text()
        assert "from qkrope" not in path.read_text()
    assert "from ." not in Path(triton_rope_model.__file__).read_text()


def _renamed(side: dict, *, roles: bool) -> dict:
    """The tiny sidecar with inputs no name rule can place (in0, in1, ...)."""
    side = json.loads(json.dumps(side))
    side["format_version"] = 2
    for i, t in enumerate(side["inputs"]):
        if roles:
            t["role"] = TINY_ROLES[t["name"]]
        t["name"] = f"in{i}"
        t["shape"] = [4 if isinstance(d, str) and d.endswith("cache_rows") else d
                      for d in t["shape"]]  # no axis names to guess from either
    return side


def test_model_info_reads_roles_and_guesses_only_without_them():
    side = _renamed(sidecar_dict(), roles=True)
    info = ModelInfo.from_dict(side)
    assert info.roles() == {role: f"in{i}" for i, role in enumerate(TINY_ROLES.values())}
    assert info.role_of("in3") == "img_cache"
    assert ModelInfo.from_dict(info.to_dict()).roles() == info.roles()  # written and read back
    # a format-1 sidecar records no roles: guessed from the names
    old = sidecar_dict()
    old["format_version"] = 1
    assert ModelInfo.from_dict(old).roles() == {v: k for k, v in TINY_ROLES.items()}
    unguessable = _renamed(sidecar_dict(), roles=False)
    unguessable["format_version"] = 1
    assert ModelInfo.from_dict(unguessable).roles() == {}


def _rename_onnx(path: Path, names: dict[str, str]) -> None:
    import onnx

    m = onnx.load(str(path))
    for vi in m.graph.input:
        vi.name = names.get(vi.name, vi.name)
    for node in m.graph.node:
        for i, n in enumerate(node.input):
            node.input[i] = names.get(n, n)
    onnx.save(m, str(path))


def test_onnx_model_io_reads_the_sidecars_roles(tmp_path):
    p = write_tiny_onnx(tmp_path / "m.onnx")
    side = json.loads(sidecar_path(p).read_text())
    _rename_onnx(p, {t["name"]: f"in{i}" for i, t in enumerate(side["inputs"])})
    sidecar_path(p).write_text(json.dumps(_renamed(side, roles=True)))
    io = io_specs.onnx_model_io(p)
    assert io.roles == {role: f"in{i}" for i, role in enumerate(TINY_ROLES.values())}
    # without the sidecar, only the graph's names and axis names are there to guess from: the
    # caches are found by their rows axes, the activations not at all
    sidecar_path(p).unlink()
    assert io_specs.onnx_model_io(p).roles == {"img_cache": "in3", "txt_cache": "in4"}


def _fake_engine(names):
    c = 32
    io = [(n, "FLOAT", [-1, c], [(1, c), (2, c), (4, c)], ft.TensorIOMode.INPUT) for n in names]
    io.append(("out", "FLOAT", [-1, c], None, ft.TensorIOMode.OUTPUT))
    return ft.ICudaEngine(io)


def test_engine_model_io_reads_the_engine_sidecars_roles():
    trt, _ = ft.make_fake_trt()
    model = ModelInfo.from_dict(_renamed(sidecar_dict(), roles=True))
    tensors = engine_tensors([EngineTensor(t.name, t.dtype,
                                           [-1 if isinstance(d, str) else d for d in t.shape])
                              for t in model.inputs], model)
    assert [t.role for t in tensors] == list(TINY_ROLES.values())  # carried on from the model
    side = EngineInfo(tensorrt_version="10.14", onnx="/m.onnx", inputs=tensors,
                      outputs=[EngineTensor("out", "float32", [-1, 32])], profiles=[],
                      plugin=None, plugin_layers=2, version_compatible=False,
                      strongly_typed=True, config={"head_dim": 16})
    back = EngineInfo.from_dict(side.to_dict())
    assert back.roles() == model.roles()
    io = io_specs.engine_model_io(_fake_engine([t.name for t in tensors]), trt, back)
    assert io.roles == model.roles()
    # no sidecar: guessed from the names, which say nothing here
    assert io_specs.engine_model_io(_fake_engine([t.name for t in tensors]), trt, None).roles == {}


def test_sidecar_role_is_checked():
    side = sidecar_dict()
    side["inputs"][0]["role"] = 3
    with pytest.raises(Exception, match=r"inputs\[0\] field 'role' must be str"):
        ModelInfo.from_dict(side)
    assert TensorInfo("x", "float32", [1]).to_dict() == {"name": "x", "dtype": "float32",
                                                         "shape": [1]}


@pytest.mark.parametrize("swap", [("hidden_states", "encoder_hidden_states"),
                                  ("img_cache", "txt_cache")])
@pytest.mark.parametrize("renamed", [False, True])
def test_swapped_roles_are_refused_in_either_sidecar(swap, renamed):
    """Roles swapped by an edit (the runner would feed each stream's data to the other) are
    refused: by the name where qkrope's names are kept, by the axis names where the model was
    renamed; the engine sidecar (which carries the roles on) likewise. A duplicate is refused."""
    side = _renamed(sidecar_dict(), roles=True) if renamed else sidecar_dict()
    if not renamed:
        side["format_version"] = 2
        for t in side["inputs"]:
            t["role"] = TINY_ROLES[t["name"]]
    side["inputs"][3]["shape"] = ["img_cache_rows", 16]  # axis names to check against
    side["inputs"][4]["shape"] = ["txt_cache_rows", 16]
    model = ModelInfo.from_dict(side)
    a, b = (next(t for t in side["inputs"] if t["role"] == r) for r in swap)
    a["role"], b["role"] = b["role"], a["role"]
    with pytest.raises(SidecarError, match="the roles were edited or swapped"):
        ModelInfo.from_dict(side)
    net = [EngineTensor(t.name, t.dtype, [-1 if isinstance(d, str) else d for d in t.shape])
           for t in model.inputs]
    engine = EngineInfo(tensorrt_version="10.14", onnx="/m.onnx",
                        inputs=engine_tensors(net, model),
                        outputs=[EngineTensor("img_out", "float32", [-1, -1, 32])], profiles=[],
                        plugin=None, plugin_layers=2, version_compatible=False,
                        strongly_typed=True, config={"head_dim": 16}).to_dict()
    EngineInfo.from_dict(engine)
    x, y = (next(t for t in engine["inputs"] if t["role"] == r) for r in swap)
    x["role"], y["role"] = y["role"], x["role"]
    with pytest.raises(SidecarError, match="the roles were edited or swapped"):
        EngineInfo.from_dict(engine)
    x["role"], y["role"] = y["role"], x["role"]
    engine["inputs"].append(dict(x))
    with pytest.raises(SidecarError, match="twice among its inputs"):
        EngineInfo.from_dict(engine)
