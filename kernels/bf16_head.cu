// The output head for decode-sized row counts: logits = x W^T with x bf16 [m, k] (m <= 32 per
// launch) and W bf16 [n, k] row-major, one row of k weights per output column (the layout a
// checkpoint stores an LM head or a tied embedding in); f32 accumulation, bf16 logits [m, n]
// rounded once.
//
// The kernel is bound by the stream of W (Llama-3.1-8B's head: 128256 rows of 4096, 1.05 GB),
// read once for all rows of x, so each warp streams whole rows of W, front to back, with many
// loads in flight and nothing else to wait for: no shared memory, no split-K, no reduction
// between warps.
//
// Entry points bf16_head_mROWS_sSW_pP_rR (ROWS 8, 16 or 32: the most rows of x the launch
// takes, NT = ROWS / 8 n-tiles of the mma; SW, P and R below) take `Bf16HeadParams` by value. block = (128, 1, 1) (4 warps);
// grid = (ceil(warps / 4), 1, 1).
//
// Work: a unit is SW strips of 16 output columns (16 SW rows of W) over all of k. Warp w takes
// units [w * units_per_warp, (w + 1) * units_per_warp) (clipped to the ceil(n / 16 SW) units);
// the host picks units_per_warp so that every warp is resident at once. A warp's (unit, step)
// items form one stream: its load ring runs across unit boundaries without draining.
//
// The mma (m16n8k16, bf16 in, f32 accumulate) with the operands swapped, C^T = W x^T: a strip's
// 16 columns are the A operand's rows, 8 rows of x (n-tile nt: rows 8 nt .. 8 nt + 7) its N
// dimension. A step covers 32 P values of k; lane (g, t) (g = lane / 4, t = lane % 4) loads the
// 8 P consecutive values [8 P t, 8 P t + 8 P) of the step from W's rows g and g + 8 of each
// strip and from x's row 8 nt + g of each n-tile (P 16-byte loads per row). Word pair (2j,
// 2j + 1) of piece p is one mma k16 slice: its logical k (2t, 2t + 1, 2t + 8, 2t + 9) are the
// physical values 8 P t + 8 p + 4 j + (0, 1, 2, 3), so A = (row g word 2j, row g + 8 word 2j,
// row g word 2j + 1, row g + 8 word 2j + 1) and B = (x word 2j, x word 2j + 1), straight from the
// loads. The permutation is the same on both sides, so the sum is unchanged. C of (strip s,
// n-tile nt): c0 / c1 = column 16 s + g, rows 8 nt + 2t / + 1; c2 / c3 = column 16 s + g + 8.
//
// Loads: a ring of R items per warp in registers; the slot an item's mma have read is refilled
// with the item R ahead. W is read with ld.global.nc, no L1 allocation and an L2 evict-first
// policy (read once); x, which the previous kernel writes and every warp reads, with
// ld.global.cg after griddepcontrol.wait (an L2 hit).
//
// Requirements (checked by the host): 1 <= m <= ROWS, k a positive multiple of 8 (whole 16-byte
// pieces; a partial last step is zero-filled), n >= 1; W and x 16-byte aligned, out 2-byte
// aligned. Columns past n read row n - 1 of W and rows past m read row m - 1 of x (finite
// values); their results are never stored.
//
// Programmatic dependent launch (NAME_pdl = 1): each CTA lets the next kernel launch at once,
// queues its first R items' weights (no kernel on Stoke's stream writes weights) and waits for
// the previous kernel (griddepcontrol.wait) before it reads x or writes anything.

#include "ptx.cuh"

struct Bf16HeadParams {
    const u16* x;        // [m, k] bf16, row-major
    const u16* w;        // [n, k] bf16, row-major
    u16* out;            // [m, n] bf16
    u32 m, k, n;
    u32 units_per_warp;  // units (SW strips of 16 columns) per warp
};
static_assert(sizeof(Bf16HeadParams) == 40, "Bf16HeadParams layout");

namespace bf16_head {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;

// 16 bytes the previous kernel wrote, after griddepcontrol.wait (coherent, through the L2; the
// asm stays after the wait).
__device__ __forceinline__ uint4 load_after_wait(const u16* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <int NT, int SW, int P, int R>
__device__ __forceinline__ void head(const Bf16HeadParams& p) {
    constexpr u32 COLS = 16 * SW, STEP = 32 * P;
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const u32 units = (p.n + COLS - 1) / COLS;
    const u32 u_begin = u32(min(u64(warp) * p.units_per_warp, u64(units)));
    const u32 u_end = min(u_begin + p.units_per_warp, units);
    const u32 steps = (p.k + STEP - 1) / STEP;
    const u32 total = (u_end - u_begin) * steps;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    griddep_launch_dependents();

    // This lane's first k of a step, and its rows of x (rows past m read row m - 1).
    const u32 k_lane = 8 * P * t;
    const u16* xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xrow[nt] = p.x + u64(min(u32(8 * nt) + g, p.m - 1)) * p.k + k_lane;

    // The load cursor: the next item's unit and step, and its rows of W.
    u32 load_unit = u_begin, load_step = 0, x_step = 0;
    const u16* wrow[SW][2];
    auto rows_of = [&](u32 unit) {
#pragma unroll
        for (int s = 0; s < SW; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 col = min(unit * COLS + u32(16 * s + 8 * h) + g, p.n - 1);
                wrow[s][h] = p.w + u64(col) * p.k + k_lane;
            }
    };
    rows_of(load_unit);

    uint4 wr[R][SW][2][P], xr[R][NT][P];
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto load_w = [&](uint4 (&slot)[SW][2][P]) {
        const u32 k0 = load_step * STEP;
#pragma unroll
        for (int pp = 0; pp < P; ++pp) {
            const bool in = k0 + k_lane + 8 * pp < p.k;
#pragma unroll
            for (int s = 0; s < SW; ++s)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    slot[s][h][pp] = in ? load_stream(reinterpret_cast<const uint4*>(wrow[s][h] + k0 + 8 * pp), policy) : zero;
        }
        if (++load_step == steps) {
            load_step = 0;
            rows_of(++load_unit < u_end ? load_unit : u_begin);
        }
    };
    auto load_x = [&](uint4 (&slot)[NT][P]) {
        const u32 k0 = x_step * STEP;
#pragma unroll
        for (int pp = 0; pp < P; ++pp) {
            const bool in = k0 + k_lane + 8 * pp < p.k;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) slot[nt][pp] = in ? load_after_wait(xrow[nt] + k0 + 8 * pp) : zero;
        }
        if (++x_step == steps) x_step = 0;
    };

    // The first R items' weights, then (after the previous kernel) their x.
#pragma unroll
    for (int i = 0; i < R; ++i)
        if (u32(i) < total) load_w(wr[i]);
    griddep_wait();
#pragma unroll
    for (int i = 0; i < R; ++i)
        if (u32(i) < total) load_x(xr[i]);

    float acc[SW][NT][4];
#pragma unroll
    for (int s = 0; s < SW; ++s)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[s][nt][c] = 0.0f;
    u32 unit = u_begin, step = 0;

    for (u32 q = 0; q < total; q += R) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (q + i >= total) break;
#pragma unroll
            for (int pp = 0; pp < P; ++pp)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int s = 0; s < SW; ++s) {
                        const uint4& lo = wr[i][s][0][pp];
                        const uint4& hi = wr[i][s][1][pp];
                        const u32 a0 = word(lo, 2 * j), a1 = word(hi, 2 * j);
                        const u32 a2 = word(lo, 2 * j + 1), a3 = word(hi, 2 * j + 1);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            mma_m16n8k16<false>(acc[s][nt], a0, a1, a2, a3, word(xr[i][nt][pp], 2 * j),
                                                word(xr[i][nt][pp], 2 * j + 1));
                    }
            if (q + i + R < total) {
                load_w(wr[i]);
                load_x(xr[i]);
            }
            if (++step == steps) {
                // The unit's logits, rounded once.
#pragma unroll
                for (int s = 0; s < SW; ++s)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const u32 col = unit * COLS + u32(16 * s + 8 * (c >> 1)) + g;
                            const u32 row = u32(8 * nt) + 2 * t + (c & 1);
                            if (row < p.m && col < p.n) p.out[u64(row) * p.n + col] = to_bf16(acc[s][nt][c]);
                            acc[s][nt][c] = 0.0f;
                        }
                step = 0;
                ++unit;
            }
        }
    }
}

}  // namespace bf16_head

#define BF16_HEAD_ENTRY(NAME, ROWS, SW, P, R, MIN_CTAS)                                              \
    extern "C" __device__ unsigned NAME##_pdl = 1;                                                   \
    extern "C" __global__ void __launch_bounds__(bf16_head::THREADS, MIN_CTAS) NAME(const Bf16HeadParams p) { \
        bf16_head::head<ROWS / 8, SW, P, R>(p);                                                      \
    }

// bf16_head_mROWS_sSW_pP_rR: up to ROWS rows, SW strips per unit, P 16-byte pieces per row and
// step, a ring of R steps; the last argument is the CTAs per SM of the launch bounds. The plan
// (crates/stoke-cuda/src/kernels/bf16_head.rs) picks among them.
BF16_HEAD_ENTRY(bf16_head_m8_s1_p2_r4, 8, 1, 2, 4, 4)
BF16_HEAD_ENTRY(bf16_head_m8_s2_p2_r3, 8, 2, 2, 3, 3)
BF16_HEAD_ENTRY(bf16_head_m16_s2_p1_r4, 16, 2, 1, 4, 3)
BF16_HEAD_ENTRY(bf16_head_m32_s4_p1_r2, 32, 4, 1, 2, 2)
