"""Pure-numpy definition of the top-k / random-k kernels (gradfuse/kernels/_sparse.pxi).

Straightforward and vectorised: selection by a stable sort (O(n log n), fine for
tests), float32 arithmetic throughout. The kernels must match these bit for bit.

A bucket is a list of tensors (``counts``, their element counts; None: one tensor):
each tensor selects its own ``ks[i]`` elements; indices are bucket positions, ascending.
"""
import numpy as np

MAX_N = 0xFFFFFFFF
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)


def _c(g, e):
    g = np.ascontiguousarray(g, dtype=np.float32)
    if e is None or len(e) == 0:
        return g.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        return (g + np.asarray(e, dtype=np.float32)).astype(np.float32)


def select_largest(keys, k):
    """Positions of the k largest uint32 keys, ties to the lower position, ascending."""
    keys = np.asarray(keys, dtype=np.uint32)
    order = np.argsort(np.uint32(0xFFFFFFFF) - keys, kind="stable")   # descending, stable
    return np.sort(order[:k]).astype(np.uint32)


def topk_keys(c):
    """|c| as the uint32 bit pattern with the sign cleared (NaNs above +inf)."""
    return np.asarray(c, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)


def _segments(n, counts, ks):
    counts = [n] if counts is None else [int(c) for c in counts]
    ks = [int(k) for k in np.atleast_1d(ks)]
    if sum(counts) != n or len(ks) != len(counts):
        raise ValueError("counts must sum to n and ks have one k per tensor")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts else []
    return [(int(a), m, k) for a, m, k in zip(starts, counts, ks)]


def k_for(ratio, n):
    """k of a tensor of n elements: min(n, max(1, ceil(ratio * n))), 0 for an empty one."""
    return 0 if n == 0 else min(n, max(1, int(np.ceil(ratio * n))))


def topk(g, e, k, counts=None):
    """-> (values, indices, e_new, nonfinite) for c = g + e (e None/empty: no residual);
    ``k`` one int per tensor (or one int for counts None)."""
    c = _c(g, e)
    keys = topk_keys(c)
    parts = [a + select_largest(keys[a:a + m], kk).astype(np.int64) for a, m, kk in _segments(len(c), counts, k)]
    idx = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    values = c[idx]
    e_new = c.copy()
    e_new[idx] = np.float32(0)
    nonfinite = int(np.count_nonzero(~np.isfinite(c)))
    return values, idx, e_new, nonfinite


M64 = (1 << 64) - 1
GOLDEN_INT = 0x9E3779B97F4A7C15


def _mix_int(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def splitmix64_mix(z):
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * M1
    z = (z ^ (z >> np.uint64(27))) * M2
    return z ^ (z >> np.uint64(31))


def tensor_seed(seed, t):
    """s_t = splitmix64_mix(seed + (t + 1) * 0x9e3779b97f4a7c15): tensor t's own stream."""
    return _mix_int(int(seed) + (t + 1) * GOLDEN_INT)


def randomk_positions(s, n, k):
    """Stratified draw of k of n positions from tensor seed s: stratum m is
    [floor(m n / k), floor((m + 1) n / k)), and its position is
    start + ((h_m * length) >> 32) with h_m = splitmix64_mix(s + (m + 1) * golden) >> 32."""
    if k == 0:
        return np.zeros(0, np.uint64)
    m = np.arange(k, dtype=object)
    a = np.array([(int(x) * n) // k for x in m], dtype=np.uint64)
    b = np.array([((int(x) + 1) * n) // k for x in m], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(s) + (np.arange(k, dtype=np.uint64) + np.uint64(1)) * GOLDEN
        h = splitmix64_mix(z) >> np.uint64(32)
        return a + ((h * (b - a)) >> np.uint64(32))


def randomk_indices(seed, counts, ks):
    """Bucket positions of every tensor's draw, ascending; the t-th non-empty tensor draws
    from tensor_seed(seed, t) (empty tensors are not counted)."""
    counts = [int(c) for c in np.atleast_1d(counts)]
    segs = [s for s in _segments(sum(counts), counts, ks) if s[1] > 0]
    parts = [a + randomk_positions(tensor_seed(seed, t), m, k).astype(np.int64)
             for t, (a, m, k) in enumerate(segs)]
    return np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)


def randomk(g, e, seed, k, counts=None):
    """-> (values, indices, e_new, nonfinite); ``k`` one int per tensor."""
    c = _c(g, e)
    idx = randomk_indices(seed, [len(c)] if counts is None else counts, k)
    values = c[idx]
    e_new = c.copy()
    e_new[idx] = np.float32(0)
    nonfinite = int(np.count_nonzero(~np.isfinite(c)))
    return values, idx, e_new, nonfinite


def decompress_sum(values, indices, n, divisor):
    """0.0f + sum over ranks r (in order) of the rank's values at each index, / divisor."""
    values = np.asarray(values, dtype=np.float32)
    indices = np.asarray(indices, dtype=np.uint32)
    out = np.zeros(n, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for r in range(values.shape[0]):
            np.add.at(out, indices[r].astype(np.int64), values[r])   # unbuffered, in m order
        if divisor != 1.0:
            out = (out / np.float32(divisor)).astype(np.float32)
    return out
