#!/usr/bin/env python3
"""Load test of a Triton server serving a ``qkrope triton-repo`` repository: N concurrent gRPC
clients send a fixed number of requests in all; reports throughput, p50/p99 latency and errors.

By default it builds what it serves, as tests/test_triton_server.py does: the tiny exported
transformer, ``triton-repo --backend onnxruntime``, the Python-backend stand-in for the
onnxruntime backend (the nvidia-pytriton server has none), and a server from
scripts/triton_server.py on loopback ports. ``--url HOST:PORT`` targets a running server instead
(then ``--model`` must name a model there whose inputs this script builds: the ensemble or the
rope model of a transformer repository).

Usage:
  python scripts/triton_load.py --clients 4 --requests 400 [--model tiny|tiny_rope]
      [--img-shape 1,8,8] [--txt-len 16] [--batch 2] [--instances 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from qkrope import model_io

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton_server  # noqa: E402


def _inputs(model: str, shape, txt_len: int, batch: int, config: dict, seed: int = 0):
    """The request for the ensemble (``tiny``) or the rope model (``*_rope``)."""
    rng = np.random.default_rng(seed)
    tokens = shape[0] * shape[1] * shape[2]
    channels = config["in_channels"]
    out = {model_io.HIDDEN_STATES.name: rng.standard_normal((batch, tokens, channels),
                                                            np.float32),
           model_io.ENCODER_HIDDEN_STATES_MASK.name: np.ones((batch, txt_len), bool),
           "img_shapes": np.asarray([shape], np.int64)}
    if not model.endswith("_rope"):
        out[model_io.ENCODER_HIDDEN_STATES.name] = rng.standard_normal(
            (batch, txt_len, config["joint_attention_dim"]), np.float32)
        out[model_io.TIMESTEP.name] = np.full((batch,), 0.5, np.float32)
    return out


DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL"}


def run_load(url: str, model: str, arrays: dict, outputs: list[str], *, clients: int,
             requests: int) -> dict:
    """``requests`` requests in all over ``clients`` threads, each with its own gRPC client."""
    import tritonclient.grpc as grpcclient

    per = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[list[str]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        inputs = []
        for name, value in arrays.items():
            t = grpcclient.InferInput(name, list(value.shape), DTYPES[value.dtype])
            t.set_data_from_numpy(value)
            inputs.append(t)
        outs = [grpcclient.InferRequestedOutput(n) for n in outputs]
        try:
            client.infer(model, inputs, outputs=outs)  # connection set up outside the timing
        except Exception:  # noqa: BLE001 - the timed requests count the errors
            pass
        finally:
            start.wait(timeout=300)
        for _ in range(per[i]):
            t0 = time.perf_counter()
            try:
                client.infer(model, inputs, outputs=outs)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors[i].append(str(exc).splitlines()[0])
            latencies[i].append(time.perf_counter() - t0)
        client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait(timeout=300)  # every worker connected (a broken barrier raises, never hangs)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.array([x for xs in latencies for x in xs]) * 1e3
    errs = [e for es in errors for e in es]
    return {"model": model, "clients": clients, "requests": int(lat.size),
            "errors": len(errs), "first_error": errs[0] if errs else None,
            "wall_s": round(wall, 3), "throughput_rps": round(lat.size / wall, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2),
            "max_ms": round(float(lat.max()), 2)}


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.processor()}, {cores} cores, {platform.system()}"


def _build(work: Path, instances: int):
    """The tiny transformer's repository with the stand-in; returns (repo, diffusers config)."""
    import onnxruntime

    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main as cli_main
    from qkrope.runtime import triton

    tp.save_transformer(tp.tiny_transformer(), work / "t")
    onnx = work / "tiny.onnx"
    if cli_main(["export", "--model", "transformer", "--diffusers", str(work / "t"),
                 "--out", str(onnx)]) != 0:
        raise SystemExit("triton_load: the export failed")
    repo = work / "repo"
    triton.write_onnx_repository(onnx, repo, name="tiny",
                                 serving=triton.Serving(instances=instances))
    ort = triton_server.onnxruntime_for_stand_in(onnxruntime.__version__)
    triton_server.use_onnx_stand_in(repo, "tiny_onnx", ort)
    from qkrope.sidecars import ModelInfo

    return repo, ModelInfo.load(onnx).config.diffusers_config


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (threads)")
    ap.add_argument("--requests", type=int, default=400, help="requests in all")
    ap.add_argument("--model", default="tiny", help="tiny (the ensemble) or tiny_rope")
    ap.add_argument("--img-shape", default="1,8,8", help="frames,height,width in latent patches")
    ap.add_argument("--txt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--instances", type=int, default=1,
                    help="instance_group count of the served models (self-hosted only)")
    ap.add_argument("--url", default=None, help="gRPC HOST:PORT of a running server")
    ap.add_argument("--in-channels", type=int, default=None,
                    help="with --url: the latent's channels (default: the tiny model's)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.requests < args.clients:
        ap.error("--clients must be >= 1 and --requests >= --clients")
    shape = tuple(int(v) for v in args.img_shape.split(","))
    outputs = list(model_io.CACHE_INPUTS if args.model.endswith("_rope")
                   else model_io.TRANSFORMER.outputs)
    outputs = [t.name for t in outputs]
    with tempfile.TemporaryDirectory(prefix="qkrope-load-") as tmp:
        if args.url:
            config = {"in_channels": args.in_channels or 16, "joint_attention_dim": 24}
            res = run_load(args.url, args.model, _inputs(args.model, shape, args.txt_len,
                                                         args.batch, config), outputs,
                           clients=args.clients, requests=args.requests)
        else:
            try:
                install = triton_server.prepare()
            except triton_server.SetupError as exc:
                print(f"triton_load: {exc}", file=sys.stderr)
                return 2
            repo, config = _build(Path(tmp), args.instances)
            with triton_server.Server(install, repo, log=Path(tmp) / "server.log") as srv:
                res = run_load(srv.grpc_url, args.model,
                               _inputs(args.model, shape, args.txt_len, args.batch, config),
                               outputs, clients=args.clients, requests=args.requests)
            res["server"] = f"tritonserver {triton_server.SERVER_VERSION} " \
                            f"({triton_server.PACKAGE}=={triton_server.VERSION}), " \
                            f"{args.instances} instance(s) per model"
    res.update(machine=_machine(), img_shape=list(shape), txt_len=args.txt_len,
               batch=args.batch)
    print(f"{res['model']}: {res['requests']} requests, {res['clients']} clients, "
          f"{res['errors']} errors; {res['throughput_rps']} req/s, p50 {res['p50_ms']} ms, "
          f"p99 {res['p99_ms']} ms (max {res['max_ms']} ms) on {res['machine']}")
    if res["errors"]:
        print(f"first error: {res['first_error']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
