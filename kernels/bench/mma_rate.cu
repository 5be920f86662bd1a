// Tensor-core rate of mma.sync.m16n8k16 (bf16 in, f32 accumulation): the instruction the W4A16
// kernels are built on, measured in the same run as they are, as the compute side of their
// roofline (the copy rate is the memory side). A benchmark ceiling, not a product kernel.
//
// Entry points mma_rate_cCHAINS: every warp runs `iters` rounds of CHAINS mma into CHAINS
// independent accumulators (c8: throughput with 4 warps per CTA and several CTAs per SM; c1: one
// dependent chain, whose time per round is the instruction's latency). Block = (128, 1, 1).
// The accumulators are written to out[global thread] only if their sum equals `never`, so the
// work stays and nothing is stored.

#include "ptx.cuh"

struct MmaRateParams {
    float* out;
    u32 iters;
    float never;
};
static_assert(sizeof(MmaRateParams) == 16, "MmaRateParams layout");

template <int CHAINS>
__device__ __forceinline__ void mma_rate(const MmaRateParams& p) {
    float c[CHAINS][4];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
    // Small bf16 pairs (about 2^-7 .. 2^-6) that differ by lane.
    const u32 lane = threadIdx.x & 31;
    const u32 a0 = 0x3c003c00u + lane, a1 = a0 + 0x10001u, a2 = a0 + 0x20002u, a3 = a0 + 0x30003u;
    const u32 b0 = 0x3c103c10u + lane, b1 = b0 + 0x10001u;
    for (u32 i = 0; i < p.iters; ++i) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) s += (c[j][0] + c[j][1]) + (c[j][2] + c[j][3]);
    if (s == p.never) p.out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(128) mma_rate_c8(const MmaRateParams p) { mma_rate<8>(p); }
extern "C" __global__ void __launch_bounds__(128) mma_rate_c1(const MmaRateParams p) { mma_rate<1>(p); }
