// The E4M3 rows the FP8 prefill GEMM reads: one CTA per row of a bf16 matrix, two passes over
// the row (the second from L1/L2).
//
//   quantize_rows_e4m3_bf16:  codes = e4m3(x * (448 / amax(x))), scale = amax(x) / 448
//   with p.normalize:         the row is RMSNorm's input; the normalized row x * r
//                             (r = rsqrt(mean(x^2) + eps), the gain folded into the weights
//                             that read it) has the same codes, since the per-row scale cancels
//                             r, and scale = amax(x) r / 448. So no normalized row is written.
//
// An all-zero row gets zero codes and scale 1 (stoke_formats::fp8::scale_for). The codes are
// bit-exact against stoke_formats::fp8::quantize_rows_fused (the same f32 operations, rounded
// to nearest even, saturating); the scale's sum of squares is summed in another order.
// Needs x 16-byte aligned, k a multiple of 8 and the row pitch ldx (elements) a multiple of 8.

#include "ptx.cuh"

constexpr int THREADS = 256;

struct Fp8RowsParams {
    const u16* x;    // [rows, ldx] bf16
    u8* codes;       // [rows, k] E4M3
    float* scales;   // [rows]
    u32 rows, k, ldx;
    float eps;
    u32 normalize;   // 1: the scale carries RMSNorm's row factor
    u32 pad;
};
static_assert(sizeof(Fp8RowsParams) == 48, "Fp8RowsParams layout");

extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_e4m3_bf16(const Fp8RowsParams p) {
    __shared__ float red[2][THREADS / 32];
    for (u32 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const u16* x = p.x + u64(row) * p.ldx;
        float amax = 0.0f, ss = 0.0f;
        for (u32 i = threadIdx.x * 8; i < p.k; i += THREADS * 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(x + i);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float a = bf16_lo(w[j]), b = bf16_hi(w[j]);
                amax = fmaxf(amax, fmaxf(fabsf(a), fabsf(b)));
                ss = fmaf(a, a, fmaf(b, b, ss));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        }
        if (threadIdx.x % 32 == 0) {
            red[0][threadIdx.x / 32] = amax;
            red[1][threadIdx.x / 32] = ss;
        }
        __syncthreads();
        amax = 0.0f;
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) {
            amax = fmaxf(amax, red[0][w]);
            ss += red[1][w];
        }
        __syncthreads();  // red is reused by the next row
        const float inv = amax > 0.0f ? __fdiv_rn(448.0f, amax) : 1.0f;
        if (threadIdx.x == 0) {
            const float r = p.normalize ? rsqrtf(ss / float(p.k) + p.eps) : 1.0f;
            p.scales[row] = amax > 0.0f ? amax * r / 448.0f : 1.0f;
        }
        u8* out = p.codes + u64(row) * p.k;
        for (u32 i = threadIdx.x * 8; i < p.k; i += THREADS * 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(x + i);
            const u32 w[4] = {v.x, v.y, v.z, v.w};
            u32 c[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const u32 lo = e4m3x2(__fmul_rn(bf16_lo(w[2 * j]), inv), __fmul_rn(bf16_hi(w[2 * j]), inv));
                const u32 hi = e4m3x2(__fmul_rn(bf16_lo(w[2 * j + 1]), inv), __fmul_rn(bf16_hi(w[2 * j + 1]), inv));
                c[j] = lo | (hi << 16);
            }
            *reinterpret_cast<uint2*>(out + i) = make_uint2(c[0], c[1]);
        }
    }
}
