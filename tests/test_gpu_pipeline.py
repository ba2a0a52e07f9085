"""gradfuse.Pipeline on GPU arrays, one rank: bit-identical to the host path for every
compressor (outputs and residuals), in place / out= / new outputs, checkpoints that move
between host and GPU, and the errors of mixed or bad input.

Marked ``gpu``: skipped without a GPU, failed with GRADFUSE_TEST_GPU=1, and run on the
CPU SIMT emulator by tests/test_gpu_emulated.py (GRADFUSE_GPU_EMULATOR=1).
"""
import gc
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest_gpu import emulated, require_gpu  # noqa: E402
from gpu_pipeline_cases import COMPRESSORS, case_id, make_grads, run_steps, same_bits  # noqa: E402
from dlpack_capsules import READ_ONLY, capsule_name, make_capsule  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.comm.single import SingleProcessCommunicator  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    return require_gpu()[0]


@pytest.fixture(scope="module")
def comm():
    return SingleProcessCommunicator()


@pytest.mark.parametrize("case", COMPRESSORS, ids=case_id)
def test_gpu_equals_host_every_compressor(cp, comm, case):
    run_steps(cp, case[0], case[1], rank=0, comm=comm, steps=3, mode="out")


@pytest.mark.parametrize("mode", ["inplace", "new"])
@pytest.mark.parametrize("name", ["none", "1bit", "fp16"])
def test_gpu_call_forms(cp, comm, name, mode):
    run_steps(cp, name, {}, rank=0, comm=comm, steps=2, mode=mode)


def test_gpu_list_names_and_tuple(cp, comm):
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    xs = (cp.arange(5, dtype=cp.float32), cp.arange(3, dtype=cp.int64))
    out = pipe.allreduce(xs, names=["a", "b"])
    assert isinstance(out, tuple) and out[0].get().tolist() == [0, 1, 2, 3, 4]
    assert out[1].get().tolist() == [0, 1, 2]


def test_gpu_checkpoint_moves_between_host_and_gpu(cp, comm, tmp_path):
    """A residual saved on the GPU restores on the host (and back): the keys do not depend
    on the device, and the next step gives the same bits on either."""
    dev = gradfuse.Pipeline(compress="1bit", fusion_threshold=4096, comm=comm, block_size=64)
    for step in range(2):
        dev.allreduce({k: cp.asarray(v) for k, v in make_grads(0, step, dtypes=False).items()})
    path = str(tmp_path / "gpu.npz")
    dev.save_state(path)
    host = gradfuse.Pipeline(compress="1bit", fusion_threshold=4096, comm=comm, block_size=64)
    assert host.load_state(path)
    g = make_grads(0, 2, dtypes=False)
    want = host.allreduce(g)
    got = dev.allreduce({k: cp.asarray(v) for k, v in g.items()})
    for k in g:
        assert same_bits(want[k], got[k].get()), k
    # and the same pipeline switching device keeps its residuals
    g = make_grads(0, 3, dtypes=False)
    a = host.allreduce({k: cp.asarray(v) for k, v in g.items()})
    b = dev.allreduce(g)
    for k in g:
        assert same_bits(a[k].get(), b[k]), k


def test_gpu_nonfinite_refused(cp, comm):
    pipe = gradfuse.Pipeline(compress="1bit", comm=comm)
    x = cp.asarray(np.array([1.0, np.nan, 2.0], np.float32))
    before = x.get()
    with pytest.raises(gradfuse.NonFiniteError, match="non-finite"):
        pipe.allreduce_([x], names=["w"])
    assert same_bits(x.get(), before)


def test_gpu_mixed_host_and_device_named(cp, comm):
    pipe = gradfuse.Pipeline(comm=comm)
    with pytest.raises(TypeError, match="tensor 'b' is in host memory but tensor 'a' is on a GPU"):
        pipe.allreduce({"a": cp.zeros(3, cp.float32), "b": np.zeros(3, np.float32)})
    if not emulated():       # the emulator's arrays are host memory with the buffer protocol
        with pytest.raises(TypeError, match="tensor 'b' is on a GPU but tensor 'a' is in host memory"):
            pipe.allreduce({"a": np.zeros(3, np.float32), "b": cp.zeros(3, cp.float32)})
    with pytest.raises(TypeError, match="output 'a' is in host memory"):
        pipe.allreduce({"a": cp.zeros(3, cp.float32)}, out={"a": np.zeros(3, np.float32)})
    # the pipeline still works afterwards
    assert pipe.allreduce({"a": cp.ones(3, cp.float32)})["a"].get().tolist() == [1.0] * 3


def test_gpu_bad_dtype_and_layout_named(cp, comm):
    pipe = gradfuse.Pipeline(comm=comm)
    with pytest.raises(TypeError, match="tensor 'c': dtype uint8 is not supported"):
        pipe.allreduce({"c": cp.zeros(3, cp.uint8)})
    x = cp.zeros((4, 4), cp.float32)
    with pytest.raises(ValueError, match="tensor 'w' is not C-contiguous"):
        pipe.allreduce_({"w": x[:, ::2]})
    # a strided input (not in place) is copied
    y = cp.asarray(np.arange(16, dtype=np.float32).reshape(4, 4))
    out = pipe.allreduce({"w": y[:, ::2]})
    assert out["w"].get().tolist() == np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2].tolist()


def test_gpu_cuda_array_interface_object(cp, comm):
    """Any object with __cuda_array_interface__ (numba, PyTorch, ...) is read without a copy."""

    class Foreign:
        def __init__(self, arr):
            self.arr = arr
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    a = cp.asarray(np.arange(6, dtype=np.float32))
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    res = pipe.allreduce_([Foreign(a)], names=["f"])
    assert res[0].arr is a and a.get().tolist() == list(range(6))
    out = pipe.allreduce([Foreign(a)], names=["f"])
    assert isinstance(out[0], cp.ndarray) and out[0].get().tolist() == list(range(6))


def _capsule(cp, arr, versioned=True, **kw):
    """A kDLCUDA capsule over a cupy array's memory, legacy or versioned (tests/dlpack_capsules.py)."""
    return make_capsule(arr.data.ptr, arr.shape, arr.dtype, device=(2, arr.device.id), versioned=versioned,
                        owner=arr, **kw)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_gpu_dlpack_capsule_and_producer(cp, comm, versioned):
    """CUDA DLPack: raw capsules of both kinds (MXNet's to_dlpack_for_write gives a legacy
    one, cupy 14's toDlpack() a versioned one) and objects with __dlpack__/__dlpack_device__,
    read and written without a copy; the capsule is renamed and its deleter called once."""
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    a = cp.asarray(np.arange(6, dtype=np.float32))
    cap, rec = _capsule(cp, a, versioned)
    assert gradfuse.fusion.intake.capsule_device(cap) == (2, a.device.id)
    out = pipe.allreduce_([cap], names=["cap"])
    assert a.get().tolist() == list(range(6)) and len(out) == 1
    assert capsule_name(cap) == ("used_dltensor_versioned" if versioned else "used_dltensor")
    # written through the capsule: out=
    dst = cp.zeros(6, cp.float32)
    cap, rec = _capsule(cp, dst, versioned)
    res = pipe.allreduce([a], out=[cap], names=["cap"])
    assert res[0] is cap and dst.get().tolist() == list(range(6))
    del out, res, cap
    pipe.allreduce([a], names=["cap"])        # the communication thread lets go of the last step
    gc.collect()
    assert rec.deleted == 1
    # the producer's own capsules (toDlpack(): versioned on cupy >= 14, legacy before)
    assert pipe.allreduce([a.toDlpack()], names=["cap"])[0].get().tolist() == list(range(6))

    class Producer:
        def __init__(self, arr):
            self.arr = arr
            self.calls = []

        def __dlpack_device__(self):
            return (2, self.arr.device.id)

        def __dlpack__(self, stream=None, max_version=None):
            self.calls.append((stream, max_version))
            return _capsule(cp, self.arr, max_version is not None and max_version >= (1, 0))[0]

    class OldProducer(Producer):          # before DLPack 1.0: no max_version
        def __dlpack__(self, stream=None):
            self.calls.append((stream, None))
            return _capsule(cp, self.arr, versioned=False)[0]

    b = cp.asarray(np.full(4, 2.0, np.float32))
    for cls in (Producer, OldProducer):
        prod = cls(b)
        res = pipe.allreduce([prod], names=["p"])
        assert isinstance(res[0], cp.ndarray) and res[0].get().tolist() == [2.0] * 4
        assert prod.calls and prod.calls[-1][0] not in (None, 0)     # a stream was passed
        assert prod.calls[0][1] == ((1, 0) if cls is Producer else None) and len(prod.calls) == 1
        dst = cp.zeros(4, cp.float32)
        pipe.allreduce([b], out=[cls(dst)], names=["p"])
        assert dst.get().tolist() == [2.0] * 4
        pipe2 = gradfuse.Pipeline(comm=comm)
        pipe2.allreduce_([cls(b)], names=["p"])
        assert b.get().tolist() == [2.0] * 4


def test_gpu_dlpack_read_only_and_unsupported_version(cp, comm):
    """A versioned capsule's read-only flag: read as an input, refused as an output; a
    capsule of another DLPack major version is refused, naming the tensor, unconsumed."""
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    a = cp.asarray(np.arange(3, dtype=np.float32))
    ro = _capsule(cp, a, flags=READ_ONLY)[0]
    assert pipe.allreduce([ro], names=["r"])[0].get().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="tensor 'r' is read-only; the results cannot be written into it"):
        pipe.allreduce_([_capsule(cp, a, flags=READ_ONLY)[0]], names=["r"])
    with pytest.raises(ValueError, match="tensor 'r' is read-only; the results cannot be written into it"):
        pipe.allreduce([a], out=[_capsule(cp, cp.zeros(3, cp.float32), flags=READ_ONLY)[0]], names=["r"])
    for first in (True, False):
        cap, rec = _capsule(cp, a, version=(2, 0))
        grads = {"v": cap} if first else {"a": a, "v": cap}
        with pytest.raises(TypeError, match=r"tensor 'v': DLPack 2\.0 capsule; gradfuse reads DLPack 1\.x"):
            pipe.allreduce(grads)
        assert capsule_name(cap) == "dltensor_versioned"
    assert pipe.allreduce({"a": a})["a"].get().tolist() == [0.0, 1.0, 2.0]


class _CAIAndDLPack:
    """A PyTorch-like CUDA tensor: __cuda_array_interface__ without a stream (version 2)
    and a stream-ordering __dlpack__; ``raise_cai`` makes the interface raise RuntimeError
    (PyTorch, requires_grad=True), ``dlpack=False`` leaves DLPack out."""

    def __init__(self, cp, arr, raise_cai=False, dlpack=True, device=True):
        self.cp, self.arr, self.raise_cai = cp, arr, raise_cai
        self.cai_reads, self.calls = 0, []
        if dlpack:
            self.__dlpack__ = self._dlpack
            if device:
                self.__dlpack_device__ = lambda: (2, arr.device.id)

    @property
    def __cuda_array_interface__(self):
        self.cai_reads += 1
        if self.raise_cai:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")
        cai = dict(self.arr.__cuda_array_interface__)
        cai["version"] = 2
        cai.pop("stream", None)
        return cai

    def _dlpack(self, stream=None, max_version=None):
        self.calls.append(stream)
        return _capsule(self.cp, self.arr, max_version is not None)[0]


def test_gpu_dlpack_preferred_over_cuda_array_interface(cp, comm):
    """An object with both protocols is read through __dlpack__(stream=...), which orders a
    side stream's work, never through its stream-less __cuda_array_interface__."""
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    b = cp.asarray(np.arange(4, dtype=np.float32))
    for grads in ([_CAIAndDLPack(cp, b)], [cp.ones(2, cp.float32), _CAIAndDLPack(cp, b)]):
        res = pipe.allreduce(grads)
        t = grads[-1]
        assert res[-1].get().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert t.cai_reads == 0 and len(t.calls) == 1 and t.calls[0] not in (None, 0)
    dst = cp.zeros(4, cp.float32)
    out = _CAIAndDLPack(cp, dst)
    pipe.allreduce([b], out=[out])
    assert dst.get().tolist() == [0.0, 1.0, 2.0, 3.0] and out.cai_reads == 0 and out.calls


def test_gpu_cuda_array_interface_that_raises(cp, comm):
    """PyTorch raises RuntimeError (not AttributeError) from __cuda_array_interface__ when
    requires_grad=True: DLPack is used instead, or a TypeError names the tensor."""
    pipe = gradfuse.Pipeline(comm=comm, average=False)
    b = cp.asarray(np.arange(3, dtype=np.float32))
    for device in (True, False):       # with and without __dlpack_device__
        for first in (True, False):
            t = _CAIAndDLPack(cp, b, raise_cai=True, device=device)
            grads = {"g": t} if first else {"a": cp.ones(2, cp.float32), "g": t}
            assert pipe.allreduce(grads)["g"].get().tolist() == [0.0, 1.0, 2.0]
            assert len(t.calls) == 1 and t.calls[0] not in (None, 0)
    for first in (True, False):
        t = _CAIAndDLPack(cp, b, raise_cai=True, dlpack=False)
        grads = {"g": t} if first else {"a": cp.ones(2, cp.float32), "g": t}
        with pytest.raises(TypeError, match=r"tensor 'g': reading the __cuda_array_interface__ of .*_CAIAndDLPack "
                                            r"raised RuntimeError: Can't get"):
            pipe.allreduce(grads)
    dst = cp.zeros(3, cp.float32)
    with pytest.raises(TypeError, match=r"tensor 'g': reading the __cuda_array_interface__"):
        pipe.allreduce({"g": b}, out={"g": _CAIAndDLPack(cp, dst, raise_cai=True, dlpack=False)})
    pipe.allreduce({"g": b}, out={"g": _CAIAndDLPack(cp, dst, raise_cai=True)})
    assert dst.get().tolist() == [0.0, 1.0, 2.0]


def test_gpu_one_device_per_rank(cp, comm):
    """A second device on the same communicator is refused before the ranks agree."""
    from gradfuse.runtime import context as runtime
    pipe = gradfuse.Pipeline(comm=comm)
    pipe.allreduce({"a": cp.ones(2, cp.float32)})
    ctx = runtime.context(comm)
    assert ctx.gpu_device == 0
    ctx.gpu_device = 5          # pretend this rank's earlier steps used GPU 5
    try:
        with pytest.raises(ValueError, match="this rank's earlier GPU steps on this communicator used GPU 5"):
            pipe.allreduce({"a": cp.ones(2, cp.float32)})
    finally:
        ctx.gpu_device = 0
    assert pipe.allreduce({"a": cp.ones(2, cp.float32)})["a"].get().tolist() == [1.0, 1.0]


def test_gpu_resident_tables_upload_once(cp, comm):
    """Plan tables are uploaded once per device and reused; a resident table gives the
    same results as a plain host table, and is validated the same way."""
    from gradfuse import gpu
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=4096)
    g = {k: cp.asarray(v) for k, v in make_grads(0, 0).items()}
    pipe.allreduce(g)
    plan = next(iter(pipe._plans.values())).plan
    first = plan.device_tables.offsets._dev[0]
    pipe.allreduce(g)
    assert plan.device_tables.offsets._dev[0] is first
    src = cp.asarray(np.arange(40, dtype=np.uint8))
    offs, sizes = np.array([0, 10, 25], np.int64), np.array([10, 15, 15], np.int64)
    ptrs = np.int64(src.data.ptr) + offs
    a, b = cp.zeros(40, cp.uint8), cp.zeros(40, cp.uint8)
    gpu.pack(a, ptrs, offs, sizes, 0, 3)
    gpu.pack(b, gpu.resident(ptrs), gpu.resident(offs), gpu.resident(sizes), 0, 3)
    assert a.get().tolist() == b.get().tolist() == list(range(40))
    with pytest.raises(ValueError, match="a row has elements and a NULL pointer"):
        gpu.pack(b, gpu.resident(np.zeros(3, np.int64)), gpu.resident(offs), gpu.resident(sizes), 0, 3)


def test_gpu_user_compressor_fused_methods_stay_on_host(cp, comm):
    """A registered compressor whose fused methods take host pointers (no supports_cuda)
    is run on the GPU through its plain methods: the fused ones never see device memory,
    and the result equals the host path's."""
    from gradfuse.compressors import register_compressor
    from gradfuse.compressors.onebit import OneBit

    calls = []

    class HostOnlyOneBit(OneBit):
        name = "test-hostonly-1bit"
        supports_cuda = False

        def compress_table(self, table, e_in, e_out, payloads, ctx):
            calls.append(ctx.device)
            return super().compress_table(table, e_in, e_out, payloads, ctx)

        def decompress_sum_table(self, rows, table, divisor, ctx):
            calls.append(ctx.device)
            return super().decompress_sum_table(rows, table, divisor, ctx)

    register_compressor("test-hostonly-1bit", HostOnlyOneBit)
    run_steps(cp, "test-hostonly-1bit", {"block_size": 64, "algorithm": "allgather"}, rank=0, comm=comm, steps=2)
    assert calls and set(calls) == {"cpu"}, calls


def test_gpu_output_for_host_gradients_named(cp, comm):
    class Foreign:
        def __init__(self, arr):
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    pipe = gradfuse.Pipeline(comm=comm)
    with pytest.raises(TypeError, match="output 'a' is on a GPU but the gradients are in host memory"):
        pipe.allreduce({"a": np.ones(3, np.float32)}, out={"a": Foreign(cp.zeros(3, cp.float32))})


def test_gpu_only_empty_tensors(cp, comm):
    pipe = gradfuse.Pipeline(compress="1bit", comm=comm)
    out = pipe.allreduce({"e": cp.zeros((0, 4), cp.float32), "f": cp.zeros(0, cp.float32)})
    assert out["e"].shape == (0, 4) and out["f"].shape == (0,) and isinstance(out["e"], cp.ndarray)


def test_gpu_bench_runs_and_streams_its_rows(cp, tmp_path, monkeypatch, capsys):
    """The device check's benchmark, small: every kernel row and every Pipeline row is
    made, each Pipeline row says the GPU and host steps gave the same bits, and the file
    is written as rows come (a run cut short by a time limit keeps what it finished)."""
    from gradfuse.bench import gpu as bench_gpu
    lines = []
    table = bench_gpu.run_pipeline(repeat=1, compressors=("none", "1bit", "topk"),
                                   shapes=[(300,), (17, 5), (1000,)], emit=lines.append)
    assert table == "\n".join(lines)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| compressor")]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), table
    out = tmp_path / "bench.md"
    monkeypatch.setattr(bench_gpu, "run_pipeline", lambda repeat, emit: emit("| pipeline row |"))
    bench_gpu.main(["--mb", "1", "--repeat", "1", "--pipeline", "--out", str(out)])
    text = out.read_text()
    assert "1-bit compress + EF (B=512)" in text and "2-bit decompress-sum" in text, text
    assert "target >= 5x" in text and text.rstrip().endswith("| pipeline row |"), text
    assert capsys.readouterr().out.strip() == text.strip()
