// W4A16 GEMM on Hopper's warpgroup MMA (entry points int4_gemm_wg_EPI_SC_nN, N = 8, 16 or 32:
// most rows per launch; int4_gemm.cuh has the contract, the epilogues and the split-K
// reduction): C^T = W^T x^T on Hopper's warpgroup MMA. The CTA is one warpgroup (4 warps) and owns
// a 64-column slab and a contiguous range of k (grid = (n / 64, splits)). Per k-tile one
// wgmma.m64nNk16 takes the slab's 64 columns as its A operand from registers (warp w: columns
// 16 w .. 16 w + 15, which is word w of every lane's 16-byte strip: each word already is an
// m16n8k16 A quad, nibble pairs 0, 2, 1, 3) and x's k-tile as B from shared memory. The
// tensor-core instructions per k-tile no longer grow with the rows, where mma.sync needs one
// per 8 rows and 16 columns.
// Steps of 4 k-tiles, batches of WG_BATCH steps: warp w loads k-tile 4 s + w of
// each step s of the next batch (one 16-byte load per lane and step, all in flight while this
// batch computes) and, when the batch begins, writes its words to shared memory, word j into
// region j; after the batch's barrier warp j reads its column tile of each k-tile back (4-byte
// accesses, conflict-free both ways). One wait per batch: ptxas tracks every load of a
// register ring on one scoreboard and waits for all of them at the first use, so a per-step
// ring (the first form) drained every step .
// x comes by the copy engine (cp.async.bulk.tensor, one box of 64 k x N rows x 4 steps per
// batch from a 3-D tensor map the runtime encodes per launch, 128-byte swizzle, rows past m and
// blocks past k zero-filled), completing on one mbarrier per buffer: no thread copies x and no
// proxy fence is needed (x through cp.async or through registers was slower at 16 and 32 rows). The steps of a batch overlap (two sets of registers):
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
//
// The algorithm's parameters:
//   WG_BATCH  steps (of 4 k-tiles) per batch: 4. Eight halves the batch's own instructions per
//             step but needs the shared memory and registers of a third CTA per SM at 16 and
//             32 rows, and was slower on most shapes.
//   wg_min_ctas(N)  resident CTAs per SM the launch bounds ask for: 5 at 8 rows (96
//             registers), 4 at 16 and 32 (128). At 16 rows 4 was faster than 5 on 7 of 8
//             benchmark shapes; the shape that lost (8B qkv) needs the fifth slot for its
//             clustered splits.

#include "ptx.cuh"
#include "kv_row.cuh"
#include "int4_gemm.cuh"

constexpr int WG_BATCH = 4;
__host__ __device__ constexpr int wg_min_ctas(int n) { return n == 8 ? 5 : 4; }

// The warpgroup kernels' parameter: the common one and a tensor map of x for the copy engine
// (bf16 [rows, k] seen as 3-D: 64 k, rows, k / 64 blocks; box 64 k x N rows x 4 blocks, 128-byte
// swizzle, rows past the launch's and blocks past k zeros), encoded by the runtime per launch.
// Passed as a __grid_constant__ kernel parameter.
struct Int4WgParams {
    Int4GemmParams p;
    TensorMap x_map;
};
static_assert(sizeof(Int4WgParams) == 320, "Int4WgParams layout");

static_assert(WG_BATCH % 4 == 0, "x comes in boxes of 4 steps");

template <int N>
struct WgSmem {
    static constexpr u32 W_STEP = 4 * 4 * 128;  // [word j][k-tile i][lane] u32
    static constexpr u32 X_STEP = N * 128;      // N rows x 64 k, bf16, 128-byte swizzle
    static constexpr u32 W_BUF = WG_BATCH * W_STEP;
    static constexpr u32 X_BUF = WG_BATCH * X_STEP;
    // [x 0][x 1][w 0][w 1][2 mbarriers], from a 1024-byte aligned base (the swizzle atoms).
    static constexpr u32 RING = 2 * (X_BUF + W_BUF) + 16;
    static constexpr u32 RED = (N + 15) / 16 * 16 * RED_PITCH * 4;  // one slot (reduce_and_store)
    static constexpr u32 BYTES = (RING > RED ? RING : RED) + 1024;  // + alignment slack
};

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
    const u32 p[4] = {nibble_pair<0>(w), nibble_pair<2>(w), nibble_pair<1>(w), nibble_pair<3>(w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a[i]) : "r"(p[i]), "r"(0x3f803f80u), "r"(0xc308c308u));
    }
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
    constexpr int Q = WG_BATCH;
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
    if (p.qkv == nullptr) griddep_launch_dependents();  // see QKV_NO_EARLY_TRIGGER in int4_gemm.cuh

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
        if (Q <= steps) load_batch(0, WgFull<true>{});
        else load_batch(0, WgFull<false>{});
    }
    griddep_wait();
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
        const u64 xdesc = smem_desc_sw128(xbuf + (bt & 1) * L::X_BUF);
        // Drained once per batch: the x buffer the next copy overwrites was read by the last one.
        wg_wait_all();
        if (bt > 0) fold(part[1]);  // the previous batch's last unit
        // Only a last, partial batch checks its steps against the range (and pads).
        if ((bt + 1) * Q <= steps) store_batch(bt, ws0, WgFull<true>{});
        else store_batch(bt, ws0, WgFull<false>{});
        __syncthreads();
        if (bt + 1 < batches) {
            if ((bt + 2) * Q <= steps) load_batch(bt + 1, WgFull<true>{});
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

#define INT4_GEMM_WG_ENTRY(NAME, EPI, F16S, N)                                             \
    INT4_GEMM_EXPORTS(NAME, 1, WgSmem<N>::BYTES)                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, wg_min_ctas(N))               \
        NAME(const __grid_constant__ Int4WgParams p) {                                     \
        if (p.p.fold_kt == 4)                                                              \
            int4_gemm_wg<EPI, F16S, N, 1>(p);                                              \
        else                                                                               \
            int4_gemm_wg<EPI, F16S, N, 2>(p);                                              \
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
