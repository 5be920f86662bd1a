// Token embedding fused with the first RMSNorm of a decode step: row b of the output is the
// embedding row of token ids[b], and its RMSNorm with the first block's gain.
//
// Entry point:
//   embed_rms_norm_bf16  one CTA per row: x_out[b] = table[ids[b]] (bf16, copied exactly),
//                        normed_out[b] = x * rsqrt(mean(x^2) + eps) * gamma (f32 math, rounded
//                        once). An id outside the vocabulary gives a zero row (and a zero norm).

#include "ptx.cuh"

struct EmbedParams {
    const u32* ids;       // [rows]
    const u16* table;     // [vocab, hidden] bf16
    const u16* gamma;     // [hidden] bf16
    u16* x_out;           // [rows, hidden] bf16
    u16* normed_out;      // [rows, hidden] bf16
    u32 rows, hidden, vocab;
    float eps;
};
static_assert(sizeof(EmbedParams) == 56, "EmbedParams layout");

constexpr int EMBED_THREADS = 256;

extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embed_rms_norm_bf16(const EmbedParams p) {
    const u32 b = blockIdx.x;
    if (b >= p.rows) return;
    const u32 id = p.ids[b];
    const bool valid = id < p.vocab;
    const u16* src = p.table + u64(valid ? id : 0) * p.hidden;
    u16* x = p.x_out + u64(b) * p.hidden;
    u16* out = p.normed_out + u64(b) * p.hidden;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < p.hidden; i += EMBED_THREADS) {
        const u16 v = valid ? src[i] : u16(0);
        x[i] = v;
        const float f = bf16_lo(v);
        ss += f * f;
    }
    __shared__ float partial[EMBED_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < EMBED_THREADS / 32; ++w) total += partial[w];
    const float inv = rsqrtf(total / float(p.hidden) + p.eps);
    for (u32 i = threadIdx.x; i < p.hidden; i += EMBED_THREADS) {
        const float f = valid ? bf16_lo(src[i]) : 0.0f;
        out[i] = to_bf16(f * inv * bf16_lo(p.gamma[i]));
    }
}
