/* y = W x for one bf16 row x: W [rows, n] row-major bf16, x [n] bf16, y [rows] bf16; and
 * Y = X W^T for a few rows X [m, n] (a decode step of m sequences), Y [m, rows].
 *
 * Decode reads every weight once per token, so this is a streaming loop: products are summed in
 * fp32 and rounded to bf16 once per output (round to nearest even, as torch rounds). On every path
 * the few-row product sums each of its rows in exactly the one-row kernel's order: a decode row's
 * output does not depend on how many sequences share its step (tests/test_gemv.py holds them bit
 * for bit). Rows are split over the OpenMP threads torch already runs (see pocketllm/compiled.py).
 * Built with -march=native: the widest path this CPU has is compiled in, AVX-512 BF16 dot products,
 * else AVX-512 or AVX2 FMAs on bf16 widened to fp32, else plain C.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"
#include "../prefetch.h"
#include "../scratch.h"
#include "../threads.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define STEP 32
static inline __m512bh load_bh(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
static float dot1(const uint16_t *w, int64_t n, const uint16_t *x, int64_t ahead) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += STEP) {
        if (ahead) _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
        __mmask32 m = n - i >= STEP ? (__mmask32)~0u : (__mmask32)((1u << (n - i)) - 1u);
        a = _mm512_dpbf16_ps(a, load_bh(w + i, m), load_bh(x + i, m));
    }
    return _mm512_reduce_add_ps(a);
}
/* Four weight rows against up to four x rows: each weight load feeds up to four dot products, so
 * the weight streams once for four sequences, and each x load feeds four weight rows. Inlined into
 * calls with a constant `cols`, so the sixteen accumulators stay in registers. x is read as it is
 * (xw unused). */
#define HAS_TILE 1
#define TILE_ROWS 4
#define WIDENS_X 0
#define X_STRIDE(n) (n) /* xw is not read */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t n, const uint16_t *x, const float *xw, int cols, float o[4][4], int64_t pf, int64_t ahead) {
    (void)xw;
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += STEP) {
        if (pf)
            for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w + r * n + i) + pf, _MM_HINT_NTA);
        if (ahead)
            for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w + r * n + i) + ahead, _MM_HINT_T0);
        __mmask32 m = n - i >= STEP ? (__mmask32)~0u : (__mmask32)((1u << (n - i)) - 1u);
        __m512bh wv[4];
        for (int r = 0; r < 4; r++) wv[r] = load_bh(w + r * n + i, m);
        for (int c = 0; c < cols; c++) {
            __m512bh xv = load_bh(x + c * n + i, m);
            for (int r = 0; r < 4; r++) a[r][c] = _mm512_dpbf16_ps(a[r][c], wv[r], xv);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < cols; c++) o[r][c] = _mm512_reduce_add_ps(a[r][c]);
}
/* A weight row (or two) against up to eight x rows: the tile above reads four weight rows at once
 * and, for more than four x rows, each weight block twice; here each thread streams its weight
 * rows one (or two) at a time, each line feeding eight dot products, which on some CPUs and shapes
 * keeps the stream at the one-row kernel's rate where the four-row tile falls well below it
 * (which wins is measured per shape and row count; docs/batching.md). Each (weight row, x row)
 * pair still has one accumulator, summed as dot1 sums it. */
#define HAS_WIDE 1
#define WIDE_COLS 8
#define WIDE_ROWS_MAX 2
static inline __attribute__((always_inline)) void wide_tile(const uint16_t *w, int64_t n, const uint16_t *x, const float *xw, int wrows, int cols, float o[2][WIDE_COLS], int64_t ahead) {
    (void)xw;
    __m512 a[2][WIDE_COLS];
    for (int r = 0; r < wrows; r++)
        for (int c = 0; c < WIDE_COLS; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += STEP) {
        if (ahead)
            for (int r = 0; r < wrows; r++) _mm_prefetch((const char *)(w + r * n + i) + ahead, _MM_HINT_T0);
        __mmask32 m = n - i >= STEP ? (__mmask32)~0u : (__mmask32)((1u << (n - i)) - 1u);
        __m512bh wv[2];
        for (int r = 0; r < wrows; r++) wv[r] = load_bh(w + r * n + i, m);
        for (int c = 0; c < cols; c++) {
            __m512bh xv = load_bh(x + c * n + i, m);
            for (int r = 0; r < wrows; r++) a[r][c] = _mm512_dpbf16_ps(a[r][c], wv[r], xv);
        }
    }
    for (int r = 0; r < wrows; r++)
        for (int c = 0; c < cols; c++) o[r][c] = _mm512_reduce_add_ps(a[r][c]);
}
const char *gemv_bf16_isa(void) { return "avx512_bf16"; }

#elif defined(__AVX512F__) && defined(__AVX512BW__)
/* Without BF16 dot products: 32 bf16 per 512-bit load, widened as two halves without a shuffle
 * (as the AVX2 path below: shifting each 32-bit lane left by 16 gives its even element as fp32,
 * masking off its low half gives its odd one). The one-row kernel widens x the same way as it goes
 * (it is in L1); the tile reads x widened to fp32 once per call in the same halves (per 32 inputs,
 * the 16 even then the 16 odd, zero past n). Even and odd products go to two
 * sums per pair, so a one-row call is not bound by one chain of FMA latencies; the two are added,
 * then reduced. */
#define STEP 32
#define HAS_TILE 1
#define TILE_ROWS 2
#define WIDENS_X 1
static inline int64_t x_width(int64_t n) { return (n + STEP - 1) / STEP * STEP; }
#define X_STRIDE(n) x_width(n)
static void widen_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i < x_width(n); i += STEP)
        for (int j = 0; j < STEP / 2; j++) {
            xw[i + j] = i + 2 * j < n ? bf16_to_f32(x[i + 2 * j]) : 0.f;
            xw[i + STEP / 2 + j] = i + 2 * j + 1 < n ? bf16_to_f32(x[i + 2 * j + 1]) : 0.f;
        }
}
static inline __m512i load_w(const uint16_t *p, int64_t left) {
    __mmask32 m = left >= STEP ? (__mmask32)~0u : (__mmask32)((1u << left) - 1u);
    return _mm512_maskz_loadu_epi16(m, p);
}
static inline __m512 even_f(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 odd_f(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }
/* x widened here the same way gives the lanes widen_x lays out, so the sums are those of the tile. */
static float dot1(const uint16_t *w, int64_t n, const uint16_t *x, int64_t ahead) {
    __m512 ae = _mm512_setzero_ps(), ao = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += STEP) {
        if (ahead) _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
        __m512i wv = load_w(w + i, n - i), xv = load_w(x + i, n - i);
        ae = _mm512_fmadd_ps(even_f(wv), even_f(xv), ae);
        ao = _mm512_fmadd_ps(odd_f(wv), odd_f(xv), ao);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(ae, ao));
}
/* Two weight rows against up to four x rows, each pair summed as dot1 sums a row: sixteen sums,
 * four widened weight halves and two x halves in the 32 registers. Inlined into calls with a
 * constant `cols`. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t n, const uint16_t *x, const float *xw, int cols, float o[2][4], int64_t pf, int64_t ahead) {
    (void)x;
    const int64_t xs = X_STRIDE(n);
    __m512 ae[2][4], ao[2][4];
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 4; c++) ae[r][c] = ao[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += STEP) {
        if (pf)
            for (int r = 0; r < 2; r++) _mm_prefetch((const char *)(w + r * n + i) + pf, _MM_HINT_NTA);
        if (ahead)
            for (int r = 0; r < 2; r++) _mm_prefetch((const char *)(w + r * n + i) + ahead, _MM_HINT_T0);
        __m512i w0 = load_w(w + i, n - i), w1 = load_w(w + n + i, n - i);
        __m512 w0e = even_f(w0), w0o = odd_f(w0), w1e = even_f(w1), w1o = odd_f(w1);
        for (int c = 0; c < cols; c++) {
            __m512 xe = _mm512_loadu_ps(xw + c * xs + i), xo = _mm512_loadu_ps(xw + c * xs + i + STEP / 2);
            ae[0][c] = _mm512_fmadd_ps(w0e, xe, ae[0][c]);
            ao[0][c] = _mm512_fmadd_ps(w0o, xo, ao[0][c]);
            ae[1][c] = _mm512_fmadd_ps(w1e, xe, ae[1][c]);
            ao[1][c] = _mm512_fmadd_ps(w1o, xo, ao[1][c]);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < cols; c++) o[r][c] = _mm512_reduce_add_ps(_mm512_add_ps(ae[r][c], ao[r][c]));
}
/* One weight row against up to eight x rows over inputs k0..k1, its widened halves feeding
 * sixteen sums carried in `acc` (even, odd per x row) from one block of inputs to the next, each
 * pair's two reduced at the end as dot1's (finish_pair). pf > 0: each 64 bytes of the row also
 * asked for pf bytes ahead, `where` as prefetch_weight. */
#define HAS_BLOCKED 1
#define BLOCK_COLS 8
typedef __m512 acc_t;
#define BLOCK_END(n) (n) /* masked loads take the last part-vector */
static inline __attribute__((always_inline)) void tile_acc(const uint16_t *w, int64_t k0, int64_t k1, int64_t n, const float *xw, int cols, acc_t *acc, int64_t pf, int where) {
    const int64_t xs = X_STRIDE(n);
    __m512 ae[BLOCK_COLS], ao[BLOCK_COLS];
    for (int c = 0; c < cols; c++) ae[c] = acc[2 * c], ao[c] = acc[2 * c + 1];
    for (int64_t i = k0; i < k1; i += STEP) {
        if (pf) prefetch_weight((const char *)(w + i) + pf, where);
        __m512i wv = load_w(w + i, n - i);
        __m512 we = even_f(wv), wo = odd_f(wv);
        for (int c = 0; c < cols; c++) {
            ae[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xw + c * xs + i), ae[c]);
            ao[c] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xw + c * xs + i + STEP / 2), ao[c]);
        }
    }
    for (int c = 0; c < cols; c++) acc[2 * c] = ae[c], acc[2 * c + 1] = ao[c];
}
static inline float finish_pair(const acc_t *a, const uint16_t *w, const uint16_t *x, int64_t n) {
    (void)w, (void)x, (void)n;
    return _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
}
/* The wide tile (see the BF16 path): tile_acc over the whole row, `ahead` into every level. */
#define HAS_WIDE 1
#define WIDE_COLS BLOCK_COLS
#define WIDE_ROWS_MAX 1
static inline __attribute__((always_inline)) void wide_tile(const uint16_t *w, int64_t n, const uint16_t *x, const float *xw, int wrows, int cols, float o[2][WIDE_COLS], int64_t ahead) {
    (void)wrows;
    acc_t acc[2 * WIDE_COLS];
    for (int c = 0; c < cols; c++) acc[2 * c] = acc[2 * c + 1] = _mm512_setzero_ps();
    tile_acc(w, 0, BLOCK_END(n), n, xw, cols, acc, ahead, PF_ALL_LEVELS);
    for (int c = 0; c < cols; c++) o[0][c] = finish_pair(acc + 2 * c, w, x + c * n, n);
}
const char *gemv_bf16_isa(void) { return "avx512f"; }

#elif defined(__AVX2__) && defined(__FMA__)
/* Sixteen bf16 per 256-bit load, widened as two halves without a shuffle: shifting each 32-bit
 * lane left by 16 gives its even element as fp32, masking off its low half gives its odd one.
 * x is split the same way, so even elements meet even ones; a widening load (vpmovzxwd) per eight
 * elements cost so many more instructions that the loop ran short of memory bandwidth. Even and
 * odd products go to two sums per pair, added, then reduced (as the AVX-512 path above): with one
 * sum a row waits on a chain of two FMA latencies per sixteen inputs, which held one row below
 * the memory's rate (docs/decode.md). */
#define STEP 16
static inline __m256 even_f(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd_f(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
static inline __m256i load_w(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* A pair's two sums reduced, then the inputs past the last whole STEP added one at a time. */
static inline float finish(__m256 ae, __m256 ao, const uint16_t *w, const uint16_t *x, int64_t i, int64_t n) {
    float s = hsum(_mm256_add_ps(ae, ao));
    for (; i < n; i++) s += bf16_to_f32(w[i]) * bf16_to_f32(x[i]);
    return s;
}
static float dot1(const uint16_t *w, int64_t n, const uint16_t *x, int64_t ahead) {
    __m256 ae = _mm256_setzero_ps(), ao = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        if (ahead && (i & 31) == 0) _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
        __m256i xv = load_w(x + i), wv = load_w(w + i);
        ae = _mm256_fmadd_ps(even_f(wv), even_f(xv), ae);
        ao = _mm256_fmadd_ps(odd_f(wv), odd_f(xv), ao);
    }
    return finish(ae, ao, w, x, i, n);
}
/* dot1 of four consecutive weight rows against one x, each row summed exactly as dot1 sums it,
 * x widened once for the four: where one row's stream runs short of the memory's rate, four
 * streams may not (a candidate, measured). `ahead` is each row's distance as dot1 has it, along
 * the rows this lane of the group reads next (row r, then r + DOT_GROUP, ...): a plain byte
 * offset past a short row's end would land in the rows the group is reading already. */
#define DOT_GROUP 4
static void dot_group(const uint16_t *w, int64_t n, const uint16_t *x, int64_t ahead, float o[DOT_GROUP]) {
    __m256 ae[DOT_GROUP], ao[DOT_GROUP];
    for (int r = 0; r < DOT_GROUP; r++) ae[r] = ao[r] = _mm256_setzero_ps();
    /* Where the prefetch is: `groups` groups on, input `at` of the row. */
    int64_t groups = ahead / 2 / n, at = ahead / 2 % n;
    int64_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        if (ahead && (i & 31) == 0) {
            const uint16_t *p = w + groups * DOT_GROUP * n + at;
            for (int r = 0; r < DOT_GROUP; r++) _mm_prefetch((const char *)(p + r * n), _MM_HINT_T0);
            if ((at += 32) >= n) at -= n, groups++;
        }
        __m256i xv = load_w(x + i);
        __m256 xe = even_f(xv), xo = odd_f(xv);
        for (int r = 0; r < DOT_GROUP; r++) {
            __m256i wv = load_w(w + r * n + i);
            ae[r] = _mm256_fmadd_ps(even_f(wv), xe, ae[r]);
            ao[r] = _mm256_fmadd_ps(odd_f(wv), xo, ao[r]);
        }
    }
    for (int r = 0; r < DOT_GROUP; r++) o[r] = finish(ae[r], ao[r], w + r * n, x, i, n);
}
/* One weight row against up to four x rows, x widened to fp32 beforehand in the same even/odd
 * halves (widen_x): each weight load feeds up to eight products, so the weight streams once for
 * four sequences; each pair summed as dot1 sums a row. Eight sums, two widened weight halves and
 * x read by the FMAs: two weight rows would need sixteen sums, all the registers. Inlined into
 * calls with a constant `cols`. */
#define HAS_TILE 1
#define TILE_ROWS 1
#define WIDENS_X 1
#define X_STRIDE(n) (n)
static void widen_x(const uint16_t *x, int64_t n, float *xw) {
    for (int64_t i = 0; i + STEP <= n; i += STEP)
        for (int j = 0; j < STEP / 2; j++) {
            xw[i + j] = bf16_to_f32(x[i + 2 * j]);
            xw[i + STEP / 2 + j] = bf16_to_f32(x[i + 2 * j + 1]);
        }
}
/* The tile over inputs k0..k1 (whole STEPs), its sums carried in `acc` (even, odd per x row)
 * from one block of inputs to the next (gemm_rows_blocked_bf16), each pair reduced at the end as
 * dot1 reduces a row (finish_pair). pf > 0: each 64 bytes of the row also asked for pf bytes
 * ahead, `where` as prefetch_weight. */
#define HAS_BLOCKED 1
#define BLOCK_COLS 4
typedef __m256 acc_t;
#define BLOCK_END(n) ((n) / STEP * STEP) /* finish_pair adds the rest */
static inline __attribute__((always_inline)) void tile_acc(const uint16_t *w, int64_t k0, int64_t k1, int64_t n, const float *xw, int cols, acc_t *acc, int64_t pf, int where) {
    __m256 ae[BLOCK_COLS], ao[BLOCK_COLS];
    for (int c = 0; c < cols; c++) ae[c] = acc[2 * c], ao[c] = acc[2 * c + 1];
    for (int64_t i = k0; i < k1; i += STEP) {
        if (pf && (i & 31) == 0) prefetch_weight((const char *)(w + i) + pf, where);
        __m256i wv = load_w(w + i);
        __m256 we = even_f(wv), wo = odd_f(wv);
        for (int c = 0; c < cols; c++) {
            ae[c] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xw + c * X_STRIDE(n) + i), ae[c]);
            ao[c] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xw + c * X_STRIDE(n) + i + STEP / 2), ao[c]);
        }
    }
    for (int c = 0; c < cols; c++) acc[2 * c] = ae[c], acc[2 * c + 1] = ao[c];
}
static inline float finish_pair(const acc_t *a, const uint16_t *w, const uint16_t *x, int64_t n) {
    return finish(a[0], a[1], w, x, BLOCK_END(n), n);
}
/* gemm_rows_bf16's tile: tile_acc over the whole row, prefetching non-temporally (pf) or into
 * every level (ahead), as its callers ask. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t n, const uint16_t *x, const float *xw, int cols, float o[1][BLOCK_COLS], int64_t pf, int64_t ahead) {
    acc_t acc[2 * BLOCK_COLS];
    for (int c = 0; c < cols; c++) acc[2 * c] = acc[2 * c + 1] = _mm256_setzero_ps();
    tile_acc(w, 0, BLOCK_END(n), n, xw, cols, acc, pf ? pf : ahead, pf ? PF_NON_TEMPORAL : PF_ALL_LEVELS);
    for (int c = 0; c < cols; c++) o[0][c] = finish_pair(acc + 2 * c, w, x + c * n, n);
}
const char *gemv_bf16_isa(void) { return "avx2"; }

#else
static float dot1(const uint16_t *w, int64_t n, const uint16_t *x, int64_t ahead) {
    (void)ahead;
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += bf16_to_f32(w[i]) * bf16_to_f32(x[i]);
    return s;
}
const char *gemv_bf16_isa(void) { return "scalar"; }
#endif

/* Each thread takes a contiguous range of rows and reads them one after another, one dot product
 * at a time: the weight is then a single sequential stream per thread, which the hardware
 * prefetchers follow at the memory's rate. Four rows at a time, sharing each load of x, read four
 * streams 2n bytes apart, which they follow less well: well below that rate (docs/decode.md, one
 * row: one stream per thread). The AVX2 build also has the four-row form (gemv_bf16_group): there
 * a row alone waits on its one chain of FMAs, which on some cores (an Intel Xeon) is below the
 * memory's rate and on others (an AMD Zen 4) is not, while the four streams read slower there;
 * both are candidates, measured on the machine that runs. Each row is summed exactly as the
 * few-row product below sums it (dot1). prefetch > 0: each row is also asked for non-temporally
 * ONE_ROW_AHEAD rows ahead, so that the weight, read once per step, passes by the outer caches
 * instead of evicting what the work after the GEMV runs on (the interpreter, the next small op's
 * data). ahead > 0: each 64 bytes of a row are asked for into every cache level `ahead` bytes
 * before they are read, so more lines are on their way than the hardware prefetchers keep in
 * flight; where those run short of the memory's rate (a core that streams alone well below what
 * two do), this is what reaches it. Which runs faster in a step depends on the CPU; each is a
 * candidate. */
#define ONE_ROW_AHEAD 2
static inline void prefetch_row(const uint16_t *w, int64_t r, int64_t rows, int64_t n) {
    if (r < rows)
        for (int64_t off = 0; off < n * 2; off += 64) __builtin_prefetch((const char *)(w + r * n) + off, 0, 0);
}
void gemv_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t prefetch, int64_t ahead) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (prefetch) prefetch_row(w, r + ONE_ROW_AHEAD, rows, n);
        y[r] = f32_to_bf16(dot1(w + r * n, n, x, ahead));
    }
}

/* gemv_bf16 four rows at a time (dot_group: each row's bits are dot1's), where the build has the
 * four-row form (AVX2); elsewhere it is gemv_bf16. A thread's range goes in groups of DOT_GROUP
 * rows, the rows past the last whole group one at a time. */
void gemv_bf16_group(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t prefetch, int64_t ahead) {
#ifdef DOT_GROUP
    const int64_t groups = (rows + DOT_GROUP - 1) / DOT_GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = g * DOT_GROUP;
        if (prefetch) /* the next group's rows, as a row alone asks for one ONE_ROW_AHEAD ahead */
            for (int64_t r = r0 + DOT_GROUP; r < r0 + 2 * DOT_GROUP; r++) prefetch_row(w, r, rows, n);
        if (r0 + DOT_GROUP <= rows) {
            float o[DOT_GROUP];
            dot_group(w + r0 * n, n, x, ahead, o);
            for (int r = 0; r < DOT_GROUP; r++) y[r0 + r] = f32_to_bf16(o[r]);
        } else {
            for (int64_t r = r0; r < rows; r++) y[r] = f32_to_bf16(dot1(w + r * n, n, x, ahead));
        }
    }
#else
    gemv_bf16(w, x, y, rows, n, prefetch, ahead);
#endif
}

/* The weight rows gemv_bf16_group takes at a time in this build (1: it is gemv_bf16). */
int gemv_bf16_group_rows(void) {
#ifdef DOT_GROUP
    return DOT_GROUP;
#else
    return 1;
#endif
}

#if defined(HAS_TILE) || defined(HAS_WIDE)
/* x's m rows widened to fp32 in the per-thread scratch, where this build's tiles read them so
 * (NULL where they read x as it is), with `extra` bytes after them (64-byte aligned, at
 * widened_bytes); *failed set when the scratch could not grow. */
static inline size_t widened_bytes(int64_t n, int64_t m) { return ((size_t)(m * X_STRIDE(n)) * sizeof(float) + 63) / 64 * 64; }
static float *widen_rows(const uint16_t *x, int64_t n, int64_t m, size_t extra, int *failed) {
    *failed = 0;
#if WIDENS_X
    float *xw = scratch(widened_bytes(n, m) + extra);
    if (xw == NULL) {
        *failed = 1;
        return NULL;
    }
    for (int64_t c = 0; c < m; c++) widen_x(x + c * n, n, xw + c * X_STRIDE(n));
    return xw;
#else
    (void)x, (void)n, (void)m, (void)extra;
    return NULL;
#endif
}
#endif

/* Y [m, rows] = X [m, n] W^T, each output summed in fp32 and rounded once. Where a tile is
 * compiled in (AVX-512, AVX2) x rows go four at a time against a block of weight rows;
 * elsewhere each output is its own dot product, which reads the weight once per x row (the
 * load-time measurement then prefers torch's GEMM there). prefetch and ahead as for gemv_bf16
 * (prefetch here a distance in bytes). */
void gemm_rows_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t prefetch, int64_t ahead) {
#ifdef HAS_TILE
    int failed;
    float *xw = widen_rows(x, n, m, 0, &failed);
    if (failed) {
        for (int64_t c = 0; c < m; c++) gemv_bf16(w, x + c * n, y + c * rows, rows, n, prefetch, ahead);
        return;
    }
    int64_t blocks = rows / TILE_ROWS;
    /* Parallel over blocks of weight rows, the x rows four at a time inside: a block read for the
     * first four is still in cache for the next four. */
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *wb = w + b * TILE_ROWS * n;
        for (int64_t c0 = 0; c0 < m; c0 += 4) {
            int cols = m - c0 < 4 ? (int)(m - c0) : 4;
            const float *xwc = xw == NULL ? NULL : xw + c0 * X_STRIDE(n);
            float o[TILE_ROWS][4];
            switch (cols) {
            case 4: tile(wb, n, x + c0 * n, xwc, 4, o, prefetch, ahead); break;
            case 3: tile(wb, n, x + c0 * n, xwc, 3, o, prefetch, ahead); break;
            case 2: tile(wb, n, x + c0 * n, xwc, 2, o, prefetch, ahead); break;
            default: tile(wb, n, x + c0 * n, xwc, 1, o, prefetch, ahead); break;
            }
            for (int r = 0; r < TILE_ROWS; r++)
                for (int c = 0; c < cols; c++) y[(c0 + c) * rows + b * TILE_ROWS + r] = f32_to_bf16(o[r][c]);
        }
    }
    for (int64_t r = blocks * TILE_ROWS; r < rows; r++)
        for (int64_t c = 0; c < m; c++) y[c * rows + r] = f32_to_bf16(dot1(w + r * n, n, x + c * n, 0));
#else
    for (int64_t c = 0; c < m; c++) gemv_bf16(w, x + c * n, y + c * rows, rows, n, prefetch, ahead);
#endif
}

/* gemm_rows_bf16 with each `ahead` prefetch reaching into the next block of weight rows: row r of
 * the next block at the same input, `ahead` bytes on. Above four x rows a block is read in several
 * passes over x, and only the first reads memory: a prefetch inside the block's own rows finds
 * them already read in the later passes, so the memory idles while they run; one block on keeps it
 * streaming through every pass. Where no tile is compiled, gemm_rows_bf16 as it is. */
void gemm_rows_next_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t prefetch, int64_t ahead) {
#ifdef HAS_TILE
    ahead += TILE_ROWS * n * (int64_t)sizeof(uint16_t);
#endif
    gemm_rows_bf16(w, x, y, rows, n, m, prefetch, ahead);
}

/* Y [m, rows] = X [m, n] W^T as gemm_rows_bf16 (the same bits), blocked for the caches, in the
 * builds whose tiles read x widened to fp32 (AVX2, AVX-512 without BF16): with eight x rows so
 * widened a tile's x no longer stays in L1 from one weight row to the next (32 KiB at n = 1024),
 * and each of its loads went to L2. Here each thread takes a block of `rb` consecutive weight rows
 * and runs it over x a block of inputs at a time (`x_bytes` of x's fp32 rows, in L1), one weight
 * row at a time against BLOCK_COLS x rows, the sums carried across input blocks (tile_acc); the
 * rows' parts for one block of inputs are read from memory by the first pass over x and from the
 * caches by the others, and meanwhile the next block of rows is asked for into L2. Where its
 * buffer cannot grow, gemm_rows_bf16 (the same bits). Returns 1; 0 where this build has no such
 * form (nothing written). */
#ifdef HAS_BLOCKED
int gemm_rows_blocked_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t x_bytes, int64_t rb) {
    const int64_t end = BLOCK_END(n), xs = X_STRIDE(n);
    int64_t kb = x_bytes / (m * (int64_t)sizeof(float)) / STEP * STEP;
    if (kb < 4 * STEP) kb = 4 * STEP;
    if (rb < 1) rb = 1;
    /* Each thread's sums after x: one buffer, as scratch() is one per thread. */
    const int threads = max_threads();
    const int64_t per = rb * m * 2;
    int failed;
    float *xw = widen_rows(x, n, m, (size_t)(per * threads) * sizeof(acc_t), &failed);
    if (failed) {
        gemm_rows_bf16(w, x, y, rows, n, m, 0, 0);
        return 1;
    }
    acc_t *sums = (acc_t *)((char *)xw + widened_bytes(n, m));
#pragma omp parallel num_threads(threads)
    {
        int64_t r0, r1;
        thread_units(rows, &r0, &r1);
        acc_t *acc = sums + thread_index() * per;
        for (int64_t b0 = r0; b0 < r1; b0 += rb) {
            const int64_t be = b0 + rb < r1 ? b0 + rb : r1;
            memset(acc, 0, (size_t)((be - b0) * m * 2) * sizeof(acc_t));
            const int64_t pf = (be - b0) * n * (int64_t)sizeof(uint16_t);
            for (int64_t k0 = 0; k0 < end; k0 += kb) {
                const int64_t k1 = k0 + kb < end ? k0 + kb : end;
                for (int64_t c0 = 0; c0 < m; c0 += BLOCK_COLS) {
                    const int cols = m - c0 < BLOCK_COLS ? (int)(m - c0) : BLOCK_COLS;
                    for (int64_t r = b0; r < be; r++) {
                        acc_t *a = acc + ((r - b0) * m + c0) * 2;
                        const int64_t p = c0 == 0 ? pf : 0; /* the first pass over these rows reads memory */
                        const float *xc = xw + c0 * xs;
                        /* Constant column counts, so the sums stay in registers. */
                        switch (cols) {
#if BLOCK_COLS >= 8
                        case 8: tile_acc(w + r * n, k0, k1, n, xc, 8, a, p, PF_L2); break;
                        case 7: tile_acc(w + r * n, k0, k1, n, xc, 7, a, p, PF_L2); break;
                        case 6: tile_acc(w + r * n, k0, k1, n, xc, 6, a, p, PF_L2); break;
                        case 5: tile_acc(w + r * n, k0, k1, n, xc, 5, a, p, PF_L2); break;
#endif
                        case 4: tile_acc(w + r * n, k0, k1, n, xc, 4, a, p, PF_L2); break;
                        case 3: tile_acc(w + r * n, k0, k1, n, xc, 3, a, p, PF_L2); break;
                        case 2: tile_acc(w + r * n, k0, k1, n, xc, 2, a, p, PF_L2); break;
                        default: tile_acc(w + r * n, k0, k1, n, xc, 1, a, p, PF_L2); break;
                        }
                    }
                }
            }
            for (int64_t r = b0; r < be; r++)
                for (int64_t c = 0; c < m; c++) y[c * rows + r] = f32_to_bf16(finish_pair(acc + ((r - b0) * m + c) * 2, w + r * n, x + c * n, n));
        }
    }
    return 1;
}
#else
int gemm_rows_blocked_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t x_bytes, int64_t rb) {
    (void)w, (void)x, (void)y, (void)rows, (void)n, (void)m, (void)x_bytes, (void)rb;
    return 0;
}
#endif

/* Y [m, rows] = X [m, n] W^T with the wide tile: `wrows` (1, or 2 where WIDE_ROWS_MAX allows)
 * weight rows at a time against up to eight x rows, `ahead` as for gemv_bf16. Returns 0 where this
 * build has no wide tile of `wrows` rows (nothing written). */
#ifdef HAS_WIDE
#define WIDE_CALL(R, C) wide_tile(wb, n, x + c0 * n, xw == NULL ? NULL : xw + c0 * X_STRIDE(n), R, C, o, ahead)
int gemm_rows_wide_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t wrows, int64_t ahead) {
    if (wrows < 1 || wrows > WIDE_ROWS_MAX) return 0;
    int failed;
    float *xw = widen_rows(x, n, m, 0, &failed);
    if (failed) {
        for (int64_t c = 0; c < m; c++) gemv_bf16(w, x + c * n, y + c * rows, rows, n, 0, ahead);
        return 1;
    }
    int64_t blocks = rows / wrows;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *wb = w + b * wrows * n;
        for (int64_t c0 = 0; c0 < m; c0 += WIDE_COLS) {
            int cols = m - c0 < WIDE_COLS ? (int)(m - c0) : WIDE_COLS;
            float o[2][WIDE_COLS];
            /* Constant row and column counts, so the accumulators stay in registers. */
            if (wrows == 1) {
                switch (cols) {
                case 8: WIDE_CALL(1, 8); break;
                case 4: WIDE_CALL(1, 4); break;
                case 2: WIDE_CALL(1, 2); break;
                default: WIDE_CALL(1, cols); break;
                }
            } else {
#if WIDE_ROWS_MAX >= 2
                switch (cols) {
                case 8: WIDE_CALL(2, 8); break;
                case 4: WIDE_CALL(2, 4); break;
                case 2: WIDE_CALL(2, 2); break;
                default: WIDE_CALL(2, cols); break;
                }
#endif
            }
            for (int r = 0; r < wrows; r++)
                for (int c = 0; c < cols; c++) y[(c0 + c) * rows + b * wrows + r] = f32_to_bf16(o[r][c]);
        }
    }
    for (int64_t r = blocks * wrows; r < rows; r++)
        for (int64_t c = 0; c < m; c++) y[c * rows + r] = f32_to_bf16(dot1(w + r * n, n, x + c * n, 0));
    return 1;
}
#else
int gemm_rows_wide_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m, int64_t wrows, int64_t ahead) {
    (void)w, (void)x, (void)y, (void)rows, (void)n, (void)m, (void)wrows, (void)ahead;
    return 0;
}
#endif

/* The same few-row product on AMX tiles, where the CPU has them and the kernel lets this process
 * use them (amx_bf16_enable). The weight is the A operand as it lies in memory, sixteen rows of
 * 32 bf16 per tile load; only X, which is small, is rearranged, into the pair-interleaved layout
 * the B operand takes. So no copy of the weight is made, and each tile product does 16 x m x 32
 * multiply-adds where an AVX-512 BF16 dot product does 32: at eight rows the AVX-512 tile above is
 * limited by its arithmetic, the AMX one by memory. */
/* AVX-512 too: a build with AVX turned off keeps the AMX macros but not their intrinsics. */
/* NO_AMX_TILES: the AVX-512-without-BF16 build (compiled.py's ISA_FLAGS) leaves them out. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__) && !defined(NO_AMX_TILES)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_bf16_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Y [m, rows] = X [m, n] W^T for m <= 16 and n a multiple of 32; xb is X in the B layout. */
static void amx_block(const uint16_t *w, const uint16_t *x, const uint16_t *xb, uint16_t *y, int64_t rows, int64_t n, int64_t m) {
    int64_t blocks = rows / 16;
#pragma omp parallel
    {
        struct tile_config cfg = {0};
        cfg.palette_id = 1;
        cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(m * 4); /* C: 16 weight rows x m fp32 */
        cfg.rows[1] = 16, cfg.colsb[1] = 64;                /* A: 16 weight rows x 32 bf16 */
        cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(m * 4); /* B: 16 pairs of n x m columns */
        _tile_loadconfig(&cfg);
        float c[16 * 16];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            _tile_zero(0);
            for (int64_t k = 0; k < n; k += 32) {
                _tile_loadd(1, w + b * 16 * n + k, n * 2);
                _tile_loadd(2, xb + k * m, m * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, c, m * 4);
            for (int r = 0; r < 16; r++)
                for (int64_t j = 0; j < m; j++) y[j * rows + b * 16 + r] = f32_to_bf16(c[r * m + j]);
        }
        _tile_release();
    }
    for (int64_t r = blocks * 16; r < rows; r++)
        for (int64_t j = 0; j < m; j++) y[j * rows + r] = f32_to_bf16(dot1(w + r * n, n, x + j * n, 0));
}

void gemm_rows_amx_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m) {
    /* x in the tiles' layout, in the per-thread scratch (a malloc and free per call cost more than
     * a small call's work). */
    uint16_t *xb = n % 32 ? NULL : scratch((size_t)(n * (m < 16 ? m : 16)) * sizeof(uint16_t));
    if (xb == NULL) { /* a width the tiles do not cover (or no memory): the AVX-512 path */
        gemm_rows_bf16(w, x, y, rows, n, m, 0, 0);
        return;
    }
    for (int64_t j0 = 0; j0 < m; j0 += 16) {
        int64_t mm = m - j0 < 16 ? m - j0 : 16;
        for (int64_t k2 = 0; k2 < n / 2; k2++)
            for (int64_t j = 0; j < mm; j++) {
                xb[(k2 * mm + j) * 2] = x[(j0 + j) * n + 2 * k2];
                xb[(k2 * mm + j) * 2 + 1] = x[(j0 + j) * n + 2 * k2 + 1];
            }
        amx_block(w, x + j0 * n, xb, y + j0 * rows, rows, n, mm);
    }
}
#else
int amx_bf16_enable(void) { return 0; }
void gemm_rows_amx_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t m) {
    gemm_rows_bf16(w, x, y, rows, n, m, 0, 0);
}
#endif

/* One row on the same tiles (gemv_bf16's signature, so a compiled step calls it as it calls that):
 * the tile unit sums each output element from its own weight row and x column alone, so a row
 * gets here the bits it gets as one of several rows of gemm_rows_amx_bf16. */
void gemv_amx_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t rows, int64_t n, int64_t prefetch, int64_t ahead) {
    (void)prefetch;
    (void)ahead;
    gemm_rows_amx_bf16(w, x, y, rows, n, 1);
}
