// Sparse (top-k / random-k): GPU twins of gradfuse/_sparse.h (docs/compressors.md,
// docs/gpu.md). Two halves:
//
// 1. Decompress-and-accumulate (every rank, all p payloads), gf_sparse_*:
//
//   out[j] = 0.0f; for r in 0..p-1, m in 0..k-1: if indices[r, m] == j: out[j] += values[r, m]
//   then out[j] = out[j] / (float)divisor unless divisor == 1.0
//
// 2. Compress: top-k and random-k selection with fused error feedback, gf_sp_* (below
//    the decompress kernels).
//
// NVRTC-compatible, own fixed-width types, _rn intrinsics only.
//
// Decompress order: the host zeroes the outputs, then launches one scatter-add per rank,
// in rank order (stream order orders the ranks). Inside a rank the indices are strictly
// ascending (the compressors' payload rule), so every thread owns a distinct element
// and the adds do not race; a row that is not strictly ascending (checked first, by
// gf_sparse_check) goes through the serial kernel instead, which adds in m order like
// the CPU. Then one division pass.


// info[0]: smallest flat position r*k+m with an index >= n (atomicMin; starts at ~0);
// info[1]: number of pairs indices[r, m-1] >= indices[r, m] (a row not strictly ascending).
extern "C" __global__ void gf_sparse_check(const gf_u32* indices, gf_i64 p, gf_i64 k, gf_i64 n, gf_u64* info)
{
    gf_i64 total = p * k;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 q = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
        gf_u32 j = indices[q];
        if ((gf_i64)j >= n) atomicMin(info, (gf_u64)q);
        if (q % k != 0 && indices[q - 1] >= j) atomicAdd(info + 1, 1ull);
    }
}

// row of bucket position j: last r in [lo, hi) with offsets[r] <= j (dense offsets)
__device__ __forceinline__ gf_i64 gf_row_of(const gf_i64* offsets, gf_i64 lo, gf_i64 hi, gf_i64 j)
{
    gf_i64 a = lo, b = hi - 1;
    while (a < b) {
        gf_i64 m = a + ((b - a + 1) >> 1);
        if (offsets[m] <= j) a = m; else b = m - 1;
    }
    return a;
}

__device__ __forceinline__ float* gf_dst(const gf_i64* ptrs, const gf_i64* offsets, gf_i64 lo, gf_i64 hi,
                                         gf_i64 j)
{
    gf_i64 r = gf_row_of(offsets, lo, hi, j);
    return (float*)ptrs[r] + (j - offsets[r]);
}

// one rank's row: out[idx[m]] += val[m], m parallel (indices unique within the row)
extern "C" __global__ void gf_sparse_add_array(const float* val, const gf_u32* idx, gf_i64 k, float* out)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 m = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; m < k; m += stride) {
        float* d = out + idx[m];
        *d = __fadd_rn(*d, val[m]);
    }
}

extern "C" __global__ void gf_sparse_add_table(const float* val, const gf_u32* idx, gf_i64 k,
                                               const gf_i64* ptrs, const gf_i64* offsets,
                                               gf_i64 lo, gf_i64 hi)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 m = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; m < k; m += stride) {
        float* d = gf_dst(ptrs, offsets, lo, hi, (gf_i64)idx[m]);
        *d = __fadd_rn(*d, val[m]);
    }
}

// the same, one thread in m order (rows that are not strictly ascending)
extern "C" __global__ void gf_sparse_add_serial(const float* val, const gf_u32* idx, gf_i64 k, float* out,
                                                const gf_i64* ptrs, const gf_i64* offsets,
                                                gf_i64 lo, gf_i64 hi)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (gf_i64 m = 0; m < k; m++) {
        float* d = out ? out + idx[m] : gf_dst(ptrs, offsets, lo, hi, (gf_i64)idx[m]);
        *d = __fadd_rn(*d, val[m]);
    }
}

// table rows lo..hi-1 (rows on blockIdx.y): zero = 1 sets them to +0.0f, else divides by d
extern "C" __global__ void gf_sparse_rows(const gf_i64* ptrs, const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                          int zero, float d)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i];
        float* x = (float*)ptrs[i];
        for (gf_i64 t = tid; t < c; t += stride) x[t] = zero ? 0.0f : __fdiv_rn(x[t], d);
    }
}

extern "C" __global__ void gf_sparse_div_array(float* out, gf_i64 n, float d)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 t = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride)
        out[t] = __fdiv_rn(out[t], d);
}


// =============================================================================== compress
//
// Top-k / random-k selection with fused error feedback: GPU twin of gf_sp_topk,
// gf_sp_randomk_indices and gf_sp_gather_table (gradfuse/_sparse.h). Same results, bit
// for bit: "the k largest keys, ties to the lower index, indices ascending", where
//   top-k:    raw = bits(c), key = raw & 0x7fffffff  (c = g + e_in, or g)
//   random-k: raw = key = ~h_i, h_i = splitmix64_mix(seed + i + 0x9e3779b97f4a7c15) >> 32
//
// Radix select on the 32-bit keys with the CPU's digits (bits 31..21, 20..10, 9..0), every
// level a pass over the keys (no n-sized scratch; with error feedback c lives in e_out):
//   gf_sp_pass1   c = g + e_in into e_out, the non-finite count, and (top-k) the level-1
//                 histogram of key >> 21; or k == n: every element, in order
//   gf_sp_hist    histogram of one digit over the keys whose higher digits equal the
//                 prefix found so far (random-k's level 1 too: no prefix)
//   gf_sp_select  one warp: the bin holding the k-th largest key (the CPU's find_bin:
//                 from the top bin down, the first with cum + h >= k; bin 0 otherwise);
//                 state[0] = prefix << width | bin, state[1] = count of keys above it
//   -> after three levels state[0] = T, state[1] = count(key > T) < k <= count(key >= T)
//   gf_sp_count   per tile of 1024 elements (one warp: 32 x 32, coalesced): the number
//                 of keys > T and == T
//   gf_sp_scan    one block: exclusive prefix sums of both tile counts
//   gf_sp_write   per tile: element j is taken if key > T, or key == T and fewer than
//                 need = k - count(key > T) ties come before it (ballot + popc ranks);
//                 its slot is the tile's prefix of taken elements plus its rank in the
//                 tile, so the indices come out ascending; values = raw c; e_out[j] = 0
//   gf_sp_pick    random-k: values[m] = c[indices[m]], e_out[indices[m]] = 0
//   gf_sp_iota    k == n: indices = 0..n-1
//
// Histograms are per block in shared memory (2048 u32), flushed with one global atomic
// per non-zero bin; a warp whose lanes all fall in one bin (ties, e.g. a zero bucket)
// adds once. Every warp intrinsic is reached by full warps: the grid-stride loops run in
// whole warps and lanes past n take part with an "out" flag.
//
// NaN through c = g + e: the GPU returns 0x7fffffff for any NaN result, x86 the NaN
// operand quieted (first operand first) or 0xffc00000 for inf - inf; the NaN's bits are
// part of the top-k key and of the values, so gf_sp_add_bits gives x86's, with g as the
// first operand (as _mm256_add_ps(g, e) in _sparse.h).

#define GF_SP_BINS 2048              // level 1 and 2 digits: 11 bits; level 3: 10 bits
#define GF_SP_TILE 1024              // elements per warp tile of gf_sp_count / gf_sp_write

__device__ __forceinline__ gf_u64 gf_sp_mix(gf_u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ~h_i of random-k (the key: the largest ~h are the smallest h)
__device__ __forceinline__ gf_u32 gf_sp_rk_key(gf_u64 seed, gf_u64 i)
{
    return ~(gf_u32)(gf_sp_mix(seed + i + 0x9e3779b97f4a7c15ull) >> 32);
}

// bits(g + e) as x86 gives them: a NaN operand quieted with its payload (g first), the
// default NaN 0xffc00000 for inf - inf; otherwise the IEEE sum (__fadd_rn)
__device__ __forceinline__ gf_u32 gf_sp_add_bits(gf_u32 g, gf_u32 e)
{
    gf_u32 u = __float_as_uint(__fadd_rn(__uint_as_float(g), __uint_as_float(e)));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        if ((g & 0x7fffffffu) > 0x7f800000u) u = g | 0x00400000u;
        else if ((e & 0x7fffffffu) > 0x7f800000u) u = e | 0x00400000u;
        else u = 0xffc00000u;
    }
    return u;
}

// The key stream: kind 0 raw words arr[j] (an array of c or g), 1 the float32 tensors of
// table rows lo..hi-1 (a per-thread cursor, j grows per thread), 2 random-k's ~h_j.
struct gf_sp_keys {
    int kind;
    gf_u32 mask;
    const gf_u32* arr;
    gf_src_table tab;
    gf_u64 seed;

    __device__ __forceinline__ void init(int kd, const gf_u32* a, const gf_i64* p, const gf_i64* o,
                                         const gf_i64* c, gf_i64 l, gf_i64 h, gf_u64 s)
    {
        kind = kd; arr = a; seed = s;
        mask = kd == 2 ? 0xffffffffu : 0x7fffffffu;
        tab.init(p, o, c, l, h);
    }

    __device__ __forceinline__ gf_u32 raw(gf_i64 j)
    {
        if (kind == 0) return arr[j];
        if (kind == 1) return __float_as_uint(tab.get(j));
        return gf_sp_rk_key(seed, (gf_u64)j);
    }
};

#define GF_SP_KEY_PARAMS int kind, const gf_u32* arr, const gf_i64* ptrs, const gf_i64* offsets, \
                         const gf_i64* counts, gf_i64 lo, gf_i64 hi, gf_u64 seed

// ---- block histograms in shared memory

__device__ __forceinline__ void gf_sp_hist_zero(gf_u32* sh, int nb)
{
    for (int i = threadIdx.x; i < nb; i += blockDim.x) sh[i] = 0;
    __syncthreads();
}

__device__ __forceinline__ void gf_sp_hist_flush(gf_u32* sh, int nb, gf_u32* hist)
{
    __syncthreads();
    for (int i = threadIdx.x; i < nb; i += blockDim.x)
        if (sh[i]) atomicAdd(hist + i, sh[i]);
}

// sh[d] += 1 for every lane with `in` (called by full warps); a warp that agrees on d
// adds once
__device__ __forceinline__ void gf_sp_hist_add(gf_u32* sh, bool in, gf_u32 d)
{
    gf_u32 d0 = __shfl_sync(GF_FULL, d, 0);
    gf_u32 all = __ballot_sync(GF_FULL, in);
    gf_u32 same = __ballot_sync(GF_FULL, in && d == d0);
    if (same == all) {
        if ((threadIdx.x & 31) == 0 && all) atomicAdd(sh + d0, (gf_u32)__popc(all));
    } else if (in) {
        atomicAdd(sh + d, 1u);
    }
}

// ---- pass 1 (top-k; random-k's c pass with mode 0)

// kind 0 (arr = x) or 1 (table) over the gradients; e_in/e_out both NULL or both n long
// (may be equal). c = g + e_in is written to e_out. mode 0: c and the count only;
// 1: also the level-1 histogram of (bits(c) & 0x7fffffff) >> 21 into hist; 2 (k == n):
// values[j] = bits(c), indices[j] = j, e_out[j] = 0. bad += the number of non-finite c.
extern "C" __global__ void gf_sp_pass1(GF_SP_KEY_PARAMS, gf_i64 n, const float* e_in, float* e_out,
                                       int mode, gf_u32* hist, gf_u64* bad, gf_u32* values,
                                       gf_u32* indices)
{
    __shared__ gf_u32 sh[GF_SP_BINS];
    gf_sp_keys keys;
    keys.init(kind, arr, ptrs, offsets, counts, lo, hi, seed);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    if (mode == 1) gf_sp_hist_zero(sh, GF_SP_BINS);
    gf_u32 nb = 0;
    for (gf_i64 base = warp * 32; base < n; base += nwarps * 32) {
        const gf_i64 j = base + lane;
        const bool in = j < n;
        gf_u32 c = 0;
        if (in) {
            c = keys.raw(j);
            if (e_in) c = gf_sp_add_bits(c, __float_as_uint(e_in[j]));
            if (e_out) ((gf_u32*)e_out)[j] = mode == 2 ? 0u : c;
            if (mode == 2) {
                values[j] = c;
                indices[j] = (gf_u32)j;
            }
        }
        const gf_u32 key = c & 0x7fffffffu;
        nb += __popc(__ballot_sync(GF_FULL, in && key >= 0x7f800000u));
        if (mode == 1) gf_sp_hist_add(sh, in, key >> 21);
    }
    if (lane == 0 && nb) atomicAdd(bad, (gf_u64)nb);
    if (mode == 1) gf_sp_hist_flush(sh, GF_SP_BINS, hist);
}

// ---- one level of the radix select

// hist[d] += 1 for d = (key >> shift) & (2^width - 1) over the keys with
// key >> (shift + width) == state[0] (all keys when shift + width == 32).
extern "C" __global__ void gf_sp_hist(GF_SP_KEY_PARAMS, gf_i64 n, int shift, int width,
                                      const gf_u64* state, gf_u32* hist)
{
    __shared__ gf_u32 sh[GF_SP_BINS];
    gf_sp_keys keys;
    keys.init(kind, arr, ptrs, offsets, counts, lo, hi, seed);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    const int top = shift + width, nbins = 1 << width;
    const gf_u32 dmask = (gf_u32)nbins - 1u;
    const gf_u32 prefix = (gf_u32)state[0];
    gf_sp_hist_zero(sh, nbins);
    for (gf_i64 base = warp * 32; base < n; base += nwarps * 32) {
        const gf_i64 j = base + lane;
        const bool in = j < n;
        const gf_u32 key = in ? keys.raw(j) & keys.mask : 0u;
        const bool m = in && (top >= 32 || (key >> top) == prefix);
        gf_sp_hist_add(sh, m, (key >> shift) & dmask);
    }
    gf_sp_hist_flush(sh, nbins, hist);
}

// One warp (launch with one block): the bin of the k-th largest key in hist[0 .. 2^width),
// given state[1] keys above the bins. Bins are summed 2^width / 32 per lane, a suffix scan
// over the lanes finds the one lane whose bins hold the crossing, and that lane walks its
// bins from the top exactly like the CPU's gf_sp_find_bin.
extern "C" __global__ void gf_sp_select(const gf_u32* hist, int width, gf_i64 k, gf_u64* state)
{
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;        // whole warps only
    const int lane = threadIdx.x;
    const int per = (1 << width) >> 5;
    gf_u64 s = 0;
    for (int q = 0; q < per; q++) s += hist[lane * per + q];
    gf_u64 S = s;                                             // bins of lanes lane..31
    for (int off = 1; off < 32; off <<= 1) {
        gf_u64 t = __shfl_down_sync(GF_FULL, S, off);
        if (lane + off < 32) S += t;
    }
    const gf_u64 prefix = state[0], cum = state[1], kk = (gf_u64)k;
    const gf_u64 above = S - s;
    const bool cross = cum + S >= kk && cum + above < kk;
    const gf_u32 any = __ballot_sync(GF_FULL, cross);
    __syncwarp();             // every lane's read of state[] before the one lane's write below
    if (cross || (any == 0 && lane == 0)) {
        gf_u64 c = cum + above;
        gf_u32 bin = 0;
        for (int q = per - 1; q >= 0; q--) {
            const int b = lane * per + q;
            if (b == 0) break;                                // bin 0: taken without a test
            if (c + hist[b] >= kk) { bin = (gf_u32)b; break; }
            c += hist[b];
        }
        state[0] = (prefix << width) | bin;
        state[1] = c;
    }
}

// ---- output: tile counts, their prefix sums, the ordered write

// tiles[2t], tiles[2t+1] <- the number of keys > T and == T (T = state[0]) in tile t
// (elements t*1024 .. t*1024+1023; one warp per tile, lane l reads t*1024 + 32i + l).
extern "C" __global__ void gf_sp_count(GF_SP_KEY_PARAMS, gf_i64 n, const gf_u64* state, gf_u32* tiles)
{
    gf_sp_keys keys;
    keys.init(kind, arr, ptrs, offsets, counts, lo, hi, seed);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    const gf_i64 ntiles = (n + GF_SP_TILE - 1) / GF_SP_TILE;
    const gf_u32 T = (gf_u32)state[0];
    for (gf_i64 t = warp; t < ntiles; t += nwarps) {
        const gf_i64 base = t * GF_SP_TILE;
        gf_u32 gt = 0, eq = 0;
        for (int i = 0; i < GF_SP_TILE / 32; i++) {
            const gf_i64 j = base + 32 * i + lane;
            if (j < n) {
                const gf_u32 key = keys.raw(j) & keys.mask;
                gt += key > T;
                eq += key == T;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            gt += __shfl_down_sync(GF_FULL, gt, off);
            eq += __shfl_down_sync(GF_FULL, eq, off);
        }
        if (lane == 0) {
            tiles[2 * t] = gt;
            tiles[2 * t + 1] = eq;
        }
    }
}

// One block: pre[2t], pre[2t+1] <- the sums of tiles[2u], tiles[2u+1] over u < t. Each
// thread sums a contiguous run of tiles, a block scan of the runs, then each thread
// writes its run's prefixes. Counts are < 2^32 (the bucket is).
extern "C" __global__ void gf_sp_scan(const gf_u32* tiles, gf_i64 ntiles, gf_u32* pre)
{
    __shared__ gf_u32 wsum[64];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const gf_i64 run = (ntiles + blockDim.x - 1) / blockDim.x;
    const gf_i64 a = tid * run, b = a + run < ntiles ? a + run : ntiles;
    gf_u32 sg = 0, se = 0;
    for (gf_i64 t = a; t < b; t++) {
        sg += tiles[2 * t];
        se += tiles[2 * t + 1];
    }
    gf_u32 ig = sg, ie = se;                                  // inclusive scan in the warp
    for (int off = 1; off < 32; off <<= 1) {
        gf_u32 tg = __shfl_sync(GF_FULL, ig, lane - off);
        gf_u32 te = __shfl_sync(GF_FULL, ie, lane - off);
        if (lane >= off) {
            ig += tg;
            ie += te;
        }
    }
    if (lane == 31) {
        wsum[2 * w] = ig;
        wsum[2 * w + 1] = ie;
    }
    __syncthreads();
    gf_u32 og = ig - sg, oe = ie - se;
    for (int v = 0; v < w; v++) {
        og += wsum[2 * v];
        oe += wsum[2 * v + 1];
    }
    for (gf_i64 t = a; t < b; t++) {
        pre[2 * t] = og;
        pre[2 * t + 1] = oe;
        og += tiles[2 * t];
        oe += tiles[2 * t + 1];
    }
}

// The ordered write. T = state[0], need = k - state[1] ties to take (the lowest indices).
// indices[slot] = j, values[slot] = raw (if values), e_out[j] = 0 (if e_out) for every
// taken j; slots ascend with j.
extern "C" __global__ void gf_sp_write(GF_SP_KEY_PARAMS, gf_i64 n, const gf_u64* state, gf_i64 k,
                                       const gf_u32* tiles, const gf_u32* pre, gf_u32* values,
                                       gf_u32* indices, float* e_out)
{
    gf_sp_keys keys;
    keys.init(kind, arr, ptrs, offsets, counts, lo, hi, seed);
    const int lane = threadIdx.x & 31;
    const gf_u32 below = (1u << lane) - 1u;                   // lanes before this one
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    const gf_i64 ntiles = (n + GF_SP_TILE - 1) / GF_SP_TILE;
    const gf_u32 T = (gf_u32)state[0];
    const gf_i64 need = k - (gf_i64)state[1];
    for (gf_i64 t = warp; t < ntiles; t += nwarps) {
        const gf_i64 eqb = pre[2 * t + 1], eqt = tiles[2 * t + 1];
        gf_i64 ties = need - eqb;                             // ties taken in this tile
        ties = ties < 0 ? 0 : (ties > eqt ? eqt : ties);
        gf_i64 slot = (gf_i64)pre[2 * t] + (eqb < need ? eqb : need);
        const gf_i64 end = slot + (gf_i64)tiles[2 * t] + ties;
        gf_i64 eqs = eqb;
        const gf_i64 base = t * GF_SP_TILE;
        for (int i = 0; i < GF_SP_TILE / 32 && slot < end; i++) {
            const gf_i64 j = base + 32 * i + lane;
            const bool in = j < n;
            const gf_u32 raw = in ? keys.raw(j) : 0u;
            const gf_u32 key = raw & keys.mask;
            const bool eq = in && key == T;
            const gf_u32 beq = __ballot_sync(GF_FULL, eq);
            const bool take = (in && key > T) || (eq && eqs + __popc(beq & below) < need);
            const gf_u32 btk = __ballot_sync(GF_FULL, take);
            const gf_i64 s = slot + __popc(btk & below);
            if (take && (gf_u64)s < (gf_u64)k) {              // always, unless the keys
                indices[s] = (gf_u32)j;                       // changed between passes
                if (values) values[s] = raw;
                if (e_out) ((gf_u32*)e_out)[j] = 0u;
            }
            slot += __popc(btk);
            eqs += __popc(beq);
        }
    }
}

// random-k: values[m] = c[indices[m]] (c in e_out, which then gets 0 there; or, without
// error feedback, g from the key stream, kind 0 or 1). Indices ascending and unique.
extern "C" __global__ void gf_sp_pick(GF_SP_KEY_PARAMS, const gf_u32* idx, gf_i64 k, float* e_out,
                                      gf_u32* values)
{
    gf_sp_keys keys;
    keys.init(kind, arr, ptrs, offsets, counts, lo, hi, seed);
    const gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 m = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; m < k; m += stride) {
        const gf_i64 j = idx[m];
        if (e_out) {
            values[m] = ((const gf_u32*)e_out)[j];
            ((gf_u32*)e_out)[j] = 0u;
        } else {
            values[m] = keys.raw(j);
        }
    }
}

extern "C" __global__ void gf_sp_iota(gf_u32* out, gf_i64 n)
{
    const gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = (gf_u32)j;
}
