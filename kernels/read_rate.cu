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

typedef unsigned int u32;
typedef unsigned long long u64;

struct ReadRateParams {
    const uint4* src;
    u64 words;
    u32* out;
    u32 never;
    u32 pad;
};
static_assert(sizeof(ReadRateParams) == 32, "ReadRateParams layout");

__device__ __forceinline__ uint4 load_stream(const uint4* p, u64 policy) {
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
        for (int j = 0; j < U; ++j) v[j] = load_stream(p.src + i + u64(j) * stride, policy);
#pragma unroll
        for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < end; i += stride) {
        const uint4 v = load_stream(p.src + i, policy);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == p.never) p.out[u64(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256) read_rate_cta_u4(const ReadRateParams p) { read_rate<4, false>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_cta_u8(const ReadRateParams p) { read_rate<8, false>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_warp_u4(const ReadRateParams p) { read_rate<4, true>(p); }
extern "C" __global__ void __launch_bounds__(256) read_rate_warp_u8(const ReadRateParams p) { read_rate<8, true>(p); }
