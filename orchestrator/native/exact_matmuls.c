/* Matmuls of several rows that sum every element exactly as ggml-cpu's one-row `vec_dot` kernels sum it, for the
reference paths (decode steps and verifications, orchestrator/kernels.py): a verification of k tokens then equals
k one-token steps bit for bit, as it does when ggml computes such a matmul row by row, but each weight (or KV)
row is unpacked once for all the rows of the ubatch instead of once per row.

Why it is exact: a one-row kernel's result depends only on the order of its floating-point operations, per output
element. Each kernel here does, per output element, the same operations in the same order as the one it stands
for (the x86 code of llama-cpp-python 0.3.36's ggml-cpu: vec.cpp `ggml_vec_dot_f16` in AVX512F/AVX512-FP16
builds, arch/x86/quants.c `ggml_vec_dot_q{4,5,6}_K_q8_K` in AVX2 and AVX512 builds); only work that does not
depend on the row of the ubatch (widening F16, unpacking 4-, 5- and 6-bit quants and scales,
integer products whose sums are exact) is shared. None of it is trusted: `exact_f16_check` and `exact_kquant_check`
compare each kernel bit for bit with the loaded library's own over pseudo-random data, and a kernel that differs
is never used (the row-by-row path stays). The runtime measures exact verification widths at start on top.

Compiled for the CPU features each function names (target attributes) and used only where the CPU has them
(`__builtin_cpu_supports`); elsewhere (no x86, no AVX2/AVX512F) the checks return 0. */
#include "ggml_abi.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EXACT_X86 1
#else
#define EXACT_X86 0
#endif

/* ---- F16 x F16 -> F32 (attention over an F16 KV cache, F16 weights) ---------------------------------------- */

static vec_dot_fn library_dot_f16; /* set once exact_f16_check agreed */
static int used = ~0;             /* orchestrator_exact_use's mask */

bool exact_f16_on(void) { return library_dot_f16 != NULL && (used & 1); }

/* Which of the kernels that agreed are used: bit 1 F16, 2 Q4_K, 4 Q6_K, 8 Q5_K (all, unless told otherwise). For
measurements that compare them with ggml's row-by-row path in one process (bench/, tests/); either way the sums
are the same. Exported as it is (ctypes). */
void orchestrator_exact_use(int mask) { used = mask; }

#if EXACT_X86
/* Each thread keeps one scratch buffer for the widened rows, (n + 1) * k floats, grown as needed: at most 16 Mi
floats (64 MiB; e.g. 33 verified rows over 32k tokens of context take 4.3 MiB), past that ggml's kernel. */
enum { SCRATCH_FLOATS = 16 << 20 };
static _Thread_local float *scratch;
static _Thread_local size_t scratch_floats;

static uint32_t next(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state;
}

/* A pseudo-random normal F16: random sign and mantissa, exponent 10..19 (about 2^-5..2^4). */
static uint16_t random_f16(uint32_t *state) {
    const uint32_t r = next(state);
    return (uint16_t)((r >> 16 & 0x8000u) | ((10u + (r >> 8) % 10u) << 10) | (r & 0x3ffu));
}

#define F16_TARGET __attribute__((target("avx512f,f16c")))

F16_TARGET static void widen(const uint16_t *x, float *y, int64_t k) {
    int64_t l = 0;
    for (; l + 16 <= k; l += 16) {
        _mm512_storeu_ps(y + l, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + l))));
    }
    for (; l < k; l++) {
        y[l] = _cvtsh_ss(x[l]);
    }
}

/* vec_dot_f16's end: its four accumulators reduced 0+2, 1+3, then 0+1, summed across lanes, then in double the
leftover products np .. k - 1, one by one. */
F16_TARGET static inline float f16_finish(__m512 s0, __m512 s1, __m512 s2, __m512 s3, const float *a,
                                          const float *b, int64_t np, int64_t k) {
    s0 = _mm512_add_ps(s0, s2);
    s1 = _mm512_add_ps(s1, s3);
    s0 = _mm512_add_ps(s0, s1);
    double sum = (double)_mm512_reduce_add_ps(s0);
    for (int64_t l = np; l < k; l++) {
        const float product = a[l] * b[l];
        sum += (double)product;
    }
    return (float)sum;
}

#define LOAD(p) _mm512_loadu_ps(p)
#define FMA4(s, b)                                        \
    s##0 = _mm512_fmadd_ps(x0, LOAD((b) + l), s##0);      \
    s##1 = _mm512_fmadd_ps(x1, LOAD((b) + l + 16), s##1); \
    s##2 = _mm512_fmadd_ps(x2, LOAD((b) + l + 32), s##2); \
    s##3 = _mm512_fmadd_ps(x3, LOAD((b) + l + 48), s##3)

/* One A row (widened, a) against four widened B rows b[0..3]: four accumulators of 16 lanes per column over steps
of 64, as vec_dot_f16; the 16 accumulators stay in registers and each load of A serves four columns. */
F16_TARGET static void f16_dot_4(const float *a, const float *const *b, int64_t k, float *out) {
    const int64_t np = k & ~(int64_t)63;
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
    __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, q0 = p0, q1 = p0, q2 = p0, q3 = p0;
    __m512 r0 = p0, r1 = p0, r2 = p0, r3 = p0, t0 = p0, t1 = p0, t2 = p0, t3 = p0;
    for (int64_t l = 0; l < np; l += 64) {
        const __m512 x0 = LOAD(a + l), x1 = LOAD(a + l + 16), x2 = LOAD(a + l + 32), x3 = LOAD(a + l + 48);
        FMA4(p, b0);
        FMA4(q, b1);
        FMA4(r, b2);
        FMA4(t, b3);
    }
    out[0] = f16_finish(p0, p1, p2, p3, a, b0, np, k);
    out[1] = f16_finish(q0, q1, q2, q3, a, b1, np, k);
    out[2] = f16_finish(r0, r1, r2, r3, a, b2, np, k);
    out[3] = f16_finish(t0, t1, t2, t3, a, b3, np, k);
}

F16_TARGET static float f16_dot_1(const float *a, const float *b, int64_t k) {
    const int64_t np = k & ~(int64_t)63;
    __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
    for (int64_t l = 0; l < np; l += 64) {
        const __m512 x0 = LOAD(a + l), x1 = LOAD(a + l + 16), x2 = LOAD(a + l + 32), x3 = LOAD(a + l + 48);
        FMA4(p, b);
    }
    return f16_finish(p0, p1, p2, p3, a, b, np, k);
}

static float *scratch_for(size_t floats) {
    if (floats > scratch_floats) {
        float *grown = realloc(scratch, floats * sizeof(float));
        if (!grown) {
            return NULL;
        }
        scratch = grown;
        scratch_floats = floats;
    }
    return scratch;
}

static void f16_gemm(int ith, int nth, int64_t m, int64_t n, int64_t k, const uint16_t *A, int64_t lda,
                     const uint16_t *B, int64_t ldb, float *C, int64_t ldc, vec_dot_fn dot) {
    const int64_t i0 = m * ith / nth, i1 = m * (ith + 1) / nth;
    if (i0 >= i1) {
        return;
    }
    const size_t floats = (size_t)(n + 1) * (size_t)k;
    float *wide = floats <= SCRATCH_FLOATS ? scratch_for(floats) : NULL;
    if (!wide) { /* too big, or no scratch memory: the library's own kernel, row by row (same sums) */
        for (int64_t i = i0; i < i1; i++) {
            for (int64_t j = 0; j < n; j++) {
                dot((int)k, C + j * ldc + i, 0, A + i * lda, 0, B + j * ldb, 0, 1);
            }
        }
        return;
    }
    float *a = wide + (size_t)n * (size_t)k;
    for (int64_t j = 0; j < n; j++) {
        widen(B + j * ldb, wide + (size_t)j * (size_t)k, k);
    }
    for (int64_t i = i0; i < i1; i++) {
        widen(A + i * lda, a, k);
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *b[4] = {wide + (size_t)j * (size_t)k, wide + (size_t)(j + 1) * (size_t)k,
                                 wide + (size_t)(j + 2) * (size_t)k, wide + (size_t)(j + 3) * (size_t)k};
            float out[4];
            f16_dot_4(a, b, k, out);
            for (int c = 0; c < 4; c++) {
                C[(j + c) * ldc + i] = out[c];
            }
        }
        for (; j < n; j++) {
            C[j * ldc + i] = f16_dot_1(a, wide + (size_t)j * (size_t)k, k);
        }
    }
}
#endif

/* C[j*ldc + i] = vec_dot_f16(A row i, B row j) for i in this thread's share of 0..m-1 (params ith of nth; each
thread widens B itself, so no barrier: ggml-cpu.c's mul_mat calls every thread for every slice and a barrier
follows the op), j in 0..n-1. Only once exact_f16_check agreed. Where scratch memory cannot be had it calls the
library's kernel itself, so its answer never depends on memory. */
void exact_f16_gemm(int ith, int nth, int64_t m, int64_t n, int64_t k, const uint16_t *A, int64_t lda,
                    const uint16_t *B, int64_t ldb, float *C, int64_t ldc) {
#if EXACT_X86
    f16_gemm(ith, nth, m, n, k, A, lda, B, ldb, C, ldc, library_dot_f16);
#else
    (void)ith, (void)nth, (void)m, (void)n, (void)k, (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc;
#endif
}

int exact_f16_check(vec_dot_fn dot) {
#if EXACT_X86
    if (!dot || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("f16c")) {
        return 0;
    }
    if (dot == library_dot_f16) {
        return 1; /* agreed before: the runtime asks at every start of a context */
    }
    static const int64_t lengths[] = {1, 15, 16, 63, 64, 65, 100, 256, 320, 1000, 1031, 4096};
    const int64_t m = 5, n = 6, kmax = 4096;
    uint16_t *A = malloc(sizeof(uint16_t) * (size_t)(m * kmax)), *B = malloc(sizeof(uint16_t) * (size_t)(n * kmax));
    float *C = malloc(sizeof(float) * (size_t)(m * n)), want;
    int agree = A && B && C && scratch_for((size_t)(n + 1) * (size_t)kmax);
    uint32_t state = 12345u;
    for (size_t t = 0; agree && t < sizeof(lengths) / sizeof(lengths[0]); t++) {
        const int64_t k = lengths[t];
        for (int64_t e = 0; e < m * kmax; e++) {
            A[e] = random_f16(&state);
        }
        for (int64_t e = 0; e < n * kmax; e++) {
            B[e] = random_f16(&state);
        }
        for (int ith = 0; ith < 2; ith++) {
            f16_gemm(ith, 2, m, n, k, A, kmax, B, kmax, C, m, dot);
        }
        for (int64_t i = 0; agree && i < m; i++) {
            for (int64_t j = 0; agree && j < n; j++) {
                dot((int)k, &want, 0, A + i * kmax, 0, B + j * kmax, 0, 1);
                agree = memcmp(&want, C + j * m + i, sizeof(float)) == 0;
            }
        }
    }
    free(A);
    free(B);
    free(C);
    if (agree) {
        library_dot_f16 = dot;
    }
    return agree;
#else
    (void)dot;
    return 0;
#endif
}

/* ---- Q4_K, Q5_K and Q6_K weights x Q8_K activations (K-quant models' weight matmuls) ------------------------ */

static bool tensor_abi_ok; /* orchestrator_exact_abi agreed: exact_kquant_mul_mat may read ggml_tensor fields */

struct ggml_init_params_0_3_36 {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};

/* Whether the loaded ggml lays `struct ggml_tensor` out as ggml_abi.h says, for the fields exact_kquant_mul_mat
reads (type, ne, nb, src, data): builds w (Q4_K 512 x 3), a (F32 512 x 2) and mul_mat(w, a) with the library's
own ggml_init, ggml_new_tensor_2d, ggml_mul_mat (in a 1 MiB context it allocates, so a wrong offset reads that
context, never past it) and compares every field with what it must be. 1 where all agree (the K-quant matmul may
then be turned on), else 0 and it stays off: a ggml of another layout (another llama-cpp-python, or
LLAMA_CPP_LIB_PATH's) gets ggml's row-by-row path, not a misread tensor. Exported as it is (ctypes: the
arguments are the loaded ggml-base's ggml_init, ggml_new_tensor_2d, ggml_mul_mat, ggml_free); call it before
orchestrator_exact_kquants, which stays off until it agreed. */
int orchestrator_exact_abi(void *init, void *new_tensor_2d, void *mul_mat, void *free_context) {
    typedef void *(*init_fn)(struct ggml_init_params_0_3_36);
    typedef struct ggml_tensor_0_3_36 *(*new_2d_fn)(void *, int, int64_t, int64_t);
    typedef struct ggml_tensor_0_3_36 *(*mul_mat_fn)(void *, struct ggml_tensor_0_3_36 *, struct ggml_tensor_0_3_36 *);
    typedef void (*free_fn)(void *);
    if (!init || !new_tensor_2d || !mul_mat || !free_context) {
        return 0;
    }
    void *ctx = ((init_fn)init)((struct ggml_init_params_0_3_36){1 << 20, NULL, false});
    if (!ctx) {
        return 0;
    }
    struct ggml_tensor_0_3_36 *w = ((new_2d_fn)new_tensor_2d)(ctx, GGML_TYPE_Q4_K, 512, 3);
    struct ggml_tensor_0_3_36 *a = ((new_2d_fn)new_tensor_2d)(ctx, GGML_TYPE_F32, 512, 2);
    struct ggml_tensor_0_3_36 *d = w && a ? ((mul_mat_fn)mul_mat)(ctx, w, a) : NULL;
    const bool ok = d && w->type == GGML_TYPE_Q4_K && w->ne[0] == 512 && w->ne[1] == 3 && w->ne[2] == 1
                    && w->ne[3] == 1 && w->nb[0] == sizeof(block_q4_K) && w->nb[1] == 2 * sizeof(block_q4_K)
                    && w->nb[2] == 6 * sizeof(block_q4_K) && a->type == GGML_TYPE_F32 && a->ne[0] == 512
                    && a->ne[1] == 2 && a->nb[0] == sizeof(float) && a->nb[1] == 512 * sizeof(float)
                    && d->type == GGML_TYPE_F32 && d->ne[0] == 3 && d->ne[1] == 2 && d->nb[1] == 3 * sizeof(float)
                    && d->src[0] == w && d->src[1] == a && w->data && a->data && d->data && w->data != a->data
                    && a->data != d->data;
    ((free_fn)free_context)(ctx);
    tensor_abi_ok = tensor_abi_ok || ok;
    return ok;
}

enum { COLUMNS = 64 }; /* ubatch rows per pass over a weight row: accumulators for each live on the stack */

#if EXACT_X86
static quantize_row_fn library_quantize_q8_K; /* set once exact_kquant_check agreed */
static barrier_fn library_barrier;

#define KQ_TARGET __attribute__((target("avx2,fma,f16c")))
#define KQ(name) name##_avx2
#include "kquant_rows.h"
#undef KQ_TARGET
#undef KQ
#define KQ_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))
#define KQ(name) name##_avx512
#include "kquant_rows.h"
#undef KQ_TARGET
#undef KQ

typedef void (*kquant_row_fn)(int, const void *, const block_q8_K *const *, int, float *, size_t);

/* The two copies of the row kernels, each [0] Q4_K, [1] Q6_K, [2] Q5_K. */
static const kquant_row_fn avx2[3] = {q4_K_row_avx2, q6_K_row_avx2, q5_K_row_avx2};
static const kquant_row_fn avx512[3] = {q4_K_row_avx512, q6_K_row_avx512, q5_K_row_avx512};
static kquant_row_fn used_row[3]; /* per type, the copy that agreed (exact_kquant_check); NULL: row by row */

/* Weight rows i0..i1-1 of a Q4_K/Q5_K/Q6_K matrix against n Q8_K rows (`q8`, `row` bytes apart), in passes of at most
COLUMNS rows: dst[j * dst_stride + i] (floats). */
static void kquant_rows(kquant_row_fn kernel, int nb, const char *w, size_t w_stride, int64_t i0, int64_t i1,
                        const char *q8, size_t row, int64_t n, float *dst, size_t dst_stride) {
    for (int64_t j0 = 0; j0 < n; j0 += COLUMNS) {
        const int cols = (int)(n - j0 < COLUMNS ? n - j0 : COLUMNS);
        const block_q8_K *y[COLUMNS];
        for (int c = 0; c < cols; c++) {
            y[c] = (const block_q8_K *)(q8 + (size_t)(j0 + c) * row);
        }
        for (int64_t i = i0; i < i1; i++) {
            kernel(nb, w + (size_t)i * w_stride, y, cols, dst + (size_t)j0 * dst_stride + (size_t)i, dst_stride);
        }
    }
}
#endif

/* ggml_compute_forward_mul_mat for a Q4_K, Q5_K or Q6_K weight matrix (2-D) times 2+ F32 rows (2-D), under the
reference paths, where ggml would quantize the rows to Q8_K into its work buffer (split between threads), meet at
a barrier and compute every element with vec_dot: the same, with the weight rows split between threads and each
computed against every activation row at once. Returns false, in every thread alike (the decision reads only the tensors
and params, which all threads share), for anything else: ggml then computes it row by row. */
bool exact_kquant_mul_mat(const struct ggml_compute_params_0_3_36 *params, struct ggml_tensor_0_3_36 *dst) {
#if EXACT_X86
    const struct ggml_tensor_0_3_36 *w = dst->src[0], *a = dst->src[1];
    if (!w || !a || (w->type != GGML_TYPE_Q4_K && w->type != GGML_TYPE_Q6_K && w->type != GGML_TYPE_Q5_K)) {
        return false;
    }
    const int t = w->type == GGML_TYPE_Q4_K ? 0 : w->type == GGML_TYPE_Q6_K ? 1 : 2;
    const kquant_row_fn kernel = used_row[t];
    if (!kernel || !(used & (2 << t))) {
        return false;
    }
    const int64_t k = w->ne[0], m = w->ne[1], n = a->ne[1];
    if (a->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 || n < 2 || k % QK_K != 0 || a->ne[0] != k
        || w->ne[2] != 1 || w->ne[3] != 1 || a->ne[2] != 1 || a->ne[3] != 1 || dst->ne[0] != m || dst->ne[1] != n
        || a->nb[0] != sizeof(float) || dst->nb[0] != sizeof(float) || dst->nb[1] % sizeof(float) != 0) {
        return false;
    }
    const int nb = (int)(k / QK_K);
    const size_t row = (size_t)nb * sizeof(block_q8_K);
    if (!params->wdata || params->wsize < row * (size_t)n) {
        return false;
    }
    char *q8 = params->wdata;
    for (int64_t j = params->ith; j < n; j += params->nth) {
        library_quantize_q8_K((const float *)((const char *)a->data + (size_t)j * a->nb[1]), q8 + (size_t)j * row, k);
    }
    library_barrier(params->threadpool);
    const int64_t i0 = m * params->ith / params->nth, i1 = m * (params->ith + 1) / params->nth;
    kquant_rows(kernel, nb, w->data, w->nb[1], i0, i1, q8, row, n, dst->data, dst->nb[1] / sizeof(float));
    return true;
#else
    (void)params, (void)dst;
    return false;
#endif
}

#if EXACT_X86
/* Compares `kernel` (a Q4_K or Q6_K row kernel, `type`) with the library's `dot` over rows of 1 to 14 blocks:
pseudo-random weight blocks (random quant and scale bytes, F16 scales of moderate size) against pseudo-random
activations quantized by the library. */
static int kquant_agrees(int type, kquant_row_fn kernel, vec_dot_fn dot, quantize_row_fn quantize) {
    enum { NB = 14, M = 3, N = 7 };
    const size_t block = type == GGML_TYPE_Q4_K   ? sizeof(block_q4_K)
                         : type == GGML_TYPE_Q5_K ? sizeof(block_q5_K)
                                                  : sizeof(block_q6_K);
    char *w = malloc(block * NB * M), *q8 = malloc(sizeof(block_q8_K) * NB * N);
    float *f = malloc(sizeof(float) * QK_K * NB), out[M * N], want;
    int agree = w && q8 && f;
    uint32_t state = 777u + (uint32_t)type;
    static const int lengths[] = {1, 2, 5, NB};
    for (size_t t = 0; agree && t < sizeof(lengths) / sizeof(lengths[0]); t++) {
        const int nb = lengths[t];
        for (size_t e = 0; e < block * NB * M; e++) {
            w[e] = (char)(next(&state) >> 24);
        }
        for (int i = 0; i < M * NB; i++) { /* the F16 scales: normal, moderate */
            if (type == GGML_TYPE_Q4_K) {
                block_q4_K *b = (block_q4_K *)w + i;
                b->d = random_f16(&state);
                b->dmin = random_f16(&state);
            } else if (type == GGML_TYPE_Q5_K) {
                block_q5_K *b = (block_q5_K *)w + i;
                b->d = random_f16(&state);
                b->dmin = random_f16(&state);
            } else {
                ((block_q6_K *)w + i)->d = random_f16(&state);
            }
        }
        for (int j = 0; j < N; j++) {
            for (int e = 0; e < QK_K * nb; e++) {
                f[e] = (float)((int32_t)next(&state)) * 0x1p-31f * (1.0f + (float)(j % 3));
            }
            quantize(f, q8 + (size_t)j * nb * sizeof(block_q8_K), QK_K * nb);
        }
        kquant_rows(kernel, nb, w, block * nb, 0, M, q8, nb * sizeof(block_q8_K), N, out, M);
        for (int i = 0; agree && i < M; i++) {
            for (int j = 0; agree && j < N; j++) {
                dot(QK_K * nb, &want, 0, w + (size_t)i * block * nb, 0, q8 + (size_t)j * nb * sizeof(block_q8_K), 0, 1);
                agree = memcmp(&want, out + j * M + i, sizeof(float)) == 0;
            }
        }
    }
    free(w);
    free(q8);
    free(f);
    return agree;
}
#endif

/* Turns exact_kquant_mul_mat on for each of Q4_K, Q6_K and Q5_K whose kernel agrees bit for bit with the
library's, once orchestrator_exact_abi agreed (`dot_q4_K`, `dot_q6_K`, `dot_q5_K`: ggml_vec_dot_q{4,6,5}_K_q8_K;
`quantize_q8_K`: quantize_row_q8_K; `barrier`: ggml_barrier). Both copies are compared where the CPU runs them
(AVX2; AVX512F/VL/BW/DQ), and the AVX512 one is used where it agrees, else the AVX2 one. Returns the bit set of
copies that agreed: AVX2 1 Q4_K, 2 Q6_K, 4 Q5_K; AVX512 8 Q4_K, 16 Q6_K, 32 Q5_K; 0 where none did (not x86, no
AVX2/FMA/F16C, a difference). Call it before the first reference computation. */
int exact_kquant_check(vec_dot_fn dot_q4_K, vec_dot_fn dot_q6_K, vec_dot_fn dot_q5_K, quantize_row_fn quantize_q8_K,
                       barrier_fn barrier) {
#if EXACT_X86
    if (!tensor_abi_ok || !quantize_q8_K || !barrier || !__builtin_cpu_supports("avx2")
        || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) {
        return 0;
    }
    static vec_dot_fn asked[3];
    static int answer = -1; /* the last answer, for the same library kernels: asked at every start of a context */
    if (answer >= 0 && asked[0] == dot_q4_K && asked[1] == dot_q6_K && asked[2] == dot_q5_K) {
        return answer;
    }
    const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                      && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    const vec_dot_fn dots[3] = {dot_q4_K, dot_q6_K, dot_q5_K};
    const int types[3] = {GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q5_K};
    int agreed = 0;
    for (int t = 0; t < 3; t++) {
        if (!dots[t]) {
            continue;
        }
        const bool narrow_ok = kquant_agrees(types[t], avx2[t], dots[t], quantize_q8_K);
        const bool wide_ok = wide && kquant_agrees(types[t], avx512[t], dots[t], quantize_q8_K);
        agreed |= (narrow_ok ? 1 << t : 0) | (wide_ok ? 8 << t : 0);
        if (!used_row[t] && (narrow_ok || wide_ok)) {
            library_quantize_q8_K = quantize_q8_K;
            library_barrier = barrier;
            used_row[t] = wide_ok ? avx512[t] : avx2[t];
        }
    }
    asked[0] = dot_q4_K;
    asked[1] = dot_q6_K;
    asked[2] = dot_q5_K;
    answer = agreed;
    return agreed;
#else
    (void)dot_q4_K, (void)dot_q6_K, (void)dot_q5_K, (void)quantize_q8_K, (void)barrier;
    return 0;
#endif
}
