// W4A16 GEMM for 9-32 rows of x on weights the warpgroup kernels cannot take (offsets, or
// groups of 16 / 32 such as GGUF Q4_0 / Q4_1 loaded as they are): entry points
// int4_gemm_EPI_SC_mROWS, ROWS = 16 or 32 rows per launch (int4_gemm.cuh has the contract, the
// epilogues and the split-K reduction).
//
// x is the mma A operand (one m-tile of 16 rows at m16, two at m32), the weights its B
// operand: per lane and k-tile one 16-byte load of weights (4 words = a 16 x 64 strip), and per
// word four LOP3s turning nibble pairs into bf16 pairs 128 + q feeding two mma.m16n8k16 per
// m-tile. The fold of the scales happens once per fold unit (int4_gemm.cuh).
//
// Loads in flight per warp, the algorithm's parameter that sets the speed here:
//   m16  a ring of KB = 4 load slots in registers (a slot refilled with the k-tile 4 ahead as
//        soon as its mma have read it), x loaded per lane from global memory (L2-resident).
//        Moving it to the shared-memory ring was no faster: its time is set inside the SM.
//   m32  a per-warp ring of SMEM_STAGES = 4 stages in dynamic shared memory, each SMEM_KT = 4
//        k-tiles of the warp's weight strips and of its rows of x, copied with cp.async (12
//        k-tiles in flight per warp without holding registers); the mma read the weights back
//        with one 16-byte shared load per lane and x with one ldmatrix.x4 per 16 rows and
//        k-tile. Three stages are as fast as four, six slower.
//   Resident CTAs per SM: 3 at m16, 2 at m32 (the launch bounds).

#include "ptx.cuh"
#include "kv_row.cuh"
#include "int4_gemm.cuh"

constexpr int SMEM_STAGES = 4;

// Per-warp accumulators of one 64-column slab: acc (the warp's result), part (the current fold
// unit's sums of x (128 + q)) and sx (lane-local sums of x over the unit, rows g and g + 8, in
// f32 on CUDA cores: the fold subtracts 128 d S from d P', so S must be as exact as P').
template <int MT>
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
            sx[mt][1] += (bf16_lo(a[mt][1]) + bf16_hi(a[mt][1])) + (bf16_lo(a[mt][3]) + bf16_hi(a[mt][3]));
        }
    }

    // Fold the unit: acc += d * P' + (m - 128 d) * S, per column. d[n8] / m[n8] hold the
    // scale / offset pair of the lane's columns 2t, 2t + 1 of n8 tile n8; sym: m = -8 d.
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
                c[2] = fmaf(d0, part[mt][n8][2], fmaf(m0, s[mt][1], c[2]));
                c[3] = fmaf(d1, part[mt][n8][3], fmaf(m1, s[mt][1], c[3]));
            }
        }
    }
};

// Column (within the 64-column slab) of fragment value pair (c0, c1) of n8 tile n8 for lane t.

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

// The shared-memory ring of the m32 kernels: per warp, SMEM_STAGES stages of SMEM_KT k-tiles, each stage the k-tiles' weight strips (512 bytes each,
// lane l's 16 bytes at 16 l, as it loads them) then x: ROWS rows of 128 bytes, 16-byte chunk c
// of row r (k-tile c / 2, half c % 2) stored at chunk c ^ (r & 7), so the 8 rows an ldmatrix
// matrix reads fall in 8 different bank groups. The reduction at the end reuses the area.
constexpr int SMEM_KT = 4;
template <int ROWS>
struct SmemRing {
    static constexpr u32 W_BYTES = SMEM_KT * 512;
    static constexpr u32 STAGE = W_BYTES + ROWS * 128;
    static constexpr u32 WARP = SMEM_STAGES * STAGE;
    static constexpr u32 RED = WARPS * (ROWS / 16) * 16 * RED_PITCH * 4;
    static constexpr u32 BYTES = WARPS * WARP > RED ? WARPS * WARP : RED;
};
// Dynamic shared memory of a batched entry point (0 without the ring: m16).
__host__ __device__ constexpr unsigned batched_dyn_smem(int rows) {
    return rows == 32 ? SmemRing<32>::BYTES : 0;
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
        if (kt < tiles) cp_async16_stream(stage + j * 512 + lane * 16, wp + kt * wstep, policy);
    }
    const char* x = static_cast<const char*>(p.x);
    const u32 xs = stage + SmemRing<ROWS>::W_BYTES;
#pragma unroll
    for (int i = 0; i < ROWS / 4; ++i) {
        const u32 q = 32 * i + lane, r = q >> 3, c = q & 7;
        const u32 kt = SMEM_KT * b + (c >> 1);
        const bool valid = kt < tiles;
        const char* src = x + u64(min(r, p.m - 1)) * p.k * 2 + (valid ? (kt0 + kt) * 32 + (c & 1) * 16 : 0);
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

template <int ROWS, int EPI, bool F16S>
__device__ __forceinline__ void int4_gemm(const Int4GemmParams& p) {
    constexpr int MT = ROWS == 32 ? 2 : 1;
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

    Accum<MT> st;
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
        // m32: weights and x SMEM_STAGES - 1 stages ahead in the warp's shared-memory ring.
        using R = SmemRing<ROWS>;
        constexpr int S = SMEM_STAGES;
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
    } else {
        // m16: the load slots as a ring in registers, as in the swapped kernel: a slot is refilled with the k-tile KB
        // ahead as soon as its mma have read it; the fold runs when a unit's last k-tile is done.
        ring_start();
        uint4 w[KB];
        u32 a[KB][MT][4];
        auto fill = [&](int s) {
            w[s] = load_stream(wp, policy);
            wp += wstep;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[s][mt][0] = load_u32(xr[mt][0]);
                a[s][mt][2] = load_u32(xr[mt][0] + 4);
                a[s][mt][1] = load_u32(xr[mt][1]);
                a[s][mt][3] = load_u32(xr[mt][1] + 4);
#pragma unroll
                for (int h = 0; h < 2; ++h) xr[mt][h] += 8;
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
    }
    finish<MT, EPI>(p, st.acc, red, warp, g, t);
}

#define INT4_GEMM_ENTRY(NAME, ROWS, MIN_CTAS, EPI, F16S)                                              \
    INT4_GEMM_EXPORTS(NAME, 0, batched_dyn_smem(ROWS))                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) NAME(const Int4GemmParams p) { \
        int4_gemm<ROWS, EPI, F16S>(p);                                                                 \
    }
#define INT4_GEMM_ENTRIES(EPI_NAME, EPI)                                                  \
    INT4_GEMM_ENTRY(int4_gemm_##EPI_NAME##_bf16s_m16, 16, 3, EPI, false)                 \
    INT4_GEMM_ENTRY(int4_gemm_##EPI_NAME##_bf16s_m32, 32, 2, EPI, false)                 \
    INT4_GEMM_ENTRY(int4_gemm_##EPI_NAME##_f16s_m16, 16, 3, EPI, true)                   \
    INT4_GEMM_ENTRY(int4_gemm_##EPI_NAME##_f16s_m32, 32, 2, EPI, true)
INT4_GEMM_ENTRIES(plain, EPI_PLAIN)
INT4_GEMM_ENTRIES(residual, EPI_RESIDUAL)
INT4_GEMM_ENTRIES(swiglu, EPI_SWIGLU)
