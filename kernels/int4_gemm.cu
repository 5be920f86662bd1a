// W4A16 GEMM for decode-sized batches: y = x W with x bf16 [m, k], W packed INT4 [k, n]
// (docs/INT4_FORMAT.md), f32 accumulation, bf16 output, and a fused epilogue.
//
// The file is compiled at run time by NVRTC for sm_90a (programmatic launch and thread-block
// clusters need sm_90, where the runtime runs). Like every Stoke kernel it includes no header:
// bf16 and f16 are raw 16-bit patterns converted with PTX.
//
// ---------------------------------------------------------------------------------------------
// Entry points: int4_gemm_EPI_SC_mROWS (batched), int4_gemm_swap_EPI_SC[_long] (m <= 8),
// int4_gemm_swap16_EPI_SC[_long] (m <= 32; see "Swapped operands" below) and
// int4_gemm_swapk_EPI_SC (m <= 8, stream-K), one argument `Int4GemmParams` by value; and
// int4_gemm_wg_EPI_SC_nN (N <= 8, 16, 32 rows; "Warpgroup kernels" below), `Int4WgParams`.
//   EPI  plain     out[r, c] = acc[r, c]
//        residual  out[r, c] = acc[r, c] + residual[r, c]          (sum in f32, rounded once)
//        swiglu    out[r, j] = silu(acc[r, 2j]) * acc[r, 2j + 1]   (gate/up interleaved; out is
//                                                                    [m, n / 2])
//        where acc = (x W)[r, c] * row_scale[r] when row_scale is non-null (the RMSNorm row
//        factor when the norm's gain is folded into W), else (x W)[r, c].
//   SC   bf16s / f16s: the type of the group scales and offsets.
//   mROWS  8, 16 or 32: most rows of x per launch (m <= ROWS; one mma m-tile for 8 and 16,
//        two for 32; m8 knows fragment rows 8-15 are empty and skips their loads). Rows past
//        m are treated as zeros and never written. Larger m: one launch per 32 rows.
//
// Launch: block = (128, 1, 1) (4 warps); grid = (n / 64, splits, 1). Each CTA owns a 64-column
// slab; the k range is cut into fold units (fold_kt k-tiles of 16 rows, fold_kt dividing both
// group / 16 and 8) dealt evenly to the splits * 4 warps of the slab. Warps of a CTA reduce
// through shared memory; with splits > 1 the CTAs of a slab add into `workspace` (f32 [m, n],
// all zeros on entry) and the last CTA to finish (counted in counters[slab], zero on entry)
// applies the epilogue and puts zeros back in both, so the same scratch serves the next launch
// on the stream; launched as clusters of the splits (STOKE_INT4_CLUSTER: cluster dims
// (1, splits, 1), 2-8 splits) they add through each other's shared memory instead, and the
// workspace is left alone. k % 16 == 0, n % 64 == 0, group % 16 == 0 and k % group == 0. All pointers
// 16-byte aligned except x, residual and row_scale (4-byte).
//
// Inner loop, per lane and k-tile: one 16-byte load of weights (4 words = a 16 x 64 strip),
// A fragments of x straight from global memory (L2-resident, shared by every slab), and per
// word four LOP3s turning nibble pairs into bf16 pairs 128 + q (exact: the magic-number trick
// with no subtraction) feeding two mma.m16n8k16. The scales never touch the inner loop: each
// fold unit's partial sums P' = sum x (128 + q) are folded into the f32 accumulator as
// d * P' + (m - 128 d) * S, where S = sum of x over the unit (lane-local adds plus two shuffles
// per unit), which equals sum x (d q + m) exactly in real arithmetic. The symmetric form uses
// m = -8 d.
// ---------------------------------------------------------------------------------------------

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#include "cluster.cuh"
#include "mbarrier.cuh"

struct Int4GemmParams {
    const void* x;          // [m, k] bf16, row-major
    const void* words;      // k * n / 8 words in fragment order
    const void* scales;     // [k / group, n] 16-bit scales d
    const void* offsets;    // [k / group, n] 16-bit offsets m, or null: symmetric (m = -8 d)
    void* out;              // [m, n] bf16 ([m, n / 2] for swiglu)
    const void* residual;   // [m, n] bf16 (residual entry points)
    const float* row_scale; // [m] or null
    float* workspace;       // [m, n] f32 zeros (splits != 1: split-K, or 0: stream-K)
    u32* counters;          // [n / 64 * 2] zeros (splits != 1; one per CTA column)
    u32 m, k, n, group;
    u32 fold_kt;            // k-tiles per fold unit
    u32 splits;             // CTAs per slab along k (gridDim.y)
    u32 kt_stride;          // 512-byte blocks between k-tiles of one slab (the word order:
    u32 slab_stride;        //   n / 64 and 1 k-tile major, 1 and k / 16 slab major)
};
static_assert(sizeof(Int4GemmParams) == 104, "Int4GemmParams layout");

constexpr int WARPS = 4;
enum { EPI_PLAIN = 0, EPI_RESIDUAL = 1, EPI_SWIGLU = 2 };

// Tuning knobs of the swapped kernel, overridable by NVRTC defines (benchmarks time variants
// through Runtime::set_defines): k-tiles per batch of loads, and the launch bounds' CTAs per SM.
#ifndef STOKE_INT4_SWAP_KB
#define STOKE_INT4_SWAP_KB 4
#endif
// The same for the `_long` entry points, which the plan picks when every warp streams many
// k-tiles (8: 70B gate/up 79.5 -> 75.4 us, but 8B o-proj 8.2 -> 9.3 us at KB = 8 everywhere).
#ifndef STOKE_INT4_SWAP_KB_LONG
#define STOKE_INT4_SWAP_KB_LONG 8
#endif
// 1: the batched kernels m16 / m32 keep their 4 load slots as a ring like the swapped kernel
// (70B gate/up m = 16: 137.7 -> 121.1 us); 0: they fill and use them 4 at a time. m8 keeps the
// batches (the ring was slower there, 56.5 -> 61.2 us on 70B down).
#ifndef STOKE_INT4_RING
#define STOKE_INT4_RING 1
#endif
// 1: the batched m32 (STOKE_INT4_SMEM_RING_M32) / m16 (STOKE_INT4_SMEM_RING_M16) kernels
// stream weights and x through a per-warp ring of STOKE_INT4_SMEM_STAGES stages in dynamic
// shared memory, each 4 k-tiles of the warp's weight strips and of its rows of x, copied with
// cp.async (STOKE_INT4_SMEM_STAGES - 1 stages, 12 k-tiles at 4, in flight per warp without
// holding registers); the mma read the weights back with one 16-byte shared load per lane and
// the x fragments with one ldmatrix.x4 per 16 rows and k-tile. 0: the register ring below
// (3 k-tiles in flight per warp, x loaded per lane from global memory, four 4-byte loads per
// 16 rows and k-tile, each touching 8 rows' lines). Timed at 8802012
// (results/experiments/h200-int4-smem-ring-8802012.json): m32 1.04-1.17x faster (70B gate/up
// 228 -> 195 us), m16 0.95-1.08x (70B gate/up 120 -> 126 us), 3 stages as fast as 4, 6 slower
// (2 CTAs per SM at m16). Four times the weight bytes in flight per warp did not speed up m16:
// its time is set inside the SM.
#ifndef STOKE_INT4_SMEM_RING_M32
#define STOKE_INT4_SMEM_RING_M32 1
#endif
#ifndef STOKE_INT4_SMEM_RING_M16
#define STOKE_INT4_SMEM_RING_M16 0
#endif
#ifndef STOKE_INT4_SMEM_STAGES
#define STOKE_INT4_SMEM_STAGES 4
#endif
// Resident CTAs per SM the batched m16 / m32 kernels' launch bounds ask for.
#ifndef STOKE_INT4_M16_MIN_CTAS
#define STOKE_INT4_M16_MIN_CTAS 3
#endif
#ifndef STOKE_INT4_M32_MIN_CTAS
#define STOKE_INT4_M32_MIN_CTAS 2
#endif
#ifndef STOKE_INT4_SWAP_MIN_CTAS
#define STOKE_INT4_SWAP_MIN_CTAS 4
#endif
// The swapped kernel for up to 16 rows per CTA (swap16: two n-tiles of x, twice the
// accumulators): k-tiles per load slot ring, its long form (6: at 8 ptxas spills at 168
// registers), and CTAs per SM (151 registers at 3; 4 spills).
#ifndef STOKE_INT4_SWAP16_KB
#define STOKE_INT4_SWAP16_KB 4
#endif
#ifndef STOKE_INT4_SWAP16_KB_LONG
#define STOKE_INT4_SWAP16_KB_LONG 6
#endif
#ifndef STOKE_INT4_SWAP16_MIN_CTAS
#define STOKE_INT4_SWAP16_MIN_CTAS 3
#endif
// The stream-K swapped kernel's load ring (k-tiles; 8 fits 128 registers, 4 CTAs per SM).
#ifndef STOKE_INT4_SWAPK_KB
#define STOKE_INT4_SWAPK_KB 8
#endif
// 1: with 8 k-tiles per fold unit (groups of 128 and more) and a ring of 4 or 8 slots, the
// swapped kernels fold each unit one k-tile late, after the next unit's first mma is issued,
// from a second set of partial sums (128 registers at m <= 8, still 4 CTAs per SM), so that no
// warp waits on its own last mma at a unit boundary (70B gate/up at m = 1: 75.3 -> 70.0 us,
// 1.01-1.08x on every shape; 0: the fold right after the unit's last mma).
#ifndef STOKE_INT4_FOLD_LATE
#define STOKE_INT4_FOLD_LATE 1
#endif
// Timing probes of the swapped kernels (wrong results; the GPU test skips them): 1 keeps the
// loads (weights, x, scales) and the launch shape but drops all arithmetic (the loaded words
// are XORed into one register); 2 keeps the loads, the nibble expansion and the mma but drops
// the sums of x and the folds (one fold at the end). Time against the shipped kernel to split
// its time into memory, expansion + mma, and the fold's share. For every kernel (batched ones
// included): 3 keeps all the work but reads the same k-tile of x throughout (x from L1, not
// L2), 4 the same 16 x 64 weight strip throughout (weights from L2, not DRAM), 5 both (what
// the arithmetic and the issue of the loads alone cost).
#ifndef STOKE_INT4_PROBE
#define STOKE_INT4_PROBE 0
#endif
// The probes that drop arithmetic (1, 2) as against those that only change addresses (3-5).
#define STOKE_INT4_PROBE_ARITH (STOKE_INT4_PROBE == 1 || STOKE_INT4_PROBE == 2)
// Whether the x and weight pointers move on (x stays in probes 3 and 5, the weights in 4 and 5).
#define STOKE_INT4_X_STEP (STOKE_INT4_PROBE == 3 || STOKE_INT4_PROBE == 5 ? 0 : 8)
#define STOKE_INT4_W_ADVANCE (STOKE_INT4_PROBE != 4 && STOKE_INT4_PROBE != 5)
// 1: the swapped kernels (swap, swap16) take part in programmatic dependent launch: the runtime
// launches them with programmatic stream serialization (it reads `<entry>_pdl`), each CTA lets
// the next kernel on the stream start launching at once (griddepcontrol.launch_dependents), and
// a CTA queues its first ring of weight loads (weights and scales are never written by other
// kernels) before it waits for the previous kernel to finish (griddepcontrol.wait), after which
// it reads x and writes anything. So a GEMM's first weight bytes are in flight while the kernel
// before it drains. 0: ordinary launches. Timed as a variant in a graph of back-to-back calls
// (results/experiments/h200-int4-pdl-0799800.json): 1.02-1.21x at m = 1 and 8 on every shape
// (8B o 6.80 -> 5.61 us, 70B qkv 18.39 -> 17.24, 70B gate/up 68.00 -> 66.86). Callers must
// not write weights or scales in the kernel just before a GEMM on the same stream (Stoke
// uploads them; nothing on its stream writes them).
#ifndef STOKE_INT4_PDL
#define STOKE_INT4_PDL 1
#endif
// 1: a split-K launch whose CTAs along k form one thread-block cluster (the runtime launches
// with cluster dims (1, splits, 1) for 2-8 splits on sm_90 when NAME_cluster is nonzero) adds
// the splits' sums through distributed shared memory: each CTA leaves its reduced tile in its
// own shared memory, a cluster barrier, then CTA q of the cluster sums items q, q + splits, ...
// across the cluster in a fixed order (deterministic) and applies the epilogue, and a second
// barrier keeps every tile alive until read. No workspace atomics, fence, counter or
// last-CTA pass. Launched without a cluster (more than 8 splits, or clusters that would not
// all be resident at once) the same kernel adds through the workspace as before.
#ifndef STOKE_INT4_CLUSTER
#define STOKE_INT4_CLUSTER 1
#endif
// 1: each warp's KB load slots form a ring, a slot refilled with the k-tile KB ahead as soon
// as it has been used (KB - 1 k-tiles always in flight); 0: filled KB at a time.
#ifndef STOKE_INT4_SWAP_PIPELINE
#define STOKE_INT4_SWAP_PIPELINE 1
#endif

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// A 16-bit scale or offset (the low half of v) as f32.
template <bool F16S>
__device__ __forceinline__ float scale_value(u32 v) {
    if (F16S) return f16_to_f32(u16(v & 0xffffu));
    return __uint_as_float(v << 16);
}

// One column's fold coefficients from its 16-bit scale d and offset m (low halves of the
// arguments): d, and m - 128 d (sym: m = -8 d).
template <bool F16S>
__device__ __forceinline__ void fold_coeffs(u32 d16, u32 m16, bool sym, float& d, float& m128) {
    d = scale_value<F16S>(d16);
    const float m = sym ? -8.0f * d : scale_value<F16S>(m16);
    m128 = fmaf(-128.0f, d, m);
}

// Round (lo, hi) to bf16, packed with lo at the lower address.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Weights are read exactly once: no L1 allocation, evict first from L2.
__device__ __forceinline__ uint4 load_stream(const uint4* p, u64 policy) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(policy));
    return r;
}

__device__ __forceinline__ u32 load_u32(const u32* p) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// bf16 pair (128 + q_lo, 128 + q_hi) from the nibbles at bits 4i and 16 + 4i of w.
template <int I>
__device__ __forceinline__ u32 nibble_pair(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * I)), "r"(0x000f000fu), "r"(0x43004300u));
    return r;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float load_cg(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Epilogue for columns (c, c + 1) of row r, c even.
template <int EPI>
__device__ __forceinline__ void store_pair(const Int4GemmParams& p, u32 r, u32 c, float v0, float v1) {
    if (p.row_scale != nullptr) {
        const float s = p.row_scale[r];
        v0 *= s;
        v1 *= s;
    }
    if (EPI == EPI_SWIGLU) {
        static_cast<u16*>(p.out)[u64(r) * (p.n / 2) + c / 2] = to_bf16(silu(v0) * v1);
    } else {
        if (EPI == EPI_RESIDUAL) {
            const u32 res = static_cast<const u32*>(p.residual)[(u64(r) * p.n + c) / 2];
            v0 += bf16_lo(res);
            v1 += bf16_hi(res);
        }
        static_cast<u32*>(p.out)[(u64(r) * p.n + c) / 2] = pack_bf16x2(v0, v1);
    }
}

// Per-warp accumulators of one 64-column slab: acc (the warp's result), part (the current fold
// unit's sums of x (128 + q)) and sx (lane-local sums of x over the unit, rows g and g + 8, in
// f32 on CUDA cores: the fold subtracts 128 d S from d P', so S must be as exact as P'; an mma
// against a B of ones was measured less accurate, see docs/PERF_NOTES.md).
template <int MT, bool LOW8>
struct Accum {
    float acc[MT][8][4];   // [m-tile][n8 tile: 2 j + h][fragment]
    float part[MT][8][4];
    float sx[MT][2];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mt][i][c] = 0.0f;
    }

    __device__ __forceinline__ void begin_unit() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            sx[mt][0] = sx[mt][1] = 0.0f;
#pragma unroll
            for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
                for (int c = 0; c < 4; ++c) part[mt][n8][c] = 0.0f;
        }
    }

    // One k-tile: the lane's four weight words (a 16 x 64 strip) and its A fragments.
    __device__ __forceinline__ void tile(const uint4& w, const u32 (&a)[MT][4]) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 b00 = nibble_pair<0>(words[j]);  // n-tile 0, rows 2t, 2t + 1
            const u32 b01 = nibble_pair<1>(words[j]);  // n-tile 0, rows 2t + 8, 2t + 9
            const u32 b10 = nibble_pair<2>(words[j]);  // n-tile 1
            const u32 b11 = nibble_pair<3>(words[j]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(part[mt][2 * j], a[mt], b00, b01);
                mma_bf16(part[mt][2 * j + 1], a[mt], b10, b11);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            sx[mt][0] += (bf16_lo(a[mt][0]) + bf16_hi(a[mt][0])) + (bf16_lo(a[mt][2]) + bf16_hi(a[mt][2]));
            if (!LOW8) sx[mt][1] += (bf16_lo(a[mt][1]) + bf16_hi(a[mt][1])) + (bf16_lo(a[mt][3]) + bf16_hi(a[mt][3]));
        }
    }

    // Fold the unit: acc += d * P' + (m - 128 d) * S, per column. d[n8] / m[n8] hold the
    // scale / offset pair of the lane's columns 2t, 2t + 1 of n8 tile n8; sym: m = -8 d.
    // LOW8: fragment rows g + 8 are empty and skipped.
    template <bool F16S>
    __device__ __forceinline__ void fold(const u32 (&d)[8], const u32 (&m)[8], bool sym) {
        float s[MT][2];  // the unit's sums of x, rows g and g + 8 (the 4 lanes of a row added)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v = sx[mt][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                s[mt][h] = v;
            }
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
            float d0, d1, m0, m1;
            fold_coeffs<F16S>(d[n8], m[n8], sym, d0, m0);
            fold_coeffs<F16S>(d[n8] >> 16, m[n8] >> 16, sym, d1, m1);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float(&c)[4] = acc[mt][n8];
                c[0] = fmaf(d0, part[mt][n8][0], fmaf(m0, s[mt][0], c[0]));
                c[1] = fmaf(d1, part[mt][n8][1], fmaf(m1, s[mt][0], c[1]));
                if (!LOW8) {
                    c[2] = fmaf(d0, part[mt][n8][2], fmaf(m0, s[mt][1], c[2]));
                    c[3] = fmaf(d1, part[mt][n8][3], fmaf(m1, s[mt][1], c[3]));
                }
            }
        }
    }
};

// Column (within the 64-column slab) of fragment value pair (c0, c1) of n8 tile n8 for lane t.
__device__ __forceinline__ u32 frag_col(int n8, u32 t) { return (n8 >> 1) * 16 + (n8 & 1) * 8 + 2 * t; }

// The fold units of this warp: [u_begin, u_end) (unit u covers k-tiles u * fold_kt onwards).
__device__ __forceinline__ void warp_units(const Int4GemmParams& p, u32 warp, u32& u_begin, u32& u_end) {
    const u32 units = p.k / 16 / p.fold_kt;
    const u32 workers = p.splits * WARPS;
    const u32 worker = blockIdx.y * WARPS + warp;
    u_begin = u32(u64(units) * worker / workers);
    u_end = u32(u64(units) * (worker + 1) / workers);
}

// Walks the scale rows of consecutive fold units without dividing in the loop: `units_per_group`
// units share a row (a group is a whole number of units).
struct GroupWalk {
    u32 row, in_group, units_per_group;
    __device__ __forceinline__ GroupWalk(const Int4GemmParams& p, u32 unit) {
        units_per_group = p.group / (16 * p.fold_kt);
        row = unit / units_per_group;
        in_group = unit % units_per_group;
    }
    __device__ __forceinline__ void next() {
        if (++in_group == units_per_group) {
            in_group = 0;
            ++row;
        }
    }
};

// The lane's scale (and offset) pairs of one unit: columns 2t, 2t + 1 of each n8 tile of the
// slab, from scale row `row`.
__device__ __forceinline__ void load_unit_scales(const Int4GemmParams& p, u32 row, u32 t, bool sym,
                                                 u32 (&d)[8], u32 (&m)[8]) {
    const u64 base = (u64(row) * p.n + blockIdx.x * 64) / 2;
    const u32* scales = static_cast<const u32*>(p.scales);
    const u32* offsets = static_cast<const u32*>(p.offsets);
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
        const u64 idx = base + frag_col(n8, t) / 2;
        d[n8] = load_u32(scales + idx);
        m[n8] = sym ? 0u : load_u32(offsets + idx);
    }
}

// The epilogue of a slab's finished sums in the workspace, rows row0 .. row0 + rows - 1, putting
// zeros back: items i0, i0 + step, ... of its (row, column pair) items.
template <int EPI>
__device__ __forceinline__ void store_from_workspace(const Int4GemmParams& p, u32 slab, u32 row0, u32 rows, u32 i0,
                                                     u32 step) {
    for (u32 i = i0; i < rows * 32; i += step) {
        const u32 r = i / 32, c = 2 * (i % 32);
        float* ws = p.workspace + u64(row0 + r) * p.n + slab * 64 + c;
        const float v0 = load_cg(ws), v1 = load_cg(ws + 1);
        ws[0] = 0.0f;
        ws[1] = 0.0f;
        store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1);
    }
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// Thread-block clusters (STOKE_INT4_CLUSTER): cluster_ctas, cluster_rank, cluster_sync and
// ld_cluster_f2 come from cluster.cuh.

// Reduces the CTA's warps through shared memory `red` ([SLOTS][MT * 16][RED_PITCH] floats), then
// applies the epilogue: directly with one split, else through the workspace, by the last CTA.
constexpr int RED_PITCH = 64 + 4;
// The second half of finish: every warp has written its [MT * 16][64] values into `red` (SLOTS
// = WARPS: one slot per warp, summed; 1: the warps wrote disjoint columns of one slot).
// `slab`: the CTA's 64-column slab; `row0`: its first row (swapped row groups, else 0). The
// split-K counter is the CTA column's, counters[blockIdx.x].
template <int MT, int EPI, int SLOTS = WARPS>
__device__ __forceinline__ void reduce_and_store(const Int4GemmParams& p, float* red, u32 slab, u32 row0) {
    __shared__ u32 last_cta;
    auto at = [&](u32 w, u32 row, u32 col) -> float& {
        return red[(w * (MT * 16) + row) * RED_PITCH + col];
    };
    __syncthreads();
    const u32 rows = min(p.m - row0, u32(MT * 16));
    const u32 pairs = rows * 32;  // (row, column pair) items of this slab
    // Sum of the warps' values at (r, c) and (r, c + 1).
    auto warp_sum = [&](u32 r, u32 c, float& v0, float& v1) {
        v0 = v1 = 0.0f;
#pragma unroll
        for (int wi = 0; wi < SLOTS; ++wi) {
            v0 += at(wi, r, c);
            v1 += at(wi, r, c + 1);
        }
    };
    const u32 cluster = cluster_ctas();
    const bool dsmem = p.splits > 1 && cluster == p.splits;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        const u32 r = i / 32, c = 2 * (i % 32);
        float v0, v1;
        warp_sum(r, c, v0, v1);
        if (p.splits == 1) {
            store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1);
        } else if (dsmem) {
            // Warp 0's slot of (r, c) holds the CTA's sum from here on (only this thread reads
            // or writes it).
            at(0, r, c) = v0;
            at(0, r, c + 1) = v1;
        } else {
            float* ws = p.workspace + u64(row0 + r) * p.n + slab * 64 + c;
            atomicAdd(ws, v0);
            atomicAdd(ws + 1, v1);
        }
    }
    if (p.splits == 1) return;
    if (dsmem) {
        cluster_sync();
        const u32 rank = cluster_rank();
        for (u32 i = rank * blockDim.x + threadIdx.x; i < pairs; i += cluster * blockDim.x) {
            const u32 r = i / 32, c = 2 * (i % 32);
            const u32 addr = smem_u32(&at(0, r, c));
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (u32 q = 0; q < 8; ++q) {
                if (q < cluster) {
                    const float2 v = ld_cluster_f2(addr, q);
                    v0 += v.x;
                    v1 += v.y;
                }
            }
            store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1);
        }
        cluster_sync();  // every CTA's tile stays until the cluster has read it
        return;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_cta = atomicAdd(p.counters + blockIdx.x, 1u) == p.splits - 1;
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    store_from_workspace<EPI>(p, slab, row0, rows, threadIdx.x, blockDim.x);
    if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
}

template <int MT, int EPI>
__device__ __forceinline__ void finish(const Int4GemmParams& p, const float (&acc)[MT][8][4], float* red,
                                       u32 warp, u32 g, u32 t) {
    auto at = [&](u32 row, u32 col) -> float& { return red[(warp * (MT * 16) + row) * RED_PITCH + col]; };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
            const u32 col = frag_col(n8, t);
            at(16 * mt + g, col) = acc[mt][n8][0];
            at(16 * mt + g, col + 1) = acc[mt][n8][1];
            at(16 * mt + 8 + g, col) = acc[mt][n8][2];
            at(16 * mt + 8 + g, col + 1) = acc[mt][n8][3];
        }
    reduce_and_store<MT, EPI>(p, red, blockIdx.x, 0);
}

// The shared-memory ring of the batched m16 / m32 kernels (STOKE_INT4_SMEM_RING_M16 / _M32): per warp,
// SMEM_STAGES stages of SMEM_KT k-tiles, each stage the k-tiles' weight strips (512 bytes each,
// lane l's 16 bytes at 16 l, as it loads them) then x: ROWS rows of 128 bytes, 16-byte chunk c
// of row r (k-tile c / 2, half c % 2) stored at chunk c ^ (r & 7), so the 8 rows an ldmatrix
// matrix reads fall in 8 different bank groups. The reduction at the end reuses the area.
constexpr int SMEM_KT = 4;
template <int ROWS>
struct SmemRing {
    static constexpr u32 W_BYTES = SMEM_KT * 512;
    static constexpr u32 STAGE = W_BYTES + ROWS * 128;
    static constexpr u32 WARP = STOKE_INT4_SMEM_STAGES * STAGE;
    static constexpr u32 RED = WARPS * (ROWS / 16) * 16 * RED_PITCH * 4;
    static constexpr u32 BYTES = WARPS * WARP > RED ? WARPS * WARP : RED;
};
// Dynamic shared memory of a batched entry point (0 without the ring; m8 never has it).
__host__ __device__ constexpr unsigned batched_dyn_smem(int rows) {
    return STOKE_INT4_SMEM_RING_M16 != 0 && rows == 16   ? SmemRing<16>::BYTES
           : STOKE_INT4_SMEM_RING_M32 != 0 && rows == 32 ? SmemRing<32>::BYTES
                                                         : 0;
}
extern __shared__ __align__(128) unsigned char int4_dyn_smem[];


// Copies `bytes` (16, or 0: zero fill) from src to shared dst; 16-byte aligned src.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// The same in four 4-byte copies, for an x that is only 4-byte aligned.
__device__ __forceinline__ void cp_async16_by4(u32 dst, const void* src, u32 bytes) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst + 4 * i),
                     "l"(static_cast<const char*>(src) + 4 * i), "r"(bytes / 4) : "memory");
}
// A weight strip's 16 bytes, read once: L2 evict-first.
__device__ __forceinline__ void cp_async16_stream(u32 dst, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
    return r;
}

// Queues stage `b` of a warp's k-tiles (relative k-tiles SMEM_KT b onwards, those before
// `tiles`; x's past them zero-filled) into the stage at shared address `stage`: the weight
// strips from wp (the warp's first k-tile, lane offset included, wstep apart) and x rows
// 0 .. ROWS - 1 (row m - 1 past m) from k-tile kt0 onwards.
template <int ROWS>
__device__ __forceinline__ void stage_copy(const Int4GemmParams& p, u32 stage, const uint4* wp, u64 wstep, u64 policy,
                                           u32 kt0, u32 b, u32 tiles, u32 lane, bool aligned16) {
#pragma unroll
    for (int j = 0; j < SMEM_KT; ++j) {
        const u32 kt = SMEM_KT * b + j;
        if (kt < tiles) cp_async16_stream(stage + j * 512 + lane * 16, wp + (STOKE_INT4_W_ADVANCE ? kt : 0) * wstep, policy);
    }
    const char* x = static_cast<const char*>(p.x);
    const u32 xs = stage + SmemRing<ROWS>::W_BYTES;
#pragma unroll
    for (int i = 0; i < ROWS / 4; ++i) {
        const u32 q = 32 * i + lane, r = q >> 3, c = q & 7;
        const u32 kt = SMEM_KT * b + (c >> 1);
        const bool valid = kt < tiles;
        const u32 xkt = STOKE_INT4_X_STEP == 0 ? (c >> 1) : kt;
        const char* src = x + u64(min(r, p.m - 1)) * p.k * 2 + (valid ? (kt0 + xkt) * 32 + (c & 1) * 16 : 0);
        const u32 dst = xs + r * 128 + ((c ^ (r & 7)) << 4);
        if (aligned16) cp_async16(dst, src, valid ? 16 : 0);
        else cp_async16_by4(dst, src, valid ? 16 : 0);
    }
}

// The A fragments of k-tile j of a stage's x, rows 16 mt onwards: matrix l / 8 of lane l is
// rows 8 (l / 8 % 2) onwards, k half l / 16 (a0 .. a3 of mma.m16n8k16).
__device__ __forceinline__ void x_fragments(u32 (&a)[4], u32 xs, int mt, int j, u32 lane) {
    const u32 r = 16 * mt + ((lane >> 3) & 1) * 8 + (lane & 7), c = 2 * j + (lane >> 4);
    ldmatrix_x4(a, xs + r * 128 + ((c ^ (r & 7)) << 4));
}

// Register-batched kernel: each warp loads KB k-tiles of weights and activations, then computes
// them; the next unit's scales are requested when a unit starts. The loops run over fold units
// and the k-tiles inside one, with pointers stepped, not recomputed: no division in the loop.
// Rows of x past m are read from row m - 1 instead (no predicates in the loop): their results
// land in rows that are never stored. ROWS = 8: fragment rows g + 8 are known to be empty (half
// the A loads, and the fold skips them).
template <int KB, int MT, bool LOW8>
__device__ __forceinline__ void batch_tiles(Accum<MT, LOW8>& st, const uint4*& wp, u64 wstep,
                                            const u32* (&xr)[MT][2], u64 policy, u32 nb) {
    uint4 w[KB];
    u32 a[KB][MT][4];
#pragma unroll
    for (int i = 0; i < KB; ++i) {
        if (i < nb) {
            w[i] = load_stream(wp, policy);
            wp += wstep;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[i][mt][0] = load_u32(xr[mt][0] + 8 * i);
                a[i][mt][2] = load_u32(xr[mt][0] + 8 * i + 4);
                a[i][mt][1] = LOW8 ? 0u : load_u32(xr[mt][1] + 8 * i);
                a[i][mt][3] = LOW8 ? 0u : load_u32(xr[mt][1] + 8 * i + 4);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) xr[mt][h] += 8 * nb;
#pragma unroll
    for (int i = 0; i < KB; ++i)
        if (i < nb) st.tile(w[i], a[i]);
}

template <int ROWS, int EPI, bool F16S>
__device__ __forceinline__ void int4_gemm(const Int4GemmParams& p) {
    constexpr int MT = ROWS == 32 ? 2 : 1;
    constexpr bool LOW8 = ROWS == 8;
    constexpr int KB = 4;
    // The reduction buffer: static, or with the shared-memory ring (m16 / m32) the ring's
    // dynamic area (the k loop is over, every warp past a barrier, before the reduction writes).
    constexpr bool SRING = batched_dyn_smem(ROWS) != 0;
    __shared__ __align__(16) float red_static[SRING ? 1 : WARPS * MT * 16 * RED_PITCH];
    float* const red = SRING ? reinterpret_cast<float*>(int4_dyn_smem) : red_static;

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 fkt = p.fold_kt;
    const bool sym = p.offsets == nullptr;
    u32 u_begin, u_end;
    warp_units(p, warp, u_begin, u_end);
    const u32 xrow_words = p.k / 2;
    // Rows of x this lane reads: g + 8 h + 16 mt, or row m - 1 past the end.
    const u32* xr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 r = min(16 * mt + 8 * h + g, p.m - 1);
            xr[mt][h] = static_cast<const u32*>(p.x) + u64(r) * xrow_words + u_begin * fkt * 8 + t;
        }
    const uint4* wp = static_cast<const uint4*>(p.words) +
                      (u64(u_begin) * fkt * p.kt_stride + u64(blockIdx.x) * p.slab_stride) * 32 + lane;
    const u64 wstep = u64(p.kt_stride) * 32;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));

    Accum<MT, LOW8> st;
    st.zero();
    GroupWalk gw(p, u_begin);
    u32 d[8], m[8];
    if (u_begin < u_end) load_unit_scales(p, gw.row, t, sym, d, m);
    // The ring forms: the warp's k-tiles; the next unit's scales (dn / mn), in flight a unit
    // ahead; after each k-tile, at a unit's end, the fold and the move to the next unit.
    const u32 tiles = (u_end - u_begin) * fkt;
    u32 dn[8], mn[8];
    u32 unit = u_begin, in_unit = 0;
    auto ring_start = [&]() {
        gw.next();
        if (u_begin + 1 < u_end) load_unit_scales(p, gw.row, t, sym, dn, mn);
    };
    auto tile_done = [&]() {
        if (++in_unit < fkt) return;
        in_unit = 0;
        st.template fold<F16S>(d, m, sym);
        st.begin_unit();
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
            d[n8] = dn[n8];
            m[n8] = mn[n8];
        }
        ++unit;
        gw.next();
        if (unit + 1 < u_end) load_unit_scales(p, gw.row, t, sym, dn, mn);
    };
    if (SRING) {
        // Weights and x SMEM_STAGES - 1 stages ahead in the warp's ring (STOKE_INT4_SMEM_RING_M*).
        using R = SmemRing<ROWS>;
        constexpr int S = STOKE_INT4_SMEM_STAGES;
        static_assert(S >= 2, "a stage in use and at least one in flight");
        const u32 kt0 = u_begin * fkt;
        const bool aligned16 = (reinterpret_cast<u64>(p.x) & 15) == 0;
        const u32 ring = smem_u32(int4_dyn_smem) + warp * R::WARP;
        ring_start();
#pragma unroll
        for (int b = 0; b < S - 1; ++b) {
            if (u32(b) * SMEM_KT < tiles) stage_copy<ROWS>(p, ring + b * R::STAGE, wp, wstep, policy, kt0, b, tiles, lane, aligned16);
            cp_async_commit();
        }
        st.begin_unit();
        u32 b = 0, slot = 0;  // slot = b % S
        for (u32 i0 = 0; i0 < tiles; i0 += SMEM_KT, ++b) {
            // Stage b + S - 1 goes out into the slot stage b - 1 used (every lane is past its
            // reads: the barrier), then stage b is waited for.
            __syncwarp();
            const u32 bn = b + S - 1, next_slot = slot == 0 ? S - 1 : slot - 1;
            if (bn * SMEM_KT < tiles) stage_copy<ROWS>(p, ring + next_slot * R::STAGE, wp, wstep, policy, kt0, bn, tiles, lane, aligned16);
            cp_async_commit();
            cp_async_wait<S - 1>();
            __syncwarp();
            const u32 stage = ring + slot * R::STAGE;
            slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
            for (int s = 0; s < SMEM_KT; ++s) {
                if (i0 + s >= tiles) break;
                const uint4 w = lds128(stage + s * 512 + lane * 16);
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) x_fragments(a[mt], stage + R::W_BYTES, mt, s, lane);
                st.tile(w, a);
                tile_done();
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with its ring: the area is the reduction's now
    } else if (STOKE_INT4_RING && ROWS > 8) {
        // The load slots as a ring, as in the swapped kernel: a slot is refilled with the k-tile KB
        // ahead as soon as its mma have read it; the fold runs when a unit's last k-tile is done.
        ring_start();
        uint4 w[KB];
        u32 a[KB][MT][4];
        auto fill = [&](int s) {
            w[s] = load_stream(wp, policy);
            if (STOKE_INT4_W_ADVANCE) wp += wstep;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[s][mt][0] = load_u32(xr[mt][0]);
                a[s][mt][2] = load_u32(xr[mt][0] + 4);
                a[s][mt][1] = LOW8 ? 0u : load_u32(xr[mt][1]);
                a[s][mt][3] = LOW8 ? 0u : load_u32(xr[mt][1] + 4);
#pragma unroll
                for (int h = 0; h < 2; ++h) xr[mt][h] += STOKE_INT4_X_STEP;
            }
        };
#pragma unroll
        for (int s = 0; s < KB; ++s)
            if (u32(s) < tiles) fill(s);
        st.begin_unit();
        for (u32 i0 = 0; i0 < tiles; i0 += KB) {
#pragma unroll
            for (int s = 0; s < KB; ++s) {
                if (i0 + s >= tiles) break;
                st.tile(w[s], a[s]);
                if (i0 + s + KB < tiles) fill(s);
                tile_done();
            }
        }
    } else {
        for (u32 u = u_begin; u < u_end; ++u) {
            // The next unit's scales, in flight during this unit.
            u32 dn[8], mn[8];
            gw.next();
            if (u + 1 < u_end) load_unit_scales(p, gw.row, t, sym, dn, mn);
            st.begin_unit();
            if (fkt % KB == 0) {  // whole batches (groups of 64 rows and more)
                for (u32 i0 = 0; i0 < fkt; i0 += KB) batch_tiles<KB>(st, wp, wstep, xr, policy, KB);
            } else {
                for (u32 i0 = 0; i0 < fkt; i0 += KB) batch_tiles<KB>(st, wp, wstep, xr, policy, min(u32(KB), fkt - i0));
            }
            st.template fold<F16S>(d, m, sym);
#pragma unroll
            for (int n8 = 0; n8 < 8; ++n8) {
                d[n8] = dn[n8];
                m[n8] = mn[n8];
            }
        }
    }
    finish<MT, EPI>(p, st.acc, red, warp, g, t);
}

// ---------------------------------------------------------------------------------------------
// Swapped operands (entry points int4_gemm_swap_EPI_SC for m <= 8, int4_gemm_swap16_EPI_SC for
// m <= 32): C^T = W^T x^T, so the weights are the mma A operand and the rows of x its N
// dimension. Lane (g, t)'s four words hold, per word j, the A quad of the 16-column tile
// 16 j .. 16 j + 15 as they are: a0 = nibble pair 0 (column 16 j + g, k 2t, 2t + 1), a1 = pair 2
// (column 16 j + 8 + g), a2 = pair 1 (k 2t + 8, 2t + 9), a3 = pair 3. The B fragment of n-tile nt
// is x row 8 nt + g (words kt * 8 + t and + 4), and C holds columns 16 j + g / 16 j + 8 + g of
// x rows 8 nt + 2t, 8 nt + 2t + 1. Per k-tile: the 4 words expanded once, 4 NT mma; no empty
// fragment rows. Same work split, fold and epilogue.
//
// Row groups (swap16): grid.x = n / 64 * G with G = ceil(m / 16); CTA x handles slab x / G and
// rows 16 (x % G) onwards. The G CTAs of a slab are adjacent in launch order, so they run
// together and the second one's weight reads hit L2: DRAM reads the weights once for 32 rows.
// Split-K counters are per CTA column (counters[x], n / 64 * G of them).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 load_u16(const u16* p) {
    u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

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

__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// The swapped kernel's k loop: acc = this warp's sums over fold units [u_begin, u_end) of slab
// `slab`, x rows row0 onwards; `groups` row groups share the slab's weights (L2 policy).
// PDL: the first ring of weight loads goes out before griddepcontrol.wait, everything that
// reads x or writes after it (STOKE_INT4_PDL).
template <bool F16S, int KB, int NT, bool LATE = STOKE_INT4_FOLD_LATE != 0, bool PDL = false>
__device__ __forceinline__ void swap_units(const Int4GemmParams& p, u32 slab, u32 row0, u32 groups, u32 u_begin,
                                           u32 u_end, float (&acc)[NT][4][4]) {
    constexpr bool RING = STOKE_INT4_SWAP_PIPELINE != 0;
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
#if STOKE_INT4_PROBE_ARITH
    u32 probe = 0;
#endif
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
    // LATE (STOKE_INT4_FOLD_LATE; not in the stream-K form, where the second set spills): units
    // of 8 k-tiles with a ring of 4 or 8 slots, so a unit's slots are static; each unit
    // accumulates into one of two partial sets (part for the first of a pair of units, pb for
    // the second) and the other set is folded after the first mma of the next unit is issued.
    const bool late = LATE && RING && fkt == 8 && 8 % KB == 0 && !STOKE_INT4_PROBE_ARITH;
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

    // KB slots of loads (a 16 x 64 weight strip and the x fragments per k-tile). RING: a slot is
    // refilled with the k-tile KB ahead as soon as it has been used, so KB - 1 k-tiles are always
    // in flight; else the slots are filled KB at a time and used before the next batch is asked.
    uint4 w[KB];
    u32 b0[KB][NT], b1[KB][NT];
    auto fill_w = [&](int s) {
        w[s] = load_stream(wp, policy);
        if (STOKE_INT4_W_ADVANCE) wp += wstep;
    };
    auto fill_x = [&](int s) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            b0[s][nt] = load_u32(xr[nt]);
            b1[s][nt] = load_u32(xr[nt] + 4);
            xr[nt] += STOKE_INT4_X_STEP;
        }
    };
    auto fill = [&](int s) {
        fill_w(s);
        fill_x(s);
    };
    if (RING && PDL) {  // the weights first, then (after the previous kernel) x
#pragma unroll
        for (int s = 0; s < KB; ++s)
            if (u32(s) < tiles) fill_w(s);
        griddep_wait();
#pragma unroll
        for (int s = 0; s < KB; ++s)
            if (u32(s) < tiles) fill_x(s);
    } else if (RING) {
#pragma unroll
        for (int s = 0; s < KB; ++s)
            if (u32(s) < tiles) fill(s);
    } else if (PDL) {
        griddep_wait();
    }
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
        if (!RING) {
#pragma unroll
            for (int s = 0; s < KB; ++s)
                if (i0 + s < tiles) fill(s);
        }
#pragma unroll
        for (int s = 0; s < KB; ++s) {
            if (i0 + s >= tiles) break;
#if STOKE_INT4_PROBE == 1
            probe ^= w[s].x ^ w[s].y ^ w[s].z ^ w[s].w;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) probe ^= b0[s][nt] ^ b1[s][nt];
#else
            mma_tile(part, w[s], b0[s], b1[s]);
            if (STOKE_INT4_PROBE != 2) add_x_sums(sx, b0[s], b1[s]);
#endif
            if (RING && i0 + s + KB < tiles) fill(s);
            if (++in_unit < fkt) continue;
            in_unit = 0;
#if STOKE_INT4_PROBE_ARITH
#pragma unroll
            for (int i = 0; i < 8; ++i) probe ^= dm[i];
            ++unit;
            gw.next();
            if (unit < u_end) load_scales(gw.row, dm);
            continue;
#endif
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
#if STOKE_INT4_PROBE == 2
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[nt][j][c] = part[nt][j][c];
#endif
#if STOKE_INT4_PROBE_ARITH
    acc[0][0][1] = __uint_as_float(probe);
#endif
}

// Stream-K (entry points int4_gemm_swapk_EPI_SC, m <= 8, launched with p.splits == 0 and at
// most one CTA per resident slot): the slabs' fold units, slab after slab, are dealt evenly to
// every warp of the grid, so every SM streams the same bytes whatever the shape (no partial
// second wave, no SM with a CTA fewer). A warp's range may end inside a slab and go on into the
// next: each piece's sums are added into the workspace, and the warp whose units complete the
// slab's count (counters[slab], in fold units) applies the epilogue and puts zeros back.
// Opt-in: faster than the split-K plan only on some shapes (docs/PERF_NOTES.md).
template <int EPI, bool F16S, int KB>
__device__ __forceinline__ void swap_stream_k(const Int4GemmParams& p) {
    const u32 lane = threadIdx.x & 31;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 units = p.k / 16 / p.fold_kt;
    const u64 total = u64(units) * (p.n / 64);
    const u64 workers = u64(gridDim.x) * WARPS, worker = u64(blockIdx.x) * WARPS + (threadIdx.x >> 5);
    u64 b = total * worker / workers;
    const u64 end = total * (worker + 1) / workers;
    while (b < end) {
        const u32 slab = u32(b / units), u0 = u32(b - u64(slab) * units);
        const u32 u1 = u32(min(end - u64(slab) * units, u64(units)));
        float acc[1][4][4];
        swap_units<F16S, KB, 1, false>(p, slab, 0, 1, u0, u1, acc);
        // Columns 16 j + 8 h + g of x rows 2t, 2t + 1.
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (2 * t + r < p.m)
                        atomicAdd(p.workspace + u64(2 * t + r) * p.n + slab * 64 + 16 * j + 8 * h + g, acc[0][j][2 * h + r]);
        __threadfence();
        __syncwarp();
        u32 last = 0;
        if (lane == 0) last = atomicAdd(p.counters + slab, u1 - u0) + (u1 - u0) == units;
        last = __shfl_sync(0xffffffffu, last, 0);
        if (last) {
            __threadfence();
            store_from_workspace<EPI>(p, slab, 0, p.m, lane, 32);
            if (lane == 0) p.counters[slab] = 0;
        }
        b = u64(slab) * units + u1;
    }
}

template <int EPI, bool F16S, int KB, int NT>
__device__ __forceinline__ void int4_gemm_swap(const Int4GemmParams& p) {
    __shared__ float red[WARPS * 16 * RED_PITCH];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 groups = gridDim.x / (p.n / 64);  // row groups (1 unless swap16 with m > 16)
    const u32 slab = blockIdx.x / groups, row0 = (blockIdx.x % groups) * 8 * NT;
    u32 u_begin, u_end;
    warp_units(p, warp, u_begin, u_end);
    // PDL: the next kernel on the stream may start launching now; its CTAs take SM slots as
    // this grid's CTAs exit and wait (griddepcontrol.wait) before touching what this one writes.
    if (STOKE_INT4_PDL) asm volatile("griddepcontrol.launch_dependents;");
    float acc[NT][4][4];
    swap_units<F16S, KB, NT, STOKE_INT4_FOLD_LATE != 0, STOKE_INT4_PDL != 0>(p, slab, row0, groups, u_begin, u_end, acc);
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

// ---------------------------------------------------------------------------------------------
// Warpgroup kernels (entry points int4_gemm_wg_EPI_SC_nN, N = 8, 16 or 32: most rows per
// launch): C^T = W^T x^T on Hopper's warpgroup MMA. The CTA is one warpgroup (4 warps) and owns
// a 64-column slab and a contiguous range of k (grid = (n / 64, splits)). Per k-tile one
// wgmma.m64nNk16 takes the slab's 64 columns as its A operand from registers (warp w: columns
// 16 w .. 16 w + 15, which is word w of every lane's 16-byte strip: each word already is an
// m16n8k16 A quad, nibble pairs 0, 2, 1, 3) and x's k-tile as B from shared memory. The
// tensor-core instructions per k-tile no longer grow with the rows, where mma.sync needs one
// per 8 rows and 16 columns.
// Steps of 4 k-tiles, batches of STOKE_INT4_WG_BATCH steps: warp w loads k-tile 4 s + w of
// each step s of the next batch (one 16-byte load per lane and step, all in flight while this
// batch computes) and, when the batch begins, writes its words to shared memory, word j into
// region j; after the batch's barrier warp j reads its column tile of each k-tile back (4-byte
// accesses, conflict-free both ways). One wait per batch: ptxas tracks every load of a
// register ring on one scoreboard and waits for all of them at the first use, so a per-step
// ring (the first form) drained every step (about 1 us per step, 1.1 TB/s at best).
// x comes by the copy engine (cp.async.bulk.tensor, one box of 64 k x N rows x 4 steps per
// batch from a 3-D tensor map the runtime encodes per launch, 128-byte swizzle, rows past m and
// blocks past k zero-filled), completing on one mbarrier per buffer: no thread copies x and no
// proxy fence is needed (at 16 and 32 rows, x through cp.async took 1.24-3.7x the time, through
// registers 1.07-1.95x: docs/PERF_NOTES.md). The steps of a batch overlap (two sets of registers):
// a step's expansion waits only for the wgmma two steps back, a unit's fold for its own last
// step; the wgmma drain once per batch (ptxas serializes wgmma left in flight across the
// batch's loads, barrier and waits: C7513). The plan uses these kernels from 9 rows on
// (`wg_rows`); x must be 16-byte aligned.
// The nibbles become q - 8 exactly (LOP3 to 128 + q, then minus 136), so the tensor core sums
// x (q - 8) over a fold unit into P (the unit's first k-tile overwrites: scale-d 0), and the
// unit's end folds acc += d P per column. Symmetric weights only, fold units of 4 or 8 k-tiles
// (group 64 and up), k ranges in whole units. (The asymmetric form would also need the units'
// sums of x: a second wgmma chain against A = ones made ptxas serialize every wgmma, C7511, or
// take 246 registers to pipeline them; those weights stay on the other kernels.)
// ---------------------------------------------------------------------------------------------

// Steps per batch (4 k-tiles each); weights, scales and x of the next batch are in flight while
// one computes. 8 (with 3 CTAs per SM at 16 and 32 rows, whose shared memory and registers it
// needs): 0.72-0.99x the speed on most points (70B qkv m32 20.9 -> 29.0 us), the batch's own
// instructions halved per step notwithstanding (results/experiments/h200-int4-wg-batch8-ff4e41d.json).
#ifndef STOKE_INT4_WG_BATCH
#define STOKE_INT4_WG_BATCH 4
#endif
// 1: a batch with all its steps in the CTA's range loads and stores them without checking each
// against the range (a second copy of that code for the last, partial batch); 0: every batch
// checks every step.
#ifndef STOKE_INT4_WG_FULL
#define STOKE_INT4_WG_FULL 1
#endif
// Timing probes of the warpgroup kernels (wrong results; the GPU test skips them): 1 leaves out
// the bf16x2 FMA that takes 128 + q to q - 8 (what the units' sums of x would save), 2 the
// whole nibble expansion (LOP3, shifts and FMA).
#ifndef STOKE_INT4_WG_PROBE
#define STOKE_INT4_WG_PROBE 0
#endif
// Resident CTAs per SM the warpgroup kernels' launch bounds ask for, per row tier. n16 at 4
// (128 registers) against 5 (96) at 15cfe24: faster on 7 of 8 benchmark shapes at m = 16 (8B
// gate/up 29.2 -> 24.4 us, 70B qkv 21.5 -> 18.5), slower on 8B qkv (8.8 -> 11.7: its 6
// clustered splits need the fifth slot).
#ifndef STOKE_INT4_WG_MIN_CTAS_N8
#define STOKE_INT4_WG_MIN_CTAS_N8 5
#endif
#ifndef STOKE_INT4_WG_MIN_CTAS_N16
#define STOKE_INT4_WG_MIN_CTAS_N16 4
#endif
#ifndef STOKE_INT4_WG_MIN_CTAS_N32
#define STOKE_INT4_WG_MIN_CTAS_N32 4
#endif
#define STOKE_INT4_WG_MIN_CTAS(N) \
    ((N) == 8 ? STOKE_INT4_WG_MIN_CTAS_N8 : (N) == 16 ? STOKE_INT4_WG_MIN_CTAS_N16 : STOKE_INT4_WG_MIN_CTAS_N32)

// The warpgroup kernels' parameter: the common one and a tensor map of x for the copy engine
// (bf16 [rows, k] seen as 3-D: 64 k, rows, k / 64 blocks; box 64 k x N rows x 4 blocks, 128-byte
// swizzle, rows past the launch's and blocks past k zeros), encoded by the runtime per launch.
// Passed as a __grid_constant__ kernel parameter.
struct __align__(64) TensorMap {
    u64 opaque[16];
};
struct Int4WgParams {
    Int4GemmParams p;
    TensorMap x_map;
};
static_assert(sizeof(Int4WgParams) == 256, "Int4WgParams layout");

static_assert(STOKE_INT4_WG_BATCH % 4 == 0, "x comes in boxes of 4 steps");

template <int N>
struct WgSmem {
    static constexpr u32 W_STEP = 4 * 4 * 128;  // [word j][k-tile i][lane] u32
    static constexpr u32 X_STEP = N * 128;      // N rows x 64 k, bf16, 128-byte swizzle
    static constexpr u32 W_BUF = STOKE_INT4_WG_BATCH * W_STEP;
    static constexpr u32 X_BUF = STOKE_INT4_WG_BATCH * X_STEP;
    // [x 0][x 1][w 0][w 1][2 mbarriers], from a 1024-byte aligned base (the swizzle atoms).
    static constexpr u32 RING = 2 * (X_BUF + W_BUF) + 16;
    static constexpr u32 RED = (N + 15) / 16 * 16 * RED_PITCH * 4;  // one slot (reduce_and_store)
    static constexpr u32 BYTES = (RING > RED ? RING : RED) + 1024;  // + alignment slack
};

// Shared-memory matrix descriptor of x at shared address `addr`: K-major, 128-byte swizzle
// (the copy engine's layout: 8-row atoms of 128-byte rows, 1024 bytes apart: stride byte
// offset), leading byte offset unused (1). k-tile i of a step starts 32 i bytes into the rows.
__device__ __forceinline__ u64 wg_x_desc(u32 addr) {
    return u64((addr & 0x3ffffu) >> 4) | (u64(1) << 16) | (u64(1024 >> 4) << 32) | (u64(1) << 62);
}

// The copy engine's copy of the box at (0, 0, block) of the 3-D `map` to shared `dst`,
// completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, u32 block, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(0), "r"(0), "r"(block), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// d (+)= A x B for one k-tile: A the 64 x 16 bf16 quad of each warp, B the descriptor's x tile;
// scale_d 0 overwrites d.
template <int N>
struct Wgmma;
template <>
struct Wgmma<8> {
    static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u64 desc, u32 scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
    }
};
template <>
struct Wgmma<16> {
    static __device__ __forceinline__ void mma(float (&d)[8], const u32 (&a)[4], u64 desc, u32 scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
            "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
    }
};
template <>
struct Wgmma<32> {
    static __device__ __forceinline__ void mma(float (&d)[16], const u32 (&a)[4], u64 desc, u32 scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
            "%10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
    }
};

// The A quad of q - 8 (bf16 pairs, exact) of word w: nibble pairs 0, 2, 1, 3 (the pair at bits
// 4 i and 16 + 4 i), each 128 + q from a LOP3 (the magic-number trick), minus 136. (Masking
// the odd pairs in place as 128 + 16 q does not work for bf16: 16 q for q >= 8 reaches the
// exponent's low bit.)
__device__ __forceinline__ void centered_quad(u32 w, u32 (&a)[4]) {
#if STOKE_INT4_WG_PROBE == 2
    // Timing probe: no expansion at all (the packed word itself as each register).
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = w ^ i;
    return;
#endif
    const u32 p[4] = {nibble_pair<0>(w), nibble_pair<2>(w), nibble_pair<1>(w), nibble_pair<3>(w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if STOKE_INT4_WG_PROBE == 1
        a[i] = p[i];  // timing probe: 128 + q, the minus 136 left out
#else
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a[i]) : "r"(p[i]), "r"(0x3f803f80u), "r"(0xc308c308u));
#endif
    }
}

__device__ __forceinline__ void sts32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 r;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr) : "memory");
    return r;
}

// A compile-time flag passed to the warpgroup kernel's batch helpers (generic lambdas).
template <bool B>
struct WgFull {
    static constexpr bool value = B;
};

template <int EPI, bool F16S, int N, int FK>
__device__ __forceinline__ void int4_gemm_wg(const Int4WgParams& wgp) {
    const Int4GemmParams& p = wgp.p;
    using L = WgSmem<N>;
    constexpr int ACC = N / 2;  // accumulators per thread of an m64nN tile
    constexpr int Q = STOKE_INT4_WG_BATCH;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2;
    const u32 slab = blockIdx.x;
    // The CTA's k range: whole fold units (a step is 4 k-tiles).
    constexpr u32 fkt = 4 * FK;  // the launch's fold_kt: 4 or 8 (steps per unit FK = 1 or 2)
    constexpr u32 bkt = fkt;
    const u32 blocks = p.k / 16 / bkt;
    const u32 b0 = u32(u64(blocks) * blockIdx.y / p.splits), b1 = u32(u64(blocks) * (blockIdx.y + 1) / p.splits);
    const u32 kt0 = b0 * bkt, steps = (b1 - b0) * bkt / 4;
    const u32 batches = (steps + Q - 1) / Q;
    if (STOKE_INT4_PDL) asm volatile("griddepcontrol.launch_dependents;");

    const u32 smem = (smem_u32(int4_dyn_smem) + 1023) & ~1023u;
    const u32 xbuf = smem, wbuf = smem + 2 * L::X_BUF, bars = wbuf + 2 * L::W_BUF;
    if (threadIdx.x == 0) {
        mbar_init(bars, 1);
        mbar_init(bars + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // This warp's k-tile of each step: kt0 + 4 s + warp; wnext walks them (the next load).
    const uint4* wnext = static_cast<const uint4*>(p.words) +
                         (u64(kt0 + warp) * p.kt_stride + u64(slab) * p.slab_stride) * 32 + lane;
    const u64 wstep = u64(p.kt_stride) * 4 * 32;
    // The lane's columns: c0 = 16 warp + g (accumulators 4 j + 0 / 1) and c0 + 8 (4 j + 2 / 3);
    // snext: their scales in the row of the next unit to load (ig: that unit's place in its
    // group of upg units).
    GroupWalk gl(p, kt0 / fkt);
    const u16* snext = static_cast<const u16*>(p.scales) + u64(gl.row) * p.n + slab * 64 + 16 * warp + g;
    u32 ig = gl.in_group;
    const u32 upg = gl.units_per_group;
    // Loads of one batch: each step's weights, and the scales of each fold unit that begins in
    // it (a unit begins at every FK-th step of a batch: compile-time). `full` (WgFull<true>): the
    // batch has all Q steps, so no step is checked against the range.
    uint4 wr[Q];
    u32 sc[Q][2];  // a unit's scales of c0 and c0 + 8 (kept apart: combining them would wait for the loads)
    auto load_batch = [&](u32 bt, auto full) {
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            if (decltype(full)::value || bt * Q + j < steps) {
                wr[j] = load_stream(wnext, policy);
                wnext += wstep;
                if (j % FK == 0) {
                    if (bt > 0 || j > 0) {
                        if (++ig == upg) {
                            ig = 0;
                            snext += p.n;
                        }
                    }
                    sc[j][0] = load_u16(snext);
                    sc[j][1] = load_u16(snext + 8);
                }
            }
        }
    };
    // x of batch bt into buffer bt % 2 by the copy engine (boxes of 64 k x N rows x 4 steps,
    // rows past m zero-filled), completing on that buffer's mbarrier; thread 0 issues it. A
    // partial last batch gets whole boxes too: past the CTA's k range the loop pads with zero
    // weights, and past k the copy engine fills zeros.
    auto copy_x = [&](u32 bt) {
        if (threadIdx.x != 0) return;
        const u32 bar = bars + 8 * (bt & 1);
        mbar_expect_tx(bar, L::X_BUF);
#pragma unroll
        for (int i = 0; i < Q / 4; ++i)
            tma_load_3d(xbuf + (bt & 1) * L::X_BUF + 4 * i * L::X_STEP, &wgp.x_map, kt0 / 4 + bt * Q + 4 * i, bar);
    };
    if (batches > 0) {
        if (STOKE_INT4_WG_FULL && Q <= steps) load_batch(0, WgFull<true>{});
        else load_batch(0, WgFull<false>{});
    }
    if (STOKE_INT4_PDL) griddep_wait();
    if (batches > 0) copy_x(0);

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;
    u32 d01 = 0;  // the current unit's scales of c0 (low half) and c0 + 8 (high half)
    auto fold = [&](const float(&pp)[ACC]) {
        const float f0 = scale_value<F16S>(d01), f1 = scale_value<F16S>(d01 >> 16);
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = fmaf((i & 2) ? f1 : f0, pp[i], acc[i]);
    };
    // The batch's weights go to shared memory (word j to region j), its scales to scb.
    u32 scb[Q];
    auto store_batch = [&](u32 bt, u32 ws0, auto full) {
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            const u32 st = ws0 + j * L::W_STEP + warp * 128 + lane * 4;
            if (decltype(full)::value || bt * Q + j < steps) {
                sts32(st, wr[j].x);
                sts32(st + 512, wr[j].y);
                sts32(st + 1024, wr[j].z);
                sts32(st + 1536, wr[j].w);
                scb[j] = sc[j][0] | sc[j][1] << 16;
            }
        }
        if (!decltype(full)::value) {
            // The padding steps of a partial last batch (see the loop below): zero weights
            // (q = 8), zero scales.
#pragma unroll
            for (int j = 1; j < Q; ++j) {
                const u32 st = ws0 + j * L::W_STEP + warp * 128 + lane * 4;
                if (bt * Q + j >= steps) {
                    sts32(st, 0x88888888u);
                    sts32(st + 512, 0x88888888u);
                    sts32(st + 1024, 0x88888888u);
                    sts32(st + 1536, 0x88888888u);
                    scb[j] = 0;
                }
            }
        }
    };
    // This warp's column tile of step j's 4 k-tiles from the batch's shared memory.
    auto read_step = [&](u32 ws0, int j, u32(&wd)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) wd[i] = lds32(ws0 + j * L::W_STEP + warp * 512 + i * 128 + lane * 4);
    };

    // Two sets of A quads (step j uses set j % 2) and of partial sums (unit u uses set u % 2):
    // step j's expansion waits only for step j - 2's wgmma, and a unit is folded once the next
    // unit's first step is issued and its own last step done (wait_group 1). Units never
    // straddle batches and a batch holds an even number of them (16 / fold_kt), so the sets'
    // indices are compile-time constants. Every batch runs all Q steps: ptxas pipelines the
    // wgmma only without early exits (C7513), so a last, partial batch is padded with steps of
    // zero weights (q = 8), zero scales and x boxes past k (the copy engine's zero fill).
    float part[2][ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) part[0][i] = part[1][i] = 0.0f;
    u32 a[2][4][4];
    for (u32 bt = 0; bt < batches; ++bt) {
        const u32 ws0 = wbuf + (bt & 1) * L::W_BUF;
        const u64 xdesc = wg_x_desc(xbuf + (bt & 1) * L::X_BUF);
        // Drained once per batch: the x buffer the next copy overwrites was read by the last one.
        wg_wait_all();
        if (bt > 0) fold(part[1]);  // the previous batch's last unit
        // Only a last, partial batch checks its steps against the range (and pads).
        if (STOKE_INT4_WG_FULL && (bt + 1) * Q <= steps) store_batch(bt, ws0, WgFull<true>{});
        else store_batch(bt, ws0, WgFull<false>{});
        __syncthreads();
        if (bt + 1 < batches) {
            if (STOKE_INT4_WG_FULL && (bt + 2) * Q <= steps) load_batch(bt + 1, WgFull<true>{});
            else load_batch(bt + 1, WgFull<false>{});
            copy_x(bt + 1);
        }
        mbar_wait(bars + 8 * (bt & 1), (bt >> 1) & 1);
#pragma unroll
        for (int j = 0; j < Q; ++j) {
            const int par = (j / FK) & 1;
            const bool first = j % FK == 0;
            u32 wd[4];
            read_step(ws0, j, wd);
            if (j >= 2) wg_wait_1();
#pragma unroll
            for (int i = 0; i < 4; ++i) centered_quad(wd[i], a[j & 1][i]);
            wg_fence();
#pragma unroll
            for (int i = 0; i < 4; ++i)
                Wgmma<N>::mma(part[par], a[j & 1][i], xdesc + (j * L::X_STEP + i * 32) / 16, !(first && i == 0));
            wg_commit();
            if (first) {
                if (j > 0) {
                    wg_wait_1();
                    fold(part[par ^ 1]);
                }
                d01 = scb[j];
            }
        }
    }
    wg_wait_all();
    if (batches > 0) fold(part[1]);
    __syncthreads();  // every warp is done with the buffers: the reduction reuses them
    // Accumulator i: column 16 warp + g + 8 ((i >> 1) & 1), x row 8 (i >> 2) + 2t + (i & 1).
    // The thread's indices are read again here rather than kept through the loop (registers).
    u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    float* red = reinterpret_cast<float*>(int4_dyn_smem + ((1024 - (smem_u32(int4_dyn_smem) & 1023)) & 1023));
#pragma unroll
    for (int i = 0; i < ACC; ++i)
        red[(8 * (i >> 2) + 2 * (tid & 3) + (i & 1)) * RED_PITCH + 16 * (tid >> 5) + ((tid & 31) >> 2) + 8 * ((i >> 1) & 1)] = acc[i];
    reduce_and_store<(N + 15) / 16, EPI, 1>(p, red, slab, 0);
}

// NAME_dyn_smem, NAME_pdl and NAME_cluster as for the other entry points.
#define INT4_GEMM_WG_ENTRY(NAME, EPI, F16S, N)                                                          \
    extern "C" __device__ unsigned NAME##_dyn_smem = WgSmem<N>::BYTES;                                  \
    extern "C" __device__ unsigned NAME##_pdl = STOKE_INT4_PDL;                                         \
    extern "C" __device__ unsigned NAME##_cluster = STOKE_INT4_CLUSTER;                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, STOKE_INT4_WG_MIN_CTAS(N)) \
        NAME(const __grid_constant__ Int4WgParams p) {                                                  \
        if (p.p.fold_kt == 4)                                                                           \
            int4_gemm_wg<EPI, F16S, N, 1>(p);                                                           \
        else                                                                                            \
            int4_gemm_wg<EPI, F16S, N, 2>(p);                                                           \
    }
#define INT4_GEMM_WG_ENTRIES(EPI_NAME, EPI)                                    \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_bf16s_n8, EPI, false, 8)      \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_bf16s_n16, EPI, false, 16)    \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_bf16s_n32, EPI, false, 32)    \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_f16s_n8, EPI, true, 8)        \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_f16s_n16, EPI, true, 16)      \
    INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##_f16s_n32, EPI, true, 32)
INT4_GEMM_WG_ENTRIES(plain, EPI_PLAIN)
INT4_GEMM_WG_ENTRIES(residual, EPI_RESIDUAL)
INT4_GEMM_WG_ENTRIES(swiglu, EPI_SWIGLU)

// NAME_pdl: 1 where the entry takes part in programmatic dependent launch (STOKE_INT4_PDL);
// NAME_cluster: 1 where its split-K launches may form clusters along k (STOKE_INT4_CLUSTER). The
// runtime reads both when it loads the entry point and launches accordingly.
#define INT4_GEMM_SWAP_ENTRY(NAME, EPI, F16S, KB, NT, MIN_CTAS)                                             \
    extern "C" __device__ unsigned NAME##_pdl = STOKE_INT4_PDL;                                          \
    extern "C" __device__ unsigned NAME##_cluster = STOKE_INT4_CLUSTER;                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) NAME(const Int4GemmParams p) { \
        int4_gemm_swap<EPI, F16S, KB, NT>(p);                                                     \
    }

#define INT4_GEMM_SWAP_ENTRIES(PREFIX, NT, KB, KB_LONG, MIN_CTAS)                                                \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_plain_bf16s, EPI_PLAIN, false, KB, NT, MIN_CTAS)                            \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_plain_f16s, EPI_PLAIN, true, KB, NT, MIN_CTAS)                              \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_residual_bf16s, EPI_RESIDUAL, false, KB, NT, MIN_CTAS)                      \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_residual_f16s, EPI_RESIDUAL, true, KB, NT, MIN_CTAS)                        \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_swiglu_bf16s, EPI_SWIGLU, false, KB, NT, MIN_CTAS)                          \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_swiglu_f16s, EPI_SWIGLU, true, KB, NT, MIN_CTAS)                            \
    /* Long streams (the plan's LONG_STREAM_TILES k-tiles per warp and more): a deeper ring. */              \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_plain_bf16s_long, EPI_PLAIN, false, KB_LONG, NT, MIN_CTAS)                  \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_plain_f16s_long, EPI_PLAIN, true, KB_LONG, NT, MIN_CTAS)                    \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_residual_bf16s_long, EPI_RESIDUAL, false, KB_LONG, NT, MIN_CTAS)            \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_residual_f16s_long, EPI_RESIDUAL, true, KB_LONG, NT, MIN_CTAS)              \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_swiglu_bf16s_long, EPI_SWIGLU, false, KB_LONG, NT, MIN_CTAS)                \
    INT4_GEMM_SWAP_ENTRY(PREFIX##_swiglu_f16s_long, EPI_SWIGLU, true, KB_LONG, NT, MIN_CTAS)

#define INT4_GEMM_SWAPK_ENTRY(NAME, EPI, F16S)                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, STOKE_INT4_SWAP_MIN_CTAS) NAME(const Int4GemmParams p) { \
        swap_stream_k<EPI, F16S, STOKE_INT4_SWAPK_KB>(p);                                                    \
    }
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_plain_bf16s, EPI_PLAIN, false)
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_plain_f16s, EPI_PLAIN, true)
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_residual_bf16s, EPI_RESIDUAL, false)
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_residual_f16s, EPI_RESIDUAL, true)
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_swiglu_bf16s, EPI_SWIGLU, false)
INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_swiglu_f16s, EPI_SWIGLU, true)

INT4_GEMM_SWAP_ENTRIES(int4_gemm_swap, 1, STOKE_INT4_SWAP_KB, STOKE_INT4_SWAP_KB_LONG, STOKE_INT4_SWAP_MIN_CTAS)
INT4_GEMM_SWAP_ENTRIES(int4_gemm_swap16, 2, STOKE_INT4_SWAP16_KB, STOKE_INT4_SWAP16_KB_LONG, STOKE_INT4_SWAP16_MIN_CTAS)

// NAME_dyn_smem: the dynamic shared memory the entry needs (the shared-memory ring's; the runtime
// reads it when it loads the entry point and launches with it); NAME_cluster as above.
#define INT4_GEMM_ENTRY(NAME, ROWS, MIN_CTAS, EPI, F16S)                                              \
    extern "C" __device__ unsigned NAME##_dyn_smem = batched_dyn_smem(ROWS);                        \
    extern "C" __device__ unsigned NAME##_cluster = STOKE_INT4_CLUSTER;                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) NAME(const Int4GemmParams p) { \
        int4_gemm<ROWS, EPI, F16S>(p);                                                    \
    }

INT4_GEMM_ENTRY(int4_gemm_plain_bf16s_m8, 8, 3, EPI_PLAIN, false)
INT4_GEMM_ENTRY(int4_gemm_plain_bf16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_PLAIN, false)
INT4_GEMM_ENTRY(int4_gemm_plain_bf16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_PLAIN, false)
INT4_GEMM_ENTRY(int4_gemm_plain_f16s_m8, 8, 3, EPI_PLAIN, true)
INT4_GEMM_ENTRY(int4_gemm_plain_f16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_PLAIN, true)
INT4_GEMM_ENTRY(int4_gemm_plain_f16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_PLAIN, true)
INT4_GEMM_ENTRY(int4_gemm_residual_bf16s_m8, 8, 3, EPI_RESIDUAL, false)
INT4_GEMM_ENTRY(int4_gemm_residual_bf16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_RESIDUAL, false)
INT4_GEMM_ENTRY(int4_gemm_residual_bf16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_RESIDUAL, false)
INT4_GEMM_ENTRY(int4_gemm_residual_f16s_m8, 8, 3, EPI_RESIDUAL, true)
INT4_GEMM_ENTRY(int4_gemm_residual_f16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_RESIDUAL, true)
INT4_GEMM_ENTRY(int4_gemm_residual_f16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_RESIDUAL, true)
INT4_GEMM_ENTRY(int4_gemm_swiglu_bf16s_m8, 8, 3, EPI_SWIGLU, false)
INT4_GEMM_ENTRY(int4_gemm_swiglu_bf16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_SWIGLU, false)
INT4_GEMM_ENTRY(int4_gemm_swiglu_bf16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_SWIGLU, false)
INT4_GEMM_ENTRY(int4_gemm_swiglu_f16s_m8, 8, 3, EPI_SWIGLU, true)
INT4_GEMM_ENTRY(int4_gemm_swiglu_f16s_m16, 16, STOKE_INT4_M16_MIN_CTAS, EPI_SWIGLU, true)
INT4_GEMM_ENTRY(int4_gemm_swiglu_f16s_m32, 32, STOKE_INT4_M32_MIN_CTAS, EPI_SWIGLU, true)
