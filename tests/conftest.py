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


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """The folder of the tiny family models and exports the matrices share across the session
    (tests/_families.py TinyBuilder.saved / .exported): made on first use under pytest's
    basetemp, so each pytest run (the CPU step, the slow step; each pytest-xdist worker) builds
    its own."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def stage_exports(tmp_path_factory):
    """The tiny pipelines' pipeline exports the stage tests share (tests/_stage_exports.py)."""
    from _stage_exports import StageExports

    return StageExports(tmp_path_factory.mktemp("stage-exports"))
