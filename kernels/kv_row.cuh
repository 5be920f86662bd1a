// The KV cache's rows as the kernels that write them share them: the cache formats and their
// descriptor, the rotate-half RoPE of one value, the mirrors' quantizers and the append of a
// row held by a warp. Included by decode_attention.cu (kv_append, rope_append, decode
// attention), fp8_gemm.cu (the prefill q|k|v epilogue, which writes the same bits as
// rope_append) and the W4A16 kernels (the decode q|k|v epilogue, the same bits again); docs/KV_CACHE_FORMAT.md and
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

// N (1 or 2) words stored at p (aligned).
template <int N>
__device__ __forceinline__ void store_words(u16* p, const u32 (&w)[N]) {
    if (N == 2)
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[N - 1]);
    else
        *reinterpret_cast<u32*>(p) = w[0];
}

// Writes one K or V row held by a warp (lane l: bf16 values l E .. l E + E - 1 in `w`) at
// (slot, kv head h, pos) of the main cache and, rotated and quantized, of the mirror.
template <int D>
__device__ __forceinline__ void append_words(const KvCache& main, const KvCache& m, u32 block, u32 slot, u32 pos, u32 h,
                                             u32 is_v, u32 kvh, u32 lane, const u32 (&w)[D / 64]) {
    constexpr int E = D / 32;
    if (main.k) {
        store_words<E / 2>(static_cast<u16*>(is_v ? main.v : main.k) + kv_row(main, slot, h, pos) * D + lane * E, w);
    }
    if (!m.k) return;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = bf16_lo(u16(w[e / 2] >> (16 * (e % 2))));
    hadamard_regs<D>(x, block, lane);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const u64 r = kv_row(m, slot, h, pos);
    if (m.format == FMT_FP8) {
        const float s = kv_fp8_scale(amax);
        u32 codes = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) codes |= kv_fp8_code(x[e], s) << (8 * e);
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * D + lane * E;
        if (E == 4)
            *reinterpret_cast<u32*>(dst) = codes;
        else
            *reinterpret_cast<u16*>(dst) = u16(codes);
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    } else {
        const float s = kv_int4_scale(amax);
        // Byte j: value 2j in the low nibble, 2j + 1 in the high one (keys and values alike).
        u32 nib = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) nib |= kv_int4_nibble(x[e], s) << (4 * e);
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * (D / 2) + lane * (E / 2);
        if (E == 4)
            *reinterpret_cast<u16*>(dst) = u16(nib);
        else
            *dst = u8(nib);
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    }
}
