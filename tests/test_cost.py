"""The cost model (gradfuse/compressors/cost.py): formulas against hand-computed values,
the crossovers the issue states, and the auto rule's inputs."""
import math

import pytest

from gradfuse.compressors import cost
from gradfuse.compressors.registry import create as make_compressor

N = 25_557_032          # ResNet-50's float32 gradient elements


def test_ring_formula_by_hand():
    link = cost.Link(1e9, 1e-4)
    rates = cost.Rates(float("inf"), float("inf"), reduce=2e9)
    for p in (2, 3, 8):
        S = 4.0 * N
        want = 2 * (p - 1) / p * S / 1e9 + 2 * (p - 1) * 1e-4 + (p - 1) / p * S / 2e9
        assert math.isclose(cost.predict("none", "ring", N, p, link, rates), want, rel_tol=1e-12)


def test_allgather_and_twophase_by_hand():
    link = cost.Link(1e8, 1e-5)
    rates = cost.Rates(1e10, 2e10)
    n, p = 1 << 20, 4
    P = cost.payload_bytes("1bit", n)
    assert P == 8 + 4 * (n // 32) + 4 * (n // 512)
    S = 4.0 * n
    ag = S / 1e10 + (p - 1) * P / 1e8 + (p - 1) * 1e-5 + p * S / 2e10
    tp = S / 1e10 + 2 * (p - 1) / p * P / 1e8 + 2 * (p - 1) * 1e-5 + S / 2e10 + S / (p * 1e10) + S / 2e10
    assert math.isclose(cost.predict("1bit", "allgather", n, p, link, rates), ag, rel_tol=1e-12)
    assert math.isclose(cost.predict("1bit", "twophase", n, p, link, rates), tp, rel_tol=1e-12)
    assert cost.bytes_per_rank("1bit", "allgather", n, p) == (p - 1) * P
    assert cost.bytes_per_rank("randomk", "sparse_allreduce", n, p, {"ratio": 0.01}) == \
        2 * (p - 1) / p * 4 * math.ceil(0.01 * n)


def test_payload_bytes_match_the_compressors_layouts():
    """The model's payload sizes are the wire's (header + 8-aligned arrays)."""
    from gradfuse.compressors.base import BucketContext
    from gradfuse.step.exchange import Wire
    counts = (1000, 7, 4096, 513)
    for name, opts in (("1bit", {}), ("1bit", {"block_size": 64}), ("2bit", {}), ("topk", {"ratio": 0.03}),
                       ("randomk", {"ratio": 0.05})):
        comp = make_compressor(name, **opts)
        ctx = BucketContext(bucket=0, step=0, device="cpu", counts=counts)
        assert cost.payload_bytes(comp, sum(counts), counts=counts) == Wire(comp.bucket_layout(ctx)).nbytes, name


def test_crossovers_resnet50_1gbit():
    """The issue's figures: allgather 1-bit breaks even near p = 64, 2-bit near 32, top-k
    (1 %) near 100; two-phase and the sparse allreduce stay ahead of the ring."""
    assert 40 <= cost.crossover("1bit", "allgather", N, "1gbit") <= 70
    assert 20 <= cost.crossover("2bit", "allgather", N, "1gbit") <= 40
    assert 80 <= cost.crossover("topk", "allgather", N, "1gbit") <= 120
    assert cost.crossover("1bit", "twophase", N, "1gbit") is None
    assert cost.crossover("randomk", "sparse_allreduce", N, "1gbit") is None
    ring = cost.predict("none", "ring", N, 2, "1gbit")
    assert 0.8 < ring < 0.85        # 2 * 102 MB / 2 / 125 MB/s


def test_best_prefers_allgather_at_two_ranks_and_twophase_for_large_buckets():
    for link in ("1gbit", "10gbit"):
        assert cost.best("1bit", ("allgather", "twophase"), 1 << 22, 2, link) == "allgather"
        assert cost.best("1bit", ("allgather", "twophase"), 1 << 22, 8, link) == "twophase"
        assert cost.best("1bit", ("allgather", "twophase"), 1024, 3, link) == "allgather"   # latency-bound


def test_link_parsing():
    assert cost.link_from("1gbit").bandwidth == 125e6
    assert cost.link_from("400mbit").bandwidth == pytest.approx(50e6)
    assert cost.link_from("2.5GB").bandwidth == 2.5e9
    assert cost.link_from(1e9, latency=0.0).latency == 0.0
    for bad in ("fast", "-1gbit", "gbit", None, True):
        with pytest.raises(ValueError):
            cost.link_from(bad)
    with pytest.raises(ValueError, match="unknown algorithm"):
        cost.predict("1bit", "tree", 10, 2, "1gbit")


def test_auto_follows_the_cost_model_per_bucket_and_p():
    one = make_compressor("1bit")
    rk = make_compressor("randomk")
    fast, slow = cost.link_from("10gbit"), cost.link_from("1gbit")
    assert one.algorithm_for(1 << 22, 1) == "allgather"
    assert one.algorithm_for(1 << 22, 2) == "allgather"
    assert one.algorithm_for(1 << 16, 3) == "allgather"               # was two-phase before the model
    assert one.algorithm_for(1 << 19, 3) == "twophase"                # default link: 10 Gbit/s
    assert one.algorithm_for(1 << 18, 3, link=fast) == "allgather"
    assert one.algorithm_for(1 << 18, 3, link=slow) == "twophase"     # a slower link pays off sooner
    for n, p in ((1 << 18, 3), (1 << 20, 8), (1000, 64)):
        want = cost.best(one, ("allgather", "twophase"), n, p, cost.DEFAULT_LINK)
        assert one.algorithm_for(n, p) == want
    assert rk.algorithm_for(1 << 20, 2) == "allgather"
    assert rk.algorithm_for(1 << 20, 8, link=slow) == "sparse_allreduce"
    assert make_compressor("randomk", algorithm="allreduce").algorithm_for(10, 2) == "sparse_allreduce"
    assert make_compressor("1bit", algorithm="twophase").algorithm_for(10, 2) == "twophase"
    assert make_compressor("topk").algorithm_for(1 << 22, 64) == "allgather"
    with pytest.raises(ValueError, match="'algorithm' must be one of auto, allgather, allreduce"):
        make_compressor("randomk", algorithm="twophase")


def test_pipeline_link_option_round_trips_and_needs_a_bandwidth():
    import gradfuse
    pipe = gradfuse.Pipeline(compress="1bit", link_bandwidth="1gbit", comm=gradfuse.comm.SingleProcessCommunicator())
    cfg = pipe.get_config()
    assert cfg["link_bandwidth"] == 125e6 and cfg["link_latency"] == 50e-6
    assert gradfuse.Pipeline(**cfg, comm=gradfuse.comm.SingleProcessCommunicator()).link == pipe.link
    with pytest.raises(ValueError, match="needs link_bandwidth"):
        gradfuse.Pipeline(compress="1bit", link_latency=1e-5)
    with pytest.raises(ValueError, match="needs link_bandwidth"):
        gradfuse.Pipeline(compress="1bit", uncompressed_if_faster=True)
    with pytest.raises(ValueError, match="link bandwidth 'fast'"):
        gradfuse.Pipeline(compress="1bit", link_bandwidth="fast")
