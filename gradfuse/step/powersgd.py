"""PowerSGD's exchange job: three allreduces per bucket (the uncompressed part, P, Q).

``compress()`` gathers the bucket (``psgd_gather``: the matrices, with the residual added,
into W; the 1-D and poorly compressible tensors into U; the non-finite count into U's
last float), orthogonalizes Q (warm: the bucket's Q of the last step; else a random one
from the compressor's seed) and computes P = M Q per matrix. ``exchange()`` sums U, then
P (one allreduce each), orthogonalizes P, computes Q = M^T P, sums Q and divides it by
the world size (the divisor). ``decode()``, after the step's non-finite verdict, writes
M^ = P Q^T into the outputs and e = W - M^ as the new residual (``psgd_scatter_approx``
with the product kernels; else the product, then ``psgd_scatter``), U /
divisor into the uncompressed tensors, and keeps Q for the next step.

State (the bucket's named arrays, ``BucketState.array``): ``"q"`` (warm start) and
``"residual"`` (error feedback), both written only in ``decode``, so a refused step leaves
them as they were; the random
Q is drawn from (seed, bucket, step), so the step counter is its whole random state.
Non-finite values: every rank's count travels in the first allreduce, and each sum is
checked where it arrives (an allreduce gives every rank the same bits), so every rank
reaches the same verdict (``gradfuse.step.verdict``).
"""
import numpy as np

from .exchange import BucketJob, ring_bytes


def _kept(st, name, n):
    """The bucket's named array ``name`` if it exists with ``n`` elements, else None (read
    without making one: the state is written after the step's verdict only)."""
    a = st.arrays.get(name)
    return a if a is not None and a.size == n else None


class PowerSGDJob(BucketJob):
    """One bucket's PowerSGD step (see the module docstring)."""

    algorithm = "powersgd"

    @classmethod
    def residual_sizes(cls, comp, n, comm, counts=None):
        # the residual covers the compressed matrices only and lives among the job's own
        # arrays ("residual"), written after the verdict: no worker/server residual here
        return 0, 0

    def buffers(self):
        """This bucket's work arrays and tables (kept across steps of the same layout)."""
        lay = self.comp.layout(self.ctx, self.n)
        got = self.cache.get("powersgd")
        if got is None or got[0] is not lay:
            bk = self.bk
            f32 = lambda k: bk.empty_bytes(4 * max(k, 1)).view(np.float32)[:k]     # noqa: E731
            bufs = {"W": f32(lay.nw), "U": f32(lay.nu + 1), "P": f32(lay.np_), "Q": f32(lay.nq), "empty": f32(0),
                    "route": bk.pointers(lay.route),
                    "p_tab": tuple(bk.pointers(a) for a in lay.p_tab),
                    "q_tab": tuple(bk.pointers(a) for a in lay.q_tab)}
            self.cache.clear()
            got = self.cache["powersgd"] = (lay, bufs)
        return got

    def _kernels(self):
        """Whether gradfuse's product kernels run this bucket's products (on the host, up
        to rank ``PSGD_PRODUCTS_MAX_RANK``)."""
        return self.bk.device == "cpu" and self.lay.max_rank <= self.bk.kernels.PSGD_PRODUCTS_MAX_RANK

    def _products(self, kind):
        """Per matrix: ``"P"``: P = M Q, ``"Q"``: Q = M^T P, ``"A"``: A = P Q^T (into the
        shared approximation array). On the host up to rank ``PSGD_PRODUCTS_MAX_RANK``
        gradfuse's kernels (``psgd_products``, on this thread: no BLAS thread pool spinning
        beside the framework's threads); above it, and on a GPU, BLAS (numpy's or cupy's
        matmul)."""
        lay, b = self.lay, self.bufs
        W, P, Q = b["W"], b["P"], b["Q"]
        A = self.shared("psgd-A", lay.nw, np.float32) if kind == "A" else None
        K = self.bk.kernels
        if self._kernels():
            K.psgd_products(kind, lay.mat_tab, W, P, Q, b["empty"] if A is None else A)
            return A
        mm, mul = self.bk.xp.matmul, self.bk.xp.multiply
        for (w, n, m, r, po, qo) in lay.mats:
            Mk = W[w:w + n * m].reshape(n, m)
            Pk = P[po:po + n * r].reshape(n, r)
            Qk = Q[qo:qo + m * r].reshape(m, r)
            if kind == "P":
                mm(Mk, Qk, out=Pk)
            elif kind == "Q":
                mm(Mk.T, Pk, out=Qk)
            elif r == 1:         # an outer product: one rounding per element, as a GEMM's, 15x faster than
                mul(Pk, Qk.T, out=A[w:w + n * m].reshape(n, m))     # numpy's matmul of k = 1 (measured)
            else:
                mm(Pk, Qk.T, out=A[w:w + n * m].reshape(n, m))
        return A

    def compress(self):
        lay, bufs = self.lay, self.bufs = self.buffers()
        comp, st, K = self.comp, self.state, self.bk.kernels
        eps = comp.options["orthogonalization_epsilon"]
        e = _kept(st, "residual", lay.nw) if comp.error_feedback else None
        ptrs, _, cnt, lo, hi = self.src
        U = bufs["U"]
        bad = K.psgd_gather(ptrs, cnt, bufs["route"], lo, hi, bufs["empty"] if e is None else e, bufs["W"],
                            U[:lay.nu])
        self.bad = int(bad)
        U[lay.nu:] = np.float32(min(self.bad, 1 << 24))
        if lay.mats:
            q = _kept(st, "q", lay.nq) if comp.options["warm_start"] else None
            Q = bufs["Q"]
            if q is None:
                init = comp.initial_q(lay, self.ctx.bucket, self.ctx.step)
                if self.bk.device == "cpu":
                    Q[...] = init
                else:
                    self.bk.upload(Q, init)
            else:
                Q[...] = q
            K.psgd_orthogonalize(Q, *bufs["q_tab"], eps)
            self._products("P")

    def exchange(self):
        lay, bufs, comm = self.lay, self.bufs, self.comm
        K, xp = self.bk.kernels, self.bk.xp
        U, P, Q = bufs["U"], bufs["P"], bufs["Q"]
        comm.allreduce_inplace(U)                  # the uncompressed part, and every rank's count
        sums = [U]
        if lay.mats:
            comm.allreduce_inplace(P)              # collective 2: P, summed (not divided)
            K.psgd_orthogonalize(P, *bufs["p_tab"], self.comp.options["orthogonalization_epsilon"])
            self._products("Q")                    # Q = M^T P: needs the orthogonalized sum
            comm.allreduce_inplace(Q)              # collective 3: Q, summed
            if self.divisor != 1.0:
                xp.divide(Q, np.float32(self.divisor), out=Q)
            sums += [P, Q]
        self.stats.bytes_sent += sum(ring_bytes(4 * a.size, comm.size) for a in sums)
        flagged = float(self.bk.host(U[lay.nu:])[0]) != 0.0
        finite = all(bool(xp.isfinite(a).all()) for a in sums)
        if flagged or not finite:
            self.nonfinite_ranks = ["?"]
            self.nonfinite_detail = ("a rank's gradients were non-finite" if flagged else
                                     "a sum of P, Q or the uncompressed values overflowed float32")

    def decode(self):
        lay, bufs, comp, st = self.lay, self.bufs, self.comp, self.state
        empty = bufs["empty"]
        K = self.bk.kernels
        e_out = st.array("residual", lay.nw) if comp.error_feedback and lay.nw else None
        e_out = empty if e_out is None else e_out
        ptrs, _, cnt, lo, hi = self.dst
        if self._kernels():     # M^ = P Q^T straight into the outputs (no approximation array)
            K.psgd_scatter_approx(ptrs, cnt, bufs["route"], lay.mrow, lo, hi, lay.mat_tab, bufs["P"], bufs["Q"],
                                  bufs["W"], e_out, bufs["U"][:lay.nu], self.divisor)
        else:
            A = self._products("A") if lay.mats else empty
            K.psgd_scatter(ptrs, cnt, bufs["route"], lo, hi, A, bufs["W"], e_out, bufs["U"][:lay.nu],
                           self.divisor)
        if lay.mats and comp.options["warm_start"]:
            st.array("q", lay.nq)[...] = bufs["Q"]
        self.commit()
