"""``qkrope.apps.bench.config``: the flags of ``qkrope bench`` read into its Config, the presets,
the thread sets and the attention forms."""

from __future__ import annotations

import pytest

from qkrope.apps.bench import config


def test_parse_int_list():
    assert config.parse_int_list("512, 1024") == [512, 1024]
    with pytest.raises(ValueError):
        config.parse_int_list("512,x")


def test_cpu_threads_default_to_one_on_the_cpu():
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu")
    assert config.cpu_threads(cfg) == 1 == config.DEFAULT_CPU_THREADS
    cfg.threads = 3
    assert config.cpu_threads(cfg) == 3
    cfg.threads, cfg.device = None, "cuda"
    assert config.cpu_threads(cfg) is None


def test_parse_threads_and_forms(monkeypatch):
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert config.available_threads() == 4
    assert config.parse_threads("1,all") == [1, 4]
    assert config.parse_threads("all,1") == [4, 1]
    assert config.parse_threads("2, 1, 2") == [2, 1]          # each count once, order kept
    assert config.parse_threads("1,ALL,4") == [1, 4]
    assert config.parse_threads(3) == [3] and config.parse_threads([1, "all"]) == [1, 4]
    for bad in ("0", "1,x", "", ",", "-2", "1.5"):
        with pytest.raises(ValueError, match="--threads"):
            config.parse_threads(bad)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert config.parse_threads("1,all") == [1]                 # one CPU: one set
    assert config.parse_attention_forms("onnx23, primitive") == ["onnx23", "primitive"]
    assert config.parse_attention_forms("primitive,primitive") == ["primitive"]
    for bad in ("", "sdpa", "primitive,onnx22"):
        with pytest.raises(ValueError, match="--attention"):
            config.parse_attention_forms(bad)


def test_thread_counts_of_a_config():
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu")
    assert config.thread_counts(cfg) == [1]
    cfg.threads = [2, 1]
    assert config.thread_counts(cfg) == [2, 1] and config.cpu_threads(cfg) == 2
    cfg.threads, cfg.device = None, "cuda:0"
    assert config.thread_counts(cfg) == [None]


def test_preset_qwen_and_flags_over_it(monkeypatch):
    from qkrope import cli

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    parser = cli.build_parser()
    cfg = config.config_from_args(parser.parse_args(["bench", "--preset", "qwen", "--device",
                                                    "cpu"]))
    assert (cfg.heads, cfg.head_dim, cfg.sizes, cfg.text_len, cfg.batches) == \
        (24, 128, [256, 512], 128, [1])
    assert (cfg.dtype, cfg.threads, cfg.iters, cfg.warmup) == ("float32", [1, 2], 5, 2)
    assert cfg.attention is None and cfg.profile_runs == 3
    cfg = config.config_from_args(parser.parse_args(
        ["bench", "--preset", "qwen", "--device", "cpu", "--heads", "2", "--threads", "1",
         "--warmup", "0", "--attention", "primitive", "--profile-runs", "0"]))
    assert (cfg.heads, cfg.head_dim, cfg.threads, cfg.warmup) == (2, 128, [1], 0)
    assert cfg.attention == ["primitive"] and cfg.profile_runs == 0
    # without a preset: the small CPU defaults of the quick path
    cfg = config.config_from_args(parser.parse_args(["bench", "--device", "cpu"]))
    assert (cfg.heads, cfg.head_dim, cfg.sizes, cfg.text_len, cfg.threads) == \
        (2, 64, [256], 64, None)
    with pytest.raises(ValueError, match="--threads"):
        config.config_from_args(parser.parse_args(["bench", "--device", "cpu", "--threads",
                                                  "0"]))


def test_a_kept_bench_work_folder_has_the_umask_mode(tmp_path, monkeypatch):
    """The work folder (mkdtemp: 0700) is kept when it holds engines: it is an output then and
    gets the mode a plain mkdir gives (issue 26)."""
    import os

    from qkrope.apps.bench import orchestrate

    def fake_bench(cfg, workdir, rows, *a):
        (workdir / "attention.engine").write_bytes(b"\x00")
        return rows

    monkeypatch.setattr(orchestrate, "_bench_in", fake_bench)
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                        text_len=8, iters=1, warmup=0, device="cpu", seed=3, out=tmp_path)
    old = os.umask(0o022)
    try:
        orchestrate.run_bench(cfg, log=lambda m: None)
    finally:
        os.umask(old)
    (work,) = [p for p in tmp_path.iterdir() if p.name.startswith("qkrope-bench-")]
    assert oct(work.stat().st_mode & 0o777) == oct(0o755)
