import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    cuda = torch.cuda.is_available()
    try:
        import tensorrt  # noqa: F401
        trt = tensorrt.__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        trt = None
    return [f"qkrope: torch {torch.__version__}, CUDA available: {cuda}, TensorRT: {trt or 'absent'}"]
