// Device building blocks of kernels/decode_attention.cu (the cache append and decode attention):
// conversions, the Walsh-Hadamard rotation, global loads, and the attention kernel's tile loads,
// mma operands and shared-memory layouts. The .cu file includes this header after
// its typedefs, cache formats and parameter structs; the runtime writes its text in place of
// the include line before NVRTC compiles (kernels::expand_includes).


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

// E (2 or 4) floats as bf16 at p (aligned).
template <int E>
__device__ __forceinline__ void store_bf16(u16* p, const float (&x)[E]) {
    const u32 w0 = u32(to_bf16(x[0])) | (u32(to_bf16(x[1])) << 16);
    if (E == 4)
        *reinterpret_cast<uint2*>(p) = make_uint2(w0, u32(to_bf16(x[2 % E])) | (u32(to_bf16(x[3 % E])) << 16));
    else
        *reinterpret_cast<u32*>(p) = w0;
}

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
// load_words), through the non-coherent path, the L2 fetching 128 bytes around each miss from
// DRAM (L2_PF, also on the cache's cp.async).
#define L2_PF ".L2::128B"
__device__ __forceinline__ uint4 ldg_cache(const uint4* p) {
    uint4 v;
    asm("ld.global.nc" L2_PF ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ldg_cache(const uint2* p) {
    uint2 v;
    asm("ld.global.nc" L2_PF ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_cache(const u32* p) {
    u32 v;
    asm("ld.global.nc" L2_PF ".u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ldg_cache(const float* p) {
    float v;
    asm("ld.global.nc" L2_PF ".f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

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
// Decode attention: fragments, tile loads, shared-memory layouts
// ---------------------------------------------------------------------------------------------

// The two halves (low, high) of an f16 pair as f32.
__device__ __forceinline__ void f16x2_to_f32(u32 h2, float& lo, float& hi) {
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(h2));
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

// cp.async of a tile's 16 rows of KB bytes, whole rows per instruction (lane: 16-byte chunk
// lane % CPR of rows RPI i + lane / CPR), rows past k1 read row k0; row(key) is a key's row in
// the pool, dst(row, chunk) the chunk's shared-memory address.
template <int KB, typename Row, typename Dst>
__device__ __forceinline__ void copy_tile_rows(const void* src, Row row, u32 base, u32 k0, u32 k1, u32 lane, Dst dst) {
    constexpr int CPR = KB / 16, RPI = 32 / CPR;
    const u32 r0 = lane / CPR, col = lane % CPR;
#pragma unroll
    for (int i = 0; i < 16 / RPI; ++i) {
        const u32 kr = RPI * i + r0;
        const u64 at = row(base + kr < k1 ? base + kr : k0);
        cp_async16_l2pf(dst(kr, col), static_cast<const u8*>(src) + at * KB + col * 16);
    }
}

// Queues the loads of the tile at key `base` of (slot, kv head kvh): K slices into r, V (BF16:
// cp.async into `tile`; mirrors: into r). Rows past k1 read row k0: finite values under masked
// (zero) probabilities. Each row is looked up in the page table (the tile at the end of a range,
// whose rows may fall back to k0's page).
template <int FMT, int D, int VP>
__device__ __forceinline__ void load_tile(const KvCache& c, u32 slot, u32 kvh, u32 base, u32 k0, u32 k1, u32 lane,
                                         Raw<FMT, D>& r, u16* tile) {
    const u32 g = lane >> 2, t = lane & 3;
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int KP = Piece<KB / 4>::BYTES, VP2 = Piece<KB / 2>::BYTES;
    auto row = [&](u32 key) { return kv_row(c, slot, kvh, key < k1 ? key : k0); };
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const u8* rowp = static_cast<const u8*>(c.k) + row(base + 8 * nt + g) * KB;
        load_pieces(rowp + t * KP, 4 * KP, r.k[nt]);
    }
    if (FMT == FMT_BF16) {
        copy_tile_rows<KB>(c.v, [&](u32 key) { return kv_row(c, slot, kvh, key); }, base, k0, k1, lane,
                           [&](u32 rw, u32 chunk) { return smem_u32(tile + rw * VP + chunk * 8); });
        return;
    }
    if (FMT == FMT_INT4) {
        // Keys 2t, 2t + 1, 2t + 8, 2t + 9, the lane's D / 16 bytes from byte g D / 16.
        constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u8* src = static_cast<const u8*>(c.v) + row(base + 2 * t + int4_value_key(kk)) * KB + g * (D / 16);
            load_words<VK>(src, &r.v[kk * VK]);
        }
    } else {  // FP8: half a value row (lane = 2 key + half)
        const u32 key = lane >> 1, half = lane & 1;
        load_pieces(static_cast<const u8*>(c.v) + row(base + key) * KB + half * VP2, 2 * VP2, r.v);
    }
    // The scales travel with their tile: loaded here, they are in flight with the codes instead
    // of costing a dependent round trip when the tile is used.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            // The K (i = 0) and V (i = 1) scales of key 8 nt + g, the lane's score rows.
            r.ks[nt][i] = ldg_cache((i ? c.vs : c.ks) + row(base + 8 * nt + g));
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

// The loads of a tile that lies wholly below the end of the range (so in one page), from the
// lane's pointers into it (its key row g, value row and scales; BF16 values: vdst, the lane's
// place in the tile): constant offsets, no clamping.
template <int FMT, int D, int VP>
__device__ __forceinline__ void load_tile_fast(const u8* kp, const u8* vp, const float* ksp, const float* vsp,
                                              Raw<FMT, D>& r, u32 vdst) {
    constexpr int KB = row_bytes<FMT, D>();
    constexpr int KP = Piece<KB / 4>::BYTES, VP2 = Piece<KB / 2>::BYTES;
    load_pieces(kp, 4 * KP, r.k[0]);
    load_pieces(kp + 8 * KB, 4 * KP, r.k[1]);
    if (FMT == FMT_BF16) {
        constexpr int RPI = 32 / (KB / 16);  // whole rows per instruction (see copy_tile_rows)
#pragma unroll
        for (int i = 0; i < 16 / RPI; ++i) cp_async16_l2pf(vdst + RPI * i * VP * 2, vp + RPI * i * KB);
        return;
    }
    if (FMT == FMT_INT4) {  // vp: key row 2t of the tile, at the lane's bytes (load_tile)
        constexpr int VK = Raw<FMT, D>::VK;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) load_words<VK>(vp + int4_value_key(kk) * KB, &r.v[kk * VK]);
    } else {
        load_pieces(vp, 2 * VP2, r.v);
    }
    r.ks[0][0] = ldg_cache(ksp);
    r.ks[1][0] = ldg_cache(ksp + 8);
    r.ks[0][1] = ldg_cache(vsp);
    r.ks[1][1] = ldg_cache(vsp + 8);
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

// A query row in shared memory: dim dd at pos(dd), 8 floats of padding after every 32 dims and
// a row pitch of 4 (mod 32) floats, so that the lanes reading their slices of the query (lane
// (g, t): row g, dims from t times the slice piece) for the B fragments fall in distinct banks
// (BF16, FP8 and INT4 slices alike; unpadded, INT4's were 8-way conflicts per 16-byte load).
template <int D>
struct QsRow {
    static constexpr int P = (D + D / 4 + 27) / 32 * 32 + 4;
    static __device__ __forceinline__ u32 pos(u32 dd) { return dd + (dd >> 5) * 8; }
};

// A head's row of a warp's output in the merge buffer: pitch D + 4 floats (the lanes of a scalar
// store, t apart by two heads and g by one column, fall in distinct banks); INT4 stores whole
// float4 groups of a lane's D / 8 dims, placed with the group index xor the head pair t so that
// the 8 lanes of a store phase hit 8 distinct bank groups (unswizzled, a 16-way conflict per
// store for 8 heads). The merge reads with the same places.
template <int D>
struct WoRow {
    static constexpr int P = D + 4;
    static __device__ __forceinline__ u32 pos(int fmt, u32 h, u32 dd) {
        if (fmt != FMT_INT4) return dd;
        constexpr u32 NJ = D / 32;  // float4 groups per lane and head
        const u32 q = dd >> 2;
        return ((q & ~(NJ - 1)) | ((q ^ (h >> 1)) & (NJ - 1))) * 4 + (dd & 3);
    }
};

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
    asm volatile("prefetch.global.L2::evict_normal [%0];" ::"l"(ptr));
}

