// W4A16 GEMM for up to 8 rows of x: the swapped-operand kernels (entry points
// int4_gemm_swap_EPI_SC and int4_gemm_swap_EPI_SC_long; int4_gemm.cuh has the contract, the
// epilogues and the split-K reduction).
//
// C^T = W^T x^T: the weights are the mma A operand and the rows of x its N dimension, so an
// m16n8k16 mma carries 16 weight columns and 8 rows of x and no fragment row is empty at one
// row (x as the A operand wastes 15 of 16 rows there). Lane (g, t)'s four words hold, per word
// j, the A quad of the 16-column tile 16 j .. 16 j + 15 as they are: a0 = nibble pair 0
// (column 16 j + g, k 2t, 2t + 1), a1 = pair 2 (column 16 j + 8 + g), a2 = pair 1 (k 2t + 8,
// 2t + 9), a3 = pair 3. The B fragment of n-tile nt is x row 8 nt + g (words kt * 8 + t and
// + 4), and C holds columns 16 j + g / 16 j + 8 + g of x rows 8 nt + 2t, 8 nt + 2t + 1. Per
// k-tile: the 4 words expanded once (four LOP3), 4 NT mma.
//
// The algorithm's parameters:
//   NT  8-row n-tiles of x per CTA: 1 (rows past 8 go to the other families, which read the
//       weights once for up to 32 rows). With NT > 1 a slab's row groups would be adjacent
//       CTAs (grid.x = n / 64 * groups) reading the weights from L2 for the second group.
//   KB  slots of the per-warp load ring (KB - 1 k-tiles in flight): SWAP_KB = 4, and
//       SWAP_KB_LONG = 8 for the `_long` entry points, which the plan takes when each warp
//       streams many k-tiles (a deeper ring pays off only on long streams; it costs registers
//       and a longer ramp on short ones).
//   SWAP_MIN_CTAS  4 resident CTAs per SM (128 registers), enough warps to cover the latency
//       of the weight stream.
// Programmatic dependent launch: each CTA lets the next kernel start launching at once and
// queues its first ring of weight loads (no kernel on Stoke's stream writes weights or scales)
// before griddepcontrol.wait; x and every write come after it (x through load_u32_after_wait:
// a non-coherent load of x was moved above the wait by ptxas).

#include "ptx.cuh"
#include "kv_row.cuh"
#include "int4_gemm.cuh"

constexpr int SWAP_KB = 4;
constexpr int SWAP_KB_LONG = 8;
constexpr int SWAP_MIN_CTAS = 4;

// One k-tile of the swapped kernels: the lane's four weight words expanded into A quads
// (nibble pairs 0, 2, 1, 3) against the x fragments b0 / b1 of each n-tile, into pp.
template <int NT>
__device__ __forceinline__ void mma_tile(float (&pp)[NT][4][4], const uint4& w, const u32 (&b0)[NT],
                                         const u32 (&b1)[NT]) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 a[4] = {nibble_pair<0>(words[j]), nibble_pair<2>(words[j]), nibble_pair<1>(words[j]),
                          nibble_pair<3>(words[j])};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(pp[nt][j], a, b0[nt], b1[nt]);
    }
}

// The lane's x values of one k-tile (fragments b0 / b1) added into its sums of x.
template <int NT>
__device__ __forceinline__ void add_x_sums(float (&sx)[NT], const u32 (&b0)[NT], const u32 (&b1)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) sx[nt] += (bf16_lo(b0[nt]) + bf16_hi(b0[nt])) + (bf16_lo(b1[nt]) + bf16_hi(b1[nt]));
}

// The swapped kernels' fold of one unit: acc += d * P' + (m - 128 d) * S per column, P' from
// `pp` (zeroed after), S of x rows 8 nt + 2t / + 1 in s0 / s1, d and m from dm (scale in the
// low half, offset in the high half; sym: m = -8 d).
template <bool F16S, int NT>
__device__ __forceinline__ void fold_swapped(float (&acc)[NT][4][4], float (&pp)[NT][4][4], const u32 (&dm)[8],
                                             bool sym, const float (&s0)[NT], const float (&s1)[NT]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float dv, mv;
            fold_coeffs<F16S>(dm[2 * j + h], dm[2 * j + h] >> 16, sym, dv, mv);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                // c[2h] (x row 8 nt + 2t) and c[2h + 1] (row 8 nt + 2t + 1) of column 16 j + 8 h + g.
                float(&c)[4] = acc[nt][j];
                c[2 * h] = fmaf(dv, pp[nt][j][2 * h], fmaf(mv, s0[nt], c[2 * h]));
                c[2 * h + 1] = fmaf(dv, pp[nt][j][2 * h + 1], fmaf(mv, s1[nt], c[2 * h + 1]));
                pp[nt][j][2 * h] = pp[nt][j][2 * h + 1] = 0.0f;
            }
        }
}

// A unit's sums of x rows 8 nt + 2t (s0) and 8 nt + 2t + 1 (s1) from the lanes' partial sums
// sx (row g's sum is complete after adding the 4 lanes of group g; lane 4 r holds row r's),
// putting sx back to zero.
template <int NT>
__device__ __forceinline__ void unit_sums(float (&sx)[NT], u32 t, float (&s0)[NT], float (&s1)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float v = sx[nt];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        s0[nt] = __shfl_sync(0xffffffffu, v, 8 * t);
        s1[nt] = __shfl_sync(0xffffffffu, v, 8 * t + 4);
        sx[nt] = 0.0f;
    }
}

// The swapped kernel's k loop: acc = this warp's sums over fold units [u_begin, u_end) of slab
// `slab`, x rows row0 onwards; `groups` row groups share the slab's weights (L2 policy).
// Programmatic dependent launch: the first ring of weight loads goes out before
// griddepcontrol.wait, everything that reads x or writes after it.
template <bool F16S, int KB, int NT>
__device__ __forceinline__ void swap_units(const Int4GemmParams& p, u32 slab, u32 row0, u32 groups, u32 u_begin,
                                           u32 u_end, float (&acc)[NT][4][4]) {
    const u32 lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 fkt = p.fold_kt;
    const bool sym = p.offsets == nullptr;
    const u32 tiles = (u_end - u_begin) * fkt;  // the warp's k-tiles, contiguous in k
    // x rows row0 + 8 nt + g (row m - 1 past the end: its results land in rows never stored).
    const u32* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
        xr[nt] = static_cast<const u32*>(p.x) + u64(min(row0 + 8 * nt + g, p.m - 1)) * (p.k / 2) + u_begin * fkt * 8 + t;
    const uint4* wp = static_cast<const uint4*>(p.words) +
                      (u64(u_begin) * fkt * p.kt_stride + u64(slab) * p.slab_stride) * 32 + lane;
    const u64 wstep = u64(p.kt_stride) * 32;
    u64 policy;
    // One row group: the weights are read once, evict them first; several: the next group's
    // CTA reads them again from L2.
    if (groups == 1) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));

    float part[NT][4][4];
    float sx[NT];  // sum of x row 8 nt + g over the lane's k of the current unit
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        sx[nt] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[nt][j][c] = part[nt][j][c] = 0.0f;
    }
    // The lane's columns: 16 j + g (h = 0) and 16 j + 8 + g (h = 1).
    const u16* s16 = static_cast<const u16*>(p.scales) + slab * 64 + g;
    const u16* o16 = static_cast<const u16*>(p.offsets) + slab * 64 + g;
    // Column i's scale in the low half of dm[i], its offset in the high half (registers are
    // what bounds the loads in flight at 4 CTAs per SM).
    auto load_scales = [&](u32 row, u32 (&dm)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u64 idx = u64(row) * p.n + 16 * (i / 2) + 8 * (i % 2);
            dm[i] = load_u16(s16 + idx) | (sym ? 0u : load_u16(o16 + idx) << 16);
        }
    };
    // The late fold: with units of 8 k-tiles (groups of 128 and more) and a ring of 4 or 8
    // slots, a unit's slots are static; each unit accumulates into one of two partial sets (part
    // for the first of a pair of units, pb for the second) and the other set is folded after the
    // first mma of the next unit is issued, so no warp waits on its own last mma at a unit
    // boundary.
    const bool late = fkt == 8 && 8 % KB == 0;
    // Scales of the current unit (dm) and, except in the late form, which loads each unit's
    // scales after the previous fold, of the next one (dmn), in flight a unit ahead.
    GroupWalk gw(p, u_begin);
    u32 dm[8], dmn[8];
    if (u_begin < u_end) load_scales(gw.row, dm);
    if (!late) {
        gw.next();
        if (u_begin + 1 < u_end) load_scales(gw.row, dmn);
    }
    u32 unit = u_begin, in_unit = 0;

    // KB slots of loads (a 16 x 64 weight strip and the x fragments per k-tile) as a ring: a slot
    // is refilled with the k-tile KB ahead as soon as it has been used, so KB - 1 k-tiles are
    // always in flight.
    uint4 w[KB];
    u32 b0[KB][NT], b1[KB][NT];
    auto fill_w = [&](int s) {
        w[s] = load_stream(wp, policy);
        wp += wstep;
    };
    auto fill_x = [&](int s) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            b0[s][nt] = load_u32_after_wait(xr[nt]);
            b1[s][nt] = load_u32_after_wait(xr[nt] + 4);
            xr[nt] += 8;
        }
    };
    auto fill = [&](int s) {
        fill_w(s);
        fill_x(s);
    };
    // The weights first, then (after the previous kernel) x. A whole ring unpredicated: with
    // each load under its own `s < tiles`, ptxas moved half the ring below the wait.
    if (tiles >= u32(KB)) {
#pragma unroll
        for (int s = 0; s < KB; ++s) fill_w(s);
    } else {
#pragma unroll
        for (int s = 0; s < KB; ++s)
            if (u32(s) < tiles) fill_w(s);
    }
    griddep_wait();
#pragma unroll
    for (int s = 0; s < KB; ++s)
        if (u32(s) < tiles) fill_x(s);
    if (late) {
        float pb[NT][4][4], ps0[NT], ps1[NT];  // the second set; the pending unit's sums of x
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) pb[nt][j][c] = 0.0f;
        u32 i = 0;  // k-tiles used
        auto fold_set = [&](float (&pp)[NT][4][4]) { fold_swapped<F16S, NT>(acc, pp, dm, sym, ps0, ps1); };
        // One unit into `into`; `other` holds the previous unit (pending) unless it is the first.
        auto unit_body = [&](float (&into)[NT][4][4], float (&other)[NT][4][4], bool pending) {
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const int sl = kk % KB;
                mma_tile(into, w[sl], b0[sl], b1[sl]);
                if (kk == 0 && pending) {
                    // The previous unit's last mma went out a k-tile ago: fold it now, then ask
                    // for this unit's scales (dm is free again).
                    fold_set(other);
                    gw.next();
                    load_scales(gw.row, dm);
                }
                add_x_sums(sx, b0[sl], b1[sl]);
                if (i + KB < tiles) fill(sl);
                ++i;
            }
            unit_sums(sx, t, ps0, ps1);  // for this unit's fold during the next (or after the loop)
        };
        bool pending = false;
        while (i < tiles) {
            unit_body(part, pb, pending);
            pending = true;
            if (i >= tiles) {
                fold_set(part);
                return;
            }
            unit_body(pb, part, true);
        }
        if (pending) fold_set(pb);
        return;
    }
    for (u32 i0 = 0; i0 < tiles; i0 += KB) {
#pragma unroll
        for (int s = 0; s < KB; ++s) {
            if (i0 + s >= tiles) break;
            mma_tile(part, w[s], b0[s], b1[s]);
            add_x_sums(sx, b0[s], b1[s]);
            if (i0 + s + KB < tiles) fill(s);
            if (++in_unit < fkt) continue;
            in_unit = 0;
            // The unit is complete: fold it.
            float s0[NT], s1[NT];
            unit_sums(sx, t, s0, s1);
            fold_swapped<F16S, NT>(acc, part, dm, sym, s0, s1);
#pragma unroll
            for (int i = 0; i < 8; ++i) dm[i] = dmn[i];
            ++unit;
            gw.next();
            if (unit + 1 < u_end) load_scales(gw.row, dmn);
        }
    }
}

// One CTA: its slab's (and row group's) partial sums over the warps' fold units, reduced and
// stored by reduce_and_store (int4_gemm.cuh).
template <int EPI, bool F16S, int KB, int NT>
__device__ __forceinline__ void int4_gemm_swap(const Int4GemmParams& p) {
    __shared__ float red[WARPS * 16 * RED_PITCH];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 groups = gridDim.x / (p.n / 64);  // row groups (1 with NT = 1)
    const u32 slab = blockIdx.x / groups, row0 = (blockIdx.x % groups) * 8 * NT;
    u32 u_begin, u_end;
    warp_units(p, warp, u_begin, u_end);
    // PDL: the next kernel on the stream may start launching now; its CTAs take SM slots as
    // this grid's CTAs exit and wait (griddepcontrol.wait) before touching what this one writes.
    // Not with the q|k|v epilogue (QKV_NO_EARLY_TRIGGER in int4_gemm.cuh).
    if (p.qkv == nullptr) griddep_launch_dependents();
    float acc[NT][4][4];
    swap_units<F16S, KB, NT>(p, slab, row0, groups, u_begin, u_end, acc);
    // Rows 8 nt + 2t, 8 nt + 2t + 1 of columns 16 j + g, 16 j + 8 + g into the reduction buffer
    // (NT = 1: rows 8-15 unused).
    auto at = [&](u32 row, u32 col) -> float& { return red[(warp * 16 + row) * RED_PITCH + col]; };
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                at(8 * nt + 2 * t, 16 * j + 8 * h + g) = acc[nt][j][2 * h];
                at(8 * nt + 2 * t + 1, 16 * j + 8 * h + g) = acc[nt][j][2 * h + 1];
            }
    reduce_and_store<1, EPI>(p, red, slab, row0);
}

#define INT4_GEMM_SWAP_ENTRY(NAME, EPI, F16S, KB)                                                            \
    INT4_GEMM_EXPORTS(NAME, 1, 0)                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, SWAP_MIN_CTAS) NAME(const Int4GemmParams p) { \
        int4_gemm_swap<EPI, F16S, KB, 1>(p);                                                              \
    }
#define INT4_GEMM_SWAP_ENTRIES(EPI_NAME, EPI)                                                 \
    INT4_GEMM_SWAP_ENTRY(int4_gemm_swap_##EPI_NAME##_bf16s, EPI, false, SWAP_KB)             \
    INT4_GEMM_SWAP_ENTRY(int4_gemm_swap_##EPI_NAME##_f16s, EPI, true, SWAP_KB)               \
    INT4_GEMM_SWAP_ENTRY(int4_gemm_swap_##EPI_NAME##_bf16s_long, EPI, false, SWAP_KB_LONG)   \
    INT4_GEMM_SWAP_ENTRY(int4_gemm_swap_##EPI_NAME##_f16s_long, EPI, true, SWAP_KB_LONG)
INT4_GEMM_SWAP_ENTRIES(plain, EPI_PLAIN)
INT4_GEMM_SWAP_ENTRIES(residual, EPI_RESIDUAL)
INT4_GEMM_SWAP_ENTRIES(swiglu, EPI_SWIGLU)
