// A tiny SIMT emulator for running gradfuse's cuda/*.cu kernels on the CPU, for tests
// on machines without a GPU (tests/cuda_emu/fakecupy.py compiles each .cu with this
// header forced in front). Not a CUDA implementation: just enough of it for these
// kernels, and strict where they could go wrong on a GPU:
//  - every warp runs as 32 fibers, so warp intrinsics (shfl, ballot) are exchanges
//    between the 32 lanes; a lane that reaches an intrinsic that the others do not reach
//    (divergence at a full-mask intrinsic, undefined on a GPU) aborts with a message;
//  - float arithmetic of the _rn intrinsics is one IEEE operation each (built with
//    -ffp-contract=off), like the GPU with --fmad=false; subnormals are kept; a NaN
//    result is the canonical 0x7fffffff, as on the GPU;
//  - a block's threads are all fibers at once: __syncthreads() is a barrier that every
//    thread of the block must reach (a thread that returned while others wait there, or
//    a warp split between a barrier and a warp intrinsic, aborts). __shared__ variables
//    are function statics: blocks run one after the other, so one copy serves them all
//    (like a GPU, they start undefined for each block: the kernels initialise them).
// Between barriers and warp intrinsics the warps of a block run one after the other.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <ucontext.h>
#include <type_traits>
#include <utility>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
extern dim3 threadIdx, blockIdx;
extern dim3 gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __shared__ static

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
// A NaN result is the GPU's canonical 0x7fffffff (x86 would keep an operand's payload),
// so a kernel that must give x86's NaN bits has to do it explicitly, as on the device.
inline float emu_gpu_nan(float r) { return r != r ? __uint_as_float(0x7fffffffu) : r; }
inline float __fadd_rn(float a, float b) { return emu_gpu_nan(a + b); }
inline float __fsub_rn(float a, float b) { return emu_gpu_nan(a - b); }
inline float __fmul_rn(float a, float b) { return emu_gpu_nan(a * b); }
inline float __fdiv_rn(float a, float b) { return emu_gpu_nan(a / b); }
inline float __fsqrt_rn(float a) { return emu_gpu_nan(__builtin_sqrtf(a)); }
// double arithmetic: one IEEE operation each (the GPU's double ops round to nearest too)
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return __builtin_sqrt(a); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned atomicAdd(unsigned* p, unsigned v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v)
{
    unsigned long long old = *p;
    if (v < old) *p = v;        // warps run one at a time: no concurrent writer
    return old;
}

// Lanes are fibers (ucontext) of one OS thread, every thread of the block at once: a
// lane runs until it reaches a warp intrinsic, __syncthreads() or returns; when all 32
// lanes of a warp wait at the same intrinsic, the exchange is computed and they resume;
// when every thread of the block waits at __syncthreads(), they all resume. Lanes that
// wait at a warp intrinsic while others of the warp returned or wait elsewhere are
// divergence at a full-mask intrinsic; a barrier that some threads cannot reach is a
// deadlock: both abort with a message. emu_cur is the thread index in the block.
enum { EMU_SHFL_DOWN = 1, EMU_SHFL = 2, EMU_BALLOT = 3, EMU_SYNC = 4, EMU_SYNCWARP = 5 };
struct EmuLane {
    int state;            // 0 runnable, 1 waiting at an intrinsic, 2 returned
    int op, arg;
    uint64_t val, res;
};
extern EmuLane emu_lanes[];             // one per thread of the block
extern int emu_cur;
void emu_wait(int op, int arg, uint64_t val);

template <class T> inline uint64_t emu_bits(T v) { uint64_t b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <class T> inline T emu_from(uint64_t b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }

inline void emu_full(unsigned mask)
{
    if (mask != 0xffffffffu) { std::fprintf(stderr, "simt emulator: partial masks unsupported\n"); std::abort(); }
}

template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned off)
{
    emu_full(mask);
    emu_wait(EMU_SHFL_DOWN, (int)off, emu_bits(v));
    return emu_from<T>(emu_lanes[emu_cur].res);
}

template <class T> inline T __shfl_sync(unsigned mask, T v, int src)
{
    emu_full(mask);
    emu_wait(EMU_SHFL, src, emu_bits(v));
    return emu_from<T>(emu_lanes[emu_cur].res);
}

inline void __syncthreads()
{
    emu_wait(EMU_SYNC, 0, 0);
}

// a warp barrier (and memory fence among its lanes): all 32 lanes must meet here
inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    emu_full(mask);
    emu_wait(EMU_SYNCWARP, 0, 0);
}

inline unsigned __ballot_sync(unsigned mask, int pred)
{
    emu_full(mask);
    emu_wait(EMU_BALLOT, 0, pred ? 1u : 0u);
    return (unsigned)emu_lanes[emu_cur].res;
}

// ---- launching: each kernel parameter is read from args[i], as cuLaunchKernel does
template <class... A, std::size_t... I>
void emu_call_impl(void (*f)(A...), void** a, std::index_sequence<I...>)
{
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(a[I])...);
}
template <class... A> void emu_call(void (*f)(A...), void** a)
{
    emu_call_impl(f, a, std::index_sequence_for<A...>{});
}

// A kernel's parameter list as cupy must pass it: per parameter a kind (p pointer,
// f float, i signed, u unsigned) and its size in bytes, e.g. "p8i4f4" for (T*, int, float).
// cupy sends a Python int as 8 bytes and a float as a double, so a width mismatch reads
// garbage on a GPU; fakecupy.RawKernel checks every launch against this.
template <class T> constexpr char emu_kind()
{
    using U = std::remove_cv_t<std::remove_reference_t<T>>;
    return std::is_pointer<U>::value ? 'p' : std::is_floating_point<U>::value ? 'f'
         : std::is_signed<U>::value ? 'i' : 'u';
}
template <class... A> const char* emu_sig(void (*)(A...))
{
    static const std::string s = [] {
        std::string r;
        ((r += emu_kind<A>(), r += char('0' + sizeof(std::remove_reference_t<A>))), ...);
        return r;
    }();
    return s.c_str();
}

typedef void (*emu_entry)(void**);
struct EmuKernel { const char* name; emu_entry fn; const char* sig; };
