/* The Q4_K, Q5_K and Q6_K row kernels of exact_matmuls.c, included there once per instruction set: KQ_TARGET is the
function attribute naming it, KQ(name) the name of this copy's function. The same source compiled for AVX2 or for
AVX512 (32 vector registers: the unpacked block stays in registers) does the same operations; which copy runs is
chosen by the CPU, and the one chosen is what exact_kquant_check compares with the library. */

/* quants.c's hsum_float_8 */
KQ_TARGET static inline float KQ(hsum_float_8)(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, unpacked as their vec_dot does: the 8 mins as 16-bit lanes,
and the 8 scales as 16-bit lanes in both halves of a 256-bit register. */
KQ_TARGET static inline void KQ(unpack_scales)(const uint8_t *packed, __m128i *mins, __m256i *scales) {
    uint32_t utmp[4];
    memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & 0x0f0f0f0f) | (((utmp[1] >> 6) & 0x03030303) << 4);
    const uint32_t uaux = utmp[1] & 0x3f3f3f3f;
    utmp[1] = (utmp[2] & 0x0f0f0f0f) | (((utmp[0] >> 6) & 0x03030303) << 4);
    utmp[2] = uaux;
    utmp[0] &= 0x3f3f3f3f;
    const __m256i mins_and_scales =
        _mm256_cvtepu8_epi16(_mm_set_epi32((int)utmp[3], (int)utmp[2], (int)utmp[1], (int)utmp[0]));
    *mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    *scales = _mm256_set_m128i(sc128, sc128);
}

/* The mins times a Q8_K block's sums of 32 quants (its 16 sums of 16, added in pairs): 4 int32 lanes. */
KQ_TARGET static inline __m128i KQ(mins_product)(__m128i mins, const block_q8_K *b) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)b->bsums);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    return _mm_madd_epi16(mins, q8s);
}

/* Q4_K's and Q5_K's quant sums for one Q8_K block: for each of the 4 pairs of 32-quant groups (unsigned quants
`lo[j]`, `hi[j]` against the block's 64 quants from 64 * j), the byte products summed in pairs and scaled by
`scale_lo[j]`, `scale_hi[j]`, added into 8 int32 lanes as their vec_dot adds them (integer sums: exact). */
KQ_TARGET static inline __m256i KQ(scaled_sums)(const __m256i *scale_lo, const __m256i *scale_hi, const __m256i *lo,
                                                const __m256i *hi, const block_q8_K *b) {
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i q8l = _mm256_loadu_si256((const __m256i *)(b->qs + 64 * j));
        const __m256i q8h = _mm256_loadu_si256((const __m256i *)(b->qs + 64 * j + 32));
        const __m256i p16l = _mm256_madd_epi16(scale_lo[j], _mm256_maddubs_epi16(lo[j], q8l));
        const __m256i p16h = _mm256_madd_epi16(scale_hi[j], _mm256_maddubs_epi16(hi[j], q8h));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
    }
    return sumi;
}

/* One Q4_K weight row (nb blocks) against `cols` Q8_K rows y[c] (nb blocks each): out[c * stride], each as
ggml_vec_dot_q4_K_q8_K computes it (per block: d = y.d * x.d and dmin = -y.d * x.dmin in float; the mins' product
into a 4-lane accumulator and the scaled quant sums into an 8-lane one, by FMA; at the end hsum_float_8 of the one
plus the reduced other). The block's scales, mins and 4-bit quants are unpacked once for all columns. */
KQ_TARGET static void KQ(q4_K_row)(int nb, const void *row, const block_q8_K *const *y, int cols, float *out,
                                   size_t stride) {
    const block_q4_K *x = row;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[COLUMNS];
    __m128 acc_m[COLUMNS];
    for (int c = 0; c < cols; c++) {
        acc[c] = _mm256_setzero_ps();
        acc_m[c] = _mm_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        const float xd = _cvtsh_ss(x[i].d), xdmin = _cvtsh_ss(x[i].dmin);
        __m128i mins;
        __m256i scales;
        KQ(unpack_scales)(x[i].scales, &mins, &scales);
        __m256i scale_l[4], scale_h[4], q4l[4], q4h[4];
        for (int j = 0; j < 4; j++) {
            /* each 16-bit lane takes scale 2j (low half) or 2j + 1 (high half), as get_scale_shuffle_k4 */
            scale_l[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 1) << 8 | (4 * j))));
            scale_h[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * j));
            q4l[j] = _mm256_and_si256(bits, m4);
            q4h[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        }
        for (int c = 0; c < cols; c++) {
            const block_q8_K *b = y[c] + i;
            const float d = b->d * xd;
            const float dmin = -b->d * xdmin;
            const __m128i prod = KQ(mins_product)(mins, b);
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[c]);
            const __m256i sumi = KQ(scaled_sums)(scale_l, scale_h, q4l, q4h, b);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < cols; c++) {
        __m128 m = acc_m[c];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[c * stride] = KQ(hsum_float_8)(acc[c]) + _mm_cvtss_f32(m);
    }
}

/* One Q6_K weight row against `cols` Q8_K rows, as ggml_vec_dot_q6_K_q8_K (per block: d = y.d * x.d in float; the
scaled quant sums minus 32 * the scaled q8 sums, into an 8-lane accumulator by FMA; hsum_float_8 at the end). The
block's 6-bit quants and scales are unpacked once for all columns. */
KQ_TARGET static void KQ(q6_K_row)(int nb, const void *row, const block_q8_K *const *y, int cols, float *out,
                                   size_t stride) {
    const block_q6_K *x = row;
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc[COLUMNS];
    for (int c = 0; c < cols; c++) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        const float xd = _cvtsh_ss(x[i].d);
        const __m128i scales = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i q[8], sc[8];
        for (int j = 0; j < 2; j++) {
            const __m256i bits1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * j));
            const __m256i bits2 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * j + 32));
            const __m256i bitsH = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * j));
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i h2 = _mm256_and_si256(bitsH, _mm256_set1_epi8(48));
            const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2);
            q[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(bits1, m15), h0);
            q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(bits2, m15), h1);
            q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), h2);
            q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15), h3);
            for (int s = 0; s < 4; s++) {
                /* bytes 0..7 take scale 2*is, bytes 8..15 scale 2*is + 1, as get_scale_shuffle(is) */
                const int is = 4 * j + s;
                const __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ull * (uint64_t)(2 * is + 1)),
                                                    (long long)(0x0101010101010101ull * (uint64_t)(2 * is)));
                sc[is] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
            }
        }
        for (int c = 0; c < cols; c++) {
            const block_q8_K *b = y[c] + i;
            const float d = b->d * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)b->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 2; j++) {
                __m256i p[4];
                for (int s = 0; s < 4; s++) {
                    const __m256i q8 = _mm256_loadu_si256((const __m256i *)(b->qs + 128 * j + 32 * s));
                    p[s] = _mm256_madd_epi16(sc[4 * j + s], _mm256_maddubs_epi16(q[4 * j + s], q8));
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < cols; c++) {
        out[c * stride] = KQ(hsum_float_8)(acc[c]);
    }
}

/* One Q5_K weight row against `cols` Q8_K rows, as ggml_vec_dot_q5_K_q8_K (per block: d and dmin as Q4_K; the
mins' product summed to one integer and added to a float sum as `summs += dmin * that`; the scaled quant sums,
the fifth bit from qh, into an 8-lane accumulator by FMA; at the end hsum_float_8 of it plus summs). The block's
scales, mins and 5-bit quants are unpacked once for all columns. */
KQ_TARGET static void KQ(q5_K_row)(int nb, const void *row, const block_q8_K *const *y, int cols, float *out,
                                   size_t stride) {
    const block_q5_K *x = row;
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m128i mzero = _mm_setzero_si128();
    __m256 acc[COLUMNS];
    float summs[COLUMNS];
    for (int c = 0; c < cols; c++) {
        acc[c] = _mm256_setzero_ps();
        summs[c] = 0.f;
    }
    for (int i = 0; i < nb; i++) {
        const float xd = _cvtsh_ss(x[i].d), xdmin = _cvtsh_ss(x[i].dmin);
        __m128i mins;
        __m256i scales;
        KQ(unpack_scales)(x[i].scales, &mins, &scales);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)x[i].qh);
        __m256i hmask = mone;
        __m256i scale_0[4], scale_1[4], q5_0[4], q5_1[4];
        for (int j = 0; j < 4; j++) {
            scale_0[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 1) << 8 | (4 * j))));
            scale_1[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * j));
            const __m256i h0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), 2 * j), 4);
            q5_0[j] = _mm256_add_epi8(_mm256_and_si256(bits, m4), h0);
            hmask = _mm256_slli_epi16(hmask, 1);
            const __m256i h1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), 2 * j + 1), 4);
            q5_1[j] = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1);
            hmask = _mm256_slli_epi16(hmask, 1);
        }
        for (int c = 0; c < cols; c++) {
            const block_q8_K *b = y[c] + i;
            const float d = b->d * xd;
            const float dmin = -b->d * xdmin;
            const __m128i prod = KQ(mins_product)(mins, b);
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
            summs[c] += dmin * _mm_extract_epi32(hsum, 0);
            const __m256i sumi = KQ(scaled_sums)(scale_0, scale_1, q5_0, q5_1, b);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < cols; c++) {
        out[c * stride] = KQ(hsum_float_8)(acc[c]) + summs[c];
    }
}
