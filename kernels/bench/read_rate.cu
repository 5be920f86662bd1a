// HBM read rate of one launch streaming a buffer once: the memory side of the roofline of the
// W4A16 kernels at one row, which read their weights once and write almost nothing (a
// device-to-device copy reads half of the bytes it moves and writes the other half). Measured in
// the same run as the kernels, for the same byte counts. A benchmark ceiling, not a product kernel.
//
// Entry points read_rate_{cta,warp}_uU: the buffer (`words` 16-byte words) is cut into equal
// contiguous chunks, one per CTA (`cta`) or one per warp (`warp`, the W4A16 kernels' pattern:
// each warp streams its own k range), read with the weights' load (ld.global.nc, no L1
// allocation, L2 evict-first), U loads of 16 bytes in flight per thread. Block: up to 256 threads,
// any grid. The loaded words are XORed and written to out[global thread] only if they equal
// `never`, so the loads stay and nothing is stored.
// read_rate_bulk: the same bytes through the copy engine: one contiguous chunk per CTA, copied
// into a ring of `stages` shared-memory stages of `stage_bytes` each by cp.async.bulk (L2
// evict-first), each stage completing on its own mbarrier and refilled as soon as it has landed.
// One thread issues and waits; the bytes in flight are stages x stage_bytes per CTA, independent
// of registers (the form a kernel staging its tiles through shared memory by the copy engine
// would take). Block: 32 threads; dynamic shared memory stages x stage_bytes + 8 x stages.

#include "ptx.cuh"

struct ReadRateParams {
    const uint4* src;
    u64 words;
    u32* out;
    u32 never;
    u32 stage_bytes;  // read_rate_bulk: bytes per stage (a multiple of 16)
    u32 stages;       // read_rate_bulk: stages in the ring
    u32 pad;
};
static_assert(sizeof(ReadRateParams) == 40, "ReadRateParams layout");

// The weights' 16-byte load (ptx.cuh's load_stream), volatile so that every load is issued as
// written whatever the use of its value.
__device__ __forceinline__ uint4 load_stream_volatile(const uint4* p, u64 policy) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(policy));
    return r;
}

template <int U, bool WARP>
__device__ __forceinline__ void read_rate(const ReadRateParams& p) {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const u32 lane = WARP ? threadIdx.x & 31 : threadIdx.x;
    const u32 stride = WARP ? 32 : blockDim.x;
    const u64 chunk_id = WARP ? u64(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
    const u64 chunks = WARP ? u64(gridDim.x) * (blockDim.x / 32) : gridDim.x;
    const u64 begin = p.words * chunk_id / chunks, end = p.words * (chunk_id + 1) / chunks;
    u32 acc = 0;
    u64 i = begin + lane;
    // Whole rounds of U loads without range checks, then the remainder.
    for (; i + u64(U - 1) * stride < end; i += u64(U) * stride) {
        uint4 v[U];
#pragma unroll
        for (int j = 0; j < U; ++j) v[j] = load_stream_volatile(p.src + i + u64(j) * stride, policy);
#pragma unroll
        for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < end; i += stride) {
        const uint4 v = load_stream_volatile(p.src + i, policy);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == p.never) p.out[u64(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256) read_rate_cta_u4(const ReadRateParams p) { read_rate<4, false>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_cta_u8(const ReadRateParams p) { read_rate<8, false>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_warp_u4(const ReadRateParams p) { read_rate<4, true>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_warp_u8(const ReadRateParams p) { read_rate<8, true>(p); }

// The bulk form's dynamic shared memory is set per launch (stages x stage_bytes + 8 x stages);
// this exported minimum (one stage's mbarrier) marks it as an entry that brings some, so the
// runtime asks for the largest shared-memory carveout when it loads it.
extern "C" __device__ unsigned read_rate_bulk_dyn_smem = 8;
extern __shared__ __align__(128) unsigned char read_rate_smem[];

extern "C" __global__ void __launch_bounds__(32) read_rate_bulk(const ReadRateParams p) {
    if (threadIdx.x != 0) return;
    const u32 stages = p.stages, stage = p.stage_bytes;
    const u64 begin = p.words * blockIdx.x / gridDim.x * 16, end = p.words * (blockIdx.x + 1) / gridDim.x * 16;
    const u64 copies = (end - begin + stage - 1) / stage;
    const u32 base = static_cast<u32>(__cvta_generic_to_shared(read_rate_smem));
    const u32 bars = base + stages * stage;
    for (u32 s = 0; s < stages; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const char* src = reinterpret_cast<const char*>(p.src);
    // Copy i goes to stage i % stages.
    auto issue = [&](u64 i) {
        const u32 s = u32(i % stages), bar = bars + 8 * s;
        const u64 at = begin + i * stage;
        const u32 n = u32(min(u64(stage), end - at));
        mbar_expect_tx(bar, n);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
                base + s * stage),
            "l"(src + at), "r"(n), "r"(bar), "l"(policy)
            : "memory");
    };
    for (u64 i = 0; i < copies && i < stages; ++i) issue(i);
    u32 acc = 0;
    for (u64 i = 0; i < copies; ++i) {
        const u32 s = u32(i % stages);
        mbar_wait(bars + 8 * s, u32(i / stages) & 1);
        // One word of the stage, so the copy is used before its stage is refilled.
        u32 w;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w) : "r"(base + s * stage) : "memory");
        acc ^= w;
        if (i + stages < copies) issue(i + stages);
    }
    if (acc == p.never) p.out[blockIdx.x] = acc;
}
