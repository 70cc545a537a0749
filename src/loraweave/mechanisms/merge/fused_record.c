/* The fused merge of one block with its compact undo record (loraweave/mechanisms/merge/inplace.py).

   For each element: W' = round(W + d) is written over W, and where round(W' - d), what an undo computes with
   torch, misses W bitwise (or either is NaN, whose bits torch may pattern differently), W's bits and the flat
   position are appended to the record. The arithmetic is torch's on the CPU: fp32 adds, one round to nearest
   even into the weight's dtype; no FMA contraction, no fast-math (built with -ffp-contract=off).

   Arguments of every kernel:
     w      the block of the weight (n elements), rewritten in place
     d      the block's ΔW, fp32, n elements
     base   the flat position of w[0] in the weight
     gaps   out: the misses' positions as undo.py's "gaps8" entries: the step from the previous miss (1..255),
            a step above 255 preceded by filler zeros worth 255 each (room for n + span/255 + 2 entries)
     vals   out: W's bits at the misses
     guard  in/out: [count, pos0..pos7] positions where W' != W (filled until 8), with guard_w / guard_m bits
     state  in/out: [misses, new non-finite values, last, entries, gaps16 fillers]: last (in/out) is the flat
            position of the previous miss (-1 before the first block); entries: gap entries written; the
            gaps16 fillers: Σ (step - 1) / 65535, to size the 2-byte encoding. misses is written last, so -1
            set before the call means the block was not written (a call is atomic for Python: no signal is
            taken inside it)
   Each block is done in slices of SLICE elements that stay in L1: W' and the miss flags first (vectorized),
   then the flags are scanned 8 at a time, then W' is copied over the slice. */

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define SLICE 2048
#define GUARDS 8

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int nan32(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
static inline int inf_or_nan32(uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u; }

/* fp32 -> bf16, round to nearest even (NaN: torch's canonical 0x7fc0; marked a miss anyway) */
static inline uint16_t bf16_of(float x) {
    uint32_t u = f2u(x);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = 0u - (uint32_t)nan32(u); /* a mask, not a branch: gcc vectorizes the loop only so */
    return (uint16_t)((r & ~nan) | (0x7fc0u & nan));
}
static inline int nan16b(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }
static inline int inf_or_nan16b(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }

/* The misses of a slice, 8 flags at a time: a word with none is skipped; in one with any, all 8 elements are
   stored unconditionally and the counters move by the flag (no branch per element to mispredict). A gap
   longer than 255 (rare) first gets its filler zeros, leaving a remainder of 1..255. */
/* The misses of a slice, from its flags, as ascending slice indices; returns their count. */
static inline int64_t flagged(const uint8_t *miss, int64_t m, int32_t *idx) {
    int64_t c = 0;
    for (int64_t i = 0; i < m; i += 8) {
        uint64_t x = 0;
        memcpy(&x, miss + i, 8);
        while (x) {
            idx[c++] = (int32_t)(i + (__builtin_ctzll(x) >> 3));
            x &= x - 1;
        }
    }
    return c;
}

/* The record of a slice's c misses: "gaps8" entries (filler zeros before a step above 255, which is rare),
   W's bits, new non-finite values; `last` is the flat position of the previous miss. */
#define EMIT(TYPE, NONFINITE)                                                                    \
    for (int64_t j = 0; j < c; j++) {                                                            \
        int64_t at = base + s + idx[j], step = at - last;                                        \
        TYPE was = ws[idx[j]];                                                                   \
        if (step > 255) {                                                                        \
            if (step > 65535) f16 += (step - 1) / 65535;                                         \
            for (; step > 255; step -= 255) gaps[e++] = 0;                                       \
        }                                                                                        \
        gaps[e++] = (uint8_t)step;                                                               \
        vals[k++] = was;                                                                         \
        bad += (!NONFINITE(was)) & NONFINITE(out[idx[j]]);                                       \
        last = at;                                                                               \
    }

/* The first byte offset where a and b differ (n where none): guards are searched over every slice until 8 are
   found, and a block whose ΔW rounds away (a zero LoRA, rows outside a fused part) changes no element. */
static inline int64_t first_diff(const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512BW__
    for (; i + 64 <= n; i += 64) {
        __mmask64 ne = _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
        if (ne) return i + __builtin_ctzll(ne);
    }
#endif
    for (; i + 8 <= n; i += 8) {
        uint64_t x, y;
        memcpy(&x, a + i, 8);
        memcpy(&y, b + i, 8);
        if (x != y) return i + (__builtin_ctzll(x ^ y) >> 3);
    }
    for (; i < n; i++)
        if (a[i] != b[i]) return i;
    return n;
}

#define GUARD(TYPE)                                                                              \
    for (int64_t i = 0; guard[0] < GUARDS; i++) {                                                \
        i += first_diff((const uint8_t *)(ws + i), (const uint8_t *)(out + i),                   \
                        (m - i) * (int64_t)sizeof(TYPE)) / (int64_t)sizeof(TYPE);                \
        if (i >= m) break;                                                                       \
        int64_t g = guard[0]++;                                                                  \
        guard[1 + g] = base + s + i;                                                             \
        guard_w[g] = ws[i];                                                                      \
        guard_m[g] = out[i];                                                                     \
    }

#define FINISH()                                                                                 \
    state[1] = bad;                                                                              \
    state[2] = last;                                                                             \
    state[3] = e;                                                                                \
    state[4] = f16;                                                                              \
    state[0] = k;                                                                                \
    return k;

#ifdef __AVX512F__
/* W' of 16 fp32 lanes and the lanes that miss (or are NaN): compress-stored as indices, no branch per lane */
static inline int64_t slice_f32(const uint32_t *ws, const float *ds, int64_t m, uint32_t *out, int32_t *idx) {
    int64_t c = 0, i = 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= m; i += 16) {
        __m512i a = _mm512_loadu_si512(ws + i);
        __m512 dv = _mm512_loadu_ps(ds + i);
        __m512 b = _mm512_add_ps(_mm512_castsi512_ps(a), dv);
        __m512i g = _mm512_castps_si512(_mm512_sub_ps(b, dv)), bi = _mm512_castps_si512(b);
        __mmask16 mk = _mm512_cmpneq_epi32_mask(g, a) |
                       _mm512_cmpgt_epu32_mask(_mm512_and_si512(bi, absmask), inf) |
                       _mm512_cmpgt_epu32_mask(_mm512_and_si512(g, absmask), inf);
        _mm512_storeu_si512(out + i, bi);
        _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi32(mk, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i))));
        c += __builtin_popcount(mk);
    }
    for (; i < m; i++) {
        uint32_t a = ws[i];
        float b = u2f(a) + ds[i];
        uint32_t bu = f2u(b), g = f2u(b - ds[i]);
        out[i] = bu;
        if ((g != a) | nan32(bu) | nan32(g)) idx[c++] = (int32_t)i;
    }
    return c;
}
#else
static inline int64_t slice_f32(const uint32_t *ws, const float *ds, int64_t m, uint32_t *out, int32_t *idx) {
    uint8_t miss[SLICE + 8];
    for (int64_t i = 0; i < m; i++) {
        uint32_t a = ws[i];
        float b = u2f(a) + ds[i];
        uint32_t bu = f2u(b), g = f2u(b - ds[i]);
        out[i] = bu;
        miss[i] = (uint8_t)((g != a) | nan32(bu) | nan32(g));
    }
    memset(miss + m, 0, 8);
    return flagged(miss, m, idx);
}
#endif

#ifdef __AVX512F__
/* 16 bf16 lanes widened to 32 bits: the add, the sub and both roundings in fp32 lanes, misses compress-stored */
static inline __m512i bf16_round(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

static inline int64_t slice_bf16(const uint16_t *ws, const float *ds, int64_t m, uint16_t *out, int32_t *idx) {
    int64_t c = 0, i = 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i quiet = _mm512_set1_epi32(0x7f80);
    for (; i + 16 <= m; i += 16) {
        __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ws + i)));
        __m512 dv = _mm512_loadu_ps(ds + i);
        __m512i b = bf16_round(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), dv));
        __m512i g = bf16_round(_mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), dv));
        __m512i absb = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff)), absg = _mm512_and_si512(g, _mm512_set1_epi32(0x7fff));
        __mmask16 mk = _mm512_cmpneq_epi32_mask(g, a) | _mm512_cmpgt_epu32_mask(absb, quiet) |
                       _mm512_cmpgt_epu32_mask(absg, quiet);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(b));
        _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi32(mk, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i))));
        c += __builtin_popcount(mk);
    }
    for (; i < m; i++) {
        uint16_t a = ws[i];
        uint16_t b = bf16_of(u2f((uint32_t)a << 16) + ds[i]);
        uint16_t g = bf16_of(u2f((uint32_t)b << 16) - ds[i]);
        out[i] = b;
        if ((g != a) | nan16b(b) | nan16b(g)) idx[c++] = (int32_t)i;
    }
    return c;
}
#else
static inline int64_t slice_bf16(const uint16_t *ws, const float *ds, int64_t m, uint16_t *out, int32_t *idx) {
    uint8_t miss[SLICE + 8];
    for (int64_t i = 0; i < m; i++) {
        uint16_t a = ws[i];
        uint16_t b = bf16_of(u2f((uint32_t)a << 16) + ds[i]);
        uint16_t g = bf16_of(u2f((uint32_t)b << 16) - ds[i]);
        out[i] = b;
        miss[i] = (uint8_t)((g != a) | nan16b(b) | nan16b(g));
    }
    memset(miss + m, 0, 8);
    return flagged(miss, m, idx);
}
#endif

#define KERNEL(NAME, TYPE, SLICE_FN, NONFINITE)                                                  \
    int64_t NAME(TYPE *w, const float *d, int64_t n, int64_t base, uint8_t *gaps, TYPE *vals,    \
                 int64_t *guard, TYPE *guard_w, TYPE *guard_m, int64_t *state) {                 \
        TYPE out[SLICE];                                                                         \
        int32_t idx[SLICE + 16];                                                                 \
        int64_t k = 0, bad = 0, last = state[2], e = 0, f16 = 0;                                 \
        for (int64_t s = 0; s < n; s += SLICE) {                                                 \
            int64_t m = n - s < SLICE ? n - s : SLICE;                                           \
            TYPE *ws = w + s;                                                                    \
            int64_t c = SLICE_FN(ws, d + s, m, out, idx);                                        \
            EMIT(TYPE, NONFINITE)                                                                \
            if (guard[0] < GUARDS) GUARD(TYPE)                                                   \
            memcpy(ws, out, (size_t)m * sizeof(TYPE));                                           \
        }                                                                                        \
        FINISH()                                                                                 \
    }

/* The positions (from -1) a record's gap entries step to, written to out; returns how many: each entry is a
   step, a zero a filler worth the encoding's largest step with no position of its own (undo.decode_gaps: one
   pass where torch needs six over 8-byte integers). */
#define DECODE(NAME, TYPE, MOST)                                                                 \
    int64_t NAME(const TYPE *e, int64_t n, int64_t *out) {                                       \
        int64_t pos = -1, k = 0;                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                        \
            int64_t step = e[i];                                                                 \
            pos += step ? step : MOST;                                                           \
            out[k] = pos;                                                                        \
            k += step != 0;                                                                      \
        }                                                                                        \
        return k;                                                                                \
    }

DECODE(lw_decode_gaps8, uint8_t, 255)
DECODE(lw_decode_gaps16, uint16_t, 65535)

KERNEL(lw_merge_f32, uint32_t, slice_f32, inf_or_nan32)
KERNEL(lw_merge_bf16, uint16_t, slice_bf16, inf_or_nan16b)

/* dst = round(w + sign·d), the kernels' arithmetic with no record (undo.combine_into for 16-bit weights: one
   pass where torch needs three; a record's rebuild, undo="none"'s direct write). sign is +1 or -1: sign·d is
   exact, the add rounds once in fp32, then once into the weight's dtype. dst may be w. */
void lw_combine_bf16(const uint16_t *w, const float *d, uint16_t *dst, int64_t n, int32_t sign) {
    const float s = (float)sign;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_of(u2f((uint32_t)w[i] << 16) + s * d[i]);
}

#ifdef __FLT16_MANT_DIG__
static inline uint16_t h2u(_Float16 h) { uint16_t u; memcpy(&u, &h, 2); return u; }
static inline _Float16 u2h(uint16_t u) { _Float16 h; memcpy(&h, &u, 2); return h; }
static inline int nan16(uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }
static inline int inf_or_nan16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

#ifdef __AVX512F__
/* 16 fp16 lanes: F16C-style conversions (round to nearest even), fp32 arithmetic, misses compress-stored */
static inline int64_t slice_f16(const uint16_t *ws, const float *ds, int64_t m, uint16_t *out, int32_t *idx) {
    int64_t c = 0, i = 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i inf = _mm512_set1_epi32(0x7c00), abs = _mm512_set1_epi32(0x7fff);
    for (; i + 16 <= m; i += 16) {
        __m256i a16 = _mm256_loadu_si256((const __m256i *)(ws + i));
        __m512 dv = _mm512_loadu_ps(ds + i);
        __m256i b16 = _mm512_cvtps_ph(_mm512_add_ps(_mm512_cvtph_ps(a16), dv), _MM_FROUND_TO_NEAREST_INT);
        __m256i g16 = _mm512_cvtps_ph(_mm512_sub_ps(_mm512_cvtph_ps(b16), dv), _MM_FROUND_TO_NEAREST_INT);
        __m512i a = _mm512_cvtepu16_epi32(a16), b = _mm512_cvtepu16_epi32(b16), g = _mm512_cvtepu16_epi32(g16);
        __mmask16 mk = _mm512_cmpneq_epi32_mask(g, a) | _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs), inf) |
                       _mm512_cmpgt_epu32_mask(_mm512_and_si512(g, abs), inf);
        _mm256_storeu_si256((__m256i *)(out + i), b16);
        _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi32(mk, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)i))));
        c += __builtin_popcount(mk);
    }
    for (; i < m; i++) {
        uint16_t a = ws[i];
        uint16_t b = h2u((_Float16)((float)u2h(a) + ds[i]));
        uint16_t g = h2u((_Float16)((float)u2h(b) - ds[i]));
        out[i] = b;
        if ((g != a) | nan16(b) | nan16(g)) idx[c++] = (int32_t)i;
    }
    return c;
}
#else
static inline int64_t slice_f16(const uint16_t *ws, const float *ds, int64_t m, uint16_t *out, int32_t *idx) {
    uint8_t miss[SLICE + 8];
    for (int64_t i = 0; i < m; i++) {
        uint16_t a = ws[i];
        uint16_t b = h2u((_Float16)((float)u2h(a) + ds[i]));
        uint16_t g = h2u((_Float16)((float)u2h(b) - ds[i]));
        out[i] = b;
        miss[i] = (uint8_t)((g != a) | nan16(b) | nan16(g));
    }
    memset(miss + m, 0, 8);
    return flagged(miss, m, idx);
}
#endif

KERNEL(lw_merge_f16, uint16_t, slice_f16, inf_or_nan16)

void lw_combine_f16(const uint16_t *w, const float *d, uint16_t *dst, int64_t n, int32_t sign) {
    const float s = (float)sign;
    int64_t i = 0;
#ifdef __AVX512F__
    /* gcc does not vectorize the _Float16 casts: the conversions slice_f16 uses, 16 lanes at a time */
    const __m512 sv = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
        __m512 y = _mm512_add_ps(x, _mm512_mul_ps(sv, _mm512_loadu_ps(d + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; i++) dst[i] = h2u((_Float16)((float)u2h(w[i]) + s * d[i]));
}

int lw_has_f16(void) { return 1; }
#else
int lw_has_f16(void) { return 0; }
#endif
