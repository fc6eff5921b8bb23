"""The one fake ``tensorrt`` module of the Python tests (no TensorRT library is needed).

It follows the real Python API where the product code relies on it:

- ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` is 1 in TensorRT 10 and 0 in 11, where it is
  deprecated (every network is strongly typed); ``Builder.create_network(flags)`` records what
  it was given.
- ``OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE`` exists from 10.15 on (not on a "10.14" fake).
- ``network.get_layer(i)`` returns a fresh :class:`ILayer`, which has no ``.plugin``: the caller
  casts it (``layer.__class__ = trt.IPluginV3Layer``) when ``layer.type`` is
  ``LayerType.PLUGIN_V3``, as polygraphy does.
- ``Builder.build_serialized_network`` returns an :class:`IHostMemory` (a buffer) or None.
- ``ICudaEngine``: the I/O queries the runner makes (names, dtypes, shapes, modes, profiles,
  ``num_optimization_profiles``) and ``create_execution_context`` (:class:`IExecutionContext`).
- ``Refitter(engine, logger)``: ``get_all_weights``, ``get_weights_prototype`` (a prototype of
  size -1 for a name that is no refittable weight, as the real one), ``get_named_weights``,
  ``set_named_weights``, ``get_missing_weights`` (what the engine still needs:
  ``RefittableEngine(required=...)``), ``refit_cuda_engine`` (False while weights are missing).
- ``OnnxParser``: ``parse_from_file(model)`` fails (False) with ``make_fake_trt(parse_errors=...)``,
  its errors read through ``num_errors`` / ``get_error(index)`` (:class:`ParserError`) and
  ``clear_errors``.
- ``Runtime(logger).deserialize_cuda_engine(serialized_engine)``: the engine registered for those
  bytes in ``state.engines``, None for anything else (what TensorRT returns for bytes that are
  not an engine it can load); ``engine_host_code_allowed``: bytes that carry host code
  (``state.host_code``: bytes -> a shared library, a version-compatible engine's plugin) are
  None unless it is True, and then the library is really ``dlopen``ed, as TensorRT does.
- ``get_plugin_registry().load_library(path)``: recorded in ``state.loaded``; with
  ``make_fake_trt(dlopen=True)`` the library is really ``dlopen``ed (its constructors run), None
  when it does not load, as TensorRT's ``IPluginRegistry.loadLibrary``.
- ``ICudaEngine.serialize()``, ``create_engine_inspector()`` (:class:`EngineInspector`:
  ``get_engine_information(format)``, ``get_layer_information(layer_index, format)``), the
  ``ProfilingVerbosity`` and ``LayerInformationFormat`` enums, ``IBuilderConfig.profiling_verbosity``
  (TensorRT's default ``LAYER_NAMES_ONLY``).

Names, parameter names and enum members are those of the real bindings:
tests/test_fake_tensorrt.py compares them with the ``tensorrt-cu12-bindings`` wheel.
``make_fake_trt(version=...)`` returns ``(module, state)``; ``state`` records what the code under
test did (flags, parser flags, profile shapes, loaded libraries, progress calls).
"""

from __future__ import annotations

import types
from typing import Sequence

from qkrope import contract


class LayerType:
    PLUGIN = "PLUGIN"
    PLUGIN_V2 = "PLUGIN_V2"
    PLUGIN_V3 = "PLUGIN_V3"
    MATRIX_MULTIPLY = "MATRIX_MULTIPLY"
    ELEMENTWISE = "ELEMENTWISE"


class PluginCapabilityType:
    CORE = "CORE"


class TensorIOMode:
    INPUT, OUTPUT = "INPUT", "OUTPUT"


class DataType:
    def __init__(self, value: str):
        self.name = value  # FLOAT, HALF, BF16, BOOL, ...


for _n in ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL", "UINT8", "FP8"):
    setattr(DataType, _n, DataType(_n))


class Weights:
    """``trt.Weights(type, ptr, count)`` (the real constructor's host form); ``dtype``, ``size``
    (element count; -1 in the prototype of an unknown name)."""

    def __init__(self, type=DataType.FLOAT, ptr=0, count=0):
        self.dtype, self.ptr, self.size = type, ptr, int(count)


class Refitter:
    """``trt.Refitter(engine, logger)`` over a :class:`RefittableEngine`: ``get_all_weights``
    (names), ``get_weights_prototype`` (a Weights of the build's dtype and count; size -1 for a
    name that is no refittable weight), ``get_named_weights`` (what was set),
    ``set_named_weights`` (False when the name is unknown or dtype or count differ, as TensorRT
    refuses them), ``get_missing_weights`` (the engine's ``required`` names not set yet; a
    partial refit keeps the other weights), ``refit_cuda_engine`` (False while weights are
    missing; else True, recording what was set in ``engine.refits``)."""

    def __init__(self, engine, logger):
        if not engine.refittable:
            raise RuntimeError("engine is not refittable")
        self.engine, self.set = engine, {}

    def get_all_weights(self):
        return list(self.engine.weights)

    def get_weights_prototype(self, weights_name):
        """The dtype and count of the weights the engine was built with (no data); size -1 when
        the name is no refittable weight."""
        if weights_name not in self.engine.weights:
            return Weights(DataType.FLOAT, 0, -1)
        dtype, count = self.engine.weights[weights_name]
        return Weights(DataType(dtype), 0, count)

    def get_named_weights(self, weights_name):
        """Weights set so far under ``weights_name`` (empty FLOAT weights when none were set)."""
        return self.set.get(weights_name, Weights(DataType.FLOAT, 0, 0))

    def set_named_weights(self, name, weights):
        if name not in self.engine.weights:
            return False
        dtype, count = self.engine.weights[name]
        if weights.dtype.name != dtype or weights.size != count:
            return False
        self.set[name] = weights
        if weights.ptr:  # the bytes TensorRT would copy (read now: the caller owns the buffer)
            import ctypes

            itemsize = {"FLOAT": 4, "HALF": 2, "BF16": 2, "INT32": 4, "INT64": 8}[dtype]
            self.engine.values[name] = ctypes.string_at(weights.ptr, count * itemsize)
        return True

    def get_missing_weights(self):
        return sorted(set(self.engine.required) - set(self.set))

    def refit_cuda_engine(self):
        if self.get_missing_weights():
            return False
        self.engine.refits.append(sorted(self.set))
        return True


class RefittableEngine:
    """An ICudaEngine as far as refitting goes: ``weights`` {name: (dtype name, count)},
    ``refittable``, ``serialize()``; ``required``: names TensorRT needs before a refit (those a
    refit of one weight makes necessary, e.g. weights folded together at build time)."""

    def __init__(self, weights, refittable=True, required=(), name=""):
        self.weights, self.refittable, self.refits = dict(weights), refittable, []
        self.name = name  # the network name it was built with
        self.required = tuple(required)
        self.values: dict[str, bytes] = {}  # what set_named_weights passed, per name

    def serialize(self):
        return IHostMemory(b"\x00REFITTED-ENGINE-%d" % len(self.refits))


class ErrorCode:
    """The ONNX parser's ``trt.ErrorCode`` (the members the fake uses)."""

    SUCCESS, INTERNAL_ERROR, INVALID_NODE, UNSUPPORTED_NODE, INVALID_GRAPH = (
        DataType(n) for n in ("SUCCESS", "INTERNAL_ERROR", "INVALID_NODE", "UNSUPPORTED_NODE",
                              "INVALID_GRAPH"))


class ParserError:
    """What ``OnnxParser.get_error(index)`` returns: ``code()``, ``desc()``, ``node()`` (-1:
    no node), ``node_name()``, ``node_operator()``, ``file()``, ``func()``, ``line()``, and a
    one-line ``str()`` naming them."""

    def __init__(self, desc, node_name="", node_operator="", code=ErrorCode.UNSUPPORTED_NODE,
                 node=-1):
        self._desc, self._name, self._op, self._code, self._node = (desc, node_name,
                                                                    node_operator, code, node)

    def code(self):
        return self._code

    def desc(self):
        return self._desc

    def node(self):
        return self._node

    def node_name(self):
        return self._name

    def node_operator(self):
        return self._op

    def file(self):
        return "ModelImporter.cpp"

    def func(self):
        return "parseNode"

    def line(self):
        return 0

    def __str__(self):
        return (f"In node {self._node} with name: {self._name} and operator: {self._op} "
                f"({self.func()}): {self._code.name}: {self._desc}")


class ProfilingVerbosity:
    LAYER_NAMES_ONLY, NONE, DETAILED = "LAYER_NAMES_ONLY", "NONE", "DETAILED"


class LayerInformationFormat:
    ONELINE, JSON = "ONELINE", "JSON"


class EngineInspector:
    """``engine.create_engine_inspector()``: the engine's ``layer_info`` (a JSON text, as
    ``get_engine_information(LayerInformationFormat.JSON)`` gives it; with ONELINE: one layer
    name a line); ``execution_context`` as the real attribute."""

    def __init__(self, engine):
        self.engine, self.execution_context = engine, None

    def get_engine_information(self, format):
        import json

        info = self.engine.layer_info
        if format == LayerInformationFormat.JSON:
            return info
        return "\n".join(layer if isinstance(layer, str) else layer.get("Name", "")
                         for layer in json.loads(info).get("Layers", []))

    def get_layer_information(self, layer_index, format):
        import json

        layer = json.loads(self.engine.layer_info)["Layers"][layer_index]
        return json.dumps(layer) if format == LayerInformationFormat.JSON else str(layer)


class PluginCore:
    """What ``get_capability_interface(CORE)`` returns: the plugin's identity."""

    def __init__(self, name, version, namespace):
        self.plugin_name, self.plugin_version, self.plugin_namespace = name, version, namespace


class Plugin:
    def __init__(self, core: PluginCore | None = None, broken: bool = False):
        self.core, self.broken = core, broken

    def get_capability_interface(self, type):
        assert type == PluginCapabilityType.CORE
        if self.broken:
            raise RuntimeError("cannot cast")
        return self.core


class ILayer:
    """The base class ``get_layer`` returns: no ``plugin`` attribute until cast."""

    def __init__(self, type, name, plugin=None):
        self.type, self.name, self._plugin = type, name, plugin


class IPluginV3Layer(ILayer):
    @property
    def plugin(self):
        return self._plugin


def qknorm_rope_layer(name="node_qk_0") -> tuple:
    """A layer spec (type, name, plugin) of a QKNormRoPE plugin layer."""
    return (LayerType.PLUGIN_V3, name, Plugin(PluginCore(
        contract.PLUGIN_NAME, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)))


class ITensor:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, DataType(dtype), shape


class INetworkDefinition:
    """Layers are kept as (type, name, plugin) specs; every get_layer call wraps one in a new
    ILayer, like the real bindings."""

    name = ""  # the network's name (the engine keeps it: ICudaEngine.name)

    def __init__(self, layers: Sequence[tuple] = (), inputs=(), outputs=(), flags: int = 0):
        self.layers, self.inputs, self.outputs = list(layers), list(inputs), list(outputs)
        self.flags = flags
        self.weights: set[str] = set()  # weight names (the ONNX parser: initializer names)
        self.marked: list[str] = []

    def mark_weights_refittable(self, name):
        """True for a weight of the network (recorded), False otherwise, like the real one."""
        if name not in self.weights:
            return False
        self.marked.append(name)
        return True

    @property
    def num_layers(self):
        return len(self.layers)

    def get_layer(self, index):
        return ILayer(*self.layers[index])

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, index):
        return self.inputs[index]

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_output(self, index):
        return self.outputs[index]


def plan_bytes(network_name: str = "") -> bytes:
    """The fake's serialised engine: fixed bytes, then the network name as text (a plan keeps
    the network's name, which ``ICudaEngine.name`` gives back after deserialising; qkrope's
    sidecar check reads it off the file)."""
    return b"\x00SERIALIZED-ENGINE" + (b"\0" + network_name.encode() if network_name else b"")


class IHostMemory(bytes):
    """The serialised engine: a buffer (``memoryview`` works) with ``nbytes``."""

    @property
    def nbytes(self) -> int:
        return len(self)


class IExecutionContext:
    """The calls the TensorRT runner makes: ``set_optimization_profile_async(k, stream)`` (True;
    False for an index the engine does not have), ``set_input_shape`` (False outside the
    context's profile, like the real one), ``set_tensor_address``, ``get_tensor_shape`` of an
    output (the shape of the input named in the engine's ``output_like``), ``execute_async_v3``
    (True; counted in ``engine.calls``)."""

    def __init__(self, engine):
        self.engine, self.profile = engine, 0
        self.shapes, self.addresses = {}, {}

    @property
    def active_optimization_profile(self):
        return self.profile

    def set_optimization_profile_async(self, profile_index, stream_handle):
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            return False
        self.profile = profile_index
        self.engine.calls.append(("set_optimization_profile_async", profile_index,
                                  stream_handle))
        return True

    def set_input_shape(self, name, shape):
        lo, _opt, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        if len(shape) != len(lo) or not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, memory):
        self.addresses[name] = memory
        return True

    def get_tensor_shape(self, name):
        return self.shapes[self.engine.output_like[name]]

    def execute_async_v3(self, stream_handle):
        self.engine.calls.append(("execute_async_v3", self.profile, dict(self.shapes),
                                  stream_handle))
        return True


class ICudaEngine:
    """The ICudaEngine queries ``io_specs.engine_model_io`` and the TensorRT runner make.
    ``io``: (name, TensorRT dtype name, shape with -1, [min, opt, max] or None, TensorIOMode);
    ``profiles``: more optimisation profiles, ``{input: (min, opt, max)}`` each (profile 0 is
    the one in ``io`` unless ``profiles`` is given); ``output_like``: output -> the input whose
    shape it has (for the fake context)."""

    def __init__(self, io: Sequence[tuple] = (), profiles: Sequence[dict] | None = None,
                 output_like: dict | None = None, layer_info: str = '{"Layers": []}',
                 serialized: bytes = b"\x00SERIALIZED-ENGINE", name: str = ""):
        self.layer_info, self._serialized, self.name = layer_info, serialized, name
        self.io = list(io)
        self.num_io_tensors = len(self.io)
        if profiles is None:
            profiles = [{e[0]: tuple(e[3]) for e in self.io if e[3] is not None}]
        self.profiles = [dict(p) for p in profiles]
        self.output_like = dict(output_like or {})
        self.contexts, self.calls = [], []

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    def _get(self, name):
        return next(e for e in self.io if e[0] == name)

    def get_tensor_name(self, index):
        return self.io[index][0]

    def get_tensor_dtype(self, name):
        return DataType(self._get(name)[1])

    def get_tensor_shape(self, name):
        return self._get(name)[2]

    def get_tensor_mode(self, name):
        return self._get(name)[4]

    def get_tensor_profile_shape(self, name, profile_index):
        assert 0 <= profile_index < len(self.profiles), profile_index
        return [tuple(s) for s in self.profiles[profile_index][name]]

    def create_execution_context(self):
        ctx = IExecutionContext(self)
        self.contexts.append(ctx)
        return ctx

    def create_engine_inspector(self):
        return EngineInspector(self)

    def serialize(self):
        return IHostMemory(self._serialized)


#: the fake's helper classes and the real class each stands for (tests/test_fake_tensorrt.py
#: compares their members with the real bindings')
PLAYS = {RefittableEngine: "ICudaEngine", Plugin: "IPluginV3", PluginCore: "IPluginV3OneCore"}


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = (int(p) for p in version.split(".")[:2])
    return major, minor


def _dlopen(path):
    """``dlopen(path, RTLD_GLOBAL)``: what TensorRT does with a plugin library."""
    import ctypes

    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def make_fake_trt(version: str = "10.14.1", *, fallback: bool = False, registered: bool = True,
                  build_ok: bool = True, parse=None, parse_errors: Sequence = (),
                  dlopen: bool = False):
    """A fake ``tensorrt`` module of ``version`` and the state it records.

    ``parse(network, path)`` fills the network when the parser reads a file (see
    tests/_tiny_model.py); ``fallback`` makes it inline the function bodies instead of plugin
    layers; ``registered=False`` leaves the QKNormRoPE creator out of the registry;
    ``build_ok=False`` makes ``build_serialized_network`` return None; ``parse_errors``
    (:class:`ParserError` or ``(desc, node_name, node_operator)``) makes ``parse_from_file``
    fail with them. ``state.engines`` maps serialised bytes to the engine ``Runtime`` returns;
    ``state.host_code`` maps serialised bytes to the library they carry (dlopened on
    deserialisation, only where ``engine_host_code_allowed``). ``dlopen=True``: the registry's
    ``load_library`` really dlopens the file.
    """
    major, minor = _version_tuple(version)
    state = types.SimpleNamespace(flags=None, parser_flags=[], profile={}, profiles=[],
                                  config=None, engines={}, timing_cache_data=None,
                                  loaded=[], progress_calls=0, fallback=fallback, host_code={})
    errors = [e if isinstance(e, ParserError) else ParserError(*e) for e in parse_errors]

    class Registry:
        def get_creator(self, type, version, plugin_namespace=""):
            key = (type, version, plugin_namespace)
            ok = registered and key == (contract.PLUGIN_NAME, contract.PLUGIN_VERSION,
                                        contract.PLUGIN_NAMESPACE)
            return object() if ok else None

        def load_library(self, plugin_path):
            state.loaded.append(("registry", plugin_path))
            if dlopen:
                try:
                    return _dlopen(plugin_path)
                except OSError:
                    return None
            return object()

    registry = Registry()

    class Logger:
        WARNING, VERBOSE = "W", "V"

        def __init__(self, min_severity="W"):
            self.min_severity = min_severity

    class OnnxParser:
        """``parse_from_file(model)``: True, or False with the errors of ``parse_errors``
        (``num_errors``, ``get_error(index)``, ``clear_errors()``)."""

        def __init__(self, network, logger):
            self.network, self._errors = network, []

        @property
        def num_errors(self):
            return len(self._errors)

        def get_error(self, index):
            return self._errors[index]

        def clear_errors(self):
            self._errors = []

        def set_flag(self, flag):
            state.parser_flags.append(flag)

        def parse_from_file(self, model):
            if errors:
                self._errors = list(errors)
                return False
            if parse is not None:
                parse(self.network, model, state)
            return True

    class Profile:
        """IOptimizationProfile: set_shape(name, min, opt, max)."""

        def __init__(self):
            self.shapes = {}

        def set_shape(self, input, min, opt, max):
            self.shapes[input] = (tuple(min), tuple(opt), tuple(max))

    class TimingCache:
        """A timing cache: binary, as TensorRT's (its bytes: a header, then what it was created
        from)."""

        def __init__(self, data):
            self.data = data

        def serialize(self):
            return IHostMemory(b"\x00\x01fake-timing-cache\x00" + bytes(self.data))

    class BuilderConfig:
        def __init__(self):
            state.config = self
            self.flags, self.pools = [], {}
            self.builder_optimization_level = None
            self.plugins_to_serialize = []
            self.progress_monitor = None
            self.profiling_verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY  # TensorRT's default
            self.cache = None

        def add_optimization_profile(self, profile):
            """Returns the profile's index (the real API: an int, -1 on failure)."""
            self.profile = profile
            state.profiles.append(dict(profile.shapes))
            if len(state.profiles) == 1:
                state.profile.update(profile.shapes)
            return len(state.profiles) - 1

        def set_memory_pool_limit(self, pool, pool_size):
            self.pools[pool] = pool_size

        def set_flag(self, flag):
            self.flags.append(flag)

        def create_timing_cache(self, serialized_timing_cache):
            state.timing_cache_data = bytes(serialized_timing_cache)
            return TimingCache(serialized_timing_cache)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags=0):
            state.flags = flags
            return INetworkDefinition(flags=flags)

        def create_builder_config(self):
            return BuilderConfig()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            state.network_name = network.name  # what the engine's name would be
            mon = config.progress_monitor
            if mon is not None:
                mon.phase_start("Building", None, 2)
                mon.step_complete("Building", 0)
                mon.phase_finish("Building")
                state.progress_calls += 1
            return IHostMemory(plan_bytes(network.name)) if build_ok else None

    class IProgressMonitor:
        def __init__(self):
            pass

    class Runtime:
        """``trt.Runtime(logger)``: ``deserialize_cuda_engine(serialized_engine)`` returns the
        engine registered for those bytes in ``state.engines``, else None (TensorRT's answer to
        bytes it cannot load); ``engine_host_code_allowed``."""

        def __init__(self, logger):
            self.logger, self.engine_host_code_allowed = logger, False

        def deserialize_cuda_engine(self, serialized_engine):
            blob = bytes(serialized_engine)
            if blob in state.host_code:  # a version-compatible engine with its plugin inside
                if not self.engine_host_code_allowed:
                    return None  # TensorRT: "host code is not allowed"
                state.loaded.append(("host_code", state.host_code[blob]))
                _dlopen(state.host_code[blob])
            return state.engines.get(blob)

    # TensorRT 10: EXPLICIT_BATCH 0 (deprecated), STRONGLY_TYPED 1; TensorRT 11: STRONGLY_TYPED
    # is 0 and deprecated (strongly typed is always on).
    creation_flags = (types.SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1) if major < 11
                      else types.SimpleNamespace(STRONGLY_TYPED=0))
    parser_flags = {"NATIVE_INSTANCENORM": 0}
    if (major, minor) >= (10, 15):
        parser_flags["ENABLE_PLUGIN_OVERRIDE"] = "ENABLE_PLUGIN_OVERRIDE"
    trt = types.SimpleNamespace(
        __version__=version, Logger=Logger, Builder=Builder, OnnxParser=OnnxParser,
        init_libnvinfer_plugins=lambda logger, ns: True,
        get_plugin_registry=lambda: registry,
        NetworkDefinitionCreationFlag=creation_flags,
        OnnxParserFlag=types.SimpleNamespace(**parser_flags),
        LayerType=LayerType, PluginCapabilityType=PluginCapabilityType,
        ILayer=ILayer, IPluginV3Layer=IPluginV3Layer, IProgressMonitor=IProgressMonitor,
        IHostMemory=IHostMemory, ICudaEngine=ICudaEngine, IExecutionContext=IExecutionContext,
        Weights=Weights, Refitter=Refitter, TensorIOMode=TensorIOMode,
        DataType=DataType, Runtime=Runtime, EngineInspector=EngineInspector,
        ProfilingVerbosity=ProfilingVerbosity, LayerInformationFormat=LayerInformationFormat,
        ParserError=ParserError, ErrorCode=ErrorCode, IBuilderConfig=BuilderConfig,
        IOptimizationProfile=Profile, ITimingCache=TimingCache, IPluginRegistry=Registry,
        INetworkDefinition=INetworkDefinition, ITensor=ITensor,
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="WS"),
        BuilderFlag=types.SimpleNamespace(VERSION_COMPATIBLE="VC", REFIT="REFIT",
                                          REFIT_IDENTICAL="REFIT_IDENTICAL",
                                          REFIT_INDIVIDUAL="REFIT_INDIVIDUAL"))
    return trt, state


# --------------------------------------------------------------------------------------------
# Fault injection for the writers' tests (not TensorRT): fail the k-th write or rename step
# --------------------------------------------------------------------------------------------

WRITE_STEPS = (("os", "replace"), ("os", "rename"), ("os", "link"), ("os", "fsync"),
               ("os", "chmod"), ("shutil", "copyfile"), ("shutil", "copy2"),
               ("shutil", "copytree"), ("pathlib.Path", "write_text"),
               ("pathlib.Path", "write_bytes"))


class FailAt:
    """Patch every write/rename step (``WRITE_STEPS`` and ``extra``) with ``monkeypatch`` so
    that the k-th call raises ``OSError(ENOSPC)``; ``calls`` counts them, ``fired`` says
    whether it failed, ``names`` lists the steps called."""

    def __init__(self, monkeypatch, k: int, extra: tuple = ()):
        import errno
        import importlib
        import pathlib

        self.k, self.calls, self.fired, self.names = k, 0, False, []
        for owner, name in WRITE_STEPS + tuple(extra):
            target = pathlib.Path if owner == "pathlib.Path" else importlib.import_module(owner)
            real = getattr(target, name)

            def step(*a, _real=real, _name=f"{owner}.{name}", **kw):
                self.calls += 1
                self.names.append(_name)
                if self.calls == self.k:
                    self.fired = True
                    raise OSError(errno.ENOSPC, f"No space left on device (injected at "
                                                f"{_name})")
                return _real(*a, **kw)

            monkeypatch.setattr(target, name, step)


def fail_each_write_step(monkeypatch, run, *, reset=lambda: None, after=lambda k: None,
                         extra: tuple = ()) -> list[str]:
    """For k = 1, 2, ...: ``reset()``, then ``run()`` with its k-th write/rename step failing
    (:class:`FailAt`), then ``after(k)`` (the caller's check of what is on disk, with the real
    steps back), until a run completes without reaching step k. A failure must reach the caller
    as a one-line QkropeError naming the full disk, never a raw OSError. Returns the names of
    the steps the complete run called (the failures injected, in order)."""
    from qkrope.errors import QkropeError

    k = 1
    while True:
        reset()
        with monkeypatch.context() as m:
            fail = FailAt(m, k, extra)
            try:
                run()
            except QkropeError as exc:
                assert "No space left" in str(exc) and "\n" not in str(exc), (k, str(exc))
            except OSError as exc:
                raise AssertionError(f"step {k}: a raw {type(exc).__name__}: {exc}") from exc
        after(k)
        if not fail.fired:
            return fail.names
        k += 1



# --------------------------------------------------------------------------------------------
# Engine inspector (FP8 builds): trt.Runtime(logger).deserialize_cuda_engine(blob)
#   .create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
# --------------------------------------------------------------------------------------------

class IEngineInspector:
    """``get_engine_information(format)``: a JSON string ``{"Layers": [...], "Bindings": [...]}``
    whose layers are dicts (Name, LayerType, Inputs/Outputs with "Format/Datatype", TacticName)
    when the engine was built with ``ProfilingVerbosity.DETAILED`` and bare names otherwise, as
    TensorRT's inspector reports them."""

    def __init__(self, layers: list, detailed: bool):
        self._layers, self._detailed = layers, detailed

    def get_engine_information(self, format):
        import json

        if format != "JSON":
            raise TypeError(f"fake inspector: only LayerInformationFormat.JSON, got {format!r}")
        layers = self._layers if self._detailed else [layer["Name"] for layer in self._layers]
        return json.dumps({"Layers": layers, "Bindings": []})


def inspector_layer(name: str, layer_type: str, datatype: str = "FP32", tactic: str = "") -> dict:
    """One layer as the DETAILED inspector JSON lists it."""
    fmt = f"Row major linear {datatype}"
    return {"Name": name, "LayerType": layer_type,
            "Inputs": [{"Name": f"{name}_in", "Format/Datatype": fmt}],
            "Outputs": [{"Name": f"{name}_out", "Format/Datatype": fmt}],
            "TacticName": tactic}


def add_engine_inspector(trt, state, *, fp8_layers: int = 1, deserialize_ok: bool = True):
    """Give a fake of :func:`make_fake_trt` ``Runtime``, ``LayerInformationFormat`` and
    ``ProfilingVerbosity``. The deserialised engine's inspector lists the parsed network's
    layers (plugin layers as ``PluginV3``) and ``fp8_layers`` GEMM layers in FP8; whether the
    layers are detailed follows ``state.config.profiling_verbosity``."""
    if not hasattr(trt, "ProfilingVerbosity"):
        trt.ProfilingVerbosity = types.SimpleNamespace(DETAILED="DETAILED",
                                                       LAYER_NAMES_ONLY="LAYER_NAMES_ONLY",
                                                       NONE="NONE")
    trt.LayerInformationFormat = types.SimpleNamespace(JSON="JSON", ONELINE="ONELINE")

    class _Engine:
        def create_engine_inspector(self):
            net = getattr(state, "network", None)
            layers = [inspector_layer(name, "PluginV3" if kind == LayerType.PLUGIN_V3
                                      else str(kind).title())
                      for kind, name, _plugin in (net.layers if net else [])]
            layers += [inspector_layer(f"gemm_{i}", "gemm", "FP8", "sm90_xmma_gemm_e4m3")
                       for i in range(fp8_layers)]
            detailed = getattr(state.config, "profiling_verbosity", None) == "DETAILED"
            return IEngineInspector(layers, detailed)

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, blob):
            state.deserialized = bytes(blob)
            return _Engine() if deserialize_ok else None

    trt.Runtime = Runtime
    return trt
