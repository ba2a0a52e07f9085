"""PowerSGD (Vogels et al., 2019): a low-rank approximation of each matrix, summed by a
plain allreduce, with error feedback against the averaged approximation.

Each tensor of two or more dimensions is seen as a matrix M of shape (shape[0], rest), of
rank r = min(n, m, ``rank``). With Q (m x r, kept from the last step: warm start),
orthogonalized, P = M Q; every rank's P's are summed (one allreduce per bucket) and
orthogonalized; Q = M^T P, summed (one allreduce) and divided by the world size; every
rank then writes M^ = P Q^T, and keeps e = M + e - M^ (error feedback on the averaged
approximation). 1-D tensors, and matrices whose compression rate n m / (r (n + m)) is
not above ``min_compression_rate``, are summed uncompressed in the same step. The step's
job is ``gradfuse.step.powersgd.PowerSGDJob`` (docs/compressors.md, "PowerSGD").

Options (torch's ``PowerSGDState`` names in brackets): ``rank`` (1,
``matrix_approximation_rank``), ``min_compression_rate`` (2), ``warm_start`` (True),
``orthogonalization_epsilon`` (0), ``seed`` (0, ``random_seed``), and the common
``warmup_steps`` (``start_powerSGD_iter``) and ``error_feedback`` (True,
``use_error_feedback``).
"""
import numpy as np

from .base import Compressor, tensor_shapes

F32 = np.dtype(np.float32)


class Layout:
    """Where a bucket's tensors go in a PowerSGD step (the same on every rank: it depends
    on the shapes and options only).

    Attributes:
        route: int64 per tensor: ``>= 0`` the offset of a compressed tensor in the matrices
            buffer W (``nw`` floats), ``< 0`` the uncompressed one's at ``-1 - route`` in U
            (``nu`` floats).
        mats: per compressed tensor ``(w, n, m, r, p, q)``: its W offset, its matrix shape
            n x m, its rank r, and the offsets of its P (n x r) and Q (m x r) in the P and
            Q buffers (``np_``, ``nq`` floats).
        p_tab, q_tab: ``(offsets, rows, cols)`` int64 arrays of the P and Q matrices, for
            ``psgd_orthogonalize``.
        mat_tab: ``mats`` flattened (6 int64 per matrix), for ``psgd_products``.
        mrow: int64 per tensor: its index in ``mats``, -1 when uncompressed (for
            ``psgd_scatter_approx``).
        max_rank: the largest r of the bucket's matrices (0 without any).
    """

    def __init__(self, shapes, rank, min_rate):
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        route, mats = [], []
        w = u = p = q = 0
        for s in self.shapes:
            count = int(np.prod(s, dtype=np.int64))
            if len(s) >= 2 and count:
                n, m = s[0], count // s[0]
                r = min(n, m, rank)
                if (n + m) * r * min_rate < n * m:          # torch's _should_compress
                    route.append(w)
                    mats.append((w, n, m, r, p, q))
                    w, p, q = w + count, p + n * r, q + m * r
                    continue
            route.append(-1 - u)
            u += count
        self.route = np.array(route, np.int64)
        self.mats = mats
        self.nw, self.nu, self.np_, self.nq = w, u, p, q
        self.p_tab = tuple(np.array(c, np.int64).reshape(-1) for c in
                           zip(*[(mp, n, r) for (_, n, _, r, mp, _) in mats])) if mats else (
            np.zeros(0, np.int64),) * 3
        self.q_tab = tuple(np.array(c, np.int64).reshape(-1) for c in
                           zip(*[(mq, m, r) for (_, _, m, r, _, mq) in mats])) if mats else (
            np.zeros(0, np.int64),) * 3
        self.mat_tab = np.array(mats, np.int64).reshape(-1)
        self.mrow = np.cumsum(self.route >= 0, dtype=np.int64) - 1
        self.mrow[self.route < 0] = -1
        self.max_rank = max((mt[3] for mt in mats), default=0)
        # the matrices grouped by shape (one batched product per group)
        groups = {}
        for k, (wo, n, m, r, po, qo) in enumerate(mats):
            groups.setdefault((n, m, r), []).append(k)
        self.groups = groups

    @property
    def compressed_share(self):
        """The share of the bucket's elements that are compressed."""
        total = self.nw + self.nu
        return self.nw / total if total else 0.0

    @property
    def floats(self):
        """Floats one rank sends per step: P's, Q's and the uncompressed values."""
        return self.np_ + self.nq + self.nu


class PowerSGD(Compressor):
    """PowerSGD: rank-``rank`` approximations summed by a plain allreduce (see the module
    docstring; docs/compressors.md, "PowerSGD").

    Args:
        rank: the approximation's rank r (torch's ``matrix_approximation_rank``); each
            matrix uses min(n, m, rank).
        min_compression_rate: a matrix is compressed only when n m > rate r (n + m).
        warm_start: keep Q from one step to the next (else a new random Q each step).
        orthogonalization_epsilon: added to each column's norm; 0 keeps a zero column zero.
        seed: the random Q's seed (every rank draws the same Q).
        error_feedback, warmup_steps, momentum, ...: as every compressor's.

    Example:
        >>> import numpy as np, gradfuse
        >>> pipe = gradfuse.Pipeline(compress="powersgd", rank=2)
        >>> out = pipe.allreduce({"w": np.ones((8, 16), np.float32), "b": np.ones(8, np.float32)})
        >>> bool(np.allclose(out["w"], 1.0, atol=1e-5)), out["b"].tolist() == [1.0] * 8
        (True, True)
    """

    name = "powersgd"
    collective = "powersgd"
    supports_cuda = True
    error_feedback_default = True
    # no optimizer correction by default: error feedback on the raw gradient, the optimizer's
    # momentum after the exchange (Vogels et al., torch's hook); DGC's correction made the
    # digits CNN worse (docs/compressors.md, "PowerSGD")
    optimizer_correction = False
    OPTIONS = {"rank": 1, "min_compression_rate": 2.0, "warm_start": True, "orthogonalization_epsilon": 0.0,
               "seed": 0}

    def validate(self):
        o = self.options
        r = o["rank"]
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ValueError(f"compressor 'powersgd': option 'rank' must be an int >= 1, got {r!r}")
        o["rank"] = int(r)
        for name, lo in (("min_compression_rate", None), ("orthogonalization_epsilon", 0.0)):
            v = o[name]
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v) \
                    or (lo is not None and v < lo) or (lo is None and v <= 0):
                bound = ">= 0" if lo is not None else "> 0"
                raise ValueError(f"compressor 'powersgd': option {name!r} must be a finite number {bound}, got {v!r}")
            o[name] = float(v)
        if not isinstance(o["warm_start"], (bool, np.bool_)):
            raise TypeError(f"compressor 'powersgd': option 'warm_start' must be True or False, got "
                            f"{o['warm_start']!r}")
        o["warm_start"] = bool(o["warm_start"])
        s = o["seed"]
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"compressor 'powersgd': option 'seed' must be an int >= 0, got {s!r}")
        o["seed"] = int(s)

    def layout(self, ctx, n):
        """The bucket's ``Layout`` (memoized by shapes)."""
        shapes = tensor_shapes(ctx, n)
        memo = self.__dict__.setdefault("_layouts", {})
        lay = memo.get(shapes)
        if lay is None:
            if len(memo) > 1024:
                memo.clear()
            lay = memo[shapes] = Layout(shapes, self.options["rank"], self.options["min_compression_rate"])
        return lay

    def initial_q(self, lay, bucket, step):
        """The random Q of a bucket (float32, ``lay.nq``): the same on every rank, drawn from
        (seed, bucket, step), so no random state needs keeping beyond the step counter."""
        rng = np.random.default_rng([self.options["seed"], int(bucket), int(step), 0x9D5])
        return rng.standard_normal(lay.nq, dtype=np.float32)

    def bucket_layout(self, ctx):
        """What one rank's allreduces carry: P's, Q's, the uncompressed values and a flag."""
        lay = self.layout(ctx, ctx.n)
        return [(F32, lay.np_), (F32, lay.nq), (F32, lay.nu + 1)]

    def compress(self, c, payloads, ctx):
        raise NotImplementedError("powersgd: buckets are exchanged by gradfuse.step.powersgd.PowerSGDJob "
                                  "(three allreduces), not by compress/decompress")

    def decompress(self, payloads, n, ctx):
        raise NotImplementedError("powersgd: buckets are exchanged by gradfuse.step.powersgd.PowerSGDJob")
