"""The TensorRT backend of :func:`qkrope.runtime.load`: :class:`TensorRTRunner` over an engine
that :func:`~qkrope.runtime.loader_tensorrt.engine_from_path` deserialised.

Threads, streams, buffers: per calling thread (``threading.local``) one ``torch.cuda.Stream`` and
one ``IExecutionContext`` per optimisation profile, created on first use and bound to its profile
with ``set_optimization_profile_async`` on that stream; each call runs on the first profile whose
[min, max] holds its shapes (shapes no profile holds are refused, naming the profiles).
``cuda_graph=True`` replays a CUDA graph captured once per (profile, shapes). The engine is
shared. The runner makes its stream wait for the caller's current stream, enqueues with
``execute_async_v3``, and makes the caller's current stream wait for it, so results are ordered
on the caller's stream without a host synchronisation.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch

from qkrope import dtypes

from .io_specs import engine_model_io
from .loader_tensorrt import LoadedEngine
from .runner import Runner, RunnerError, RunnerInputError, _same_cuda

#: CUDA graphs (with their static input and output buffers) a thread keeps with
#: ``cuda_graph=True``: those of the last four sets of input shapes used (a true-CFG pair at two
#: resolutions); an older set is captured again when it comes back.
GRAPHS_PER_THREAD = 4


class TorchCuda:
    """The CUDA operations of :class:`TensorRTRunner` (streams, events, CUDA graphs), in one
    place so that the bookkeeping around them is tested with a stand-in where there is no GPU."""

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def handle(self, stream) -> int:
        return stream.cuda_stream

    def wait(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def record(self, tensor, stream) -> None:
        tensor.record_stream(stream)

    def stream_scope(self, stream):
        return torch.cuda.stream(stream)

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, stream):
        """Context manager: capture what is enqueued on ``stream`` into ``graph``."""
        return torch.cuda.graph(graph, stream=stream)

    def replay(self, graph, stream) -> None:
        with torch.cuda.stream(stream):
            graph.replay()


class TensorRTRunner(Runner):
    """TensorRT backend: shared engine; per thread, one CUDA stream and one execution context
    per optimisation profile (created on first use, bound to its profile with
    ``set_optimization_profile_async`` on the thread's stream). Each call runs on the first
    profile whose [min, max] holds its shapes; shapes no profile holds are refused naming the
    profiles.

    ``cuda_graph=True`` (off by default: not yet verified on a GPU in this project's CI)
    captures ``execute_async_v3`` once per (thread, profile, input shapes) into a
    ``torch.cuda.CUDAGraph`` over static input and output buffers and replays it on later calls
    with the same shapes (inputs are copied into the static buffers first). The returned
    outputs are those static buffers: overwritten by the next call with the same shapes, as
    without graphs. A thread keeps the graphs of its last :data:`GRAPHS_PER_THREAD` sets of
    shapes (memory stays bounded when shapes keep changing)."""

    backend = "tensorrt"

    def __init__(self, loaded: LoadedEngine, *, copy_outputs: bool = False,
                 cuda_graph: bool = False, device=None, cuda=None, transformer: bool = True):
        """``loaded``: the engine :func:`~qkrope.runtime.loader_tensorrt.engine_from_path`
        deserialised (tests pass a fake engine, a CPU ``device`` and a stand-in for
        :class:`TorchCuda` as ``cuda``). ``device``: default the current CUDA device.
        ``transformer=False``: a pipeline stage's engine, run with ``run_feeds``."""
        engine, trt, sidecar = loaded.engine, loaded.trt, loaded.sidecar
        self.path, self.plugin_path = loaded.path, loaded.plugin_path
        self.runtime, self.logger = loaded.runtime, loaded.logger  # the engine's, kept alive
        self.trt, self.engine, self.sidecar = trt, engine, sidecar
        if sidecar is not None:
            sidecar.check_engine_name(getattr(engine, "name", None), sidecar.source or "engine")
        Runner.__init__(self, engine_model_io(engine, trt, sidecar, roles=transformer),
                        copy_outputs=copy_outputs, transformer=transformer)
        self.device = (device if device is not None
                       else torch.device("cuda", torch.cuda.current_device()))
        self.cuda = cuda if cuda is not None else TorchCuda()
        self.cuda_graph = bool(cuda_graph)
        names = set(self.input_names)
        self.profile_ranges = []
        for k in range(max(int(getattr(engine, "num_optimization_profiles", 1)), 1)):
            prof = {}
            for n in self.input_names:
                lo, _opt, hi = engine.get_tensor_profile_shape(n, k)
                prof[n] = ([int(d) for d in lo], [int(d) for d in hi])
            self.profile_ranges.append(prof)
        labels = list(sidecar.profile_labels) if sidecar is not None else []
        self.profile_labels = (labels if len(labels) == len(self.profile_ranges)
                               else [""] * len(self.profile_ranges))
        assert names == set(self.profile_ranges[0])

    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda" or not _same_cuda(device, self.device):
            raise RunnerInputError(
                f"the inputs are on {device} but the TensorRT engine runs on {self.device}. Fix: "
                f"move them with .to({str(self.device)!r}) (caches too)")

    def select_profile(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """The first optimisation profile whose [min, max] holds every input shape."""
        from .profiles import ProfileError, select_profile

        try:
            return select_profile(self.profile_ranges, shapes, self.profile_labels)
        except ProfileError as exc:
            raise RunnerInputError(str(exc)) from None

    def _thread_state(self):
        loc = self._local
        if not hasattr(loc, "contexts"):
            loc.contexts = {}   # profile index -> IExecutionContext
            # (profile, input shapes) -> (graph, static inputs, outputs), least recent first
            loc.graphs = OrderedDict()
            loc.stream = self.cuda.new_stream(self.device)
        return loc

    def _context(self, st, k: int):
        ctx = st.contexts.get(k)
        if ctx is None:
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise RunnerError("TensorRT could not create an execution context (out of device "
                                  "memory?)")
            if len(self.profile_ranges) > 1 or k != 0:
                if not ctx.set_optimization_profile_async(k, self.cuda.handle(st.stream)):
                    raise RunnerError(f"TensorRT could not select optimisation profile {k} on a "
                                      f"new execution context (see its log above)")
            st.contexts[k] = ctx
        return ctx

    def _bind(self, ctx, feeds, device, k: int):
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RunnerInputError(f"TensorRT rejected the shape {tuple(t.shape)} for {name} "
                                       f"(profile {k})")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for spec in self.io.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(spec.name))
            buf = self._output_buffer(spec.name, shape, dtypes.torch_dtype(spec.dtype), device)
            ctx.set_tensor_address(spec.name, buf.data_ptr())
            outs.append(buf)
        return outs

    def _enqueue(self, ctx, st) -> None:
        if not ctx.execute_async_v3(self.cuda.handle(st.stream)):
            raise RunnerError("TensorRT's execute_async_v3 failed (see its log above)")

    def _execute(self, feeds, axes, device):
        shapes = {n: tuple(int(d) for d in t.shape) for n, t in feeds.items()}
        k = self.select_profile(shapes)
        st = self._thread_state()
        ctx = self._context(st, k)
        caller = self.cuda.current_stream(device)
        self.cuda.wait(st.stream, caller)
        if not self.cuda_graph:
            outs = self._bind(ctx, feeds, device, k)
            self._enqueue(ctx, st)
        else:
            key = (k, tuple(sorted(shapes.items())))
            entry = st.graphs.get(key)
            if entry is None:
                with self.cuda.stream_scope(st.stream):
                    static = {n: torch.empty_like(t) for n, t in feeds.items()}
                    for n, t in feeds.items():
                        static[n].copy_(t)
                outs = self._bind(ctx, static, device, k)
                # one eager run first: TensorRT finishes deferred work (shape-dependent setup)
                # outside the capture, then the enqueue is captured
                self._enqueue(ctx, st)
                graph = self.cuda.new_graph()
                with self.cuda.capture(graph, st.stream):
                    self._enqueue(ctx, st)
                st.graphs[key] = (graph, static, outs)
                while len(st.graphs) > GRAPHS_PER_THREAD:
                    st.graphs.popitem(last=False)  # its buffers go with its last reference
            else:
                st.graphs.move_to_end(key)
                graph, static, outs = entry
                with self.cuda.stream_scope(st.stream):
                    for n, t in feeds.items():
                        static[n].copy_(t)
                self.cuda.replay(graph, st.stream)
        for t in feeds.values():
            self.cuda.record(t, st.stream)
        self.cuda.wait(caller, st.stream)
        return list(outs)


__all__ = ["GRAPHS_PER_THREAD", "TensorRTRunner", "TorchCuda"]
