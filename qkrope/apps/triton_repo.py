"""``qkrope triton-repo``: argument handling over :func:`qkrope.runtime.triton.write_repository`."""

from __future__ import annotations

import argparse
import sys

from qkrope.runtime.profiles import DEFAULT_MAX_IMG_TOKENS, DEFAULT_MAX_TXT_TOKENS

from . import _args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "triton-repo",
        description=f"Write REPO/<name>/{{config.pbtxt, 1/model.plan, {_args.PLUGIN_FILE_NAME}}} from a "
                    "TensorRT engine and its sidecar (MODEL.engine.json, written by `qkrope "
                    "build`), and print the tritonserver command that loads the plugin.")
    _args.add_engine(p, "the model served with --backend tensorrt")
    p.add_argument("--backend", choices=("tensorrt", "onnxruntime"), default="tensorrt",
                   help="tensorrt (default: --engine) or onnxruntime (--onnx MODEL.onnx, no "
                        "TensorRT or plugin). A whole transformer gets an ensemble <name> over "
                        "<name>_rope (Python backend: the RoPE caches from the positions the "
                        "family's pipeline passes: img_shapes, or txt_ids/img_ids) and "
                        "<name>_trt / <name>_onnx")
    p.add_argument("--onnx", default=None, help="the exported model, for --backend onnxruntime")
    p.add_argument("--pipeline", metavar="OUT_DIR", default=None,
                   help="a whole pipeline export (`qkrope export --model pipeline -o OUT_DIR`): "
                        "one repository from prompt to pixels. Its top model <name> (Python "
                        "backend) takes a BYTES prompt (seed, steps, height, width, guidance, "
                        "frames, negative_prompt optional, where the pipeline's call takes them) "
                        "and returns UINT8 pixels, running the pipeline's tokenizers and "
                        "scheduler and calling each model stage by BLS: <name>_<component>_"
                        "<graph> per text-encoder and VAE graph, the transformer's ensemble "
                        "<name>_transformer. --backend onnxruntime serves the graphs; tensorrt "
                        "the engines `qkrope build OUT_DIR` wrote (default --name: OUT_DIR's "
                        "folder name)")
    from qkrope.runtime.plugin_build import DEFAULT_PLUGIN_HELP

    _args.add_plugin(p, DEFAULT_PLUGIN_HELP)
    p.add_argument("-o", "--output", "--repo", dest="repo", required=True,
                   help="model repository directory (created if missing)")
    p.add_argument("--name", default=None,
                   help="model name (default: the engine file stem, e.g. attn.fp16 for "
                        "attn.fp16.engine)")
    p.add_argument("--max-batch-size", type=int, default=0,
                   help="Triton max_batch_size with dynamic batching (default 0: the batch is an "
                        "explicit dynamic dim of the model; a model with RoPE cache inputs, "
                        "which have no batch axis, needs 0)")
    p.add_argument("--preferred-batch-sizes", type=_int_list, default=(), metavar="N,N",
                   help="dynamic batching's preferred batch sizes (with --max-batch-size)")
    p.add_argument("--max-queue-delay-us", type=int, default=0, metavar="US",
                   help="how long dynamic batching may hold a request to form a batch "
                        "(microseconds, with --max-batch-size; default 0)")
    p.add_argument("--instances", type=int, default=1,
                   help="instance_group count: model instances per GPU (the rope model: on "
                        "the CPU)")
    p.add_argument("--gpus", type=_int_list, default=(), metavar="0,1",
                   help="the GPUs the instances run on (instance_group gpus; default: all)")
    p.add_argument("--max-img-tokens", type=int, default=None,
                   help="the most image tokens the rope model of a whole transformer's ensemble "
                        "accepts (refused for an attention block, which has none; default: the engine "
                        f"profile's largest image cache; {DEFAULT_MAX_IMG_TOKENS} for --backend "
                        f"onnxruntime)")
    p.add_argument("--max-txt-tokens", type=int, default=None,
                   help="the most text tokens the rope model of a whole transformer's ensemble "
                        "accepts (refused for an attention block; default: the engine "
                        f"profile's largest text cache; {DEFAULT_MAX_TXT_TOKENS} for --backend "
                        f"onnxruntime)")
    p.add_argument("--force", action="store_true", help="replace an existing model directory")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--copy", dest="link", action="store_false", default=False,
                     help="the default, named: the engine (or the model and its data) goes into "
                          "the repository as an independent copy (a copy-on-write clone where "
                          "the filesystem makes one, else a plain copy), so rewriting the source "
                          "in place never changes the served model")
    how.add_argument("--link", dest="link", action="store_true", default=False,
                     help="hard-link the engine (or the model and its data) into the repository "
                          "instead (no bytes copied on one filesystem, a copy elsewhere); the "
                          "link shares the file: rewriting the source in place changes the "
                          "served model too")
    p.add_argument("--no-copy-plugin", dest="copy_plugin", action="store_false",
                   help="reference the plugin library where it is instead of copying it into "
                        "the model directory")
    _args.add_allow_host_code(p, "with --backend tensorrt: a version-compatible engine's "
                                 "repository serves it with version-compatible=true, which "
                                 "lets the server run that code; ")
    p.add_argument("--no-plugin-hash-check", dest="check_plugin_hash", action="store_false",
                   help="do not require the plugin's sha256 to match the engine sidecar's")
    p.set_defaults(func=run)
    return p


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,1; got "
                                         f"{text!r}") from None
#: the longest suffix added to --name (the ensemble's <name>_rope, <name>_onnx): a model folder
#: name must fit the file system's 255 bytes with it
NAME_SUFFIX_BYTES = len("_onnx")
NAME_MAX_BYTES = 255 - NAME_SUFFIX_BYTES


def transfer_line(transfer: str, link: bool) -> str:
    """What the command says of how the served files went in (``transfer``: the result's)."""
    if transfer == "hard-linked":
        return "hard-linked (--link: no bytes copied; the repository shares the file with its source)"
    independent = "rewriting the source in place leaves the served model as it is"
    if link:  # asked for, but the filesystem gave none
        return (f"{transfer} (--link asked for a hard link, but the repository is on another "
                f"filesystem or its filesystem has none; {independent})")
    if transfer == "cloned":
        return (f"cloned (a copy-on-write copy: no bytes copied until either file changes; "
                f"{independent}; --link hard-links instead)")
    return f"copied ({independent}; --link hard-links instead)"


def _run_pipeline(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre
    from qkrope.runtime import triton
    from qkrope.apps.triton_pipeline import write_pipeline_repository

    pre.input_dir(args.pipeline, flag="--pipeline",
                  fix="pass the folder `qkrope export --model pipeline -o OUT_DIR` wrote")
    given = [f for f, v in (("--engine", args.engine), ("--onnx", args.onnx),
                            ("--max-img-tokens", args.max_img_tokens),
                            ("--max-txt-tokens", args.max_txt_tokens)) if v is not None]
    if given:
        raise triton.TritonRepoError(f"{given[0]} with --pipeline: the pipeline export names "
                                     f"its own models and limits. Fix: leave {given[0]} out")
    if args.backend == "tensorrt":
        _args.check_plugin(args)
    serving = triton.Serving(instances=args.instances, gpus=tuple(args.gpus),
                             max_batch_size=args.max_batch_size,
                             preferred_batch_sizes=tuple(args.preferred_batch_sizes),
                             max_queue_delay_us=args.max_queue_delay_us)
    res = write_pipeline_repository(args.pipeline, args.repo, name=args.name,
                                    backend=args.backend, plugin=args.plugin, serving=serving,
                                    force=args.force, link=args.link,
                                    check_plugin_hash=args.check_plugin_hash,
                                    allow_host_code=args.allow_host_code)
    print(f"wrote {len(res.models)} models: {', '.join(m.name + '/' for m in res.models)}")
    print(f"the top model {res.model_dir.name} takes {', '.join(res.inputs)} (only prompt "
          f"required) and returns pixels (UINT8)")
    print(f"note: {triton.PIPELINE_ENV_NOTE}")
    print("serve it with:")
    print(f"  {res.command}")
    if args.backend == "onnxruntime":
        print("or, to try it without Docker (from a qkrope checkout):")
        print(f"  python scripts/triton_server.py serve {args.repo} --onnx-stand-in --pipeline-env")
    sys.stdout.flush()
    return 0


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre
    from qkrope.errors import InputError

    if args.pipeline is not None:
        return _run_pipeline(args)
    _args.check_engine(args, "triton-repo")
    if args.onnx is not None:
        pre.onnx_model(args.onnx, command="triton-repo --backend onnxruntime --onnx",
                       flag="--onnx")
    _args.check_plugin(args)
    if args.name is not None and len(args.name.encode()) > NAME_MAX_BYTES:
        raise InputError(f"--name is {len(args.name.encode())} bytes long ({args.name[:40]!r}...); "
                         f"a Triton model name is a folder name, at most {NAME_MAX_BYTES} bytes "
                         f"here (255 less the {NAME_SUFFIX_BYTES} of the ensemble's '_onnx' "
                         f"suffix). Fix: pass a shorter --name")

    from qkrope.runtime import triton

    serving = triton.Serving(instances=args.instances, gpus=tuple(args.gpus),
                             max_batch_size=args.max_batch_size,
                             preferred_batch_sizes=tuple(args.preferred_batch_sizes),
                             max_queue_delay_us=args.max_queue_delay_us)
    limits = dict(max_img_tokens=args.max_img_tokens, max_txt_tokens=args.max_txt_tokens)
    if args.backend == "onnxruntime":
        if args.engine is not None or args.onnx is None:
            raise triton.TritonRepoError("--backend onnxruntime serves an ONNX model: pass "
                                         "--onnx MODEL.onnx (not --engine)")
        res = triton.write_onnx_repository(args.onnx, args.repo, name=args.name,
                                           serving=serving, force=args.force, link=args.link,
                                           **limits)
    else:
        if args.engine is None or args.onnx is not None:
            raise triton.TritonRepoError("--backend tensorrt serves an engine: pass --engine "
                                         "MODEL.engine (or --backend onnxruntime --onnx M.onnx)")
        res = triton.write_repository(args.engine, args.repo, plugin=args.plugin,
                                      name=args.name, serving=serving, force=args.force,
                                      copy_plugin=args.copy_plugin,
                                      check_plugin_hash=args.check_plugin_hash,
                                      link=args.link, allow_host_code=args.allow_host_code,
                                      **limits)
    what = "the engine" if args.backend == "tensorrt" else "the model and its data"
    print(f"{what}: {transfer_line(res.transfer, args.link)}")
    if res.transfer == "hard-linked":
        print(f"note: {triton.HARD_LINK_NOTE}")
    if res.models and len(res.models) > 1:
        print(f"wrote {', '.join(str(m) + '/' for m in res.models)} (ensemble {res.model_dir.name}:"
              f" clients send {' and '.join(res.rope_inputs or ['img_shapes'])}, not the "
              f"caches)")
        print(f"note: {triton.PYTHON_ENV_NOTE}")
    else:
        plugin = (f", {res.plugin_path.name}" if res.plugin_path is not None
                  and res.plugin_path.parent == res.model_dir.resolve() else "")
        print(f"wrote {res.model_dir}/ (config.pbtxt, 1/{res.plan_path.name}{plugin})")
    print("serve it with:")
    print(f"  {res.command}")
    if args.backend == "onnxruntime":  # the tests' way: no Docker, no onnxruntime backend
        print("or, to try it without Docker (from a qkrope checkout: the nvidia-pytriton "
              "wheel's tritonserver, whose only backend is Python, runs the ONNX model with "
              "ONNX Runtime in it):")
        print(f"  python scripts/triton_server.py serve {args.repo} --onnx-stand-in")
    if res.models and len(res.models) > 1:  # a transformer: qkrope's client drop-in
        print(f"call it from a diffusers pipeline: pipe.transformer = qkrope.runtime."
              f"triton_transformer(url='HOST:8001', model={res.model_dir.name!r})")
    sys.stdout.flush()
    return 0
