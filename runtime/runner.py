"""The base of the runners :func:`qkrope.runtime.load` returns: the checks of a call against the
model's I/O (:class:`~qkrope.model_io.ModelIO`, read by :mod:`qkrope.runtime.io_specs`), and
:class:`Runner`, which maps the call's arguments to model inputs and checks them all before a
backend runs anything (the backends: :mod:`qkrope.runtime.runner_onnxrt`,
:mod:`qkrope.runtime.runner_tensorrt`; :func:`~qkrope.runtime.backends.load` picks one).

Every call is checked **before** anything executes: the RoPE caches with
:func:`~qkrope.runtime.validate_cos_sin_caches` (head_dim from the model), then every input's
dtype, rank, dimensions (static ones, the engine profile's min/max, shared axes such as batch),
device and contiguity. Failures raise :class:`RopeCacheError` (the cache pair) or
:class:`RunnerInputError` (everything else), both RuntimeErrors whose message says what was
received, what was expected and the fix. Nothing is converted or copied silently.

Outputs are allocated per (thread, output, shape) and reused while that shape is one of the last
:data:`BUFFERS_PER_NAME` (2) used: the tensors a call returns may be overwritten by a later call
with the same shapes on the same thread. Pass ``copy_outputs=True`` to
:func:`~qkrope.runtime.load` (or ``.clone()`` them) to keep them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping

import torch

from qkrope.errors import InputError, QkropeError

from qkrope import dtypes, model_io
from qkrope.model_io import ModelIO
from .caches import validate_cos_sin_caches

#: Output (and default-mask) buffers a thread keeps per tensor name: those of the last two
#: shapes, so that a true-CFG pipeline alternating two text lengths reuses both, while calls with
#: ever new shapes (a pipeline over many image sizes) hold a bounded amount of memory.
BUFFERS_PER_NAME = 2
#: The optional inputs a call passes by role in ``conditioning`` (the family graph's that has
#: them; qkrope.model_io).
CONDITIONING_ROLES = ("pooled_projections", "guidance", "padding_mask", "encoder_hidden_states_2",
                      "encoder_attention_mask_2", "image_embeds", "encoder_hidden_states_image",
                      "control_hidden_states", "control_hidden_states_scale", "latents_clean",
                      "latents_history_2x", "latents_history_4x", "target_timestep",
                      *model_io.PACKED_ROLES)


class RunnerError(QkropeError, RuntimeError):
    """The runner cannot be created or cannot run (missing library, bad engine, failed enqueue)."""


class RunnerInputError(RunnerError, ValueError):
    """An input does not match the model. The message says received / expected / fix."""


# --------------------------------------------------------------------------------------------
# What the model accepts
# --------------------------------------------------------------------------------------------

def _torch_dtype_name(t: torch.Tensor) -> str:
    return dtypes.canonical(t.dtype, source="torch")


# --------------------------------------------------------------------------------------------
# Checks (pure; run before any execution)
# --------------------------------------------------------------------------------------------

def check_inputs(io: ModelIO, feeds: Mapping[str, Any], *, device: torch.device) -> dict[str, int]:
    """Check every fed tensor against ``io``; returns the value of every named axis.

    Raises RunnerInputError naming the input, what was received, what was expected, the fix.
    The RoPE caches' own facts (a float32 pair, rows >= the tokens of their stream, ...) are not
    repeated here: :meth:`Runner.prepare` checks them once with ``validate_cos_sin_caches``, the
    only way a cache reaches ``feeds`` (``extra_inputs`` may not replace it).
    """
    role_of = {v: k for k, v in io.roles.items()}
    axis_values: dict[str, tuple[int, str]] = {}
    for spec in io.inputs:
        if spec.name not in feeds or feeds[spec.name] is None:
            raise RunnerInputError(
                f"the model input {spec.name!r} ({spec.describe()}) was not given. Fix: pass it "
                f"({'as ' + role_of[spec.name] + '=' if spec.name in role_of else 'in extra_inputs='}...)")
        t = feeds[spec.name]
        label = role_of.get(spec.name, spec.name)
        if label != spec.name:
            label = f"{label} (model input {spec.name!r})"
        if not isinstance(t, torch.Tensor):
            raise RunnerInputError(f"{label} must be a torch.Tensor; got {type(t).__name__}. Fix: "
                                   f"torch.as_tensor(...)")
        if t.layout != torch.strided:
            kind = "sparse" if t.is_sparse or "sparse" in str(t.layout) else "non-strided"
            raise RunnerInputError(
                f"{label} is a {kind} tensor ({t.layout}, shape {tuple(t.shape)}); the model "
                f"takes dense tensors. Fix: pass {label.split()[0]}.to_dense()")
        if t.device != device and not (t.device.type == device.type == "cuda"
                                       and _same_cuda(t.device, device)):
            raise RunnerInputError(
                f"{label} is on {t.device} but hidden_states is on {device}; all inputs must be on "
                f"one device. Fix: {label.split()[0]}.to({str(device)!r})")
        got_dtype = _torch_dtype_name(t)
        if got_dtype != spec.dtype and role_of.get(spec.name) == "encoder_hidden_states_mask":
            from . import schemes  # the one check the Triton rope model runs too

            try:
                schemes.check_mask_dtype(got_dtype, spec.dtype, label)
            except schemes.BadRequest as exc:
                raise RunnerInputError(str(exc)) from None
        if got_dtype != spec.dtype:
            short = {v: k for k, v in dtypes.NAME_BY_SHORT.items()}
            other = (f" (or re-export with `qkrope export --dtype {short[got_dtype]}` for "
                     f"{got_dtype} activations)"
                     if got_dtype in short and spec.dtype in short
                     and role_of.get(spec.name) in ("hidden_states", "encoder_hidden_states")
                     else "")
            raise RunnerInputError(
                f"{label} has dtype {got_dtype}; the model expects {spec.dtype} (precision is fixed "
                f"at export). Fix: cast it to the model's dtype {spec.dtype}: "
                f"{label.split()[0]}.to(torch.{spec.dtype}){other}")
        if t.dim() != spec.rank:
            raise RunnerInputError(f"{label} has shape {tuple(t.shape)} ({t.dim()}-D); the model "
                                   f"expects {spec.rank}-D {spec.describe()}. Fix: reshape it")
        for i, (n, (lo, hi), ax) in enumerate(zip(t.shape, spec.dims, spec.axes)):
            if lo == hi and n != lo:
                what = "hidden size" if (i == spec.rank - 1 and role_of.get(spec.name) in (
                    "hidden_states", "encoder_hidden_states")) else f"dimension {i}"
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: {what} is {n}, the model's is {lo} "
                    f"(expected {spec.describe()}). Fix: feed tensors of the model this "
                    f"engine/ONNX file was exported from")
            axis = f" ({ax})" if ax else ""
            if n < 1 <= lo:
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} is 0, and the "
                    f"model needs at least 1 there (expected {spec.describe()}): an empty "
                    f"{ax or 'dimension'} cannot run. Fix: pass at least one "
                    f"{'batch item' if ax == 'batch' else 'element'} in dimension {i}")
            if (n < lo or (hi is not None and n > hi)) and io.profile_bounds:
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} = {n} is outside the "
                    f"range {lo}..{hi} this engine was built for (expected {spec.describe()}). Fix: "
                    f"rebuild with `qkrope build` and larger --max-batch/--max-img-tokens/"
                    f"--max-txt-tokens (or --min/--opt/--max shapes)")
            if n < lo or (hi is not None and n > hi):
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} = {n} is outside "
                    f"the model's range {lo}..{hi if hi is not None else ''} (expected "
                    f"{spec.describe()}). Fix: pass a size in that range")
            if ax is not None:
                if ax in axis_values and axis_values[ax][0] != n:
                    other_n, other = axis_values[ax]
                    raise RunnerInputError(
                        f"{ax} mismatch: {label} has {n} in dimension {i} but {other} has "
                        f"{other_n}. Fix: give all inputs the same {ax}")
                axis_values.setdefault(ax, (n, label))
        if not t.is_contiguous():
            raise RunnerInputError(f"{label} must be contiguous; got strides {t.stride()} for "
                                   f"shape {tuple(t.shape)}. Fix: pass {label.split()[0]}"
                                   f".contiguous()")
    unknown = sorted(set(feeds) - {s.name for s in io.inputs})
    if unknown:
        raise RunnerInputError(f"unknown input(s) {', '.join(unknown)}; the model's inputs are "
                               f"{', '.join(s.name for s in io.inputs)}. Fix: drop them from "
                               f"extra_inputs")
    return {ax: v for ax, (v, _) in axis_values.items()}


def _same_cuda(a: torch.device, b: torch.device) -> bool:
    cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


def check_roles(hidden_states, encoder_hidden_states, mask) -> None:
    """Checks that do not depend on the model: types, ranks, batch, mask shape (a 5-D latent
    passes the rank check: :func:`_check_roles` with the family's answer)."""
    _check_roles(hidden_states, encoder_hidden_states, mask, latent_5d=True)


def _check_roles(hidden_states, encoder_hidden_states, mask, *, latent_5d: bool) -> None:
    """:func:`check_roles`; ``latent_5d``: whether the family's latent is 5-D (its record's
    latent; the Triton rope model is told the same by its ``latent_patch``), else a 5-D
    hidden_states is a rank error as on the served path."""
    for name, t in (("hidden_states", hidden_states),
                    ("encoder_hidden_states", encoder_hidden_states)):
        if not isinstance(t, torch.Tensor):
            fix = (f"pass the {name} the pipeline computes" if t is None
                   else f"torch.as_tensor({name})")
            raise RunnerInputError(f"{name} must be a torch.Tensor [batch, tokens, dim]; got "
                                   f"{type(t).__name__}. Fix: {fix}")
    from . import schemes  # the ranks, batch and mask: the one check the Triton rope model runs

    given = mask if mask is None or isinstance(mask, torch.Tensor) else torch.empty(0)
    try:
        schemes.check_token_shapes(tuple(hidden_states.shape), tuple(encoder_hidden_states.shape),
                                   None if given is None else tuple(given.shape),
                                   latent_5d=latent_5d)
    except schemes.BadRequest as exc:
        msg = str(exc)
        if given is not mask:  # not a tensor: say what it is
            msg = msg.replace("got shape (0,)", f"got {type(mask).__name__}")
        raise RunnerInputError(msg) from None


# --------------------------------------------------------------------------------------------
# The common runner
# --------------------------------------------------------------------------------------------

def _has_text_cache(io: ModelIO) -> bool:
    """Whether the model's graph has a text cache: its family's (a family whose text is never
    rotated, nor normalised by the node, has none); True for a model without a family."""
    from qkrope import families
    from qkrope.model_io import TXT_COS_SIN_CACHE

    name = getattr(io.config, "family", None)
    if name is None:
        return True
    try:
        return TXT_COS_SIN_CACHE in families.by_name(name).graph.inputs
    except InputError:
        return True


class Runner:
    """Base class: argument mapping and checks; subclasses implement :meth:`_execute`."""

    backend = "?"
    #: where the inputs go (each backend sets it: its first provider's device, the engine's GPU)
    device: torch.device | None = None

    def __init__(self, io: ModelIO, *, copy_outputs: bool = False, transformer: bool = True):
        """``transformer=False``: a graph that is no transformer (a pipeline stage's engine),
        run with :meth:`run_feeds` only: no runner roles, RoPE caches or head_dim."""
        self.io = io
        self.copy_outputs = copy_outputs
        self._local = threading.local()
        if not transformer:
            return
        missing = [r for r in ("hidden_states", "encoder_hidden_states", "img_cache", "txt_cache")
                   if r not in io.roles and not (r == "txt_cache" and not _has_text_cache(io))]
        if missing:
            raise RunnerError(
                f"cannot tell which model inputs are {', '.join(missing)} (inputs: "
                f"{', '.join(s.name for s in io.inputs)}; from {io.source}). Fix: export with "
                f"`qkrope export`, whose input names the runner knows")
        if io.head_dim is None:
            raise RunnerError(f"the model's head_dim is unknown ({io.source} has no config and no "
                              f"QKNormRoPE weights). Fix: keep the sidecar JSON next to the model")

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.io.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.io.outputs]

    def _buffers(self) -> dict:
        if not hasattr(self._local, "buffers"):
            self._local.buffers = {}
        return self._local.buffers

    def _kept_buffer(self, name: str, key: tuple, make) -> torch.Tensor:
        """The buffer of ``name`` for ``key`` (shape, dtype, device): reused while it is one of
        the :data:`BUFFERS_PER_NAME` keys of ``name`` used last on this thread, else made anew
        and the least recently used one dropped, so that calls with ever new shapes hold a
        bounded amount of memory."""
        kept = self._buffers().setdefault(name, OrderedDict())
        buf = kept.get(key)
        if buf is None:
            buf = kept[key] = make()
            while len(kept) > BUFFERS_PER_NAME:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
        return buf

    def _output_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """Reused per (thread, output, shape, dtype, device) among the last shapes used
        (:meth:`_kept_buffer`)."""
        return self._kept_buffer(name, (shape, dtype, device),
                                 lambda: torch.empty(shape, dtype=dtype, device=device))

    def prepare(self, hidden_states, encoder_hidden_states, image_rotary_emb,
                encoder_hidden_states_mask=None, timestep=None, *,
                extra_inputs: Mapping[str, torch.Tensor] | None = None,
                conditioning: Mapping[str, torch.Tensor] | None = None,
                full_check: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Validate everything and return ``(feeds by model input name, axis values)``.

        ``conditioning``: the inputs of :data:`CONDITIONING_ROLES` by role
        (``pooled_projections`` and ``guidance``, where the family's graph has them); each one
        the model has must be given, and none it lacks."""
        check_roles(hidden_states, encoder_hidden_states, encoder_hidden_states_mask)
        device = hidden_states.device
        roles = self.io.roles
        # a model without a text cache (its text is never rotated) takes a cache pair whose
        # text cache has no rows, or None in its place
        if "txt_cache" not in roles and isinstance(image_rotary_emb, (tuple, list)) \
                and len(image_rotary_emb) == 2 and image_rotary_emb[1] is None \
                and isinstance(image_rotary_emb[0], torch.Tensor):
            image_rotary_emb = (image_rotary_emb[0], image_rotary_emb[0][:0])
        caches = validate_cos_sin_caches(
            image_rotary_emb, head_dim=self.io.head_dim,
            img_seq_len=self._img_tokens(hidden_states),
            txt_seq_len=encoder_hidden_states.shape[1] if "txt_cache" in roles else 0,
            device=device, full=full_check)
        self._check_device(device)
        feeds: dict[str, Any] = {roles["hidden_states"]: hidden_states,
                                 roles["encoder_hidden_states"]: encoder_hidden_states,
                                 roles["img_cache"]: caches.img}
        if "txt_cache" in roles:  # a model that rotates no text token has no text cache input
            feeds[roles["txt_cache"]] = caches.txt
        if encoder_hidden_states_mask is not None:
            if "encoder_hidden_states_mask" not in roles:
                raise RunnerInputError(
                    "encoder_hidden_states_mask was given but this model has no mask input (it "
                    "was exported without one, so every text token is attended). Fix: drop the "
                    "mask, or re-export with a mask input")
            feeds[roles["encoder_hidden_states_mask"]] = encoder_hidden_states_mask
        elif "encoder_hidden_states_mask" in roles:
            spec = self.io.input(roles["encoder_hidden_states_mask"])
            b, s = encoder_hidden_states.shape[:2]
            feeds[spec.name] = self._ones_mask((b, s), dtypes.torch_dtype(spec.dtype), device)
        if timestep is not None:
            if "timestep" not in roles:
                raise RunnerInputError("timestep was given but this model has no timestep input "
                                       "(an attention block takes none). Fix: drop it")
            feeds[roles["timestep"]] = timestep
        elif "timestep" in roles:
            raise RunnerInputError(f"this model needs timestep (input {roles['timestep']!r}, "
                                   f"{self.io.input(roles['timestep']).describe()}). Fix: pass "
                                   f"timestep=...")
        given = dict(conditioning or {})
        unknown = sorted(set(given) - set(CONDITIONING_ROLES))
        if unknown:
            raise RunnerInputError(f"conditioning takes the roles {list(CONDITIONING_ROLES)}; "
                                   f"got {unknown}. Fix: pass other inputs in extra_inputs")
        for role in CONDITIONING_ROLES:
            value = given.get(role)
            if value is not None and role not in roles:
                raise RunnerInputError(f"{role} was given but this model has no {role} input. "
                                       f"Fix: drop it")
            if value is None and role in roles:
                raise RunnerInputError(f"this model needs {role} (input {roles[role]!r}, "
                                       f"{self.io.input(roles[role]).describe()}). Fix: pass "
                                       f"conditioning={{{role!r}: ...}}")
            if value is not None:
                feeds[roles[role]] = value
        role_of = {v: k for k, v in roles.items()}
        for name, t in (extra_inputs or {}).items():
            if name in role_of or name in feeds:
                role = role_of.get(name)
                how = ("image_rotary_emb=(img_cache, txt_cache)" if role in ("img_cache",
                                                                              "txt_cache")
                       else f"{role}=..." if role else "its argument")
                raise RunnerInputError(
                    f"extra_inputs names {name!r}, which is the model's {role or 'input'} "
                    f"{'input ' if role else ''}and is passed (and checked) through the runner's "
                    f"own argument; extra_inputs may not replace it. Fix: pass it as {how} and "
                    f"keep extra_inputs for inputs the runner has no argument for")
            feeds[name] = t
        axes = check_inputs(self.io, feeds, device=device)
        return feeds, axes

    def _img_tokens(self, hidden_states: torch.Tensor) -> int:
        """The image tokens of ``hidden_states``: axis 1 of a token stream; the patch grid of a
        5-D latent (the model's family record and config, qkrope.runtime.latents)."""
        if hidden_states.dim() != 5:
            return int(hidden_states.shape[1])
        from .caches import record_of
        from .latents import latent_of

        config = self.io.config
        latent = latent_of(record_of(config, self.io.source),
                           getattr(config, "diffusers_config", None))
        try:
            return latent.tokens(tuple(hidden_states.shape))
        except InputError as exc:
            raise RunnerInputError(str(exc)) from None

    def _ones_mask(self, shape, dtype, device) -> torch.Tensor:
        return self._kept_buffer("__mask__", (tuple(shape), dtype, device),
                                 lambda: torch.ones(shape, dtype=dtype, device=device))

    def __call__(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 image_rotary_emb: Any, encoder_hidden_states_mask: torch.Tensor | None = None,
                 timestep: torch.Tensor | None = None, *,
                 extra_inputs: Mapping[str, torch.Tensor] | None = None,
                 conditioning: Mapping[str, torch.Tensor] | None = None,
                 full_check: bool = False):
        """Run the model. Returns the outputs in model order: a tuple ``(img_out, txt_out)`` for an
        attention block, a single tensor for a one-output model.

        ``image_rotary_emb`` is the ``(img_cache, txt_cache)`` pair (``[rows, rotary_dim]``
        float32 on the activations' device; convert other formats with ``to_cos_sin_caches``).
        ``full_check=True`` also checks cache values (synchronises the device).
        """
        feeds, axes = self.prepare(hidden_states, encoder_hidden_states, image_rotary_emb,
                                   encoder_hidden_states_mask, timestep,
                                   extra_inputs=extra_inputs, conditioning=conditioning,
                                   full_check=full_check)
        outs = self._execute(feeds, axes, hidden_states.device)
        if self.copy_outputs:
            outs = [o.clone() for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run_feeds(self, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run the model on ``feeds``, one tensor per model input by name, every one checked
        first as a call's are (dtype, rank, dimensions, the profiles' bounds, one device,
        contiguity); the outputs in model order. The path of a graph with no runner roles (a
        pipeline stage's engine); a transformer's call goes through ``__call__``, which checks
        its RoPE caches."""
        unknown = sorted(set(feeds) - set(self.input_names))
        if unknown:
            raise RunnerInputError(f"{', '.join(unknown)} are no inputs of the model (its inputs: "
                                   f"{', '.join(self.input_names)}). Fix: pass those by name")
        devices = sorted({str(t.device) for t in feeds.values() if isinstance(t, torch.Tensor)})
        if len(devices) > 1:
            raise RunnerInputError(f"the inputs are on {' and '.join(devices)}; they must be on "
                                   f"one device. Fix: move them with .to({str(self.device)!r})")
        device = torch.device(devices[0]) if devices else self.device
        self._check_device(device)
        axes = check_inputs(self.io, feeds, device=device)
        outs = self._execute(dict(feeds), axes, device)
        return [o.clone() for o in outs] if self.copy_outputs else list(outs)

    def run_positions(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      *, mask: torch.Tensor | None = None, timestep: torch.Tensor | None = None,
                      **request):
        """Build the caches from the position request of the model's family (its scheme's
        fields: ``img_shapes`` and ``txt_seq_len``, default ``encoder_hidden_states.shape[1]``;
        or ``txt_ids`` / ``img_ids``), memoised per request and device
        (:func:`qkrope.runtime.caches.build_rope_caches`, with the RoPE setting the model's
        sidecar records), then call the runner. Other keywords (``conditioning``,
        ``extra_inputs``, ``full_check``) go to the call. A text length shorter than the text
        tokens is reported by the cache check (overflow)."""
        from . import schemes
        from .caches import build_rope_caches, model_setting, record_of
        from .latents import VIDEO_5D, latent_of

        record = record_of(self.io.config, self.io.source)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            cfg = getattr(self.io.config, "diffusers_config", None)
            latent_5d = latent_of(record, cfg if isinstance(cfg, dict) else {}).kind == VIDEO_5D
            _check_roles(hidden_states, encoder_hidden_states, None, latent_5d=latent_5d)
        call = {k: request.pop(k) for k in ("conditioning", "extra_inputs", "full_check")
                if k in request}
        scheme = schemes.scheme(record.scheme)
        length = getattr(scheme, "TEXT_LENGTH_FIELD", None)
        if length is not None and request.get(length) is None:
            request[length] = int(encoder_hidden_states.shape[1])
        caches = build_rope_caches(record.scheme, request,
                                   model_setting(self.io.config, record, self.io.source),
                                   device=hidden_states.device)
        if caches.img.shape[0] != hidden_states.shape[1]:
            raise RunnerInputError(
                f"{' / '.join(k for k in request)} give {caches.img.shape[0]} image tokens but "
                f"hidden_states has {hidden_states.shape[1]}. Fix: pass the positions of this "
                f"batch's latent (img_shapes: the latent patch grid (frames, height/2/8..., "
                f"width...) so that sum(f*h*w) = tokens; ids: one row per token)")
        return self(hidden_states, encoder_hidden_states, caches, mask, timestep, **call)

    # backend hooks
    def _check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def _execute(self, feeds: dict[str, torch.Tensor], axes: dict[str, int],
                 device: torch.device) -> list[torch.Tensor]:
        raise NotImplementedError



# --------------------------------------------------------------------------------------------
# The model's I/O as each backend reads it (an ONNX file and its session, a deserialised engine)
# --------------------------------------------------------------------------------------------
