"""The cost model of gradfuse's collectives: predicted seconds of one bucket's exchange.

Pure arithmetic (no numpy, no MPI), so a benchmark, the docs and ``algorithm="auto"``
all use the same formulas. Every collective is bandwidth-optimal ("ring") in this model;
the MPI library may pick another algorithm for small messages (recursive doubling:
log2 p latency steps instead of p - 1), which only changes the latency term.

Notation, for one bucket of n float32 elements on p ranks:

- ``S = 4 n`` the bucket's gradient bytes, ``P`` one rank's compressed payload in bytes
  (``payload_bytes``: the compressor's arrays plus the 8-byte non-finite header),
- ``B`` the link bandwidth in bytes/s (what one rank can send, and receive, at once:
  full duplex), ``a`` the latency per message step in seconds,
- ``C`` the compress rate and ``D`` the decode rate of the compressor's kernels, in
  gradient bytes (4 per element) per second (``Rates``; ``python -m gradfuse.bench
  compress`` measures them), and ``R`` the rate of the summation inside an allreduce.

Predicted seconds (``predict``), with ``q = (p - 1) / p``:

- ``ring`` (fp32 allreduce, ``none``): ``2 q S / B + 2 (p - 1) a + q S / R``
  (a reduce-scatter and an allgather, each p - 1 steps of S / p; the reduce-scatter adds
  q S bytes).
- ``allreduce`` (fp16/bf16 summed by the network): ``S / C + 2 q (S/2) / B + 2 (p - 1) a
  + q S / R + S / D``: cast, a ring over 2 n bytes, the 16-bit sum, cast back.
- ``allgather`` (any compressor): ``S / C + (p - 1) P / B + (p - 1) a + decode(p)``:
  every rank sends its payload to p - 1 others and decodes all p. ``decode(m)`` is
  ``m S / D`` for the dense formats (1-bit, 2-bit: every payload covers every element)
  and ``S / D + m P / D'`` for the sparse ones (the output is cleared once, then each
  payload's values are scattered in; ``D'`` is taken as ``D``).
- ``twophase`` (1-bit, 2-bit): ``S / C + 2 q P / B + 2 (p - 1) a + decode(p) / p
  + S / (p C) + decode(1)``: an alltoall of the p chunks of P / p, the server decodes p
  chunks of n / p elements and compresses its chunk again, then an allgather of the
  servers' chunks and one decode of the whole bucket. Bytes per rank stay about
  2 P flat in p, against (p - 1) P for the allgather.
- ``sparse_allreduce`` (random-k: every rank draws the same k positions): ``S / C +
  2 q (4 k) / B + 2 (p - 1) a + q 4 k / R + decode(1)``: the k values are summed by a
  ring allreduce of k float32 values.
- ``powersgd`` (PowerSGD, three dependent ring allreduces: the uncompressed part U, then
  P, then Q): ``S / C + 2 q P / B + 3 * 2 (p - 1) a + q P / R + S / D``, where P =
  4 (sum over the compressed matrices of r (n + m) + U + 1) bytes (``payload_bytes``, from
  the tensors' ``shapes``), C covers the gather, P = M Q and Q = M^T P, D the
  approximation P Q^T and the scatter. The bytes do not grow with p (2 q P), and neither
  does the compute; the latency grows as 6 (p - 1) a.

``crossover(...)`` is the smallest p at which an algorithm stops paying against the fp32
ring (its prediction is at least the ring's); ``best(...)`` the cheapest of a set of
algorithms, which ``algorithm="auto"`` uses with the ranks' agreed values only (the same
constants, options and sizes on every rank), so every rank makes the same choice.
"""
import math

__all__ = ["Link", "Rates", "LINKS", "DEFAULT_LINK", "RATES", "link_from", "payload_bytes", "bytes_per_rank", "predict",
           "best", "crossover", "powersgd_split"]

GBIT = 1e9 / 8


class Link:
    """A rank's network link: ``bandwidth`` in bytes/s per direction, ``latency`` in s per
    message step."""

    __slots__ = ("bandwidth", "latency")

    def __init__(self, bandwidth, latency=0.0):
        if not (isinstance(bandwidth, (int, float)) and bandwidth > 0 and math.isfinite(bandwidth)):
            raise ValueError(f"link bandwidth must be a finite number of bytes/s > 0, got {bandwidth!r}")
        if not (isinstance(latency, (int, float)) and latency >= 0 and math.isfinite(latency)):
            raise ValueError(f"link latency must be a finite number of seconds >= 0, got {latency!r}")
        self.bandwidth, self.latency = float(bandwidth), float(latency)

    def __repr__(self):
        return f"Link({self.bandwidth / GBIT:g} Gbit/s, {self.latency * 1e6:g} us)"

    def __eq__(self, other):
        return isinstance(other, Link) and (self.bandwidth, self.latency) == (other.bandwidth, other.latency)

    def __hash__(self):
        return hash((self.bandwidth, self.latency))


#: Presets (latency: one message step of a TCP link through a switch).
LINKS = {"1gbit": Link(1 * GBIT, 50e-6), "10gbit": Link(10 * GBIT, 20e-6), "100gbit": Link(100 * GBIT, 5e-6)}

#: The link ``algorithm="auto"`` assumes when the pipeline is not told one (``Pipeline(link_bandwidth=...)``).
DEFAULT_LINK = LINKS["10gbit"]

_UNITS = {"gbit": GBIT, "mbit": GBIT / 1000, "gb": 1e9, "mb": 1e6, "b": 1.0}


def link_from(spec, latency=None):
    """A ``Link`` from a preset name (``"1gbit"``, ``"10gbit"``, ``"100gbit"``), a rate
    with a unit (``"2.5gbit"``, ``"400mbit"``, ``"1.2GB"``: bytes/s), a number of bytes/s,
    or a ``Link``; ``latency`` (s) overrides the preset's.

    Example: ``link_from("1gbit").bandwidth == 125e6``.
    """
    if isinstance(spec, Link):
        link = spec
    elif isinstance(spec, str):
        s = spec.strip().lower().replace("/s", "").replace("ps", "")
        link = LINKS.get(s)
        unit = next((u for u in _UNITS if s.endswith(u)), None)
        if link is None and unit is not None:
            try:
                link = Link(float(s[:-len(unit)]) * _UNITS[unit], 20e-6)
            except ValueError:
                link = None
        if link is None:
            raise ValueError(f"link bandwidth {spec!r}: expected a preset ({', '.join(LINKS)}), a rate "
                             f"> 0 like '2.5gbit' / '400mbit' / '1.2GB', or bytes/s as a number")
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        link = Link(float(spec), 20e-6)
    else:
        raise ValueError(f"link bandwidth must be a preset name, a rate string or bytes/s, got {spec!r}")
    return link if latency is None else Link(link.bandwidth, latency)


class Rates:
    """Compute rates of a compressor's kernels in gradient bytes (4 per element) per
    second: ``compress`` (error feedback included), ``decode`` (decode-and-sum of one
    payload into the bucket), ``reduce`` (the sum an allreduce computes)."""

    __slots__ = ("compress", "decode", "reduce")

    def __init__(self, compress, decode, reduce=8e9):
        self.compress, self.decode, self.reduce = float(compress), float(decode), float(reduce)

    def __repr__(self):
        return (f"Rates(compress={self.compress / 1e9:g} GB/s, decode={self.decode / 1e9:g} GB/s, "
                f"reduce={self.reduce / 1e9:g} GB/s)")


#: Kernel rates measured on this project's 2-core development machine (quiet; the
#: "Compressor kernels" table of docs/benchmarks.md, ``python -m gradfuse.bench compress``).
#: They are constants on purpose: ``auto`` must decide the same on every rank. random-k's
#: compress rate is not in that table's run (it predates the O(k) draw); 12 GB/s is an
#: estimate from the 0.99x-of-the-bandwidth-limit figure in the text below that table.
RATES = {
    "none": Rates(float("inf"), float("inf")),
    "fp16": Rates(22.9e9, 25.2e9), "bf16": Rates(21.3e9, 25.9e9),
    "1bit": Rates(11.5e9, 32.5e9), "2bit": Rates(8.0e9, 19.0e9),
    "topk": Rates(5.4e9, 28.3e9), "randomk": Rates(12.0e9, 26.9e9),
    # PowerSGD's whole compute at its default rank 1 on ResNet-50 (gather, Gram-Schmidt, the
    # products by gradfuse's kernels, the fused decode), ``OMP_NUM_THREADS=1 python -m
    # gradfuse.bench powersgd`` (docs/compressors.md, "PowerSGD"); rank 4 computes about
    # 1.2x as long
    "powersgd": Rates(3.5e9, 4.7e9),
}

SPARSE = ("topk", "randomk")
ALGORITHMS = ("ring", "allreduce", "allgather", "twophase", "sparse_allreduce", "powersgd")


def powersgd_split(shapes, rank=1, min_rate=2.0):
    """``(compressed elements, floats sent)`` of PowerSGD on tensors of ``shapes``: a tensor
    of two or more dimensions is the matrix (shape[0], rest) of rank r = min(n, m, rank),
    compressed when (n + m) r * min_rate < n m (torch's rule); it sends r (n + m) floats,
    every other tensor its elements (``gradfuse.compressors.powersgd.Layout``)."""
    done = sent = 0
    for s in shapes:
        count = math.prod(int(d) for d in s)
        if len(s) >= 2 and count:
            n, m = int(s[0]), count // int(s[0])
            r = min(n, m, int(rank))
            if (n + m) * r * min_rate < n * m:
                done += count
                sent += r * (n + m)
                continue
        sent += count
    return done, sent


def _name_options(compressor, options):
    if isinstance(compressor, str):
        return compressor, dict(options or {})
    opts = dict(getattr(compressor, "options", {}) or {})
    opts.update(options or {})
    return compressor.name, opts


def _k(ratio, n):
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def payload_bytes(compressor, n, options=None, counts=None, shapes=None):
    """One rank's payload in bytes for a bucket of n elements (with the 8-byte header;
    ``counts``: the tensors' element counts, for per-tensor formats; default one tensor;
    ``shapes``: the tensors' shapes, for PowerSGD; default each tensor 1-D).

    ``compressor``: a name or a compressor object (its ``options`` are used).
    """
    name, opts = _name_options(compressor, options)
    counts = tuple(counts) if counts else (n,)
    if name == "none":
        return 4 * n
    if name == "powersgd":        # P's, Q's, the uncompressed values and the flag, summed
        shapes = tuple(shapes) if shapes else tuple((c,) for c in counts)
        return 4 * (powersgd_split(shapes, opts.get("rank", 1), opts.get("min_compression_rate", 2.0))[1] + 1)
    if name in ("fp16", "bf16"):
        return 2 * n
    if name == "1bit":
        block = int(opts.get("block_size", 512))
        words = sum((c + 31) // 32 for c in counts)
        scales = sum(-(-c // block) for c in counts)
        return 8 + _a8(4 * words) + _a8(4 * scales)
    if name == "2bit":
        if opts.get("threshold") is not None:          # MXNet's absolute format: 2 bits, no values
            return 8 + _a8((n + 3) // 4)
        block = int(opts.get("block_size", 512))       # the scaled format: 16 codes a word, a value per block
        words = sum((c + 15) // 16 for c in counts)
        values = sum(-(-c // block) for c in counts)
        return 8 + _a8(4 * words) + _a8(4 * values)
    if name in SPARSE:
        k = sum(_k(float(opts.get("ratio", 0.01)), c) for c in counts)
        return 8 + (_a8(4 * k) + _a8(4 * k) if name == "topk" else _a8(4 * k))
    raise ValueError(f"cost model: unknown compressor {name!r}")


def _a8(x):
    return (x + 7) & ~7


def _sparse_values(name, n, opts, counts):
    """random-k's k float32 values (what the sparse allreduce sums), in bytes."""
    counts = tuple(counts) if counts else (n,)
    return 4 * sum(_k(float(opts.get("ratio", 0.01)), c) for c in counts)


def bytes_per_rank(compressor, algorithm, n, p, options=None, counts=None, shapes=None):
    """Bytes one rank sends for a bucket of n elements on p ranks with ``algorithm``."""
    name, opts = _name_options(compressor, options)
    q = (p - 1) / p
    if algorithm == "ring":
        return 2 * q * 4 * n
    if algorithm == "allreduce":
        return 2 * q * 2 * n
    P = payload_bytes(name, n, opts, counts, shapes)
    if algorithm == "allgather":
        return (p - 1) * P
    if algorithm == "powersgd":
        return 2 * q * P
    if algorithm == "twophase":
        return 2 * q * P
    if algorithm == "sparse_allreduce":
        return 2 * q * _sparse_values(name, n, opts, counts)
    raise ValueError(f"cost model: unknown algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")


def predict(compressor, algorithm, n, p, link, rates=None, options=None, counts=None, shapes=None):
    """Predicted seconds of one bucket's exchange (compress, wire, decode; see the module
    docstring for each formula).

    Args:
        compressor: a name (``"none"``, ``"fp16"``, ``"1bit"``, ...) or a compressor object.
        algorithm: ``"ring"``, ``"allreduce"``, ``"allgather"``, ``"twophase"``,
            ``"sparse_allreduce"`` or ``"powersgd"``.
        n, p: the bucket's float32 elements and the number of ranks.
        link: a ``Link`` or anything ``link_from`` takes.
        rates: ``Rates`` (default ``RATES[name]``; ``none`` computes nothing).
        counts, shapes: the bucket's tensor counts (per-tensor formats) and shapes (PowerSGD).
    Returns: seconds (float). ``p == 1`` costs only the compute of a compressing
    algorithm (there is no wire).

    Example: ``predict("none", "ring", 25_557_032, 2, "1gbit")`` is about 0.82 s.
    """
    name, opts = _name_options(compressor, options)
    link = link_from(link)
    r = rates or RATES.get(name) or RATES["none"]
    if p < 1 or n < 0:
        raise ValueError(f"cost model: need p >= 1 and n >= 0, got p={p}, n={n}")
    S, B, a, q = 4.0 * n, link.bandwidth, link.latency, (p - 1) / p
    wire = bytes_per_rank(name, algorithm, n, p, opts, counts, shapes) / B
    steps = (p - 1) * (1 if algorithm == "allgather" else 6 if algorithm == "powersgd" else 2)
    t = wire + steps * a
    if algorithm == "ring":
        return t + q * S / r.reduce
    comp = S / r.compress
    if algorithm == "allreduce":
        return t + comp + q * S / r.reduce + S / r.decode
    P = payload_bytes(name, n, opts, counts, shapes)
    if algorithm == "powersgd":
        return t + comp + q * P / r.reduce + S / r.decode

    def decode(m, frac=1.0):
        if name in SPARSE:
            return frac * S / r.decode + m * frac * P / r.decode
        return m * frac * S / r.decode

    if algorithm == "allgather":
        return t + comp + decode(p)
    if algorithm == "twophase":
        return t + comp + decode(p, 1.0 / p) + S / (p * r.compress) + decode(1)
    if algorithm == "sparse_allreduce":
        return t + comp + q * _sparse_values(name, n, opts, counts) / r.reduce + decode(1)
    raise ValueError(f"cost model: unknown algorithm {algorithm!r}")


def best(compressor, algorithms, n, p, link, rates=None, options=None, counts=None, shapes=None):
    """The cheapest of ``algorithms`` for this bucket (ties: the first listed), by ``predict``."""
    costs = [(predict(compressor, a, n, p, link, rates, options, counts, shapes), i, a)
             for i, a in enumerate(algorithms)]
    return min(costs)[2]


def crossover(compressor, algorithm, n, link, rates=None, options=None, p_max=4096, baseline="ring",
              counts=None, shapes=None):
    """The smallest p in [2, p_max] at which ``algorithm`` is predicted no faster than the
    fp32 ``baseline`` for a bucket of n elements (None if it pays up to ``p_max``).

    Example: ``crossover("1bit", "allgather", 25_557_032, "1gbit")`` is about 55 (GRACE-style figures: 2-bit about 29, top-k 1 % about 100).
    """
    def loses(p):
        return (predict(compressor, algorithm, n, p, link, rates, options, counts, shapes)
                >= predict("none", baseline, n, p, link))

    if loses(2):
        return 2
    lo, hi = 2, 4
    while hi <= p_max and not loses(hi):
        lo, hi = hi, hi * 2
    if hi > p_max:
        if not loses(p_max):
            return None
        hi = p_max
    while hi - lo > 1:        # the gap to the ring grows with p for every algorithm here: bisect
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if loses(mid) else (mid, hi)
    return hi
