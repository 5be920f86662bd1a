// Decode attention over a KV cache in one of three formats, with split-KV and a log-sum-exp
// merge, and the cache append that writes each new token's K and V rows. The building blocks
// (conversions, rotation, loads, mma operands, shared-memory layouts, the kernel's parameters)
// are in decode_attention.cuh.
//
// Formats (docs/KV_CACHE_FORMAT.md; crates/stoke-formats/src/kv.rs is the specification), each
// a pool of pages of P = 2^page_shift positions found through the slots' page tables (kv_row in
// kv_row.cuh):
//   BF16  the main cache:  k, v  [pages, kv_heads, P, d] bf16
//   FP8   E4M3 mirror:     k, v  [pages, kv_heads, P, d] u8 codes, ks, vs [pages, kv_heads, P]
//                          f32 scales (amax / 448), value = e4m3(code) * scale
//   INT4  mirror:          k, v [pages, kv_heads, P, d / 2] bytes, value 2j in the low nibble
//                          of byte j, ks, vs f32 scales (amax / 7), value = q * scale
// The mirrors hold rows rotated by the normalized block-diagonal Walsh-Hadamard transform of
// `block` (0: no rotation); the query is rotated the same way and the output rotated back, so
// attention over an exact rotated cache equals attention over the unrotated one.
//
// Entry points:
//   kv_append         one warp per (slot, kv head, K or V): writes the bf16 row of the main cache
//                     at position pos[slot], and the rotated, quantized row of the mirror.
//   rope_append       one warp per (row, q/k/v head) of a q|k|v projection output: RoPE on the q
//                     and k heads at pos[row], q to q_out, k and v appended as kv_append does,
//                     len[row] = pos[row] + 1.
//   decode_attn_FMT_dD  (FMT bf16 / fp8 / int4, D 64 / 128) grid (splits, head CTAs, batch),
//                     WARPS warps (the launch bounds) that split the keys: the query heads that
//                     share a kv head (group <= 8) together, so each cache byte is read once (a
//                     group of 16 or more: CTAs of 8 of its heads, HeadCta); the
//                     CTA takes keys [split * chunk, min(len, (split + 1) * chunk)). One split:
//                     writes the output (normalized, rotated back, bf16). More: writes its
//                     partial (max, sum, unnormalized output) of each head, and the last split
//                     of a (batch, head CTA) to finish merges them all and writes the output
//                     (an arrival count per (batch, head CTA); no second launch).
//   decode_attn_FMT_dD_cl  the same kernel for split launches of 2-8 splits that the runtime
//                     launches as one thread-block cluster per (sequence, head CTA) (it decides
//                     per launch, where every cluster is resident at once; the split plan counts
//                     such a split's merge as free): each CTA leaves its heads' partials in its
//                     own shared memory, a cluster barrier, then CTA q merges heads q, q +
//                     splits, ... from every CTA's memory (distributed shared memory) and writes
//                     them, and a second barrier keeps each CTA's memory until the cluster has
//                     read it. No partials in global memory, no arrival count, and the merge is
//                     spread over the splits instead of done by the last one to finish.
//   NAME_pdl, NAME_cl_cluster  (u32 globals) read by the runtime when it loads an entry point:
//                     launch with programmatic dependent launch; launches may form clusters.
//
// Tensor cores, per warp and 16-key tile (one query token per sequence):
//   S^T = K Q^T  mma.m16n8k16 with the tile's 16 keys as rows (A = key rows g and g + 8 of lane
//               (g, t), straight from its loads) and the group's heads as the 8 columns (B = the
//               queries): d / 16 mma per tile, and a group of 8 heads fills every column. The
//               reduction over head dims is permuted so that a lane's registers come straight
//               from 16-byte loads: its slice of a key row is the row's 16-byte pieces t, t + 4,
//               t + 8, ... (the four lanes of a row read 64 contiguous bytes per load
//               instruction), and the query is laid out the same way, so no byte order of the
//               cache row is special. BF16 / FP8: register R holds slice values 2R, 2R + 1.
//               INT4: one LOP3 per register, no subtraction: register 4i + r of word i holds
//               values (8i + r, 8i + r + 4) as 1032 + q (even r: the nibble xor 8 under the
//               exponent of 1024) or 1152 + 16 q (odd r: the high nibble in place); the query
//               carries 1 / 16 on odd registers, and the score accumulator starts at minus the
//               offsets' dot product with the query, so the scores come out exact.
//   softmax     lane (g, t) holds keys g, g + 8 of heads 2t, 2t + 1. Scores in log2 units
//               (key scale x 1 / sqrt(d) x log2 e), the max reduced over the 8 lanes of a
//               head, the row sums lane-partial until the end, the output rescale skipped when
//               no head's max moved, keys past the length masked.
//   O^T += V^T P^T  P^T is packed to 16 bits and turned into the B operand (keys 2t, 2t + 1 /
//               2t + 8, 2t + 9 of head g) by two movmatrix transposes; V^T is the A operand.
//               BF16 / FP8: read with ldmatrix.trans from a per-warp shared-memory tile of 16
//               value rows (BF16: cp.async; FP8: the exact codes as f16). INT4: straight from
//               registers (int4_key_pairs), the dims permuted and put back when the output is
//               merged. Mirrors: the value row scales (x 16) folded into the probabilities and
//               taken off the output at the end.
//   loads       each warp takes every WARPS-th batch of TILES 16-key tiles of its CTA's keys and
//               keeps a batch of loads in flight (L2 fetches of 128 bytes); the mirrors refill a
//               slot as soon as its tile has been used (a ring), BF16 refills a whole batch. The
//               first batch is queued before the query heads are loaded and rotated
//               (hadamard_regs), so the query setup runs under its DRAM round trip.
// BF16 cache: bf16 operands. FP8 / INT4 mirrors: f16 operands (exact for the codes; the query is
// pre-multiplied by 1 / sqrt(d) before rounding to f16), f32 accumulation throughout.
//
// Why it is built this way (each choice timed against its alternatives on an H200; the figures
// and the variants tried are in docs/PERFORMANCE.md):
//   - INT4: 6 warps held to 168 registers, 2 CTAs (12 warps) per SM in one wave, 3 tiles per
//     warp, beat 4 warps with 4 tiles and 8 warps with 2. BF16 / FP8: 4 warps and 2 tiles (2
//     CTAs per SM by their registers); 6 warps, 3 tiles, or 168 registers for 3 CTAs per SM were
//     slower. Neither more tiles in flight, fewer instructions, two tiles per softmax step nor two
//     accumulator chains for the score mma moved the INT4 kernel: it waits on memory latency.
//   - The ring: the mirrors gained from it; BF16, whose values go through cp.async, lost 1-2%.
//   - BF16 values are copied whole rows per cp.async instruction (each 128-byte line in one
//     request; one sector of each of 16 rows requested every line four times). BF16 keys go
//     straight from global loads into registers: through shared memory they needed far fewer
//     registers but ran slower everywhere.
//   - The cache loads ask the L2 for 128-byte fetches (L2_PF): slightly faster at most points
//     than no hint; 256 bytes were no better than none.
//   - Interleaved batches: contiguous per-warp shares balance better but were slower at batch 32;
//     the CTA's warps reading neighbouring tiles together matters more.
//   - The query rows and the merge buffer are padded (and INT4's merge stores swizzled) against
//     shared-memory bank conflicts (QsRow, WoRow): unpadded, they cost the INT4 kernel most of
//     the 70B shape's extra time over 8B.
//   - The output is rescaled whenever a head's max moves: a lazy rescale (the reference max
//     moving only past a margin) was no faster.
//   - The in-CTA merge works through both head slots of every warp, so that with 8 heads per kv
//     head the two heads' chains interleave after the last tile.
//   - Split merge: thread 0 counts the arrival with one acquire-release atomic after the CTA
//     barrier (faster at every split point than fences by every thread around a relaxed count);
//     the last split loads 16 splits' partials per head together. Partials as f16 were no faster
//     (the bytes the merge reads are not what it waits for); requesting the first splits'
//     outputs together with the records was faster at batch 8 but slower at batch 1 with long
//     contexts.
//   - Clusters on separate _cl entry points: the plain kernels with the cluster merge compiled
//     in ran 4-6% slower where no launch formed a cluster.
//   - Programmatic dependent launch for the mirrors only: 1-5% faster for them, but BF16 was
//     slower with it at batch 32 (and at 8B, context 32k), so BF16 stays in stream order.

#include "ptx.cuh"
#include "kv_row.cuh"

constexpr int MAX_GROUP = 8;

// A CTA's query heads (grid y = head CTAs, [`head_ctas`] on the host): a kv head's group of at
// most MAX_GROUP heads is one CTA; a larger group (a multiple of MAX_GROUP, Llama-3.1-405B's
// 16) is served by group / MAX_GROUP CTAs of MAX_GROUP heads each, every one reading the kv
// head's cache rows. `base` is the CTA's first query head.
struct HeadCta {
    u32 kvh, group, base;
};
__device__ __forceinline__ HeadCta head_cta(u32 heads, u32 kv_heads, u32 y) {
    const u32 all = heads / kv_heads, per = (all + MAX_GROUP - 1) / MAX_GROUP;
    return {y / per, all / per, y * (all / per)};
}

struct AppendParams {
    const u16* k_new;     // [slots_in_step, kv_heads, d] bf16 (row b belongs to slot slot_of[b])
    const u16* v_new;
    const u32* slot_of;   // [batch] cache slot of each row
    const u32* pos;       // [batch] position to write in that slot
    KvCache main;         // the bf16 cache (format BF16; k/v null: not written)
    KvCache mirror;       // the FP8 or INT4 mirror (k/v null: none)
    u32 batch, block;
};

struct AttnParams {
    const u16* q;         // [batch, heads, d] bf16
    const u32* slot_of;   // [batch]
    const u32* len;       // [batch] keys to attend to (positions 0 .. len - 1 of the slot)
    KvCache cache;
    float* part_o;        // [batch, heads, splits, d] unnormalized outputs (splits > 1)
    float* part_ml;       // [batch, heads, splits, 2] (running max of scaled scores, sum of exp)
    u16* out;             // [batch, heads, d] bf16
    u32* arrived;         // [batch, kv_heads] splits finished (splits > 1); zero between launches
    u32 batch, heads, splits, chunk, block;
    float scale;          // 1 / sqrt(d)
};
struct RopeAppendParams {
    const u16* qkv;       // [batch, (heads + 2 kv_heads) d] bf16: q | k | v of each row
    u16* q_out;           // [batch, heads, d] bf16: q rotated
    const float* rope;    // [max_pos, d / 2, 2] (cos, sin) of each position and frequency
    const u32* slot_of;   // [batch]
    const u32* pos;       // [batch] position of the row's token
    u32* len;             // [batch] written: pos + 1 (the keys the step attends to)
    KvCache main;
    KvCache mirror;
    u32 batch, heads, block, max_pos;
};
static_assert(sizeof(KvCache) == 64, "KvCache layout");
static_assert(sizeof(AppendParams) == 168, "AppendParams layout");
static_assert(sizeof(RopeAppendParams) == 192, "RopeAppendParams layout");
static_assert(sizeof(AttnParams) == 144, "AttnParams layout");

#include "decode_attention.cuh"

// ---------------------------------------------------------------------------------------------
// Cache append
// ---------------------------------------------------------------------------------------------

// One warp per (slot, kv head, K or V) item.
template <int D>
__device__ __forceinline__ void append_row(const AppendParams& p, u32 b, u32 h, u32 is_v, u32 kvh, u32 lane) {
    constexpr int E = D / 32;
    const u16* src = (is_v ? p.v_new : p.k_new) + (u64(b) * kvh + h) * D + lane * E;
    u32 w[E / 2];
    load_words<E / 2>(reinterpret_cast<const u8*>(src), w);
    append_words<D>(p.main, p.mirror, p.block, p.slot_of[b], p.pos[b], h, is_v, kvh, lane, w);
}

extern "C" __global__ void __launch_bounds__(128) kv_append(const AppendParams p) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * 4 + warp;  // (b, kv head, K/V)
    const u32 kvh = p.main.kv_heads ? p.main.kv_heads : p.mirror.kv_heads;
    if (item >= p.batch * kvh * 2) return;
    const u32 b = item / (kvh * 2), h = (item / 2) % kvh, is_v = item & 1;
    const u32 d = p.main.k ? p.main.d : p.mirror.d;
    if (d == 128)
        append_row<128>(p, b, h, is_v, kvh, lane);
    else
        append_row<64>(p, b, h, is_v, kvh, lane);
}

// One warp per (row, head) of a q|k|v projection's output: q and k heads rotated (rotate-half
// RoPE at the row's position, f32 math, rounded once), q written for attention, k and v appended
// to the cache; the row's attention length pos + 1 written by its first warp.
template <int D>
__device__ __forceinline__ void rope_append_item(const RopeAppendParams& p, u32 b, u32 item, u32 kvh, u32 lane) {
    constexpr int E = D / 32;
    const u32 heads = p.heads;
    const u16* src = p.qkv + (u64(b) * (heads + 2 * kvh) + item) * D + lane * E;
    u32 w[E / 2];
    load_words<E / 2>(reinterpret_cast<const u8*>(src), w);
    const u32 pos = p.pos[b];
    if (item == 0 && lane == 0) p.len[b] = pos + 1;
    if (item < heads + kvh) {
        // Lane l holds dims l E ..; its rotation partners (d +- D / 2) are in lane l ^ 16.
        const float* cs = p.rope + (u64(min(pos, p.max_pos - 1)) * (D / 2) + (lane & 15) * E) * 2;
        float y[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float x = bf16_lo(u16(w[e / 2] >> (16 * (e % 2))));
            const float other = __shfl_xor_sync(0xffffffffu, x, 16);
            y[e] = rope_rotate(x, other, cs[2 * e], cs[2 * e + 1], lane >= 16);
        }
#pragma unroll
        for (int e = 0; e < E / 2; ++e) w[e] = pack_bf16x2(y[2 * e], y[2 * e + 1]);
    }
    if (item < heads) {
        store_words<E / 2>(p.q_out + (u64(b) * heads + item) * D + lane * E, w);
        return;
    }
    const u32 is_v = item >= heads + kvh;
    append_words<D>(p.main, p.mirror, p.block, p.slot_of[b], pos, item - heads - is_v * kvh, is_v, kvh, lane, w);
}

extern "C" __global__ void __launch_bounds__(128) rope_append(const RopeAppendParams p) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 kvh = p.main.kv_heads ? p.main.kv_heads : p.mirror.kv_heads;
    const u32 per_row = p.heads + 2 * kvh;
    const u32 item = blockIdx.x * 4 + warp;
    if (item >= p.batch * per_row) return;
    const u32 b = item / per_row, i = item % per_row;
    const u32 d = p.main.k ? p.main.d : p.mirror.d;
    if (d == 128)
        rope_append_item<128>(p, b, i, kvh, lane);
    else
        rope_append_item<64>(p, b, i, kvh, lane);
}

// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------

// The attention kernel's parameters per format and head dim, chosen here (the header says why
// these values): warps per CTA (they split the CTA's keys; the launch bounds, and the host reads
// the block size from the kernel), the launch bounds' CTAs per SM (INT4: 2, which holds it to 168
// registers; BF16 / FP8 fit 2 CTAs per SM by their registers, and the split plan asks the
// occupancy calculator), the 16-key tiles of loads each warp keeps in flight, and the
// shared-memory areas they give.
template <int FMT, int D>
struct AttnShape {
    static constexpr int WARPS = FMT == FMT_INT4 ? 6 : 4;
    static constexpr int MIN_CTAS = FMT == FMT_INT4 ? 2 : 1;
    static constexpr int TILES = FMT == FMT_INT4 ? 3 : 2;
    // The mirrors' warps refill a tile's load slot as soon as it has been used (a ring); BF16
    // warps queue a whole batch of TILES tiles at a time.
    static constexpr bool RING = FMT != FMT_BF16;
    // The mirrors' kernels are launched with programmatic dependent launch, BF16's in stream order.
    static constexpr bool PDL = FMT != FMT_BF16;
    // Splits whose partials the last split's merge loads together per head of a warp.
    static constexpr int MERGE_UNROLL = 16;
    static constexpr int VP = D + 8;  // value tile row pitch (elements)
    static constexpr int VTILES = FMT == FMT_BF16 ? TILES : FMT == FMT_FP8 ? 1 : 0;  // INT4: no value tile
    static constexpr int VT_BYTES = WARPS * VTILES * 16 * VP * 2;
    static constexpr int WO_BYTES = WARPS * MAX_GROUP * WoRow<D>::P * 4;
    // The value tiles, which become the merge buffer after the key loop.
    static constexpr int VT_AREA = VT_BYTES > WO_BYTES ? VT_BYTES : WO_BYTES;
};

// The merge of a cluster's splits (_cl entry points). CTA q (split q) merges heads q, q + splits,
// ..., a warp per head: lane s holds split s's (max, sum) from `ml` ([head][2] floats) of CTA s,
// and the splits' outputs from `part` ([head][D] floats) are added in a fixed order
// (deterministic). Not inlined: at the end of the attention kernel its registers are free, and
// inlined it made ptxas spill in the INT4 kernel's merge.
template <int D, int WARPS>
__device__ __noinline__ void cluster_merge(const AttnParams& p, u32 part, u32 ml, u32 group, u32 base, u32 b, u32 warp, u32 lane) {
    constexpr int E = D / 32;
    cluster_sync();
    const u32 rank = cluster_rank(), ns = p.splits;
    for (u32 h = rank + warp * ns; h < group; h += WARPS * ns) {
        float ms = NEG_INF, ls = 0.0f;
        if (lane < ns) {
            float v[2];
            ld_cluster_floats<2>(ml + h * 8, lane, v);
            ms = v[0];
            ls = v[1];
        }
        float mx = ms;
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
        const float f = ms == NEG_INF ? 0.0f : __expf(ms - mx);  // an empty split adds 0
        float lsum = ls * f;
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o2);
        float os[E];
#pragma unroll
        for (int e = 0; e < E; ++e) os[e] = 0.0f;
#pragma unroll
        for (u32 s = 0; s < 8; ++s) {
            const float fs = __shfl_sync(0xffffffffu, f, s);
            if (s >= ns) break;
            float x[E];
            ld_cluster_floats<E>(part + (h * D + lane * E) * 4, s, x);
#pragma unroll
            for (int e = 0; e < E; ++e) os[e] += x[e] * fs;
        }
        write_head<D>(os, lsum, p.block, lane, p.out + (u64(b) * p.heads + base + h) * D);
    }
    cluster_sync();  // every CTA's partials stay until the cluster has read them
}

// The mirrors' kernels (AttnShape::PDL): lets the next kernel launch, asks the L2 for this
// warp's first batch of cache rows (keys and values; positions from the split alone, clipped to
// the slot's page table: no length is read), then waits for the previous kernel. Nothing before
// the wait reads what another kernel writes except the slot index, and that only places the
// hints (the page table is written by copies before the step, never by a kernel).
template <int FMT, int D>
__device__ __forceinline__ void attn_pdl_prologue(const AttnParams& p) {
    using S = AttnShape<FMT, D>;
    if (!S::PDL) return;
    griddep_launch_dependents();
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int LINES = 16 * S::TILES * KB / 128;  // 128-byte lines per batch of a warp
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const KvCache& c = p.cache;
    // Through the L2 only (.cg): a line of slot_of left in this SM's L1 before the wait could
    // serve the kernel's own read after it with a value an earlier kernel has since changed.
    u32 slot;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(slot) : "l"(p.slot_of + blockIdx.z));
    const u32 kvh = head_cta(p.heads, c.kv_heads, blockIdx.y).kvh;
    const u32 r0 = blockIdx.x * p.chunk + warp * 16 * S::TILES;
    for (u32 i = lane; i < u32(LINES); i += 32) {
        // Line i of the batch: key r0 + i 128 / KB, byte i 128 % KB of its row (a line holding
        // several rows holds keys of one 16-key tile, so of one page).
        const u32 key = r0 + i * 128 / KB;
        if (key >= c.max_pages << c.page_shift) break;
        const u64 at = kv_row(c, slot, kvh, key) * KB + (i * 128) % KB;
        prefetch_l2(static_cast<const u8*>(c.k) + at);
        prefetch_l2(static_cast<const u8*>(c.v) + at);
    }
    griddep_wait();
}

// A split launch without a cluster: counts this split's arrival at (b, head CTA) and sets `last` (shared)
// where it is the last split to finish, which then merges every split's partials (no second
// launch) and puts the count back to zero for the next launch. Every thread's partial stores,
// then the CTA barrier, then thread 0's count as one acquire-release atomic: the release covers
// the stores the barrier ordered before it, the acquire (and the barrier after it) the other
// splits' partials for every thread of the merging split.
__device__ __forceinline__ void count_arrival(const AttnParams& p, u32 b, u32& last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* cnt = p.arrived + u64(b) * gridDim.y + blockIdx.y;
        u32 old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory");
        last = old == p.splits - 1;
        if (last) *cnt = 0;
    }
    __syncthreads();
}

// The attention kernel (entry points decode_attn_FMT_dD), one warp per 16-key tile at a time;
// the tensor-core layout is in the header. Its phases (numbered below) stay in one function:
// moved into force-inlined functions, their local arrays are placed ahead of the kernel's and
// the compiler then orders and allocates the loop's registers differently (other SASS).
template <int FMT, int D, bool CL>
__device__ __forceinline__ void decode_attn(const AttnParams& p) {
    using S = AttnShape<FMT, D>;
    constexpr bool F16 = FMT != FMT_BF16;
    constexpr int VP = S::VP, WARPS = S::WARPS, TILES = S::TILES, VTILES = S::VTILES;
    constexpr bool RING = S::RING;
    __shared__ __align__(16) float qs[MAX_GROUP][QsRow<D>::P];
    __shared__ __align__(16) unsigned char vt_raw[S::VT_AREA];
    __shared__ float wm[WARPS][MAX_GROUP], wl[WARPS][MAX_GROUP];
    // The cluster entry points (CL): this split's partials, read by the cluster's merge.
    __shared__ __align__(16) float cpart[CL ? MAX_GROUP : 1][CL ? D : 4];
    __shared__ __align__(8) float cml[CL ? MAX_GROUP : 1][2];

    // 1. The CTA's keys, the query loads, the lane's load pointers, the first batch queued.
    attn_pdl_prologue<FMT, D>(p);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 split = blockIdx.x, b = blockIdx.z;
    const KvCache& c = p.cache;
    const HeadCta cta = head_cta(p.heads, c.kv_heads, blockIdx.y);
    const u32 kvh = cta.kvh, group = cta.group;
    const u32 len = p.len[b];
    const u32 k0 = split * p.chunk, k1 = min(len, k0 + p.chunk);
    const u32 slot = p.slot_of[b];

    // The query rows of this warp's heads (h = warp + WARPS r; lane l: dims l E .. l E + E - 1),
    // requested first; they are used after the first tiles' loads are queued.
    constexpr int E = D / 32;
    constexpr int QR = (MAX_GROUP + WARPS - 1) / WARPS;
    u32 qraw[QR][E / 2];
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        if (h < group) load_words<E / 2>(reinterpret_cast<const u8*>(p.q + ((u64(b) * p.heads + cta.base + h) * D + lane * E)), qraw[r]);
    }
    // Bytes per cache row; a lane's key pieces (KP bytes, KE values) and value pieces (VP2 bytes).
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int KP = Piece<KB / 4>::BYTES, VP2 = FMT == FMT_BF16 ? 16 : Piece<KB / 2>::BYTES;
    constexpr int KE = FMT == FMT_BF16 ? KP / 2 : FMT == FMT_FP8 ? KP : 2 * KP;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // heads 2t, 2t + 1 (l: this lane's keys)
    // O^T fragments: m-tile n = dims 16n .. 16n + 15; [0], [1] = heads 2t, 2t + 1 at dim 16n + g,
    // [2], [3] the same at dim 16n + 8 + g.
    // Mirrors: the probabilities carry the value scale times VSF (kept well inside the f16
    // range), undone at the end.
    constexpr float VSF = 16.0f;
    float o[D / 16][4];
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    u16* vt = reinterpret_cast<u16*>(vt_raw) + warp * VTILES * 16 * VP;
    // The warp's keys: every WARPS-th batch of TILES tiles of the CTA's [k0, k1), from kw0 in
    // steps of kstep. The lane's offsets in a tile: key row g, its value pieces, the scales of
    // key g; and where its value pieces land in the warp's BF16 tiles.
    const u32 kw0 = k0 + warp * 16 * TILES, kstep = WARPS * 16 * TILES;
    // Value rows: BF16 row lane / CPR, 16-byte chunk lane % CPR (whole rows per instruction);
    // INT4 key row 2t, the lane's D / 16 bytes from byte g D / 16 (int4_key_pairs); FP8 row
    // lane / 2, piece lane % 2.
    const u32 vrow = FMT == FMT_BF16 ? lane / (KB / 16) : FMT == FMT_INT4 ? 2 * t : lane >> 1;
    const u32 vcol = FMT == FMT_BF16 ? (lane % (KB / 16)) * 16 : FMT == FMT_INT4 ? g * (D / 16) : (lane & 1) * VP2;  // bytes
    const u32 vdst = smem_u32(vt + vrow * VP + vcol / 2);
    Raw<FMT, D> raw[TILES];
    // Queues the loads of tile ti of the batch at key bb0 into raw[ti]: a whole tile from the
    // lane's pointers at the tile's first row (a tile lies in one page), the last one row by
    // row. BF16 commits one cp.async group per call, empty past the end, so that a slot's group
    // is always followed by the same number of groups.
    auto issue = [&](int ti, u32 bb0) {
        const u32 tb = bb0 + 16 * ti;
        if (bb0 + 16 * TILES <= k1) {
            const u64 tr = kv_row(c, slot, kvh, tb);
            load_tile_fast<FMT, D, VP>(static_cast<const u8*>(c.k) + (tr + g) * KB + t * KP,
                                       static_cast<const u8*>(c.v) + (tr + vrow) * KB + vcol, F16 ? c.ks + tr + g : nullptr,
                                       F16 ? c.vs + tr + g : nullptr, raw[ti], vdst + (FMT == FMT_BF16 ? ti : 0) * 16 * VP * 2);
        } else if (tb < k1) {  // rows past the end read row k0
            load_tile<FMT, D, VP>(c, slot, kvh, tb, k0, k1, lane, raw[ti], vt + (FMT == FMT_BF16 ? ti : 0) * 16 * VP);
        }
        if (FMT == FMT_BF16) asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // RING: a slot is refilled with the same tile of the next batch as soon as it has been used,
    // so TILES - 1 tiles are always in flight; else a batch's TILES tiles are queued together.
    u32 base0 = kw0;
    if (base0 < k1) {  // the first batch, queued before the query is set up
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) issue(ti, base0);
    }
    // 2. The query operand: the query heads, rotated like the mirrors' rows (registers and
    // shuffles), into qs (heads past the group are zero), then the lane's B fragments.
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        if (h >= MAX_GROUP) break;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = h < group ? bf16_lo(u16(qraw[r][e / 2] >> (16 * (e % 2)))) : 0.0f;
        if (F16) hadamard_regs<D>(x, p.block, lane);
        store_floats<E>(&qs[h][QsRow<D>::pos(lane * E)], x);
    }
    __syncthreads();
    const float qscale = F16 ? p.scale : 1.0f;
    const float sscale = F16 ? 1.0f : p.scale;
    // B fragments of Q^T: column g = head g, register R of the key operand <-> qa[R / 2][R % 2].
    u32 qa[D / 16][2];
    float off = 0.0f;  // INT4: this lane's part of head g's offset dot product
#pragma unroll
    for (int R = 0; R < D / 8; ++R) {
        int e0, e1;
        float qf;
        operand_values<FMT>(R, e0, e1, qf);
        auto dim = [&](int e) { return (e / KE) * 4 * KE + int(t) * KE + e % KE; };
        const u32 h2 = pack_x2<F16>(qs[g][QsRow<D>::pos(dim(e0))] * qscale * qf, qs[g][QsRow<D>::pos(dim(e1))] * qscale * qf);
        qa[R / 2][R % 2] = h2;
        if (FMT == FMT_INT4) {
            float lo, hi;
            f16x2_to_f32(h2, lo, hi);
            off += (R % 2 ? 1152.0f : 1032.0f) * (lo + hi);
        }
    }
    float init0 = 0.0f, init1 = 0.0f;  // score accumulators' start for heads 2t, 2t + 1
    if (FMT == FMT_INT4) {
        off += __shfl_xor_sync(0xffffffffu, off, 1);
        off += __shfl_xor_sync(0xffffffffu, off, 2);
        init0 = -__shfl_sync(0xffffffffu, off, 8 * t);
        init1 = -__shfl_sync(0xffffffffu, off, 8 * t + 4);
    }

    // 3. The key loop: per tile, scores, online softmax and O^T += V^T P^T, then its slot's next
    // loads (RING) or, before a batch, the whole batch's (BF16).
    for (bool first_batch = true; base0 < k1; base0 += kstep, first_batch = false) {
        if (!RING && !first_batch) {
#pragma unroll
            for (int ti = 0; ti < TILES; ++ti) issue(ti, base0);
        }
#pragma unroll
        for (int t0 = 0; t0 < TILES; ++t0) {
            const u32 base = base0 + 16 * t0;
            if (base >= k1) break;
            const Raw<FMT, D>& r = raw[t0];
            // S^T: c0, c1 = key base + g, heads 2t, 2t + 1; c2, c3 = key base + 8 + g. Scores in
            // log2 units (exp2 below); m and l are kept in them until the end.
            constexpr float LOG2E = 1.4426950408889634f;
            float sc[4] = {init0, init1, init0, init1};
            u32 ka[D / 8], kb[D / 8];
            k_operand<FMT, D>(r.k[0], ka);
            k_operand<FMT, D>(r.k[1], kb);
#pragma unroll
            for (int j = 0; j < D / 16; ++j) mma_m16n8k16<F16>(sc, ka[2 * j], kb[2 * j], ka[2 * j + 1], kb[2 * j + 1], qa[j][0], qa[j][1]);
            const float ks0 = F16 ? r.ks[0][0] * (sscale * LOG2E) : sscale * LOG2E;
            const float ks1 = F16 ? r.ks[1][0] * (sscale * LOG2E) : sscale * LOG2E;
            float s4[4] = {sc[0] * ks0, sc[1] * ks0, sc[2] * ks1, sc[3] * ks1};
            if (base + 16 > k1) {  // keys past the end (rows that hold row k0's finite values)
                if (base + g >= k1) s4[0] = s4[1] = NEG_INF;
                if (base + 8 + g >= k1) s4[2] = s4[3] = NEG_INF;
            }
            // The tile's max of each head over its 8 lanes, from -inf (a NaN score is dropped).
            float mx0 = fmaxf(NEG_INF, fmaxf(s4[0], s4[2])), mx1 = fmaxf(NEG_INF, fmaxf(s4[1], s4[3]));
#pragma unroll
            for (int o2 = 4; o2 < 32; o2 <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
            }
            const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);
            // mn is finite (key `base` is in range); a masked score gives exp2(-inf) = 0. The
            // output is rescaled only when some head's max moved. (`+ 0.0f` changes no result;
            // it keeps the FADD of the kernels as they were timed.)
            const bool move = __any_sync(0xffffffffu, mn0 > m[0] + 0.0f || mn1 > m[1] + 0.0f);
            const float r0 = move ? mn0 : m[0], r1 = move ? mn1 : m[1];
            float pr[4];
            pr[0] = exp2_approx(s4[0] - r0);
            pr[1] = exp2_approx(s4[1] - r1);
            pr[2] = exp2_approx(s4[2] - r0);
            pr[3] = exp2_approx(s4[3] - r1);
            if (move) {
                const float c0 = exp2_approx(m[0] - mn0), c1 = exp2_approx(m[1] - mn1);  // 0 from -inf
                l[0] *= c0;
                l[1] *= c1;
#pragma unroll
                for (int n = 0; n < D / 16; ++n) {
                    o[n][0] *= c0;
                    o[n][1] *= c1;
                    o[n][2] *= c0;
                    o[n][3] *= c1;
                }
                m[0] = mn0;
                m[1] = mn1;
            }
            // P^T (keys x heads) to P (B operand: keys 2t, 2t + 1 and 2t + 8, 2t + 9 of head g);
            // mirrors: times the value rows' scales (and VSF). FP8 value codes to their tile.
            l[0] += pr[0] + pr[2];
            l[1] += pr[1] + pr[3];
            const float vs0 = F16 ? r.ks[0][1] * VSF : 1.0f, vs1 = F16 ? r.ks[1][1] * VSF : 1.0f;
            const u32 pb0 = movmatrix_trans(pack_x2<F16>(pr[0] * vs0, pr[1] * vs0));
            const u32 pb1 = movmatrix_trans(pack_x2<F16>(pr[2] * vs1, pr[3] * vs1));
            if (FMT == FMT_FP8) codes_to_tile<FMT, D, VP>(r, lane, vt);
            // BF16: the groups queued after this tile's slot may still be in flight.
            if (FMT == FMT_BF16) cp_async_wait_n(TILES - 1 - t0);
            if (FMT == FMT_INT4) {
                // V^T from registers: word j's bytes 0-1 / 2-3 of the four keys give m-tiles
                // 4j + 2 hi and 4j + 2 hi + 1 (int4_key_pairs).
                constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
                for (int j = 0; j < VK; ++j)
#pragma unroll
                    for (int hi = 0; hi < 2; ++hi) {
                        const u32* v = r.v;
                        u32 a[4], b[4];
                        int4_key_pairs(v[j], v[VK + j], hi, a);
                        int4_key_pairs(v[2 * VK + j], v[3 * VK + j], hi, b);
                        const int n = 4 * j + 2 * hi;
                        mma_m16n8k16<F16>(o[n], a[0], a[1], b[0], b[1], pb0, pb1);
                        mma_m16n8k16<F16>(o[n + 1], a[2], a[3], b[2], b[3], pb0, pb1);
                    }
            } else {
                __syncwarp();
                const u16* tile = vt + (FMT == FMT_BF16 ? t0 : 0) * 16 * VP;
#pragma unroll
                for (int n = 0; n < D / 16; ++n) {
                    const u32 mi = lane >> 3;
                    const u16* rowp = tile + ((mi >> 1) * 8 + (lane & 7)) * VP + n * 16 + (mi & 1) * 8;
                    u32 v0, v1, v2, v3;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                                 : "r"(smem_u32(rowp)));
                    mma_m16n8k16<F16>(o[n], v0, v1, v2, v3, pb0, pb1);
                }
                __syncwarp();
            }
            if (RING) issue(t0, base0 + kstep);
        }
    }

    // 4. The CTA's warps merged. The row sums over the 8 lanes of each head; each warp's (max,
    // sum) into wm, wl and its unnormalized output into the merge buffer wo.
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) {
        l[0] += __shfl_xor_sync(0xffffffffu, l[0], o2);
        l[1] += __shfl_xor_sync(0xffffffffu, l[1], o2);
    }
    __syncthreads();  // the V tiles become the merge buffer
    float (*wo)[MAX_GROUP][WoRow<D>::P] = reinterpret_cast<float (*)[MAX_GROUP][WoRow<D>::P]>(vt_raw);
    if (g == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (2 * t + h < group) {
                wm[warp][2 * t + h] = m[h] * 0.6931471805599453f;  // natural units from here on
                wl[warp][2 * t + h] = l[h];
            }
    }
    if (FMT == FMT_INT4) {
        // Lane (g, t) holds dims g D / 8 .. (g + 1) D / 8 of heads 2t, 2t + 1 (int4_key_pairs):
        // D / 32 float4 stores per head, at WoRow's swizzled places.
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
            const u32 h = 2 * t + c2;
            if (h >= group) continue;
#pragma unroll
            for (int jj = 0; jj < D / 32; ++jj) {
                const float x[4] = {o[2 * jj][c2] * (1.0f / VSF), o[2 * jj][c2 + 2] * (1.0f / VSF),
                                    o[2 * jj + 1][c2] * (1.0f / VSF), o[2 * jj + 1][c2 + 2] * (1.0f / VSF)};
                store_floats<4>(&wo[warp][h][WoRow<D>::pos(FMT, h, int4_value_dim<D>(g, 2 * jj, 0))], x);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < D / 16; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 col = 16 * n + 8 * (i >> 1) + g;  // the value tile's column
                const u32 h = 2 * t + (i & 1);
                const float v = F16 ? o[n][i] * (1.0f / VSF) : o[n][i];  // FP8: P carried VSF
                if (h < group) wo[warp][h][WoRow<D>::pos(FMT, h, col)] = v;
            }
    }
    __syncthreads();
    // A warp per head merges its warps' outputs (lane l: dims l E ..). One split: the CTA holds
    // the whole output of its heads; normalized, rotated back and written as bf16 here, with no
    // partials and no combine. Else the split's partial (max, sum, unnormalized output): in this
    // CTA's shared memory (cluster entry points, launched as clusters of the splits), else in
    // global memory.
    if (CL && p.splits > 1 && cluster_ctas() != p.splits) __trap();  // the host's contract
    const bool dsm = CL && p.splits > 1;
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        // Every warp works through all QR of its head slots (in range of wo: warp + WARPS r <
        // MAX_GROUP), so the two heads' chains interleave; only real heads store.
        const bool real = h < group;
        const u32 hc = h < MAX_GROUP ? h : warp;  // the slot read (six INT4 warps reach past 8)
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wm[w][hc]);
        float lsum = 0.0f, os[E];
#pragma unroll
        for (int e = 0; e < E; ++e) os[e] = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = wm[w][hc] == NEG_INF ? 0.0f : __expf(wm[w][hc] - mx);
            float x[E];
            load_floats<E>(&wo[w][hc][WoRow<D>::pos(FMT, hc, lane * E)], x);
            lsum += wl[w][hc] * f;
#pragma unroll
            for (int e = 0; e < E; ++e) os[e] += x[e] * f;
        }
        const u64 row = u64(b) * p.heads + cta.base + h;
        if (!real) {
        } else if (p.splits == 1) {
            write_head<D>(os, lsum, p.block, lane, p.out + row * D);
        } else if (dsm) {
            store_floats<E>(&cpart[h][lane * E], os);
            if (lane == 0) {
                cml[h][0] = mx;
                cml[h][1] = lsum;
            }
        } else {
            const u64 ph = row * p.splits + split;
            store_floats<E>(p.part_o + ph * D + lane * E, os);
            if (lane == 0) {
                p.part_ml[ph * 2] = mx;
                p.part_ml[ph * 2 + 1] = lsum;
            }
        }
    }

    // 5. Split launches: the cluster's merge, or the merge by the last split to arrive.
    if (p.splits == 1) return;
    if (dsm) {
        cluster_merge<D, WARPS>(p, smem_u32(&cpart[0][0]), smem_u32(&cml[0][0]), group, cta.base, b, warp, lane);
        return;
    }
    __shared__ u32 last;
    count_arrival(p, b, last);
    if (!last) return;
    // The warp's heads together (their loads interleave). Lane l first holds split l's (max,
    // sum) of each head, and the splits' weights reach the other lanes by shuffles.
    float mx[QR], lsum[QR], os[QR][E], ms[QR], ls[QR];
    const float* po[QR];
    const float2* ml[QR];
    bool hv[QR];
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        hv[r] = h < group;
        const u64 row = u64(b) * p.heads + cta.base + (hv[r] ? h : 0);
        ml[r] = reinterpret_cast<const float2*>(p.part_ml) + row * p.splits;
        po[r] = p.part_o + row * p.splits * D + lane * E;
        ms[r] = NEG_INF;
        ls[r] = 0.0f;
        if (hv[r] && lane < p.splits) {
            const float2 v = __ldcg(&ml[r][lane]);
            ms[r] = v.x;
            ls[r] = v.y;
        }
        mx[r] = ms[r];
        if (hv[r])
            for (u32 s = lane + 32; s < p.splits; s += 32) mx[r] = fmaxf(mx[r], __ldcg(&ml[r][s].x));
        lsum[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) os[r][e] = 0.0f;
    }
#pragma unroll
    for (int r = 0; r < QR; ++r)
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 >>= 1) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], o2));
    for (u32 s0 = 0; s0 < p.splits; s0 += 32) {
        const u32 n = min(32u, p.splits - s0);
        float f[QR];
#pragma unroll
        for (int r = 0; r < QR; ++r) {
            if (s0 > 0) {
                ms[r] = NEG_INF;
                if (hv[r] && lane < n) {
                    const float2 v = __ldcg(&ml[r][s0 + lane]);
                    ms[r] = v.x;
                    ls[r] = v.y;
                }
            }
            f[r] = ms[r] == NEG_INF ? 0.0f : __expf(ms[r] - mx[r]);  // an empty split adds 0
            lsum[r] += ls[r] * f[r];
        }
        constexpr int MU = S::MERGE_UNROLL;
#pragma unroll MU
        for (u32 i = 0; i < n; ++i)
#pragma unroll
            for (int r = 0; r < QR; ++r) {
                const float fi = __shfl_sync(0xffffffffu, f[r], i);
                if (!hv[r]) continue;
                float x[E];
                load_floats<E, true>(po[r] + u64(s0 + i) * D, x);
#pragma unroll
                for (int e = 0; e < E; ++e) os[r][e] += x[e] * fi;
            }
    }
#pragma unroll
    for (int r = 0; r < QR; ++r) {
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 >>= 1) lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], o2);
        if (hv[r]) write_head<D>(os[r], lsum[r], p.block, lane, p.out + (u64(b) * p.heads + cta.base + warp + WARPS * r) * D);
    }
}

// Each format and head dim has two entry points: NAME, and NAME_cl, whose split launches are
// clusters of their splits merging through distributed shared memory. NAME_pdl: launched with
// programmatic dependent launch (AttnShape::PDL); NAME_cl_cluster: its launches may form
// clusters. Runtime::kernel reads both.
#define DECODE_ATTN_ENTRY(NAME, FMT, D)                                                              \
    extern "C" __device__ unsigned NAME##_pdl = AttnShape<FMT, D>::PDL;                             \
    extern "C" __global__ void __launch_bounds__(AttnShape<FMT, D>::WARPS * 32, AttnShape<FMT, D>::MIN_CTAS) \
        NAME(const AttnParams p) { decode_attn<FMT, D, false>(p); }                                  \
    extern "C" __device__ unsigned NAME##_cl_pdl = AttnShape<FMT, D>::PDL;                          \
    extern "C" __device__ unsigned NAME##_cl_cluster = 1;                                           \
    extern "C" __global__ void __launch_bounds__(AttnShape<FMT, D>::WARPS * 32, AttnShape<FMT, D>::MIN_CTAS) \
        NAME##_cl(const AttnParams p) { decode_attn<FMT, D, true>(p); }

DECODE_ATTN_ENTRY(decode_attn_bf16_d64, FMT_BF16, 64)
DECODE_ATTN_ENTRY(decode_attn_bf16_d128, FMT_BF16, 128)
DECODE_ATTN_ENTRY(decode_attn_fp8_d64, FMT_FP8, 64)
DECODE_ATTN_ENTRY(decode_attn_fp8_d128, FMT_FP8, 128)
DECODE_ATTN_ENTRY(decode_attn_int4_d64, FMT_INT4, 64)
DECODE_ATTN_ENTRY(decode_attn_int4_d128, FMT_INT4, 128)
