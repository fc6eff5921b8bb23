"""``qkrope export``: the Qwen-Image attention block or a whole diffusers transformer (any family
of :mod:`qkrope.families`, through its export hooks) to ONNX.

Exporter path: ``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript/torchlib) with
``custom_translation_table={torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation}``:
every call of the fused op becomes one ``qkrope::QKNormRoPE`` node (docs/spec.md section 4). After the
export the model-local function body is added (one body per model, see
:mod:`qkrope.export.onnx_function`), the IR version is pinned to 10, or 11 at opset 23
(:func:`ir_version_for`; ONNX Runtime 1.31 rejects the IR 14 that onnx 1.23 writes), and the file is checked (``onnx.checker`` full check, strict
shape inference with every graph output shaped, QKNormRoPE node count, no complex types).

The weights are never in memory as a whole: the module traced has placeholder parameters and
each initializer is read from the weight files by its state-dict key when it is written
(:mod:`qkrope.export.streaming`), external data first, that form checked, then inlined in chunks
into one file for a model under :data:`EXTERNAL_DATA_THRESHOLD`.

Files are written to a hidden staging folder next to the destination and moved into place as a
group by :func:`qkrope._fileio.staged_outputs` (the sidecar ``.onnx.json`` first, then the
``.onnx.data`` external-data companion of models over 1.5 GiB, then the ``.onnx``; any failure
puts the old files back): a failed re-export leaves the old model and sidecar as they were. The
sidecar records the model's sha256, so a kill between two renames leaves a pair the reader
refuses ("does not describe this model"), never a silently mixed one.

Graph inputs are named after diffusers' arguments: ``hidden_states``, ``encoder_hidden_states``,
``encoder_hidden_states_mask`` (**bool** ``[batch, txt_tokens]``, True = attend, in both models:
diffusers normalises any mask to bool before attention, and a float mask fed to SDPA would be
*additive*, so bool removes the ambiguity; pass ``mask > 0`` for a 1.0/0.0 mask), ``timestep``
(transformer; ``[batch]`` in the model dtype, as the pipeline passes it), ``img_cos_sin_cache``,
``txt_cos_sin_cache`` (fp32 ``[rows, rotary_dim]``). Outputs: ``img_out``, ``txt_out`` (attention)
or ``sample`` (transformer). Dynamic axes: ``batch``, ``img_tokens``, ``txt_tokens``,
``img_cache_rows``, ``txt_cache_rows``.

torch.export specialises dimensions whose sample value is 0 or 1, so tracing always uses a batch
of at least 2 and at least 2 tokens per stream (the sidecar records the traced sample).

The export is split by subject, and this module keeps every name (imported from there):
:mod:`.trace` (the torch.export call), :mod:`.finalize` (optimisation, the function body, the
file checks, :class:`ExportError`), :mod:`.save` (staged saving and the commit order),
:mod:`.annotate` (the sidecar's tensors, the model's metadata), :mod:`.sample` (the traced
sample), :mod:`.arguments` (the argument checks), :mod:`.attention_export` (the attention
block) and :mod:`.transformer_export` (a whole transformer, :class:`TransformerPlan`).
"""

from __future__ import annotations

# noqa: F401 throughout: this module is the exporter's face; every name is defined elsewhere
from qkrope.runtime.caches import default_axes_dims  # noqa: F401 (part of this module's API)

from .annotate import INPUT_DOCS, _tensor_infos, _versions, annotate_model  # noqa: F401
from .arguments import (FP8_MIN_OPSET, TORCH_DTYPES, _check_dtype, _check_opset,  # noqa: F401
                        _check_out, _check_quant_opset, default_opset)
from .attention import (ATTENTION_FORMS, DEFAULT_ATTENTION_FORM,  # noqa: F401 (API)
                        attention_form, check_attention_form)
from .attention_export import (ATTENTION_INPUTS, ATTENTION_OUTPUTS,  # noqa: F401
                               CacheInputAttention, _attention_module, _attention_weights,
                               _check_attention_weights, _random_parameter, _refuse_quantized,
                               _shapes, build_attention, export_attention, load_state_dict)
from .finalize import (IR_VERSION, ExportError, _optimize, _qk_nodes,  # noqa: F401
                       check_parameters, finalize_model, ir_version_for, verify_onnx_file)
from .sample import (DEFAULT_ATTENTION_SAMPLE, DEFAULT_TRANSFORMER_SAMPLE,  # noqa: F401
                     MAX_SEED, Sample, _axis_values, _sample, _sample_args, _sample_dict)
from .save import (EXTERNAL_DATA_THRESHOLD, _commit_order, _initializer_bytes,  # noqa: F401
                   _save_staged, _write_outputs)
from .trace import _dynamic_shapes, _rename_parameters, _torch_export  # noqa: F401
from .transformer_export import (TRANSFORMER_INPUTS, TRANSFORMER_OUTPUTS,  # noqa: F401
                                 TransformerPlan, _skeleton, diffusers_config_record,
                                 export_transformer)
