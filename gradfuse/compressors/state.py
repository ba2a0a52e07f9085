"""Compression state of a pipeline: residuals, server residuals, velocities, step counter.

Residuals are per rank and per fusion bucket, keyed by the plan's digest (which covers
names, shapes, dtypes, options and the bucket layout) and the bucket index, so a residual
can only ever be applied to the bucket it came from. On a GPU (and with momentum) each
residual is double-buffered: kernels write the new residual into the spare buffer, and
``commit`` swaps it in once every rank has agreed the step was finite. On the host a
residual is a single buffer (``single``): the step first agrees that every compressed
input is finite and that nothing can overflow (``gradfuse.step.verdict.input_bound``,
with each residual's ``bound``) and the kernels then update it in place (``nxt is cur``);
a step that cannot promise that gets a spare for that step only (``spare()``), dropped
again at ``commit``/``release``; a pipelined step's early groups keep theirs (``pin``). With ``momentum`` (DGC's momentum correction,
``gradfuse.compressors.momentum``) each bucket also keeps this rank's velocity, double-
buffered the same way, and a pending factor ``velocity_scale`` that the next velocity
update folds into the momentum (``CompressionState.scale_velocity``).

**Named arrays.** An optimizer correction keeps further per-bucket state as named arrays
(``BucketState.arrays``, ``array(name, n, dtype)``): the Adam correction's first and second
moments, its step counter, freeze step and mask (``gradfuse.compressors.adam``). They are
saved, restored and moved between devices with the bucket, by name, whatever they hold:
int64 arrays (counters) live in host memory, the others where the bucket's buffers do.
Pipeline-wide scalars of a correction (JSON-able) live in ``CompressionState.meta``. Both
are written only after a step's verdict, so a refused step leaves them as they were.

``state_dict()`` holds plain numpy arrays and JSON-able values; restoring it is bit-exact.
``load_state_dict`` first validates the whole state (``gradfuse.compressors.checkpoint``) and
compares it with this pipeline, and changes nothing unless it is restored: a state of
another compressor config, other pipeline options, or (on as many ranks) another rank is
refused (``GradfuseError``, naming where it came from and each difference), or with
``on_mismatch="reset"`` replaced by a fresh state (with a warning). A state saved on another
number of ranks keeps what is the same on every rank (the step counter, the pipeline-wide
scalars, the arrays ``checkpoint.ARRAYS`` marks shared) and starts this rank's own
(residuals, velocities) from zero, with a warning naming them. A residual is only ever
applied to the bucket it was saved for; when the first compressed step after a restore
finds none of its own, a warning says the layout changed. States saved before velocities
(or named arrays, or the options) existed load with none.
"""
import json
import warnings

import numpy as np

from . import checkpoint as _ckpt
from .checkpoint import FORMAT, load_npz, save_npz  # noqa: F401  (the Pipeline's file format)
from ..errors import GradfuseError

ON_MISMATCH = ("raise", "reset")


class BucketState:
    """One bucket's residuals (worker and server) and velocity in ``bk``'s memory: residuals single
    (host, ``single``) or double-buffered, the velocity double-buffered.

    The three parts are sized independently (``ensure``): a bucket that runs uncompressed
    during warm-up keeps a velocity and no residual, and gets its residual when compression
    starts, without losing the velocity.
    """

    __slots__ = ("n", "cur", "nxt", "server_cur", "server_nxt", "vel_cur", "vel_nxt", "vscale",
                 "algorithm", "device", "bk", "tables", "single", "bound", "pinned", "arrays")

    def __init__(self, n, server_n, algorithm, bk, velocity=0, single=False):
        self.bk = bk
        self.single = single     # one buffer per residual, updated in place (host; see the module docstring)
        self.device = (bk.device, bk.device_id)
        self.algorithm = algorithm
        self.n = -1
        self.server_cur = self.vel_cur = None
        self.vscale = 1.0
        self.tables = {}         # pointer tables over this state's arrays (gradfuse.compressors.momentum)
        # an upper bound on |cur| (gradfuse.step.verdict.input_bound): exact for zeros and
        # restored residuals, then grown step by step by the compressor's ``settle``; inf: unknown
        self.bound = 0.0
        self.pinned = False      # single, but keeps its spare across steps (``pin``)
        self.arrays = {}         # name -> an optimizer correction's array (module docstring)
        self.ensure(n, server_n, velocity)

    def ensure(self, n, server_n, velocity):
        """Give each part the size asked for: a part whose size changes starts from zero."""
        bk = self.bk
        spare = (lambda m: None) if self.single else (lambda m: bk.zeros(m, np.float32))   # noqa: E731
        if self.n != n:
            self.n, self.cur, self.nxt = n, bk.zeros(n, np.float32), spare(n)
            self.bound = 0.0
        if self.server_cur is None or self.server_cur.size != server_n:
            self.server_cur, self.server_nxt = bk.zeros(server_n, np.float32), spare(server_n)
        self.release()
        if self.pinned:
            self.spare()
        if self.vel_cur is None or self.vel_cur.size != velocity:
            self.vel_cur, self.vel_nxt = bk.zeros(velocity, np.float32), bk.zeros(velocity, np.float32)
            self.vscale = 1.0
            self.tables.clear()

    def commit(self):
        """The step's residuals and velocity become current (a compressed bucket)."""
        if self.nxt is not self.cur:
            self.cur, self.nxt = self.nxt, self.cur
        if self.server_nxt is not self.server_cur:
            self.server_cur, self.server_nxt = self.server_nxt, self.server_cur
        self.release()
        self.commit_velocity()

    @property
    def in_place(self):
        """Whether this step's kernels update the residuals where they lie (no spare)."""
        return self.nxt is self.cur and self.cur.size > 0 or (self.server_nxt is self.server_cur
                                                                and self.server_cur.size > 0)

    def spare(self):
        """A single-buffered state gets spare buffers for one step (one whose inputs are not
        known to be finite on every rank, so it may be refused and must leave the
        residuals as they were)."""
        if self.single:
            if self.nxt is self.cur or self.nxt is None or self.nxt.size != self.cur.size:
                self.nxt = self.bk.zeros(self.cur.size, np.float32)
            if (self.server_nxt is self.server_cur or self.server_nxt is None
                    or self.server_nxt.size != self.server_cur.size):
                self.server_nxt = self.bk.zeros(self.server_cur.size, np.float32)

    def release(self):
        """Drop a step's spare buffers (single-buffered, not pinned): the kernels write in
        place again."""
        if self.single and not self.pinned:
            self.nxt, self.server_nxt = self.cur, self.server_cur

    def pin(self, on=True):
        """Keep (``on``) or stop keeping a spare residual across steps: a single-buffered
        bucket that a pipelined step compresses before every rank agreed its inputs are
        finite (``gradfuse.step.grouped``, "early groups") writes into the spare, as a GPU's
        double-buffered residual does, and ``commit`` swaps it in."""
        if not self.single or on == self.pinned:
            return
        self.pinned = on
        if on:
            self.spare()
        else:
            self.release()

    def zero(self):
        """Clear the residuals (a refused step whose in-place update could not be undone)."""
        for a in (self.cur, self.server_cur):
            if a.size:
                a[...] = 0
        self.bound = 0.0
        self.release()

    def array(self, name, n, dtype=np.float32):
        """The named array ``name`` of ``n`` elements of ``dtype``, made (zeros) when it does
        not exist or has another size or dtype: int64 in host memory, the others in the
        bucket's backend."""
        a = self.arrays.get(name)
        dtype = np.dtype(dtype)
        if a is None or a.size != n or a.dtype != dtype:
            a = self.arrays[name] = np.zeros(n, dtype) if dtype == np.int64 else self.bk.zeros(n, dtype)
        return a

    def commit_velocity(self):
        """The step's velocity becomes current (an uncompressed bucket: residuals untouched)."""
        if self.vel_cur.size:
            self.vel_cur, self.vel_nxt = self.vel_nxt, self.vel_cur
            self.vscale = 1.0

    def upload(self, saved):
        """Fill from a saved entry (host arrays). The residuals are taken when both sizes fit
        (else both stay zero), the velocity when its size fits; returns whether all fitted."""
        bk = self.bk
        res, srv = saved["residual"], saved["server_residual"]
        # none saved (both empty: a warm-up bucket, or zeroed for another world size): zeros
        ok = res.size == self.cur.size and srv.size == self.server_cur.size or not (res.size or srv.size)
        if ok and (res.size or srv.size):
            self.bound = float(np.abs(res).max()) if res.size else 0.0
            if res.size:
                bk.upload(self.cur, res)
            if srv.size:
                bk.upload(self.server_cur, srv)
        vel = saved.get("velocity")
        if vel is not None and vel.size:
            if vel.size == self.vel_cur.size:
                bk.upload(self.vel_cur, vel)
                self.vscale = float(saved.get("velocity_scale", 1.0))
            else:
                ok = False
        for name, a in (saved.get("arrays") or {}).items():
            a = np.asarray(a)
            if a.dtype == np.int64:
                self.arrays[name] = a.copy()
            else:
                self.arrays[name] = dev = bk.zeros(a.size, a.dtype)
                if a.size:
                    bk.upload(dev, a.reshape(-1))
        return ok

    def saved(self):
        """This state as host arrays (a ``state_dict()`` entry)."""
        host = lambda a: np.array(self.bk.host(a), copy=True)      # noqa: E731
        entry = {"n": self.n, "residual": host(self.cur), "server_residual": host(self.server_cur),
                 "algorithm": self.algorithm}
        if self.vel_cur.size:
            entry["velocity"] = host(self.vel_cur)
            entry["velocity_scale"] = self.vscale
        if self.arrays:
            entry["arrays"] = {k: (a.copy() if isinstance(a, np.ndarray) else host(a))
                               for k, a in self.arrays.items()}
        return entry


class CompressionState:
    """All of one pipeline's compressor state on this rank."""

    def __init__(self):
        self.step = 0                 # compressed-or-warm-up steps completed
        self.buckets = {}             # (digest hex, bucket index) -> BucketState
        self.pending = {}             # restored, not yet claimed by a plan
        self.meta = {}                # an optimizer correction's pipeline-wide scalars (JSON-able)
        self.seeds = {}               # bucket index -> a saved entry for a new bucket of that index (``seed``)
        self._fresh_restore = False   # no compressed step since the last restore
        self._claimed_any = False

    def bucket(self, key, n, server_n, algorithm, bk, velocity=0, single=False):
        """The state of bucket ``key``, in the memory of backend ``bk`` (host or a GPU):
        ``n`` residual, ``server_n`` server-residual and ``velocity`` velocity elements;
        ``single``: one buffer per residual, updated in place (see the module docstring).

        Keys do not depend on where the tensors live, so a state follows its bucket from
        host to GPU and back (it is copied over when the device changes).
        """
        st = self.buckets.get(key)
        if st is not None and st.device != (bk.device, bk.device_id):
            moved = BucketState(st.n, st.server_cur.size, st.algorithm, bk, st.vel_cur.size, single)
            moved.upload(st.saved())
            self.buckets[key] = st = moved
        if st is not None and st.single != single:      # momentum switched on or off: re-made
            moved = BucketState(st.n, st.server_cur.size, st.algorithm, bk, st.vel_cur.size, single)
            moved.upload(st.saved())
            self.buckets[key] = st = moved
        if st is None:
            st = BucketState(n, server_n, algorithm, bk, velocity, single)
            saved = self.pending.pop(key, None)
            if saved is not None:
                self._claimed_any = True
            else:
                saved = self.seeds.pop(key[1], None)
            if saved is not None:
                if not st.upload(saved):
                    warnings.warn(f"gradfuse: checkpointed state of bucket {key[1]} has a different size; "
                                  f"starting the parts that differ from zero", RuntimeWarning, stacklevel=3)
            self.buckets[key] = st
        else:
            st.ensure(n, server_n, velocity)
        if algorithm is not None:
            st.algorithm = algorithm
        return st

    def take_residual(self, key, bk):
        """Remove bucket ``key``'s residuals and return ``(residual, server residual)`` as
        float32 arrays in ``bk``'s memory (the caller may overwrite them), or None if it has
        none: the bucket now runs uncompressed and its residual goes into that sum. A
        restored, not yet claimed residual is taken too."""
        st = self.buckets.pop(key, None)
        if st is not None:
            if not st.cur.size and not st.server_cur.size:
                return None
            return st.cur, st.server_cur
        saved = self.pending.pop(key, None)
        if saved is None or not (saved["residual"].size or saved["server_residual"].size):
            return None
        self._claimed_any = True
        return (bk.xp.array(saved["residual"], dtype=np.float32),
                bk.xp.array(saved["server_residual"], dtype=np.float32))

    def seed(self, index, entry):
        """Start the next new bucket of index ``index`` (of any plan, without a restored state of
        its own) from ``entry`` (a ``state_dict()`` bucket entry): a binding that carries an
        optimizer correction's arrays over to a new bucket layout (the DDP hook's rebuild)."""
        self.seeds[int(index)] = entry

    def scale_velocity(self, factor):
        """Multiply every velocity by ``factor`` at its bucket's next velocity update (folded
        into the momentum there: ``u = (m * factor) * u + g``, one rounding of the product).

        The MXNet binding calls it when the learning rate changes, with ``lr_old / lr_new``,
        so that the velocity, kept in gradient units, stays MXNet's lr-scaled momentum buffer
        (docs/mxnet.md). Call it between steps (no step of this pipeline in flight).
        """
        factor = float(factor)
        if factor == 1.0:
            return
        if not np.isfinite(factor) or factor <= 0:
            raise ValueError(f"scale_velocity: factor must be finite and > 0, got {factor!r}")
        for st in self.buckets.values():
            if st.vel_cur.size:
                st.vscale *= factor
        for saved in self.pending.values():
            if saved.get("velocity") is not None and saved["velocity"].size:
                saved["velocity_scale"] = float(saved.get("velocity_scale", 1.0)) * factor

    def claim_done(self, digest):
        """After a compressed step of plan ``digest`` has taken its buckets' residuals.

        Restored residuals of other layouts stay pending (a pipeline may alternate between
        several tensor sets, and each claims its own on its first step) and stay in
        ``state_dict()``; but if the first compressed step after a restore finds none of its
        own, the layout changed: that is reported once, and this layout starts from zero.
        """
        if self._fresh_restore:
            self._fresh_restore = False
            if self.pending and not self._claimed_any:
                warnings.warn(f"gradfuse: {len(self.pending)} checkpointed residual(s) belong to a bucket "
                              f"layout that is not in use (names, shapes, options or fusion threshold "
                              f"changed); this layout starts from zero residuals, and they are kept "
                              f"only for a layout that matches them", RuntimeWarning, stacklevel=3)

    def state_dict(self, config, world_size, rank, options=None):
        """This state as numpy arrays and JSON-able values, with what it must be restored
        into: the compressor ``config``, the pipeline ``options`` that key its buckets, the
        world size and rank."""
        buckets = {}
        for (digest, b), st in self.buckets.items():
            buckets[f"{digest}/{b}"] = st.saved()
        for (digest, b), saved in self.pending.items():
            buckets.setdefault(f"{digest}/{b}", saved)
        sd = {"format": FORMAT, "compressor": config, "world_size": world_size, "rank": rank,
              "step": self.step, "buckets": buckets}
        if options is not None:
            sd["options"] = json.loads(json.dumps(options))
        if self.meta:
            sd["meta"] = json.loads(json.dumps(self.meta))
        return sd

    def load_state_dict(self, sd, config, world_size, rank, options=None, on_mismatch="raise",
                        where="the state_dict", check_only=False):
        """Restore ``sd`` (module docstring); returns True if it was restored, False if it
        was replaced by a fresh state (``on_mismatch="reset"``). ``where`` names it in the
        messages (the file it was read from); ``check_only``: raise what it would raise, and
        change nothing."""
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {', '.join(map(repr, ON_MISMATCH))}, got {on_mismatch!r}")
        _ckpt.check_state(sd, where)
        saved_c = sd["compressor"]
        if isinstance(saved_c, dict) and isinstance(config, dict) and saved_c.get("name") != config.get("name"):
            saved_c, config_c = {"name": saved_c.get("name")}, {"name": config.get("name")}   # its options follow
        else:
            config_c = config
        diffs = [f"compressor {d}" for d in _ckpt.differences(saved_c, config_c)]
        if options is not None and sd.get("options") is not None:
            diffs += [f"option {d}" for d in _ckpt.differences(sd["options"], options)
                      if not d.startswith("compress:")]
        if sd["world_size"] == world_size and sd.get("rank", rank) != rank:
            diffs.append(f"it is rank {sd.get('rank')}'s state and this is rank {rank} (each rank loads its own)")
        if diffs and on_mismatch == "raise":
            raise GradfuseError(f"gradfuse: {where} does not fit this pipeline: {'; '.join(diffs)}. Nothing was "
                                f"loaded and the live state is unchanged; to start this pipeline from a fresh "
                                f"state instead, load with on_mismatch='reset'")
        if check_only:
            return not diffs
        if diffs:
            warnings.warn(f"gradfuse: {where} does not fit this pipeline ({'; '.join(diffs)}); on_mismatch='reset': "
                          f"starting from a fresh state (step 0, zero residuals)", RuntimeWarning, stacklevel=3)
            self.buckets.clear()
            self.pending.clear()
            self.meta, self.step = {}, 0
            return False
        pending, zeroed = {}, set()
        for key, saved in sd["buckets"].items():
            digest, b = key.rsplit("/", 1)
            entry = {"n": int(saved["n"]), "residual": np.array(saved["residual"], copy=True),
                     "server_residual": np.array(saved["server_residual"], copy=True),
                     "algorithm": saved.get("algorithm", "allgather")}
            if saved.get("velocity") is not None:
                entry["velocity"] = np.array(saved["velocity"], copy=True)
                entry["velocity_scale"] = float(saved.get("velocity_scale", 1.0))
            if saved.get("arrays"):
                entry["arrays"] = {k: np.array(a, copy=True) for k, a in saved["arrays"].items()}
            if sd["world_size"] != world_size:
                entry, lost = _ckpt.for_world_size(entry)
                zeroed.update(lost)
            pending[(digest, int(b))] = entry
        if sd["world_size"] != world_size:
            warnings.warn(f"gradfuse: {where} was saved on {sd['world_size']} ranks and this run has {world_size}: "
                          f"restoring the step counter and the state every rank shares, and starting this "
                          f"rank's own state from zero ({', '.join(sorted(zeroed)) or 'nothing to zero'})",
                          RuntimeWarning, stacklevel=3)
        self.buckets.clear()
        self.pending = pending
        self.step = int(sd["step"])
        self.meta = json.loads(json.dumps(sd.get("meta") or {}))
        self._fresh_restore, self._claimed_any = True, False
        return True
