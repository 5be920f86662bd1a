// Decode attention over a KV cache in one of three formats, with split-KV and a log-sum-exp
// merge, and the cache append that writes each new token's K and V rows.
//
// Formats (docs/KV_CACHE_FORMAT.md; crates/stoke-formats/src/kv.rs is the specification):
//   BF16  the main cache:  k, v  [slots, kv_heads, cap, d] bf16
//   FP8   E4M3 mirror:     k, v  [slots, kv_heads, cap, d] u8 codes, ks, vs [slots, kv_heads, cap]
//                          f32 scales (amax / 448), value = e4m3(code) * scale
//   INT4  mirror:          k, v [slots, kv_heads, cap, d / 2] bytes, value 2j in the low nibble
//                          of byte j, ks, vs f32 scales (amax / 7), value = q * scale
// The mirrors hold rows rotated by the normalized block-diagonal Walsh-Hadamard transform of
// `block` (0: no rotation); the query is rotated the same way and the output rotated back, so
// attention over an exact rotated cache equals attention over the unrotated one.
//
// Entry points:
//   kv_append         one warp per (slot, kv head, K or V): writes the bf16 row of the main cache
//                     at position pos[slot], and the rotated, quantized row of the mirror.
//   decode_attn_FMT_dD  (FMT bf16 / fp8 / int4, D 64 / 128) grid (splits, kv_heads, batch),
//                     WARPS warps (the launch bounds) that split the keys: the query heads that
//                     share a kv head (group <= 8) together, so each cache byte is read once; the
//                     CTA takes keys [split * chunk, min(len, (split + 1) * chunk)). One split:
//                     writes the output (normalized, rotated back, bf16). More: writes its
//                     partial (max, sum, unnormalized output) of each head, and the last split
//                     of a (batch, kv head) to finish merges them all and writes the output
//                     (an arrival count per (batch, kv head); no second launch).
//   NAME_dyn_smem     (u32 globals) the dynamic shared memory each attention entry point needs:
//                     0 as shipped; the K and V tiles with STOKE_ATTN_K_SMEM. The runtime reads
//                     them when it loads the entry point and launches with that size.
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
//   loads       each warp keeps TILES tiles of loads in flight (L2 fetches of 128 bytes); the
//               mirrors refill a slot as soon as its tile has been used (a ring), BF16 refills
//               a whole batch. The first batch is queued before the query heads are loaded and
//               rotated (hadamard_regs), so the query setup runs under its DRAM round trip.
// BF16 cache: bf16 operands. FP8 / INT4 mirrors: f16 operands (exact for the codes; the query is
// pre-multiplied by 1 / sqrt(d) before rounding to f16), f32 accumulation throughout.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#include "cluster.cuh"

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_INT4 = 2 };

// Bytes of one cache row (d values) in format FMT: bf16, one e4m3 code or one nibble per value.
template <int FMT, int D>
__host__ __device__ constexpr int row_bytes() {
    return FMT == FMT_BF16 ? 2 * D : FMT == FMT_FP8 ? D : D / 2;
}

// Tuning knobs, overridable by NVRTC defines (benchmarks time variants through
// Runtime::set_defines; the defaults are the shipped kernels): 16-key tiles of loads a warp
// queues before computing (INT4, and BF16 / FP8), and the launch bounds' CTAs per SM.
#ifndef STOKE_ATTN_TILES_INT4
#define STOKE_ATTN_TILES_INT4 3
#endif
#ifndef STOKE_ATTN_TILES
#define STOKE_ATTN_TILES 2
#endif
#ifndef STOKE_ATTN_MIN_CTAS
#define STOKE_ATTN_MIN_CTAS 1
#endif
// Warps per CTA (they split the CTA's keys) and the launch bounds' CTAs per SM of the INT4
// kernels, apart from the BF16 / FP8 ones (STOKE_ATTN_WARPS, STOKE_ATTN_MIN_CTAS). The host
// reads the block size from the kernel (its launch bounds). INT4: 6 warps held to 168
// registers, 2 CTAs (12 warps) per SM in one wave, 3 tiles per warp; against 4 warps at 212
// registers and 4 tiles: B = 32, ctx 4096 58.3 -> 53.1 us (8B), 62.4 -> 57.2 us (70B);
// 8 warps x 2 tiles at 128 registers 54.8 us; BF16 / FP8 with 6 warps no faster
// (results/experiments/h200-attention-warps-c90e2db.json).
#ifndef STOKE_ATTN_WARPS
#define STOKE_ATTN_WARPS 4
#endif
#ifndef STOKE_ATTN_WARPS_INT4
#define STOKE_ATTN_WARPS_INT4 6
#endif
#ifndef STOKE_ATTN_MIN_CTAS_INT4
#define STOKE_ATTN_MIN_CTAS_INT4 2
#endif
// 1: a warp's TILES load slots form a ring, each refilled with the next batch's tile as soon as
// it has been used; 0: a batch's tiles are queued together and used before the next batch. For
// the mirrors (FP8 / INT4) and for BF16 (whose values go through cp.async; the ring measured
// 1-2% slower there, results/experiments/h200-attention-ring-c566446.json).
#ifndef STOKE_ATTN_PIPELINE
#define STOKE_ATTN_PIPELINE 1
#endif
#ifndef STOKE_ATTN_PIPELINE_BF16
#define STOKE_ATTN_PIPELINE_BF16 0
#endif
// 1: two 16-key tiles per softmax step (mirrors; _BF16 for the BF16 cache), 0: one.
#ifndef STOKE_ATTN_PAIR
#define STOKE_ATTN_PAIR 0
#endif
#ifndef STOKE_ATTN_PAIR_BF16
#define STOKE_ATTN_PAIR_BF16 0
#endif
// 1: the BF16 value tiles are copied whole rows per cp.async instruction (every 128-byte line
// in one request) instead of one 32-byte sector of each of 16 rows (0). B = 32, ctx 4096:
// 151.9 -> 132.1 us; B = 1, ctx 32k: 50.1 -> 45.3 us.
#ifndef STOKE_ATTN_V_ROWS
#define STOKE_ATTN_V_ROWS 1
#endif
// 1: each warp takes a contiguous share of the CTA's tiles (equal within one tile), 0: every
// WARPS-th batch of TILES tiles (at B = 32, ctx 4096 INT4's 256 tiles give 6 warps 42-45).
// Contiguous shares measured slower at B = 32 (BF16 129.3 -> 132.8 us, FP8 72.4 -> 78.0,
// results/experiments/h200-attention-fused-ranges-a227ed5.json).
#ifndef STOKE_ATTN_RANGES
#define STOKE_ATTN_RANGES 0
#endif
// 1: the query rows and the merge buffer padded and swizzled against shared-memory bank conflicts
// (QsRow, WoRow); 0: plain rows. Nsight Compute at 8f23d90 counted 3.3k (8B) / 5.0k (70B) shared
// wavefronts per INT4 CTA, 85% of them conflicts: the query slices' 16-byte loads (8-way) and
// the merge's stores (8-way for 4 heads, 16-way for 8), i.e. about the 70B shape's extra time.
// Same run against 0 (results/experiments/h200-attention-smem-layout-ab2727e.json): INT4 at
// B = 32, ctx 4096 44.7 -> 42.1 us (8B), 47.0 -> 42.9 us (70B); B = 8, ctx 1024 15.4 -> 12.9 /
// 18.8 -> 14.6 us; BF16 / FP8 at B = 32 from 0.8% faster to 1.8% slower (BF16 70B, 125.3 ->
// 127.6 us), at the other points 0.1-5% faster.
#ifndef STOKE_ATTN_SMEM_LAYOUT
#define STOKE_ATTN_SMEM_LAYOUT 1
#endif
// L2 prefetch size of the cache loads (0: none; 128 or 256 bytes). 128 against none, same run:
// 10 of the 12 (B, ctx, format) points at B = 32 / ctx 4096 and B = 1 / ctx 32k 0.2-1.4% faster
// (results/experiments/h200-attention-l2-prefetch-e0c6f52.json); 256 within 1% of none.
#ifndef STOKE_ATTN_L2_PREFETCH
#define STOKE_ATTN_L2_PREFETCH 128
#endif
// Lazy rescale: the running max a warp's probabilities are taken against moves only when a
// score passes it by more than STOKE_ATTN_LAZY (log2 units; 0: whenever it passes it), so the
// output's rescale runs on fewer tiles and the probabilities stay below 2^LAZY (the mirrors'
// f16 probabilities then carry a smaller factor VSF).
#ifndef STOKE_ATTN_LAZY
#define STOKE_ATTN_LAZY 0
#endif
// Independent accumulator chains of the S^T = K Q^T mma of a tile (1 or 2; 2: half the serial
// mma latency, one add per score).
#ifndef STOKE_ATTN_QK_CHAINS
#define STOKE_ATTN_QK_CHAINS 1
#endif
// 1: BF16 keys go through cp.async into shared memory with the values (each warp's TILES tiles of
// 16 key rows, whole rows per instruction, 16-byte chunk c of row r at c ^ 4 (r & 1) so that the
// lanes' slice reads are conflict-free) and are read back with ld.shared.v4 just before the
// score mma; 0: each lane's key slices straight from global loads into registers (64 registers
// for two tiles). The K and V tiles then live in dynamic shared memory, whose size the host
// reads from the entry's `<entry>_dyn_smem` global (AttnShape::DYN).
#ifndef STOKE_ATTN_K_SMEM
#define STOKE_ATTN_K_SMEM 0
#endif
// Splits whose partials the last split's merge loads together per head of a warp (16: with 8
// heads per kv head, a warp's 2 heads keep 32 float4 loads in flight). Against 8, same run
// (results/experiments/h200-attention-merge-k-smem-65d0f3d.json): B = 1, ctx 32k BF16 41.4 ->
// 40.3 us (8B), 42.5 -> 42.1 us (70B); B = 1, ctx 1024 8.4 -> 8.2 / 9.4 -> 8.9 us; one split
// (B = 32) within 0.8%.
#ifndef STOKE_ATTN_MERGE_UNROLL
#define STOKE_ATTN_MERGE_UNROLL 16
#endif
// 1: the in-CTA merge after the last tile works through both head slots of every warp (a warp
// holds heads warp and warp + WARPS), the second one's result dropped where it is not a real
// head, so the two heads' chains interleave instead of the second starting after the first
// (with 8 heads per kv head the tail after the last tile was about 100 instructions per warp
// longer than with 4: results/experiments/h200-attention-ncu-70b-b8-99800e6.txt). 0: a warp
// stops after its real heads. Same run against 0 (fb4aba6,
// results/experiments/h200-attention-merge-ilp-fb4aba6.json), BF16: B = 8, ctx 1024 14.11 ->
// 13.73 us (8B), 15.17 -> 14.66 (70B); B = 32, ctx 4096 123.70 -> 123.17 / 124.60 -> 123.46;
// ctx 32k 38.54 -> 37.65 / 39.44 -> 39.43; FP8 / INT4 within 1.5%.
#ifndef STOKE_ATTN_MERGE_ILP
#define STOKE_ATTN_MERGE_ILP 1
#endif
// N > 0: the last split's merge requests the first N splits' partial outputs of its warp's heads
// together with the splits' (max, sum) records, instead of after the records have arrived and
// their max is known (the weights are applied once both are in): one L2 round trip less on the
// path after the last split's final tile (BF16 and FP8); with at most N splits, none of the
// merge's unrolled loop runs either. 0: off. The trace of a launch (STOKE_ATTN_TRACE) put that
// path at 3.4-4.9 us (B = 1, ctx 32k; B = 8, ctx 1024), against 1.3-1.5 us for the splits that
// only write their partials. Same run as the shipped kernels (326c85d / 798a021,
// results/experiments/h200-attention-merge-early-326c85d.json, ...-acq-rel-798a021.json): N = 16
// (255 registers) 70B B = 8, ctx 1024 BF16 14.50 -> 14.16 us, FP8 12.89 -> 11.69, but B = 1,
// ctx 32k 37.90 -> 39.16 (8B) and 39.18 -> 40.39 (70B): slower streaming, not a longer merge.
// N = 4 (488c63d, results/h200-attention.json variant rows): B = 8 13.40 -> 13.08 / 14.53 ->
// 13.64 us, but ctx 32k 38.17 -> 40.55 / 39.29 -> 43.68 (the unrolled loop then starts at split
// 4 and leaves 12 splits to its one-at-a-time remainder, likely).
#ifndef STOKE_ATTN_MERGE_EARLY
#define STOKE_ATTN_MERGE_EARLY 0
#endif
// 1: a split counts its arrival with one acquire-release atomic by thread 0 after the CTA
// barrier (the release covers the partial stores of every thread, the acquire the merge's loads)
// instead of a sequentially consistent fence (__threadfence: MEMBAR.SC.GPU and an L1
// invalidation) by every thread before a relaxed count and another after it. The trace put the
// records' round trip behind the second fence at 0.8-1.1 us, 0.6-0.8 us without it. Same run
// against 0 (798a021, results/experiments/h200-attention-acq-rel-798a021.json): every split
// point faster, B = 8, ctx 1024 BF16 13.72 -> 13.44 us (8B), 14.89 -> 14.50 (70B); B = 1, ctx
// 32k 38.56 -> 37.90 / 39.33 -> 39.18; FP8 and INT4 0.9-4% faster.
#ifndef STOKE_ATTN_ACQ_REL
#define STOKE_ATTN_ACQ_REL 1
#endif
#ifndef STOKE_ATTN_PARTIAL_F16
#define STOKE_ATTN_PARTIAL_F16 0
#endif
// Programmatic dependent launch (the entry's `_pdl` global; Runtime::launch): the kernel lets
// the next kernel on the stream launch at once, and before it waits for the previous kernel
// (griddepcontrol.wait) it only asks the L2 for the first STOKE_ATTN_PDL_PREFETCH batches of
// each warp's cache rows, so their DRAM round trip overlaps the previous kernel's end. Those
// are hints: the slot is read before the wait only to place them (a stale value prefetches
// other rows), and every load that feeds the results comes after the wait (the L2 is
// coherent). 0: launched in plain stream order. STOKE_ATTN_PDL is the mirrors' (FP8 / INT4),
// STOKE_ATTN_PDL_BF16 the BF16 cache's. Both on against both off, same run (graphs of
// back-to-back calls; results/experiments/h200-attention-pdl-b48a9b7.json): the mirrors 1-5%
// faster at every point (INT4 B = 32, ctx 4096 41.61 -> 41.15 us at 70B, ctx 32k 20.05 ->
// 19.54), BF16 2-5% faster at context 1024 but 1.5-1.7% slower at B = 32, ctx 4096 (125.94 ->
// 128.12 us at 70B) and at 8B ctx 32k, so BF16 stays in stream order. Launching BF16
// programmatically only for calls of at most 64 MiB (b758a041, reverted;
// results/experiments/h200-attention-bf16-pdl-size-b758a04.json) gained 1.7-2.2% at B = 8, ctx
// 1024 but lost 4-5% at B = 1 (clustered launches), and the prologue alone, in stream order,
// cost 0.6-3.6% at B = 32 and ctx 32k.
#ifndef STOKE_ATTN_PDL
#define STOKE_ATTN_PDL 1
#endif
#ifndef STOKE_ATTN_PDL_BF16
#define STOKE_ATTN_PDL_BF16 0
#endif
#define ATTN_PDL(FMT) ((FMT) == FMT_BF16 ? STOKE_ATTN_PDL_BF16 : STOKE_ATTN_PDL)
#ifndef STOKE_ATTN_PDL_PREFETCH
#define STOKE_ATTN_PDL_PREFETCH 1
#endif
// 1: a split launch of 2-8 splits whose clusters are all resident at once forms one thread-block
// cluster per (sequence, kv head) on the `_cl` entry points (the runtime decides per launch, and
// the split plan counts such a split's merge as free), and the splits merge through
// distributed shared memory: each CTA leaves its heads' partials
// (max, sum, unnormalized output) in its own shared memory, a cluster barrier, then CTA q merges
// heads q, q + splits, ... from every CTA's memory and writes them, and a second barrier keeps
// each CTA's memory until the cluster has read it. No partials in global memory, no arrival
// count, and the merge is spread over the splits instead of done by the last one to finish.
// 0 (or a launch without a cluster): the partials and the last split's merge below.
#ifndef STOKE_ATTN_CLUSTER
#define STOKE_ATTN_CLUSTER 1
#endif

#define NEG_INF __int_as_float(0xff800000)
constexpr int MAX_GROUP = 8;

// 1: a timeline of each attention launch for diagnostics (the benchmark reads it after a
// variant's timing): thread 0 of each CTA stores into the module global decode_attn_trace, at
// ATTN_TRACE_WORDS words per CTA (linear block index, the first ATTN_TRACE_CTAS), the
// %globaltimer ns at each TraceAt point it passes (0 where it passes none), then its SM in the
// low 16 bits of word TRACE_SM with flags above (bit 16: it merged the splits; bit 17: cluster
// merge). 0: none (the shipped kernels).
#ifndef STOKE_ATTN_TRACE
#define STOKE_ATTN_TRACE 0
#endif
enum TraceAt {
    TRACE_START = 0,    // the CTA starts
    TRACE_STREAMED,     // every warp is past its last tile
    TRACE_MERGED,       // its warps' outputs merged (partials or output stores issued)
    TRACE_ARRIVED,      // split launches: the arrival count answered
    TRACE_RECORDS,      // the merging split: every split's (max, sum) in, their max known
    TRACE_END,          // the CTA's last store issued
    TRACE_SM,
    ATTN_TRACE_WORDS = 8
};
constexpr unsigned ATTN_TRACE_CTAS = 4096;
#if STOKE_ATTN_TRACE
extern "C" __device__ unsigned long long decode_attn_trace[ATTN_TRACE_CTAS * ATTN_TRACE_WORDS];
#endif
// Stores the time of point `at` for this CTA (TRACE_END: also its SM and `flags`), read after
// `dep` is known and after the memory operations before it have been issued.
__device__ __forceinline__ void attn_trace(TraceAt at, unsigned flags = 0, float dep = 0.0f) {
#if STOKE_ATTN_TRACE
    if (threadIdx.x != 0) return;
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta >= ATTN_TRACE_CTAS) return;
    unsigned long long* w = decode_attn_trace + cta * ATTN_TRACE_WORDS;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(dep) : "memory");
    if (at == TRACE_START)
        for (int i = 1; i < ATTN_TRACE_WORDS; ++i) w[i] = 0;
    w[at] = t;
    if (at == TRACE_END) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        w[TRACE_SM] = sm | (flags << 16);
    }
#endif
}

struct KvCache {
    void* k;         // see the header: bf16 rows, fp8 codes or int4 bytes
    void* v;
    float* ks;       // [slots, kv_heads, cap] (FP8 and INT4)
    float* vs;
    u32 kv_heads, cap, d, format;
};

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
    float* part_ml;       // [batch, heads, splits, 2 or 4] (running max of scaled scores, sum of
                          // exp; PARTIAL_F16: and the output's scale); the host allocates 16 bytes
                          // per record
    u16* out;             // [batch, heads, d] bf16
    u32* arrived;         // [batch, kv_heads] splits finished (splits > 1); zero between launches
    u32 batch, heads, splits, chunk, block;
    float scale;          // 1 / sqrt(d)
};
static_assert(sizeof(KvCache) == 48, "KvCache layout");
static_assert(sizeof(AppendParams) == 136, "AppendParams layout");
static_assert(sizeof(AttnParams) == 128, "AttnParams layout");

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(u32(v) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Nearest E4M3 code of x (saturating, ties to even), as the hardware does it.
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return r & 0xffu;
}

// In-place normalized Walsh-Hadamard transform of each `block` (a power of two up to D; 0: none)
// consecutive values of a D-vector held by one warp in registers, lane l holding values
// l E .. l E + E - 1 (E = D / 32): the butterflies of distance below E inside the lane, the
// rest across lanes by shuffles (one per value and pass).
template <int D>
__device__ __forceinline__ void hadamard_regs(float (&x)[D / 32], u32 block, u32 lane) {
    constexpr int E = D / 32;
    if (block == 0) return;
#pragma unroll
    for (int h = 1; h < E; h <<= 1)
#pragma unroll
        for (int a = 0; a < E; ++a)
            if (!(a & h) && u32(h) < block) {
                const float u = x[a], v = x[a + h];
                x[a] = u + v;
                x[a + h] = u - v;
            }
#pragma unroll
    for (u32 hl = 1; hl < 32; hl <<= 1) {  // lane distance hl: value distance hl E
        if (hl * E >= block) break;
        const bool upper = lane & hl;
#pragma unroll
        for (int a = 0; a < E; ++a) {
            const float y = __shfl_xor_sync(0xffffffffu, x[a], hl);
            x[a] = upper ? y - x[a] : x[a] + y;
        }
    }
    const float norm = rsqrtf(float(block));
#pragma unroll
    for (int a = 0; a < E; ++a) x[a] *= norm;
}

// E consecutive floats at p (E = 2 or 4, aligned): shared memory, or with CG global memory
// through the L2 only (data other CTAs wrote during this kernel).
template <int E, bool CG = false>
__device__ __forceinline__ void load_floats(const float* p, float (&x)[E]) {
    if (E == 4) {
        const float4 v = CG ? __ldcg(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
        x[0] = v.x;
        x[1 % E] = v.y;
        x[2 % E] = v.z;
        x[3 % E] = v.w;
    } else {
        const float2 v = CG ? __ldcg(reinterpret_cast<const float2*>(p)) : *reinterpret_cast<const float2*>(p);
        x[0] = v.x;
        x[E - 1] = v.y;
    }
}

template <int E>
__device__ __forceinline__ void store_floats(float* p, const float (&x)[E]) {
    if (E == 4)
        *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1 % E], x[2 % E], x[3 % E]);
    else
        *reinterpret_cast<float2*>(p) = make_float2(x[0], x[E - 1]);
}

// N (1 or 2) words stored at p (aligned).
template <int N>
__device__ __forceinline__ void store_words(u16* p, const u32 (&w)[N]) {
    if (N == 2)
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[N - 1]);
    else
        *reinterpret_cast<u32*>(p) = w[0];
}

// E (2 or 4) floats as bf16 at p (aligned).
template <int E>
__device__ __forceinline__ void store_bf16(u16* p, const float (&x)[E]) {
    const u32 w0 = u32(f32_to_bf16(x[0])) | (u32(f32_to_bf16(x[1])) << 16);
    if (E == 4)
        *reinterpret_cast<uint2*>(p) = make_uint2(w0, u32(f32_to_bf16(x[2 % E])) | (u32(f32_to_bf16(x[3 % E])) << 16));
    else
        *reinterpret_cast<u32*>(p) = w0;
}

// Thread-block clusters (STOKE_ATTN_CLUSTER): cluster_ctas, cluster_rank, cluster_sync and
// ld_cluster_floats come from cluster.cuh.

// A head's merged output slice (lane l: dims l E ..): divided by the row sum, rotated back
// (undoes V's rotation; block 0: none) and written as bf16 at out.
template <int D>
__device__ __forceinline__ void write_head(float (&os)[D / 32], float lsum, u32 block, u32 lane, u16* out) {
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
#pragma unroll
    for (int e = 0; e < D / 32; ++e) os[e] *= inv;
    hadamard_regs<D>(os, block, lane);
    store_bf16<D / 32>(out + lane * (D / 32), os);
}

// Global loads of data read once (cache rows and scales; also new rows and queries through
// load_words): with STOKE_ATTN_L2_PREFETCH (128 or 256) the L2 fetches that many bytes around
// each miss from DRAM.
#if STOKE_ATTN_L2_PREFETCH == 256
#define STOKE_ATTN_PF ".L2::256B"
#elif STOKE_ATTN_L2_PREFETCH == 128
#define STOKE_ATTN_PF ".L2::128B"
#else
#define STOKE_ATTN_PF ""
#endif
#if STOKE_ATTN_L2_PREFETCH
__device__ __forceinline__ uint4 ldg_cache(const uint4* p) {
    uint4 v;
    asm("ld.global.nc" STOKE_ATTN_PF ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ldg_cache(const uint2* p) {
    uint2 v;
    asm("ld.global.nc" STOKE_ATTN_PF ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_cache(const u32* p) {
    u32 v;
    asm("ld.global.nc" STOKE_ATTN_PF ".u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ldg_cache(const float* p) {
    float v;
    asm("ld.global.nc" STOKE_ATTN_PF ".f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
#else
template <typename T>
__device__ __forceinline__ T ldg_cache(const T* p) { return __ldg(p); }
#endif

// N (1 or 2) consecutive words at p.
template <int N>
__device__ __forceinline__ void load_words(const u8* p, u32* w) {
    if (N == 2) {
        const uint2 v = ldg_cache(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[N - 1] = v.y;
    } else {
        w[0] = ldg_cache(reinterpret_cast<const u32*>(p));
    }
}

// ---------------------------------------------------------------------------------------------
// Cache append
// ---------------------------------------------------------------------------------------------

// One warp per (slot, kv head, K or V) item; lane l holds row values l E .. l E + E - 1.
template <int D>
__device__ __forceinline__ void append_row(const AppendParams& p, u32 b, u32 h, u32 is_v, u32 kvh, u32 lane) {
    constexpr int E = D / 32;
    const u16* src = (is_v ? p.v_new : p.k_new) + (u64(b) * kvh + h) * D + lane * E;
    const u32 slot = p.slot_of[b], pos = p.pos[b];
    u32 w[E / 2];
    load_words<E / 2>(reinterpret_cast<const u8*>(src), w);
    if (p.main.k) {
        store_words<E / 2>(static_cast<u16*>(is_v ? p.main.v : p.main.k) + ((u64(slot) * kvh + h) * p.main.cap + pos) * D + lane * E, w);
    }
    if (!p.mirror.k) return;
    const KvCache& m = p.mirror;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = bf16_to_f32(u16(w[e / 2] >> (16 * (e % 2))));
    hadamard_regs<D>(x, p.block, lane);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const u64 r = (u64(slot) * kvh + h) * m.cap + pos;
    if (m.format == FMT_FP8) {
        const float s = amax / 448.0f;
        u32 codes = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) codes |= (s > 0.0f ? f32_to_e4m3(x[e] / s) : 0u) << (8 * e);
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * D + lane * E;
        if (E == 4)
            *reinterpret_cast<u32*>(dst) = codes;
        else
            *reinterpret_cast<u16*>(dst) = u16(codes);
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    } else {
        const float s = amax / 7.0f;
        // Byte j: value 2j in the low nibble, 2j + 1 in the high one (keys and values alike).
        u32 nib = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float qv = s > 0.0f ? fminf(fmaxf(rintf(x[e] / s), -8.0f), 7.0f) : 0.0f;
            nib |= (u32(int(qv)) & 0xfu) << (4 * e);
        }
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * (D / 2) + lane * (E / 2);
        if (E == 4)
            *reinterpret_cast<u16*>(dst) = u16(nib);
        else
            *dst = u8(nib);
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    }
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

// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------

template <bool F16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (F16)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The two halves (low, high) of an f16 pair as f32.
__device__ __forceinline__ void f16x2_to_f32(u32 h2, float& lo, float& hi) {
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(h2));
}

#if STOKE_ATTN_PARTIAL_F16
// A split's partial output slice (lane l: dims l E ..) of one head as f16 times 2^(14 - ex),
// ex the exponent that bounds the row's largest magnitude (a warp max), and its record (max,
// sum, scale 2^(ex - 14), -).
template <int D>
__device__ __forceinline__ void store_part_f16(float* part_o, float* ml, u64 idx, u32 lane, float m, float l,
                                               const float (&os)[D / 32]) {
    constexpr int E = D / 32;
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(os[e]));
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o2));
    int ex;
    frexpf(amax, &ex);  // amax < 2^ex (ex = 0 for amax == 0)
    const float inv = ldexpf(1.0f, 14 - ex);
    u32 w[E / 2];
#pragma unroll
    for (int e = 0; e < E; e += 2) w[e / 2] = pack2<true>(os[e] * inv, os[e + 1] * inv);
    store_words<E / 2>(reinterpret_cast<u16*>(part_o) + idx * D + lane * E, w);
    if (lane == 0) reinterpret_cast<float4*>(ml)[idx] = make_float4(m, l, ldexpf(1.0f, ex - 14), 0.0f);
}

// The f16 slice at src (store_part_f16) as floats, read through the L2 (other CTAs wrote it).
template <int E>
__device__ __forceinline__ void load_part_f16(const u16* src, float (&x)[E]) {
    u32 w[E / 2];
    if (E == 4) {
        const uint2 v = __ldcg(reinterpret_cast<const uint2*>(src));
        w[0] = v.x;
        w[(E / 2) - 1] = v.y;
    } else {
        w[0] = __ldcg(reinterpret_cast<const unsigned int*>(src));
    }
#pragma unroll
    for (int e = 0; e < E; e += 2) f16x2_to_f32(w[e / 2], x[e], x[e + 1]);
}
#endif

template <bool F16>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two E4M3 codes (bits 0-7 and 8-15 of v) to an f16 pair (exact).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(u16(v & 0xffffu)));
    return r;
}

// Value codes of an INT4 word w as four exact f16 pairs q, two instructions each (no byte
// permute): register r holds dims (r, r + 4) of the word's 8. Even r: the nibble xor 8 under
// the exponent of 1024 is 1032 + q, minus 1032; odd r: the high nibble in place is 1152 + 16 q,
// times 1 / 16 minus 72 (one fma, exact).
__device__ __forceinline__ void int4_values(u32 w, u32 (&h)[4]) {
    const u32 w8 = w >> 8;
    u32 e0, o0, e1, o1;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(e0) : "r"(w), "r"(0x000f000fu), "r"(0x64086408u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(o0) : "r"(w), "r"(0x00f000f0u), "r"(0x64806480u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(e1) : "r"(w8), "r"(0x000f000fu), "r"(0x64086408u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(o1) : "r"(w8), "r"(0x00f000f0u), "r"(0x64806480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[0]) : "r"(e0), "r"(0x64086408u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h[1]) : "r"(o0), "r"(0x2c002c00u), "r"(0xd480d480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h[2]) : "r"(e1), "r"(0x64086408u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h[3]) : "r"(o1), "r"(0x2c002c00u), "r"(0xd480d480u));
}

// INT4 values as the A operand of O^T += V^T P^T straight from registers (no shared tile): lane
// (g, t) holds dims g D / 8 .. (g + 1) D / 8 of keys 2t, 2t + 1 (k columns 2t, 2t + 1) and 2t + 8,
// 2t + 9 (columns 2t + 8, 2t + 9), and m-tile n's rows g / g + 8 are its local dims 2n / 2n + 1.
// A byte permute puts the same 4 dims of two keys side by side (key a in the low half, key b in
// the high one), and int4_values turns them into 4 f16 pairs: h[0..3] = local dims 8j + 4 hi
// + 0..3 of word j (hi: 0 for bytes 0-1, 1 for bytes 2-3).
__device__ __forceinline__ void int4_key_pairs(u32 a, u32 b, int hi, u32 (&h)[4]) {
    int4_values(__byte_perm(a, b, hi ? 0x7632 : 0x5410), h);
}

// The output dim of row g (half 0) or g + 8 (half 1) of value m-tile n (int4_key_pairs).
template <int D>
__device__ __forceinline__ u32 int4_value_dim(u32 g, u32 n, u32 half) { return g * (D / 8) + 2 * n + half; }

// INT4 value key kk (0..3) of lane (g, t), relative to key 2t of the tile: keys 2t, 2t + 1,
// 2t + 8, 2t + 9 (int4_key_pairs).
__device__ __forceinline__ u32 int4_value_key(int kk) { return (kk & 1) + 8 * (kk >> 1); }

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// A BF16 key tile in shared memory (STOKE_ATTN_K_SMEM): 16 rows of 2 D bytes, unpadded, the
// 16-byte chunk c of row r at chunk c ^ 4 (r & 1). A lane (g, t) reads its slice chunks t + 4 i of
// rows g and g + 8; in each 8-lane phase of a 16-byte load, rows g = 2 j and 2 j + 1 then fall in
// the two halves of the 8 bank groups (unswizzled: a 2-way conflict).
template <int D>
struct KTile {
    static constexpr int BYTES = 16 * 2 * D;
    static __device__ __forceinline__ u32 at(u32 row, u32 chunk) { return row * (2 * D) + ((chunk ^ ((row & 1) << 2)) << 4); }
};

// Raw cache words of one lane per 16-key tile, loaded before any of them is used (so a warp has
// TILES tiles of loads in flight): the key slice of rows g and g + 8 of the tile (lane (g, t):
// D / 4 dims from dim t * D / 4), and for the mirrors half a value row (lane = 2 key + half).
// The BF16 value rows go straight to shared memory with cp.async instead.
template <int FMT, int D>
struct Raw {
    static constexpr int KW = FMT == FMT_BF16 ? D / 8 : FMT == FMT_FP8 ? D / 16 : D / 32;  // words per key slice
    // Mirrors' value words: FP8 half a value row; INT4 the lane's D / 8 dims (from dim g D / 8)
    // of its 4 keys 2t, 2t + 1, 2t + 8, 2t + 9 (D / 64 words each, key-major).
    static constexpr int VW = FMT == FMT_BF16 ? 0 : FMT == FMT_FP8 ? D / 8 : D / 16;
    static constexpr int VK = D / 64;  // INT4: value words per key
    u32 k[2][KW];
    u32 v[VW > 0 ? VW : 1];
    float ks[2][2];  // mirrors: [nt][0] K and [nt][1] V scale of key 8 nt + g (the lane's scores)
};

// Bytes per load piece of a lane: 16, or the lane's whole share when it is smaller.
template <int SHARE>
struct Piece {
    static constexpr int BYTES = SHARE < 16 ? SHARE : 16;
};

// The N words of a lane's pieces: piece i (16 bytes, or 8 when N == 2) at p + i * stride. The
// lanes that share a row take interleaved pieces (stride = lanes per row x piece), so one load
// instruction covers whole 32-byte sectors of each row instead of half of each.
template <int N>
__device__ __forceinline__ void load_pieces(const u8* p, u32 stride, u32 (&w)[N]) {
    if (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const uint4 v = ldg_cache(reinterpret_cast<const uint4*>(p + i * stride));
            w[4 * i] = v.x;
            w[(4 * i + 1) % N] = v.y;
            w[(4 * i + 2) % N] = v.z;
            w[(4 * i + 3) % N] = v.w;
        }
    } else {
        const uint2 v = ldg_cache(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[1 % N] = v.y;
    }
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global" STOKE_ATTN_PF " [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// Waits until at most n of the calling thread's cp.async groups are pending (n is a constant
// after unrolling; above 3 it waits for 3, which is stricter).
__device__ __forceinline__ void cp_async_wait(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
}

// cp.async of a tile's 16 rows of KB bytes, whole rows per instruction (lane: 16-byte chunk
// lane % CPR of rows RPI i + lane / CPR), rows past k1 read row k0; dst(row, chunk) is the
// chunk's shared-memory address.
template <int KB, typename Dst>
__device__ __forceinline__ void copy_tile_rows(const void* src, u64 row0, u32 base, u32 k0, u32 k1, u32 lane, Dst dst) {
    constexpr int CPR = KB / 16, RPI = 32 / CPR;
    const u32 r0 = lane / CPR, col = lane % CPR;
#pragma unroll
    for (int i = 0; i < 16 / RPI; ++i) {
        const u32 kr = RPI * i + r0;
        const u64 row = row0 + (base + kr < k1 ? base + kr : k0);
        cp_async16(dst(kr, col), static_cast<const u8*>(src) + row * KB + col * 16);
    }
}

// Queues the loads of the tile at key `base`: K slices into r, V (BF16: cp.async into `tile`;
// mirrors: into r). Rows past k1 read row k0: finite values under masked (zero) probabilities.
template <int FMT, int D, int VP>
__device__ __forceinline__ void load_tile(const KvCache& c, u64 row0, u32 base, u32 k0, u32 k1, u32 lane,
                                         Raw<FMT, D>& r, u16* tile, u8* ktile) {
    const u32 g = lane >> 2, t = lane & 3;
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int KP = Piece<KB / 4>::BYTES, VP2 = Piece<KB / 2>::BYTES;
    if (FMT == FMT_BF16 && STOKE_ATTN_K_SMEM) {  // chunks swizzled (KTile)
        copy_tile_rows<KB>(c.k, row0, base, k0, k1, lane, [&](u32 row, u32 chunk) { return smem_u32(ktile + KTile<D>::at(row, chunk)); });
    } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const u32 key = base + 8 * nt + g;
            const u8* rowp = static_cast<const u8*>(c.k) + (row0 + (key < k1 ? key : k0)) * KB;
            load_pieces(rowp + t * KP, 4 * KP, r.k[nt]);
        }
    }
    const u32 key = lane >> 1, half = lane & 1;
    const bool valid = base + key < k1;
    const u64 row = row0 + (valid ? base + key : k0);
    if (FMT == FMT_BF16 && STOKE_ATTN_V_ROWS) {
        copy_tile_rows<KB>(c.v, row0, base, k0, k1, lane, [&](u32 row, u32 chunk) { return smem_u32(tile + row * VP + chunk * 8); });
    } else if (FMT == FMT_BF16) {
        // Pieces 2i + half of the row (16 bytes = 8 values each).
        const u8* src = static_cast<const u8*>(c.v) + row * KB + half * 16;
        const u32 dst = smem_u32(tile + key * VP + half * 8);
#pragma unroll
        for (int i = 0; i < D / 16; ++i) cp_async16(dst + 32 * i, src + 32 * i);
    } else {
        if (FMT == FMT_INT4) {
            // Keys 2t, 2t + 1, 2t + 8, 2t + 9, the lane's D / 16 bytes from byte g D / 16.
            constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u32 vk = base + 2 * t + int4_value_key(kk);
                const u8* src = static_cast<const u8*>(c.v) + (row0 + (vk < k1 ? vk : k0)) * KB + g * (D / 16);
                load_words<VK>(src, &r.v[kk * VK]);
            }
        } else {
            load_pieces(static_cast<const u8*>(c.v) + row * KB + half * VP2, 2 * VP2, r.v);
        }
        // The scales travel with their tile: loaded here, they are in flight with the codes
        // instead of costing a dependent round trip when the tile is used.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // The K (i = 0) and V (i = 1) scales of key 8 nt + g, the lane's score rows.
                const u32 kk = base + 8 * nt + g;
                r.ks[nt][i] = ldg_cache((i ? c.vs : c.ks) + row0 + (kk < k1 ? kk : k0));
            }
    }
}

// B fragments (b[2 j], b[2 j + 1] of chunk j) of one key slice.
template <int FMT, int D>
__device__ __forceinline__ void k_fragments(const u32 (&w)[Raw<FMT, D>::KW], u32 (&b)[D / 8]) {
    if (FMT == FMT_BF16) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) b[i] = w[i % Raw<FMT, D>::KW];
    } else {  // FP8 (INT4 keys go through k_operand's LOP3 form)
#pragma unroll
        for (int i = 0; i < Raw<FMT, D>::KW; ++i) {
            b[2 * i] = e4m3x2_to_f16x2(w[i]);
            b[2 * i + 1] = e4m3x2_to_f16x2(w[i] >> 16);
        }
    }
}

// A operands of one key row's slice for S^T = K Q^T (register R feeds chunk R / 2 as a0/a2 for
// row g, a1/a3 for row g + 8). BF16 / FP8: slice values 2R, 2R + 1, as k_fragments. INT4: register
// 4i + r of word i holds slice values (8i + r, 8i + r + 4) offset, with one LOP3 each and no
// subtraction: even r 1032 + q (the nibble xor 8 under the exponent of 1024), odd r 1152 + 16 q
// (the high nibble in place). The query carries 1 / 16 on the odd registers, and the score
// accumulator starts at minus the offsets' dot product with the query (kernel prologue).
template <int FMT, int D>
__device__ __forceinline__ void k_operand(const u32 (&w)[Raw<FMT, D>::KW], u32 (&b)[D / 8]) {
    if (FMT != FMT_INT4) {
        k_fragments<FMT, D>(w, b);
    } else {
#pragma unroll
        for (int i = 0; i < Raw<FMT, D>::KW; ++i) {
            const u32 w8 = w[i] >> 8;
            asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(b[4 * i]) : "r"(w[i]), "r"(0x000f000fu), "r"(0x64086408u));
            asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(b[4 * i + 1]) : "r"(w[i]), "r"(0x00f000f0u), "r"(0x64806480u));
            asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(b[4 * i + 2]) : "r"(w8), "r"(0x000f000fu), "r"(0x64086408u));
            asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(b[4 * i + 3]) : "r"(w8), "r"(0x00f000f0u), "r"(0x64806480u));
        }
    }
}

// The slice values (e0, e1) held by A-operand register R of k_operand, and the factor the
// query carries for them.
template <int FMT>
__device__ __forceinline__ void operand_values(int R, int& e0, int& e1, float& qf) {
    if (FMT == FMT_INT4) {
        e0 = 8 * (R / 4) + R % 4;
        e1 = e0 + 4;
        qf = R % 2 ? 1.0f / 16.0f : 1.0f;
    } else {
        e0 = 2 * R;
        e1 = 2 * R + 1;
        qf = 1.0f;
    }
}

// The loads of tile ti of a batch that lies wholly below the end of the range,
// from the lane's running pointers (its key row g, value row and scales at the batch's first
// tile): constant offsets, no clamping.
template <int FMT, int D, int VP>
__device__ __forceinline__ void load_tile_fast(const u8* kp, const u8* vp, const float* ksp, const float* vsp,
                                              int ti, Raw<FMT, D>& r, u32 vdst, u32 kdst) {
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int KP = Piece<KB / 4>::BYTES, VP2 = Piece<KB / 2>::BYTES;
    if (FMT == FMT_BF16 && STOKE_ATTN_K_SMEM) {
        // kp: the lane's chunk of its first row (load_tile); kdst: its swizzled place in slot 0.
        // Rows RPI apart keep the row's parity, so the swizzle is the lane's own.
        constexpr int RPI = 32 / (KB / 16);
#pragma unroll
        for (int i = 0; i < 16 / RPI; ++i) cp_async16(kdst + ti * KTile<D>::BYTES + RPI * i * KB, kp + (ti * 16 + RPI * i) * KB);
    } else {
        load_pieces(kp + ti * 16 * KB, 4 * KP, r.k[0]);
        load_pieces(kp + (ti * 16 + 8) * KB, 4 * KP, r.k[1]);
    }
    if (FMT == FMT_BF16 && STOKE_ATTN_V_ROWS) {
        constexpr int RPI = 32 / (KB / 16);  // whole rows per instruction (see load_tile)
#pragma unroll
        for (int i = 0; i < 16 / RPI; ++i) cp_async16(vdst + RPI * i * VP * 2, vp + (ti * 16 + RPI * i) * KB);
    } else if (FMT == FMT_BF16) {
#pragma unroll
        for (int i = 0; i < D / 16; ++i) cp_async16(vdst + 32 * i, vp + ti * 16 * KB + 32 * i);
    } else {
        if (FMT == FMT_INT4) {  // vp: key row 2t of the batch, at the lane's bytes (load_tile)
            constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) load_words<VK>(vp + (ti * 16 + int4_value_key(kk)) * KB, &r.v[kk * VK]);
        } else {
            load_pieces(vp + ti * 16 * KB, 2 * VP2, r.v);
        }
        r.ks[0][0] = ldg_cache(ksp + 16 * ti);
        r.ks[1][0] = ldg_cache(ksp + 16 * ti + 8);
        r.ks[0][1] = ldg_cache(vsp + 16 * ti);
        r.ks[1][1] = ldg_cache(vsp + 16 * ti + 8);
    }
}

__device__ __forceinline__ float exp2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// FP8: the lane's half value row as exact f16 codes (the E4M3 values) in `tile`, in dim order.
// The row scales go to the probabilities instead. (INT4 values skip the tile: int4_key_pairs.
// An offset left in the INT4 codes and taken off the output once, 1032 times the sum of P,
// cancels too much over long contexts: 1.7e-2 relative error at 4k keys.)
template <int FMT, int D, int VP>
__device__ __forceinline__ void codes_to_tile(const Raw<FMT, D>& r, u32 lane, u16* tile) {
    const u32 key = lane >> 1, half = lane & 1;
    constexpr int PE = Piece<D / 2>::BYTES;
    u16* dst = tile + key * VP;
    u32 h[D / 4];
#pragma unroll
    for (int i = 0; i < Raw<FMT, D>::VW; ++i) {
        h[2 * i] = e4m3x2_to_f16x2(r.v[i]);
        h[2 * i + 1] = e4m3x2_to_f16x2(r.v[i] >> 16);
    }
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
        const int at = (2 * (8 * i / PE) + int(half)) * PE + 8 * i % PE;
        *reinterpret_cast<uint4*>(dst + at) = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
    }
}

__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// A query row in shared memory (STOKE_ATTN_SMEM_LAYOUT = 1; 0: dim dd at dd, pitch D): dim dd at
// pos(dd), 8 floats of padding after every 32 dims and a
// row pitch of 4 (mod 32) floats, so that the lanes reading their slices of the query (lane
// (g, t): row g, dims from t times the slice piece) for the B fragments fall in distinct banks
// (BF16, FP8 and INT4 slices alike; unpadded, INT4's were 8-way conflicts per 16-byte load).
template <int D>
struct QsRow {
    static constexpr int P = STOKE_ATTN_SMEM_LAYOUT ? (D + D / 4 + 27) / 32 * 32 + 4 : D;
    static __device__ __forceinline__ u32 pos(u32 dd) { return STOKE_ATTN_SMEM_LAYOUT ? dd + (dd >> 5) * 8 : dd; }
};

// A head's row of a warp's output in the merge buffer (STOKE_ATTN_SMEM_LAYOUT = 1; 0: dim dd at
// dd, pitch D, scalar stores): pitch D + 4 floats (the lanes of a
// scalar store, t apart by two heads and g by one column, fall in distinct banks); INT4 stores
// whole float4 groups of a lane's D / 8 dims, placed with the group index xor the head pair t
// so that the 8 lanes of a store phase hit 8 distinct bank groups (unswizzled, a 16-way
// conflict per store for 8 heads). The merge reads with the same places.
template <int D>
struct WoRow {
    static constexpr int P = STOKE_ATTN_SMEM_LAYOUT ? D + 4 : D;
    static __device__ __forceinline__ u32 pos(int fmt, u32 h, u32 dd) {
        if (fmt != FMT_INT4 || !STOKE_ATTN_SMEM_LAYOUT) return dd;
        constexpr u32 NJ = D / 32;  // float4 groups per lane and head
        const u32 q = dd >> 2;
        return ((q & ~(NJ - 1)) | ((q ^ (h >> 1)) & (NJ - 1))) * 4 + (dd & 3);
    }
};

// The attention kernel's warps, tiles and shared-memory areas per format and head dim.
template <int FMT, int D>
struct AttnShape {
    static constexpr int VP = D + 8;  // value tile row pitch (elements)
    static constexpr int WARPS = FMT == FMT_INT4 ? STOKE_ATTN_WARPS_INT4 : STOKE_ATTN_WARPS;
    static constexpr int TILES = FMT == FMT_INT4 ? STOKE_ATTN_TILES_INT4 : STOKE_ATTN_TILES;
    // Tiles per softmax step: their scores, max and rescale together (PAIR: two independent
    // chains of score mma per step, half the serial softmax steps).
    static constexpr int NT = (FMT == FMT_BF16 ? STOKE_ATTN_PAIR_BF16 : STOKE_ATTN_PAIR) ? 2 : 1;
    static constexpr int VTILES = FMT == FMT_BF16 ? TILES : FMT == FMT_FP8 ? NT : 0;  // INT4: no value tile
    static constexpr int VT_BYTES = WARPS * VTILES * 16 * VP * 2;
    static constexpr int WO_BYTES = WARPS * MAX_GROUP * WoRow<D>::P * 4;
    // The value tiles, which become the merge buffer after the key loop.
    static constexpr int VT_AREA = VT_BYTES > WO_BYTES ? VT_BYTES : WO_BYTES;
    // BF16 keys through shared memory: the value area and the key tiles are dynamic.
    static constexpr bool KSM = FMT == FMT_BF16 && STOKE_ATTN_K_SMEM;
    static constexpr int KT_BYTES = KSM ? WARPS * TILES * KTile<D>::BYTES : 0;
    static constexpr unsigned DYN = KSM ? VT_AREA + KT_BYTES : 0;
};

extern __shared__ __align__(16) unsigned char attn_dyn_smem[];

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
    asm volatile("prefetch.global.L2::evict_normal [%0];" ::"l"(ptr));
}

// STOKE_ATTN_CLUSTER: the merge of a cluster's splits. CTA q (split q) merges heads q, q + splits,
// ..., a warp per head: lane s holds split s's (max, sum) from `ml` ([head][2] floats) of CTA s,
// and the splits' outputs from `part` ([head][D] floats) are added in a fixed order
// (deterministic). Not inlined: at the end of the attention kernel its registers are free, and
// inlined it made ptxas spill in the INT4 kernel's merge.
template <int D, int WARPS>
__device__ __noinline__ void cluster_merge(const AttnParams& p, u32 part, u32 ml, u32 group, u32 kvh, u32 b, u32 warp, u32 lane) {
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
        write_head<D>(os, lsum, p.block, lane, p.out + (u64(b) * p.heads + kvh * group + h) * D);
    }
    cluster_sync();  // every CTA's partials stay until the cluster has read them
}

// STOKE_ATTN_PDL: lets the next kernel launch, asks the L2 for this warp's first batches of
// cache rows (keys and values; positions from the split alone, clipped to the slot's capacity:
// no length is read), then waits for the previous kernel. Nothing before the wait reads what
// another kernel writes except the slot index, and that only places the hints.
template <int FMT, int D>
__device__ __forceinline__ void attn_pdl_prologue(const AttnParams& p) {
    if (!ATTN_PDL(FMT)) return;
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (STOKE_ATTN_PDL_PREFETCH > 0 && !STOKE_ATTN_RANGES) {
        using S = AttnShape<FMT, D>;
        constexpr int KB = row_bytes<FMT, D>();
        constexpr int LINES = 16 * S::TILES * KB / 128;  // 128-byte lines per batch of a warp
        const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const KvCache& c = p.cache;
        // Through the L2 only (.cg): a line of slot_of left in this SM's L1 before the wait could
        // serve the kernel's own read after it with a value an earlier kernel has since changed.
        u32 slot;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(slot) : "l"(p.slot_of + blockIdx.z));
        const u64 row0 = (u64(slot) * c.kv_heads + blockIdx.y) * c.cap;
        const u32 kw0 = blockIdx.x * p.chunk + warp * 16 * S::TILES;
#pragma unroll
        for (int f = 0; f < STOKE_ATTN_PDL_PREFETCH; ++f) {
            const u32 r0 = kw0 + f * S::WARPS * 16 * S::TILES;
            for (u32 i = lane; i < u32(LINES); i += 32) {
                const u32 row = r0 + i * 128 / KB;
                if (row >= c.cap) break;
                const u64 at = (row0 + r0) * KB + u64(i) * 128;
                prefetch_l2(static_cast<const u8*>(c.k) + at);
                prefetch_l2(static_cast<const u8*>(c.v) + at);
            }
        }
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The attention kernel (entry points decode_attn_FMT_dD), one warp per 16-key tile at a time;
// the tensor-core layout is in the header.
template <int FMT, int D, bool CL>
__device__ __forceinline__ void decode_attn(const AttnParams& p) {
    using S = AttnShape<FMT, D>;
    constexpr bool F16 = FMT != FMT_BF16;
    constexpr int VP = S::VP, WARPS = S::WARPS, TILES = S::TILES, NT = S::NT, VTILES = S::VTILES;
    constexpr bool KSM = S::KSM;
    __shared__ __align__(16) float qs[MAX_GROUP][QsRow<D>::P];
    __shared__ __align__(16) unsigned char vt_static[KSM ? 16 : S::VT_AREA];
    __shared__ float wm[WARPS][MAX_GROUP], wl[WARPS][MAX_GROUP];
    // The cluster entry points (CL): this split's partials, read by the cluster's merge.
    constexpr bool CLM = CL && STOKE_ATTN_CLUSTER;
    __shared__ __align__(16) float cpart[CLM ? MAX_GROUP : 1][CLM ? D : 4];
    __shared__ __align__(8) float cml[CLM ? MAX_GROUP : 1][2];
    unsigned char* const vt_raw = KSM ? attn_dyn_smem : vt_static;
    if (KSM) {  // the launch must bring the dynamic area (the host reads <entry>_dyn_smem)
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (int(dyn) < int(S::DYN)) __trap();
    }

    attn_trace(TRACE_START);
    attn_pdl_prologue<FMT, D>(p);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const KvCache& c = p.cache;
    const u32 group = p.heads / c.kv_heads;
    const u32 len = p.len[b];
    const u32 k0 = split * p.chunk, k1 = min(len, k0 + p.chunk);
    const u64 row0 = (u64(p.slot_of[b]) * c.kv_heads + kvh) * c.cap;

    // The query rows of this warp's heads (h = warp + WARPS r; lane l: dims l E .. l E + E - 1),
    // requested first; they are used after the first tiles' loads are queued.
    constexpr int E = D / 32;
    constexpr int QR = (MAX_GROUP + WARPS - 1) / WARPS;
    u32 qraw[QR][E / 2];
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        if (h < group) load_words<E / 2>(reinterpret_cast<const u8*>(p.q + ((u64(b) * p.heads + kvh * group + h) * D + lane * E)), qraw[r]);
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
    constexpr float VSF = 16.0f / float(1 << STOKE_ATTN_LAZY);  // P < 2^LAZY
    float o[D / 16][4];
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    u16* vt = reinterpret_cast<u16*>(vt_raw) + warp * VTILES * 16 * VP;
    // The lane's pointers at its warp's first tile: key row g, value row lane / 2 (its pieces),
    // the scales of key g; and where its value pieces land in the warp's BF16 tiles.
    // The warp's keys [kw0, kend) in batches kstep apart. RANGES: a contiguous share of whole
    // tiles (the shares differ by at most one tile); else every WARPS-th batch of the CTA's.
    u32 kw0, kend, kstep;
    if (STOKE_ATTN_RANGES) {
        const u32 ntiles = k1 > k0 ? (k1 - k0 + 15) / 16 : 0;
        const u32 per = ntiles / WARPS, rem = ntiles % WARPS;
        kw0 = k0 + 16 * (warp * per + min(warp, rem));
        kend = min(k1, kw0 + 16 * (per + (warp < rem ? 1 : 0)));
        kstep = 16 * TILES;
    } else {
        kw0 = k0 + warp * 16 * TILES;
        kend = k1;
        kstep = WARPS * 16 * TILES;
    }
    const u64 first = row0 + kw0;
    const u8* kp = static_cast<const u8*>(c.k) + (first + g) * KB + t * KP;  // KSM: set below
    // Value rows: lane / 2, piece lane % 2 (V_ROWS, BF16: row lane / CPR, 16-byte chunk lane % CPR).
    constexpr bool VROWS = FMT == FMT_BF16 && STOKE_ATTN_V_ROWS;
    // INT4: key row 2t, the lane's D / 16 bytes from byte g D / 16 (int4_key_pairs).
    const u32 vrow = VROWS ? lane / (KB / 16) : FMT == FMT_INT4 ? 2 * t : lane >> 1;
    const u32 vcol = VROWS ? (lane % (KB / 16)) * 16 : FMT == FMT_INT4 ? g * (D / 16) : (lane & 1) * VP2;  // bytes
    const u8* vp = static_cast<const u8*>(c.v) + (first + vrow) * KB + vcol;
    const float* ksp = F16 ? c.ks + first + g : nullptr;
    const float* vsp = F16 ? c.vs + first + g : nullptr;
    const u32 vdst = smem_u32(vt + vrow * VP + vcol / 2);
    // KSM: the warp's key tiles; the lane copies 16-byte chunk lane % (KB / 16) of rows
    // lane / (KB / 16) + 32 / (KB / 16) i of each (load_tile).
    u8* const kt = attn_dyn_smem + S::VT_AREA + warp * TILES * KTile<D>::BYTES;
    const u32 kdst = smem_u32(kt + KTile<D>::at(lane / (KB / 16), lane % (KB / 16)));
    if (KSM) kp = static_cast<const u8*>(c.k) + (first + lane / (KB / 16)) * KB + (lane % (KB / 16)) * 16;
    constexpr bool RING = (FMT == FMT_BF16 ? STOKE_ATTN_PIPELINE_BF16 : STOKE_ATTN_PIPELINE) != 0;
    static_assert(TILES % NT == 0, "tiles per step must divide the tiles in flight");
    Raw<FMT, D> raw[TILES];
    // Queues the loads of tile ti of the batch at key bb0 into raw[ti], from the lane's pointers
    // (at that batch). BF16 commits one cp.async group per call, empty past the end, so that a
    // slot's group is always followed by the same number of groups.
    auto issue = [&](int ti, u32 bb0) {
        if (bb0 + 16 * TILES <= kend)
            load_tile_fast<FMT, D, VP>(kp, vp, ksp, vsp, ti, raw[ti], vdst + (FMT == FMT_BF16 ? ti : 0) * 16 * VP * 2, kdst);
        else if (bb0 + 16 * (ti - ti % NT) < kend)  // a step's tiles past the end read row k0
            load_tile<FMT, D, VP>(c, row0, bb0 + 16 * ti, k0, kend, lane, raw[ti], vt + (FMT == FMT_BF16 ? ti : 0) * 16 * VP,
                                  kt + ti * KTile<D>::BYTES);
        if (FMT == FMT_BF16) asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto advance = [&]() {  // the pointers to the warp's next batch
        kp += u64(kstep) * KB;
        vp += u64(kstep) * KB;
        if (F16) {
            ksp += kstep;
            vsp += kstep;
        }
    };
    // RING: a slot is refilled with the same tile of the next batch as soon as it has been used,
    // so TILES - 1 tiles are always in flight; else a batch's TILES tiles are queued together.
    u32 base0 = kw0;
    if (base0 < kend) {  // the first batch, queued before the query is set up
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) issue(ti, base0);
        advance();
    }
    // The query heads, rotated like the mirrors' rows (registers and shuffles), into qs; heads
    // past the group are zero.
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        if (h >= MAX_GROUP) break;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = h < group ? bf16_to_f32(u16(qraw[r][e / 2] >> (16 * (e % 2)))) : 0.0f;
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
        const u32 h2 = pack2<F16>(qs[g][QsRow<D>::pos(dim(e0))] * qscale * qf, qs[g][QsRow<D>::pos(dim(e1))] * qscale * qf);
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

    for (bool first_batch = true; base0 < kend; base0 += kstep, first_batch = false) {
        if (!RING && !first_batch) {
#pragma unroll
            for (int ti = 0; ti < TILES; ++ti) issue(ti, base0);
            advance();
        }
#pragma unroll
        for (int t0 = 0; t0 < TILES; t0 += NT) {
            const u32 base = base0 + 16 * t0;
            if (base >= kend) break;
            // S^T per tile u of the step: c0, c1 = key base + 16 u + g, heads 2t, 2t + 1; c2, c3 =
            // key base + 16 u + 8 + g. Scores in log2 units (exp2 below); m and l are kept in
            // them until the end.
            constexpr float LOG2E = 1.4426950408889634f;
            if (KSM) {  // this step's key (and value) tiles have landed, every lane's copies
                cp_async_wait(RING ? TILES - NT : TILES - NT - t0);
                __syncwarp();
            }
            float s4[NT][4];
#pragma unroll
            for (int u = 0; u < NT; ++u) {
                const Raw<FMT, D>& r = raw[t0 + u];
                // QK_CHAINS independent accumulators (chunk j into chain j % QK_CHAINS), summed.
                float sc[4] = {init0, init1, init0, init1}, sc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                u32 ka[D / 8], kb[D / 8];
                if (KSM) {  // the lane's slice chunks t + 4 i of rows g, g + 8 (load_pieces' order)
                    constexpr int KW = Raw<FMT, D>::KW;
                    const u8* tile = kt + (t0 + u) * KTile<D>::BYTES;
                    u32 w[2][KW];
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int i = 0; i < KW / 4; ++i) {
                            const uint4 v = *reinterpret_cast<const uint4*>(tile + KTile<D>::at(g + 8 * nt, t + 4 * i));
                            w[nt][4 * i] = v.x;
                            w[nt][4 * i + 1] = v.y;
                            w[nt][4 * i + 2] = v.z;
                            w[nt][4 * i + 3] = v.w;
                        }
                    k_operand<FMT, D>(w[0], ka);
                    k_operand<FMT, D>(w[1], kb);
                } else {
                    k_operand<FMT, D>(r.k[0], ka);
                    k_operand<FMT, D>(r.k[1], kb);
                }
#pragma unroll
                for (int j = 0; j < D / 16; ++j)
                    mma16816<F16>(STOKE_ATTN_QK_CHAINS == 2 && j % 2 ? sc2 : sc, ka[2 * j], kb[2 * j], ka[2 * j + 1], kb[2 * j + 1], qa[j][0], qa[j][1]);
                if (STOKE_ATTN_QK_CHAINS == 2)
#pragma unroll
                    for (int i = 0; i < 4; ++i) sc[i] += sc2[i];
                const float ks0 = F16 ? r.ks[0][0] * (sscale * LOG2E) : sscale * LOG2E;
                const float ks1 = F16 ? r.ks[1][0] * (sscale * LOG2E) : sscale * LOG2E;
                s4[u][0] = sc[0] * ks0;
                s4[u][1] = sc[1] * ks0;
                s4[u][2] = sc[2] * ks1;
                s4[u][3] = sc[3] * ks1;
                const u32 bu = base + 16 * u;
                if (bu + 16 > kend) {  // a tile wholly past the end holds row k0's finite values
                    if (bu + g >= kend) s4[u][0] = s4[u][1] = NEG_INF;
                    if (bu + 8 + g >= kend) s4[u][2] = s4[u][3] = NEG_INF;
                }
            }
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int u = 0; u < NT; ++u) {
                mx0 = fmaxf(mx0, fmaxf(s4[u][0], s4[u][2]));
                mx1 = fmaxf(mx1, fmaxf(s4[u][1], s4[u][3]));
            }
#pragma unroll
            for (int o2 = 4; o2 < 32; o2 <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
            }
            const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);
            // mn is finite (key `base` is in range); a masked score gives exp2(-inf) = 0. The
            // warp's reference max moves to mn (and the output is rescaled) when some head's
            // max passed it by more than LAZY; else the probabilities stay below 2^LAZY.
            constexpr float LAZY = float(STOKE_ATTN_LAZY);
            const bool move = __any_sync(0xffffffffu, mn0 > m[0] + LAZY || mn1 > m[1] + LAZY);
            const float r0 = move ? mn0 : m[0], r1 = move ? mn1 : m[1];
            float pr[NT][4];
#pragma unroll
            for (int u = 0; u < NT; ++u) {
                pr[u][0] = exp2_approx(s4[u][0] - r0);
                pr[u][1] = exp2_approx(s4[u][1] - r1);
                pr[u][2] = exp2_approx(s4[u][2] - r0);
                pr[u][3] = exp2_approx(s4[u][3] - r1);
            }
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
            // mirrors: times the value rows' scales (and VSF). Mirrors' value codes to their tiles.
            u32 pb[NT][2];
#pragma unroll
            for (int u = 0; u < NT; ++u) {
                const Raw<FMT, D>& r = raw[t0 + u];
                l[0] += pr[u][0] + pr[u][2];
                l[1] += pr[u][1] + pr[u][3];
                const float vs0 = F16 ? r.ks[0][1] * VSF : 1.0f, vs1 = F16 ? r.ks[1][1] * VSF : 1.0f;
                pb[u][0] = movmatrix_trans(pack2<F16>(pr[u][0] * vs0, pr[u][1] * vs0));
                pb[u][1] = movmatrix_trans(pack2<F16>(pr[u][2] * vs1, pr[u][3] * vs1));
                if (FMT == FMT_FP8) codes_to_tile<FMT, D, VP>(r, lane, vt + u * 16 * VP);
            }
            // BF16: the groups queued after this step's last slot may still be in flight.
            if (FMT == FMT_BF16 && !KSM) cp_async_wait(RING ? TILES - NT : TILES - NT - t0);
            if (FMT == FMT_INT4) {
                // V^T from registers: word j's bytes 0-1 / 2-3 of the four keys give m-tiles
                // 4j + 2 hi and 4j + 2 hi + 1 (int4_key_pairs).
                constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
                for (int u = 0; u < NT; ++u)
#pragma unroll
                    for (int j = 0; j < VK; ++j)
#pragma unroll
                        for (int hi = 0; hi < 2; ++hi) {
                            const u32* v = raw[t0 + u].v;
                            u32 a[4], b[4];
                            int4_key_pairs(v[j], v[VK + j], hi, a);
                            int4_key_pairs(v[2 * VK + j], v[3 * VK + j], hi, b);
                            const int n = 4 * j + 2 * hi;
                            mma16816<F16>(o[n], a[0], a[1], b[0], b[1], pb[u][0], pb[u][1]);
                            mma16816<F16>(o[n + 1], a[2], a[3], b[2], b[3], pb[u][0], pb[u][1]);
                        }
            } else {
                __syncwarp();
#pragma unroll
                for (int n = 0; n < D / 16; ++n)
#pragma unroll
                    for (int u = 0; u < NT; ++u) {
                        const u16* tile = vt + (FMT == FMT_BF16 ? t0 + u : u) * 16 * VP;
                        const u32 mi = lane >> 3;
                        const u16* rowp = tile + ((mi >> 1) * 8 + (lane & 7)) * VP + n * 16 + (mi & 1) * 8;
                        u32 v0, v1, v2, v3;
                        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                                     : "r"(smem_u32(rowp)));
                        mma16816<F16>(o[n], v0, v1, v2, v3, pb[u][0], pb[u][1]);
                    }
                __syncwarp();
            }
            if (RING) {
#pragma unroll
                for (int u = 0; u < NT; ++u) issue(t0 + u, base0 + kstep);
            }
        }
        if (RING) advance();
    }
    // The row sums over the 8 lanes of each head.
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) {
        l[0] += __shfl_xor_sync(0xffffffffu, l[0], o2);
        l[1] += __shfl_xor_sync(0xffffffffu, l[1], o2);
    }
    __syncthreads();  // the V tiles become the merge buffer
    attn_trace(TRACE_STREAMED);
    float (*wo)[MAX_GROUP][WoRow<D>::P] = reinterpret_cast<float (*)[MAX_GROUP][WoRow<D>::P]>(vt_raw);
    if (g == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (2 * t + h < group) {
                wm[warp][2 * t + h] = m[h] * 0.6931471805599453f;  // natural units from here on
                wl[warp][2 * t + h] = l[h];
            }
    }
    if (FMT == FMT_INT4 && STOKE_ATTN_SMEM_LAYOUT) {
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
                const u32 h = 2 * t + (i & 1), dd = FMT == FMT_INT4 ? int4_value_dim<D>(g, n, i >> 1) : col;
                const float v = F16 ? o[n][i] * (1.0f / VSF) : o[n][i];  // mirrors: P carried VSF
                if (h < group) wo[warp][h][WoRow<D>::pos(FMT, h, dd)] = v;
            }
    }
    __syncthreads();
    // A warp per head merges its warps' outputs (lane l: dims l E ..). One split: the CTA holds
    // the whole output of its heads; normalized, rotated back and written as bf16 here, with no
    // partials and no combine. Else the split's partial (max, sum, unnormalized output): in this
    // CTA's shared memory (cluster entry points, launched as clusters of the splits), else in
    // global memory.
    if (CLM && p.splits > 1 && cluster_ctas() != p.splits) __trap();  // the host's contract
    const bool dsm = CLM && p.splits > 1;
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
#if STOKE_ATTN_MERGE_ILP
        // Every warp works through all QR of its head slots (in range of wo: warp + WARPS r <
        // MAX_GROUP), so the two heads' chains interleave; only real heads store.
        const bool real = h < group;
        const u32 hc = h < MAX_GROUP ? h : warp;  // the slot read (six INT4 warps reach past 8)
#else
        if (h >= group) break;
        const bool real = true;
        const u32 hc = h;
#endif
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
        const u64 row = u64(b) * p.heads + kvh * group + h;
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
#if STOKE_ATTN_PARTIAL_F16
            store_part_f16<D>(p.part_o, p.part_ml, ph, lane, mx, lsum, os);
#else
            store_floats<E>(p.part_o + ph * D + lane * E, os);
            if (lane == 0) {
                p.part_ml[ph * 2] = mx;
                p.part_ml[ph * 2 + 1] = lsum;
            }
#endif
        }
    }
    attn_trace(TRACE_MERGED);
    if (p.splits == 1) {
        attn_trace(TRACE_END);
        return;
    }
    if (dsm) {
        cluster_merge<D, WARPS>(p, smem_u32(&cpart[0][0]), smem_u32(&cml[0][0]), group, kvh, b, warp, lane);
        attn_trace(TRACE_END, 2);
        return;
    }
    // The last split of (b, kvh) to finish merges every split's partials (no second launch) and
    // puts the arrival count back to zero for the next launch.
    __shared__ u32 last;
    // STOKE_ATTN_ACQ_REL: every thread's partial stores, then the CTA barrier, then thread 0's
    // count as one acquire-release atomic: the release covers the stores the barrier ordered
    // before it, the acquire (and the barrier after it) the other splits' partials for every
    // thread of the merging split. Else a fence by every thread on each side of a relaxed count.
    if (!STOKE_ATTN_ACQ_REL) __threadfence();  // this CTA's partials are visible before it counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* cnt = p.arrived + u64(b) * c.kv_heads + kvh;
        u32 old;
        if (STOKE_ATTN_ACQ_REL)
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory");
        else
            old = atomicAdd(cnt, 1u);
        last = old == p.splits - 1;
        if (last) *cnt = 0;
    }
    __syncthreads();
    attn_trace(TRACE_ARRIVED);
    if (!last) {
        attn_trace(TRACE_END);
        return;
    }
    if (!STOKE_ATTN_ACQ_REL) __threadfence();
    // The warp's heads together (their loads interleave). Lane l first holds split l's (max,
    // sum) of each head, and the splits' weights reach the other lanes by shuffles.
    float mx[QR], lsum[QR], os[QR][E], ms[QR], ls[QR];
#if STOKE_ATTN_PARTIAL_F16
    // Records (max, sum, scale, -), f16 outputs; the scale goes into the split's weight.
    typedef float4 Rec;
    typedef u16 PartT;
    float sc[QR];
#else
    typedef float2 Rec;
    typedef float PartT;
#endif
    const PartT* po[QR];
    const Rec* ml[QR];
    bool hv[QR];
#if STOKE_ATTN_MERGE_EARLY
    // The first MERGE_EARLY splits' outputs of the warp's heads, requested with the records
    // (not INT4, whose kernels are held to 168 registers).
    constexpr int MERGE_EARLY = FMT == FMT_INT4 ? 0 : STOKE_ATTN_MERGE_EARLY;
    float xe[QR][MERGE_EARLY > 0 ? MERGE_EARLY : 1][E];
#endif
#pragma unroll
    for (int r = 0; r < QR; ++r) {
        const u32 h = warp + WARPS * r;
        hv[r] = h < group;
        const u64 row = u64(b) * p.heads + kvh * group + (hv[r] ? h : 0);
        ml[r] = reinterpret_cast<const Rec*>(p.part_ml) + row * p.splits;
        po[r] = reinterpret_cast<const PartT*>(p.part_o) + row * p.splits * D + lane * E;
#if STOKE_ATTN_MERGE_EARLY
#pragma unroll
        for (int i = 0; i < MERGE_EARLY; ++i) {
            if (hv[r] && u32(i) < p.splits) {
#if STOKE_ATTN_PARTIAL_F16
                load_part_f16<E>(po[r] + u64(i) * D, xe[r][i]);
#else
                load_floats<E, true>(po[r] + u64(i) * D, xe[r][i]);
#endif
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) xe[r][i][e] = 0.0f;
            }
        }
#endif
        ms[r] = NEG_INF;
        ls[r] = 0.0f;
#if STOKE_ATTN_PARTIAL_F16
        sc[r] = 1.0f;  // lanes past the splits: weight 0 times a finite scale
#endif
        if (hv[r] && lane < p.splits) {
            const Rec v = __ldcg(&ml[r][lane]);
            ms[r] = v.x;
            ls[r] = v.y;
#if STOKE_ATTN_PARTIAL_F16
            sc[r] = v.z;
#endif
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
    attn_trace(TRACE_RECORDS, 0, mx[0]);
    for (u32 s0 = 0; s0 < p.splits; s0 += 32) {
        const u32 n = min(32u, p.splits - s0);
        float f[QR];
#pragma unroll
        for (int r = 0; r < QR; ++r) {
            if (s0 > 0) {
                ms[r] = NEG_INF;
                if (hv[r] && lane < n) {
                    const Rec v = __ldcg(&ml[r][s0 + lane]);
                    ms[r] = v.x;
                    ls[r] = v.y;
#if STOKE_ATTN_PARTIAL_F16
                    sc[r] = v.z;
#endif
                }
            }
            f[r] = ms[r] == NEG_INF ? 0.0f : __expf(ms[r] - mx[r]);  // an empty split adds 0
            lsum[r] += ls[r] * f[r];
#if STOKE_ATTN_PARTIAL_F16
            f[r] *= sc[r];  // the split's output scale
#endif
        }
        constexpr int MU = STOKE_ATTN_MERGE_UNROLL;
        u32 i0 = 0;  // splits of this chunk already merged
#if STOKE_ATTN_MERGE_EARLY
        if (s0 == 0) {
#pragma unroll
            for (int i = 0; i < MERGE_EARLY; ++i)
#pragma unroll
                for (int r = 0; r < QR; ++r) {
                    const float fi = __shfl_sync(0xffffffffu, f[r], i);
                    if (!hv[r] || u32(i) >= n) continue;
#pragma unroll
                    for (int e = 0; e < E; ++e) os[r][e] += xe[r][i][e] * fi;
                }
            i0 = min(n, u32(MERGE_EARLY));
        }
#endif
#pragma unroll MU
        for (u32 i = i0; i < n; ++i)
#pragma unroll
            for (int r = 0; r < QR; ++r) {
                const float fi = __shfl_sync(0xffffffffu, f[r], i);
                if (!hv[r]) continue;
                float x[E];
#if STOKE_ATTN_PARTIAL_F16
                load_part_f16<E>(po[r] + u64(s0 + i) * D, x);
#else
                load_floats<E, true>(po[r] + u64(s0 + i) * D, x);
#endif
#pragma unroll
                for (int e = 0; e < E; ++e) os[r][e] += x[e] * fi;
            }
    }
#pragma unroll
    for (int r = 0; r < QR; ++r) {
#pragma unroll
        for (int o2 = 16; o2 > 0; o2 >>= 1) lsum[r] += __shfl_xor_sync(0xffffffffu, lsum[r], o2);
        if (hv[r]) write_head<D>(os[r], lsum[r], p.block, lane, p.out + (u64(b) * p.heads + kvh * group + warp + WARPS * r) * D);
    }
    attn_trace(TRACE_END, 1);
}

// BF16 / FP8: 187 / 213 registers at d = 128, 2 CTAs per SM; INT4: 168 (launch bounds); the
// split plan asks the occupancy calculator.
// Holding BF16 and FP8 to 168 registers for 3 CTAs per SM was measured slower
// (results/experiments/h200-attention-3ctas-f301e7a.json).
// Each format and head dim has two entry points: NAME, and NAME_cl, whose split launches are
// clusters of their splits merging through distributed shared memory (STOKE_ATTN_CLUSTER). Kept
// apart because the plain kernels built with the cluster merge in them ran 4-6% slower in the
// run that timed that first form (e56ebe1) at B = 8, ctx 1024, where no launch formed a cluster.
// NAME_dyn_smem: the dynamic shared memory each launch must bring; NAME_pdl: launched with
// programmatic dependent launch (STOKE_ATTN_PDL, _BF16); NAME_cl_cluster: its launches may form
// clusters. Runtime::kernel reads all three.
#define DECODE_ATTN_ENTRY(NAME, FMT, D, W, MC)                                                       \
    extern "C" __device__ unsigned NAME##_dyn_smem = AttnShape<FMT, D>::DYN;                        \
    extern "C" __device__ unsigned NAME##_pdl = ATTN_PDL(FMT);                                      \
    extern "C" __global__ void __launch_bounds__(W * 32, MC) NAME(const AttnParams p) { decode_attn<FMT, D, false>(p); } \
    extern "C" __device__ unsigned NAME##_cl_dyn_smem = AttnShape<FMT, D>::DYN;                     \
    extern "C" __device__ unsigned NAME##_cl_pdl = ATTN_PDL(FMT);                                   \
    extern "C" __device__ unsigned NAME##_cl_cluster = STOKE_ATTN_CLUSTER;                          \
    extern "C" __global__ void __launch_bounds__(W * 32, MC) NAME##_cl(const AttnParams p) { decode_attn<FMT, D, true>(p); }

DECODE_ATTN_ENTRY(decode_attn_bf16_d64, FMT_BF16, 64, STOKE_ATTN_WARPS, STOKE_ATTN_MIN_CTAS)
DECODE_ATTN_ENTRY(decode_attn_bf16_d128, FMT_BF16, 128, STOKE_ATTN_WARPS, STOKE_ATTN_MIN_CTAS)
DECODE_ATTN_ENTRY(decode_attn_fp8_d64, FMT_FP8, 64, STOKE_ATTN_WARPS, STOKE_ATTN_MIN_CTAS)
DECODE_ATTN_ENTRY(decode_attn_fp8_d128, FMT_FP8, 128, STOKE_ATTN_WARPS, STOKE_ATTN_MIN_CTAS)
DECODE_ATTN_ENTRY(decode_attn_int4_d64, FMT_INT4, 64, STOKE_ATTN_WARPS_INT4, STOKE_ATTN_MIN_CTAS_INT4)
DECODE_ATTN_ENTRY(decode_attn_int4_d128, FMT_INT4, 128, STOKE_ATTN_WARPS_INT4, STOKE_ATTN_MIN_CTAS_INT4)
