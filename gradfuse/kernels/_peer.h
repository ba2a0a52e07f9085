/*
 * Intra-host sums over the peers' own memory, for the ranks of one host.
 *
 * Linux's cross-memory attach (process_vm_readv) lets a process copy from another
 * process's address space in one kernel copy, with no shared buffer and no bounce copy
 * through one. The ranks of one host use it to allreduce the tensors where they lie:
 *
 *   A *table* is the rows of one dtype: nseg tensors, row i a contiguous run of
 *   counts[i] elements at address tab[r * stride + i] in rank r's process (every rank
 *   publishes its own addresses; the counts are the same on every rank, the ranks agreed
 *   on them). In row order the rows form one vector of N elements, cut into stripes by
 *   bounds[0..nchunks] (bounds[0] = 0, bounds[nchunks] = N, nchunks a multiple of p);
 *   stripe c is rank c % p's, so every rank owns stripes from the whole vector (a
 *   gradient list's small tensors come first, its large ones last, and they do not cost
 *   the same per byte: contiguous halves left one rank waiting at the fence).
 *
 *   Phase 1, gf_peer_reduce, once per stripe [lo, hi) of rank `me`: it reads the stripe
 *   of every other rank's *source*
 *   rows, a piece at a time (process_vm_readv into its scratch, one slot of `piece`
 *   bytes per rank), sums x_0 + x_1 + ... + x_{p-1} in rank order, each add in the
 *   dtype's arithmetic (float16, and bf16 words (code 6): gf_sum16's rule, a float32 add
 *   rounded once per add),
 *   divides the sum when asked (float16: in float32, rounded once; the same operations
 *   as _core.unpack_div), and writes chunk `me` of its own *destination* rows.
 *   Phase 2, gf_peer_gather (once every rank finished phase 1): for each stripe of
 *   another owner, rank `me` copies the owner's destination rows into its own, straight
 *   from the owner's memory.
 *
 * Every element is summed once, by its owner, and copied to the others, so every rank
 * ends with the same bits; with p = 2 they are MPI_Allreduce's (a + b == b + a). The
 * memory traffic per rank is 1.5 reads and 1 write of the vector (the least an allreduce
 * over private buffers can move), against MPI's shared-memory path, which copies every
 * byte through its cells.
 *
 * In place (source row == destination row) is allowed: phase 1 reads and writes only
 * the stripes of `me` in this rank's rows, and the same stripes of the peers' source rows,
 * which the peers do not write in phase 1. The caller keeps every row alive and unwritten from
 * the moment its addresses are published until every rank finished phase 2.
 *
 * Both phases return 0, or an errno (EFAULT for a short copy) with *who set to the rank
 * whose memory could not be read.
 */
#ifndef GRADFUSE_PEER_H
#define GRADFUSE_PEER_H

#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/types.h>
#include "_half.h"
#include "_cast.h"
#include "_simd.h"
#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define GF_PEER_NT 1
#else
#define GF_PEER_NT 0
#endif

#if defined(__linux__)
#include <sys/uio.h>
#define GF_PEER_OK 1
#else
#define GF_PEER_OK 0
struct iovec { void *iov_base; size_t iov_len; };
#endif

#define GF_PEER_IOV 1024                     /* IOV_MAX on Linux */
#define GF_PEER_CALL_MAX ((int64_t)1 << 30)  /* bytes per process_vm_readv call (the kernel caps one at ~2 GB) */

/* dtype codes, as in _core.pyx */
#define GF_PEER_F16 1
#define GF_PEER_F32 2
#define GF_PEER_F64 3
#define GF_PEER_I32 4
#define GF_PEER_I64 5
#define GF_PEER_BF16 6      /* bf16 words (the bf16 compressor's payload): gf_sum16's bf16 rule */

static inline int64_t gf_peer_itemsize(int code)
{
    return (code == GF_PEER_F16 || code == GF_PEER_BF16) ? 2 : (code == GF_PEER_F32 || code == GF_PEER_I32) ? 4 : 8;
}

/* Copy n matched (local, remote) iovec pairs from process pid (write: to it), resuming
 * after a partial copy (the kernel stops at the first page it cannot reach). 0 or an errno. */
static int gf_peer_copyv(int64_t pid, struct iovec *l, struct iovec *r, int n, int write)
{
#if GF_PEER_OK
    int i = 0;
    while (i < n) {
        int64_t want = 0;
        int k;
        for (k = i; k < n; k++) want += (int64_t) l[k].iov_len;
        ssize_t got = write
            ? process_vm_writev((pid_t) pid, l + i, (unsigned long) (n - i), r + i, (unsigned long) (n - i), 0)
            : process_vm_readv((pid_t) pid, l + i, (unsigned long) (n - i), r + i, (unsigned long) (n - i), 0);
        if (got < 0) return errno ? errno : EFAULT;
        if (got == want) return 0;
        if (got == 0) return EFAULT;
        /* skip what was copied and resume inside the pair that was cut */
        while (got > 0) {
            if ((int64_t) l[i].iov_len <= got) { got -= (ssize_t) l[i].iov_len; i++; continue; }
            l[i].iov_base = (char *) l[i].iov_base + got;
            r[i].iov_base = (char *) r[i].iov_base + got;
            l[i].iov_len -= (size_t) got;
            r[i].iov_len -= (size_t) got;
            got = 0;
        }
    }
    return 0;
#else
    (void) pid; (void) l; (void) r; (void) n; (void) write;
    return ENOSYS;
#endif
}

static int gf_peer_readv(int64_t pid, struct iovec *l, struct iovec *r, int n)
{
    return gf_peer_copyv(pid, l, r, n, 0);
}

/* One copy of n bytes between addr in process pid and buf here (write: buf to addr; the
 * probe). 0 or an errno. */
static int gf_peer_copy(int64_t pid, int64_t addr, uint8_t *buf, int64_t n, int write)
{
    struct iovec l, r;
    l.iov_base = buf;
    l.iov_len = (size_t) n;
    r.iov_base = (void *) (uintptr_t) addr;
    r.iov_len = (size_t) n;
    return gf_peer_copyv(pid, &l, &r, 1, write);
}

/* A position in a table: row s starts at element base of the vector. */
typedef struct { int64_t s, base; } gf_peer_cur;

static void gf_peer_seek(gf_peer_cur *c, const int64_t *counts, int64_t nseg, int64_t pos)
{
    c->s = 0;
    c->base = 0;
    while (c->s < nseg && c->base + counts[c->s] <= pos) {
        c->base += counts[c->s];
        c->s++;
    }
}

/* out[i] = a[i] + b[i] (out may be a or b itself) in the dtype of `code`, n elements; a
 * is the earlier ranks' (the running sum), and where both are NaN a's wins, as in x86's
 * float adds (its first operand's payload) and gf_sum16's rule (its `in` operand's) */
static void gf_peer_add(int code, void *out, const void *a, const void *b, int64_t n)
{
    int64_t i;
    if (code == GF_PEER_F32) {
        float *o = (float *) out;
        const float *x = (const float *) a, *y = (const float *) b;
        if (o == x) { for (i = 0; i < n; i++) o[i] = o[i] + y[i]; }
        else if (o == y) { for (i = 0; i < n; i++) o[i] = x[i] + o[i]; }
        else {
            float *__restrict o2 = o;
            const float *__restrict x2 = x, *__restrict y2 = y;
            for (i = 0; i < n; i++) o2[i] = x2[i] + y2[i];
        }
    } else if (code == GF_PEER_F64) {
        double *o = (double *) out;
        const double *x = (const double *) a, *y = (const double *) b;
        if (o == x) { for (i = 0; i < n; i++) o[i] = o[i] + y[i]; }
        else if (o == y) { for (i = 0; i < n; i++) o[i] = x[i] + o[i]; }
        else {
            double *__restrict o2 = o;
            const double *__restrict x2 = x, *__restrict y2 = y;
            for (i = 0; i < n; i++) o2[i] = x2[i] + y2[i];
        }
    } else if (code == GF_PEER_I32) {           /* wrapping, as two's complement sums do */
        uint32_t *o = (uint32_t *) out;
        const uint32_t *x = (const uint32_t *) a, *y = (const uint32_t *) b;
        for (i = 0; i < n; i++) o[i] = x[i] + y[i];
    } else if (code == GF_PEER_I64) {
        uint64_t *o = (uint64_t *) out;
        const uint64_t *x = (const uint64_t *) a, *y = (const uint64_t *) b;
        for (i = 0; i < n; i++) o[i] = x[i] + y[i];
    } else {            /* float16, bf16: gf_sum16(fmt, in = a, inout = b), so a NaN of a wins */
        uint16_t *o = (uint16_t *) out;
        int fmt = code == GF_PEER_BF16 ? GF_FMT_BF16 : GF_FMT_F16;
        if (o == (const uint16_t *) b) {
            gf_sum16(fmt, (const uint16_t *) a, o, n);
        } else if (o == (const uint16_t *) a) {       /* the running sum: b through a small buffer */
            uint16_t tmp[512];
            for (i = 0; i < n; i += 512) {
                int64_t m = n - i < 512 ? n - i : 512;
                memcpy(tmp, (const uint16_t *) b + i, (size_t) m * 2);
                gf_sum16(fmt, o + i, tmp, m);
                memcpy(o + i, tmp, (size_t) m * 2);
            }
        } else {
            memcpy(o, b, (size_t) n * 2);
            gf_sum16(fmt, (const uint16_t *) a, o, n);
        }
    }
}

/* out[i] = out[i] / divisor, as _core's division kernel does it */
static void gf_peer_div(int code, void *out, int64_t n, double divisor)
{
    int64_t i;
    float fd = (float) divisor;
    if (code == GF_PEER_F32) {
        float *o = (float *) out;
        for (i = 0; i < n; i++) o[i] = o[i] / fd;
    } else if (code == GF_PEER_F64) {
        double *o = (double *) out;
        for (i = 0; i < n; i++) o[i] = o[i] / divisor;
    } else if (code == GF_PEER_F16) {
        uint16_t *o = (uint16_t *) out;
        for (i = 0; i < n; i++) o[i] = gf_float_to_half(gf_half_to_float(o[i]) / fd);
    }
}

/* Two ranks, out of place, float32/float64: out[i] = (a[i] + b[i]) [/ d] in one pass with
 * non-temporal stores, so the destination's lines are not read for ownership first (a
 * third of phase 1's memory traffic out of place). The same operations, so the same bits,
 * as gf_peer_add then gf_peer_div. Returns 0 where it does not apply (the caller then
 * takes the plain loops). The stores are ordered before the fence by gf_peer_sfence. */
static int gf_peer_add2_stream(int code, void *out, const void *a, const void *b, int64_t n,
                               int divide, double divisor)
{
#if GF_PEER_NT
    int64_t i = 0;
    if (n < 4096 || (code != GF_PEER_F32 && code != GF_PEER_F64)) return 0;
    if (code == GF_PEER_F32) {
        float *o = (float *) out;
        const float *x = (const float *) a, *y = (const float *) b;
        const float fd = (float) divisor;
        if ((uintptr_t) o % 4) return 0;
        for (; i < n && ((uintptr_t) (o + i) % 16); i++) o[i] = divide ? (x[i] + y[i]) / fd : x[i] + y[i];
        if (divide) {
            const __m128 vd = _mm_set1_ps(fd);
            for (; i + 4 <= n; i += 4)
                _mm_stream_ps(o + i, _mm_div_ps(_mm_add_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(y + i)), vd));
        } else {
            for (; i + 4 <= n; i += 4)
                _mm_stream_ps(o + i, _mm_add_ps(_mm_loadu_ps(x + i), _mm_loadu_ps(y + i)));
        }
        for (; i < n; i++) o[i] = divide ? (x[i] + y[i]) / fd : x[i] + y[i];
    } else {
        double *o = (double *) out;
        const double *x = (const double *) a, *y = (const double *) b;
        if ((uintptr_t) o % 8) return 0;
        for (; i < n && ((uintptr_t) (o + i) % 16); i++) o[i] = divide ? (x[i] + y[i]) / divisor : x[i] + y[i];
        if (divide) {
            const __m128d vd = _mm_set1_pd(divisor);
            for (; i + 2 <= n; i += 2)
                _mm_stream_pd(o + i, _mm_div_pd(_mm_add_pd(_mm_loadu_pd(x + i), _mm_loadu_pd(y + i)), vd));
        } else {
            for (; i + 2 <= n; i += 2)
                _mm_stream_pd(o + i, _mm_add_pd(_mm_loadu_pd(x + i), _mm_loadu_pd(y + i)));
        }
        for (; i < n; i++) o[i] = divide ? (x[i] + y[i]) / divisor : x[i] + y[i];
    }
    return 1;
#else
    (void) code; (void) out; (void) a; (void) b; (void) n; (void) divide; (void) divisor;
    return 0;
#endif
}

static inline void gf_peer_sfence(void)
{
#if GF_PEER_NT
    _mm_sfence();
#endif
}

/* Phase 1: stripe [lo, hi) of the vector, summed into this rank's destination rows.
 * src_tab, dst_tab: p rows of nseg source / destination addresses (row r: rank r's),
 * `stride` elements apart; scratch: p slots of `piece` bytes (piece a multiple of 64).
 * push: each piece's sums are also written into every peer's destination rows
 * (process_vm_writev), so no phase 2 follows: the sums are read once (from the cache,
 * just written) instead of by every peer from this rank's memory. */
static int gf_peer_reduce(int p, int me, const int64_t *pids, const int64_t *src_tab, const int64_t *dst_tab,
                          int64_t stride, const int64_t *counts, int64_t nseg, int code, int64_t lo,
                          int64_t hi, int divide, double divisor, uint8_t *scratch, int64_t piece, int push,
                          int *who)
{
    struct iovec liov[GF_PEER_IOV], riov[GF_PEER_IOV];
    int64_t seg_s[GF_PEER_IOV], seg_off[GF_PEER_IOV], seg_n[GF_PEER_IOV];
    const void *xs[64];
    const int64_t isz = gf_peer_itemsize(code);
    const int64_t per_piece = piece / isz;
    const int64_t *dst = dst_tab + (int64_t) me * stride;
    gf_peer_cur cur;
    int64_t pos = lo;
    if (p < 2 || p > 64 || per_piece < 1) return EINVAL;
    gf_peer_seek(&cur, counts, nseg, pos);
    while (pos < hi) {
        int64_t end = hi - pos < per_piece ? hi : pos + per_piece;
        int np = 0, k, q, err;
        int64_t at = pos, done;
        gf_peer_cur c = cur;
        while (at < end && np < GF_PEER_IOV) {          /* the rows this piece spans */
            int64_t off = at - c.base, take = counts[c.s] - off;
            if (take > end - at) take = end - at;
            seg_s[np] = c.s;
            seg_off[np] = off;
            seg_n[np] = take;
            np++;
            at += take;
            if (off + take == counts[c.s]) {
                c.base += counts[c.s];
                c.s++;
                while (c.s < nseg && counts[c.s] == 0) c.s++;
            }
        }
        end = at;
        for (q = 0; q < p; q++) {                          /* the peers' values of this piece */
            uint8_t *slot = scratch + (int64_t) q * piece;
            if (q == me) {
                if (p > 2) {         /* own values into the slot: the running sum may overwrite them */
                    done = 0;
                    for (k = 0; k < np; k++) {
                        memcpy(slot + done, (const uint8_t *) (uintptr_t) src_tab[(int64_t) me * stride + seg_s[k]]
                               + seg_off[k] * isz, (size_t) (seg_n[k] * isz));
                        done += seg_n[k] * isz;
                    }
                }
                continue;
            }
            done = 0;
            for (k = 0; k < np; k++) {
                liov[k].iov_base = slot + done;
                liov[k].iov_len = (size_t) (seg_n[k] * isz);
                riov[k].iov_base = (void *) (uintptr_t) (src_tab[(int64_t) q * stride + seg_s[k]] + seg_off[k] * isz);
                riov[k].iov_len = liov[k].iov_len;
                done += seg_n[k] * isz;
            }
            err = gf_peer_readv(pids[q], liov, riov, np);
            if (err) { *who = q; return err; }
        }
        done = 0;                                          /* sum in rank order, divide, write */
        for (k = 0; k < np; k++) {
            uint8_t *out = (uint8_t *) (uintptr_t) dst[seg_s[k]] + seg_off[k] * isz;
            for (q = 0; q < p; q++)
                xs[q] = (q == me && p == 2)
                    ? (const void *) ((const uint8_t *) (uintptr_t) src_tab[(int64_t) me * stride + seg_s[k]] + seg_off[k] * isz)
                    : (const void *) (scratch + (int64_t) q * piece + done);
            if (!push && p == 2 && out != xs[0] && out != xs[1]
                    && gf_peer_add2_stream(code, out, xs[0], xs[1], seg_n[k], divide, divisor)) {
                done += seg_n[k] * isz;
                continue;                                  /* out of place: streamed */
            }
            gf_peer_add(code, out, xs[0], xs[1], seg_n[k]);
            for (q = 2; q < p; q++) gf_peer_add(code, out, out, xs[q], seg_n[k]);
            if (divide) gf_peer_div(code, out, seg_n[k], divisor);
            done += seg_n[k] * isz;
        }
        if (push) {                                        /* the sums into every peer's rows */
            for (q = 0; q < p; q++) {
                if (q == me) continue;
                for (k = 0; k < np; k++) {
                    liov[k].iov_base = (void *) (uintptr_t) (dst[seg_s[k]] + seg_off[k] * isz);
                    liov[k].iov_len = (size_t) (seg_n[k] * isz);
                    riov[k].iov_base = (void *) (uintptr_t) (dst_tab[(int64_t) q * stride + seg_s[k]]
                                                             + seg_off[k] * isz);
                    riov[k].iov_len = liov[k].iov_len;
                }
                err = gf_peer_copyv(pids[q], liov, riov, np, 1);
                if (err) { *who = q; return err; }
            }
        }
        cur = c;
        pos = end;
    }
    gf_peer_sfence();              /* streamed stores land before the fence lets peers read */
    return 0;
}

/* Phase 2: every stripe c whose owner c % p is not me (bounds[c] .. bounds[c + 1] of
 * nchunks) copied from the owner's destination rows (dst_tab row c % p, rows `stride`
 * elements apart) into this rank's (row me). */
static int gf_peer_gather(int p, int me, const int64_t *pids, const int64_t *dst_tab, int64_t stride,
                          const int64_t *counts, int64_t nseg, int code, const int64_t *bounds, int64_t nchunks,
                          int *who)
{
    struct iovec liov[GF_PEER_IOV], riov[GF_PEER_IOV];
    const int64_t isz = gf_peer_itemsize(code);
    int64_t ch;
    for (ch = 0; ch < nchunks; ch++) {
        int c = (int) (ch % p), err;
        int64_t pos = bounds[ch], hi = bounds[ch + 1];
        gf_peer_cur cur;
        if (c == me) continue;
        gf_peer_seek(&cur, counts, nseg, pos);
        while (pos < hi) {
            int n = 0;
            int64_t bytes = 0;
            while (pos < hi && n < GF_PEER_IOV && bytes < GF_PEER_CALL_MAX) {
                int64_t off = pos - cur.base, take = counts[cur.s] - off;
                if (take > hi - pos) take = hi - pos;
                if (take * isz > GF_PEER_CALL_MAX - bytes) take = (GF_PEER_CALL_MAX - bytes) / isz;
                liov[n].iov_base = (void *) (uintptr_t) (dst_tab[(int64_t) me * stride + cur.s] + off * isz);
                riov[n].iov_base = (void *) (uintptr_t) (dst_tab[(int64_t) c * stride + cur.s] + off * isz);
                liov[n].iov_len = riov[n].iov_len = (size_t) (take * isz);
                n++;
                bytes += take * isz;
                pos += take;
                if (off + take == counts[cur.s]) {
                    cur.base += counts[cur.s];
                    cur.s++;
                    while (cur.s < nseg && counts[cur.s] == 0) cur.s++;
                }
            }
            err = gf_peer_readv(pids[c], liov, riov, n);
            if (err) { *who = c; return err; }
        }
    }
    return 0;
}

#endif
