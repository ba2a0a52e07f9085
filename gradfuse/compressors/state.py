"""Compression state of a pipeline: residuals, server residuals, step counter.

Residuals are per rank and per fusion bucket, keyed by the plan's digest (which covers
names, shapes, dtypes, options and the bucket layout) and the bucket index, so a residual
can only ever be applied to the bucket it came from. Each residual is double-buffered:
kernels write the new residual into the spare buffer, and ``commit`` swaps it in once every
rank has agreed the step was finite.

``state_dict()`` holds plain numpy arrays and JSON-able values; restoring it is bit-exact.
A state saved with another world size or compressor config is reset with a warning; a
residual is only ever applied to the bucket it was saved for; when the first compressed
step after a restore finds none of its own, a warning says the layout changed.
"""
import json
import warnings

import numpy as np

FORMAT = "gradfuse-state-1"


class BucketState:
    """One bucket's residuals (worker and server), double-buffered, in ``bk``'s memory."""

    __slots__ = ("n", "cur", "nxt", "server_cur", "server_nxt", "algorithm", "device", "bk")

    def __init__(self, n, server_n, algorithm, bk):
        self.n = n
        self.cur = bk.zeros(n, np.float32)
        self.nxt = bk.zeros(n, np.float32)
        self.server_cur = bk.zeros(server_n, np.float32)
        self.server_nxt = bk.zeros(server_n, np.float32)
        self.algorithm = algorithm
        self.device = (bk.device, bk.device_id)
        self.bk = bk

    def commit(self):
        self.cur, self.nxt = self.nxt, self.cur
        self.server_cur, self.server_nxt = self.server_nxt, self.server_cur


class CompressionState:
    """All of one pipeline's compressor state on this rank."""

    def __init__(self):
        self.step = 0                 # compressed-or-warm-up steps completed
        self.buckets = {}             # (digest hex, bucket index) -> BucketState
        self.pending = {}             # restored, not yet claimed by a plan
        self._fresh_restore = False   # no compressed step since the last restore
        self._claimed_any = False

    def bucket(self, key, n, server_n, algorithm, bk):
        """The state of bucket ``key``, in the memory of backend ``bk`` (host or a GPU).

        Keys do not depend on where the tensors live, so a residual follows its bucket
        from host to GPU and back (it is copied over when the device changes).
        """
        st = self.buckets.get(key)
        if st is not None and st.n == n and st.server_cur.size == server_n \
                and st.device != (bk.device, bk.device_id):
            moved = BucketState(n, server_n, algorithm, bk)
            if n:
                bk.upload(moved.cur, st.bk.host(st.cur))
            if server_n:
                bk.upload(moved.server_cur, st.bk.host(st.server_cur))
            self.buckets[key] = st = moved
        if st is None or st.n != n or st.server_cur.size != server_n:
            st = BucketState(n, server_n, algorithm, bk)
            saved = self.pending.pop(key, None)
            if saved is not None:
                self._claimed_any = True
                if saved["n"] == n and saved["server_residual"].size == server_n:
                    if n:
                        bk.upload(st.cur, saved["residual"])
                    if server_n:
                        bk.upload(st.server_cur, saved["server_residual"])
                else:
                    warnings.warn(f"gradfuse: checkpointed residual of bucket {key[1]} has a different "
                                  f"size; starting that bucket from zero", RuntimeWarning, stacklevel=3)
            self.buckets[key] = st
        st.algorithm = algorithm
        return st

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

    def state_dict(self, config, world_size, rank):
        buckets = {}
        for (digest, b), st in self.buckets.items():
            buckets[f"{digest}/{b}"] = {"n": st.n, "residual": np.array(st.bk.host(st.cur), copy=True),
                                        "server_residual": np.array(st.bk.host(st.server_cur), copy=True),
                                        "algorithm": st.algorithm}
        for (digest, b), saved in self.pending.items():
            buckets.setdefault(f"{digest}/{b}", saved)
        return {"format": FORMAT, "compressor": config, "world_size": world_size, "rank": rank,
                "step": self.step, "buckets": buckets}

    def load_state_dict(self, sd, config, world_size, rank):
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ValueError(f"not a gradfuse state dict (expected format {FORMAT!r})")
        problem = None
        if sd["world_size"] != world_size:
            problem = f"it was saved on {sd['world_size']} ranks and this run has {world_size}"
        elif sd["compressor"] != config:
            problem = f"it was saved with compressor {sd['compressor']} and this pipeline has {config}"
        self.buckets.clear()
        self.pending.clear()
        if problem:
            warnings.warn(f"gradfuse: compressor state reset: {problem}", RuntimeWarning, stacklevel=3)
            self.step = 0
            return False
        if sd.get("rank") != rank:
            warnings.warn(f"gradfuse: loading rank {sd.get('rank')}'s compressor state on rank {rank}; "
                          f"each rank should load its own file", RuntimeWarning, stacklevel=3)
        self.step = int(sd["step"])
        self._fresh_restore, self._claimed_any = True, False
        for key, saved in sd["buckets"].items():
            digest, b = key.rsplit("/", 1)
            self.pending[(digest, int(b))] = {
                "n": int(saved["n"]), "residual": np.asarray(saved["residual"], np.float32).copy(),
                "server_residual": np.asarray(saved["server_residual"], np.float32).copy(),
                "algorithm": saved.get("algorithm", "allgather")}
        return True


def save_npz(sd, path):
    """Write a ``state_dict()`` to ``path``: numpy .npz, arrays plus JSON metadata, no pickle."""
    arrays = {}
    meta = {k: v for k, v in sd.items() if k != "buckets"}
    meta["buckets"] = {}
    for i, (key, b) in enumerate(sd["buckets"].items()):
        arrays[f"r{i}"] = b["residual"]
        arrays[f"s{i}"] = b["server_residual"]
        meta["buckets"][key] = {"n": b["n"], "algorithm": b["algorithm"], "i": i}
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def load_npz(path):
    """The ``state_dict()`` that ``save_npz`` wrote to ``path``."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        buckets = {}
        for key, b in meta["buckets"].items():
            buckets[key] = {"n": b["n"], "algorithm": b["algorithm"],
                            "residual": z[f"r{b['i']}"], "server_residual": z[f"s{b['i']}"]}
    meta["buckets"] = buckets
    return meta
