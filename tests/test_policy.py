"""The layer policy: which compressor each tensor gets, by name and size (one rank; the
cross-rank agreement is in tests/mpi/test_policy.py)."""
import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.compressors.policy import LayerPolicy


@pytest.fixture(scope="module")
def comm():
    return SingleProcessCommunicator()


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return {"conv1.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
            "conv1.bias": rng.standard_normal(8).astype(np.float32),
            "bn1.norm.weight": rng.standard_normal(8).astype(np.float32),
            "fc.weight": rng.standard_normal((10, 64)).astype(np.float32),
            "fc.bias": rng.standard_normal(10).astype(np.float32)}


def test_patterns_choose_per_tensor_first_match_wins(comm):
    pipe = gradfuse.Pipeline(compress={"*.bias": None, "*norm*": None, "fc.*": "topk", "*": "1bit"},
                             comm=comm, average=False)
    g = _grads()
    out = pipe.allreduce(g)
    for k in ("conv1.bias", "bn1.norm.weight", "fc.bias"):     # uncompressed: exact
        assert out[k].tobytes() == g[k].tobytes(), k
    assert not np.array_equal(out["conv1.weight"], g["conv1.weight"])      # 1-bit: lossy
    topk = out["fc.weight"]
    assert np.count_nonzero(topk) == max(1, int(np.ceil(0.01 * topk.size)))
    groups = {b.group for b in pipe._plans[next(iter(pipe._plans))].plan.buckets}
    assert groups == {0, 1, 2}            # uncompressed, topk and 1bit never share a bucket
    assert pipe.compressor.name == "topk" and "1bit" in pipe.policy.name


def test_a_policy_equals_separate_pipelines(comm):
    """Tensors of each compressor give what a pipeline of that compressor alone gives them."""
    pol = gradfuse.Pipeline(compress={"*.bias": None, "*": {"name": "1bit", "block_size": 32}}, comm=comm)
    one = gradfuse.Pipeline(compress="1bit", block_size=32, comm=comm)
    for step in range(3):
        g = _grads(step)
        got = pol.allreduce(g)
        weights = {k: v for k, v in g.items() if not k.endswith(".bias")}
        want = one.allreduce(weights)
        for k in weights:
            assert got[k].tobytes() == want[k].tobytes(), (step, k)


def test_min_elements_gate(comm):
    pipe = gradfuse.Pipeline(compress="1bit", min_elements=100, comm=comm, average=False)
    g = _grads()
    out = pipe.allreduce(g)
    for k, v in g.items():
        if v.size < 100:
            assert out[k].tobytes() == v.tobytes(), k
        else:
            assert not np.array_equal(out[k], v), k
    assert pipe.get_config()["min_elements"] == 100
    with pytest.raises(ValueError, match="min_elements must be a non-negative int, got -1"):
        gradfuse.Pipeline(compress="1bit", min_elements=-1, comm=comm)


def test_get_config_round_trips_a_policy(comm):
    pipe = gradfuse.Pipeline(compress={"*.bias": None, "*": {"name": "topk", "ratio": 0.05}},
                             min_elements=3, comm=comm, nonfinite="skip")
    cfg = pipe.get_config()
    again = gradfuse.Pipeline(comm=comm, **cfg)
    assert again.get_config() == cfg
    assert again._options() == pipe._options()
    g = _grads()
    a, b = pipe.allreduce(g), again.allreduce(g)
    assert all(a[k].tobytes() == b[k].tobytes() for k in g)


def test_one_compressor_keeps_its_config_and_residual_keys(comm):
    """Without a policy nothing changes in what the ranks agree on or what is checkpointed."""
    pipe = gradfuse.Pipeline(compress="1bit", comm=comm)
    assert pipe._options()["compress"] == pipe.compressor.get_config()
    assert pipe.policy.single and pipe.policy.get_config() == pipe.compressor.get_config()


def test_policy_errors_name_the_problem(comm):
    with pytest.raises(TypeError, match="cannot be given beside a layer policy"):
        gradfuse.Pipeline(compress={"*": "topk"}, ratio=0.1, comm=comm)
    with pytest.raises(ValueError, match="pattern 'fc.*': unknown compressor 'nope'"):
        gradfuse.Pipeline(compress={"fc.*": "nope"}, comm=comm)
    with pytest.raises(TypeError, match="patterns must be non-empty strings, got 3"):
        gradfuse.Pipeline(compress={3: "1bit"}, comm=comm)


def test_unmatched_tensors_and_other_dtypes_go_uncompressed(comm):
    pipe = gradfuse.Pipeline(compress={"w*": "1bit"}, comm=comm, average=False)
    g = {"w": np.linspace(-1, 1, 64).astype(np.float32), "x": np.linspace(-1, 1, 64).astype(np.float32),
         "wd": np.arange(4, dtype=np.float64)}
    out = pipe.allreduce(g)
    assert out["x"].tobytes() == g["x"].tobytes() and out["wd"].tobytes() == g["wd"].tobytes()
    assert not np.array_equal(out["w"], g["w"])


def test_integer_positions_match_as_strings():
    pol = LayerPolicy.create({"1": None, "*": "2bit"})
    assert [pol.group(i, 10) for i in range(3)] == [1, 0, 1]


def test_rules_with_the_same_compressor_share_its_buckets(comm):
    pipe = gradfuse.Pipeline(compress={"a": "1bit", "b": {"name": "1bit"}, "c": "topk", "*": None}, comm=comm)
    assert [c.name for c in pipe.policy.compressors] == ["none", "1bit", "topk"]
    g = {k: np.linspace(-1, 1, 50).astype(np.float32) for k in "abcd"}
    pipe.allreduce(g)
    buckets = next(iter(pipe._plans.values())).plan.buckets
    assert sorted(b.group for b in buckets) == [0, 1, 2]      # a and b in one 1-bit bucket
