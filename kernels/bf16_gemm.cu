// Dense bf16 GEMM for decode-sized row counts: y = x W with x bf16 [m, k] (m <= 32), W bf16
// [k, n] row-major (Burn's Linear layout, used in place), f32 accumulation, bf16 output rounded
// once, with a fused epilogue:
//   EPI  plain     out[r, c] = acc[r, c]
//        residual  out[r, c] = acc[r, c] + residual[r, c]          (sum in f32, rounded once)
//        swiglu    out[r, j] = silu(acc[r, 2j]) * acc[r, 2j + 1]   (gate/up interleaved; out is
//                                                                    [m, n / 2])
// At these sizes the kernel is bound by the stream of W: every weight byte is read once (for all
// rows together) at as close to the HBM copy rate as the grid allows.
//
// Entry points bf16_gemm_EPI_mROWS_LAYOUT (each takes `Bf16GemmParams` by value):
//   ROWS    8, 16 or 32: the most rows of x the launch takes (NT = ROWS / 8 n-tiles of the mma).
//   LAYOUT  wide  the CTA's 4 warps side by side along n: 256 columns per CTA, all warps on the
//                 same k range (they read the same x). For wide matrices.
//           deep  the 4 warps along k on the same 64 columns (reduced through shared memory):
//                 64 columns per CTA, 4x the CTAs of `wide`, a quarter of the partial sums per
//                 split. For narrow matrices, where `wide` would need many k splits.
// block = (128, 1, 1); grid = (ceil(n / (64 * WN)), splits, 1) with WN = 4 (wide) or 1 (deep).
// Split s of a column block covers k-steps [s * split_steps, (s + 1) * split_steps) of the
// ceil(k / 32) steps of 32 rows; warp wk of the WK = 4 / WN warps along k takes steps
// first + wk, first + wk + WK, ... of its split.
//
// The mma (m16n8k16, bf16 in, f32 accumulate) with the operands swapped, C^T = W^T x^T: 16 weight
// columns are the A operand's rows and 8 rows of x its N dimension, so one row of x uses one
// n-tile and nothing is wasted at m = 1..8. The fragments need no transpose: a k-step of 32 rows
// is permuted so that lane (g, t) (g = lane / 4, t = lane % 4) holds physical rows 8t .. 8t + 7
// of it, the two k16 halves j = 0, 1 taking rows 8t + 4j .. 8t + 4j + 3 as the logical k
// (2t, 2t + 1, 2t + 8, 2t + 9). The same permutation applies to x, so the sum is unchanged.
// Each lane loads, per k-step, 16 bytes (columns 8g .. 8g + 7 of its 64-column strip) of each of
// its 8 rows: a warp reads 4 rows x 128 contiguous bytes per load. Word q of row r holds columns
// 8g + 2q, 8g + 2q + 1; A tile q (16 logical columns: logical column i < 8 is physical 8i + 2q,
// i >= 8 is 8(i - 8) + 2q + 1) is a0 = lo halves of rows (4j, 4j + 1), a1 = hi halves of the
// same, a2 / a3 the same of rows (4j + 2, 4j + 3): one PRMT each. The lane's x fragment of
// n-tile nt is row 8 nt + g, k 8t .. 8t + 7 of the step: 16 contiguous bytes, b0 / b1 = words
// (2j, 2j + 1). C of tile (nt, q): c0 / c2 = row 8 nt + 2t, columns 8g + 2q / + 1; c1 / c3 =
// row 8 nt + 2t + 1, the same columns.
//
// Loads: each thread streams its own 16-byte pieces through a private STAGES-slot ring in shared
// memory with cp.async (W with an L2 evict-first policy; x through L1, shared by the warps and
// CTAs that read it), STAGES - 1 k-steps in flight; every thread reads back only what it copied.
// The pieces of one (slot, piece) across the CTA are contiguous, so the copies and the 16-byte
// reads back are free of bank conflicts.
//
// Reduction and epilogue: the warps' sums go to a shared tile [WK][ROWS][64 WN] (reusing the
// ring), and each thread takes items of (row, 4 columns), adding the WK values in order. With
// one split it applies the epilogue. With splits > 1 every CTA writes its items to
// workspace[split] (f32 [splits, m, n]) and counts itself in counters[column block] (zero on
// entry); the last CTA of the column block to arrive adds the splits' values in split order
// (deterministic: the result does not depend on which CTA finishes last), applies the epilogue,
// and puts the counter back to zero. No atomics touch the output.
//
// Requirements (checked by the host): 1 <= m <= ROWS, k % 8 == 0, n % 8 == 0; W 16-byte aligned,
// x and residual 4-byte aligned, out 8-byte aligned (4 for swiglu), workspace 16-byte aligned.
// A k not a multiple of 32 ends on a partial step, zero-filled in W and x. Columns past n of the
// last column block read column 0 (finite values; their results are never stored).
//
// Programmatic dependent launch (NAME_pdl = 1): each CTA lets the next kernel launch at once,
// queues the weight copies of its first STAGES - 1 steps (no kernel on Stoke's stream writes
// weights) and waits for the previous kernel (griddepcontrol.wait) before it reads x or writes
// anything. NAME_dyn_smem: the dynamic shared memory every launch needs.

#include "ptx.cuh"

struct Bf16GemmParams {
    const u16* x;         // [m, k] bf16, row-major
    const u16* w;         // [k, n] bf16, row-major
    u16* out;             // [m, n] bf16 ([m, n / 2] for swiglu)
    const u16* residual;  // [m, n] bf16 (residual entry points), else null
    float* workspace;     // [splits, m, n] f32 (splits > 1), else null
    u32* counters;        // [gridDim.x] zeros, left zeroed (splits > 1), else null
    u32 m, k, n;
    u32 splits;           // gridDim.y
    u32 split_steps;      // k-steps of 32 rows per split
};
static_assert(sizeof(Bf16GemmParams) == 72, "Bf16GemmParams layout");

namespace bf16_gemm {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
// k rows per step: two mma k16 halves, 16 bytes of x per lane and n-tile.
constexpr int STEP_K = 32;
// Ring slots per thread: STAGES - 1 steps in flight (3 x 16 KB of weights per CTA).
constexpr int STAGES = 4;
// Columns per warp: 8 lanes x 8 columns (16 bytes).
constexpr int WARP_COLS = 64;
// Weight rows per lane and step (one 16-byte piece each).
constexpr int W_PIECES = 8;
// Float padding of the reduction tile's rows (keeps 16-byte alignment).
constexpr int RED_PAD = 4;

enum { EPI_PLAIN = 0, EPI_RESIDUAL = 1, EPI_SWIGLU = 2 };

// 16-byte pieces per thread and ring slot: the weight rows, then one x piece per n-tile.
__host__ __device__ constexpr int pieces(int nt) { return W_PIECES + nt; }
__host__ __device__ constexpr unsigned ring_bytes(int nt) { return STAGES * pieces(nt) * 16 * THREADS; }
// The reduction tile [WK][8 NT][64 WN + RED_PAD] floats, WK * WN = WARPS.
__host__ __device__ constexpr unsigned red_bytes(int nt, int wn) {
    return (WARPS / wn) * 8 * nt * (WARP_COLS * wn + RED_PAD) * 4;
}
__host__ __device__ constexpr unsigned dyn_smem(int nt, int wn) {
    return ring_bytes(nt) > red_bytes(nt, wn) ? ring_bytes(nt) : red_bytes(nt, wn);
}
// Resident CTAs per SM the launch bounds ask for: what the shared memory allows (228 KB per SM,
// 1 KB of it reserved per CTA).
__host__ __device__ constexpr int min_ctas(int nt) { return int((228u << 10) / (dyn_smem(nt, 1) + 1024)); }

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Partial sums other CTAs wrote (L2 only: no stale L1 line).
__device__ __forceinline__ float4 load_cg4(const float* p) {
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

// The epilogue of columns c .. c + 3 of row r (c a multiple of 4, c + 3 < n).
template <int EPI>
__device__ __forceinline__ void store4(const Bf16GemmParams& p, u32 r, u32 c, float4 v) {
    if (EPI == EPI_SWIGLU) {
        u32* out = reinterpret_cast<u32*>(p.out + u64(r) * (p.n / 2) + c / 2);
        *out = pack_bf16x2(silu(v.x) * v.y, silu(v.z) * v.w);
        return;
    }
    const u64 at = u64(r) * p.n + c;
    if (EPI == EPI_RESIDUAL) {
        const u32* res = reinterpret_cast<const u32*>(p.residual + at);
        const u32 r0 = res[0], r1 = res[1];
        v.x += bf16_lo(r0);
        v.y += bf16_hi(r0);
        v.z += bf16_lo(r1);
        v.w += bf16_hi(r1);
    }
    *reinterpret_cast<uint2*>(p.out + at) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
}

template <int EPI, int NT, int WN>
__device__ __forceinline__ void gemm(const Bf16GemmParams& p, unsigned char* smem) {
    constexpr int WK = WARPS / WN;
    constexpr int BN = WARP_COLS * WN;
    constexpr int PIECES = pieces(NT);
    constexpr int ROWS = 8 * NT;
    constexpr int PITCH = BN + RED_PAD;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 wn = warp % WN, wk = warp / WN;

    // PDL: the next kernel on the stream may start launching now; its CTAs take SM slots as
    // this grid's CTAs exit and wait before touching what this one writes.
    griddep_launch_dependents();

    // The lane's 8 columns; past n, column 0 (read, never stored).
    const u32 col = blockIdx.x * BN + wn * WARP_COLS + 8 * g;
    const u32 wcol = col < p.n ? col : 0;
    // The warp's k-steps: first, first + WK, ... below s_end; `count` of them.
    const u32 steps = (p.k + STEP_K - 1) / STEP_K;
    const u32 s_begin = blockIdx.y * p.split_steps;
    const u32 s_end = min(steps, s_begin + p.split_steps);
    const u32 first = s_begin + wk;
    const u32 count = first < s_end ? (s_end - first + WK - 1) / WK : 0;

    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const u32 ring = smem_u32(smem) + tid * 16;
    auto slot = [&](u32 stage, int piece) -> u32 { return ring + (stage * PIECES + piece) * (THREADS * 16); };
    // Rows 8t .. 8t + 7 of the warp's i-th step, into ring slot i % STAGES.
    auto copy_w = [&](u32 i) {
        const u32 stage = i % STAGES;
        const u32 k0 = (first + i * WK) * STEP_K + 8 * t;
        if (k0 < p.k) {
            const u16* src = p.w + u64(k0) * p.n + wcol;
#pragma unroll
            for (int r = 0; r < W_PIECES; ++r) cp_async16_stream(slot(stage, r), src + u64(r) * p.n, policy);
        } else {
#pragma unroll
            for (int r = 0; r < W_PIECES; ++r) cp_async16(slot(stage, r), p.w, 0);  // zeros
        }
    };
    auto copy_x = [&](u32 i) {
        const u32 stage = i % STAGES;
        const u32 k0 = (first + i * WK) * STEP_K + 8 * t;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 row = 8 * nt + g;
            const bool ok = row < p.m && k0 < p.k;
            cp_async16_by4(slot(stage, W_PIECES + nt), p.x + (ok ? u64(row) * p.k + k0 : 0), ok ? 16 : 0);
        }
    };

    float acc[NT][4][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[nt][q][c] = 0.0f;

    // The first STAGES - 1 steps' weights, then (after the previous kernel) their x; one
    // commit group per step.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (u32(s) < count) copy_w(s);
    griddep_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (u32(s) < count) copy_x(s);
        cp_async_commit();
    }
    for (u32 i = 0; i < count; ++i) {
        // Step i + STAGES - 1 goes out into the slot step i - 1 used (read back last iteration),
        // then step i is waited for.
        __syncwarp();
        const u32 ahead = i + STAGES - 1;
        if (ahead < count) {
            copy_w(ahead);
            copy_x(ahead);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u32 stage = i % STAGES;
        uint4 wv[W_PIECES];
#pragma unroll
        for (int r = 0; r < W_PIECES; ++r) wv[r] = lds128(slot(stage, r));
        uint4 xv[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) xv[nt] = lds128(slot(stage, W_PIECES + nt));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint4& r0 = wv[4 * j], &r1 = wv[4 * j + 1], &r2 = wv[4 * j + 2], &r3 = wv[4 * j + 3];
            const u32 w0[4] = {r0.x, r0.y, r0.z, r0.w}, w1[4] = {r1.x, r1.y, r1.z, r1.w};
            const u32 w2[4] = {r2.x, r2.y, r2.z, r2.w}, w3[4] = {r3.x, r3.y, r3.z, r3.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 a0 = __byte_perm(w0[q], w1[q], 0x5410), a1 = __byte_perm(w0[q], w1[q], 0x7632);
                const u32 a2 = __byte_perm(w2[q], w3[q], 0x5410), a3 = __byte_perm(w2[q], w3[q], 0x7632);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const u32 b0 = j == 0 ? xv[nt].x : xv[nt].z, b1 = j == 0 ? xv[nt].y : xv[nt].w;
                    mma_m16n8k16<false>(acc[nt][q], a0, a1, a2, a3, b0, b1);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every thread is done with its ring: the area is the reduction tile now

    // The warps' sums into red[wk][row][column]: row 8 nt + 2t (c0, c2) and + 1 (c1, c3) of
    // columns 8g + 2q, 8g + 2q + 1 of the warp's strip; tiles q = 0, 1 and 2, 3 as 16 bytes.
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 row = 8 * nt + 2 * t + h;
            float* at = red + (wk * ROWS + row) * PITCH + wn * WARP_COLS + 8 * g;
#pragma unroll
            for (int q = 0; q < 4; q += 2)
                *reinterpret_cast<float4*>(at + 2 * q) =
                    make_float4(acc[nt][q][h], acc[nt][q][2 + h], acc[nt][q + 1][h], acc[nt][q + 1][2 + h]);
        }
    __syncthreads();

    // Items (row, 4 columns) of the CTA's tile, rows below m and columns below n.
    constexpr u32 ITEMS_PER_ROW = BN / 4;
    const u32 col0 = blockIdx.x * BN;
    const u32 items = p.m * ITEMS_PER_ROW;
    auto item_sum = [&](u32 r, u32 c4) -> float4 {
        float4 v = *reinterpret_cast<const float4*>(red + r * PITCH + 4 * c4);
#pragma unroll
        for (int w = 1; w < WK; ++w) {
            const float4 u = *reinterpret_cast<const float4*>(red + (w * ROWS + r) * PITCH + 4 * c4);
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        return v;
    };
    if (p.splits == 1) {
        for (u32 i = tid; i < items; i += THREADS) {
            const u32 r = i / ITEMS_PER_ROW, c4 = i % ITEMS_PER_ROW, c = col0 + 4 * c4;
            if (c < p.n) store4<EPI>(p, r, c, item_sum(r, c4));
        }
        return;
    }
    // Split-K: this split's values to the workspace, then the last CTA of the column block adds
    // every split's in order.
    const u64 split_stride = u64(p.m) * p.n;
    for (u32 i = tid; i < items; i += THREADS) {
        const u32 r = i / ITEMS_PER_ROW, c4 = i % ITEMS_PER_ROW, c = col0 + 4 * c4;
        if (c < p.n)
            *reinterpret_cast<float4*>(p.workspace + blockIdx.y * split_stride + u64(r) * p.n + c) = item_sum(r, c4);
    }
    __shared__ u32 last_cta;
    __threadfence();
    __syncthreads();
    if (tid == 0) last_cta = atomicAdd(p.counters + blockIdx.x, 1u) == p.splits - 1;
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    for (u32 i = tid; i < items; i += THREADS) {
        const u32 r = i / ITEMS_PER_ROW, c4 = i % ITEMS_PER_ROW, c = col0 + 4 * c4;
        if (c >= p.n) continue;
        const float* ws = p.workspace + u64(r) * p.n + c;
        float4 v = load_cg4(ws);
        for (u32 s = 1; s < p.splits; ++s) {
            const float4 u = load_cg4(ws + s * split_stride);
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        store4<EPI>(p, r, c, v);
    }
    if (tid == 0) p.counters[blockIdx.x] = 0;
}

}  // namespace bf16_gemm

extern __shared__ __align__(128) unsigned char bf16_gemm_smem[];

// One entry point and the globals the runtime reads for it (see the top of this file).
#define BF16_GEMM_ENTRY(EPI_NAME, EPI, ROWS, LAYOUT, WN)                                                          \
    extern "C" __device__ unsigned bf16_gemm_##EPI_NAME##_m##ROWS##_##LAYOUT##_pdl = 1;                           \
    extern "C" __device__ unsigned bf16_gemm_##EPI_NAME##_m##ROWS##_##LAYOUT##_dyn_smem =                         \
        bf16_gemm::dyn_smem(ROWS / 8, WN);                                                                        \
    extern "C" __global__ void __launch_bounds__(bf16_gemm::THREADS, bf16_gemm::min_ctas(ROWS / 8))                \
        bf16_gemm_##EPI_NAME##_m##ROWS##_##LAYOUT(const Bf16GemmParams p) {                                      \
        bf16_gemm::gemm<EPI, ROWS / 8, WN>(p, bf16_gemm_smem);                                                   \
    }
#define BF16_GEMM_LAYOUTS(EPI_NAME, EPI, ROWS)      \
    BF16_GEMM_ENTRY(EPI_NAME, EPI, ROWS, wide, 4)   \
    BF16_GEMM_ENTRY(EPI_NAME, EPI, ROWS, deep, 1)
#define BF16_GEMM_ENTRIES(EPI_NAME, EPI)        \
    BF16_GEMM_LAYOUTS(EPI_NAME, EPI, 8)         \
    BF16_GEMM_LAYOUTS(EPI_NAME, EPI, 16)        \
    BF16_GEMM_LAYOUTS(EPI_NAME, EPI, 32)

BF16_GEMM_ENTRIES(plain, bf16_gemm::EPI_PLAIN)
BF16_GEMM_ENTRIES(residual, bf16_gemm::EPI_RESIDUAL)
BF16_GEMM_ENTRIES(swiglu, bf16_gemm::EPI_SWIGLU)
