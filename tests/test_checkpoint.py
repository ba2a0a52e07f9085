"""Pipeline checkpoints never lose or tear state (gradfuse.compressors.checkpoint, docs/reliability.md):
atomic saves, saves during a step in flight, refused loads that leave the live state alone,
on_mismatch="reset", another world size, bad files, and one validation for every array."""
import json
import os
import threading
import warnings
import zipfile

import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.compressors import checkpoint as ckpt
from gradfuse.errors import GradfuseError

F32 = np.float32


@pytest.fixture
def comm():
    return SingleProcessCommunicator()


def grads(step, sizes=(300, 700, 40)):
    rng = np.random.default_rng([step, 36])
    return {f"t{i}": rng.standard_normal(s).astype(F32) for i, s in enumerate(sizes)}


def bits(a):
    return np.ascontiguousarray(a).tobytes()


def trained(comm, compress="1bit", steps=3, **opts):
    pipe = gradfuse.Pipeline(compress, comm=comm, **opts)
    for t in range(steps):
        pipe.allreduce(grads(t))
    return pipe


def snapshot(pipe):
    """Every array and counter of the live state, as bytes (no waiting, no copies kept)."""
    st = pipe.state
    out = {"step": st.step, "meta": json.dumps(st.meta, sort_keys=True),
           "pending": sorted(map(str, st.pending))}
    for key, b in st.buckets.items():
        out[str(key)] = (bits(b.cur), bits(b.server_cur), bits(b.vel_cur),
                         {k: bits(np.asarray(a)) for k, a in b.arrays.items()})
    return out


# ------------------------------------------------------------------ saves

def test_a_crash_during_a_save_keeps_the_previous_checkpoint(comm, tmp_path, monkeypatch):
    pipe = trained(comm)
    path = tmp_path / "ckpt"                      # a bare name: np.savez would append .npz
    pipe.save_state(str(path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    before = path.read_bytes()
    pipe.allreduce(grads(9))

    def dies(f, **arrays):                        # half a file, then the process "dies"
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt("killed during the save")
    monkeypatch.setattr(np, "savez", dies)
    with pytest.raises(KeyboardInterrupt):
        pipe.save_state(str(path))
    assert path.read_bytes() == before            # the old checkpoint is whole
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]       # and no temporary file is left
    monkeypatch.undo()
    again = gradfuse.Pipeline("1bit", comm=comm)
    assert again.load_state(str(path)) and again.state.step == 3


def test_a_save_fsyncs_the_file_and_its_folder_then_renames(comm, tmp_path, monkeypatch):
    pipe = trained(comm)
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", os.path.dirname(a) ==
                                                                   os.path.dirname(b))), real_replace(a, b)))
    pipe.save_state(str(tmp_path / "s.npz"))
    assert calls == [("fsync", False), ("replace", True), ("fsync", True)]


def test_a_save_during_a_step_in_flight_holds_one_whole_step(comm, tmp_path):
    """allreduce_async of 4M elements not finished (held behind a job on the communication
    thread): the saved step counter and every residual are those of the finished step
    (before, the save read whatever the step had written so far)."""
    pipe = gradfuse.Pipeline("1bit", comm=comm)
    big = lambda t: {"w": np.random.default_rng(t).standard_normal(4_000_000).astype(F32)}   # noqa: E731
    pipe.allreduce(big(0))
    gate = threading.Event()
    pipe._ctx.engine.submit(gate.wait, "test gate")      # the step below stays in flight until it opens
    h = pipe.allreduce_async(big(1))
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    pipe.save_state(str(tmp_path / "s.npz"))
    assert gate.is_set()
    h.wait()
    opener.join()
    saved = ckpt.load_npz(str(tmp_path / "s.npz"))
    live = pipe.state_dict()
    assert saved["step"] == live["step"] == 2
    for key, b in live["buckets"].items():
        assert bits(saved["buckets"][key]["residual"]) == bits(b["residual"])


def test_a_save_from_the_communication_thread_is_refused_while_a_step_waits(comm):
    """A job on the communication thread cannot wait for the step queued behind it (it would
    deadlock), nor read the state without it (torn): it is refused, by name."""
    pipe = trained(comm, steps=1)
    gate = threading.Event()
    inner = pipe._ctx.engine.submit(lambda: (gate.wait(), pipe.state_dict()), "state_dict on the thread")
    h = pipe.allreduce_async(grads(1))            # queued behind the job above
    gate.set()
    with pytest.raises(GradfuseError, match=r"state_dict\(\) was called on the communication thread.*cannot wait"):
        inner.wait(timeout=60)
    h.wait()
    assert pipe.state_dict()["step"] == 2


# ------------------------------------------------------------------ loads that do not fit

def test_another_compressors_state_is_refused_and_the_live_state_kept(comm, tmp_path):
    other = trained(comm, "1bit")
    path = str(tmp_path / "onebit.npz")
    other.save_state(path)
    live = trained(comm, "topk", ratio=0.1)
    assert len(live.state.buckets) == 1
    before = snapshot(live)
    with pytest.raises(GradfuseError, match=r"onebit\.npz' does not fit this pipeline: compressor name: saved "
                                            r"'1bit', here 'topk'.*live state is unchanged.*on_mismatch='reset'"):
        live.load_state(path)
    assert snapshot(live) == before               # 1 bucket and step 3, bit for bit
    with pytest.warns(RuntimeWarning, match="on_mismatch='reset': starting from a fresh state"):
        assert live.load_state(path, on_mismatch="reset") is False
    assert live.state.step == 0 and not live.state.buckets and not live.state.pending
    with pytest.raises(ValueError, match="on_mismatch must be one of 'raise', 'reset'"):
        live.load_state(path, on_mismatch="ignore")


def test_other_options_or_another_rank_are_refused_by_name(comm):
    sd = trained(comm, fusion_threshold=4096).state_dict()
    live = trained(comm, fusion_threshold=8192)
    before = snapshot(live)
    with pytest.raises(GradfuseError, match="option fusion_threshold: saved 4096, here 8192"):
        live.load_state_dict(sd)
    with pytest.raises(GradfuseError, match="compressor block_size: saved 512, here 64"):
        trained(comm, block_size=64).load_state_dict(sd)
    same = trained(comm, fusion_threshold=4096)
    with pytest.raises(GradfuseError, match="it is rank 3's state and this is rank 0"):
        same.load_state_dict(dict(sd, world_size=1, rank=3))
    assert snapshot(live) == before
    assert same.load_state_dict(sd)


@pytest.mark.parametrize("compress,opts,kept,zeroed", [
    ("1bit", {"adam": "adamw", "warmup_steps": 2}, {"adam.m", "adam.v", "adam.step", "adam.freeze", "adam.mask",
                                                     "adam.r"}, {"residual"}),
    ("1bit", {"momentum": 0.9}, set(), {"residual", "velocity"}),
    ("powersgd", {"rank": 2}, {"q"}, {"residual"}),
])
def test_another_world_size_keeps_the_shared_state_and_zeroes_this_ranks_own(comm, compress, opts, kept, zeroed):
    g = {"fc": np.random.default_rng(1).standard_normal((40, 30)).astype(F32),
         "b": np.random.default_rng(2).standard_normal(30).astype(F32)}
    a = gradfuse.Pipeline(compress, comm=comm, **opts)
    for t in range(4):
        a.allreduce({k: v * (t + 1) for k, v in g.items()})
    sd = a.state_dict()
    (key, entry), = sd["buckets"].items()
    assert set(entry.get("arrays", {})) == kept | ({"residual"} if compress == "powersgd" else set())
    b = gradfuse.Pipeline(compress, comm=comm, **opts)
    with pytest.warns(RuntimeWarning, match=rf"saved on 4 ranks and this run has 1: .*starting this rank's own "
                                            rf"state from zero \({', '.join(sorted(zeroed))}\)"):
        assert b.load_state_dict(dict(sd, world_size=4, rank=2))
    got = b.state_dict()
    assert got["step"] == sd["step"] == 4 and got.get("meta") == sd.get("meta")
    restored = got["buckets"][key]
    assert restored["residual"].size == 0 and restored.get("velocity") is None
    assert set(restored.get("arrays", {})) == kept
    for name in kept:
        assert bits(restored["arrays"][name]) == bits(entry["arrays"][name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # the zeroed parts are no "different size"
        b.allreduce(g)


# ------------------------------------------------------------------ bad files

def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_bad_files_raise_gradfuse_errors_naming_the_file_and_the_problem(comm, tmp_path):
    good = str(tmp_path / "good.npz")
    trained(comm).save_state(good)
    raw = open(good, "rb").read()
    npz = tmp_path / "other.npz"
    np.savez(npz, weights=np.ones(3))
    npy = tmp_path / "array.npy"
    np.save(npy, np.ones(3))
    meta, arrays = ckpt.pack(trained(comm).state_dict())
    ckpt.write_npz(str(tmp_path / "v0.npz"), dict(meta, format="gradfuse-state-0"), arrays)
    ckpt.write_npz(str(tmp_path / "lacks.npz"), meta, {k: v for k, v in arrays.items() if k != "r0"})
    cases = {
        _write(tmp_path / "truncated.npz", raw[:len(raw) // 2]): "is truncated or corrupt",
        _write(tmp_path / "empty.npz", b""): "is empty",
        _write(tmp_path / "text.npz", b"step = 3\n"): r"not a gradfuse state file \(not a .npz archive",
        str(npz): r"is a .npz without gradfuse's metadata \(arrays \['weights'\]\)",
        str(npy): "not a .npz archive",
        str(tmp_path / "v0.npz"): "has format 'gradfuse-state-0'; this gradfuse reads 'gradfuse-state-1'",
        str(tmp_path / "lacks.npz"): "array 'r0' is missing",
        str(tmp_path / "nowhere.npz"): "does not exist",
    }
    live = trained(comm)
    before = snapshot(live)
    for path, problem in cases.items():
        with pytest.raises(GradfuseError, match=rf"state file '{path}'.*{problem}"):
            live.load_state(path)
    assert snapshot(live) == before


def test_a_corrupt_member_is_named_too(comm, tmp_path):
    path = str(tmp_path / "crc.npz")
    trained(comm).save_state(path)
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("r0.npy")
    at = info.header_offset + 30 + len(info.filename) + 200       # inside r0's data
    raw[at] ^= 0xFF
    _write(path, bytes(raw))
    with pytest.raises(GradfuseError, match=r"crc\.npz' is truncated or corrupt \(BadZipFile: Bad CRC-32"):
        gradfuse.Pipeline("1bit", comm=comm).load_state(path)


# ------------------------------------------------------------------ one validation for every array

def _adam_sd(comm):
    return trained(comm, "1bit", steps=4, adam="adamw", warmup_steps=2).state_dict()


def _first(sd):
    return next(iter(sd["buckets"].values()))


def _breaks(change, problem, make=_adam_sd):
    return pytest.param(change, problem, make, id=problem[:40])


def _set(name, fn):
    def change(sd):
        b = _first(sd)
        arrays = b.setdefault("arrays", {})
        if name in ("residual", "server_residual", "velocity"):
            b[name] = fn(b[name])
        else:
            arrays[name] = fn(arrays[name])
    return change


def _nan_at(i):
    def f(a):
        a = a.copy()
        a[i] = np.nan
        return a
    return f


def _psgd_sd(comm):
    g = {"fc": np.random.default_rng(1).standard_normal((40, 30)).astype(F32)}
    pipe = gradfuse.Pipeline("powersgd", rank=2, comm=comm)
    for t in range(2):
        pipe.allreduce(g)
    return pipe.state_dict()


def _momentum_sd(comm):
    return trained(comm, "1bit", momentum=0.9).state_dict()


@pytest.mark.parametrize("change,problem,make", [
    _breaks(_set("residual", _nan_at(5)), "residual holds nan at element 5"),
    _breaks(_set("adam.m", _nan_at(7)), "adam.m holds nan at element 7"),
    _breaks(_set("adam.v", lambda a: -a - 1), r"adam.v holds -1\.\d+ at element 0; it must be >= 0"),
    _breaks(_set("adam.freeze", lambda a: a - 100), r"adam.freeze holds -98 at element 0; it must be >= 0"),
    _breaks(_set("adam.step", lambda a: np.zeros(2, np.int64)), "adam.step has 2 elements, expected 1"),
    _breaks(_set("adam.mask", lambda a: a + 2), r"adam.mask holds \d at element 0; a mask is 0 or 1"),
    _breaks(_set("adam.r", lambda a: a[:-1]), "adam.r has .* elements and adam.v .*; they must match"),
    _breaks(_set("residual", lambda a: a.astype(np.float64)), "residual has dtype float64, expected float32"),
    _breaks(_set("residual", lambda a: a.reshape(1, -1)), r"residual has shape \(1, \d+\), expected a 1-D array"),
    _breaks(_set("residual", lambda a: a[:-1]), r"residual has \d+ elements, its n says"),
    _breaks(lambda sd: _first(sd)["arrays"].__setitem__("bogus", np.zeros(3, F32)),
            "holds an array 'bogus' this gradfuse does not know"),
    _breaks(lambda sd: sd.__setitem__("step", -1), "step is -1; it must be an integer >= 0"),
    _breaks(lambda sd: sd["meta"]["adam"].__setitem__("calm", float("nan")), r"meta.adam.calm is nan",
            lambda c: trained(c, "1bit", steps=2, adam="adamw").state_dict()),
    _breaks(_set("q", _nan_at(0)), "q holds nan at element 0", _psgd_sd),
    _breaks(_set("velocity", _nan_at(3)), "velocity holds nan at element 3", _momentum_sd),
    _breaks(lambda sd: _first(sd).__setitem__("velocity_scale", float("inf")), "velocity_scale is inf",
            _momentum_sd),
])
def test_every_array_is_validated_and_a_bad_state_changes_nothing(comm, tmp_path, change, problem, make):
    sd = make(comm)
    change(sd)
    live = gradfuse.Pipeline(sd["compressor"]["name"] if isinstance(sd["compressor"], dict) else "1bit",
                             comm=comm, **{k: v for k, v in sd["compressor"].items() if k != "name"})
    live.allreduce(grads(0) if make is not _psgd_sd else
                   {"fc": np.ones((40, 30), F32)})
    before = snapshot(live)
    with pytest.raises(GradfuseError, match=f"the state_dict: bucket .*{problem}|the state_dict: {problem}"):
        live.load_state_dict(sd)
    assert snapshot(live) == before
    path = str(tmp_path / "bad.npz")
    ckpt.save_npz(sd, path)                       # the same state in a file: named by the file
    with pytest.raises(GradfuseError, match=rf"state file '{path}'"):
        live.load_state(path)


def test_a_nan_state_file_is_refused_at_load_not_blamed_on_the_gradients(comm, tmp_path):
    sd = trained(comm).state_dict()
    _first(sd)["residual"][0] = np.nan
    path = str(tmp_path / "nan.npz")
    ckpt.save_npz(sd, path)
    with pytest.raises(GradfuseError, match=r"nan\.npz'.*residual holds nan at element 0"):
        gradfuse.Pipeline("1bit", comm=comm).load_state(path)


def test_the_table_covers_every_array_a_compressor_keeps(comm):
    """Each compressor's state (named arrays included) passes the one validation, and every
    array it holds is in checkpoint.ARRAYS (a new compressor's state must be added there)."""
    seen = set()
    for make in (_adam_sd, _psgd_sd, _momentum_sd, lambda c: trained(c, "topk", ratio=0.1).state_dict(),
                 lambda c: trained(c, "2bit").state_dict(), lambda c: trained(c, "randomk", ratio=0.1).state_dict(),
                 lambda c: trained(c, "1bit", adam="adam", warmup_steps=1).state_dict()):
        sd = make(comm)
        ckpt.check_state(sd)
        for b in sd["buckets"].values():
            seen.update(p for p in ("residual", "server_residual", "velocity") if b.get(p) is not None)
            seen.update(b.get("arrays", {}))
    assert seen == set(ckpt.ARRAYS)


def test_a_save_follows_a_link_and_writes_a_device_in_place(comm, tmp_path):
    pipe = trained(comm)
    real = tmp_path / "real.npz"
    pipe.save_state(str(real))
    link = tmp_path / "latest.npz"
    link.symlink_to(real)
    pipe.allreduce(grads(7))
    pipe.save_state(str(link))
    assert link.is_symlink() and ckpt.load_npz(str(link))["step"] == 4
    ckpt.atomic_write("/dev/null", lambda f: f.write(b"state"))     # written in place, not replaced
    assert not os.path.isfile("/dev/null") and os.path.exists("/dev/null")


def test_a_save_into_a_missing_folder_names_the_file(comm, tmp_path):
    path = str(tmp_path / "nowhere" / "s.npz")
    with pytest.raises(FileNotFoundError, match=rf"cannot write '{path}'.*No such file or directory"):
        trained(comm).save_state(path)
