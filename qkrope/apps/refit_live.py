"""Refit without a disk round trip: new weights into a loaded ``--refit`` engine, in process.

    pipe.load_lora_weights(lora)            # the PyTorch pipeline: weights in memory
    pipe.fuse_lora()
    fused = pipe.transformer
    pipe.transformer = qkrope.runtime.load_transformer("transformer.engine")  # built --refit
    refit_weights(pipe.transformer, fused)  # or a {diffusers name: tensor} state dict

:func:`refit_weights` takes the weights of a live ``torch.nn.Module`` (a LoRA fused with
``fuse_lora``: peft's ``base_layer`` names are read as diffusers' own, the unfused ``lora_A`` /
``lora_B`` tensors are left out; an adapter loaded but not fused is refused) or an in-memory
state dict, by diffusers parameter name (dense real float tensors with values: a meta,
sparse, float8, quantised or complex tensor is refused in one line naming its key), and refits
the engine the drop-in (or
:class:`~qkrope.runtime.runner_tensorrt.TensorRTRunner`) runs: the next call uses the new
weights; no file is read or written (``qkrope refit`` writes a refitted engine to disk). The
engine file then no longer holds the weights that run: the runner is marked refitted in process
(when the engine changes), and ``pipe.save_pretrained`` / the drop-in's ``save_pretrained``
refuse it in one line with the ``qkrope refit`` command that writes the refitted engine.

The checks are ``qkrope refit``'s, from one home (:func:`qkrope.apps.refit.refit_engine`):
the name map against the export's ``config.parameters`` (keys it left out of the graph
skipped), every tensor of the shape the export recorded, finite before and after the
conversion to the engine's dtype, ModelOpt-quantised weights refused; nothing is refitted when
any check fails. It lives with the command (an app) because the runtime layer does not import
the apps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .refit import _REFIT_QUANT_FIX, RefitError, RefitReport, refit_engine


def _runner_of(target: Any):
    """The TensorRT runner behind a drop-in (or the runner itself)."""
    runner = getattr(target, "_runner", target)
    backend = getattr(runner, "backend", None)
    if backend != "tensorrt":
        what = (f"{type(target).__name__} on {backend}" if backend else
                f"a {type(target).__name__}")
        raise RefitError(f"refit_weights replaces the weights of a TensorRT engine (built with "
                         f"`qkrope build --refit`, loaded with load_transformer / load); got "
                         f"{what}. Fix: load the .engine; an ONNX model takes new weights by "
                         f"re-export: save the fused transformer (transformer.save_pretrained("
                         f"DIR)) and `qkrope export --model transformer --diffusers DIR`")
    return runner


def _is_lora_entry(key: str) -> bool:
    return any(part.startswith("lora_") for part in key.split("."))


def live_state_dict(weights: Any) -> dict:
    """``{diffusers name: tensor}`` of a module or a mapping (module docstring)."""
    import torch

    if isinstance(weights, torch.nn.Module):
        unfused = sorted({a for m in weights.modules()
                          if hasattr(m, "base_layer") and hasattr(m, "merged_adapters")
                          and not getattr(m, "disable_adapters", False)
                          for a in getattr(m, "active_adapters", ())
                          if a not in m.merged_adapters})
        if unfused:
            raise RefitError(f"the module has LoRA adapter(s) {unfused} loaded but not fused: "
                             f"its weights are still the base model's, and an engine cannot "
                             f"apply an adapter. Fix: pipe.fuse_lora() (lora_scale= sets the "
                             f"strength) before refitting")
        state: dict = {}
        for key, value in weights.state_dict().items():
            if _is_lora_entry(key):
                continue  # the adapter's own matrices: fused into base_layer already
            name = key.replace(".base_layer.", ".")
            if name in state:
                raise RefitError(f"the module has both {name} and {key}; cannot tell which is "
                                 f"the weight. Fix: pipe.unload_lora_weights() after fuse_lora()")
            state[name] = value
        return state
    if isinstance(weights, Mapping):
        bad = [k for k in weights if not isinstance(k, str)]
        if bad:
            raise RefitError(f"the state dict's keys must be diffusers parameter names (str); "
                             f"got {bad[:3]!r}")
        return dict(weights)
    raise RefitError(f"weights must be a torch.nn.Module (e.g. pipe.transformer after "
                     f"fuse_lora()) or a mapping of diffusers parameter names to tensors; got "
                     f"{type(weights).__name__}")


class _MarkingTensorRT:
    """TensorRT's module for :func:`refit_engine`, whose ``Refitter`` marks the runner as
    refitted in process (:func:`qkrope.runtime.component.mark_refitted`) right before it
    changes the engine (``refit_cuda_engine``, which may leave some weights refitted when it
    fails): from then on the engine runs weights its file does not hold, and saving the drop-in
    is refused. A refit refused before that leaves the engine, and the runner, as they were."""

    def __init__(self, trt: Any, runner: Any):
        self._trt, self._runner = trt, runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trt, name)

    def Refitter(self, engine: Any, logger: Any) -> Any:  # noqa: N802 - TensorRT's name
        return _MarkingRefitter(self._trt.Refitter(engine, logger), self._runner)


class _MarkingRefitter:
    def __init__(self, refitter: Any, runner: Any):
        self._refitter, self._runner = refitter, runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._refitter, name)

    def refit_cuda_engine(self) -> bool:
        from qkrope.runtime.component import mark_refitted

        mark_refitted(self._runner)
        return self._refitter.refit_cuda_engine()


def refit_weights(target: Any, weights: Any, *, allow_missing: bool = False,
                  allow_extra: bool = False) -> RefitReport:
    """Refit the engine behind ``target`` (the drop-in :func:`qkrope.runtime.load_transformer`
    returned for a ``--refit`` engine, or its runner) with ``weights`` (a module or a state
    dict by diffusers name), in process; ``allow_missing`` / ``allow_extra`` as ``qkrope
    refit``'s flags. Returns what was refitted (:class:`qkrope.apps.refit.RefitReport`); every
    problem is a one-line :class:`RefitError` and leaves the engine as it was. Not while a
    call of the same engine runs (the device is synchronised first). Once the engine changes,
    saving the drop-in is refused (the file holds the build's weights; module docstring)."""
    from qkrope.quantization import refuse_quantized_state_dict
    from qkrope.runtime.state_dict import refuse_unusable_tensors

    runner = _runner_of(target)
    info = runner.sidecar
    where = getattr(runner, "path", "") or "the engine"
    if info is None or not info.refittable:
        raise RefitError(f"{where} was not built refittable (its sidecar "
                         f"{'is missing' if info is None else 'says refittable: false'}). Fix: "
                         f"rebuild it with `qkrope build --refit`")
    if getattr(runner, "cuda_graph", False):
        raise RefitError(f"{where} is loaded with cuda_graph=True: its captured graphs would "
                         f"keep replaying the old weights. Fix: load it without cuda_graph to "
                         f"refit in process, or `qkrope refit` the file and load it again")
    state = live_state_dict(weights)
    refuse_quantized_state_dict(state, source="the weights given to refit_weights",
                                fix=_REFIT_QUANT_FIX)
    # before any tensor is read (a meta one has no values); refit_engine checks again
    refuse_unusable_tensors(state, source="cannot refit from the weights given to "
                                          "refit_weights", error=RefitError)
    device = getattr(runner, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)  # no call of the old weights still in flight
    return refit_engine(_MarkingTensorRT(runner.trt, runner), runner.engine, runner.logger,
                        state, parameters=info.config.parameters,
                        not_in_graph=info.config.parameters_not_in_graph or (),
                        allow_missing=allow_missing, allow_extra=allow_extra,
                        shapes=info.config.parameter_shapes)


__all__ = ["live_state_dict", "refit_weights"]
