"""Pure-numpy definition of the top-k / random-k kernels (gradfuse/kernels/_sparse.pxi).

Straightforward and vectorised: selection by a stable sort (O(n log n), fine for
tests), float32 arithmetic throughout. The kernels must match these bit for bit.
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


def topk(g, e, k):
    """-> (values, indices, e_new, nonfinite) for c = g + e (e None/empty: no residual)."""
    c = _c(g, e)
    idx = select_largest(topk_keys(c), k)
    values = c[idx]
    e_new = c.copy()
    e_new[idx] = np.float32(0)
    nonfinite = int(np.count_nonzero(~np.isfinite(c)))
    return values, idx, e_new, nonfinite


def splitmix64_mix(z):
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * M1
    z = (z ^ (z >> np.uint64(27))) * M2
    return z ^ (z >> np.uint64(31))


def randomk_hash(seed, n):
    """h_i = splitmix64_mix(seed + i + 0x9e3779b97f4a7c15) >> 32, uint64 wrap-around."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(n, dtype=np.uint64) + GOLDEN
        return (splitmix64_mix(z) >> np.uint64(32)).astype(np.uint32)


def randomk_indices(seed, n, k):
    """The k positions with the smallest h_i, ties to the lower position, ascending."""
    h = randomk_hash(seed, n)
    order = np.argsort(h, kind="stable")
    return np.sort(order[:k]).astype(np.uint32)


def randomk(g, e, seed, k):
    """-> (values, indices, e_new, nonfinite)."""
    c = _c(g, e)
    idx = randomk_indices(seed, len(c), k)
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
