// The KV cache's rows as the kernels that write them share them: the cache formats and their
// descriptor, the rotate-half RoPE of one value, and the mirrors' quantizers. Included by
// decode_attention.cu (kv_append, rope_append, decode attention) and fp8_gemm.cu (the q|k|v
// epilogue, which writes the same bits as rope_append); docs/KV_CACHE_FORMAT.md and
// crates/stoke-formats/src/kv.rs specify the formats. Needs ptx.cuh first.

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_INT4 = 2 };

// Bytes of one cache row (d values) in format FMT: bf16, one e4m3 code or one nibble per value.
template <int FMT, int D>
__host__ __device__ constexpr int row_bytes() {
    return FMT == FMT_BF16 ? 2 * D : FMT == FMT_FP8 ? D : D / 2;
}

// A paged cache: a pool of pages of 2^page_shift positions, each holding every kv head's rows
// for those positions, and a page table per sequence slot (the page of its positions
// i 2^page_shift .. (i + 1) 2^page_shift - 1 at pages[slot * max_pages + i]). Every kernel that
// reads or writes cache rows finds them through kv_row, so sequences share pages (a common
// prompt prefix) and grow page by page without moving.
struct KvCache {
    void* k;            // [pages, kv_heads, 2^page_shift, d]: bf16 rows, fp8 codes or int4 bytes (format)
    void* v;
    float* ks;          // [pages, kv_heads, 2^page_shift] (FP8 and INT4)
    float* vs;
    const u32* pages;   // [slots, max_pages] the page table
    u32 kv_heads, page_shift, d, format, max_pages, pad;
};

// Row of (slot, kv head h, position pos) in the pool: rows of one page and head are contiguous,
// so a 16-key tile starting at a multiple of 16 lies in one page (pages hold at least 16
// positions).
__device__ __forceinline__ u64 kv_row(const KvCache& c, u32 slot, u32 h, u32 pos) {
    const u32 page = __ldg(c.pages + u64(slot) * c.max_pages + (pos >> c.page_shift));
    return ((u64(page) * c.kv_heads + h) << c.page_shift) + (pos & ((1u << c.page_shift) - 1u));
}

// Nearest E4M3 code of x (saturating, ties to even), as the hardware does it.
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return r & 0xffu;
}

// Dim i of a head rotated at a position with (c, s) = (cos, sin) of its frequency: x is dim i,
// other its partner i -+ d / 2, upper whether i >= d / 2. Rounded as written (no contraction
// left to the compiler), so every kernel that rotates gets the same bits.
__device__ __forceinline__ float rope_rotate(float x, float other, float c, float s, bool upper) {
    return __fmaf_rn(x, c, __fmul_rn(upper ? other : -other, s));
}

// A mirror row's scale from its max |value| (FP8: amax / 448, INT4: amax / 7), and one value's
// code at that scale (an all-zero row: scale 0, codes 0).
__device__ __forceinline__ float kv_fp8_scale(float amax) { return amax / 448.0f; }
__device__ __forceinline__ float kv_int4_scale(float amax) { return amax / 7.0f; }
__device__ __forceinline__ u32 kv_fp8_code(float x, float s) { return s > 0.0f ? f32_to_e4m3(x / s) : 0u; }
// Two's-complement nibble of round(x / s) clamped to [-8, 7].
__device__ __forceinline__ u32 kv_int4_nibble(float x, float s) {
    const float q = s > 0.0f ? fminf(fmaxf(rintf(x / s), -8.0f), 7.0f) : 0.0f;
    return u32(int(q)) & 0xfu;
}
