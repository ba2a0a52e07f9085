"""DGC's momentum correction and sparsity warm-up (Lin et al., Deep Gradient Compression, 2018).

**Momentum correction.** Error feedback on the raw gradient, with the optimizer's momentum
applied after the exchange, diverges for the quantizers at momentum 0.9
(docs/experiments.md). DGC
moves the momentum in front of the compressor: every rank keeps its own velocity, error
feedback accumulates the velocity, and the optimizer then runs without momentum. Per rank
and bucket, with velocity ``u`` and residual ``e`` (both zero at the start), float32::

    u = m * u + g                       # the velocity update (two roundings, no FMA)
    x = u,  or  x = m * u + g           # Nesterov (DGC's variant for NAG)
    c = x + e                           # error feedback, as without momentum
    send compress(c);  e = c - decompress(sent)
    u[j] = 0 where a sparsifier sent c_j != 0   # momentum factor masking (top-k, random-k)
    u = decompress(sent)                        # 1bit, velocity="sent" (its default; SGD)

and the update is ``w -= lr * mean_ranks(decompress(sent))``. Lossless (``compress=None``,
and uncompressed tensors of a compressed pipeline: warm-up steps, a layer policy's
``None`` patterns), the same velocity runs and the bucket's sum is the sum of ``x``:
because the sum is linear, that is exactly SGD with momentum on the averaged gradient.

1-bit sends every coordinate, so it has nothing to mask; its velocity becomes what this
rank sent (1-bit Adam's rule, ``gradfuse.compressors.onebit``), so that the part of ``c``
left unsent is kept once, in the residual, and the ranks' mean velocity is the applied
update.

Masking is decided from the residual, so it needs no knowledge of a compressor's
payload: a position whose non-zero ``c_j`` was sent has ``e_j = c_j - c_j = 0``
(``momentum_mask``: ``e_out == 0 and e_in + x != 0``); positions whose ``c_j`` is zero are
left alone (sending a zero changes nothing).

The velocity is double-buffered like the residual (``gradfuse.compressors.state``): the
update writes the spare buffer, which becomes current when the step is committed, so a
step refused for NaN/Inf leaves it as it was. ``CompressionState.scale_velocity(f)``
multiplies every velocity by ``f`` at its next update (``u = (m * f) * u + g``); the MXNet
binding passes ``lr_old / lr_new`` when the learning rate changes, which keeps ``lr * u``
equal to MXNet's lr-scaled momentum buffer (docs/mxnet.md).

The compressor reads ``x`` through a pointer table over the velocity array with the
bucket's own tensor boundaries (``table``), so every compress kernel, per-tensor formats
included, works unchanged. The velocity update is its own pass (``momentum_update`` in
``_core`` and ``cuda/momentum.cu``: reads g and u, writes u; the compress kernel then
reads u instead of g): one more pass over the bucket than without momentum.

**Sparsity warm-up** (``sparsity_warmup=N``, top-k and random-k): over the first N
compressed steps the ratio goes 25%, 6.25%, 1.5625%, ... (each stage 4x sparser, the N
steps cut into equal stages, one per density above ``ratio``), then ``ratio``
(``warmup_ratio``). The step counter, which every rank agrees on and which is
checkpointed, picks the stage, so every rank sends the same k. ``warmup_steps`` (fully
uncompressed steps) comes first.
"""
import numpy as np

EMPTY_TABLE = np.zeros(0, np.int64)
STAGE_FACTOR = 0.25          # DGC: each warm-up stage keeps a quarter of the previous density


def pipeline_momentum(policy):
    """``(m, nesterov)`` of a pipeline's compressors (a ``LayerPolicy``), or None without momentum.

    The velocity belongs to the pipeline: every tensor of a momentum pipeline gets one,
    compressed or not, so a layer policy's lossy compressors must agree on it (the
    uncompressed tensors take theirs).
    """
    main = getattr(policy, "main", policy)          # a LayerPolicy, or one compressor
    comps = [main] if getattr(policy, "single", True) else list(policy.compressors[1:])
    seen = {}
    for c in comps:
        seen.setdefault((c.momentum, c.nesterov), c.name)
    if len(seen) > 1:
        parts = ", ".join(f"{name!r} has momentum={m}, nesterov={n}" for (m, n), name in seen.items())
        raise ValueError(f"layer policy: the compressors disagree on the momentum correction ({parts}); "
                         f"the velocity is the pipeline's, give every lossy compressor the same momentum")
    if not seen:
        return None
    (m, nesterov), = seen
    return (m, nesterov) if m else None


def address(a):
    """The data address of a host (numpy) or device (cupy) array."""
    return a.ctypes.data if type(a) is np.ndarray else a.data.ptr


def table(st, bk, base, byte_offsets, rows, lo, hi):
    """A pointer table (``rows`` long, rows lo..hi-1 set) at ``base`` + ``byte_offsets[i]``,
    cached in the bucket state ``st`` (the kernels read rows lo..hi-1 only)."""
    key = ("table", base, rows, lo, hi)
    t = st.tables.get(key)
    if t is None:
        if len(st.tables) > 16:
            st.tables.clear()
        ptrs = np.zeros(rows, np.int64)
        ptrs[lo:hi] = base + np.asarray(byte_offsets[lo:hi], np.int64)
        t = st.tables[key] = bk.pointers(ptrs)
    return t


def scratch(st, bk, n):
    """The bucket's Nesterov scratch array (what the compressor reads), kept in the state."""
    x = st.tables.get("nesterov")
    if x is None or x.size != n:
        x = st.tables["nesterov"] = bk.zeros(n, np.float32)
    return x


def update(bk, st, src, out, velocity):
    """``u_next = (m * scale) * u + g`` for the bucket ``src`` (a 5-tuple table) into the
    state's spare velocity; ``out`` (a pointer table or ``EMPTY_TABLE``) receives ``u_next``
    or, Nesterov, ``m * u_next + g`` (the look-ahead takes the momentum itself, unscaled)."""
    m, nesterov = velocity
    ptrs, off, cnt, lo, hi = src
    bk.kernels.momentum_update(ptrs, off, cnt, lo, hi, st.vel_cur, st.vel_nxt, m * st.vscale, out,
                               m if nesterov else 0.0)


def feed(bk, st, src, velocity):
    """The velocity stage of a compressed bucket: update the velocity from the gradients
    ``src`` and return ``(table, x)``: a table over what the compressor reads instead of
    the gradients (``x``: the new velocity, or the Nesterov values) with the bucket's
    tensor boundaries."""
    ptrs, off, cnt, lo, hi = src
    n = st.vel_nxt.size
    elem = np.asarray(off, np.int64) * 4
    if velocity[1]:
        x = scratch(st, bk, n)
        xt = table(st, bk, address(x), elem, len(ptrs), lo, hi)
        update(bk, st, src, xt, velocity)
    else:
        update(bk, st, src, EMPTY_TABLE, velocity)
        x = st.vel_nxt
        xt = table(st, bk, address(x), elem, len(ptrs), lo, hi)
    return (xt, off, cnt, lo, hi), x


def mask(bk, e_in, x, e_out, u):
    """Momentum factor masking after the compress kernel (see the module docstring)."""
    if u.size and e_out.size:
        bk.kernels.momentum_mask(e_in, x, e_out, u)


def warmup_ratio(comp, step):
    """The ratio of compressed step ``step`` under DGC's sparsity warm-up, or None (no ramp:
    not a sparsifier, warm-up off or over, or ``ratio`` at least the first stage's)."""
    n_ramp = getattr(comp, "sparsity_warmup", 0)
    t = step - comp.warmup_steps
    if not n_ramp or t < 0 or t >= n_ramp:
        return None
    target = comp.options["ratio"]
    stages, d = [], STAGE_FACTOR
    while d > target:
        stages.append(d)
        d *= STAGE_FACTOR
    if not stages:
        return None
    return stages[t * len(stages) // n_ramp]


_STAGES = {}       # (id(comp), ratio) -> (comp, the same compressor at that ratio)


def stage_compressor(comp, step):
    """The compressor that runs step ``step``: ``comp``, or during its sparsity warm-up the
    same compressor at the stage's ratio (made once per stage). The job uses it; the
    agreed config, the residual keys and the checkpoint stay ``comp``'s."""
    ratio = warmup_ratio(comp, step)
    if ratio is None:
        return comp
    key = (id(comp), ratio)
    hit = _STAGES.get(key)
    if hit is None or hit[0] is not comp:
        if len(_STAGES) > 64:
            _STAGES.clear()
        cfg = {k: v for k, v in comp.get_config().items() if k != "name"}
        cfg.update(ratio=ratio, sparsity_warmup=0)
        hit = _STAGES[key] = (comp, type(comp)(**cfg))
    return hit[1]
