"""The command applications: one module per ``qkrope`` subcommand (its arguments and how it
drives the library), apart from the library itself.

=================  ===================================================================
module             command
=================  ===================================================================
export             ``qkrope export`` over :mod:`qkrope.export.onnx_export`
check              ``qkrope check``: polygraphy parity (ONNX Runtime, TensorRT) vs PyTorch
build_plugin       ``qkrope build-plugin`` over :mod:`qkrope.runtime.plugin_build`
build              ``qkrope build`` over :mod:`qkrope.runtime.engine`
triton_repo        ``qkrope triton-repo`` over :mod:`qkrope.runtime.triton`
bench              ``qkrope bench`` (attention block latency); kernel_bench: the kernel
                   timing method it shares with ``scripts/bench_kernel.py``
kernel_report      the kernel's static SASS/ptxas report (``scripts/kernel_report.py``)
demo               ``qkrope demo``, the main job
=================  ===================================================================

Applications may import both :mod:`qkrope.export` and :mod:`qkrope.runtime`; the library never
imports the applications.
"""
