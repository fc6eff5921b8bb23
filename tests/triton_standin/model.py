"""TEST STAND-IN, not part of qkrope: the ``<name>_onnx`` step of the ensemble, served by Triton's
Python backend running ONNX Runtime on the repository's own ``1/model.onnx``.

The server the tests run (from the nvidia-pytriton wheel) has no onnxruntime backend, so
tests/test_triton_server.py puts this file in place of that model (its config.pbtxt keeps the
I/O ``qkrope triton-repo`` wrote, with ``backend: "python"``). Triton's real onnxruntime backend
is not exercised by these tests. ONNX Runtime is loaded from the folder named by the
``ort_path`` parameter (installed there with ``pip --target`` next to the server's numpy<2).
"""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        sys.path.insert(0, config["parameters"]["ort_path"]["string_value"])
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # the test compares bits with a 1-thread session
        options.inter_op_num_threads = 1
        model = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        self.session = ort.InferenceSession(str(model), options,
                                            providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        responses = []
        for request in requests:
            feed = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                    for n in self.inputs}
            try:
                values = self.session.run(self.outputs, feed)
            except Exception as exc:  # ONNX Runtime refuses what does not fit the graph
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.
                                 TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(n, v) for n, v in zip(self.outputs, values)]))
        return responses
