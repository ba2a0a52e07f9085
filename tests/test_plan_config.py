"""Fusion planning rules and GRADFUSE_* environment parsing."""
import numpy as np
import pytest

from gradfuse import config
from gradfuse.fusion.plan import FusionPlan

F32, F64 = 2, 3


def test_buckets_follow_given_order_and_threshold():
    sizes = [40, 40, 40, 1000, 40, 8, 0, 8]
    codes = [F32, F32, F32, F32, F32, F64, F32, F64]
    p = FusionPlan(codes, sizes, fusion_threshold=100)
    kinds = [(b.code, b.hi - b.lo, b.nbytes, b.direct) for b in p.buckets]
    assert kinds == [(F32, 2, 80, False), (F32, 2, 80, False), (F32, 1, 1000, True), (F64, 2, 16, False)]
    assert p.order.tolist() == [0, 1, 2, 4, 3, 5, 7]          # the empty tensor 6 is not sent
    assert p.offsets.tolist() == [0, 40, 0, 40, 0, 0, 8]
    for b in p.buckets:
        if not b.direct:
            assert b.buffer.ctypes.data % 64 == 0 and b.buffer.nbytes == b.nbytes


def test_threshold_zero_disables_fusion_and_direct_threshold():
    p = FusionPlan([F32] * 3, [4, 8, 12], fusion_threshold=0)
    assert all(b.direct for b in p.buckets) and len(p.buckets) == 3
    p = FusionPlan([F32] * 3, [4, 8, 12], fusion_threshold=100, direct_threshold=8)
    assert [b.direct for b in p.buckets] == [False, True, True]


@pytest.mark.parametrize("raw", ["", "abc", "-1", "1e3", "4294967296000000000000", " ", "1.5"])
def test_bad_threshold_env_names_variable(monkeypatch, raw):
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", raw)
    with pytest.raises(ValueError, match="GRADFUSE_FUSION_THRESHOLD"):
        config.fusion_threshold()


@pytest.mark.parametrize("raw", ["", "abc", "-1", "nan", "inf", " "])
def test_bad_seconds_env_names_variable(monkeypatch, raw):
    monkeypatch.setenv("GRADFUSE_STALL_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="GRADFUSE_STALL_TIMEOUT_S"):
        config.stall_timeout_s()


def test_env_defaults_and_values(monkeypatch):
    monkeypatch.delenv("GRADFUSE_STALL_TIMEOUT_S", raising=False)
    assert config.stall_timeout_s() == 600.0
    monkeypatch.setenv("GRADFUSE_STALL_TIMEOUT_S", " 0 ")
    assert config.stall_timeout_s() == 0.0
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", "4294967296")
    assert config.fusion_threshold() == 4294967296
    assert config.fusion_threshold(np.int64(5)) == 5
