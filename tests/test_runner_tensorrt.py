"""The TensorRT runner (qkrope.runtime.runner_tensorrt) over fake engines: the optimisation
profile of each call, CUDA graph bookkeeping (a stand-in for the CUDA calls; the real capture is in
test_trt_runner_cuda_graph_on_gpu), the sidecar's config against the engine's."""

from __future__ import annotations

import pytest
import torch

import threading

import fake_tensorrt as ft
from _runner_helpers import (C, FakeCuda, _engine_sidecar, _fake_trt_runner, _multi_engine,  # noqa: F401
                             _profile, _qwen_inputs)

from qkrope.runtime import loader_tensorrt, runner_tensorrt
from qkrope.runtime import runner as rn
from qkrope.runtime.backends import load


# --------------------------------------------------------------------------------------------
# Several optimisation profiles: the runner's choice; CUDA graph bookkeeping
# --------------------------------------------------------------------------------------------

def test_trt_runner_picks_the_first_profile_holding_the_shapes():
    presets = [_profile((1, 2), 16, 8), _profile((1, 2), 64, 8), _profile((1, 2), 256, 8)]
    r, engine, _ = _fake_trt_runner(presets, labels=["64x64", "128x128", "256x256"])
    assert r.io.input("hidden_states").dims == ((1, 2), (1, 256), (C, C))  # the union
    assert r.select_profile({"hidden_states": (2, 16, C)}) == 0
    for grid, want in ((4, 0), (8, 1), (6, 1), (16, 2), (4, 0)):
        r(*_qwen_inputs(2, grid, 5))
        assert engine.calls[-1][0] == "execute_async_v3" and engine.calls[-1][1] == want
    # one context per profile used on this thread, each bound to its profile on the stream
    assert [c.profile for c in engine.contexts] == [0, 1, 2]
    assert [c[1] for c in engine.calls if c[0] == "set_optimization_profile_async"] == [0, 1, 2]
    # a second thread gets its own contexts
    t = threading.Thread(target=lambda: r(*_qwen_inputs(1, 4, 3)))
    t.start()
    t.join()
    assert len(engine.contexts) == 4 and engine.contexts[-1].profile == 0
    # beyond every profile: refused before anything runs (the union's bounds)
    n = len(engine.calls)
    with pytest.raises(rn.RunnerInputError, match="outside the range"):
        r(*_qwen_inputs(2, 18, 5))
    assert len(engine.calls) == n


def test_a_stage_engine_runs_by_input_name_with_every_input_checked_first():
    """``transformer=False`` (a pipeline stage's engine): no runner roles are needed, and
    ``run_feeds`` checks every named input (names, dtype, rank, the profiles' bounds, one
    device) before anything executes; outputs are copies with ``copy_outputs``."""
    trt, _ = ft.make_fake_trt()
    engine = _multi_engine([_profile((1, 2), 16, 8), _profile((1, 2), 64, 8)])
    r = runner_tensorrt.TensorRTRunner(loader_tensorrt.LoadedEngine(engine, trt, None),
                                       device=torch.device("cpu"), cuda=FakeCuda(),
                                       copy_outputs=True, transformer=False)
    r._check_device = lambda device: None
    assert r.io.roles == {}
    hs, ehs, (img, txt) = _qwen_inputs(2, 8, 5)
    feeds = {"hidden_states": hs, "encoder_hidden_states": ehs,
             "encoder_hidden_states_mask": torch.ones(2, 5, dtype=torch.bool),
             "img_cos_sin_cache": img, "txt_cos_sin_cache": txt}
    outs = r.run_feeds(feeds)
    assert [tuple(o.shape) for o in outs] == [tuple(hs.shape), tuple(ehs.shape)]
    assert engine.calls[-1][0] == "execute_async_v3" and engine.calls[-1][1] == 1
    assert outs[0].data_ptr() != r.run_feeds(feeds)[0].data_ptr()  # copies, not the buffers
    n = len(engine.calls)
    bad = [({**feeds, "latents": hs}, "latents are no inputs of the model"),
           ({**feeds, "hidden_states": hs.double()}, "has dtype float64"),
           ({**feeds, "hidden_states": hs[:, :, :4]}, "dimension 2 is 4, the model.s is 32"),
           ({k: v for k, v in feeds.items() if k != "txt_cos_sin_cache"}, "was not given"),
           ({**feeds, "hidden_states": torch.zeros(2, 65, C)}, "outside the range"),
           ({**feeds, "hidden_states": hs.to("meta")}, "on cpu and meta")]
    for given, says in bad:
        with pytest.raises(rn.RunnerInputError, match=says):
            r.run_feeds(given)
    assert len(engine.calls) == n  # nothing ran


def test_trt_runner_refuses_shapes_no_profile_holds_naming_them():
    # profile 0: batch 1, up to 256 image tokens; profile 1: batch 2, up to 16
    r, engine, _ = _fake_trt_runner([_profile((1, 1), 256, 8), _profile((2, 2), 16, 8)],
                                    labels=["single", "cfg"])
    r(*_qwen_inputs(1, 16, 5))
    r(*_qwen_inputs(2, 4, 5))
    assert [c[1] for c in engine.calls if c[0] == "execute_async_v3"] == [0, 1]
    with pytest.raises(rn.RunnerInputError, match=r"no optimisation profile.*hidden_states 2x64x"
                       r".*\n  profile 0 \(single\): hidden_states 1x1x\d+..1x256x\d+.*\n  "
                       r"profile 1 \(cfg\)"):
        r(*_qwen_inputs(2, 8, 5))


def test_trt_runner_cuda_graph_captures_once_per_shapes_then_replays():
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 16, 8), _profile((1, 2), 64, 8)],
                                       cuda_graph=True)
    hs, ehs, caches = _qwen_inputs(2, 4, 5)
    out1 = r(hs, ehs, caches)
    assert len(cuda.graphs) == 1
    execs = [c for c in engine.calls if c[0] == "execute_async_v3"]
    assert len(execs) == 2  # one eager run, then the captured one
    ctx = engine.contexts[0]
    static = ctx.addresses["hidden_states"]
    assert static != hs.data_ptr()  # bound to the graph's static input buffer
    hs2, ehs2, caches2 = _qwen_inputs(2, 4, 5)
    out2 = r(hs2 + 1, ehs2, caches2)
    assert len(cuda.graphs) == 1 and cuda.graphs[0].replays == 1
    assert len([c for c in engine.calls if c[0] == "execute_async_v3"]) == 2  # replay only
    assert out2[0].data_ptr() == out1[0].data_ptr()  # the graph's static outputs
    # the static input holds the new call's values
    graph, static_in, _outs = next(iter(r._local.graphs.values()))
    assert torch.equal(static_in["hidden_states"], hs2 + 1)
    # other shapes (another profile): a second capture; then a replay of the first again
    r(*_qwen_inputs(2, 8, 5))
    assert len(cuda.graphs) == 2 and engine.contexts[-1].profile == 1
    r(*_qwen_inputs(2, 4, 5))
    assert cuda.graphs[0].replays == 2 and cuda.graphs[1].replays == 0


def test_trt_runner_without_cuda_graph_captures_nothing():
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 16, 8)])
    r(*_qwen_inputs(2, 4, 5))
    r(*_qwen_inputs(2, 4, 5))
    assert cuda.graphs == [] and len(engine.contexts) == 1
    assert not any(c[0] == "set_optimization_profile_async" for c in engine.calls)


def test_trt_runner_cuda_graph_on_gpu(tmp_path):
    """The real capture: needs an engine built here (QKROPE_TEST_ENGINE) on a CUDA GPU."""
    import os

    trt = pytest.importorskip("tensorrt", reason="requires TensorRT and CUDA")
    if not torch.cuda.is_available() or not os.environ.get("QKROPE_TEST_ENGINE"):
        pytest.skip("requires TensorRT and CUDA (and QKROPE_TEST_ENGINE=an attention-block "
                    "engine built by `qkrope build`)")
    del trt
    eager = load(os.environ["QKROPE_TEST_ENGINE"], copy_outputs=True)
    graphed = load(os.environ["QKROPE_TEST_ENGINE"], copy_outputs=True, cuda_graph=True)
    spec = eager.io.input(eager.io.roles["hidden_states"])
    width = spec.dims[2][0]
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(spec.dtype,
                                                                           torch.float32)
        hs = torch.randn(1, 16, width, generator=g).to("cuda", dtype)
        ehs = torch.randn(1, 5, width, generator=g).to("cuda", dtype)
        a = eager.run_positions(hs, ehs, img_shapes=[(1, 4, 4)])
        b = graphed.run_positions(hs, ehs, img_shapes=[(1, 4, 4)])
        torch.cuda.synchronize()
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


def test_trt_runner_refuses_a_sidecar_config_the_engine_was_not_built_from():
    """A permuted axes_dims_rope in the engine sidecar (engine_sha256 still valid) would build
    other RoPE caches: the engine's name records its build's config tag, which disagrees."""
    from qkrope.sidecars import EngineInfoError, config_tag

    trt, _ = ft.make_fake_trt()
    side = _engine_sidecar()
    engine = _multi_engine([_profile((1, 2), 16, 8)])
    engine.name = config_tag(side.config)
    loaded = loader_tensorrt.LoadedEngine(engine, trt, side)
    runner_tensorrt.TensorRTRunner(loaded, device=torch.device("cpu"), cuda=FakeCuda())  # agrees
    side.config.axes_dims_rope = side.config.axes_dims_rope[::-1]
    with pytest.raises(EngineInfoError, match="describes another config than the one"):
        runner_tensorrt.TensorRTRunner(loaded, device=torch.device("cpu"), cuda=FakeCuda())


def test_trt_runner_keeps_the_cuda_graphs_of_the_last_shapes_only():
    """Ever new shapes with cuda_graph=True: the graphs (and their static buffers) a thread
    keeps stay bounded; a shape that comes back after being dropped is captured again."""
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 64, 8)], cuda_graph=True)
    grids = [2, 3, 4, 5, 6, 7]  # six sets of shapes
    for grid in grids:
        r(*_qwen_inputs(2, grid, 5))
    assert len(cuda.graphs) == len(grids)
    assert len(r._local.graphs) == runner_tensorrt.GRAPHS_PER_THREAD
    r(*_qwen_inputs(2, grids[-1], 5))  # kept: replayed
    assert len(cuda.graphs) == len(grids) and cuda.graphs[-1].replays == 1
    r(*_qwen_inputs(2, grids[0], 5))  # dropped: captured again
    assert len(cuda.graphs) == len(grids) + 1
    assert len(r._local.graphs) == runner_tensorrt.GRAPHS_PER_THREAD

