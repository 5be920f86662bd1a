// Token sampling on the GPU: one decode step's next token per batch row, chosen inside the
// step (a CUDA graph replays it) with no host synchronization.
//
// The file is compiled at run time by NVRTC (sm_80 and later). It includes only ptx.cuh, for
// its integer typedefs and the bf16 unpacking.
//
// ---------------------------------------------------------------------------------------------
// Entry points `sample_f32` and `sample_bf16` (the logits' element type) take one argument,
// `SampleParams` by value. block = (1024, 1, 1); grid.x = rows (any grid.x >= 1 is correct:
// CTAs stride over rows). One CTA samples one row; rows == 0 is a no-op.
//
// Row r of the logits belongs to lane lane_of[r] (lane_of null: lane r): the lane's id, draw
// counter, presence words and settings are read and written. Settings: row_cfg[lane] when given
// (each request its own; counter word 1 is its `stream`; a lane without ROW_ACTIVE, a step's
// padding, is skipped: nothing drawn, nothing written), else the launch's for every row with
// stream = r.
//
// `logprobs_f32` / `logprobs_bf16` (LogprobParams, the same launch shape) run after a sampling:
// for each row whose settings ask for them, the log-softmax of the raw logits (no penalty, no
// temperature) at the chosen token ids[lane] and at the `top` largest logits (ties to the lower
// index), written to out[row] as (id, logprob) pairs: the chosen token first, then the top ones
// in order.
//
// Semantics (crates/stoke-formats/src/sample.rs is the CPU reference; the two agree exactly):
//   1. NaN logits count as -inf. A token whose presence bit is set gets the repetition penalty
//      p: its logit l becomes l / p if l > 0, else l * p (skipped when p == 1).
//   2. temperature <= 0: greedy, the argmax, ties to the lowest index.
//   3. Otherwise l' = l / T (-0 counts as +0). Top-k (0 < top_k < vocab) keeps l' >= t_k, the
//      k-th largest l' (ties at the threshold kept).
//   4. A kept token weighs w = exp(l' - max) as an integer: the exponential by a fixed sequence
//      of correctly rounded f32 operations (weight() below), times 2^40, truncated. The largest
//      token weighs exactly 2^40; tokens more than 28 below the largest weigh 0. All sums of
//      weights are exact 64-bit integers, so no result depends on the order of additions.
//   5. Top-p (top_p < 1) keeps l' >= t_p, the largest value whose upper set weighs at least
//      ceil(top_p * kept weight).
//   6. u = (Philox4x32-10 word 0 >> 8) * 2^-24, counter (pos[row], row, 0, 0), key (seed low,
//      seed high). The token is the first in index order whose running (inclusive) weight
//      exceeds u * total, i.e. exceeds floor(bits * total / 2^24).
//   Then thread 0 writes ids_out[row], sets the token's presence bit (when presence is given)
//   and writes pos[row] + 1 (when pos is given; a null pos draws with counter 0).
//
// Algorithm. Thread t owns the contiguous chunk [t * c, (t + 1) * c) of the row, c =
// ceil(vocab / 1024) rounded up to a 16-byte vector (4 f32 or 8 bf16 logits). Every pass over
// the row recomputes each logit's penalty, l' and its key: the float's bits mapped to a u32
// whose unsigned order is the float order. Thresholds are found by radix select on the keys,
// three digits of 11, 11 and 10 bits, each a histogram in shared memory (counts for top-k,
// weights for top-p) and a block scan over its bins from the top.
//   pass 1     max (and argmax) of l'; with top-k, the histogram of the first digit.
//   top-k      the first digit's bin, then the remaining digits. When the tokens at or above
//              that bin number at most kListCap, one pass gathers them (key, index) into shared
//              memory and everything after runs on that list instead of the row.
//   top-p      the same over weights; the first digit's bin needs the kept weight, which its
//              histogram gives. From the row, a gather of the tokens at or above the bin is
//              tried (it fails when more than kListCap qualify; the row is used instead).
//   draw       the weight of each thread's chunk (from the row, or from the list by shared
//              atomics into per-chunk sums), a block scan, the chunk holding the target; warp 0
//              rescans that chunk, lane by lane, for the token.
// So greedy reads the row once; temperature alone twice; top-k, and top-p over a concentrated
// distribution, two or three times, the rest in shared memory. Top-p over a flat distribution
// (the gather fails) takes six; top-k over more than kListCap tokens then that, eight. No
// global scratch memory.
// ---------------------------------------------------------------------------------------------

#include "ptx.cuh"

// One lane's settings (a request's).
struct RowSample {
    unsigned long long seed;   // Philox key
    float temperature;         // <= 0: greedy
    unsigned int top_k;        // 0 or >= vocab: off
    float top_p;               // >= 1 (or NaN): off
    float repetition_penalty;  // 1: off; > 0
    unsigned int stream;       // Philox counter word 1
    unsigned int flags;        // ROW_ACTIVE | ROW_LOGPROB | top logprobs << 8
};
enum { ROW_ACTIVE = 1, ROW_LOGPROB = 2 };
constexpr unsigned int kMaxTopLogprobs = 20;

struct SampleParams {
    const void* logits;       // [rows, row_stride] f32 or bf16 (by entry point); vocab used
    unsigned int* ids_out;    // [lanes]: the chosen token
    unsigned int* pos;        // [lanes] or nullptr: the draw counter, advanced by 1
    unsigned int* presence;   // [lanes, (vocab + 31) / 32] bitmap or nullptr; chosen bit set
    unsigned long long seed;  // Philox key: low 32 bits, high 32 bits
    unsigned int row_stride;  // elements between rows, >= vocab
    unsigned int vocab;       // >= 1, < 2^24
    unsigned int rows;
    float temperature;         // <= 0: greedy
    unsigned int top_k;        // 0 or >= vocab: off
    float top_p;               // >= 1 (or NaN): off
    float repetition_penalty;  // 1: off; > 0
    const RowSample* row_cfg;  // [lanes] or nullptr: the settings above for every row
    const unsigned int* lane_of;  // [rows] or nullptr: row r is lane r
};
// The Rust mirror (crates/stoke-cuda/src/kernels/sample.rs) asserts the same layout.
static_assert(sizeof(void*) == 8, "64-bit device pointers expected");
static_assert(sizeof(RowSample) == 32, "RowSample: u64, 6 x 32-bit");
static_assert(sizeof(SampleParams) == 88, "SampleParams: 4 pointers, u64, 7 x 32-bit, padding, 2 pointers");
static_assert(alignof(SampleParams) == 8, "SampleParams is 8-byte aligned");
// Field offsets: logits 0, ids_out 8, pos 16, presence 24, seed 32, row_stride 40, vocab 44,
// rows 48, temperature 52, top_k 56, top_p 60, repetition_penalty 64, 4 bytes of padding,
// row_cfg 72, lane_of 80.

struct LogprobParams {
    const void* logits;           // [rows, row_stride] f32 or bf16
    const unsigned int* ids;      // [lanes]: the chosen tokens
    const RowSample* row_cfg;     // [lanes]: ROW_LOGPROB and the top count
    const unsigned int* lane_of;  // [rows] or nullptr
    float* out;                   // [rows, 1 + kMaxTopLogprobs, 2]: (id bits, logprob)
    unsigned int row_stride, vocab, rows, pad;
};
static_assert(sizeof(LogprobParams) == 56, "LogprobParams: 5 pointers, 4 x 32-bit");

namespace stoke_sample {

constexpr u32 kThreads = 1024;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kBins = 2048;                // 11-bit digits (the last is 10 bits)
constexpr u32 kListCap = 4000;             // tokens the shared-memory list holds
constexpr u64 kWeightOne = 1ull << 40;     // weight of the largest logit
constexpr u32 kNone = 0xffffffffu;

// ---- element types -------------------------------------------------------------------------

struct F32 {
    static constexpr u32 kBytes = 4;
    static constexpr u32 kVec = 4;
    __device__ static __forceinline__ void load_vec(const void* row, u32 i, float (&v)[kVec]) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(row) + i));
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    }
    __device__ static __forceinline__ float load(const void* row, u32 i) {
        return __ldg(static_cast<const float*>(row) + i);
    }
};

struct BF16 {
    static constexpr u32 kBytes = 2;
    static constexpr u32 kVec = 8;
    __device__ static __forceinline__ void load_vec(const void* row, u32 i, float (&v)[kVec]) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(static_cast<const u16*>(row) + i));
        const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[2 * j] = bf16_lo(w[j]);
            v[2 * j + 1] = bf16_hi(w[j]);
        }
    }
    __device__ static __forceinline__ float load(const void* row, u32 i) {
        return __uint_as_float(u32(__ldg(static_cast<const u16*>(row) + i)) << 16);
    }
};

// ---- values, keys and weights ----------------------------------------------------------------

// NaN -> -inf.
__device__ __forceinline__ float clean(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? __uint_as_float(0xff800000u) : x;
}

__device__ __forceinline__ float penalize(float l, float p) {
    return l > 0.f ? __fdiv_rn(l, p) : __fmul_rn(l, p);
}

// The float's bits as a u32 in float order (no NaN here; -0 already made +0).
__device__ __forceinline__ u32 key_of(float x) {
    const u32 b = __float_as_uint(x);
    return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}
__device__ __forceinline__ float value_of(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// Key of l' = l / T; adding +0 turns -0 into +0.
__device__ __forceinline__ u32 scaled_key(float l, float t) { return key_of(__fadd_rn(__fdiv_rn(l, t), 0.f)); }

// exp(x) * 2^40 truncated, x = l' - max <= 0: n = rint(x log2 e), r = x - n ln 2 (two-constant
// Cody-Waite), the degree-7 Taylor polynomial of exp(r) by Horner, times 2^(n + 40). Every
// operation is an explicitly rounded intrinsic (no contraction), so the CPU reference
// (stoke_formats::sample::weight) computes the same bits.
__device__ __forceinline__ u64 weight(float x) {
    if (!(x >= -28.f)) return 0;
    const float n = rintf(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)));
    float r = __fmaf_rn(n, -__uint_as_float(0x3f317200u), x);
    r = __fmaf_rn(n, -__uint_as_float(0x35bfbe8eu), r);
    float p = __uint_as_float(0x39500d01u);
    p = __fmaf_rn(p, r, __uint_as_float(0x3ab60b61u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3c088889u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3d2aaaabu));
    p = __fmaf_rn(p, r, __uint_as_float(0x3e2aaaabu));
    p = __fmaf_rn(p, r, __uint_as_float(0x3f000000u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3f800000u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3f800000u));
    const float scale = __uint_as_float(u32(int(n) + 40 + 127) << 23);
    return __float2ull_rz(__fmul_rn(p, scale));
}

// Weight of the token with key `key` when the largest has key `max_key` and value `max`.
__device__ __forceinline__ u64 weight_of(u32 key, u32 max_key, float max) {
    return key == max_key ? kWeightOne : weight(__fsub_rn(value_of(key), max));
}

// ceil(p * z) exactly, at least 1, for p < 1 (p = mant * 2^-shift with shift >= 24).
__device__ __forceinline__ u64 ceil_mul(float p, u64 z) {
    if (!(p > 0.f)) return 1;
    const u32 b = __float_as_uint(p);
    const u32 e = (b >> 23) & 0xffu;
    const u64 mant = (b & 0x7fffffu) | (e ? 0x800000u : 0u);
    const u32 shift = 150u - (e ? e : 1u);
    const u64 lo = mant * z, hi = __umul64hi(mant, z);
    u64 q;
    bool rem;
    if (shift >= 128) {
        q = 0;
        rem = (lo | hi) != 0;
    } else if (shift >= 64) {
        const u32 s = shift - 64;
        q = hi >> s;
        rem = lo != 0 || (hi & ((1ull << s) - 1)) != 0;
    } else {
        q = (hi << (64 - shift)) | (lo >> shift);
        rem = (lo & ((1ull << shift) - 1)) != 0;
    }
    q += rem ? 1 : 0;
    return q ? q : 1;
}

// floor(bits * total / 2^24), bits < 2^24.
__device__ __forceinline__ u64 target_of(u32 bits, u64 total) {
    const u64 lo = u64(bits) * total, hi = __umul64hi(u64(bits), total);
    return (hi << 40) | (lo >> 24);
}

// Philox4x32-10 (Random123), word 0 of counter (ctr, row, 0, 0), shifted right by 8.
__device__ __forceinline__ u32 uniform_bits(u64 seed, u32 ctr, u32 row) {
    u32 c0 = ctr, c1 = row, c2 = 0, c3 = 0;
    u32 k0 = u32(seed), k1 = u32(seed >> 32);
#pragma unroll
    for (int i = 0; i < 10; ++i) {
        if (i > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return c0 >> 8;
}

// ---- the row -------------------------------------------------------------------------------------

struct Row {
    const void* logits;  // this row's first logit
    const u32* pres;     // this row's presence words; nullptr when no penalty applies
    float penalty;
    u32 vocab;
    u32 chunk;  // tokens per thread, a multiple of the vector width
    bool vec;   // the row is 16-byte aligned: vector loads
};

// f(i, l) for each token i in [beg, end) (beg a multiple of the vector width), l its logit
// after the NaN rule and the penalty.
template <class D, class F>
__device__ __forceinline__ void each_logit(const Row& r, u32 beg, u32 end, F&& f) {
    constexpr u32 V = D::kVec;
    u32 i = beg;
    if (r.vec) {
        for (; i + V <= end; i += V) {
            float v[V];
            D::load_vec(r.logits, i, v);
            // A vector's tokens share one presence word (V divides 32).
            const u32 bits = r.pres ? (r.pres[i >> 5] >> (i & 31)) & ((1u << V) - 1) : 0u;
#pragma unroll
            for (u32 j = 0; j < V; ++j) {
                float l = clean(v[j]);
                if (bits & (1u << j)) l = penalize(l, r.penalty);
                f(i + j, l);
            }
        }
    }
    for (; i < end; ++i) {
        float l = clean(D::load(r.logits, i));
        if (r.pres && ((r.pres[i >> 5] >> (i & 31)) & 1u)) l = penalize(l, r.penalty);
        f(i, l);
    }
}

// ---- shared memory and block primitives ----------------------------------------------------------

struct Shared {
    union {
        u64 weight[kBins];  // weight histogram
        u32 count[kBins];   // count histogram
        u64 chunk[kThreads];  // weight per thread chunk (the draw)
    } h;
    u32 list_key[kListCap];
    u32 list_idx[kListCap];
    u64 warp[kWarps];
    u64 val[4];  // results broadcast to the block
    u32 n_list;
};

// Inclusive sum over the block (thread order); `total` gets the sum of all. Every thread calls.
__device__ __forceinline__ u64 block_scan(u64 v, Shared& s, u64& total) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    if (lane == 31) s.warp[w] = v;
    __syncthreads();
    if (w == 0) {
        u64 x = s.warp[lane];
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            const u64 n = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += n;
        }
        s.warp[lane] = x;
    }
    __syncthreads();
    const u64 before = w ? s.warp[w - 1] : 0;
    total = s.warp[kWarps - 1];
    __syncthreads();
    return v + before;
}

// Maximum over the block, returned to every thread.
__device__ __forceinline__ u64 block_max(u64 v, Shared& s) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) {
        const u64 n = __shfl_xor_sync(0xffffffffu, v, o);
        v = n > v ? n : v;
    }
    if (lane == 0) s.warp[w] = v;
    __syncthreads();
    v = s.warp[lane];
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) {
        const u64 n = __shfl_xor_sync(0xffffffffu, v, o);
        v = n > v ? n : v;
    }
    __syncthreads();
    return v;
}

// ---- radix select ----------------------------------------------------------------------------------
//
// Finds the largest key t with W(t) >= need, W(t) the count (top-k) or weight (top-p) of the
// tokens with key >= t (and key >= floor), one digit per level from the top.

__device__ __forceinline__ u32 level_shift(int level) { return level == 0 ? 21u : level == 1 ? 10u : 0u; }
__device__ __forceinline__ u32 level_bins(int level) { return level == 2 ? 1024u : 2048u; }
// Bits of the key the earlier levels fixed.
__device__ __forceinline__ u32 level_mask(int level) {
    return level == 0 ? 0u : level == 1 ? 0xffe00000u : 0xfffffc00u;
}

struct Select {
    u32 prefix;  // the digits chosen so far, in place
    u64 above;   // W of the tokens whose key's prefix is larger
    u64 need;
};

__device__ __forceinline__ void clear_histogram(Shared& s) {
    for (u32 b = threadIdx.x; b < kBins; b += kThreads) s.h.weight[b] = 0;
    __syncthreads();
}

// The histogram of `level` over the tokens `each` yields that match the prefix (and key >=
// floor). MASS: weights, else counts.
template <bool MASS, class Each>
__device__ __forceinline__ void histogram(Shared& s, int level, const Select& sel, u32 floor, u32 max_key,
                                          float max, Each&& each) {
    clear_histogram(s);
    const u32 mask = level_mask(level), shift = level_shift(level), bins = level_bins(level);
    each([&](u32 key, u32) {
        if (key >= floor && (key & mask) == sel.prefix) {
            const u32 d = (key >> shift) & (bins - 1);
            if (MASS) {
                const u64 w = weight_of(key, max_key, max);
                if (w) atomicAdd(reinterpret_cast<unsigned long long*>(&s.h.weight[d]), w);
            } else {
                atomicAdd(&s.h.count[d], 1u);
            }
        }
    });
    __syncthreads();
}

// Picks the digit of `level` from its histogram: the largest d with above + sum_{b >= d} h[b]
// >= need, where need is sel.need, or at the first top-p level ceil(top_p * total) (the
// histogram's total is the kept weight). Thread t looks at bins 2t and 2t + 1 counted from the
// top. Returns W at the chosen digit (above + h[d]).
template <bool MASS>
__device__ u64 choose(Shared& s, int level, Select& sel, bool need_from_total, float top_p) {
    const u32 bins = level_bins(level);
    const u32 r0 = 2 * threadIdx.x, r1 = r0 + 1;
    const u64 w0 = r0 < bins ? (MASS ? s.h.weight[bins - 1 - r0] : u64(s.h.count[bins - 1 - r0])) : 0;
    const u64 w1 = r1 < bins ? (MASS ? s.h.weight[bins - 1 - r1] : u64(s.h.count[bins - 1 - r1])) : 0;
    if (threadIdx.x == 0) {
        s.val[0] = 0;
        s.val[1] = sel.above;
        s.val[2] = sel.above;
    }
    u64 total;
    const u64 incl = block_scan(w0 + w1, s, total);
    const u64 need = need_from_total ? ceil_mul(top_p, sel.above + total) : sel.need;
    const u64 a0 = sel.above + incl - w0 - w1, a1 = a0 + w0, a2 = a1 + w1;
    if (a0 < need && a1 >= need) {
        s.val[0] = bins - 1 - r0;
        s.val[1] = a0;
        s.val[2] = a1;
    } else if (a1 < need && a2 >= need) {
        s.val[0] = bins - 1 - r1;
        s.val[1] = a1;
        s.val[2] = a2;
    }
    __syncthreads();
    const u32 d = u32(s.val[0]);
    sel.above = s.val[1];
    const u64 at = s.val[2];
    __syncthreads();
    sel.need = need;
    sel.prefix |= d << level_shift(level);
    return at;
}

// Levels `from`..2 over the tokens `each` yields.
template <bool MASS, class Each>
__device__ __forceinline__ void refine(Shared& s, int from, Select& sel, u32 floor, u32 max_key, float max,
                                       Each&& each) {
    for (int level = from; level < 3; ++level) {
        histogram<MASS>(s, level, sel, floor, max_key, max, each);
        choose<MASS>(s, level, sel, false, 0.f);
    }
}

// Gathers the tokens with key >= lo into the list; false (list unusable) when more than
// kListCap qualify.
template <class Each>
__device__ __forceinline__ bool gather(Shared& s, u32 lo, Each&& each) {
    if (threadIdx.x == 0) s.n_list = 0;
    __syncthreads();
    each([&](u32 key, u32 i) {
        if (key >= lo) {
            const u32 j = atomicAdd(&s.n_list, 1u);
            if (j < kListCap) {
                s.list_key[j] = key;
                s.list_idx[j] = i;
            }
        }
    });
    __syncthreads();
    return s.n_list <= kListCap;
}

// ---- one row ------------------------------------------------------------------------------------------

template <class D>
__device__ __forceinline__ u32 greedy_row(const Row& r, Shared& s) {
    const u32 beg = min(threadIdx.x * r.chunk, r.vocab), end = min(beg + r.chunk, r.vocab);
    // Largest key, then lowest index: (key << 32) | ~index.
    u64 best = 0;
    each_logit<D>(r, beg, end, [&](u32 i, float l) {
        const u64 c = (u64(key_of(__fadd_rn(l, 0.f))) << 32) | u32(~i);
        best = c > best ? c : best;
    });
    return ~u32(block_max(best, s));
}

template <class D>
__device__ __forceinline__ u32 sample_row(const RowSample& p, const Row& r, Shared& s, u32 ctr) {
    const float t = p.temperature;
    const u32 beg = min(threadIdx.x * r.chunk, r.vocab), end = min(beg + r.chunk, r.vocab);
    const bool top_k = p.top_k > 0 && p.top_k < r.vocab;
    const bool top_p = p.top_p < 1.f;
    auto row_keys = [&](auto&& f) { each_logit<D>(r, beg, end, [&](u32 i, float l) { f(scaled_key(l, t), i); }); };
    auto list_keys = [&](auto&& f) {
        const u32 n = s.n_list;
        for (u32 j = threadIdx.x; j < n; j += kThreads) f(s.list_key[j], s.list_idx[j]);
    };

    // Pass 1: the largest l' (and its lowest index, the fallback); the first top-k digit.
    if (top_k) clear_histogram(s);
    u64 best = 0;
    row_keys([&](u32 key, u32 i) {
        const u64 c = (u64(key) << 32) | u32(~i);
        best = c > best ? c : best;
        if (top_k) atomicAdd(&s.h.count[key >> 21], 1u);
    });
    best = block_max(best, s);
    const u32 max_key = u32(best >> 32), argmax = ~u32(best);
    const float max = value_of(max_key);

    u32 floor = 0;  // the top-k threshold's key (0: everything kept)
    bool listed = false;
    if (top_k) {
        Select sel = {0, 0, p.top_k};
        const u64 at = choose<false>(s, 0, sel, false, 0.f);
        if (at <= kListCap) listed = gather(s, sel.prefix, row_keys);
        if (listed) refine<false>(s, 1, sel, 0, max_key, max, list_keys);
        else refine<false>(s, 1, sel, 0, max_key, max, row_keys);
        floor = sel.prefix;
    }
    u32 thr = floor;
    if (top_p) {
        Select sel = {0, 0, 0};
        if (listed) histogram<true>(s, 0, sel, floor, max_key, max, list_keys);
        else histogram<true>(s, 0, sel, floor, max_key, max, row_keys);
        choose<true>(s, 0, sel, true, p.top_p);
        if (!listed) listed = gather(s, sel.prefix > floor ? sel.prefix : floor, row_keys);
        if (listed) refine<true>(s, 1, sel, floor, max_key, max, list_keys);
        else refine<true>(s, 1, sel, floor, max_key, max, row_keys);
        thr = sel.prefix;
    }

    // The draw: weight per thread chunk, the chunk holding the target, then the token in it.
    u64 mine = 0;
    if (listed) {
        s.h.chunk[threadIdx.x] = 0;
        __syncthreads();
        list_keys([&](u32 key, u32 i) {
            if (key >= thr) {
                const u64 w = weight_of(key, max_key, max);
                if (w) atomicAdd(reinterpret_cast<unsigned long long*>(&s.h.chunk[i / r.chunk]), w);
            }
        });
        __syncthreads();
        mine = s.h.chunk[threadIdx.x];
    } else {
        row_keys([&](u32 key, u32) {
            if (key >= thr) mine += weight_of(key, max_key, max);
        });
    }
    if (threadIdx.x == 0) {
        s.val[0] = kNone;
        s.val[1] = 0;
        s.val[2] = argmax;
    }
    u64 total;
    const u64 incl = block_scan(mine, s, total);
    const u64 target = target_of(uniform_bits(p.seed, ctr, p.stream), total);
    if (mine > 0 && incl - mine <= target && target < incl) {
        s.val[0] = threadIdx.x;
        s.val[1] = target - (incl - mine);
    }
    __syncthreads();
    const u32 owner = u32(s.val[0]);
    const u64 rest = s.val[1];
    if (owner < kThreads && threadIdx.x < 32) {
        constexpr u32 V = D::kVec;
        const u32 lane = threadIdx.x;
        const u32 cb = owner * r.chunk, ce = min(cb + r.chunk, r.vocab);
        const u32 sub = ((r.chunk + 31) / 32 + V - 1) / V * V;
        const u32 lb = min(cb + lane * sub, ce), le = min(lb + sub, ce);
        u64 lw = 0;
        each_logit<D>(r, lb, le, [&](u32, float l) {
            const u32 key = scaled_key(l, t);
            if (key >= thr) lw += weight_of(key, max_key, max);
        });
        u64 li = lw;
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            const u64 n = __shfl_up_sync(0xffffffffu, li, o);
            if (lane >= o) li += n;
        }
        if (lw > 0 && li - lw <= rest && rest < li) {
            u64 acc = li - lw;
            u32 found = kNone;
            each_logit<D>(r, lb, le, [&](u32 i, float l) {
                if (found != kNone) return;
                const u32 key = scaled_key(l, t);
                if (key >= thr) {
                    acc += weight_of(key, max_key, max);
                    if (acc > rest) found = i;
                }
            });
            if (found != kNone) s.val[2] = found;
        }
    }
    __syncthreads();
    return u32(s.val[2]);
}

// Row `row`'s lane and settings (the launch's, with stream = row, where no lane has its own).
__device__ __forceinline__ RowSample row_settings(const SampleParams& p, u32 row, u32& lane) {
    lane = p.lane_of ? p.lane_of[row] : row;
    if (p.row_cfg) return p.row_cfg[lane];
    return RowSample{p.seed, p.temperature, p.top_k, p.top_p, p.repetition_penalty, row, ROW_ACTIVE};
}

template <class D>
__device__ __forceinline__ void sample_kernel(const SampleParams& p) {
    __shared__ Shared s;
    const u32 words = (p.vocab + 31) / 32;
    const u32 chunk = ((p.vocab + kThreads - 1) / kThreads + D::kVec - 1) / D::kVec * D::kVec;
    if (p.vocab == 0) return;
    for (u32 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        u32 lane;
        const RowSample cfg = row_settings(p, row, lane);
        // A lane with no active sequence (a step's padding rows): nothing drawn, nothing written
        // (its presence words may be a prompt's, waiting for its prefill).
        if (!(cfg.flags & ROW_ACTIVE)) continue;
        const bool penalty = p.presence != nullptr && cfg.repetition_penalty != 1.f;
        Row r;
        r.logits = static_cast<const char*>(p.logits) + u64(row) * p.row_stride * D::kBytes;
        r.pres = penalty ? p.presence + u64(lane) * words : nullptr;
        r.penalty = cfg.repetition_penalty;
        r.vocab = p.vocab;
        r.chunk = chunk;
        r.vec = (reinterpret_cast<unsigned long long>(r.logits) & 15u) == 0;
        // Read by every thread before any writes it (thread 0, after the row's barriers).
        const u32 ctr = p.pos ? p.pos[lane] : 0u;
        const u32 id = cfg.temperature > 0.f ? sample_row<D>(cfg, r, s, ctr) : greedy_row<D>(r, s);
        if (threadIdx.x == 0) {
            p.ids_out[lane] = id;
            if (p.presence) atomicOr(p.presence + u64(lane) * words + (id >> 5), 1u << (id & 31));
            if (p.pos) p.pos[lane] = ctr + 1;
        }
        __syncthreads();
    }
}

// Sum over the block, returned to every thread.
__device__ __forceinline__ float block_sum(float v, Shared& s) {
    const u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s.warp[w] = __float_as_uint(v);
    __syncthreads();
    v = __uint_as_float(u32(s.warp[lane]));
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// Log-probabilities of one row (see the file's head): max, then the sum of exp(l - max) in f32,
// then the top tokens one block argmax at a time, each below the one before in (logit, lower
// index) order.
template <class D>
__device__ __forceinline__ void logprobs_kernel(const LogprobParams& p) {
    __shared__ Shared s;
    const u32 chunk = ((p.vocab + kThreads - 1) / kThreads + D::kVec - 1) / D::kVec * D::kVec;
    if (p.vocab == 0) return;
    for (u32 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const u32 lane = p.lane_of ? p.lane_of[row] : row;
        const u32 flags = p.row_cfg[lane].flags;
        const u32 top = min(flags >> 8 & 0xffu, kMaxTopLogprobs);
        if (!(flags & ROW_LOGPROB)) continue;  // the same for every thread: no barrier skipped
        Row r;
        r.logits = static_cast<const char*>(p.logits) + u64(row) * p.row_stride * D::kBytes;
        r.pres = nullptr;
        r.penalty = 1.f;
        r.vocab = p.vocab;
        r.chunk = chunk;
        r.vec = (reinterpret_cast<unsigned long long>(r.logits) & 15u) == 0;
        const u32 beg = min(threadIdx.x * chunk, p.vocab), end = min(beg + chunk, p.vocab);
        u64 best = 0;
        each_logit<D>(r, beg, end, [&](u32 i, float l) {
            const u64 c = (u64(key_of(__fadd_rn(l, 0.f))) << 32) | u32(~i);
            best = c > best ? c : best;
        });
        best = block_max(best, s);
        const float mx = value_of(u32(best >> 32));
        float sum = 0.f;
        each_logit<D>(r, beg, end, [&](u32, float l) { sum += __expf(l - mx); });
        sum = block_sum(sum, s);
        const float lse = mx + __logf(sum);
        float* out = p.out + u64(row) * (1 + kMaxTopLogprobs) * 2;
        if (threadIdx.x == 0) {
            const u32 id = p.ids[lane];
            out[0] = __uint_as_float(id);
            out[1] = (id < p.vocab ? clean(D::load(r.logits, id)) : __uint_as_float(0xff800000u)) - lse;
        }
        u64 prev = ~0ull;
        for (u32 j = 0; j < top; ++j) {
            u64 c = best;
            if (j > 0) {
                c = 0;
                each_logit<D>(r, beg, end, [&](u32 i, float l) {
                    const u64 k = (u64(key_of(__fadd_rn(l, 0.f))) << 32) | u32(~i);
                    if (k < prev && k > c) c = k;
                });
                c = block_max(c, s);
            }
            prev = c;
            if (threadIdx.x == 0) {
                out[2 + 2 * j] = __uint_as_float(~u32(c));
                out[3 + 2 * j] = value_of(u32(c >> 32)) - lse;
            }
        }
        __syncthreads();
    }
}

}  // namespace stoke_sample

// ---- entry points --------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(1024, 1) sample_f32(const SampleParams p) {
    stoke_sample::sample_kernel<stoke_sample::F32>(p);
}

extern "C" __global__ void __launch_bounds__(1024, 1) sample_bf16(const SampleParams p) {
    stoke_sample::sample_kernel<stoke_sample::BF16>(p);
}

extern "C" __global__ void __launch_bounds__(1024, 1) logprobs_f32(const LogprobParams p) {
    stoke_sample::logprobs_kernel<stoke_sample::F32>(p);
}

extern "C" __global__ void __launch_bounds__(1024, 1) logprobs_bf16(const LogprobParams p) {
    stoke_sample::logprobs_kernel<stoke_sample::BF16>(p);
}
