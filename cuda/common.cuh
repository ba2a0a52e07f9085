// Shared prelude of every cuda/*.cu file. gradfuse.gpu.source() puts it in front of a
// kernel file before NVRTC (or nvcc, or the CPU emulator) compiles it, so each file is
// still one self-contained translation unit. NVRTC-compatible: no host headers.

typedef unsigned char gf_u8;
typedef unsigned short gf_u16;
typedef unsigned int gf_u32;
typedef long long gf_i64;
typedef unsigned long long gf_u64;

#define GF_FULL 0xffffffffu

// ------------------------------------------------------------------ sources

// One contiguous float32 array.
struct gf_src_array {
    const float* x;
    __device__ __forceinline__ float get(gf_i64 j) { return x[j]; }
};

// Rows lo..hi-1 of the plan's table, dense element offsets starting at 0 (checked by the
// caller). Each thread keeps its own cursor [rbeg, rend) and re-searches (binary search
// over the rows) only when j leaves it; j only grows per thread.
struct gf_src_table {
    const gf_i64* ptrs;
    const gf_i64* offsets;
    const gf_i64* counts;
    gf_i64 lo, hi;
    gf_i64 rbeg, rend;
    const float* base;

    __device__ __forceinline__ void init(const gf_i64* p, const gf_i64* o, const gf_i64* c,
                                         gf_i64 l, gf_i64 h)
    {
        ptrs = p; offsets = o; counts = c; lo = l; hi = h; rbeg = 0; rend = 0; base = 0;
    }

    __device__ __forceinline__ void seek(gf_i64 j)
    {
        // last row r in [lo, hi) with offsets[r] <= j: dense offsets make it the row that
        // holds j (empty rows share their offset with the next row, so they are skipped)
        gf_i64 a = lo, b = hi - 1;
        while (a < b) {
            gf_i64 m = a + ((b - a + 1) >> 1);
            if (offsets[m] <= j) a = m; else b = m - 1;
        }
        rbeg = offsets[a];
        rend = rbeg + counts[a];
        base = (const float*)ptrs[a];
    }

    __device__ __forceinline__ float get(gf_i64 j)
    {
        if (j >= rend || j < rbeg) seek(j);
        return base[j - rbeg];
    }
};
