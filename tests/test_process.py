"""Process-wide settings of a stage (services/common/process.py) and their config checks."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from bench.gil_switch import measure
from services.common.process import configure_process
from services.talker.config import TalkerConfig


def test_configure_process_sets_threads_and_the_gil_switch_interval():
    old_interval, old_threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        configure_process(1, 0.25)
        assert sys.getswitchinterval() == pytest.approx(0.00025) and torch.get_num_threads() == 1
        configure_process(0, 5.0)  # threads 0: torch's own setting is left alone
        assert sys.getswitchinterval() == pytest.approx(0.005) and torch.get_num_threads() == 1
        for bad in (0.0, -1.0, 1000.0):
            with pytest.raises(ValueError, match="gil_switch_ms"):
                configure_process(1, bad)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # a refused value changes nothing
    finally:
        sys.setswitchinterval(old_interval)
        torch.set_num_threads(old_threads)


def test_every_stage_config_checks_the_gil_switch_interval():
    from services.decoder.config import DecoderConfig
    from services.encoder.config import EncoderConfig

    ckpt = ["--checkpoint", "/x"]
    cfg = TalkerConfig.load(ckpt, env={})
    assert cfg.gil_switch_ms == 0.2  # services/common/process.py: why not CPython's 5 ms
    with pytest.raises(ValueError, match="gil_switch_ms"):
        replace(cfg, gil_switch_ms=0.0)
    assert EncoderConfig.load(ckpt, env={}).gil_switch_ms == 0.2
    assert DecoderConfig.load([*ckpt, "--gil-switch-ms", "1"], env={}).gil_switch_ms == 1.0
    for cls in (EncoderConfig, DecoderConfig, TalkerConfig):
        with pytest.raises(SystemExit, match="gil_switch_ms"):
            cls.load([*ckpt, "--gil-switch-ms", "0"], env={})


def test_gil_switch_bench_measures_a_row_and_restores_the_interval():
    old = sys.getswitchinterval()
    row = measure(0.5, ops=2, repeats=3)
    assert sys.getswitchinterval() == old
    assert row["interval_ms"] == 0.5 and 0 < row["ops_p50_ms"] <= row["ops_p99_ms"]
    assert row["busy_thread_work_per_s"] > 0
    alone = measure(5.0, ops=2, repeats=3, busy_thread=False)
    assert alone["busy_thread_work_per_s"] == 0  # no busy thread ran
