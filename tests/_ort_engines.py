"""The fake TensorRT (tests/fake_tensorrt.py) with engines that compute: ``qkrope build
OUT_DIR`` parses each stage graph with :func:`parse_graph` (the graph's inputs and outputs, and
its path as the network's name, so that every graph's serialised bytes differ), and
:func:`register_engines` then makes each engine file ``qkrope build`` wrote deserialise to an
:class:`OrtEngine`: its graph in an ONNX Runtime session, with TensorRT's execution contract
over the memory the caller binds. ``set_input_shape`` within the context's profile,
``set_tensor_address`` of every input and output, ``get_tensor_shape`` of an output (the
graph's output shape for the bound inputs), then ``execute_async_v3`` reads the inputs from
their addresses and writes the outputs to theirs, as an engine does on its stream.

What this proves on a CPU: the TensorRT path's bookkeeping (which engine runs which graph,
profile selection, binding by address, output shapes and dtypes, outputs copied before the next
call reuses the buffers, the feature cache a causal VAE passes from call to call). What it
cannot: TensorRT's own numerics, which need a GPU with TensorRT (``qkrope check OUT_DIR``
compares the engines there).

The addresses are host pointers of CPU tensors (``data_ptr``), read and written with ctypes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import fake_tensorrt as ft
import numpy as np

#: ONNX element type -> the TensorRT data type name the fake uses
TRT_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16", 7: "INT64", 6: "INT32", 9: "BOOL"}
#: ONNX Runtime's type strings -> numpy (the dtypes a host buffer can be read as)
NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
         "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def parse_graph(network, path, state):
    """The fake parser over any ONNX file: its inputs and outputs (-1 = dynamic), one
    QKNormRoPE plugin layer per node, the file's path as the network's name; the files parsed,
    in order, in ``state.parsed``, and where each one's profiles start in ``state.marks``."""
    import onnx

    from qkrope.runtime import onnx_file

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}

    def tensor(v):
        t = v.type.tensor_type
        return ft.ITensor(v.name, TRT_TYPES[t.elem_type],
                          [d.dim_value if d.dim_value else -1 for d in t.shape.dim])
    network.inputs = [tensor(v) for v in model.graph.input if v.name not in inits]
    network.outputs = [tensor(v) for v in model.graph.output]
    network.layers += [ft.qknorm_rope_layer(n) for n in onnx_file.count_plugin_nodes(path)]
    network.name = str(Path(path).resolve())
    state.parsed.append(f"{Path(path).parent.name}/{Path(path).name}")
    state.marks.append(len(state.profiles))  # its profiles are the ones added after this


def by_graph(state) -> dict:
    """graph file (``stage/file.onnx``) -> the profiles the builder added for it
    ({input: (min, opt, max)} each)."""
    ends = state.marks[1:] + [len(state.profiles)]
    return {f: state.profiles[a:b] for f, a, b in zip(state.parsed, state.marks, ends)}


def _host(address: int, shape, dtype) -> np.ndarray:
    """The ``shape`` array of ``dtype`` at host ``address`` (a view: no copy)."""
    count = int(np.prod(shape, dtype=np.int64))
    size = count * np.dtype(dtype).itemsize
    if size == 0:
        return np.empty(shape, dtype)
    buf = (ctypes.c_char * size).from_address(address)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class OrtContext(ft.IExecutionContext):
    """An execution context whose ``execute_async_v3`` runs the graph (module docstring)."""

    def _feeds(self) -> dict:
        session = self.engine.session
        return {i.name: _host(self.addresses[i.name], self.shapes[i.name], NUMPY[i.type])
                for i in session.get_inputs()}

    def get_tensor_shape(self, name):
        outs = self.engine.session.run(None, self._feeds())
        names = [o.name for o in self.engine.session.get_outputs()]
        return tuple(outs[names.index(name)].shape)

    def execute_async_v3(self, stream_handle):
        super().execute_async_v3(stream_handle)
        session = self.engine.session
        outs = session.run(None, self._feeds())
        for o, value in zip(session.get_outputs(), outs):
            value = np.ascontiguousarray(value, dtype=NUMPY[o.type])
            ctypes.memmove(self.addresses[o.name], value.ctypes.data, value.nbytes)
        return True


class OrtEngine(ft.ICudaEngine):
    """An engine of ``onnx`` with the optimisation ``profiles`` its build added."""

    def __init__(self, onnx: Path, profiles, name: str = ""):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
        io = [(i.name, TRT_TYPES[_onnx_type(i.type)],
               [d if isinstance(d, int) else -1 for d in i.shape], None, ft.TensorIOMode.INPUT)
              for i in self.session.get_inputs()]
        io += [(o.name, TRT_TYPES[_onnx_type(o.type)],
                [d if isinstance(d, int) else -1 for d in o.shape], None,
                ft.TensorIOMode.OUTPUT) for o in self.session.get_outputs()]
        super().__init__(io, profiles=profiles, name=name)

    def create_execution_context(self):
        ctx = OrtContext(self)
        self.contexts.append(ctx)
        return ctx


def _onnx_type(type_string: str) -> int:
    return {"tensor(float)": 1, "tensor(float16)": 10, "tensor(int64)": 7, "tensor(int32)": 6,
            "tensor(bool)": 9, "tensor(bfloat16)": 16}[type_string]


def register_engines(state, out_dir: Path) -> list[Path]:
    """Every stage engine under ``out_dir`` that the fake build wrote, registered in ``state``
    as an :class:`OrtEngine` of its graph with the profiles the build added; the engines."""
    profiles = by_graph(state)
    done = []
    for key, added in profiles.items():
        onnx = out_dir / key
        engine = onnx.with_suffix(".engine")
        if not engine.is_file() or onnx.parent.name == "transformer":
            continue
        blob = engine.read_bytes()
        state.engines[blob] = OrtEngine(onnx, added, name=str(onnx.resolve()))
        done.append(engine)
    return done
