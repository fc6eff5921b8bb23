"""A runner whose model runs on a Triton Inference Server: :class:`TritonRunner`, and the
diffusers drop-in over it, :func:`triton_transformer`.

    pipe.transformer = qkrope.runtime.triton_transformer(url="gpu-box:8001", model="flux")

Every transformer call of the pipeline becomes one inference request (gRPC, or HTTP/REST with
Triton's binary tensor extension) to the model ``qkrope triton-repo`` wrote: the pipeline, its
text encoders and VAE stay where they are. A call is checked before anything is sent, exactly
as for a local model (:class:`qkrope.runtime.runner.Runner`: the RoPE caches, every input's
dtype, rank and dimensions), against the I/O record the repository keeps in the model's
``config.pbtxt`` (:mod:`qkrope.runtime.triton_io`; ``sidecar=`` the exported model for a
repository without one).

What is sent: the model step of the repository, the one that takes the RoPE caches. Given the
ensemble's name (``<name>``), the runner calls its step ``<name>_onnx`` / ``<name>_trt``; the
caches are built in the pipeline's process, memoised per shape, as for a local model (the
ensemble's server-side rope model computes the same bits: tests/test_triton_server.py).

Tensors go as raw little-endian bytes, bfloat16 included (two bytes per value, no conversion:
numpy has no bfloat16), and come back on the device of the inputs. Every answer is checked
before the pipeline (its scheduler) sees it: each output present, of the model's dtype, of the
shape the call's inputs give (batch and layout), its byte count whole (a cut-off body, or a
proxy's HTML page in place of an answer, is refused), and every value finite. Given
``sidecar=`` (the export the client expects), the client confirms once at connect that the
server serves that export: the identity ``qkrope triton-repo`` recorded in the served config
(``qkrope_export_identity``, :func:`~qkrope.runtime.triton_io.export_identity`) is that
export's. A request the server
refuses, a model it does not have, a server it cannot reach: one :class:`RunnerError` line
naming the server, the model and the fix. Calls from several threads are fine (one gRPC channel;
one HTTP connection per thread).

gRPC needs ``grpcio`` and ``tritonclient[grpc]`` (its protobuf messages); HTTP needs nothing
beyond the standard library.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from qkrope import dtypes
from qkrope._deps import require
from qkrope.errors import QkropeError

from .caches import checked_device
from .runner import Runner, RunnerError, RunnerInputError
from .triton_io import (IDENTITY_PARAMETER, IO_PARAMETER, ServedModelError, check_served_io,
                        export_identity, model_io_of)

PROTOCOLS = ("grpc", "http")
#: the protocol of a model calling its own server's models (a Python-backend model; ``url``: the
#: server's model repository folder)
IN_SERVER = "bls"
#: seconds a request may take before it is abandoned (a FLUX.1-dev step at 1024x1024 on one
#: GPU is about a second; the default leaves room for a queue)
DEFAULT_TIMEOUT_S = 300.0
#: KServe v2 tensor datatypes (Triton's TYPE_* without the prefix) by qkrope dtype name
WIRE_DTYPE = {name: t[len("TYPE_"):] for name, t in dtypes.TRITON_BY_NAME.items()}
NAME_BY_WIRE = {v: k for k, v in WIRE_DTYPE.items()}
CACHE_ROLES = ("img_cache", "txt_cache")


class _ServerError(QkropeError):
    """What a transport got back instead of an answer: ``kind`` (``unreachable``,
    ``not_found``, ``refused``, ``failed``) and the server's message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def one_line(text: str, limit: int = 400) -> str:
    """A server's message on one line (newlines and runs of spaces folded), at most ``limit``
    characters."""
    text = re.sub(r"\s+", " ", str(text)).strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Tensors <-> bytes on the wire
# --------------------------------------------------------------------------------------------

def to_wire(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """``(datatype, shape, raw bytes)`` of a tensor: its memory as is, bfloat16 as its two bytes
    per value (read through an int16 view; nothing is rounded)."""
    name = dtypes.canonical(t.dtype, source="torch")
    if name not in WIRE_DTYPE:
        raise RunnerInputError(f"a {name} tensor has no Triton datatype. Fix: cast it to the "
                               f"model's dtype")
    host = t.detach().to("cpu").contiguous()
    raw = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
    return WIRE_DTYPE[name], [int(d) for d in t.shape], raw.numpy().tobytes()


def from_wire(data: bytes, datatype: str, shape: Sequence[int], *, name: str,
              device: torch.device) -> torch.Tensor:
    """The tensor of raw bytes (:func:`to_wire`'s inverse), on ``device``."""
    if datatype not in NAME_BY_WIRE:
        raise RunnerError(f"the server returned {name} as {datatype}, which qkrope does not read")
    dtype = dtypes.torch_dtype(NAME_BY_WIRE[datatype])
    shape = [int(d) for d in shape]
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != count * itemsize:
        raise RunnerError(f"the server returned {len(data)} bytes for {name} {datatype} {shape} "
                          f"({count * itemsize} expected)")
    if count == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return t.to(device) if device.type != "cpu" else t


# --------------------------------------------------------------------------------------------
# Transports: a model's config, one inference (raw tensors), the repository's models
# --------------------------------------------------------------------------------------------

class _Grpc:
    """KServe v2 over gRPC, with tritonclient's generated stubs (raw input/output contents)."""

    def __init__(self, url: str, timeout_s: float, headers: Mapping[str, str]):
        self.grpc = require("grpc", "qkrope's Triton client over gRPC (protocol='grpc')")
        tc = require("tritonclient.grpc", "qkrope's Triton client over gRPC (protocol='grpc'; "
                     "or protocol='http', which needs no package)")
        self.pb, self.timeout = tc.service_pb2, timeout_s
        self.metadata = tuple((k.lower(), str(v)) for k, v in headers.items())
        self.channel = self.grpc.insecure_channel(url, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        self.stub = tc.service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout,
                                              metadata=self.metadata or None)
        except self.grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            sc = self.grpc.StatusCode
            kind = {sc.UNAVAILABLE: "unreachable", sc.DEADLINE_EXCEEDED: "unreachable",
                    sc.NOT_FOUND: "not_found", sc.INVALID_ARGUMENT: "refused"}.get(code, "failed")
            if kind == "failed" and details and "unknown model" in details.lower():
                kind = "not_found"
            raise _ServerError(kind, f"{getattr(code, 'name', code)}: {details}") from None

    def config(self, model: str, version: str) -> dict:
        from google.protobuf import json_format

        res = self._call("ModelConfig", self.pb.ModelConfigRequest(name=model, version=version))
        return json_format.MessageToDict(res.config, preserving_proto_field_name=True)

    def models(self) -> list[str]:
        res = self._call("RepositoryIndex", self.pb.RepositoryIndexRequest(ready=True))
        return [m.name for m in res.models]

    def infer(self, model: str, version: str, inputs, outputs: Sequence[str]) -> dict:
        req = self.pb.ModelInferRequest(model_name=model, model_version=version)
        for name, datatype, shape, data in inputs:
            req.inputs.add(name=name, datatype=datatype, shape=shape)
            req.raw_input_contents.append(data)
        for name in outputs:
            req.outputs.add(name=name)
        res = self._call("ModelInfer", req)
        if len(res.raw_output_contents) != len(res.outputs):
            raise _ServerError("answer", f"an answer of {len(res.outputs)} outputs with "
                                         f"{len(res.raw_output_contents)} raw contents (cut "
                                         f"short, or its tensors sent as typed values)")
        return {o.name: (o.datatype, list(o.shape), res.raw_output_contents[i])
                for i, o in enumerate(res.outputs)}

    def close(self) -> None:
        self.channel.close()


class _Http:
    """KServe v2 over HTTP/REST with Triton's binary tensor extension (the standard library's
    ``http.client``; one keep-alive connection per thread)."""

    def __init__(self, url: str, timeout_s: float, headers: Mapping[str, str]):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RunnerError(f"url {url!r} is not host:port or http(s)://host:port. Fix: "
                              f"pass e.g. 'localhost:8000'")
        self.https, self.host = parts.scheme == "https", parts.hostname
        self.port = parts.port or (443 if self.https else 8000)
        self.prefix = parts.path.rstrip("/")
        self.timeout, self.headers = timeout_s, dict(headers)
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self._local.conn = cls(self.host, self.port, timeout=self.timeout)
        return conn

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[int, Any, bytes]:
        all_headers = {**self.headers, **(headers or {})}
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more, anew
            conn = self._connection()
            try:
                conn.request(method, self.prefix + path, body=body, headers=all_headers)
                res = conn.getresponse()
                return res.status, res.headers, res.read()
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError) as exc:
                conn.close()
                self._local.conn = None
                if attempt:
                    raise _ServerError("unreachable", f"{type(exc).__name__}: {exc}") from None
            except http.client.IncompleteRead as exc:  # the body ends before its length
                conn.close()
                self._local.conn = None
                raise _ServerError("answer", f"the answer was cut short ({len(exc.partial)} "
                                             f"bytes of its body read, {exc.expected} more "
                                             f"announced)") from None
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, ...
                conn.close()
                self._local.conn = None
                raise _ServerError("unreachable", f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    @staticmethod
    def _error(status: int, data: bytes) -> _ServerError:
        try:
            message = json.loads(data or b"{}").get("error", "")
        except (ValueError, AttributeError):
            message = data[:200].decode("utf-8", "replace")
        kind = ("not_found" if status == 404 or "unknown model" in message.lower()
                else "refused" if status == 400 else "failed")
        return _ServerError(kind, f"HTTP {status}: {message}")

    @staticmethod
    def _json(data: bytes, headers, what: str):
        """``data`` as the JSON of a KServe answer, else an ``answer`` _ServerError saying what
        came back instead (a proxy's HTML page, a cut-off body) in a few words."""
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            pass
        kind = (headers.get("Content-Type") if headers is not None else None) or "no content type"
        head = data[:120].decode("utf-8", "replace")
        looks = ("an HTML page" if re.search(r"<\s*(!doctype|html|head|body)", head, re.I)
                 else "text that is not JSON" if data else "an empty body")
        raise _ServerError("answer", f"{what} came back as {looks} ({kind}, {len(data)} bytes: "
                                     f"{one_line(head, 80)!r}), not a KServe v2 answer")

    def _model_path(self, model: str, version: str) -> str:
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}"
        return path + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")

    def config(self, model: str, version: str) -> dict:
        status, headers, data = self._request("GET",
                                              self._model_path(model, version) + "/config")
        if status != 200:
            raise self._error(status, data)
        cfg = self._json(data, headers, "the model's config")
        if not isinstance(cfg, dict):
            raise _ServerError("answer", f"the model's config came back as a JSON "
                                         f"{type(cfg).__name__}, not a model config")
        return cfg

    def models(self) -> list[str]:
        status, headers, data = self._request("POST", "/v2/repository/index", b'{"ready": true}')
        if status != 200:
            raise self._error(status, data)
        index = self._json(data, headers, "the repository index")
        try:
            return [m["name"] for m in index]
        except (TypeError, KeyError):
            raise _ServerError("answer", "the repository index is not a list of models") from None

    def infer(self, model: str, version: str, inputs, outputs: Sequence[str]) -> dict:
        header = {"inputs": [{"name": n, "datatype": dt, "shape": shape,
                              "parameters": {"binary_data_size": len(data)}}
                             for n, dt, shape, data in inputs],
                  "outputs": [{"name": n, "parameters": {"binary_data": True}}
                              for n in outputs]}
        head = json.dumps(header).encode()
        body = b"".join([head, *(data for *_, data in inputs)])
        status, headers, data = self._request(
            "POST", self._model_path(model, version) + "/infer", body,
            {"Inference-Header-Content-Length": str(len(head)),
             "Content-Type": "application/octet-stream"})
        if status != 200:
            raise self._error(status, data)
        return self._answer(headers, data)

    def _answer(self, headers, data: bytes) -> dict:
        """The outputs of an inference answer (JSON header, then each output's raw bytes),
        every part checked: the header's length, its form, and that the bytes it announces are
        all there, nothing more (a cut-off or padded body is refused, never read short)."""
        length = headers.get("Inference-Header-Content-Length")
        try:
            n = int(length) if length is not None else len(data)
        except ValueError:
            raise _ServerError("answer", f"the answer's Inference-Header-Content-Length is "
                                         f"{one_line(length, 40)!r}, not a length") from None
        if not 0 < n <= len(data):
            raise _ServerError("answer", f"the answer announces a {n}-byte header but its body "
                                         f"has {len(data)} bytes (cut short)")
        meta = self._json(data[:n], headers, "the inference answer")
        outputs = meta.get("outputs") if isinstance(meta, dict) else None
        if not isinstance(outputs, list):
            raise _ServerError("answer", "the inference answer has no list of outputs")
        offset, out = n, {}
        for o in outputs:
            try:
                name, datatype, shape = str(o["name"]), str(o["datatype"]), list(o["shape"])
                size = int((o.get("parameters") or {}).get("binary_data_size", -1))
            except (TypeError, KeyError, ValueError, AttributeError):
                raise _ServerError("answer", f"an output of the answer is not a KServe tensor "
                                             f"({one_line(o, 80)})") from None
            if size < 0:
                raise _ServerError("answer", f"the server returned {name} as JSON data, not "
                                             f"binary")
            if offset + size > len(data):
                raise _ServerError("answer", f"output {name} announces {size} bytes but the body "
                                             f"holds {len(data) - offset} after the header (cut "
                                             f"short)")
            out[name] = (datatype, shape, data[offset:offset + size])
            offset += size
        if offset != len(data):
            raise _ServerError("answer", f"the answer's body has {len(data) - offset} bytes "
                                         f"beyond the outputs it announces")
        return out

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class _Bls:
    """Business-logic scripting: requests from a Python-backend model to the other models of
    its own server (``triton_python_backend_utils.InferenceRequest``), for the pipeline model
    of ``qkrope triton-repo --pipeline``. ``url`` is the model repository the server loaded:
    a model's config is read from its ``config.pbtxt`` there (BLS has no config query).
    Tensors cross as DLPack (bfloat16 included), bytes in and out as the other transports'."""

    def __init__(self, url: str, timeout_s: float, headers: Mapping[str, str]):
        self.pb = require("triton_python_backend_utils", "BLS calls (protocol='bls': from a "
                          "Python-backend model of the server itself)")
        self.repo, self.timeout_us = Path(url), int(timeout_s * 1e6)

    def config(self, model: str, version: str) -> dict:
        from google.protobuf import json_format

        from .triton import parse_config

        path = self.repo / model / "config.pbtxt"
        # a model is a folder of the repository: a name is never a path to follow elsewhere
        if Path(model).name != model or model in ("", ".", "..") or not path.is_file():
            raise _ServerError("not_found", f"no model {model!r} in the repository {self.repo}")
        cfg = parse_config(path.read_text(encoding="utf-8"))
        return json_format.MessageToDict(cfg, preserving_proto_field_name=True)

    def models(self) -> list[str]:
        return sorted(p.parent.name for p in self.repo.glob("*/config.pbtxt"))

    def infer(self, model: str, version: str, inputs, outputs: Sequence[str]) -> dict:
        from torch.utils import dlpack

        pb = self.pb
        tensors = [pb.Tensor.from_dlpack(name, dlpack.to_dlpack(
            from_wire(data, datatype, shape, name=name, device=torch.device("cpu"))))
            for name, datatype, shape, data in inputs]
        request = pb.InferenceRequest(model_name=model, requested_output_names=list(outputs),
                                      inputs=tensors, model_version=int(version or -1),
                                      timeout=self.timeout_us)
        answer = request.exec()
        if answer.has_error():
            message = answer.error().message()
            lower = message.lower()
            kind = ("not_found" if "unknown model" in lower or "not found" in lower else
                    "refused" if "invalid" in lower or "unexpected" in lower else "failed")
            raise _ServerError(kind, message)
        got = {}
        for name in outputs:
            t = pb.get_output_tensor_by_name(answer, name)
            if t is not None:
                got[name] = to_wire(torch.from_dlpack(t.to_dlpack()))
        return got

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------

def _fix(kind: str, protocol: str) -> str:
    port = "8001" if protocol == "grpc" else "8000"
    return {"unreachable": f"start the server, or check the url and protocol (Triton's "
                           f"default {protocol} port is {port})",
            "not_found": "name a model the server has loaded (its repository index lists "
                         "them)",
            "refused": "the server's reason above says which input; send what the model "
                       "takes",
            "answer": "point url at the Triton server itself (not a proxy or web page in "
                      "front of it), or check the server's log",
            }.get(kind, "see the server's log")


class TritonRunner(Runner):
    """The model step of a Triton repository written by ``qkrope triton-repo``, behind the
    runner interface (module docstring). ``url``: ``host:port`` (``http(s)://`` too for HTTP);
    ``model``: the repository's model (the ensemble's name or its model step);
    ``protocol``: ``"grpc"`` or ``"http"`` (``"bls"`` from a Python-backend model of the
    server itself, ``url`` then the server's model repository folder: :class:`_Bls`); ``model_version``: "" for the server's policy;
    ``sidecar``: the exported model (``.onnx`` or ``.engine``, or its ``.json``) the server
    should serve: its identity is compared with the one the served config records, once at
    connect (and its I/O is used, for a served config without the I/O record); ``device``: where outputs go when the inputs are on no
    device yet (outputs follow the inputs' device); ``headers``: sent with every request
    (e.g. an ``Authorization`` for a gateway); ``timeout_s``: per request."""

    backend = "triton"

    def __init__(self, url: str, model: str, *, protocol: str = "grpc",
                 model_version: str = "", sidecar: str | None = None,
                 device: torch.device | str | None = None,
                 headers: Mapping[str, str] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, copy_outputs: bool = False):
        if protocol not in (*PROTOCOLS, IN_SERVER):
            raise RunnerError(f"protocol must be one of {list(PROTOCOLS)} (or {IN_SERVER!r} "
                              f"inside the server); got {protocol!r}")
        if not isinstance(url, str) or not url.strip():
            raise RunnerError(f"url must be the server's host:port (e.g. 'localhost:8001'); got "
                              f"{url!r}")
        if not isinstance(model, str) or not model:
            raise RunnerError(f"model must be the name of a served model; got {model!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise RunnerError(f"timeout_s must be a positive number of seconds; got "
                              f"{timeout_s!r}")
        self.url, self.protocol = url.strip(), protocol
        self.model_version = str(model_version or "")
        grpc_url = re.sub(r"^grpcs?://", "", self.url)
        transport = {"grpc": lambda: _Grpc(grpc_url, float(timeout_s), dict(headers or {})),
                     "http": lambda: _Http(self.url, float(timeout_s), dict(headers or {})),
                     IN_SERVER: lambda: _Bls(self.url, float(timeout_s), {})}[protocol]
        self._transport = transport()
        self.requested_model = model
        self.model, cfg = self._resolve(model)
        source = f"Triton {protocol}://{self.url}/{self.model}"
        io, given = self._io(cfg, sidecar, source)
        try:
            served_in = [str(t["name"]) for t in cfg.get("input", [])]
            served_out = [str(t["name"]) for t in cfg.get("output", [])]
        except (TypeError, KeyError, AttributeError):
            raise RunnerError(f"{self._where(self.model)}: its config lists inputs or outputs "
                              f"without names; not a Triton model config. Fix: "
                              f"{_fix('answer', self.protocol)}") from None
        try:
            check_served_io(io, served_in, served_out, source=source)
        except ServedModelError as exc:
            raise RunnerError(str(exc)) from None
        #: the identity of the export the server serves (its config's, written by triton-repo)
        self.served_export = _parameter(cfg, IDENTITY_PARAMETER)
        if sidecar is not None:
            self._check_identity(sidecar, given)
        super().__init__(io, copy_outputs=copy_outputs)
        self.device = checked_device(device)

    # ---------------------------------------------------------------------------- set-up
    def _where(self, model: str | None = None) -> str:
        return f"Triton at {self.url} ({self.protocol}), model {model or self.requested_model!r}"

    def _server(self, what, model: str | None = None):
        try:
            return what()
        except _ServerError as exc:
            extra = ""
            if exc.kind == "not_found":
                try:
                    names = sorted(self._transport.models())
                    extra = (f" (ready: {', '.join(names[:12])}"
                             f"{' ...' if len(names) > 12 else ''})")
                except _ServerError:
                    pass
            raise RunnerError(f"{self._where(model)}: {one_line(exc.message)}{extra}. Fix: "
                              f"{_fix(exc.kind, self.protocol)}") from None

    def _config(self, model: str) -> dict:
        return self._server(lambda: self._transport.config(model, self.model_version), model)

    def _resolve(self, model: str) -> tuple[str, dict]:
        """The model to call and its config: ``model``, or the step of the ensemble ``model``
        that takes the RoPE caches (the one with the I/O record)."""
        cfg = self._config(model)
        if cfg.get("platform") != "ensemble":
            return model, cfg
        steps = [s.get("model_name") for s in cfg.get("ensemble_scheduling", {}).get("step", [])]
        self.model_version = ""  # the ensemble calls its steps' latest version (-1): so do we
        for step in steps:
            step_cfg = self._config(step)
            if IO_PARAMETER in step_cfg.get("parameters", {}):
                return step, step_cfg
        raise RunnerError(f"{self._where()}: an ensemble of {steps} none of which has a qkrope "
                          f"I/O record ({IO_PARAMETER}). Fix: name its model step (the one "
                          f"taking the RoPE caches) and pass sidecar= (the exported model)")

    def _check_identity(self, sidecar, given: str | None) -> None:
        """Once, at connect: the server serves the export this client was given (``sidecar=``):
        the identity triton-repo recorded in the served config is that export's."""
        served = self.served_export
        if served is None:
            raise RunnerError(f"{self._where(self.model)}: its config records no export "
                              f"identity ({IDENTITY_PARAMETER}), so it cannot be confirmed to "
                              f"serve {sidecar}. Fix: rewrite the repository with this "
                              f"qkrope's `qkrope triton-repo ... --force`, or leave out sidecar= "
                              f"to take the served config's own record")
        if given is None:
            raise RunnerError(f"{self._where(self.model)}: {sidecar} records no content hashes "
                              f"of its files, so the served export cannot be compared with it. "
                              f"Fix: pass the sidecar `qkrope export` / `qkrope build` wrote "
                              f"(M.onnx.json / M.engine.json)")
        if served != given:
            raise RunnerError(f"{self._where(self.model)} serves another export than {sidecar} "
                              f"(served identity {served[:12]}..., this export's "
                              f"{given[:12]}...). Fix: serve this export (`qkrope triton-repo` "
                              f"it and restart or reload the model), or pass the sidecar of the "
                              f"export the server serves")

    def _io(self, cfg: dict, sidecar, source: str):
        """The served model's I/O (from ``sidecar`` when given, else the config's record) and
        the identity of the export given (None without ``sidecar``)."""
        record = _parameter(cfg, IO_PARAMETER)
        try:
            if sidecar is not None:
                return _sidecar_io(sidecar, source)
            if record:
                return model_io_of(record, source=source), None
        except ServedModelError as exc:
            raise RunnerError(str(exc)) from None
        raise RunnerError(f"{self._where()}: its config has no qkrope I/O record "
                          f"({IO_PARAMETER}: repositories written by `qkrope triton-repo` "
                          f"carry it). Fix: rewrite the repository with `qkrope triton-repo`, "
                          f"or pass sidecar= (the .onnx or .engine it serves)")

    # ---------------------------------------------------------------------------- calls
    def _check_device(self, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise RunnerInputError(f"the inputs are on {device}; this runner takes cpu or cuda "
                                   f"tensors. Fix: move them with .to('cpu') or .to('cuda')")

    def _execute(self, feeds, axes, device):
        inputs = [(name, *to_wire(t)) for name, t in feeds.items()]
        names = [s.name for s in self.io.outputs]
        got = self._server(lambda: self._transport.infer(self.model, self.model_version, inputs,
                                                         names), self.model)
        return [self._checked_output(spec, got, axes, device) for spec in self.io.outputs]

    def _checked_output(self, spec, got: dict, axes: Mapping[str, int],
                        device: torch.device) -> torch.Tensor:
        """One output of an answer, checked before a scheduler sees it: present, of the
        model's dtype, of the shape this call's inputs give (batch and layout: each static
        dimension, each named axis the inputs fixed, the rest within the model's range), its
        byte count, and every value finite. Each refusal is one RunnerError line naming the
        server, the model and what came back."""
        where = self._where(self.model)
        if spec.name not in got:
            raise RunnerError(f"{where}: the answer has no output {spec.name!r} (it has "
                              f"{sorted(got)[:8]}). Fix: {_fix('answer', self.protocol)}")
        datatype, shape, data = got[spec.name]
        try:
            shape = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise RunnerError(f"{where}: output {spec.name} came back with shape "
                              f"{one_line(shape, 60)}, not a list of sizes") from None
        want = [lo if lo == hi else axes.get(ax) if ax is not None else None
                for (lo, hi), ax in zip(spec.dims, spec.axes)]
        fits = len(shape) == spec.rank and all(
            (n == w) if w is not None else (n >= lo and (hi is None or n <= hi))
            for n, w, (lo, hi) in zip(shape, want, spec.dims))
        if NAME_BY_WIRE.get(datatype) != spec.dtype or not fits:
            expected = "[" + ", ".join(str(w) if w is not None else (ax or "?") for w, ax in
                                       zip(want, spec.axes)) + "]"
            raise RunnerError(f"{where}: output {spec.name} came back {one_line(datatype, 20)} "
                              f"{shape}; this call expects {spec.dtype} {expected} (the "
                              f"model's {spec.describe()}, with the inputs' axes). Fix: check "
                              f"that the server serves this export (its log), and that url "
                              f"points at the server itself")
        try:
            t = from_wire(data, datatype, shape, name=spec.name, device=torch.device("cpu"))
        except RunnerError as exc:
            raise RunnerError(f"{where}: {exc} (cut short). Fix: "
                              f"{_fix('answer', self.protocol)}") from None
        if t.is_floating_point() and t.numel():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                first = [int(i) for i in bad.nonzero()[0]]
                raise RunnerError(
                    f"{where}: output {spec.name} {list(t.shape)} came back with "
                    f"{int(bad.sum())} NaN or infinite values (the first at {first}: "
                    f"{float(t[tuple(first)])}); refused before the scheduler steps with it. "
                    f"Fix: check the inputs are finite and the served model (its log; a "
                    f"float16 export can overflow where bfloat16 does not)")
        return t.to(device) if device.type != "cpu" else t

    def close(self) -> None:
        """Close the connection(s) (the runner reconnects on its next call over HTTP)."""
        self._transport.close()

    def __repr__(self) -> str:
        return f"TritonRunner({self.protocol}://{self.url}/{self.model})"


def _parameter(cfg: dict, key: str) -> str | None:
    """A string parameter of a model config (as JSON: ``parameters.<key>.string_value``)."""
    params = cfg.get("parameters")
    value = params.get(key) if isinstance(params, dict) else None
    value = value.get("string_value") if isinstance(value, dict) else None
    return value if isinstance(value, str) and value else None


def _sidecar_io(sidecar, source: str):
    """The ModelIO of the export a server serves and the export's identity
    (:func:`~qkrope.runtime.triton_io.export_identity`), from its sidecar (``.onnx`` /
    ``.engine``, or the ``.json`` itself)."""
    from qkrope.sidecars import EngineInfo, ModelInfo

    from .triton_io import record_of

    p = Path(sidecar)
    name = p.name[:-len(".json")] if p.name.endswith(".json") else p.name
    model = p.with_name(name)
    info = (EngineInfo.load(model) if model.suffix.lower() in (".engine", ".plan")
            else ModelInfo.describe(model))
    return model_io_of(record_of(info), source=source), export_identity(info)


def triton_transformer(url: str, model: str, *, protocol: str = "grpc", model_version: str = "",
                       sidecar: str | None = None, device: torch.device | str | None = None,
                       headers: Mapping[str, str] | None = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S):
    """A drop-in for ``pipe.transformer`` whose every call runs on a Triton server (the
    family's drop-in of :func:`qkrope.runtime.load_transformer`, by the served model's
    family, over a :class:`TritonRunner`; the arguments are its)."""
    from .transformer import transformer_for_runner

    if device is not None:
        device = checked_device(device)
    runner = TritonRunner(url, model, protocol=protocol, model_version=model_version,
                          sidecar=sidecar, device=device, headers=headers, timeout_s=timeout_s)
    return transformer_for_runner(runner, device=device)


__all__ = ["DEFAULT_TIMEOUT_S", "PROTOCOLS", "TritonRunner", "from_wire", "one_line",
           "to_wire", "triton_transformer"]
