// Causal prefill attention over packed variable-length sequences, reading the BF16 KV cache that
// the q|k|v epilogue (rope_append in decode_attention.cu) has just written.
//
// A prefill batch is a list of sequences packed row after row without padding: sequence s owns
// rows [first, first + rows) of the query and output tensors, lives in cache slot `slot`, and
// its first row sits at cache position `pos0` (0 for a fresh prompt; the tokens already cached
// for a chunk appended to a longer prompt). Row i of the sequence is at position pos0 + i and
// attends to cache positions 0 ..= pos0 + i of its slot: the prompt's own keys and everything
// cached before it, so chunked prefill is the same kernel.
//
// Entry points:
//   prefill_attn_bf16_dD  (D 64 / 128) grid (query tiles, heads, sequences), 4 warps. A CTA
//                         takes 64 query rows of one head of one sequence (tiles whose rows
//                         start past the sequence's length return at once; the x index runs
//                         backwards so the longest, most causal tiles start first) and the
//                         keys [0, pos0 + last row + 1) of that head's kv head (GQA: heads /
//                         kv_heads query heads share one), 64 keys at a time.
//
// Per CTA (the FlashAttention-2 schedule on mma.sync m16n8k16, bf16 operands, f32 accumulation):
//   - the query tile and the first key/value tile are copied to shared memory with cp.async
//     (rows past the end zero-filled), then each warp keeps its 16 query rows as A fragments;
//   - per 64-key tile, the next tile's copy is queued into the other buffer first, then
//     S = Q K^T (K rows straight from shared memory as B fragments, ldmatrix), scaled into log2
//     units, keys past a row's position set to -inf (only on tiles that reach past the warp's
//     first row), the online softmax (row max over the 4 lanes of a row, the output and row sum
//     rescaled by 2^(old max - new max)), and O += P V with P repacked from the S accumulators
//     as the A operand and V read transposed (ldmatrix.trans);
//   - the output divided by the row sum and written as bf16 rows of [rows, heads, D].
// Shared rows are padded to D + 8 elements, which puts the eight 16-byte rows an ldmatrix reads
// in distinct banks.

#include "ptx.cuh"

struct PrefillAttnParams {
    const u16* q;     // [rows, heads, D] bf16, RoPE applied
    const u16* k;     // [slots, kv_heads, cap, D] bf16: the main cache
    const u16* v;     // [slots, kv_heads, cap, D] bf16
    u16* out;         // [rows, heads, D] bf16
    const u32* seqs;  // [n_seqs][4]: first row, rows, slot, pos0
    u32 n_seqs, heads, kv_heads, cap;
    float scale_log2;  // log2(e) / sqrt(D)
    u32 pad;
};
static_assert(sizeof(PrefillAttnParams) == 64, "PrefillAttnParams layout");

constexpr int PA_BM = 64;    // query rows per CTA (16 per warp)
constexpr int PA_BN = 64;    // keys per tile
constexpr int PA_WARPS = 4;  // warps per CTA

// Dynamic shared memory of the D kernel: the query tile and two key and two value tiles.
template <int D>
struct PrefillShape {
    static constexpr int P = D + 8;  // row pitch (elements)
    static constexpr int TILE = PA_BN * P * 2;
    static constexpr int BYTES = PA_BM * P * 2 + 4 * TILE;
};

template <int D>
__device__ __forceinline__ void prefill_attn(const PrefillAttnParams& p, u32 smem) {
    constexpr int P = PrefillShape<D>::P, TILE = PrefillShape<D>::TILE, CH = D / 8;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const uint4 sd = reinterpret_cast<const uint4*>(p.seqs)[blockIdx.z];
    const u32 row0 = sd.x, nrows = sd.y, slot = sd.z, pos0 = sd.w;
    const u32 m0 = (gridDim.x - 1 - blockIdx.x) * PA_BM;
    if (m0 >= nrows) return;
    const u32 head = blockIdx.y;
    const u32 kend = pos0 + min(nrows, m0 + PA_BM);  // keys [0, kend)
    const u32 ntiles = (kend + PA_BN - 1) / PA_BN;
    const u32 kvhead = head / (p.heads / p.kv_heads);
    const u64 cache_row = (u64(slot) * p.kv_heads + kvhead) * p.cap;
    const u16* kbase = p.k + cache_row * D;
    const u16* vbase = p.v + cache_row * D;
    const u32 qs = smem, ks = smem + PA_BM * P * 2, vs = ks + 2 * TILE;

    for (u32 c = tid; c < PA_BM * CH; c += PA_WARPS * 32) {
        const u32 r = c / CH, col = c % CH;
        const bool ok = m0 + r < nrows;
        const u16* src = p.q + (u64(row0 + (ok ? m0 + r : 0)) * p.heads + head) * D + col * 8;
        cp_async16(qs + (r * P + col * 8) * 2, src, ok ? 16 : 0);
    }
    auto load_kv = [&](u32 j, u32 stage) {
        for (u32 c = tid; c < PA_BN * CH; c += PA_WARPS * 32) {
            const u32 r = c / CH, col = c % CH;
            const u32 key = j * PA_BN + r;
            const bool ok = key < kend;
            const u64 off = u64(ok ? key : 0) * D + col * 8;
            const u32 dst = stage * TILE + (r * P + col * 8) * 2;
            cp_async16(ks + dst, kbase + off, ok ? 16 : 0);
            cp_async16(vs + dst, vbase + off, ok ? 16 : 0);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    u32 qf[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const u32 wrow = m0 + warp * 16;  // the warp's first row in the sequence
    const u32 qpos = pos0 + wrow + g;  // position of row g (row g + 8: qpos + 8)
    // ldmatrix row addresses of this lane: A operand (Q) and B operand (K) tiles, V transposed.
    const u32 a_row = (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
    const u32 b_row = (lane % 8) + 8 * (lane / 16), b_col = 8 * ((lane / 8) % 2);

    for (u32 j = 0; j < ntiles; ++j) {
        const u32 stage = j & 1;
        if (j + 1 < ntiles) {
            load_kv(j + 1, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc)
                ldmatrix_x4(qf[kc], qs + ((warp * 16 + a_row) * P + kc * 16 + a_col) * 2);
        }
        float s[PA_BN / 8][4];
#pragma unroll
        for (int i = 0; i < PA_BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        const u32 kt = ks + stage * TILE, vt = vs + stage * TILE;
#pragma unroll
        for (int np = 0; np < PA_BN / 16; ++np) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                u32 b[4];
                ldmatrix_x4(b, kt + ((np * 16 + b_row) * P + kc * 16 + b_col) * 2);
                mma_bf16(s[2 * np], qf[kc], b[0], b[1]);
                mma_bf16(s[2 * np + 1], qf[kc], b[2], b[3]);
            }
        }
        const u32 kfirst = j * PA_BN;
        const bool masked = kfirst + PA_BN - 1 > pos0 + wrow;
        float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float x = s[nt][c] * p.scale_log2;
                if (masked && kfirst + nt * 8 + 2 * t + (c & 1) > qpos + 8 * (c >> 1)) x = NEG_INF;
                s[nt][c] = x;
                mx[c >> 1] = fmaxf(mx[c >> 1], x);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            alpha[r] = exp2_approx(mrow[r] - mx[r]);
            mrow[r] = mx[r];
            lrow[r] *= alpha[r];
        }
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[nt][c] = exp2_approx(s[nt][c] - mx[c >> 1]);
                lrow[c >> 1] += s[nt][c];
            }
        }
#pragma unroll
        for (int kk = 0; kk < PA_BN / 16; ++kk) {
            const u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, vt + ((kk * 16 + a_row) * P + dp * 16 + a_col) * 2);
                mma_bf16(o[2 * dp], a, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
        lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
        inv[r] = 1.0f / lrow[r];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 i = wrow + g + 8 * r;
        if (i >= nrows) continue;
        u16* dst = p.out + (u64(row0 + i) * p.heads + head) * D + 2 * t;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<u32*>(dst + dt * 8) = pack_bf16x2(o[dt][2 * r] * inv[r], o[dt][2 * r + 1] * inv[r]);
    }
}

#define PREFILL_ATTN_ENTRY(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(PA_WARPS * 32) prefill_attn_bf16_d##D(const PrefillAttnParams p) { \
        extern __shared__ __align__(128) u8 smem_raw[];                                        \
        prefill_attn<D>(p, smem_u32(smem_raw));                                                \
    }

PREFILL_ATTN_ENTRY(64)
PREFILL_ATTN_ENTRY(128)
