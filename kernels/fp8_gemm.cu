// FP8 (E4M3) prefill GEMM on Hopper: y[M, N] = (A[M, K] W[N, K]^T) * a_scale[row] * w_scale[col],
// f32 accumulation, then one of the epilogues (stoke_formats::fp8 holds each one's reference):
//   fp8_gemm_plain      out = bf16(y)
//   fp8_gemm_residual   out = bf16(y + residual) (the O and down projections; the next RMSNorm's
//                       statistics come with the row quantization that follows, which reads
//                       the row anyway)
//   fp8_gemm_swiglu     columns 2j / 2j + 1 are gate j / up j: h = silu(gate) up, written as
//                       the E4M3 input of the down projection with a delayed per-tensor scale
//                       (out_scale, set from earlier invocations); the invocation's max |h|
//                       goes to *amax (f32 bits, atomicMax) and the values beyond the scale's
//                       range (written as +-448) are counted in *saturated.
//   fp8_gemm_swiglu_bf16  the same h written as bf16 ([M, ldo], N / 2 columns): the model's
//                       prefill until the down projection reads the E4M3 h directly.
//   fp8_gemm_qkv        the q|k|v projection of a packed prefill: the columns are heads of d
//                       (64 or 128, so a tile holds whole heads), q | k | v; each value is
//                       rounded to bf16, q and k heads rotated (rotate-half RoPE at the row's
//                       position pos[row]), q written to out ([M, ldo], heads x d), k and v
//                       written straight into the KV cache at (slot_of[row], pos[row]): the BF16
//                       main cache and the FP8 / INT4 mirror (Walsh-Hadamard rotated, quantized
//                       per row), and len[row] = pos[row] + 1. The bits are rope_append's
//                       (decode_attention.cu) on the plain epilogue's output: the same rounding
//                       points, the same order of butterflies, the same quantizers
//                       (kv_row.cuh), so no dense k / v tensor and no append kernel.
// The same mainloop on bf16 operands (bf16_tc_gemm_plain / _residual / _swiglu_bf16 / _qkv, and
// the same with _n256): A [M, K] and W [N, K] bf16, loaded as bytes (a 128-byte k-block is 64
// bf16), wgmma.m64n128k16.bf16 (_n256: 128 x 256 tiles, wgmma.m64n256k16) accumulating straight
// into the tile's f32 accumulator (the tensor core's bf16 sums are f32),
// with one k-block's wgmma group kept in flight while the next is issued (its stage is released
// once the following group is issued and it has completed), no scales.
// INT4 weights (fp8_i4_gemm_plain / _residual / _swiglu_bf16 / _qkv, _g32 / _g64 / _g128): the
// packed weight of docs/INT4_FORMAT.md as it is, words [k / 16, n / 64 x 128] and 16-bit scales
// d (and offsets m) [k / group, n], no E4M3 copy. y[r, c] = a_scale[r] sum_k a[r, k] (d q + m).
//   - The producer's warp 0 loads each k-block's A tile, its words (8 k-tiles x 2 column groups,
//     8 KB) and the scale (offset) rows of its promotions; warps 1-3 convert them: a word holds
//     nibbles of rows 2t, 2t + 1, 2t + 8, 2t + 9 of one k-tile for columns g and 8 + g (lane
//     4 g + t), so two byte permutes (i4_e4m3) turn a column's four into the E4M3 codes of
//     q - 8 (exact: -8 .. 7), stored as one 32-bit word at bytes 4t .. 4t + 3 of the column's
//     k-tile in the swizzled K-major tile. The k order inside each 16 is then 2t, 2t + 8, 2t + 1,
//     2t + 9 (k at 2 (k % 8) + (k % 16) / 8), and A is quantized in that order (fp8_quant.cu,
//     order 1), so a k-block's dot products are the same. The scales go to f32 per promotion.
//   - The consumers' wgmma are the FP8 ones, per promotion of G k (32, 64 or 128: the largest
//     dividing the group): the block accumulator is added as acc += d blk + (m + 8 d) S, S the
//     sum of the promotion's A codes (fp8_quant.cu's sums), the offsets' part only where the
//     weight has them (symmetric weights: m = -8 d). No value of the weight is rounded twice.
//   - 128 x 128 tiles, 4 stages (each with the words, the raw and the f32 scales besides A and
//     the E4M3 tile), a third mbarrier per stage (converted) that the consumers wait on.
//
// One persistent CTA per SM (grid = min(SMs, tiles)) walks the 128 x BN output tiles in a
// rasterized order: tiles go down M inside a band of RASTER tile columns, so the band's weight
// tiles stay in L2 while every row block streams past them. The CTA is three warpgroups:
// - warpgroup 0 is the producer: one thread issues the copy engine's loads (two 2-D tensor maps,
//   128-byte swizzle, rows past M and k past K read as zeros) of each k-block (128 k) of A and W
//   into a ring of STAGES stages, each completing on its stage's "full" mbarrier, after the
//   stage's "empty" mbarrier says both consumers are done with it;
// - warpgroups 1 and 2 are consumers of rows 0-63 and 64-127 of the tile: per k-block, four
//   wgmma.m64n128k32 from shared memory into a block accumulator, then the block is added to
//   the tile's f32 accumulator (the tensor core's FP8 sums keep fewer bits than f32; adding
//   every 128 k keeps long K exact to f32 rounding), the stage released, and at the tile's end
//   the epilogue restores both scales (loaded into registers at the tile's start, so their
//   round trip overlaps the mainloop) and writes bf16. A 256-column FP8 tile (_n256) runs the
//   same per 128-column half, one half's group after the other into the one block
//   accumulator, so 128 + 64 accumulators per thread fit.
// setmaxnreg gives the producer 40 registers and the consumers 232.
//
// The algorithm's parameters (Shape<BN>):
//   BM, BN, BK  128 x BN output tiles, BN = 128 or 256 (_n256: a k-block's A tile, loaded
//               from L2 once, serves twice the columns, a quarter less L2 traffic per MMA;
//               bf16 reads it from shared memory once per wgmma.m64n256k16, FP8 once per
//               128-column half); 128 k bytes per stage (one 128-byte swizzle row).
//   STAGES      k-blocks in flight: 5 of 32 KB (BN = 256: 4 of 48 KB).
//   RASTER      tile columns per band of the persistent order: 1024 / BN (1024 columns of
//               weights, K bytes each, stay in L2 while the band's row blocks pass).
// The host picks BN per call (kernels::fp8_gemm::wide_tiles): the wide tiles where their waves
// of persistent tiles take less time than the narrow ones' (a bf16 wide tile measured about
// 1.2x the work rate of two narrow ones), so calls whose wide tiles would leave SMs idle keep
// the narrow ones.

#include "ptx.cuh"
#include "kv_row.cuh"

constexpr int BM = 128, BK = 128;
constexpr u32 A_STAGE = BM * BK;  // bytes

// The operands: E4M3 codes (scales per row and per output channel), bf16 (no scales), or
// INT4 weights in the packed order of docs/INT4_FORMAT.md with E4M3 activations (OP_I4: see
// "INT4 weights" above).
enum { OP_FP8 = 0, OP_BF16 = 1, OP_I4 = 2 };

// The stages, band width and shared memory of BN-column tiles.
template <int BN, int OP = OP_FP8> struct Shape {
    static constexpr bool I4 = OP == OP_I4;
    static constexpr int STAGES = I4 || BN == 256 ? 4 : 5;
    static constexpr u32 RASTER = 1024 / BN;
    static constexpr u32 W_STAGE = BN * BK;
    // INT4: the k-block's words (8 k-tiles x BN / 64 column groups of 512 bytes), the raw
    // 16-bit scale and offset rows (up to 4 of BN each: RAW_M apart) and the f32 ones the
    // consumers read ([4 promotions][d, m'][BN]).
    static constexpr u32 Q_STAGE = I4 ? 64 * BN : 0;
    static constexpr u32 RAW_M = 8 * BN;
    static constexpr u32 RAW_STAGE = I4 ? 2 * RAW_M : 0;
    static constexpr u32 SC_STAGE = I4 ? 32 * BN : 0;
    static constexpr u32 STAGE_BYTES = A_STAGE + W_STAGE + Q_STAGE + RAW_STAGE + SC_STAGE;
    // [A 0 .. S-1][W 0 .. S-1]([Q ..][RAW ..][SC ..])[full S][empty S]([converted S]) from a
    // 1024-byte aligned base.
    static constexpr u32 BARS = I4 ? 3 : 2;
    static constexpr u32 SMEM_BYTES = STAGES * STAGE_BYTES + BARS * STAGES * 8 + 1024;
};
static_assert(Shape<128>::SMEM_BYTES == 164944 && Shape<256>::SMEM_BYTES == 197696 && Shape<128, OP_I4>::SMEM_BYTES == 189536,
              "shared memory (Rust mirrors it)");

enum { EPI_PLAIN = 0, EPI_RESIDUAL = 1, EPI_SWIGLU = 2, EPI_SWIGLU_BF16 = 3, EPI_QKV = 4 };

struct Fp8GemmParams {
    TensorMap a_map;        // A [M, K] u8 (E4M3), box 128 k x 128 rows
    TensorMap w_map;        // W [N, K] u8 (E4M3), box 128 k x 128 rows
    const float* a_scale;   // [M] per row, or [1] when a_scale_stride is 0
    const float* w_scale;   // [N] per output channel
    u16* out;               // plain, residual: [M, ldo] bf16; swiglu_bf16: [M, ldo] (N / 2 columns)
    const u16* residual;    // residual: [M, ldr] bf16
    u8* codes;              // swiglu: [M, ldo] E4M3 (N / 2 columns)
    const float* out_scale; // swiglu: [1] the delayed scale
    u32* amax;              // swiglu: [1] max |h| as f32 bits (atomicMax; start from 0)
    u32* saturated;         // swiglu: [1] count (atomicAdd)
    u32 m, n, k;
    u32 ldo;
    u32 ldr;
    u32 a_scale_stride;     // 1: per row; 0: one scale
    KvCache main;           // qkv: the BF16 cache (k null: not written)
    KvCache mirror;         // qkv: the FP8 / INT4 mirror (k null: none)
    const float* rope;      // qkv: [max_pos, d / 2, 2] (cos, sin) of each position and frequency
    const u32* slot_of;     // qkv: [M] cache slot of each row
    const u32* pos;         // qkv: [M] position of each row's token
    u32* len;               // qkv: [M] written: pos + 1
    u32 heads;              // qkv: query heads (the kv heads are the caches')
    u32 block;              // qkv: the mirror's Hadamard block (0: none, else 2 .. d)
    u32 max_pos;            // qkv: positions in the RoPE table
    // INT4 weights (fp8_i4_*; w_map is then the words [k / 16, n / 64 x 128] u32, boxes of
    // 8 k-tiles x 256 words, no swizzle):
    TensorMap d_map;        // scales [k / group, n] 16-bit, boxes of 128 / G rows x 128 columns
    TensorMap m_map;        // offsets, the same (with I4_OFFSETS)
    const float* a_sums;    // [m, k / 32] the sum of each 32 codes of A's rows (with I4_OFFSETS)
    u32 group;              // rows of k per scale
    u32 i4_flags;           // I4_F16 | I4_OFFSETS
};
static_assert(sizeof(Fp8GemmParams) == 896, "Fp8GemmParams layout (64-byte aligned maps)");

enum { I4_F16 = 1, I4_OFFSETS = 2 };

// d (+)= A B^T for one k32 slice: 64 rows of A and 128 rows of W, both E4M3 in shared memory.
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[64], u64 a, u64 b, u32 scale_d) {
    WGMMA_M64N128("k32.f32.e4m3.e4m3", "1, 1");
}

// One wgmma.m64n256 of bf16 (k16, both K-major), d (+)= A B^T: the 128 f32 accumulators of a
// thread are d[0..128].
__device__ __forceinline__ void wgmma_bf16_n256(float (&d)[128], u64 a, u64 b, u32 scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(scale_d));
}

// Tile t of the persistent order: (row block, column block).
template <u32 RASTER>
__device__ __forceinline__ void tile_coords(u32 t, u32 tiles_m, u32 tiles_n, u32& tm, u32& tn) {
    const u32 band = t / (RASTER * tiles_m);
    const u32 first = band * RASTER;
    const u32 width = min(RASTER, tiles_n - first);
    const u32 in_band = t - band * RASTER * tiles_m;
    tm = in_band / width;
    tn = first + in_band % width;
}

// A 4 x 4 transpose of u32 across a quad's lanes (q = lane % 4): lane q's v[i] becomes lane i's
// v[q]. Every lane of the warp must call it. It turns a quad's column pairs of four 8-column
// groups (each lane a pair of each group) into one group per lane, 16 contiguous bytes, and back.
__device__ __forceinline__ void quad_transpose(u32 (&v)[4], u32 q) {
    const bool b = q & 2, c = q & 1;
    // Lane bit 1 with index bit 1, then lane bit 0 with index bit 0.
    u32 s0 = b ? v[0] : v[2], s1 = b ? v[1] : v[3];
    u32 r0 = __shfl_xor_sync(0xffffffffu, s0, 2), r1 = __shfl_xor_sync(0xffffffffu, s1, 2);
    const u32 a0 = b ? r0 : v[0], a1 = b ? r1 : v[1], a2 = b ? v[2] : r0, a3 = b ? v[3] : r1;
    s0 = c ? a0 : a1;
    s1 = c ? a2 : a3;
    r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
    r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    v[0] = c ? r0 : a0;
    v[1] = c ? a1 : r0;
    v[2] = c ? r1 : a2;
    v[3] = c ? a3 : r1;
}

// h = silu(g) u on the MUFU units: one ex2 and one reciprocal, a few f32 ulp from the exact
// value, far below the bf16 or E4M3 step h is stored in (IEEE expf and division cost several
// times the instructions, and the SwiGLU epilogue ran 12-18% behind the plain one). Past
// g < -87, 1 + e^-g exceeds 2^126 and h is 0, its limit.
__device__ __forceinline__ float swiglu(float g, float u) { return __fdividef(g * u, 1.0f + __expf(-g)); }

// Column 8 j + 2 (lane % 4) + e's weight scale for a consumer thread (0 past N; 1 for bf16
// operands).
template <int OP, int BN>
__device__ __forceinline__ float w_scale_at(const Fp8GemmParams& p, u32 tn, int j, int e, u32 lane) {
    const u32 col = tn * BN + 8 * j + 2 * (lane % 4) + e;
    return OP != OP_FP8 ? 1.0f : col < p.n ? p.w_scale[col] : 0.0f;
}

// Whether a tile's weight scales are held in registers from its start: all but the FP8 wide
// tiles, whose 64 more would not fit beside their 192 accumulators (they load theirs in the
// epilogue's batches).
template <int OP, int BN> constexpr bool SCALES_EARLY = OP != OP_FP8 || BN == 128;

// The scales a consumer thread's values of a tile take: ws[j][e] of column
// 8 j + 2 (lane % 4) + e (see w_scale_at; only with SCALES_EARLY), sa[h] of row row0 + 8 h
// (1 past M; 1 for bf16 operands). Loaded at the tile's start, so their round trip hides
// behind the mainloop.
template <int OP, int BN>
__device__ __forceinline__ void tile_scales(const Fp8GemmParams& p, u32 tn, u32 row0, u32 lane, float (&ws)[BN / 8][2], float (&sa)[2]) {
    if constexpr (SCALES_EARLY<OP, BN>) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) ws[j][e] = w_scale_at<OP, BN>(p, tn, j, e, lane);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 row = row0 + 8 * h;
        sa[h] = OP == OP_BF16 || row >= p.m ? 1.0f : p.a_scale[row * p.a_scale_stride];
    }
}

// The weight scales of the epilogue's batch of column pairs c .. c + CH - 1: wc[jj][e] of
// column 8 (c + jj) + 2 (lane % 4) + e, held from the tile's start (ws) or loaded here (FP8
// wide tiles).
template <int OP, int BN, int CH>
__device__ __forceinline__ void batch_scales(const Fp8GemmParams& p, const float (&ws)[BN / 8][2], u32 tn, int c, u32 lane,
                                             float (&wc)[CH][2]) {
#pragma unroll
    for (int jj = 0; jj < CH; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if constexpr (SCALES_EARLY<OP, BN>)
                wc[jj][e] = ws[c + jj][e];
            else
                wc[jj][e] = w_scale_at<OP, BN>(p, tn, c + jj, e, lane);
        }
}

// Output e of the thread's column pair c + jj (acc[4 j + 2 h + e], j = c + jj) in row half h
// (row row0 + 8 h), its scales restored: the row's activation scale and the batch's weight
// scale.
template <int N, int CH>
__device__ __forceinline__ float restored(const float (&acc)[N], const float (&sa)[2], const float (&wc)[CH][2], int c,
                                          int jj, int h, int e) {
    return acc[4 * (c + jj) + 2 * h + e] * sa[h] * wc[jj][e];
}

// The q|k|v epilogue of one consumer thread's two rows of a tile, heads of D dims (see the
// header). acc[4 j + e]: row row0 (+ 8 for e >= 2), column 8 j + 2 (lane % 4) + e % 2 of the
// tile, so dim c = 8 jj + 2 q + e of a head (q = lane % 4) sits in the lane's jj-th pair: a
// rotate-half partner (c +- D / 2) is in the same lane, and the Walsh-Hadamard butterflies
// run in registers (distance 1 and 8 up) and across the quad (2 and 4), in rope_append's order
// of increasing distance. Rows past M compute on zeros and store nothing (the quad's lanes
// share a row, so the shuffles stay inside it). Head by head, both rows of each: a head's
// weight scales are taken once, from ws, or loaded here where the tile holds none
// (SCALES_EARLY: the FP8 wide tiles), before the head's stores.
template <int D, int OP, int BN>
__device__ __forceinline__ void qkv_epilogue(const Fp8GemmParams& p, const float (&acc)[BN / 2], const float (&ws)[BN / 8][2],
                                             const float (&sa)[2], const u32 (&pos_of)[2], const u32 (&slot_at)[2], u32 tn,
                                             u32 row0, u32 lane) {
    constexpr int HT = BN / D;  // heads per tile
    constexpr int J = D / 8;    // pairs per head and lane
    const u32 q = lane % 4;
    const KvCache& kv = p.main.k ? p.main : p.mirror;
    const u32 kvh = kv.kv_heads, heads = p.heads;
    if (tn == 0 && q == 0)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (row0 + 8 * h < p.m) p.len[row0 + 8 * h] = pos_of[h] + 1;
#pragma unroll
    for (int t = 0; t < HT; ++t) {
        const u32 head = tn * HT + t;
        if (head >= heads + 2 * kvh) break;
        float wt[J][2];
#pragma unroll
        for (int jj = 0; jj < J; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                wt[jj][e] = SCALES_EARLY<OP, BN> ? ws[t * J + jj][e] : w_scale_at<OP, BN>(p, tn, t * J + jj, e, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 row = row0 + 8 * h;
            const bool valid = row < p.m;
            const u32 pos = pos_of[h], slot = slot_at[h];
            const float* cs = p.rope + u64(min(pos, p.max_pos - 1)) * D;  // (cos, sin) of D / 2 freqs
            // The values as the plain epilogue writes them (bf16 of y + 0).
            float x[2 * J];
#pragma unroll
            for (int jj = 0; jj < J; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float y = acc[4 * (t * J + jj) + 2 * h + e] * sa[h] * wt[jj][e];
                    x[2 * jj + e] = bf16_lo(to_bf16(y + 0.0f));
                }
            if (head < heads + kvh) {
#pragma unroll
                for (int jj = 0; jj < J / 2; ++jj)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float2 r = *reinterpret_cast<const float2*>(cs + 2 * (8 * jj + 2 * q + e));
                        const float lo = x[2 * jj + e], hi = x[2 * (jj + J / 2) + e];
                        x[2 * jj + e] = rope_rotate(lo, hi, r.x, r.y, false);
                        x[2 * (jj + J / 2) + e] = rope_rotate(hi, lo, r.x, r.y, true);
                    }
            }
            u32 w[J];
#pragma unroll
            for (int jj = 0; jj < J; ++jj) w[jj] = pack_bf16x2(x[2 * jj], x[2 * jj + 1]);
            if (head < heads) {
                if (valid) {
                    u16* out = p.out + u64(row) * p.ldo + head * D + 2 * q;
#pragma unroll
                    for (int jj = 0; jj < J; ++jj) *reinterpret_cast<u32*>(out + 8 * jj) = w[jj];
                }
                continue;
            }
            const u32 is_v = head >= heads + kvh;
            const u64 r = kv_row(kv, slot, head - heads - is_v * kvh, pos);
            if (valid && p.main.k) {
                u16* dst = static_cast<u16*>(is_v ? p.main.v : p.main.k) + r * D + 2 * q;
#pragma unroll
                for (int jj = 0; jj < J; ++jj) *reinterpret_cast<u32*>(dst + 8 * jj) = w[jj];
            }
            if (!p.mirror.k) continue;
#pragma unroll
            for (int jj = 0; jj < J; ++jj) {
                x[2 * jj] = bf16_lo(w[jj]);
                x[2 * jj + 1] = bf16_hi(w[jj]);
            }
            if (p.block) {
                // Distance 1: the pair's two values.
#pragma unroll
                for (int jj = 0; jj < J; ++jj) {
                    const float u = x[2 * jj], v = x[2 * jj + 1];
                    x[2 * jj] = u + v;
                    x[2 * jj + 1] = u - v;
                }
                // Distances 2 and 4: the quad's lanes.
#pragma unroll
                for (u32 hl = 1; hl < 4; hl <<= 1) {
                    if (2 * hl >= p.block) break;
                    const bool upper = q & hl;
#pragma unroll
                    for (int a = 0; a < 2 * J; ++a) {
                        const float y = __shfl_xor_sync(0xffffffffu, x[a], hl);
                        x[a] = upper ? y - x[a] : x[a] + y;
                    }
                }
                // Distances 8 and up: pairs jj, jj + dj.
#pragma unroll
                for (int dj = 1; dj < J; dj <<= 1) {
                    if (u32(8 * dj) >= p.block) break;
#pragma unroll
                    for (int jj = 0; jj < J; ++jj)
                        if (!(jj & dj))
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const float u = x[2 * jj + e], v = x[2 * (jj + dj) + e];
                                x[2 * jj + e] = u + v;
                                x[2 * (jj + dj) + e] = u - v;
                            }
                }
                const float norm = rsqrtf(float(p.block));
#pragma unroll
                for (int a = 0; a < 2 * J; ++a) x[a] *= norm;
            }
            float amax = 0.0f;
#pragma unroll
            for (int a = 0; a < 2 * J; ++a) amax = fmaxf(amax, fabsf(x[a]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            if (!valid) continue;
            if (p.mirror.format == FMT_FP8) {
                const float s = kv_fp8_scale(amax);
                u8* dst = static_cast<u8*>(is_v ? p.mirror.v : p.mirror.k) + r * D + 2 * q;
#pragma unroll
                for (int jj = 0; jj < J; ++jj)
                    *reinterpret_cast<u16*>(dst + 8 * jj) = u16(kv_fp8_code(x[2 * jj], s) | kv_fp8_code(x[2 * jj + 1], s) << 8);
                if (q == 0) (is_v ? p.mirror.vs : p.mirror.ks)[r] = s;
            } else {
                const float s = kv_int4_scale(amax);
                // Byte c / 2 of the row: dim c in the low nibble, c + 1 in the high one.
                u8* dst = static_cast<u8*>(is_v ? p.mirror.v : p.mirror.k) + r * (D / 2) + q;
#pragma unroll
                for (int jj = 0; jj < J; ++jj)
                    dst[4 * jj] = u8(kv_int4_nibble(x[2 * jj], s) | kv_int4_nibble(x[2 * jj + 1], s) << 4);
                if (q == 0) (is_v ? p.mirror.vs : p.mirror.ks)[r] = s;
            }
        }
    }
}

// One INT4 word's two column rows of E4M3 codes (see "INT4 weights"): sel holds the nibbles
// q of one column, rows 2t, 2t + 8, 2t + 1, 2t + 9 of the k-tile, in its low 16 bits; byte i
// of the result is e4m3(q_i - 8). Two byte permutes look the codes up: the codes of 0 .. 7 by
// q ^ 8 (q >= 8; q < 8 sets the selector's sign mode, which reads 0 from these non-negative
// codes), and by q the codes of -8 .. -1 shifted right by one bit (all even, so exact), which
// read 0 where q >= 8; doubling them back restores their sign bits.
__device__ __forceinline__ u32 i4_e4m3(u32 sel) {
    u32 pos, neg;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(pos) : "r"(0x44403800u), "r"(0x4e4c4a48u), "r"(sel ^ 0x8888u));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(neg) : "r"(0x65666768u), "r"(0x5c606264u), "r"(sel));
    return pos + neg * 2;  // disjoint bytes, each below 0x100: one IMAD where | and << take two
}

// The INT4 converters' share of one k-block: the words in q (8 k-tiles x BN / 64 groups of
// 32 lanes x 4 words) become E4M3 codes in w, the 128-byte swizzled [BN][128] K-major tile
// the consumers' wgmma read (k permuted within each k-tile as A is; see "INT4 weights"), and
// the raw scale (and offset) rows become f32 per promotion: sc[i][0][c] = d, sc[i][1][c] =
// m + 8 d of column c at k-block promotion i. ct: the thread's index among the converters.
template <int BN, int G>
__device__ __forceinline__ void i4_convert(const Fp8GemmParams& p, u32 q, u32 w, u32 raw, u32 sc, u32 kb, u32 ct) {
    using S = Shape<BN, OP_I4>;
    constexpr u32 CONVERTERS = 96, TASKS = 8 * BN / 2;  // one 16-byte lane load each
    constexpr u32 PER = (TASKS + CONVERTERS - 1) / CONVERTERS;
    // Every load first, so their latencies overlap (a converter warp is alone on its
    // scheduler's producer side).
    uint4 v[PER];
#pragma unroll
    for (u32 s = 0; s < PER; ++s)
        if (ct + s * CONVERTERS < TASKS) v[s] = lds128(q + (ct + s * CONVERTERS) * 16);
#pragma unroll
    for (u32 s = 0; s < PER; ++s) {
        const u32 task = ct + s * CONVERTERS;
        if (task >= TASKS) break;
        const u32 words[4] = {v[s].x, v[s].y, v[s].z, v[s].w};
        const u32 lane = task % 32, kt = task / (BN / 2), nq = task / 32 % (BN / 64);
        const u32 g = lane / 4, t = lane % 4;
        const u32 at = ((kt ^ g) << 4) + 4 * t;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 n = 16 * (4 * nq + j) + g;  // column g of the 16-column tile; + 8 below
            u32 lo, hi;  // bytes 0, 2: column g; bytes 1, 3: column 8 + g
            asm("prmt.b32 %0, %1, 0, 0x4420;" : "=r"(lo) : "r"(words[j]));
            asm("prmt.b32 %0, %1, 0, 0x4431;" : "=r"(hi) : "r"(words[j]));
            sts32(w + n * BK + at, i4_e4m3(lo));
            sts32(w + (n + 8) * BK + at, i4_e4m3(hi));
        }
    }
    constexpr u32 P = BK / G;
    const u32 g0 = kb * BK / p.group;
    const bool f16 = p.i4_flags & I4_F16, offsets = p.i4_flags & I4_OFFSETS;
    for (u32 task = ct; task < P * BN; task += CONVERTERS) {
        const u32 i = task / BN, c = task % BN;
        const u32 r = (kb * BK + i * G) / p.group - g0;
        const u32 bits = lds32(raw + ((r * BN + c) & ~1u) * 2) >> 16 * (c & 1);
        const float d = f16 ? f16_to_f32(u16(bits)) : __uint_as_float(bits << 16);
        sts32(sc + (i * 2 * BN + c) * 4, __float_as_uint(d));
        if (offsets) {
            const u32 mb = lds32(raw + S::RAW_M + ((r * BN + c) & ~1u) * 2) >> 16 * (c & 1);
            const float m = f16 ? f16_to_f32(u16(mb)) : __uint_as_float(mb << 16);
            sts32(sc + ((i * 2 + 1) * BN + c) * 4, __float_as_uint(fmaf(8.0f, d, m)));
        }
    }
}

template <int EPI, int OP, int BN = 128, int G = 0>
__device__ __forceinline__ void fp8_gemm(const Fp8GemmParams& p) {
    static_assert(BN == 128 || BN == 256, "tiles of 128 or 256 columns");
    constexpr bool BF16 = OP == OP_BF16, I4 = OP == OP_I4;
    static_assert(!I4 || (BN == 128 && (G == 32 || G == 64 || G == 128)), "INT4: 128-column tiles, promotions of 32, 64 or 128 k");
    using S = Shape<BN, OP>;
    constexpr int STAGES = S::STAGES;
    constexpr u32 W_STAGE = S::W_STAGE, STAGE_BYTES = S::STAGE_BYTES;
    extern __shared__ __align__(1024) u8 smem_raw[];
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 a_smem = base, w_smem = base + STAGES * A_STAGE;
    const u32 q_smem = w_smem + STAGES * W_STAGE, raw_smem = q_smem + STAGES * S::Q_STAGE;
    const u32 sc_smem = raw_smem + STAGES * S::RAW_STAGE;
    const u32 full = base + STAGES * STAGE_BYTES, empty = full + STAGES * 8, converted = empty + STAGES * 8;
    const u32 wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const u32 tiles_m = (p.m + BM - 1) / BM, tiles_n = (p.n + BN - 1) / BN;
    // k-blocks of BK bytes: BK E4M3 values, or BK / 2 bf16 ones.
    const u32 kbytes = BF16 ? 2 * p.k : p.k;
    const u32 tiles = tiles_m * tiles_n, kblocks = (kbytes + BK - 1) / BK;
    // INT4: promotions per k-block and the bytes of one of its scale rows' boxes.
    constexpr u32 P = I4 ? BK / G : 1, RAW_BOX = P * BN * 2;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, I4 ? 8 : 2);  // INT4: each consumer warp, after its scale reads
            if (I4) mbar_init(converted + 8 * s, 96);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // What the producer gives up is what the consumers' increase takes (setmaxnreg.inc
        // waits for it): 128 x (168 - 40) = 256 x (232 - 168); INT4: the converters keep 72
        // (their loads in flight together), 128 x (168 - 72) = 256 x (216 - 168).
        if constexpr (I4) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
        } else {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        }
        if (I4 && tid >= 32) {
            // Warps 1-3 convert each k-block once its loads land.
            u32 stage = 0, phase = 0;
            for (u32 t = blockIdx.x; t < tiles; t += gridDim.x) {
                u32 tm, tn;
                tile_coords<S::RASTER>(t, tiles_m, tiles_n, tm, tn);
                for (u32 kb = 0; kb < kblocks; ++kb) {
                    mbar_wait(full + 8 * stage, phase);
                    i4_convert<BN, I4 ? G : 128>(p, q_smem + stage * S::Q_STAGE, w_smem + stage * W_STAGE, raw_smem + stage * S::RAW_STAGE,
                                                 sc_smem + stage * S::SC_STAGE, kb, tid - 32);
                    // The codes are read by wgmma (the async proxy).
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    mbar_arrive(converted + 8 * stage);
                    if (++stage == STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }
            return;
        }
        if (tid != 0) return;
        const bool offsets = p.i4_flags & I4_OFFSETS;
        u32 stage = 0, phase = 0;
        for (u32 t = blockIdx.x; t < tiles; t += gridDim.x) {
            u32 tm, tn;
            tile_coords<S::RASTER>(t, tiles_m, tiles_n, tm, tn);
            for (u32 kb = 0; kb < kblocks; ++kb) {
                mbar_wait(empty + 8 * stage, phase ^ 1);
                const u32 bar = full + 8 * stage;
                if constexpr (I4) {
                    mbar_expect_tx(bar, A_STAGE + S::Q_STAGE + (offsets ? 2 : 1) * RAW_BOX);
                    tma_load_2d(a_smem + stage * A_STAGE, &p.a_map, kb * BK, tm * BM, bar);
                    // Words: column tn BN / 64 x 128 (u32), k-tile row 8 kb.
                    tma_load_2d(q_smem + stage * S::Q_STAGE, &p.w_map, tn * BN * 2, kb * 8, bar);
                    const u32 raw = raw_smem + stage * S::RAW_STAGE, g0 = kb * BK / p.group;
                    tma_load_2d(raw, &p.d_map, tn * BN, g0, bar);
                    if (offsets) tma_load_2d(raw + S::RAW_M, &p.m_map, tn * BN, g0, bar);
                } else {
                    mbar_expect_tx(bar, STAGE_BYTES);
                    tma_load_2d(a_smem + stage * A_STAGE, &p.a_map, kb * BK, tm * BM, bar);
                    tma_load_2d(w_smem + stage * W_STAGE, &p.w_map, kb * BK, tn * BN, bar);
                }
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
        }
        return;
    }

    if constexpr (I4) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    }
    const u32 half = wg - 1;  // rows 64 half .. 64 half + 63 of the tile
    const u32 warp = tid / 32, lane = tid % 32;
    u32 stage = 0, phase = 0;
    const bool offsets = I4 && (p.i4_flags & I4_OFFSETS);
    float acc[BN / 2], blk[64];
    // The E4M3 codes are h / out_scale, taken as h times its reciprocal (within an f32 ulp).
    const float inv_scale = EPI == EPI_SWIGLU ? 1.0f / *p.out_scale : 1.0f;  // the same for every tile
    for (u32 t = blockIdx.x; t < tiles; t += gridDim.x) {
        u32 tm, tn;
        tile_coords<S::RASTER>(t, tiles_m, tiles_n, tm, tn);
        // acc[4 j + e]: row 16 warp + lane / 4 (+ 8 for e >= 2), column 8 j + 2 (lane % 4) + e % 2.
        const u32 row0 = tm * BM + half * 64 + warp * 16 + lane / 4;
        float ws[BN / 8][2], sa[2];
        tile_scales<OP, BN>(p, tn, row0, lane, ws, sa);
        // q|k|v: the rows' positions and cache slots (0 past M), likewise loaded early.
        u32 pos[2] = {0, 0}, slot[2] = {0, 0};
        if (EPI == EPI_QKV) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 row = row0 + 8 * h;
                if (row < p.m) {
                    pos[h] = p.pos[row];
                    slot[h] = p.slot_of[row];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
        u32 held = STAGES;  // bf16: the stage the wgmma group still in flight reads
        for (u32 kb = 0; kb < kblocks; ++kb) {
            mbar_wait((I4 ? converted : full) + 8 * stage, phase);
            const u32 a = a_smem + stage * A_STAGE + half * 64 * BK;
            const u32 w = w_smem + stage * W_STAGE;
            if constexpr (I4) {
                // Per promotion of G k (one group's part of the k-block): G / 32 wgmma of k32
                // into the block accumulator, then acc += d blk (+ m' S, S the rows' sums of
                // the promotion's codes) with the column's f32 d and m' from sc; the stage goes
                // back once every consumer warp has read them.
                const u32 sc = sc_smem + stage * S::SC_STAGE, ks = p.k / 32;
                float sx[P][2] = {};
                if (offsets) {
#pragma unroll
                    for (int i = 0; i < int(P); ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const u32 row = row0 + 8 * h, s0 = (kb * BK + i * G) / 32;
                            float v = 0.0f;
#pragma unroll
                            for (int u = 0; u < G / 32; ++u)
                                if (row < p.m && s0 + u < ks) v += p.a_sums[u64(row) * ks + s0 + u];
                            sx[i][h] = v;
                        }
                }
#pragma unroll
                for (int i = 0; i < int(P); ++i) {
                    wg_fence();
#pragma unroll
                    for (int j = 0; j < G / 32; ++j) {
                        const u32 kk = 32 * (i * (G / 32) + j);
                        wgmma_e4m3_n128(blk, smem_desc_sw128(a + kk), smem_desc_sw128(w + kk), j > 0);
                    }
                    wg_commit();
                    wg_wait_all();
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
                        const u32 col = 8 * j + 2 * (lane % 4);
                        const float2 d = lds64f(sc + (i * 2 * BN + col) * 4);
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            acc[4 * j + 2 * h] = fmaf(d.x, blk[4 * j + 2 * h], acc[4 * j + 2 * h]);
                            acc[4 * j + 2 * h + 1] = fmaf(d.y, blk[4 * j + 2 * h + 1], acc[4 * j + 2 * h + 1]);
                        }
                        if (offsets) {
                            const float2 m = lds64f(sc + ((i * 2 + 1) * BN + col) * 4);
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                acc[4 * j + 2 * h] = fmaf(m.x, sx[i][h], acc[4 * j + 2 * h]);
                                acc[4 * j + 2 * h + 1] = fmaf(m.y, sx[i][h], acc[4 * j + 2 * h + 1]);
                            }
                        }
                    }
                }
                if (lane == 0) mbar_arrive(empty + 8 * stage);
            } else if constexpr (BF16) {
                wg_fence();
                // Four wgmma of 32 bytes (16 bf16) of k each.
#pragma unroll
                for (int j = 0; j < BK / 32; ++j) {
                    const u64 da = smem_desc_sw128(a + 32 * j), dw = smem_desc_sw128(w + 32 * j);
                    if constexpr (BN == 256) {
                        wgmma_bf16_n256(acc, da, dw, kb > 0 || j > 0);
                    } else {
                        wgmma_bf16_n128(acc, da, dw, kb > 0 || j > 0);
                    }
                }
                wg_commit();
                // One group stays in flight (its sums go straight into acc): the previous
                // k-block's is done, so its stage goes back to the producer.
                wg_wait_1();
                if (tid == 0 && held != STAGES) mbar_arrive(empty + 8 * held);
                held = stage;
            } else {
                // Per 128-column half of the tile (one for 128-column tiles): four wgmma of k32
                // into the block accumulator, then the block added to the half's columns
                // (acc[64 nh ..]: columns 128 nh + 8 j + ..). The stage goes back after the
                // last half's group.
#pragma unroll
                for (int nh = 0; nh < BN / 128; ++nh) {
                    wg_fence();
#pragma unroll
                    for (int j = 0; j < BK / 32; ++j) {
                        const u64 da = smem_desc_sw128(a + 32 * j);
                        const u64 dw = smem_desc_sw128(w + nh * 128 * BK + 32 * j);
                        wgmma_e4m3_n128(blk, da, dw, j > 0);
                    }
                    wg_commit();
                    wg_wait_all();
                    if (nh == BN / 128 - 1 && tid == 0) mbar_arrive(empty + 8 * stage);
#pragma unroll
                    for (int i = 0; i < 64; ++i) acc[64 * nh + i] += blk[i];
                }
            }
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
        if (BF16) {
            wg_wait_all();
            if (tid == 0 && held != STAGES) mbar_arrive(empty + 8 * held);
        }
        if (EPI == EPI_QKV) {
            if ((p.main.k ? p.main.d : p.mirror.d) == 128)
                qkv_epilogue<128, OP, BN>(p, acc, ws, sa, pos, slot, tn, row0, lane);
            else
                qkv_epilogue<64, OP, BN>(p, acc, ws, sa, pos, slot, tn, row0, lane);
            continue;
        }
        // What the epilogue reads is read in batches, each before its stores: a load after a
        // store waits for its own round trip (the compiler keeps it behind the store), and a
        // tile's loads taken one by one between its stores cost several µs
        // (docs/PERFORMANCE.md). A batch is all 16 column pairs of a 128-column tile (the block
        // accumulator is free by now), 8 beside the 128 accumulators of a 256-column one (16
        // spill there).
        constexpr int CH = BN == 256 ? 8 : 16;
        // bf16 out (+ residual) of a tile inside N, with 16-byte aligned rows: each quad's four
        // 8-column groups are transposed across its lanes (quad_transpose), so a lane loads and
        // stores 16 contiguous bytes (a quad 64) where it would take 4 (the same values, bit
        // for bit).
        if constexpr (EPI == EPI_PLAIN || EPI == EPI_RESIDUAL) {
            const bool rows16 = p.ldo % 8 == 0 && (reinterpret_cast<u64>(p.out) & 15) == 0 &&
                                (EPI == EPI_PLAIN || (p.ldr % 8 == 0 && (reinterpret_cast<u64>(p.residual) & 15) == 0));
            if (rows16 && tn * BN + BN <= p.n) {
                const u32 q = lane % 4;
#pragma unroll
                for (int c = 0; c < BN / 8; c += CH) {
                    float wc[CH][2];
                    batch_scales<OP, BN>(p, ws, tn, c, lane, wc);
                    // res[h][jj]: the pair of column 8 (c + jj) + 2 q of row h, loaded as lane
                    // q's 16 bytes of group c + 4 g + q and transposed back.
                    u32 res[2][CH];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 row = row0 + 8 * h;
#pragma unroll
                        for (int g = 0; g < CH / 4; ++g) {
                            u32 v[4] = {0u, 0u, 0u, 0u};
                            if (EPI == EPI_RESIDUAL && row < p.m) {
                                const uint4 r = *reinterpret_cast<const uint4*>(p.residual + u64(row) * p.ldr + tn * BN + 8 * (c + 4 * g + q));
                                v[0] = r.x;
                                v[1] = r.y;
                                v[2] = r.z;
                                v[3] = r.w;
                            }
                            if (EPI == EPI_RESIDUAL) quad_transpose(v, q);
#pragma unroll
                            for (int i = 0; i < 4; ++i) res[h][4 * g + i] = v[i];
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 row = row0 + 8 * h;
#pragma unroll
                        for (int g = 0; g < CH / 4; ++g) {
                            u32 v[4];
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int jj = 4 * g + i;
                                const float y0 = restored(acc, sa, wc, c, jj, h, 0);
                                const float y1 = restored(acc, sa, wc, c, jj, h, 1);
                                const float r0 = EPI == EPI_RESIDUAL ? bf16_lo(res[h][jj]) : 0.0f;
                                const float r1 = EPI == EPI_RESIDUAL ? bf16_hi(res[h][jj]) : 0.0f;
                                v[i] = pack_bf16x2(y0 + r0, y1 + r1);
                            }
                            quad_transpose(v, q);
                            if (row < p.m)
                                *reinterpret_cast<uint4*>(p.out + u64(row) * p.ldo + tn * BN + 8 * (c + 4 * g + q)) =
                                    make_uint4(v[0], v[1], v[2], v[3]);
                        }
                    }
                }
                continue;
            }
        }
        float amax = 0.0f;
        u32 saturated = 0;
        // SwiGLU (E4M3 or bf16 h, output o = col / 2) of a tile inside N, with 4-element
        // aligned rows: a quad's h of four 8-column groups are transposed across its lanes
        // (quad_transpose), so a lane stores its group's four consecutive outputs (4 bytes of
        // E4M3, 8 of bf16) where it would store one.
        bool swiglu_quads = false;
        if constexpr (EPI == EPI_SWIGLU || EPI == EPI_SWIGLU_BF16) {
            const u64 at = EPI == EPI_SWIGLU ? reinterpret_cast<u64>(p.codes) & 3 : reinterpret_cast<u64>(p.out) & 7;
            swiglu_quads = p.ldo % 4 == 0 && at == 0 && tn * BN + BN <= p.n;
        }
#pragma unroll
        for (int c = 0; c < BN / 8; c += CH) {
            // The batch's weight scales (held from the tile's start, or loaded here: FP8 wide
            // tiles), and the two rows' residual pairs of column 8 (c + jj) + 2 (lane % 4) (lo,
            // hi: the pair's two columns).
            float wc[CH][2];
            batch_scales<OP, BN>(p, ws, tn, c, lane, wc);
            if constexpr (EPI == EPI_SWIGLU || EPI == EPI_SWIGLU_BF16) {
                if (swiglu_quads) {
                    const u32 q = lane % 4;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 row = row0 + 8 * h;
                        const bool valid = row < p.m;
#pragma unroll
                        for (int g = 0; g < CH / 4; ++g) {
                            // v[i]: h of column pair 8 (c + 4 g + i) + 2 q, i.e. output
                            // 4 (c + 4 g + i) + q of the tile.
                            u32 v[4];
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int jj = 4 * g + i;
                                const float y0 = restored(acc, sa, wc, c, jj, h, 0);
                                const float up = restored(acc, sa, wc, c, jj, h, 1);
                                const float hv = swiglu(y0, up);
                                if (EPI == EPI_SWIGLU) {
                                    if (valid && fabsf(hv) < __int_as_float(0x7f800000)) amax = fmaxf(amax, fabsf(hv));
                                    float qv = hv * inv_scale;
                                    if (!(fabsf(qv) <= 448.0f)) {
                                        saturated += valid;
                                        qv = hv < 0.0f ? -448.0f : 448.0f;
                                    }
                                    v[i] = e4m3x2(qv, 0.0f) & 0xffu;
                                } else {
                                    v[i] = to_bf16(hv);
                                }
                            }
                            quad_transpose(v, q);
                            // Now outputs 4 (c + 4 g + q) + i of the tile, i = 0..3.
                            const u64 o = u64(row) * p.ldo + tn * (BN / 2) + 4 * (c + 4 * g + q);
                            if (!valid) continue;
                            if (EPI == EPI_SWIGLU)
                                *reinterpret_cast<u32*>(p.codes + o) = v[0] | v[1] << 8 | v[2] << 16 | v[3] << 24;
                            else
                                *reinterpret_cast<uint2*>(p.out + o) = make_uint2(v[0] | v[1] << 16, v[2] | v[3] << 16);
                        }
                    }
                    continue;
                }
            }
            u32 res[2][CH];
#pragma unroll
            for (int jj = 0; jj < CH; ++jj) {
                const u32 col = tn * BN + 8 * (c + jj) + 2 * (lane % 4);
                if (EPI == EPI_RESIDUAL) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 row = row0 + 8 * h;
                        const u16* r = p.residual + u64(row) * p.ldr + col;
                        const u32 lo = row < p.m && col < p.n ? u32(r[0]) : 0u;
                        const u32 hi = row < p.m && col + 1 < p.n ? u32(r[1]) : 0u;
                        res[h][jj] = lo | hi << 16;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 row = row0 + 8 * h;
                if (row >= p.m) continue;
#pragma unroll
                for (int jj = 0; jj < CH; ++jj) {
                    const int j = c + jj;
                    const u32 col = tn * BN + 8 * j + 2 * (lane % 4);
                    if (col >= p.n) continue;
                    const float y0 = restored(acc, sa, wc, c, jj, h, 0);
                    if (EPI == EPI_SWIGLU) {
                        // n is even: the pair is whole.
                        const float up = restored(acc, sa, wc, c, jj, h, 1);
                        const float hv = swiglu(y0, up);
                        if (fabsf(hv) < __int_as_float(0x7f800000)) amax = fmaxf(amax, fabsf(hv));
                        float q = hv * inv_scale;
                        if (!(fabsf(q) <= 448.0f)) {
                            ++saturated;
                            q = hv < 0.0f ? -448.0f : 448.0f;
                        }
                        p.codes[u64(row) * p.ldo + col / 2] = u8(e4m3x2(q, 0.0f));
                        continue;
                    }
                    if (EPI == EPI_SWIGLU_BF16) {
                        const float up = restored(acc, sa, wc, c, jj, h, 1);
                        p.out[u64(row) * p.ldo + col / 2] = to_bf16(swiglu(y0, up));
                        continue;
                    }
                    const float r0 = EPI == EPI_RESIDUAL ? bf16_lo(res[h][jj]) : 0.0f;
                    const float r1 = EPI == EPI_RESIDUAL ? bf16_hi(res[h][jj]) : 0.0f;
                    u16* out = p.out + u64(row) * p.ldo;
                    if (col + 1 < p.n) {
                        const float y1 = restored(acc, sa, wc, c, jj, h, 1);
                        *reinterpret_cast<u32*>(out + col) = pack_bf16x2(y0 + r0, y1 + r1);
                    } else {
                        out[col] = to_bf16(y0 + r0);
                    }
                }
            }
        }
        if (EPI == EPI_SWIGLU) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                saturated += __shfl_xor_sync(0xffffffffu, saturated, o);
            }
            if (lane == 0) {
                atomicMax(p.amax, __float_as_uint(amax));
                if (saturated) atomicAdd(p.saturated, saturated);
            }
        }
    }
}

// Entry points: NAME runs fp8_gemm<EPI, BF16, BN>.
#define FP8_GEMM_ENTRY(NAME, EPI, BF16, BN)                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(const __grid_constant__ Fp8GemmParams p) { \
        fp8_gemm<EPI, BF16 ? OP_BF16 : OP_FP8, BN>(p);                                                \
    }
#define I4_GEMM_ENTRY(NAME, EPI, G)                                                                  \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(const __grid_constant__ Fp8GemmParams p) { \
        fp8_gemm<EPI, OP_I4, 128, G>(p);                                                              \
    }

FP8_GEMM_ENTRY(fp8_gemm_plain, EPI_PLAIN, false, 128)
FP8_GEMM_ENTRY(fp8_gemm_residual, EPI_RESIDUAL, false, 128)
FP8_GEMM_ENTRY(fp8_gemm_swiglu, EPI_SWIGLU, false, 128)
FP8_GEMM_ENTRY(fp8_gemm_swiglu_bf16, EPI_SWIGLU_BF16, false, 128)
FP8_GEMM_ENTRY(fp8_gemm_qkv, EPI_QKV, false, 128)
FP8_GEMM_ENTRY(fp8_gemm_plain_n256, EPI_PLAIN, false, 256)
FP8_GEMM_ENTRY(fp8_gemm_residual_n256, EPI_RESIDUAL, false, 256)
FP8_GEMM_ENTRY(fp8_gemm_swiglu_n256, EPI_SWIGLU, false, 256)
FP8_GEMM_ENTRY(fp8_gemm_swiglu_bf16_n256, EPI_SWIGLU_BF16, false, 256)
FP8_GEMM_ENTRY(fp8_gemm_qkv_n256, EPI_QKV, false, 256)
FP8_GEMM_ENTRY(bf16_tc_gemm_plain, EPI_PLAIN, true, 128)
FP8_GEMM_ENTRY(bf16_tc_gemm_residual, EPI_RESIDUAL, true, 128)
FP8_GEMM_ENTRY(bf16_tc_gemm_swiglu_bf16, EPI_SWIGLU_BF16, true, 128)
FP8_GEMM_ENTRY(bf16_tc_gemm_qkv, EPI_QKV, true, 128)
FP8_GEMM_ENTRY(bf16_tc_gemm_plain_n256, EPI_PLAIN, true, 256)
FP8_GEMM_ENTRY(bf16_tc_gemm_residual_n256, EPI_RESIDUAL, true, 256)
FP8_GEMM_ENTRY(bf16_tc_gemm_swiglu_bf16_n256, EPI_SWIGLU_BF16, true, 256)
FP8_GEMM_ENTRY(bf16_tc_gemm_qkv_n256, EPI_QKV, true, 256)
I4_GEMM_ENTRY(fp8_i4_gemm_plain_g32, EPI_PLAIN, 32)
I4_GEMM_ENTRY(fp8_i4_gemm_residual_g32, EPI_RESIDUAL, 32)
I4_GEMM_ENTRY(fp8_i4_gemm_swiglu_bf16_g32, EPI_SWIGLU_BF16, 32)
I4_GEMM_ENTRY(fp8_i4_gemm_qkv_g32, EPI_QKV, 32)
I4_GEMM_ENTRY(fp8_i4_gemm_plain_g64, EPI_PLAIN, 64)
I4_GEMM_ENTRY(fp8_i4_gemm_residual_g64, EPI_RESIDUAL, 64)
I4_GEMM_ENTRY(fp8_i4_gemm_swiglu_bf16_g64, EPI_SWIGLU_BF16, 64)
I4_GEMM_ENTRY(fp8_i4_gemm_qkv_g64, EPI_QKV, 64)
I4_GEMM_ENTRY(fp8_i4_gemm_plain_g128, EPI_PLAIN, 128)
I4_GEMM_ENTRY(fp8_i4_gemm_residual_g128, EPI_RESIDUAL, 128)
I4_GEMM_ENTRY(fp8_i4_gemm_swiglu_bf16_g128, EPI_SWIGLU_BF16, 128)
I4_GEMM_ENTRY(fp8_i4_gemm_qkv_g128, EPI_QKV, 128)
