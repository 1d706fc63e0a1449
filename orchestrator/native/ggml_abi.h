/* The parts of ggml's ABI the native helpers read, as llama-cpp-python 0.3.36 (vendored ggml 0.25.3, the version
pyproject.toml pins) lays them out: ggml-cpu-impl.h's `struct ggml_compute_params`, ggml.h's `struct ggml_tensor`
and `enum ggml_type`, ggml-common.h's K-quant blocks. A layout that had changed would make the helpers' self-checks
or the runtime's start-up measurement of exact verification widths fail (speculation off), not answer wrongly:
every kernel here is compared bit for bit with the loaded library's own before it is used. */
#ifndef ORCHESTRATOR_GGML_ABI_H
#define ORCHESTRATOR_GGML_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ggml_compute_params_0_3_36 {
    int ith, nth;
    size_t wsize;
    void *wdata;
    void *threadpool;
    bool use_ref;
};

struct ggml_tensor_0_3_36 {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor_0_3_36 *src[10];
    struct ggml_tensor_0_3_36 *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

enum { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13, GGML_TYPE_Q6_K = 14,
       GGML_TYPE_BF16 = 30 };

#define QK_K 256

typedef struct {
    uint16_t d, dmin;   /* F16 */
    uint8_t scales[12]; /* scales and mins, 6 bits each */
    uint8_t qs[QK_K / 2];
} block_q4_K;

typedef struct {
    uint16_t d, dmin;   /* F16 */
    uint8_t scales[12]; /* scales and mins, 6 bits each */
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;

typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d; /* F16 */
} block_q6_K;

typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} block_q8_K;

_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K");
_Static_assert(sizeof(block_q8_K) == 292, "block_q8_K");

/* ggml-cpu's one-row kernels, as the loaded library exports them */
typedef void (*vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);
typedef void (*quantize_row_fn)(const float *x, void *y, int64_t k);
typedef void (*barrier_fn)(void *threadpool);

/* exact_matmuls.c */
bool exact_f16_on(void);
void exact_f16_gemm(int ith, int nth, int64_t m, int64_t n, int64_t k, const uint16_t *A, int64_t lda,
                    const uint16_t *B, int64_t ldb, float *C, int64_t ldc);
int exact_f16_check(vec_dot_fn dot);
bool exact_kquant_mul_mat(const struct ggml_compute_params_0_3_36 *params, struct ggml_tensor_0_3_36 *dst);
int exact_kquant_check(vec_dot_fn dot_q4_K, vec_dot_fn dot_q6_K, vec_dot_fn dot_q5_K, quantize_row_fn quantize_q8_K,
                       barrier_fn barrier);

#endif
