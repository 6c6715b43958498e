// y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]: fp32 rows times bf16 weights, fp32 arithmetic, on AVX2 + FMA.
// The weight is blocked as [N/16][K][16] bf16 (w16[b][k][j] = w[16 b + j][k]) so one pass reads it once,
// whatever the row count: each 16-column block is multiplied with every row while it sits in cache.
#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_bf16x8(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Row i of a tile: its value at k, broadcast, times the block's two weight vectors, into its two accumulators.
#define ROW(i)                                                \
    if constexpr (MR > i) {                                   \
        const __m256 v = _mm256_broadcast_ss(x + i * K + k);  \
        a##i = _mm256_fmadd_ps(v, w0, a##i);                  \
        b##i = _mm256_fmadd_ps(v, w1, b##i);                  \
    }

// One 16-column block times MR (1-6) rows of x (each K long). The accumulators are named variables, not an array:
// GCC kept an array's 12 registers but also stored them to the stack on every step of k, which halved the speed.
template <int MR>
static inline void block(const float* x, const uint16_t* wb, int64_t K, const float* bias, float* y, int64_t ldy,
                         int64_t cols) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
    for (int64_t k = 0; k < K; ++k) {
        const __m256 w0 = load_bf16x8(wb + 16 * k), w1 = load_bf16x8(wb + 16 * k + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    const __m256 acc[6][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
    float out[16];
    for (int m = 0; m < MR; ++m) {
        _mm256_storeu_ps(out, acc[m][0]);
        _mm256_storeu_ps(out + 8, acc[m][1]);
        for (int64_t j = 0; j < cols; ++j) y[m * ldy + j] = out[j] + (bias ? bias[j] : 0.0f);
    }
}
#undef ROW

// A tile of mr rows: the template instance for mr (the row count must be a compile-time constant there).
static inline void tile(int64_t mr, const float* x, const uint16_t* wb, int64_t K, const float* bias, float* y,
                        int64_t N, int64_t cols) {
    switch (mr) {
        case 6: block<6>(x, wb, K, bias, y, N, cols); break;
        case 5: block<5>(x, wb, K, bias, y, N, cols); break;
        case 4: block<4>(x, wb, K, bias, y, N, cols); break;
        case 3: block<3>(x, wb, K, bias, y, N, cols); break;
        case 2: block<2>(x, wb, K, bias, y, N, cols); break;
        case 1: block<1>(x, wb, K, bias, y, N, cols); break;
        default: break;
    }
}

// Rows go in tiles of at most 6, as even as possible (8 rows: 4 + 4, not 6 + 2): a tile of r rows keeps 2 r
// FMA chains in flight, and fewer than ~8 chains leave the FMA units waiting on their latency.
extern "C" void bf16_linear(const float* x, int64_t M, int64_t K, const uint16_t* w16, int64_t N,
                            const float* bias, float* y, int threads) {
    const int64_t blocks = (N + 15) / 16, tiles = (M + 5) / 6;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* wb = w16 + b * K * 16;
        const int64_t n0 = 16 * b, cols = N - n0 < 16 ? N - n0 : 16;
        const float* bb = bias ? bias + n0 : nullptr;
        for (int64_t t = 0, m = 0; t < tiles; ++t) {
            const int64_t mr = M / tiles + (t < M % tiles ? 1 : 0);
            tile(mr, x + m * K, wb, K, bb, y + m * N + n0, N, cols);
            m += mr;
        }
    }
}
