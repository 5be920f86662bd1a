// W4A16 GEMM, the part every kernel family shares: y = x W with x bf16 [m, k], W packed INT4
// [k, n] (docs/INT4_FORMAT.md), f32 accumulation, bf16 output and a fused epilogue. Included
// after ptx.cuh and kv_row.cuh by int4_gemm_swap.cu, int4_gemm_wg.cu and int4_gemm_batched.cu.
//
// Three kernel families, one launch per 32-row chunk of x, chosen by the plan
// (crates/stoke-cuda/src/kernels/int4_gemm.rs):
//   int4_gemm_swap_EPI_SC[_long]        m <= 8: weights as the mma A operand (int4_gemm_swap.cu)
//   int4_gemm_wg_EPI_SC_nN              9-32 rows, symmetric weights with groups of 64 and more:
//                                       Hopper's warpgroup MMA (int4_gemm_wg.cu)
//   int4_gemm_EPI_SC_mROWS              9-32 rows of every other weight (offsets, groups of 16
//                                       or 32: GGUF Q4_0 / Q4_1 as loaded): mma.sync with x as
//                                       the A operand (int4_gemm_batched.cu)
//   EPI  plain     out[r, c] = acc[r, c]
//        residual  out[r, c] = acc[r, c] + residual[r, c]          (sum in f32, rounded once)
//        swiglu    out[r, j] = silu(acc[r, 2j]) * acc[r, 2j + 1]   (gate/up interleaved; out is
//                                                                    [m, n / 2])
//        with qkv (plain only): the decode q|k|v epilogue (QkvRope below): out is q [m, heads * 64]
//        for the whole call (each launch places its rows by row0)
//        where acc = (x W)[r, c] * f[r], f[r] the product of row_scale[r] (when non-null) and
//        the row factor of a folded RMSNorm (when ss_in is non-null, below), else 1.
//   The RMSNorm fold, which takes the norm between two GEMMs off its own launch:
//        producer (norm_gain non-null; residual and plain epilogues): besides out, writes
//          gained[r, c] = out[r, c] * norm_gain[c] (bf16, from the rounded out) and, per 64-column
//          slab j, norm_ss[j * norm_stride + r] = sum over the slab of out[r, c]^2 (f32, from the
//          rounded out; one warp stores each (slab, row), so no atomics and no zeroing);
//        consumer (ss_in non-null, x = the producer's gained): the row factor
//          f[r] = rsqrt(sum_j ss_in[j * norm_stride + r] / k + eps), j < k / 64, so that
//          f[r] (gained W)[r, c] = (rms_norm(out, norm_gain, eps) W)[r, c] up to bf16 rounding.
//   SC   bf16s / f16s: the type of the group scales and offsets.
//
// Work split: block = (128, 1, 1) (4 warps); grid = (n / 64, splits, 1). Each CTA owns a
// 64-column slab; the k range is cut into fold units (fold_kt k-tiles of 16 rows, fold_kt
// dividing both group / 16 and 8) dealt evenly to the splits * 4 warps of the slab. Warps of a
// CTA reduce through shared memory. With splits > 1 the runtime launches the CTAs along k of a
// slab as one thread-block cluster (cluster dims (1, splits, 1), 2-8 splits, where every
// cluster is resident at once): each CTA leaves its reduced tile in its own shared memory and
// CTA q of the cluster sums items q, q + splits, ... across the cluster in a fixed order
// (deterministic) and applies the epilogue. Launched without a cluster (more than 8 splits, or
// clusters that would not all be resident) the CTAs add into `workspace` (f32 [m, n], all zeros
// on entry) and the last CTA to finish (counted in counters[slab], zero on entry) applies the
// epilogue and puts zeros back in both, so the same scratch serves the next launch on the
// stream. k % 16 == 0, n % 64 == 0, group % 16 == 0 and k % group == 0. All pointers 16-byte
// aligned except x, residual and row_scale (4-byte).
//
// The scales never touch the inner loop: each fold unit's partial sums P' = sum x (128 + q)
// (the nibbles become bf16 128 + q exactly with one LOP3: the magic-number trick) are folded
// into the f32 accumulator as d * P' + (m - 128 d) * S, where S = sum of x over the unit, which
// equals sum x (d q + m) exactly in real arithmetic. The symmetric form uses m = -8 d. S is
// summed in f32 on CUDA cores: an mma against a B of ones was less accurate.
//
// Exported with each entry point, read by the runtime when it loads it: NAME_pdl (1: launch
// with programmatic stream serialization), NAME_cluster (1: split-K launches may form clusters
// along k), NAME_dyn_smem (dynamic shared memory the launch needs).

// The decode q|k|v epilogue for heads of 64 (a 64-column slab is one head: q heads, then k, then
// v): RoPE and the cache append of rope_append (decode_attention.cu) on the GEMM's rounded
// outputs, with the same bits; q goes to out ([m, heads * 64]). One per layer in device memory.
// QKV_NO_EARLY_TRIGGER: a launch with it lets the next kernel launch only when it is done (no
// griddepcontrol.launch_dependents), as rope_append, which it replaces, did: each layer's chain
// of programmatic launches ends there, as it did before. The loads of what earlier kernels
// wrote that this epilogue and the norm fold add go through the L2 (.cg).
struct QkvRope {
    const float* rope;    // [max_pos, 32, 2] (cos, sin)
    const u32* slot_of;   // [rows of the call]
    const u32* pos;       // [rows] position of each row's token
    u32* len;             // [rows] written: pos + 1
    KvCache main;         // kv_row.cuh
    KvCache mirror;
    u32 heads, block, max_pos, pad;
};
static_assert(sizeof(QkvRope) == 176, "QkvRope layout");

struct Int4GemmParams {
    const void* x;          // [m, k] bf16, row-major
    const void* words;      // k * n / 8 words in fragment order
    const void* scales;     // [k / group, n] 16-bit scales d
    const void* offsets;    // [k / group, n] 16-bit offsets m, or null: symmetric (m = -8 d)
    void* out;              // [m, n] bf16 ([m, n / 2] for swiglu)
    const void* residual;   // [m, n] bf16 (residual entry points)
    const float* row_scale; // [m] or null
    float* workspace;       // [m, n] f32 zeros (splits != 1 without clusters)
    u32* counters;          // [n / 64 * 2] zeros (splits != 1; one per CTA column)
    const void* norm_gain;  // [n] bf16, or null: no folded RMSNorm reads out (producer side)
    void* gained;           // [m, n] bf16 out * norm_gain (with norm_gain)
    float* norm_ss;         // [n / 64][norm_stride] f32 slab sums of out^2 (with norm_gain)
    const float* ss_in;     // [k / 64][norm_stride] f32, or null: x is not a folded norm's input
    const QkvRope* qkv;     // the decode q|k|v epilogue (plain epilogue), or null
    u32 m, k, n, group;
    u32 fold_kt;            // k-tiles per fold unit
    u32 splits;             // CTAs per slab along k (gridDim.y)
    u32 kt_stride;          // 512-byte blocks between k-tiles of one slab (the word order:
    u32 slab_stride;        //   n / 64 and 1 k-tile major, 1 and k / 16 slab major)
    u32 norm_stride;        // rows between slabs of norm_ss and ss_in (the call's rows)
    float eps;              // the folded norm's epsilon (with ss_in)
    u32 row0;               // the launch's first row in the call (qkv's per-row arrays)
    u32 pad;
};
static_assert(sizeof(Int4GemmParams) == 160, "Int4GemmParams layout");

constexpr int WARPS = 4;
enum { EPI_PLAIN = 0, EPI_RESIDUAL = 1, EPI_SWIGLU = 2 };

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

// bf16 pair (128 + q_lo, 128 + q_hi) from the nibbles at bits 4i and 16 + 4i of w.
template <int I>
__device__ __forceinline__ u32 nibble_pair(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * I)), "r"(0x000f000fu), "r"(0x43004300u));
    return r;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// A folded norm's producer side for columns (c, c + 1) of row r (their rounded values in
// packed): the gained pair, and the slab's sum of squares of the row, reduced across the warp
// (see store_pair). Kept out of line: the kernels' main loops stay at their register budget.
__device__ __noinline__ void norm_out(const u32* gain, u32* gained, float* norm_ss, u32 n, u32 stride, u32 r, u32 c,
                                      u32 packed) {
    // The rounded values, as a norm reading out would see them.
    const float h0 = bf16_lo(packed), h1 = bf16_hi(packed);
    const u32 g = gain[c / 2];
    gained[(u64(r) * n + c) / 2] = pack_bf16x2(h0 * bf16_lo(g), h1 * bf16_hi(g));
    float ss = fmaf(h0, h0, h1 * h1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) norm_ss[u64(c / 64) * stride + r] = ss;
}

// The q|k|v epilogue of columns (c, c + 1) of the call's row grow holding v0, v1 (q_out: the
// call's q, [m, heads * 64]): the lanes of a warp hold one head's 64 values (see store_pair),
// as rope_append's warps do. The row's position is read through the L2 (.cg): the sampler of
// the step before wrote it.
__device__ __noinline__ void qkv_out(const QkvRope* qp, u16* q_out, u32 grow, u32 c, float v0, float v1) {
    const u32 lane = threadIdx.x & 31;
    const u32 item = c / 64, heads = qp->heads;
    const u32 kvh = qp->main.k ? qp->main.kv_heads : qp->mirror.kv_heads;
    const u32 pos = __ldcg(qp->pos + grow);
    if (item == 0 && lane == 0) qp->len[grow] = pos + 1;
    u32 w[1] = {pack_bf16x2(v0, v1)};
    if (item < heads + kvh) {
        // Lane l holds dims 2l, 2l + 1; their rotation partners (d +- 32) are in lane l ^ 16.
        const float* cs = qp->rope + (u64(min(pos, qp->max_pos - 1)) * 32 + (lane & 15) * 2) * 2;
        float y[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float x = bf16_lo(u16(w[0] >> (16 * e)));
            const float other = __shfl_xor_sync(0xffffffffu, x, 16);
            y[e] = rope_rotate(x, other, cs[2 * e], cs[2 * e + 1], lane >= 16);
        }
        w[0] = pack_bf16x2(y[0], y[1]);
    }
    if (item < heads) {
        store_words<1>(q_out + (u64(grow) * heads + item) * 64 + lane * 2, w);
        return;
    }
    const u32 is_v = item >= heads + kvh;
    append_words<64>(qp->main, qp->mirror, qp->block, __ldcg(qp->slot_of + grow), pos, item - heads - is_v * kvh, is_v, kvh,
                     lane, w);
}

// Epilogue for columns (c, c + 1) of row r, c even, with the row's factor f. The 32 lanes of a
// warp call it together for the 32 column pairs of one row of one slab (every caller deals
// (row, pair) items to consecutive threads, 32 per row), which the folded norm's slab sums use.
template <int EPI>
__device__ __forceinline__ void store_pair(const Int4GemmParams& p, u32 r, u32 c, float v0, float v1, float f) {
    v0 *= f;
    v1 *= f;
    if (EPI == EPI_SWIGLU) {
        static_cast<u16*>(p.out)[u64(r) * (p.n / 2) + c / 2] = to_bf16(silu(v0) * v1);
    } else {
        if (EPI == EPI_PLAIN && p.qkv != nullptr) {
            qkv_out(p.qkv, static_cast<u16*>(p.out), p.row0 + r, c, v0, v1);
            return;
        }
        if (EPI == EPI_RESIDUAL) {
            const u32 res = static_cast<const u32*>(p.residual)[(u64(r) * p.n + c) / 2];
            v0 += bf16_lo(res);
            v1 += bf16_hi(res);
        }
        const u32 packed = pack_bf16x2(v0, v1);
        static_cast<u32*>(p.out)[(u64(r) * p.n + c) / 2] = packed;
        if (p.norm_gain != nullptr) {
            norm_out(static_cast<const u32*>(p.norm_gain), static_cast<u32*>(p.gained), p.norm_ss, p.n, p.norm_stride,
                     r, c, packed);
        }
    }
}

// Each row's factor f (store_pair) for rows row0 .. row0 + rows - 1 into f[0 .. rows): the
// product of row_scale and a folded norm's row factor, 1 without either. Every thread of the
// CTA calls it; the caller synchronizes before reading f. A warp takes 8 rows at a time: lane
// 8q + i adds row i's sums of slabs q, q + 4, ..., so one warp load reads 8 consecutive rows
// (one 32-byte sector) of 4 slabs, and two shuffles add the four lanes of a row.
__device__ __noinline__ void row_factors_of(const float* ss_in, const float* row_scale, u32 k, u32 stride, float eps,
                                            u32 row0, u32 rows, float* f) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane >> 3;
    const u32 slabs = k / 64;
    for (u32 r8 = warp * 8; r8 < rows; r8 += (blockDim.x >> 5) * 8) {
        const u32 r = r8 + (lane & 7);
        float v = 1.0f;
        if (ss_in != nullptr) {
            float s = 0.0f;
            if (r < rows) {
#pragma unroll 4
                for (u32 j = q; j < slabs; j += 4) s += __ldcg(ss_in + u64(j) * stride + row0 + r);
            }
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            v = rsqrtf(s / float(k) + eps);
        }
        if (r < rows && q == 0) {
            if (row_scale != nullptr) v *= row_scale[row0 + r];
            f[r] = v;
        }
    }
}
__device__ __forceinline__ void row_factors(const Int4GemmParams& p, u32 row0, u32 rows, float* f) {
    row_factors_of(p.ss_in, p.row_scale, p.k, p.norm_stride, p.eps, row0, rows, f);
}

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

// The epilogue of a slab's finished sums in the workspace, rows row0 .. row0 + rows - 1, putting
// zeros back: items i0, i0 + step, ... of its (row, column pair) items.
template <int EPI>
__device__ __forceinline__ void store_from_workspace(const Int4GemmParams& p, u32 slab, u32 row0, u32 rows, u32 i0,
                                                     u32 step, const float* f) {
    for (u32 i = i0; i < rows * 32; i += step) {
        const u32 r = i / 32, c = 2 * (i % 32);
        float* ws = p.workspace + u64(row0 + r) * p.n + slab * 64 + c;
        const float v0 = load_cg(ws), v1 = load_cg(ws + 1);
        ws[0] = 0.0f;
        ws[1] = 0.0f;
        store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1, f[r]);
    }
}

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
    __shared__ float f[MT * 16];
    auto at = [&](u32 w, u32 row, u32 col) -> float& {
        return red[(w * (MT * 16) + row) * RED_PITCH + col];
    };
    const u32 rows = min(p.m - row0, u32(MT * 16));
    row_factors(p, row0, rows, f);
    __syncthreads();
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
            store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1, f[r]);
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
            store_pair<EPI>(p, row0 + r, slab * 64 + c, v0, v1, f[r]);
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
    store_from_workspace<EPI>(p, slab, row0, rows, threadIdx.x, blockDim.x, f);
    if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
}

extern __shared__ __align__(128) unsigned char int4_dyn_smem[];

// The globals the runtime reads for entry point NAME (see the top of this file).
#define INT4_GEMM_EXPORTS(NAME, PDL, DYN_SMEM)                 \
    extern "C" __device__ unsigned NAME##_pdl = PDL;           \
    extern "C" __device__ unsigned NAME##_cluster = 1;         \
    extern "C" __device__ unsigned NAME##_dyn_smem = DYN_SMEM;
