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
// gf_sp_randomk_draw and gf_sp_gather_table (gradfuse/_sparse.h). Same results, bit for
// bit. Every tensor (row) of the table selects its own k; indices are bucket positions,
// tensor after tensor.
//
// top-k: "the k largest keys of each tensor, ties to the lower index, indices ascending",
// raw = bits(c), key = raw & 0x7fffffff (c = g + e_in, or g). A radix select on the 32-bit
// keys with the CPU's large-tensor digits (bits 31..21, 20..10, 9..0; any digits give the
// same T and so the same selection), every level a pass over the keys (no n-sized
// scratch; with error feedback c lives in e_out), all the tensors of a launch at once:
// segment s (a tensor that needs a selection, 0 < k < n) is described by the host's
// segment table seg[GF_SP_SEG * s ..] = {first bucket position j0, n, k, first output
// slot, first tile}; kernels put the segments on blockIdx.y (strided by gridDim.y), and
// each segment has its own histograms (hist + GF_SP_HSEG * s), state (2 words) and tiles.
//   gf_sp_pass1   c = g + e_in into e_out and the non-finite count, over the whole bucket
//   gf_sp_hist    per segment: histogram of one digit over the keys whose higher digits
//                 equal the segment's prefix found so far (level 1: all its keys)
//   gf_sp_select  one warp per segment: the bin holding the k-th largest key (the CPU's
//                 find_bin: from the top bin down, the first with cum + h >= k; bin 0
//                 otherwise); state[0] = prefix << width | bin, state[1] = count above it
//   -> after three levels state[0] = T, state[1] = count(key > T) < k <= count(key >= T)
//   gf_sp_count   per tile of 1024 elements of a segment (one warp: 32 x 32, coalesced):
//                 the number of keys > T and == T
//   gf_sp_scan    one block per segment: exclusive prefix sums of both tile counts
//   gf_sp_write   per tile: element j is taken if key > T, or key == T and fewer than
//                 need = k - count(key > T) ties come before it (ballot + popc ranks);
//                 its slot is the segment's first slot plus the tile's prefix of taken
//                 elements plus its rank in the tile, so the indices come out ascending;
//                 values = raw c; e_out[j] = 0
//   gf_sp_take    tensors with k == n: every element, in order
// random-k: gf_sp_rk_draw (k positions per tensor, stratified, O(k): the CPU's
// gf_sp_randomk_draw), then gf_sp_pass1 and gf_sp_pick (values[m] = c[indices[m]]).
//
// Histograms are per block in shared memory (2048 u32), flushed with one global atomic
// per non-zero bin; a warp whose lanes all fall in one bin (ties, e.g. a zero tensor)
// adds once. Every warp intrinsic is reached by full warps: the grid-stride loops run in
// whole warps and lanes past n take part with an "out" flag.
//
// NaN through c = g + e: the GPU returns 0x7fffffff for any NaN result, x86 the NaN
// operand quieted (first operand first) or 0xffc00000 for inf - inf; the NaN's bits are
// part of the top-k key and of the values, so gf_sp_add_bits gives x86's, with g as the
// first operand (as _mm256_add_ps(g, e) in _sparse.h).

#define GF_SP_BINS 2048              // level 1 and 2 digits: 11 bits; level 3: 10 bits
#define GF_SP_HSEG 5120              // histogram words per segment: 2048 + 2048 + 1024
#define GF_SP_TILE 1024              // elements per warp tile of gf_sp_count / gf_sp_write
#define GF_SP_SEG 5                  // int64 words per segment: j0, n, k, slot0, tile0
#define GF_SP_GOLDEN 0x9e3779b97f4a7c15ull

__device__ __forceinline__ gf_u64 gf_sp_mix(gf_u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
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

// The key stream, by bucket position j: kind 0 raw words arr[j] (an array of c or g), 1 the
// float32 tensors of table rows lo..hi-1 (a per-thread cursor, j grows per thread).
struct gf_sp_keys {
    int kind;
    const gf_u32* arr;
    gf_src_table tab;

    __device__ __forceinline__ void init(int kd, const gf_u32* a, const gf_i64* p, const gf_i64* o,
                                         const gf_i64* c, gf_i64 l, gf_i64 h)
    {
        kind = kd; arr = a;
        tab.init(p, o, c, l, h);
    }

    __device__ __forceinline__ gf_u32 raw(gf_i64 j)
    {
        if (kind == 0) return arr[j];
        return __float_as_uint(tab.get(j));
    }
};

#define GF_SP_KEY_PARAMS int kind, const gf_u32* arr, const gf_i64* ptrs, const gf_i64* offsets, \
                         const gf_i64* counts, gf_i64 lo, gf_i64 hi
#define GF_SP_KEY_ARGS kind, arr, ptrs, offsets, counts, lo, hi
#define GF_SP_MASK 0x7fffffffu

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

// ---- pass 1: c and the non-finite count, over the whole bucket

// kind 0 (arr = x) or 1 (table) over the gradients; e_in/e_out both NULL or both n long
// (may be equal). c = g + e_in is written to e_out. bad += the number of non-finite c.
extern "C" __global__ void gf_sp_pass1(GF_SP_KEY_PARAMS, gf_i64 n, const float* e_in, float* e_out,
                                       gf_u64* bad)
{
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    gf_u32 nb = 0;
    for (gf_i64 base = warp * 32; base < n; base += nwarps * 32) {
        const gf_i64 j = base + lane;
        const bool in = j < n;
        gf_u32 c = 0;
        if (in) {
            c = keys.raw(j);
            if (e_in) c = gf_sp_add_bits(c, __float_as_uint(e_in[j]));
            if (e_out) ((gf_u32*)e_out)[j] = c;
        }
        nb += __popc(__ballot_sync(GF_FULL, in && (c & 0x7fffffffu) >= 0x7f800000u));
    }
    if (lane == 0 && nb) atomicAdd(bad, (gf_u64)nb);
}

// ---- one level of the radix select, every segment

// per segment s: hist[s][d] += 1 for d = (key >> shift) & (2^width - 1) over its keys with
// key >> (shift + width) == state[2s] (all its keys when shift + width == 32).
// hist: the level's histograms (segment s at hist + GF_SP_HSEG * s).
extern "C" __global__ void gf_sp_hist(GF_SP_KEY_PARAMS, const gf_i64* seg, gf_i64 nseg, int shift, int width,
                                      const gf_u64* state, gf_u32* hist)
{
    __shared__ gf_u32 sh[GF_SP_BINS];
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    const int top = shift + width, nbins = 1 << width;
    const gf_u32 dmask = (gf_u32)nbins - 1u;
    for (gf_i64 s = blockIdx.y; s < nseg; s += gridDim.y) {
        const gf_i64 j0 = seg[GF_SP_SEG * s], n = seg[GF_SP_SEG * s + 1];
        const gf_u32 prefix = (gf_u32)state[2 * s];
        gf_sp_hist_zero(sh, nbins);
        for (gf_i64 base = warp * 32; base < n; base += nwarps * 32) {
            const gf_i64 i = base + lane;
            const bool in = i < n;
            const gf_u32 key = in ? keys.raw(j0 + i) & GF_SP_MASK : 0u;
            const bool m = in && (top >= 32 || (key >> top) == prefix);
            gf_sp_hist_add(sh, m, (key >> shift) & dmask);
        }
        gf_sp_hist_flush(sh, nbins, hist + GF_SP_HSEG * s);
        __syncthreads();                                      // sh is zeroed again next
    }
}

// One warp per segment (blocks strided over the segments): the bin of the k-th largest
// key in the segment's hist[0 .. 2^width), given state[2s+1] keys above the bins. Bins are
// summed 2^width / 32 per lane, a suffix scan over the lanes finds the one lane whose bins
// hold the crossing, and that lane walks its bins from the top exactly like the CPU's
// gf_sp_find_bin.
extern "C" __global__ void gf_sp_select(const gf_u32* hist, int width, const gf_i64* seg, gf_i64 nseg,
                                        gf_u64* state)
{
    if (threadIdx.x >= 32) return;                            // whole warps only
    const int lane = threadIdx.x;
    const int per = (1 << width) >> 5;
    for (gf_i64 sg = blockIdx.x; sg < nseg; sg += gridDim.x) {
        const gf_u32* h = hist + GF_SP_HSEG * sg;
        gf_u64* st = state + 2 * sg;
        gf_u64 s = 0;
        for (int q = 0; q < per; q++) s += h[lane * per + q];
        gf_u64 S = s;                                         // bins of lanes lane..31
        for (int off = 1; off < 32; off <<= 1) {
            gf_u64 t = __shfl_down_sync(GF_FULL, S, off);
            if (lane + off < 32) S += t;
        }
        const gf_u64 prefix = st[0], cum = st[1], kk = (gf_u64)seg[GF_SP_SEG * sg + 2];
        const gf_u64 above = S - s;
        const bool cross = cum + S >= kk && cum + above < kk;
        const gf_u32 any = __ballot_sync(GF_FULL, cross);
        __syncwarp();         // every lane's read of st[] before the one lane's write below
        if (cross || (any == 0 && lane == 0)) {
            gf_u64 c = cum + above;
            gf_u32 bin = 0;
            for (int q = per - 1; q >= 0; q--) {
                const int b = lane * per + q;
                if (b == 0) break;                            // bin 0: taken without a test
                if (c + h[b] >= kk) { bin = (gf_u32)b; break; }
                c += h[b];
            }
            st[0] = (prefix << width) | bin;
            st[1] = c;
        }
        __syncwarp();
    }
}

// ---- output: tile counts, their prefix sums, the ordered write

// tiles[2t], tiles[2t+1] <- the number of keys > T and == T (T = state[2s]) in tile t of
// segment s (its elements t*1024 .. t*1024+1023; one warp per tile, lane l reads
// t*1024 + 32i + l); the segment's tiles start at tile seg[5s+4].
extern "C" __global__ void gf_sp_count(GF_SP_KEY_PARAMS, const gf_i64* seg, gf_i64 nseg, const gf_u64* state,
                                       gf_u32* tiles)
{
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
    const int lane = threadIdx.x & 31;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    for (gf_i64 s = blockIdx.y; s < nseg; s += gridDim.y) {
        const gf_i64 j0 = seg[GF_SP_SEG * s], n = seg[GF_SP_SEG * s + 1], t0 = seg[GF_SP_SEG * s + 4];
        const gf_i64 ntiles = (n + GF_SP_TILE - 1) / GF_SP_TILE;
        const gf_u32 T = (gf_u32)state[2 * s];
        for (gf_i64 t = warp; t < ntiles; t += nwarps) {
            const gf_i64 base = t * GF_SP_TILE;
            gf_u32 gt = 0, eq = 0;
            for (int i = 0; i < GF_SP_TILE / 32; i++) {
                const gf_i64 q = base + 32 * i + lane;
                if (q < n) {
                    const gf_u32 key = keys.raw(j0 + q) & GF_SP_MASK;
                    gt += key > T;
                    eq += key == T;
                }
            }
            for (int off = 16; off > 0; off >>= 1) {
                gt += __shfl_down_sync(GF_FULL, gt, off);
                eq += __shfl_down_sync(GF_FULL, eq, off);
            }
            if (lane == 0) {
                tiles[2 * (t0 + t)] = gt;
                tiles[2 * (t0 + t) + 1] = eq;
            }
        }
    }
}

// One block per segment (strided): pre[2t], pre[2t+1] <- the sums of tiles[2u], tiles[2u+1]
// over the segment's tiles u < t. Each thread sums a contiguous run of tiles, a block scan
// of the runs, then each thread writes its run's prefixes. Counts are < 2^32.
extern "C" __global__ void gf_sp_scan(const gf_u32* tiles, const gf_i64* seg, gf_i64 nseg, gf_u32* pre)
{
    __shared__ gf_u32 wsum[64];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (gf_i64 sg = blockIdx.x; sg < nseg; sg += gridDim.x) {
        const gf_i64 t0 = seg[GF_SP_SEG * sg + 4];
        const gf_i64 ntiles = (seg[GF_SP_SEG * sg + 1] + GF_SP_TILE - 1) / GF_SP_TILE;
        const gf_u32* tl = tiles + 2 * t0;
        gf_u32* pr = pre + 2 * t0;
        const gf_i64 run = (ntiles + blockDim.x - 1) / blockDim.x;
        const gf_i64 a = tid * run, b = a + run < ntiles ? a + run : ntiles;
        gf_u32 sg_ = 0, se = 0;
        for (gf_i64 t = a; t < b; t++) {
            sg_ += tl[2 * t];
            se += tl[2 * t + 1];
        }
        gf_u32 ig = sg_, ie = se;                             // inclusive scan in the warp
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
        gf_u32 og = ig - sg_, oe = ie - se;
        for (int v = 0; v < w; v++) {
            og += wsum[2 * v];
            oe += wsum[2 * v + 1];
        }
        for (gf_i64 t = a; t < b; t++) {
            pr[2 * t] = og;
            pr[2 * t + 1] = oe;
            og += tl[2 * t];
            oe += tl[2 * t + 1];
        }
        __syncthreads();                                      // wsum is written again next
    }
}

// The ordered write, per segment. T = state[2s], need = k - state[2s+1] ties to take (the
// lowest indices). indices[slot] = j, values[slot] = raw (if values), e_out[j] = 0 (if
// e_out) for every taken j (a bucket position); slots ascend with j from seg[5s+3].
extern "C" __global__ void gf_sp_write(GF_SP_KEY_PARAMS, const gf_i64* seg, gf_i64 nseg, const gf_u64* state,
                                       const gf_u32* tiles, const gf_u32* pre, gf_u32* values,
                                       gf_u32* indices, float* e_out)
{
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
    const int lane = threadIdx.x & 31;
    const gf_u32 below = (1u << lane) - 1u;                   // lanes before this one
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    for (gf_i64 sg = blockIdx.y; sg < nseg; sg += gridDim.y) {
        const gf_i64* d = seg + GF_SP_SEG * sg;
        const gf_i64 j0 = d[0], n = d[1], k = d[2], slot0 = d[3], t0 = d[4];
        const gf_i64 ntiles = (n + GF_SP_TILE - 1) / GF_SP_TILE;
        const gf_u32 T = (gf_u32)state[2 * sg];
        const gf_i64 need = k - (gf_i64)state[2 * sg + 1];
        for (gf_i64 t = warp; t < ntiles; t += nwarps) {
            const gf_i64 eqb = pre[2 * (t0 + t) + 1], eqt = tiles[2 * (t0 + t) + 1];
            gf_i64 ties = need - eqb;                         // ties taken in this tile
            ties = ties < 0 ? 0 : (ties > eqt ? eqt : ties);
            gf_i64 slot = (gf_i64)pre[2 * (t0 + t)] + (eqb < need ? eqb : need);
            const gf_i64 end = slot + (gf_i64)tiles[2 * (t0 + t)] + ties;
            gf_i64 eqs = eqb;
            const gf_i64 base = t * GF_SP_TILE;
            for (int i = 0; i < GF_SP_TILE / 32 && slot < end; i++) {
                const gf_i64 q = base + 32 * i + lane;
                const bool in = q < n;
                const gf_u32 raw = in ? keys.raw(j0 + q) : 0u;
                const gf_u32 key = raw & GF_SP_MASK;
                const bool eq = in && key == T;
                const gf_u32 beq = __ballot_sync(GF_FULL, eq);
                const bool take = (in && key > T) || (eq && eqs + __popc(beq & below) < need);
                const gf_u32 btk = __ballot_sync(GF_FULL, take);
                const gf_i64 s = slot + __popc(btk & below);
                if (take && (gf_u64)s < (gf_u64)k) {          // always, unless the keys
                    indices[slot0 + s] = (gf_u32)(j0 + q);    // changed between passes
                    if (values) values[slot0 + s] = raw;
                    if (e_out) ((gf_u32*)e_out)[j0 + q] = 0u;
                }
                slot += __popc(btk);
                eqs += __popc(beq);
            }
        }
    }
}

// Tensors with k == n (segments on blockIdx.y): every element, in order.
extern "C" __global__ void gf_sp_take(GF_SP_KEY_PARAMS, const gf_i64* seg, gf_i64 nseg, gf_u32* values,
                                      gf_u32* indices, float* e_out)
{
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
    const gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 sg = blockIdx.y; sg < nseg; sg += gridDim.y) {
        const gf_i64 j0 = seg[GF_SP_SEG * sg], n = seg[GF_SP_SEG * sg + 1], slot0 = seg[GF_SP_SEG * sg + 3];
        for (gf_i64 q = tid; q < n; q += stride) {
            indices[slot0 + q] = (gf_u32)(j0 + q);
            if (values) values[slot0 + q] = keys.raw(j0 + q);
            if (e_out) ((gf_u32*)e_out)[j0 + q] = 0u;
        }
    }
}

// random-k: the draw of the tensors in rk (4 int64 per tensor t: first bucket position j0,
// n, k, first output slot; tensors on blockIdx.y; the host leaves the empty tensors out).
// Tensor t draws from s_t = splitmix64_mix(seed + (t + 1) * golden) (t: its index in rk,
// so the index among the bucket's non-empty tensors); stratum m of its n
// elements is [a, b) = [floor(m n / k), floor((m + 1) n / k)), its position
// a + ((h * (b - a)) >> 32), h = splitmix64_mix(s_t + (m + 1) * golden) >> 32.
extern "C" __global__ void gf_sp_rk_draw(gf_u64 seed, const gf_i64* rk, gf_i64 ntensors, gf_u32* out)
{
    const gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 t = blockIdx.y; t < ntensors; t += gridDim.y) {
        const gf_u64 j0 = (gf_u64)rk[4 * t], n = (gf_u64)rk[4 * t + 1], k = (gf_u64)rk[4 * t + 2];
        const gf_i64 slot0 = rk[4 * t + 3];
        const gf_u64 st = gf_sp_mix(seed + ((gf_u64)t + 1) * GF_SP_GOLDEN);
        for (gf_u64 m = (gf_u64)tid; m < k; m += (gf_u64)stride) {
            const gf_u64 a = m * n / k, b = (m + 1) * n / k;
            const gf_u64 h = gf_sp_mix(st + (m + 1) * GF_SP_GOLDEN) >> 32;
            out[slot0 + (gf_i64)m] = (gf_u32)(j0 + a + ((h * (b - a)) >> 32));
        }
    }
}

// random-k: values[m] = c[indices[m]] (c in e_out, which then gets 0 there; or, without
// error feedback, g from the key stream, kind 0 or 1). Indices ascending and unique.
extern "C" __global__ void gf_sp_pick(GF_SP_KEY_PARAMS, const gf_u32* idx, gf_i64 k, float* e_out,
                                      gf_u32* values)
{
    gf_sp_keys keys;
    keys.init(GF_SP_KEY_ARGS);
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
