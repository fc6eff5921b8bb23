"""``qkrope check`` at scale: the transformer's PyTorch reference with one block's weights
resident at a time, and ONNX Runtime's outputs of each block (``--blocks``) or of a ``--layers K``
prefix.

The reference (:class:`StreamedTransformer`) is diffusers' own forward of the family's class
(e.g. ``QwenImageTransformer2DModel.forward``; families whose record lists its blocks,
``block_lists``, e.g. FLUX's double-stream then single-stream blocks): the
modules outside the blocks (embeddings, norms, projections: a few MiB at the real width) are
loaded from the shards, every block is a ``meta``-device skeleton whose weights are read from
the safetensors shards (tensor by tensor, through the index) by a forward pre-hook just before
it runs and dropped by its forward hook right after. So the check holds the model once (in ONNX Runtime) plus one block, never two
copies. The forward hooks also keep each block's outputs, the reference side of the per-block
comparison.

The ONNX Runtime side of a per-block comparison is the polygraphy idiom of marking
intermediate tensors as graph outputs (``polygraphy run --onnx-outputs``): each block's image
and text hidden states are found in the exported graph by the torch exporter's name scopes
(node metadata ``pkg.torch.onnx.name_scopes``: ``transformer_blocks.<i>``), added as outputs,
and with ``--layers K`` the graph is cut after block ``K-1`` (the nodes and initializers later
blocks need are dropped, so ONNX Runtime reads only the first K blocks' weights). The graph is
edited without loading its weights; ONNX Runtime opens it from memory and reads the external
data from the model's folder.
"""

from __future__ import annotations

import ast
import copy
from collections import Counter
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from qkrope import model_io
from qkrope.errors import QkropeError
from qkrope.families._record import BLOCK_STREAMS

BLOCK_SCOPE = re.compile(r"(?:.*\.)?transformer_blocks\.(\d+)")  # one list, from block 0
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
STREAMS = BLOCK_STREAMS  # a block's outputs: hidden_states (image), encoder_hidden_states, or
# the one joined text-and-image stream (FLUX.2's and Chroma's single blocks; in the model's own
# order)
#: the token axis of each stream in an exported graph (export/trace names the axes)
STREAM_AXES = {"img_tokens": "img", "txt_tokens": "txt", "txt_tokens + img_tokens": "joined",
               # a packed sequence (every stream's rows in one, by index tensors)
               model_io.PACKED_ROWS: "joined"}
#: a factor of the image token axis of a graph whose model patchifies a 5-D latent
#: (export/latent_axes.py): the product of the latent's token grid, each factor a latent axis
#: (patch 1), its token count (``<axis>_tokens``) or, where torch.onnx left that count unnamed
#: inside the graph (a patch wider than 1), a bare ``s<n>`` symbol, as in
#: ``latent_frames*s38*s71``
LATENT_TOKEN_FACTOR = re.compile(rf"(?:{model_io.LATENT_FRAMES}|{model_io.LATENT_HEIGHT}|"
                                 rf"{model_io.LATENT_WIDTH})(?:_tokens)?|s\d+")
#: the condition token axes one text stream may join (a sum of them counts its tokens)
_TEXT_TERMS = frozenset((model_io.TXT_TOKENS, model_io.TXT2_TOKENS,
                         model_io.IMAGE_EMBED_TOKENS))


def _sum_terms(axis: str) -> list[str]:
    """The terms of ``axis`` (a dim_param) added at its top level: ``a + (Mod(b, 32))`` ->
    ``["a", "(Mod(b, 32))"]``; a term with a top-level subtraction stays one term."""
    terms, depth, start = [], 0, 0
    for i, c in enumerate(axis):
        depth += (c == "(") - (c == ")")
        if depth == 0 and axis.startswith(" + ", i):
            terms.append(axis[start:i].strip())
            start = i + 3
    return terms + [axis[start:].strip()]


def stream_of_axis(axis: str) -> str | None:
    """The stream whose tokens an exported graph's token axis named ``axis`` counts (None for
    any other axis):

    - one of :data:`STREAM_AXES`;
    - "txt" for a sum of text axes (``image_embed_tokens + txt2_tokens + txt_tokens``: a text
      stream that joins other conditions);
    - "img" for a product of a 5-D latent's token grid with a named latent axis among its
      factors (``latent_frames*latent_height*latent_width``, ``latent_frames*s38*s71``);
    - one of those plus a padding the graph adds (the exporter's symbolic dim, e.g. tokens
      padded to a multiple of 32: ``img_tokens + (Mod(32 - (Mod(img_tokens, 32)), 32))``),
      named by the token axes among its top-level terms, in any order (a padding is a term of
      ``Mod``; a padding alone, or a term that is neither, is no stream's)."""
    if axis in STREAM_AXES:
        return STREAM_AXES[axis]
    terms = _sum_terms(axis)
    if len(terms) > 1 and all(t in _TEXT_TERMS for t in terms):
        return "txt"
    factors = [f.strip() for f in axis.split("*")]
    if len(factors) > 1 and all(LATENT_TOKEN_FACTOR.fullmatch(f) for f in factors) and any(
            not re.fullmatch(r"s\d+", f) for f in factors):
        return "img"
    # the image stream of a model that joins latents before its own (history): a sum of the
    # parts' token grids, each a product of a frame axis and the latent's rows and columns (a
    # named axis or a symbol; pooled parts divide them), so a per-frame count alone or a
    # padding of frames is no stream's
    frames = (model_io.LATENT_FRAMES,) + model_io.HISTORY_AXES
    frame = re.compile(rf"\b(?:{'|'.join(frames)})\b")
    spatial = re.compile(rf"\b(?:{model_io.LATENT_HEIGHT}|{model_io.LATENT_WIDTH})(?:_tokens)?\b"
                         rf"|\bs\d+\b")
    if len(terms) > 1 and all(frame.search(t) and spatial.search(t) and "*" in t
                              for t in terms):
        return "img"
    names = {a for a in STREAM_AXES if len(_sum_terms(a)) == 1}
    found = frozenset(t for t in terms if t in names)
    if not found or any(t not in names and "Mod(" not in t for t in terms):
        return None  # a padding alone, or a term that is neither a token axis nor a padding
    by_terms = {frozenset(_sum_terms(a)): s for a, s in STREAM_AXES.items()}
    return by_terms.get(found)


class BlockCheckError(QkropeError, ValueError):
    """The per-block comparison cannot be set up for this model (said with the fix)."""


def block_output_name(block: int, stream: str) -> str:
    """The name a block output gets in the comparison table and polygraphy's JSON."""
    return f"block{block}.{stream}"


# --------------------------------------------------------------------------------------------
# The reference, one block resident at a time
# --------------------------------------------------------------------------------------------

class ShardReader:
    """The tensors of a saved diffusers folder by key: the streamed export's reader
    (:func:`qkrope.diffusers_weights.tensor_headers`: every shard the index names, headers
    checked; :func:`~qkrope.diffusers_weights.read_tensor`: one tensor by its offsets, with
    plain reads into memory of its own), so nothing is memory-mapped from a shard and a tensor
    read costs its own bytes."""

    def __init__(self, folder: str | os.PathLike, *, variant: str | None = None):
        from qkrope.diffusers_weights import tensor_headers

        self.folder = str(folder)
        self.headers = tensor_headers(folder, variant=variant)
        self.weight_map = {k: h.file.name for k, h in self.headers.items()}

    def keys(self) -> list[str]:
        return sorted(self.weight_map)

    def get_many(self, keys: Sequence[str], dtype, *,
                 keep_in_fp32: Sequence[str] = ()) -> dict[str, Any]:
        """``{key: tensor in dtype}`` for ``keys`` (a key the folder lacks is an error); the keys
        of the ``keep_in_fp32`` modules (the class's ``_keep_in_fp32_modules``) in float32, as
        diffusers loads them."""
        import torch

        from qkrope.diffusers_weights import read_tensor
        from qkrope.export.streaming import kept_in_fp32

        missing = [k for k in keys if k not in self.headers]
        if missing:
            raise BlockCheckError(f"{self.folder} has no tensor {missing[0]!r}"
                                  f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}"
                                  f" (a parameter of the diffusers model). Fix: pass --diffusers "
                                  f"the folder the model was exported from")
        return {k: read_tensor(self.headers[k]).to(
                    torch.float32 if kept_in_fp32(k, keep_in_fp32) else dtype) for k in keys}


def _return_freed_memory() -> None:
    """Hand the freed block's heap back to the system (glibc ``malloc_trim``). Without it glibc's
    adaptive mmap threshold serves a block's tensors under 32 MiB from the heap after the first
    large free, and the heap, fragmented, grows block after block (measured at the real width:
    +125-290 MiB from 1 to 3 blocks; flat with the trim). Elsewhere than glibc: nothing."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _parameters_on_meta:
    """Within: every parameter a module registers goes to the ``meta`` device at once (no
    storage; buffers stay where they are made), so a model of any size is built in the memory
    of its largest single tensor."""

    def __enter__(self):
        import torch

        self._orig = orig = torch.nn.Module.register_parameter

        def register(module, name, param):
            if param is not None and param.device.type != "meta":
                param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            orig(module, name, param)

        torch.nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc):
        import torch

        torch.nn.Module.register_parameter = self._orig
        return False


class StreamedTransformer:
    """diffusers' transformer of ``folder`` (``class_name``: its family record's class, e.g.
    ``QwenImageTransformer2DModel``) running its first ``num_layers`` blocks counted in
    execution order through the record's ``block_lists`` (e.g. FLUX's double-stream
    ``transformer_blocks`` then its ``single_transformer_blocks``; the later ones pass their
    streams through), whose blocks hold their weights only while they run (the module
    docstring). ``peak_block_elements``: the most block parameter elements resident at once
    (one block's, by construction; the test checks it); ``block_outputs[i]``: block ``i``'s
    outputs of the last call (``i`` in execution order), by the stream names of its list's
    ``BlockList.returns``: ``{"img": hidden_states, "txt": encoder_hidden_states}`` for a block
    returning the pair, ``{"joined": hidden_states}`` for one returning the joined
    text-and-image stream (FLUX.2's single-stream blocks), ``{"img": ...}`` for one returning
    the image stream alone."""

    def __init__(self, folder: str | os.PathLike, *, dtype, num_layers: int | None = None,
                 variant: str | None = None, class_name: str | None = None,
                 block_lists: Sequence[Any] | None = None):
        import diffusers
        import torch

        from qkrope.diffusers_weights import model_folder
        from qkrope.quantization import check_folder

        d = model_folder(folder)
        check_folder(str(d), None)  # quantizer state: not this reference's (check_fp8's)
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        # the family's class and block lists (its record; default: the registry's first
        # family, whose folders older callers pass)
        from qkrope import families

        record = families.by_class(class_name) if class_name else families.default()
        if block_lists is None:
            block_lists = record.block_lists if record is not None else ()
        if not block_lists:
            raise BlockCheckError(f"{class_name}: no block lists on its family record; its "
                                  f"reference is loaded whole")
        cls = getattr(diffusers, class_name or families.default().class_name)
        counts = [int(config.get(blocks.key, 0)) for blocks in block_lists]
        total = sum(counts)
        n = total if num_layers is None else int(num_layers)
        if not 1 <= n <= total:
            raise BlockCheckError(f"{d} has {total} blocks; cannot compare {n}")
        self.reader = ShardReader(d, variant=variant)
        # the whole model, every parameter on the meta device and its buffers computed as
        # diffusers computes them from the config (some depend on the block counts: Chroma's
        # modulation rows), then the parameters outside the blocks read from the shards. The
        # first n blocks in execution order run; each later one passes its streams through
        # unchanged (pass_through), so the model's own output is that of the first n blocks
        # with everything else as in the whole model: what an export --layers n computes.
        with _parameters_on_meta():
            model = cls.from_config(config).eval()
        torch.nn.Module.to(model, dtype)  # (ModelMixin.to warns about fp32 modules it has none of)
        self.blocks: list[tuple[str, Any]] = []  # (key prefix, module) of the first n blocks
        self.returns: list[tuple[str, ...]] = []  # what each of them returns (BlockList.returns)
        for blocks in block_lists:
            modules = model.get_submodule(blocks.attr)  # a dotted path: FLUX.3's mode_blocks.image
            for j, block in enumerate(modules):
                if len(self.blocks) < n:
                    self.blocks.append((f"{blocks.attr}.{j}.", block))
                    self.returns.append(tuple(blocks.returns))
                else:
                    modules[j] = pass_through(block, blocks.returns)
        inside = tuple(f"{blocks.attr}." for blocks in block_lists)
        outside = [k for k in model.state_dict() if not k.startswith(inside)]
        self.keep_in_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
        missing, unexpected = model.load_state_dict(
            self.reader.get_many(outside, dtype, keep_in_fp32=self.keep_in_fp32), strict=False,
            assign=True)
        stray = list(unexpected) + [k for k in missing if not k.startswith(inside)]
        if stray:
            raise BlockCheckError(f"{d}: the model outside its blocks does not take "
                                  f"{stray[0]!r} as its config builds it. Fix: pass --diffusers "
                                  f"the folder the model was exported from")
        self.model, self.dtype, self.num_layers = model, dtype, n
        self.block_elements = [sum(p.numel() for p in b.parameters()) for _, b in self.blocks]
        self.peak_block_elements = 0
        self.block_outputs: dict[int, dict[str, Any]] = {}
        for i, (prefix, block) in enumerate(self.blocks):
            block.register_forward_pre_hook(self._materialise(i, prefix))
            block.register_forward_hook(self._release(i))

    def _resident(self) -> int:
        return sum(p.numel() for _, b in self.blocks for p in b.parameters()
                   if p.device.type != "meta")

    def _materialise(self, i: int, prefix: str):
        def hook(block, args):
            names = [name for name, _ in block.named_parameters()]
            loaded = self.reader.get_many([prefix + n for n in names], self.dtype,
                                          keep_in_fp32=self.keep_in_fp32)
            state = {n: loaded[prefix + n] for n in names}
            try:
                block.load_state_dict(state, strict=True, assign=True)
            except RuntimeError as exc:  # a shape that is not the config's
                raise BlockCheckError(f"{self.reader.folder}: block {i} ({prefix[:-1]})'s "
                                      f"weights do not fit its config: "
                                      f"{str(exc).splitlines()[-1].strip()}") from None
            self.peak_block_elements = max(self.peak_block_elements, self._resident())
        return hook

    def _release(self, i: int):
        returns = self.returns[i]

        def hook(block, args, output):
            values = tuple(output) if isinstance(output, (tuple, list)) else (output,)
            if len(values) != len(returns):
                raise BlockCheckError(f"block {i} returned {len(values)} tensors; its family "
                                      f"record's block list says {returns}")
            self.block_outputs[i] = {s: v.detach().clone() for s, v in zip(returns, values)}
            block.to("meta")  # the weights go; the next block's come in
            _return_freed_memory()
        return hook

    def __call__(self, **kwargs):
        self.block_outputs = {}
        return self.model(**kwargs)


def pass_through(block, returns: Sequence[str]):
    """A module standing for ``block`` past ``--layers`` in the reference: it holds no weights
    and returns the streams it was given (by the names of the block's own forward arguments,
    ``STREAM_ARGUMENT``; for a block returning one tensor, its first argument where the name is
    not one of them), in the block's return order."""
    import inspect

    import torch

    from qkrope.families._record import STREAM_ARGUMENT

    signature = inspect.signature(block.forward)
    returns = tuple(returns)

    class PassThrough(torch.nn.Module):
        def forward(self, *args, **kwargs):
            given = signature.bind_partial(*args, **kwargs).arguments
            if len(returns) == 1:
                name = STREAM_ARGUMENT[returns[0]]
                return given[name] if name in given else next(iter(given.values()))
            return tuple(given[STREAM_ARGUMENT[s]] for s in returns)

        def extra_repr(self) -> str:
            return f"passes through {returns}"

    return PassThrough()


# --------------------------------------------------------------------------------------------
# The ONNX side: block outputs marked, the graph cut after --layers K
# --------------------------------------------------------------------------------------------

def block_offsets(block_lists: Sequence[Any], config: Any) -> dict[str, int]:
    """``{module attribute: index of its first block in execution order}`` for a family's
    ``block_lists`` and its diffusers ``config`` (each list's count under its key)."""
    offsets, at = {}, 0
    for blocks in block_lists:
        offsets[blocks.attr] = at
        at += int(config.get(blocks.key, 0))
    return offsets


def unread_blocks(block_lists: Sequence[Any], config: Any) -> set[int]:
    """The blocks (indices in execution order) of the lists whose outputs only later blocks
    read (``feeds_output`` False): a graph cut before any reader holds none of them."""
    out, at = set(), 0
    for blocks in block_lists:
        count = int(config.get(blocks.key, 0))
        if not blocks.feeds_output:
            out.update(range(at, at + count))
        at += count
    return out


def block_module(block: int, offsets: dict[str, int] | None) -> str:
    """The module path of block ``block`` (in execution order), e.g. ``transformer_blocks.3``
    or FLUX's ``single_transformer_blocks.0``."""
    if not offsets:
        return f"transformer_blocks.{block}"
    attr = max((o, a) for a, o in offsets.items() if o <= block)[1]
    return f"{attr}.{block - offsets[attr]}"


def _block_of(node, pattern=BLOCK_SCOPE, offsets=None) -> int | None:
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            for scope in scopes:
                m = pattern.fullmatch(str(scope))
                if m:
                    if offsets is None:
                        return int(m.group(1))
                    return offsets[m.group(1)] + int(m.group(2))
    return None


def _node_blocks(model, pattern, offsets) -> list[int | None]:
    """The block of each node of the graph (in node order): its name scope's, and for a node
    the exporter left with no name scope at all (torch.onnx writes none on the ``Split`` of a
    ``chunk`` / ``split``, e.g. of a fused QKV projection) the block of the nodes that read its
    outputs where they are all one block's (nodes in reverse order, so a chain of such nodes
    takes the block its last one feeds): a value a block makes and only such a node reads
    then stays inside the block, not a block output."""
    nodes = list(model.graph.node)
    blocks = [_block_of(n, pattern, offsets) for n in nodes]
    unscoped = [not any(p.key == NAME_SCOPES_KEY for p in n.metadata_props) for n in nodes]
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    outputs = {o.name for o in model.graph.output}
    for index in range(len(nodes) - 1, -1, -1):
        if not unscoped[index] or any(o in outputs for o in nodes[index].output):
            continue
        read_by = {blocks[r] for o in nodes[index].output for r in readers.get(o, ())}
        if len(read_by) == 1 and None not in read_by:
            blocks[index] = read_by.pop()
    return blocks


def find_block_outputs(model, offsets: dict[str, int] | None = None) -> dict[int, dict[str, str]]:
    """``{block: {"img": value name, "txt": value name}}`` of an exported transformer graph, or
    ``{block: {"joined": value name}}`` for a block returning the joined stream: the values a
    block's nodes produce and nodes outside it (or the graph's outputs) use, of shape
    ``[batch, img_tokens | txt_tokens | txt_tokens + img_tokens, width]`` (a token axis plus a
    padding the graph adds, a 5-D latent's image tokens: :func:`stream_of_axis`; the last
    block's text output is unused by the model and absent; a node with no name scope belongs
    to the block that reads it: :func:`_node_blocks`). Where a block has two such values of
    one stream (a joined block's fused projection read by a node the exporter left without a
    scope), the one of the model's width (that of the other blocks' outputs) is the block's;
    where that leaves more than one (modulations computed per token in the block and read by an
    unscoped node or by the next block), the block's is the one computed from all the others
    (its running stream, the block's last value). ``offsets`` (:func:`block_offsets`): the
    family's block lists, each numbered from its first block's index in execution order
    (default: ``transformer_blocks`` alone)."""
    pattern = BLOCK_SCOPE
    if offsets is not None:
        names = "|".join(re.escape(a) for a in sorted(offsets, key=len, reverse=True))
        pattern = re.compile(rf"(?:.*\.)?({names})\.(\d+)")
    block_of = _node_blocks(model, pattern, offsets)
    producer: dict[str, int | None] = {}
    made_by: dict[str, int] = {}  # value name -> index of the node that makes it
    for index, node in enumerate(model.graph.node):
        for out in node.output:
            producer[out] = block_of[index]
            made_by[out] = index
    crossing: dict[int, set[str]] = {}
    for index, node in enumerate(model.graph.node):
        b = block_of[index]
        for name in node.input:
            p = producer.get(name)
            if p is not None and p != b:
                crossing.setdefault(p, set()).add(name)
    for out in model.graph.output:
        p = producer.get(out.name)
        if p is not None:
            crossing.setdefault(p, set()).add(out.name)
    shapes = {v.name: v.type.tensor_type.shape for v in model.graph.value_info}
    candidates: dict[tuple[int, str], list[tuple[str, int]]] = {}  # (block, stream) -> (name, width)
    for block, names in sorted(crossing.items()):
        for name in sorted(names):
            shape = shapes.get(name)
            if shape is None or len(shape.dim) != 3:
                continue
            d = shape.dim
            stream = stream_of_axis(d[1].dim_param) if d[1].dim_param else None
            if d[0].dim_param == "batch" and stream is not None and d[2].dim_value > 0:
                candidates.setdefault((block, stream), []).append((name, d[2].dim_value))
    # the model's width: the one most blocks' lone outputs have (a block's output is its residual
    # stream, as wide as the model); a value of another width leaving a block is a projection
    # another block or an unscoped node reads (the last block's fused text QKV where its text
    # output is unused), not the block's output
    lone = Counter(w for found in candidates.values() if len(found) == 1 for _, w in found)
    width = max(lone, key=lambda w: (lone[w], w)) if lone else None
    found: dict[int, dict[str, str]] = {}
    for (block, stream), values in sorted(candidates.items()):
        if width is not None and len(values) > 1:
            values = [v for v in values if v[1] == width] or values
        if len(values) > 1:
            values = [v for v in values
                      if _computed_from(model, made_by, v[0], {n for n, _ in values} - {v[0]})]
        if len(values) != 1:
            raise BlockCheckError(f"block {block} of the graph has {len(values)} {stream} outputs "
                                  f"({', '.join(n for n, _ in values)}); the per-block comparison "
                                  f"needs one")
        found.setdefault(block, {})[stream] = values[0][0]
    return found


def _computed_from(model, made_by: dict[str, int], value: str, others: set[str]) -> bool:
    """Whether the graph computes ``value`` from every one of ``others`` (its ancestors; the
    nodes are in topological order, so the walk stops at the earliest of them)."""
    first = min(made_by[n] for n in others | {value})
    seen, todo, found = set(), [value], set()
    while todo:
        name = todo.pop()
        index = made_by.get(name)
        if name in seen or index is None or index < first:
            continue
        seen.add(name)
        if name in others:
            found.add(name)
        todo.extend(model.graph.node[index].input)
    return found == others


def _used_names(graph) -> set[str]:
    """Every value name the nodes of ``graph`` (and their subgraphs) read."""
    out: set[str] = set()
    for node in graph.node:
        out.update(node.input)
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                out |= _used_names(g)
    return out


def prune_to_outputs(model, outputs: Sequence[str]) -> None:
    """Make ``outputs`` the graph's outputs and drop every node and initializer they do not
    need (in place; nothing else changed). Graph inputs stay (an unused input is allowed)."""
    import onnx

    wanted, keep = set(outputs), []
    shapes = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    for node in reversed(model.graph.node):
        if wanted & set(node.output):
            keep.append(node)
            wanted |= set(node.input)
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    wanted |= _used_names(g)
    keep.reverse()
    del model.graph.node[:]
    model.graph.node.extend(keep)
    inits = [t for t in model.graph.initializer if t.name in wanted]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    new_outputs = []
    for name in outputs:
        vi = shapes.get(name)
        new_outputs.append(copy.deepcopy(vi) if vi is not None
                           else onnx.helper.make_empty_tensor_value_info(name))
    del model.graph.output[:]
    model.graph.output.extend(new_outputs)


def marked_model(onnx_path: str, *, num_blocks: int, layers: int | None,
                 offsets: dict[str, int] | None = None, unread: set[int] = frozenset()):
    """The model's graph (weights not loaded) with each compared block's outputs as graph
    outputs named ``block<i>.img`` / ``block<i>.txt`` or ``block<i>.joined`` (an Identity each;
    the last block's text output is unused by the model and absent), cut after block ``layers - 1`` when ``layers``
    is given (the model's own outputs then dropped); ``offsets``: :func:`find_block_outputs`'s.
    ``unread`` (:func:`unread_blocks`): blocks whose outputs only later blocks read; in a cut
    graph (``layers``) one the graph does not hold (no kept block reads it: FLUX.3's text blocks
    before any joint block) is not compared. Returns ``(model, [block output names])``."""
    import onnx

    model = onnx.load(onnx_path, load_external_data=False)
    blocks = find_block_outputs(model, offsets)
    n = num_blocks if layers is None else layers
    missing = [i for i in range(n) if not blocks.get(i)  # (a text refiner returns txt alone)
               and not (layers is not None and i in unread)]
    if missing:
        raise BlockCheckError(
            f"{onnx_path}: the outputs of block(s) {missing[:6]} cannot be found in the graph "
            f"(the exporter's name scopes pkg.torch.onnx.name_scopes are missing or changed). "
            f"Fix: re-export with `qkrope export --model transformer`, or check without "
            f"--blocks/--layers")
    names: list[str] = []
    vi = {v.name: v for v in model.graph.value_info}
    for i in range(n):
        for stream in STREAMS:
            value = blocks.get(i, {}).get(stream)
            if value is None:
                continue  # the last block's text output: unused by the model
            out = block_output_name(i, stream)
            model.graph.node.append(onnx.helper.make_node("Identity", [value], [out],
                                                          name=f"qkrope_check_{out}"))
            info = copy.deepcopy(vi[value])
            info.name = out
            model.graph.value_info.append(info)
            names.append(out)
    finals = [o.name for o in model.graph.output]
    prune_to_outputs(model, (finals if layers is None else []) + names)
    return model, names


def ort_block_session(onnx_path: str, model, providers: Sequence[str]):
    """An ONNX Runtime session over the edited graph, opened from memory, its external data read
    from the model's folder (``session.model_external_initializers_file_folder_path``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(Path(onnx_path).resolve().parent))
    return ort.InferenceSession(model.SerializeToString(), sess_options=so,
                                providers=list(providers))


def ort_block_runner(session, info, *, name: str = "onnxrt-blocks"):
    """A polygraphy ``BaseRunner`` over that session (inputs and outputs as OrtValues, so
    bfloat16 passes; outputs as float32 numpy); ``info``: the model's sidecar (the inputs'
    dtypes and shapes for polygraphy's metadata)."""
    from ._polygraphy import comparator_runner

    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}

    def infer(feed_dict):
        from qkrope.runtime.inputs import from_ort_value, to_ort_value

        feeds = {k: to_ort_value(np.asarray(v)) for k, v in feed_dict.items() if k in wanted}
        outs = session.run_with_ort_values(names, feeds)
        return {n: from_ort_value(v).astype(np.float32) for n, v in zip(names, outs)}

    inputs = [(t.name, t.dtype, [d if isinstance(d, int) else -1 for d in t.shape])
              for t in info.inputs]
    return comparator_runner(name, "qkrope-onnxrt-blocks", inputs, infer)


def reference_block_outputs(streamed: StreamedTransformer,
                            names: Sequence[str]) -> dict[str, np.ndarray]:
    """The streamed reference's block outputs of the last call, by compared name
    (``block<i>.<stream>``)."""
    out = {}
    for name in names:
        block, stream = name[len("block"):].split(".")
        out[name] = streamed.block_outputs[int(block)][stream].float().numpy()
    return out


def first_failing_block(rows: Sequence[Any]) -> int | None:
    """The lowest block index among the failing ``block<i>.*`` rows of the table."""
    bad = [int(r.output[5:].split(".")[0]) for r in rows
           if not r.passed and r.output.startswith("block")]
    return min(bad) if bad else None


__all__ = ["StreamedTransformer", "ShardReader", "BlockCheckError", "find_block_outputs",
           "prune_to_outputs", "unread_blocks", "marked_model", "ort_block_session", "ort_block_runner",
           "reference_block_outputs", "first_failing_block", "block_output_name",
           "pass_through"]
