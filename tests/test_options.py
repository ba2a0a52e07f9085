"""Every option's range is checked when the compressor (or the pipeline) is made: a value
out of range is refused at construction, naming the compressor, the option, the value and
the valid range, never at the first allreduce; and the edges of each range work."""
import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.compressors import create
from gradfuse.compressors.base import MAX_BLOCK

FLT_MAX = float(np.finfo(np.float32).max)

# (compressor, options, option named in the error, range text the error holds)
BAD = [
    ("1bit", {"block_size": 2**31}, "block_size", f"[32, {MAX_BLOCK}]"),
    ("1bit", {"block_size": 2**40}, "block_size", f"[32, {MAX_BLOCK}]"),
    ("1bit", {"block_size": 16}, "block_size", f"[32, {MAX_BLOCK}]"),
    ("1bit", {"algorithm": "ring"}, "algorithm", "one of auto, allgather, twophase"),
    ("1bit", {"velocity": "global"}, "velocity", "one of sent, local"),
    ("2bit", {"block_size": 2**31}, "block_size", f"[32, {MAX_BLOCK}]"),
    ("2bit", {"factor": 1e300}, "factor", "[0, 3.40282e+38]"),
    ("2bit", {"factor": float("nan")}, "factor", "[0, 3.40282e+38]"),
    ("2bit", {"threshold": 1e300}, "threshold", "(0, 3.40282e+38]"),
    ("2bit", {"threshold": 3.5e38}, "threshold", "(0, 3.40282e+38]"),
    ("2bit", {"threshold": 1e-50}, "threshold", "(0, 3.40282e+38]"),      # 0 as a float32
    ("topk", {"ratio": 0}, "ratio", "(0, 1]"),
    ("topk", {"ratio": 1.5}, "ratio", "(0, 1]"),
    ("randomk", {"ratio": float("nan")}, "ratio", "(0, 1]"),
    ("randomk", {"seed": 2**64}, "seed", "[0, 2**64)"),
    ("randomk", {"seed": -1}, "seed", "[0, 2**64)"),
    ("fp16", {"sum16": "fast"}, "sum16", "'exact' or 'nccl'"),
    ("bf16", {"predivide": 1}, "predivide", "True or False"),
    ("1bit", {"warmup_steps": 2**70}, "warmup_steps", "[0, 2**63 - 1]"),
    ("1bit", {"warmup_steps": -1}, "warmup_steps", "[0, 2**63 - 1]"),
    ("topk", {"sparsity_warmup": 2**63}, "sparsity_warmup", "[0, 2**63 - 1]"),
    ("2bit", {"momentum": 1.0}, "momentum", "[0, 1)"),
    ("2bit", {"error_feedback": "yes"}, "error_feedback", "True or False"),
]


@pytest.mark.parametrize("name,opts,option,valid", BAD, ids=[f"{n}-{o}-{list(k.values())[0]!r}" for n, k, o, _ in BAD])
def test_an_option_out_of_range_is_refused_at_construction(name, opts, option, valid):
    """Refused by ``create`` and by ``Pipeline``, before any data moves, with the
    compressor, the option, the value and the range in the message."""
    for make in (lambda: create(name, **opts), lambda: gradfuse.Pipeline(compress=name, comm=SingleProcessCommunicator(), **opts)):
        with pytest.raises((TypeError, ValueError)) as info:
            make()
        msg = str(info.value)
        assert f"compressor {name!r}" in msg, msg
        assert repr(option) in msg, msg
        assert repr(opts[option]) in msg, msg
        assert valid in msg, msg


class Strict(gradfuse.compressors.Compressor):
    """A user compressor whose validate() says nothing of its name."""

    name = "strict"
    OPTIONS = {"level": 1}

    def validate(self):
        if self.options["level"] not in (1, 2):
            raise ValueError(f"option 'level' must be 1 or 2, got {self.options['level']!r}")

    def payload_layout(self, n):
        return [(np.dtype(np.float32), n)]

    def compress(self, c, payloads, ctx):
        payloads[0][...] = c

    def decompress(self, payloads, n, ctx):
        return payloads[0]


def test_a_user_compressors_validate_errors_name_the_compressor():
    with pytest.raises(ValueError, match=r"^compressor 'strict': option 'level' must be 1 or 2, got 3$"):
        Strict(level=3)


# the edges of each range: accepted at construction, and the first allreduce runs
EDGES = [("1bit", {"block_size": MAX_BLOCK}), ("1bit", {"block_size": 32}), ("2bit", {"block_size": MAX_BLOCK}),
         ("2bit", {"factor": FLT_MAX}), ("2bit", {"threshold": FLT_MAX}), ("2bit", {"factor": 0.0}),
         ("topk", {"ratio": 1e-300}), ("topk", {"ratio": 1}), ("randomk", {"seed": 2**64 - 1}),
         ("1bit", {"warmup_steps": 2**63 - 1}), ("topk", {"sparsity_warmup": 2**63 - 1})]


@pytest.mark.parametrize("name,opts", EDGES, ids=[f"{n}-{k}" for n, k in EDGES])
def test_the_edges_of_each_range_run(name, opts):
    pipe = gradfuse.Pipeline(compress=name, comm=SingleProcessCommunicator(), **opts)
    g = [np.linspace(-1, 1, 1000, dtype=np.float32), np.ones(3000, np.float32)]
    out = pipe.allreduce(g)
    assert [o.shape for o in out] == [(1000,), (3000,)]
    assert all(np.isfinite(o).all() for o in out)


@pytest.mark.parametrize("option,value", [("fusion_threshold", 2**41), ("fusion_threshold", -1),
                                          ("direct_threshold", 2**70), ("direct_threshold", 1.5)])
def test_pipeline_thresholds_have_a_range(option, value):
    """The argument takes the range its environment variable takes, [0, 2**40] bytes."""
    with pytest.raises(ValueError, match=rf"^{option} must be an int of bytes in \[0, 2\*\*40\], got {value!r}$"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator(), **{option: value})
    assert gradfuse.Pipeline(comm=SingleProcessCommunicator(), **{option: 2**40}).get_config()[option] == 2**40


@pytest.mark.parametrize("opts", [{"link_bandwidth": -1}, {"link_bandwidth": float("inf")},
                                  {"link_bandwidth": "1gbit", "link_latency": -1e-6},
                                  {"link_bandwidth": "1gbit", "link_latency": "x"}])
def test_pipeline_link_options_are_named(opts):
    with pytest.raises(ValueError) as info:
        gradfuse.Pipeline(compress="1bit", comm=SingleProcessCommunicator(), **opts)
    msg = str(info.value)
    assert "link_bandwidth=" in msg and "link_latency=" in msg and repr(list(opts.values())[-1]) in msg, msg
