// Decode attention over a KV cache in one of three formats, with split-KV and a log-sum-exp
// combine, and the cache append that writes each new token's K and V rows.
//
// Formats (docs/KV_CACHE_FORMAT.md; crates/stoke-formats/src/kv.rs is the specification):
//   BF16  the main cache:  k, v  [slots, kv_heads, cap, d] bf16
//   FP8   E4M3 mirror:     k, v  [slots, kv_heads, cap, d] u8 codes, ks, vs [slots, kv_heads, cap]
//                          f32 scales (amax / 448), value = e4m3(code) * scale
//   INT4  mirror:          k [slots, kv_heads, cap, d / 2] bytes in the mma byte order, v the
//                          same in natural order, ks, vs f32 scales (amax / 7), value = q * scale
// The mirrors hold rows rotated by the normalized block-diagonal Walsh-Hadamard transform of
// `block` (0: no rotation); the query is rotated the same way and the output rotated back, so
// attention over an exact rotated cache equals attention over the unrotated one.
//
// Entry points:
//   kv_append         one warp per (slot, kv head, K or V): writes the bf16 row of the main cache
//                     at position pos[slot], and the rotated, quantized row of the mirror.
//   decode_attn_FMT_dD  (FMT bf16 / fp8 / int4, D 64 / 128) grid (splits, kv_heads, batch),
//                     128 threads: the query heads that share a kv head (group <= 8) together,
//                     so each cache byte is read once; the CTA takes keys
//                     [split * chunk, min(len, (split + 1) * chunk)). Writes the partial
//                     (max, sum, unnormalized output) of each (batch, head, split).
//   decode_combine_dD one warp per (batch, head): merges the splits, rotates back, writes bf16.
//
// This first version runs on CUDA cores: within a warp, lane j owns key j of each 32-key step
// for q.k (q in shared memory, read by broadcast), then the warp owns the value rows one at a
// time for p.v (lane j holds output dims j * d / 32 onwards). Softmax is online per warp; the
// CTA's warps merge through shared memory.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_INT4 = 2 };
#define NEG_INF __int_as_float(0xff800000)
constexpr int WARPS = 4;
constexpr int MAX_GROUP = 8;

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
    float* part_o;        // [batch, heads, splits, d] unnormalized outputs
    float* part_ml;       // [batch, heads, splits, 2] (running max of scaled scores, sum of exp)
    u32 batch, heads, splits, chunk, block;
    float scale;          // 1 / sqrt(d)
};

struct CombineParams {
    const float* part_o;
    const float* part_ml;
    u16* out;             // [batch, heads, d] bf16
    u32 batch, heads, splits, block;
};
static_assert(sizeof(KvCache) == 48, "KvCache layout");
static_assert(sizeof(AppendParams) == 136, "AppendParams layout");
static_assert(sizeof(AttnParams) == 112, "AttnParams layout");
static_assert(sizeof(CombineParams) == 40, "CombineParams layout");

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(u32(v) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// E4M3 code to f32 (exact): through the hardware pair conversion to f16.
__device__ __forceinline__ float e4m3_to_f32(u32 code) {
    u32 h2;
    const u16 pair = u16(code & 0xffu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u16(h2 & 0xffffu)));
    return f;
}

// Nearest E4M3 code of x (saturating, ties to even), as the hardware does it.
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return r & 0xffu;
}

// In-place normalized Walsh-Hadamard transform of each `block` consecutive values of v[0..d),
// by one warp in shared memory (log2(block) butterfly passes).
__device__ __forceinline__ void hadamard_warp(float* v, u32 d, u32 block, u32 lane) {
    if (block == 0) return;
    for (u32 h = 1; h < block; h <<= 1) {
        __syncwarp();
        for (u32 i = lane; i < d / 2; i += 32) {
            // The i-th butterfly pair of this pass: (a, a + h) with a's bit h clear.
            const u32 a = (i / h) * 2 * h + (i % h);
            const float x = v[a], y = v[a + h];
            v[a] = x + y;
            v[a + h] = x - y;
        }
    }
    __syncwarp();
    const float norm = 1.0f / sqrtf(float(block));
    for (u32 i = lane; i < d; i += 32) v[i] *= norm;
    __syncwarp();
}

// Byte / nibble position of value i of an INT4 row: natural, or the mma key order (within each
// 16-value chunk, byte 2t holds values 2t, 2t + 1 and byte 2t + 1 values 2t + 8, 2t + 9).
__device__ __forceinline__ void int4_pos(u32 i, bool mma, u32& byte, bool& hi) {
    if (!mma) {
        byte = i / 2;
        hi = i & 1;
        return;
    }
    const u32 chunk = i / 16, r = i % 16;
    byte = chunk * 8 + 2 * ((r % 8) / 2) + r / 8;
    hi = r & 1;
}

// ---------------------------------------------------------------------------------------------
// Cache append
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(128) kv_append(const AppendParams p) {
    __shared__ float rowbuf[4][256];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * 4 + warp;  // (b, kv head, K/V)
    const u32 kvh = p.main.kv_heads ? p.main.kv_heads : p.mirror.kv_heads;
    if (item >= p.batch * kvh * 2) return;
    const u32 b = item / (kvh * 2), h = (item / 2) % kvh, is_v = item & 1;
    const u32 d = p.main.k ? p.main.d : p.mirror.d;
    const u16* src = (is_v ? p.v_new : p.k_new) + (u64(b) * kvh + h) * d;
    const u32 slot = p.slot_of[b], pos = p.pos[b];
    float* row = rowbuf[warp];
    for (u32 i = lane; i < d; i += 32) row[i] = bf16_to_f32(src[i]);
    __syncwarp();
    if (p.main.k) {
        u16* dst = static_cast<u16*>(is_v ? p.main.v : p.main.k) + ((u64(slot) * kvh + h) * p.main.cap + pos) * d;
        for (u32 i = lane; i < d; i += 32) dst[i] = src[i];
    }
    if (!p.mirror.k) return;
    const KvCache& m = p.mirror;
    hadamard_warp(row, d, p.block, lane);
    float amax = 0.0f;
    for (u32 i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(row[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const u64 r = (u64(slot) * kvh + h) * m.cap + pos;
    if (m.format == FMT_FP8) {
        const float s = amax / 448.0f;
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * d;
        for (u32 i = lane; i < d; i += 32) dst[i] = u8(s > 0.0f ? f32_to_e4m3(row[i] / s) : 0u);
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    } else {
        const float s = amax / 7.0f;
        u8* dst = static_cast<u8*>(is_v ? m.v : m.k) + r * (d / 2);
        // Each lane builds whole bytes: byte j holds the two values whose positions map to it.
        for (u32 j = lane; j < d / 2; j += 32) {
            u32 byte_val = 0;
            for (u32 i = 0; i < d; ++i) {  // d <= 128: small; the append is one row
                u32 bi;
                bool hi;
                int4_pos(i, !is_v, bi, hi);
                if (bi != j) continue;
                float qv = s > 0.0f ? rintf(row[i] / s) : 0.0f;
                qv = fminf(fmaxf(qv, -8.0f), 7.0f);
                const u32 nib = u32(int(qv)) & 0xfu;
                byte_val |= hi ? nib << 4 : nib;
            }
            dst[j] = u8(byte_val);
        }
        if (lane == 0) (is_v ? m.vs : m.ks)[r] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------

// 16 consecutive key values (dims c*16 .. c*16+15, natural order) of key row `row` as f32.
template <int FMT, int D>
__device__ __forceinline__ void load_key16(const KvCache& c, u64 row, u32 chunk, float (&x)[16]) {
    if (FMT == FMT_BF16) {
        const uint4* p = reinterpret_cast<const uint4*>(static_cast<const u16*>(c.k) + row * D + chunk * 16);
        const uint4 a = p[0], b = p[1];
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else if (FMT == FMT_FP8) {
        const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const u8*>(c.k) + row * D + chunk * 16);
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) x[4 * i + j] = e4m3_to_f32(w[i] >> (8 * j));
    } else {
        const uint2 a = *reinterpret_cast<const uint2*>(static_cast<const u8*>(c.k) + row * (D / 2) + chunk * 8);
        const u32 w[2] = {a.x, a.y};
        // Byte 2t: dims 2t, 2t + 1; byte 2t + 1: dims 2t + 8, 2t + 9 (t = 0..3).
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 lo = (w[t / 2] >> (16 * (t % 2))) & 0xffu, hi = (w[t / 2] >> (16 * (t % 2) + 8)) & 0xffu;
            x[2 * t] = float(int(lo << 28) >> 28);
            x[2 * t + 1] = float(int(lo << 24) >> 28);
            x[2 * t + 8] = float(int(hi << 28) >> 28);
            x[2 * t + 9] = float(int(hi << 24) >> 28);
        }
    }
}

// The lane's E = D / 32 value dims (lane * E onwards) of value row `row` as f32.
template <int FMT, int D>
__device__ __forceinline__ void load_value(const KvCache& c, u64 row, u32 lane, float (&x)[D / 32]) {
    constexpr int E = D / 32;
    if (FMT == FMT_BF16) {
        const u16* p = static_cast<const u16*>(c.v) + row * D + lane * E;
        if (E == 4) {
            const uint2 a = *reinterpret_cast<const uint2*>(p);
            x[0] = __uint_as_float(a.x << 16);
            x[1] = __uint_as_float(a.x & 0xffff0000u);
            x[2 % E] = __uint_as_float(a.y << 16);
            x[3 % E] = __uint_as_float(a.y & 0xffff0000u);
        } else {
            const u32 a = *reinterpret_cast<const u32*>(p);
            x[0] = __uint_as_float(a << 16);
            x[1] = __uint_as_float(a & 0xffff0000u);
        }
    } else if (FMT == FMT_FP8) {
        const u8* p = static_cast<const u8*>(c.v) + row * D + lane * E;
        const u32 a = E == 4 ? *reinterpret_cast<const u32*>(p) : u32(*reinterpret_cast<const u16*>(p));
#pragma unroll
        for (int i = 0; i < E; ++i) x[i] = e4m3_to_f32(a >> (8 * i));
    } else {
        const u8* p = static_cast<const u8*>(c.v) + row * (D / 2) + lane * (E / 2);
        const u32 a = E == 4 ? u32(*reinterpret_cast<const u16*>(p)) : u32(*p);
#pragma unroll
        for (int i = 0; i < E; ++i) x[i] = float(int(a << (28 - 4 * i)) >> 28);
    }
}

template <int FMT, int D>
__device__ __forceinline__ void decode_attn(const AttnParams& p) {
    constexpr int E = D / 32;
    __shared__ __align__(16) float qs[MAX_GROUP][D];
    __shared__ float ps[WARPS][MAX_GROUP][32];
    __shared__ float wm[WARPS][MAX_GROUP], wl[WARPS][MAX_GROUP];
    __shared__ float wo[WARPS][MAX_GROUP][D];

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const KvCache& c = p.cache;
    const u32 group = p.heads / c.kv_heads;
    const u32 len = p.len[b];
    const u32 k0 = split * p.chunk, k1 = min(len, k0 + p.chunk);
    const u64 row0 = (u64(p.slot_of[b]) * c.kv_heads + kvh) * c.cap;

    // The group's queries, rotated like the cache rows (the BF16 cache is not rotated).
    for (u32 i = threadIdx.x; i < group * D; i += blockDim.x) {
        const u32 h = i / D, dd = i % D;
        qs[h][dd] = bf16_to_f32(p.q[(u64(b) * p.heads + kvh * group + h) * D + dd]);
    }
    __syncthreads();
    if (FMT != FMT_BF16 && p.block) {
        for (u32 h = warp; h < group; h += WARPS) hadamard_warp(qs[h], D, p.block, lane);
        __syncthreads();
    }

    float m[MAX_GROUP], l[MAX_GROUP], o[MAX_GROUP][E];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[h][e] = 0.0f;
    }
    for (u32 base = k0 + warp * 32; base < k1; base += WARPS * 32) {
        const u32 key = base + lane;
        const bool valid = key < k1;
        const u64 row = row0 + (valid ? key : k0);
        float s[MAX_GROUP];
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) s[h] = 0.0f;
#pragma unroll 2
        for (u32 ch = 0; ch < D / 16; ++ch) {
            float x[16];
            load_key16<FMT, D>(c, row, ch, x);
#pragma unroll
            for (int h = 0; h < MAX_GROUP; ++h) {
                if (h < group) {
                    const float4* qv = reinterpret_cast<const float4*>(&qs[h][ch * 16]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float4 q4 = qv[i];
                        s[h] = fmaf(q4.x, x[4 * i], s[h]);
                        s[h] = fmaf(q4.y, x[4 * i + 1], s[h]);
                        s[h] = fmaf(q4.z, x[4 * i + 2], s[h]);
                        s[h] = fmaf(q4.w, x[4 * i + 3], s[h]);
                    }
                }
            }
        }
        const float kscale = (FMT == FMT_BF16 ? 1.0f : c.ks[row]) * p.scale;
        const float vscale = FMT == FMT_BF16 ? 1.0f : c.vs[row];
        const u32 nvalid = min(32u, k1 - base);
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h >= group) break;
            float sc = valid ? s[h] * kscale : NEG_INF;
            float mx = sc;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mnew = fmaxf(m[h], mx);
            const float pr = valid ? __expf(sc - mnew) : 0.0f;
            float sum = pr;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            const float corr = __expf(m[h] - mnew);
            l[h] = l[h] * corr + sum;
            m[h] = mnew;
#pragma unroll
            for (int e = 0; e < E; ++e) o[h][e] *= corr;
            ps[warp][h][lane] = pr * vscale;
        }
        __syncwarp();
        for (u32 i = 0; i < nvalid; ++i) {
            float vx[E];
            load_value<FMT, D>(c, row0 + base + i, lane, vx);
#pragma unroll
            for (int h = 0; h < MAX_GROUP; ++h) {
                if (h >= group) break;
                const float pw = ps[warp][h][i];
#pragma unroll
                for (int e = 0; e < E; ++e) o[h][e] = fmaf(pw, vx[e], o[h][e]);
            }
        }
        __syncwarp();
    }
    // Merge the warps: each writes its (m, l, o); then all threads combine per (head, dim).
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        if (h >= group) break;
        if (lane == 0) {
            wm[warp][h] = m[h];
            wl[warp][h] = l[h];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) wo[warp][h][lane * E + e] = o[h][e];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < group * D; i += blockDim.x) {
        const u32 h = i / D, dd = i % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wm[w][h]);
        float lsum = 0.0f, osum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = wm[w][h] == NEG_INF ? 0.0f : __expf(wm[w][h] - mx);
            lsum += wl[w][h] * f;
            osum += wo[w][h][dd] * f;
        }
        const u64 ph = (u64(b) * p.heads + kvh * group + h) * p.splits + split;
        p.part_o[ph * D + dd] = osum;
        if (dd == 0) {
            p.part_ml[ph * 2] = mx;
            p.part_ml[ph * 2 + 1] = lsum;
        }
    }
}

template <int D>
__device__ __forceinline__ void decode_combine(const CombineParams& p) {
    __shared__ float rowbuf[4][D];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * 4 + warp;  // (batch, head)
    if (item >= p.batch * p.heads) return;
    const float* ml = p.part_ml + u64(item) * p.splits * 2;
    float mx = NEG_INF;
    for (u32 s = 0; s < p.splits; ++s) mx = fmaxf(mx, ml[2 * s]);
    float lsum = 0.0f;
    for (u32 s = 0; s < p.splits; ++s)
        if (ml[2 * s] != NEG_INF) lsum += ml[2 * s + 1] * __expf(ml[2 * s] - mx);
    float* row = rowbuf[warp];
    for (u32 dd = lane; dd < D; dd += 32) {
        float acc = 0.0f;
        for (u32 s = 0; s < p.splits; ++s)
            if (ml[2 * s] != NEG_INF) acc += p.part_o[(u64(item) * p.splits + s) * D + dd] * __expf(ml[2 * s] - mx);
        row[dd] = lsum > 0.0f ? acc / lsum : 0.0f;
    }
    hadamard_warp(row, D, p.block, lane);  // undoes the rotation of V (no-op for block 0)
    for (u32 dd = lane; dd < D; dd += 32) p.out[u64(item) * D + dd] = f32_to_bf16(row[dd]);
}

#define DECODE_ATTN_ENTRY(NAME, FMT, D) \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const AttnParams p) { decode_attn<FMT, D>(p); }

DECODE_ATTN_ENTRY(decode_attn_bf16_d64, FMT_BF16, 64)
DECODE_ATTN_ENTRY(decode_attn_bf16_d128, FMT_BF16, 128)
DECODE_ATTN_ENTRY(decode_attn_fp8_d64, FMT_FP8, 64)
DECODE_ATTN_ENTRY(decode_attn_fp8_d128, FMT_FP8, 128)
DECODE_ATTN_ENTRY(decode_attn_int4_d64, FMT_INT4, 64)
DECODE_ATTN_ENTRY(decode_attn_int4_d128, FMT_INT4, 128)

extern "C" __global__ void __launch_bounds__(128) decode_combine_d64(const CombineParams p) { decode_combine<64>(p); }
extern "C" __global__ void __launch_bounds__(128) decode_combine_d128(const CombineParams p) { decode_combine<128>(p); }
