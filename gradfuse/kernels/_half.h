/*
 * Portable IEEE half <-> float conversions used by the gradfuse kernels.
 *
 * float -> half rounds to nearest, ties to even, and matches numpy's
 * npy_floatbits_to_halfbits bit for bit: overflow gives a signed inf, NaN keeps
 * its sign and the top 10 bits of its payload (forced non-zero so it stays a NaN).
 * half -> float is exact.
 *
 * No FMA, no fast-math: these are integer bit manipulations only.
 */
#ifndef GRADFUSE_HALF_H
#define GRADFUSE_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t gf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float gf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t gf_float_to_half(float value)
{
    uint32_t f = gf_f32_bits(value);
    uint32_t f_exp, f_sig;
    uint16_t h_sgn, h_sig;

    h_sgn = (uint16_t)((f & 0x80000000u) >> 16);
    f_exp = (f & 0x7f800000u);

    if (f_exp >= 0x47800000u) {              /* overflow, inf or NaN */
        if (f_exp == 0x7f800000u) {
            f_sig = (f & 0x007fffffu);
            if (f_sig != 0) {
                uint16_t ret = (uint16_t)(0x7c00u + (f_sig >> 13));
                if (ret == 0x7c00u) ret++;   /* keep it a NaN */
                return (uint16_t)(h_sgn + ret);
            }
            return (uint16_t)(h_sgn + 0x7c00u);
        }
        return (uint16_t)(h_sgn + 0x7c00u);  /* overflow to signed inf */
    }
    if (f_exp <= 0x38000000u) {              /* subnormal half or signed zero */
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = (0x00800000u + (f & 0x007fffffu));
        f_sig >>= (113 - f_exp);
        /* round to nearest even; the shift may have dropped up to 11 bits,
         * which the second test looks for in the original significand */
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) {
            f_sig += 0x00001000u;
        }
        h_sig = (uint16_t)(f_sig >> 13);
        return (uint16_t)(h_sgn + h_sig);
    }
    {
        uint16_t h_exp = (uint16_t)((f_exp - 0x38000000u) >> 13);
        f_sig = (f & 0x007fffffu);
        if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
        h_sig = (uint16_t)(f_sig >> 13);
        /* a carry out of the significand bumps the exponent, up to inf */
        h_sig = (uint16_t)(h_sig + h_exp);
        return (uint16_t)(h_sgn + h_sig);
    }
}

static inline float gf_half_to_float(uint16_t h)
{
    uint32_t sign = ((uint32_t)(h & 0x8000u)) << 16;
    uint32_t h_exp = (h & 0x7c00u);
    uint32_t h_sig = (h & 0x03ffu);
    if (h_exp == 0) {
        if (h_sig == 0) return gf_bits_f32(sign);          /* signed zero */
        /* subnormal: normalise */
        h_sig <<= 1;
        while ((h_sig & 0x0400u) == 0) { h_sig <<= 1; h_exp++; }
        {
            uint32_t f_exp = ((uint32_t)(127 - 15 - h_exp)) << 23;
            uint32_t f_sig = ((uint32_t)(h_sig & 0x03ffu)) << 13;
            return gf_bits_f32(sign + f_exp + f_sig);
        }
    }
    if (h_exp == 0x7c00u) {                                 /* inf or NaN */
        return gf_bits_f32(sign + 0x7f800000u + (h_sig << 13));
    }
    return gf_bits_f32(sign + (((h & 0x7fffu) + 0x1c000u) << 13));
}

#endif
