/*
 * Run-time CPU feature selection for the gradfuse kernels.
 *
 * Kernels are compiled for the baseline x86-64 (no -march flags); SIMD variants are
 * compiled per function with __attribute__((target("avx2,f16c"))) and chosen at run
 * time here. GRADFUSE_FORCE_SCALAR=1 (read in Python, passed to gf_simd_init) forces
 * the portable path, so the tests cover both paths on any CPU. Every SIMD kernel must
 * give the same bits as its scalar twin: canonical reduction orders, no FMA
 * contraction (-ffp-contract=off; explicit where used).
 */
#ifndef GRADFUSE_SIMD_H
#define GRADFUSE_SIMD_H

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define GF_X86 1
#else
#define GF_X86 0
#endif

static int gf_cpu_avx2 = 0;     /* AVX2 + F16C present */
static int gf_use_avx2 = 0;     /* ... and not forced off */

static void gf_simd_init(int force_scalar)
{
#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    gf_cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    gf_cpu_avx2 = 0;
#endif
    gf_use_avx2 = gf_cpu_avx2 && !force_scalar;
}

#endif
