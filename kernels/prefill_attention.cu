// Causal prefill attention over packed variable-length sequences, reading the BF16 KV cache that
// the q|k|v epilogue (rope_append in decode_attention.cu) has just written.
//
// A prefill batch is a list of sequences packed row after row without padding: sequence s owns
// rows [first, first + rows) of the query and output tensors, lives in cache slot `slot`, and
// its first row sits at cache position `pos0` (0 for a fresh prompt; the tokens already cached
// for a chunk appended to a longer prompt, or a prompt prefix shared with another sequence).
// Row i of the sequence is at position pos0 + i and attends to cache positions 0 ..= pos0 + i
// of its slot: the prompt's own keys and everything cached before it, so chunked prefill is the
// same kernel. The cache is paged (kv_row.cuh): each key row is found through the slot's page
// table.
//
// Entry points:
//   prefill_attn_bf16_dD  (D 64 / 128) grid (query tiles, heads, sequences), two warpgroups. A
//                         CTA takes 128 query rows of one head of one sequence, 64 per
//                         warpgroup (tiles whose rows start past the sequence's length return at
//                         once; the x index runs backwards so the longest, most causal tiles
//                         start first) and the keys [0, pos0 + last row + 1) of that head's kv
//                         head (GQA: heads / kv_heads query heads share one), 128 at a time.
//
// Per CTA (the FlashAttention-2 schedule on Hopper's warpgroup MMA, bf16 operands, f32 sums):
//   - the query tile and the first key/value tile are copied to shared memory with cp.async
//     (rows past the end zero-filled) in the 128-byte swizzled layout wgmma reads: rows of 128
//     bytes (64 dims), D / 64 panels of them, the 16-byte chunk c of row r at chunk c ^ (r % 8);
//     keys and values share the layout (rows = keys);
//   - per 128-key tile, the next tile's copy is queued into the other buffer first, then per
//     warpgroup S = Q K^T (wgmma m64n128k16, both operands from shared memory, K-major), scaled
//     into log2 units, keys past a row's position set to -inf (only on tiles that reach past the
//     warp's first row), the online softmax (row max over the 4 lanes of a row, the output and
//     row sum rescaled by 2^(old max - new max)), and O += P V (wgmma with P from registers: the
//     S accumulators' layout is the A fragment's, packed to bf16 pairs; V from shared memory as
//     an MN-major operand);
//   - the output divided by the row sum and written as bf16 rows of [rows, heads, D].
// Between the tile barriers the two warpgroups run independently, so one's softmax can overlap
// the other's MMAs; nothing schedules that, and the barrier lines them up again every tile.

#include "ptx.cuh"
#include "kv_row.cuh"

struct PrefillAttnParams {
    const u16* q;     // [rows, heads, D] bf16, RoPE applied
    u16* out;         // [rows, heads, D] bf16
    const u32* seqs;  // [n_seqs][4]: first row, rows, slot, pos0
    KvCache cache;    // the BF16 main cache (k, v: [pages, kv_heads, P, D] bf16)
    u32 n_seqs, heads;
    float scale_log2;  // log2(e) / sqrt(D)
    u32 pad;
};
static_assert(sizeof(PrefillAttnParams) == 104, "PrefillAttnParams layout");

constexpr int PA_BM = 128;   // query rows per CTA (64 per warpgroup)
constexpr int PA_BN = 128;   // keys per tile
constexpr int PA_WARPS = 8;  // warps per CTA

// Dynamic shared memory of the D kernel: the query tile, then two stages of a key and a value
// tile (D * 2 bytes a row, no padding: the swizzle spreads the banks), on a 1024-byte boundary.
template <int D>
struct PrefillShape {
    static constexpr int PANEL_Q = PA_BM * 128;  // one 64-dim panel of the query tile
    static constexpr int PANEL_K = PA_BN * 128;  // one 64-dim panel of a key or value tile
    static constexpr int TILE = PA_BN * D * 2;
    static constexpr int BYTES = PA_BM * D * 2 + 4 * TILE + 1024;
};

// An MN-major shared-memory operand (the K-major one is ptx.cuh's smem_desc_sw128): the same
// 128-byte swizzled rows, one k each (64 n of 2 bytes), 8-k groups 1024 bytes apart (stride
// offset) and 64-n panels `panel` bytes apart (leading offset).
__device__ __forceinline__ u64 desc_mn_major(u32 addr, u32 panel) {
    return u64((addr & 0x3ffffu) >> 4) | (u64((panel >> 4) & 0x3fffu) << 16) | (u64(1024 >> 4) << 32) |
           (u64(1) << 62);
}

// Byte offset of 16-byte chunk `c` (of D / 8) of row `r` in a tile of `panel`-byte panels.
__device__ __forceinline__ u32 swz(u32 r, u32 c, u32 panel) {
    return (c / 8) * panel + r * 128 + (((c % 8) ^ (r % 8)) << 4);
}

// O += P V for 16 keys: P from registers (the A fragment of 64 rows x 16 keys, a thread's 4
// bf16 pairs), V from shared memory as [keys][D] rows, i.e. MN-major (the transpose immediate
// 1); D = 128: d[0..64], D = 64: d[0..32].
__device__ __forceinline__ void wgmma_pv(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.b32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ void wgmma_pv(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.b32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Pins registers a wgmma wrote at this point: uses of them are not moved above the wait before.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int D>
__device__ __forceinline__ void prefill_attn(const PrefillAttnParams& p, u32 smem) {
    using S = PrefillShape<D>;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    const u32 tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const u32 g = lane >> 2, t = lane & 3;
    const uint4 sd = reinterpret_cast<const uint4*>(p.seqs)[blockIdx.z];
    const u32 row0 = sd.x, nrows = sd.y, slot = sd.z, pos0 = sd.w;
    const u32 m0 = (gridDim.x - 1 - blockIdx.x) * PA_BM;
    if (m0 >= nrows) return;
    const u32 head = blockIdx.y;
    const u32 kend = pos0 + min(nrows, m0 + PA_BM);  // keys [0, kend)
    const u32 ntiles = (kend + PA_BN - 1) / PA_BN;
    const KvCache& kc = p.cache;
    const u32 kvhead = head / (p.heads / kc.kv_heads);
    const u16* kbase = static_cast<const u16*>(kc.k);
    const u16* vbase = static_cast<const u16*>(kc.v);
    const u32 qs = (smem + 1023u) & ~1023u, ks = qs + PA_BM * D * 2, vs = ks + 2 * S::TILE;

    for (u32 c = tid; c < PA_BM * CH; c += PA_WARPS * 32) {
        const u32 r = c / CH, col = c % CH;
        const bool ok = m0 + r < nrows;
        const u16* src = p.q + (u64(row0 + (ok ? m0 + r : 0)) * p.heads + head) * D + col * 8;
        cp_async16(qs + swz(r, col, S::PANEL_Q), src, ok ? 16 : 0);
    }
    auto load_kv = [&](u32 j, u32 stage) {
        for (u32 c = tid; c < PA_BN * CH; c += PA_WARPS * 32) {
            const u32 r = c / CH, col = c % CH;
            const u32 key = j * PA_BN + r;
            const bool ok = key < kend;
            const u64 off = kv_row(kc, slot, kvhead, ok ? key : 0) * D + col * 8;
            const u32 dst = stage * S::TILE + swz(r, col, S::PANEL_K);
            cp_async16(ks + dst, kbase + off, ok ? 16 : 0);
            cp_async16(vs + dst, vbase + off, ok ? 16 : 0);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    // o[4 i + c]: row g (+ 8 for c >= 2) of the warp's 16, dim 8 i + 2 t + (c & 1); s alike
    // with key 8 i + 2 t + (c & 1) of the tile.
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const u32 wrow = m0 + wg * 64 + warp * 16;  // the warp's first row in the sequence
    const u32 qpos = pos0 + wrow + g;            // position of row g (row g + 8: qpos + 8)
    const u32 qa = qs + wg * 64 * 128;           // the warpgroup's 64 query rows

    for (u32 j = 0; j < ntiles; ++j) {
        const u32 stage = j & 1;
        // Tile j has landed (every thread's copies, then the barrier), and every warpgroup is
        // done with tile j - 1, whose buffer the next copy refills.
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (j + 1 < ntiles) {
            load_kv(j + 1, stage ^ 1);
            cp_async_commit();
        }
        const u32 kt = ks + stage * S::TILE, vt = vs + stage * S::TILE;
        float s[64];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk % 4) * 32;  // k16 slice within the 64-dim panel
            const u64 dq = smem_desc_sw128(qa + (kk / 4) * S::PANEL_Q + off);
            const u64 dk = smem_desc_sw128(kt + (kk / 4) * S::PANEL_K + off);
            wgmma_bf16_n128(s, dq, dk, kk > 0);
        }
        wg_commit();
        wg_wait_all();
        fence_regs(s);

        const u32 kfirst = j * PA_BN;
        const bool masked = kfirst + PA_BN - 1 > pos0 + wrow;
        float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            float x = s[i] * p.scale_log2;
            if (masked && kfirst + (i / 4) * 8 + 2 * t + (i & 1) > qpos + 8 * ((i >> 1) & 1)) x = NEG_INF;
            s[i] = x;
            mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], x);
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
        for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
        u32 pa[8][4];
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const float e0 = exp2_approx(s[i] - mx[(i >> 1) & 1]);
            const float e1 = exp2_approx(s[i + 1] - mx[(i >> 1) & 1]);
            lrow[(i >> 1) & 1] += e0 + e1;
            // pa[kk]: keys 16 kk .. 16 kk + 15 as the A fragment, the pairs (row g, key 2t),
            // (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8): s[8 kk ..] in order.
            pa[i / 8][(i / 2) % 4] = pack_bf16x2(e0, e1);
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) wgmma_pv(o, pa[kk], desc_mn_major(vt + kk * 16 * 128, S::PANEL_K));
        wg_commit();
        wg_wait_all();
        fence_regs(o);
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
            *reinterpret_cast<u32*>(dst + dt * 8) = pack_bf16x2(o[4 * dt + 2 * r] * inv[r], o[4 * dt + 2 * r + 1] * inv[r]);
    }
}

#define PREFILL_ATTN_ENTRY(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(PA_WARPS * 32, 1) prefill_attn_bf16_d##D(const PrefillAttnParams p) { \
        extern __shared__ __align__(1024) u8 smem_raw[];                                       \
        prefill_attn<D>(p, smem_u32(smem_raw));                                                \
    }

PREFILL_ATTN_ENTRY(64)
PREFILL_ATTN_ENTRY(128)
