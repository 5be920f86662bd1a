// The E4M3 rows the FP8 prefill GEMM reads: one CTA per row of a bf16 matrix, two passes over
// the row (the second from L1/L2).
//
//   quantize_rows_e4m3_bf16:  codes = e4m3(x * (448 / amax(x))), scale = amax(x) / 448
//   with p.normalize:         the row is RMSNorm's input; the normalized row x * r
//                             (r = rsqrt(mean(x^2) + eps), the gain folded into the weights
//                             that read it) has the same codes, since the per-row scale cancels
//                             r, and scale = amax(x) r / 448. So no normalized row is written.
//
//   with p.gain:              the row is multiplied by the bf16 gain [k] first (f32 products;
//                             the INT4-weight GEMM, whose weights cannot carry RMSNorm's gain):
//                             codes = e4m3(x g * (448 / amax(x g))), scale = amax(x g) r / 448
//   with p.order = 1:         the codes of each 16 consecutive k are stored interleaved, k at
//                             2 (k % 8) + (k % 16) / 8, the order of the INT4 words' nibbles
//                             (fp8_gemm.cu, "INT4 weights"); needs k a multiple of 32
//   with p.sums:              sums[row, k / 32] = the sum of each 32 consecutive codes' values
//                             (exact in f32), for INT4 weights with offsets
//   with p.amax:              the largest |x| over all rows also goes to *p.amax (f32 bits,
//                             atomicMax): a delayed scale's first invocation, which runs per row
//                             and starts the amax history (fp8_delayed_record)
//
//   fp8_delayed_record:       one invocation of a delayed per-tensor scale
//                             (stoke_formats::fp8::DelayedScale::record, then ::scale): hands the
//                             scale the invocation used to *used, pushes the amax and saturation
//                             count the GEMM's SwiGLU epilogue (or quantize_rows) gathered into the
//                             history, resets them and writes the next invocation's scale
//   dequantize_rows_e4m3_bf16: bf16(e4m3(code) * scale) of rows with one scale per row or one for
//                             all (E4M3 rows read by something other than the FP8 GEMM)
//
// An all-zero row gets zero codes and scale 1 (stoke_formats::fp8::scale_for). The codes are
// bit-exact against stoke_formats::fp8::quantize_rows_fused (the same f32 operations, rounded
// to nearest even, saturating); the scale's sum of squares is summed in another order.
// Needs x (and the gain) 16-byte aligned, k a multiple of 8 and the row pitch ldx (elements) a
// multiple of 8.

#include "ptx.cuh"

constexpr int THREADS = 256;

struct Fp8RowsParams {
    const u16* x;    // [rows, ldx] bf16
    u8* codes;       // [rows, k] E4M3
    float* scales;   // [rows]
    u32* amax;       // [1] max |x| as f32 bits (atomicMax), or null
    const u16* gain; // [k] bf16, or null
    float* sums;     // [rows, k / 32], or null
    u32 rows, k, ldx;
    float eps;
    u32 normalize;   // 1: the scale carries RMSNorm's row factor
    u32 order;       // 1: each 16 k interleaved (see above)
};
static_assert(sizeof(Fp8RowsParams) == 72, "Fp8RowsParams layout");

// E4M3 (no infinities; 0x7f/0xff NaN) to f32, exactly.
__device__ __forceinline__ float e4m3_to_f32(u32 c) {
    const u32 e = (c >> 3) & 15, m = c & 7;
    float v;
    if (e == 15 && m == 7) v = __int_as_float(0x7fc00000);
    else if (e == 0) v = float(m) * 0.001953125f;  // m 2^-9
    else v = __uint_as_float(((e + 120) << 23) | (m << 20));
    return (c & 0x80) ? -v : v;
}

// Eight bf16 values as f32.
__device__ __forceinline__ void unpack8(uint4 a, float (&v)[8]) {
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = bf16_lo(w[j]);
        v[2 * j + 1] = bf16_hi(w[j]);
    }
}

// v times the gain's eight values from i, with one.
__device__ __forceinline__ void apply_gain(const Fp8RowsParams& p, u32 i, float (&v)[8]) {
    if (p.gain == nullptr) return;
    float g[8];
    unpack8(*reinterpret_cast<const uint4*>(p.gain + i), g);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(v[j], g[j]);
}

// Eight values of the row from i (times the gain with one).
__device__ __forceinline__ void load8(const Fp8RowsParams& p, const u16* x, u32 i, float (&v)[8]) {
    unpack8(*reinterpret_cast<const uint4*>(x + i), v);
    apply_gain(p, i, v);
}

extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_e4m3_bf16(const Fp8RowsParams p) {
    __shared__ float red[2][THREADS / 32];
    for (u32 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const u16* x = p.x + u64(row) * p.ldx;
        float amax = 0.0f, ss = 0.0f;
        for (u32 i = threadIdx.x * 8; i < p.k; i += THREADS * 8) {
            // One load: the norm's sum of squares takes the values, the codes' amax the
            // values times the gain.
            float v[8];
            unpack8(*reinterpret_cast<const uint4*>(x + i), v);
#pragma unroll
            for (int j = 0; j < 4; ++j) ss = fmaf(v[2 * j], v[2 * j], fmaf(v[2 * j + 1], v[2 * j + 1], ss));
            apply_gain(p, i, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        }
        if (threadIdx.x % 32 == 0) {
            red[0][threadIdx.x / 32] = amax;
            red[1][threadIdx.x / 32] = ss;
        }
        __syncthreads();
        amax = 0.0f;
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) {
            amax = fmaxf(amax, red[0][w]);
            ss += red[1][w];
        }
        __syncthreads();  // red is reused by the next row
        if (p.amax != nullptr && threadIdx.x == 0) atomicMax(p.amax, __float_as_uint(amax));
        const float inv = amax > 0.0f ? __fdiv_rn(448.0f, amax) : 1.0f;
        if (threadIdx.x == 0) {
            const float r = p.normalize ? rsqrtf(ss / float(p.k) + p.eps) : 1.0f;
            p.scales[row] = amax > 0.0f ? amax * r / 448.0f : 1.0f;
        }
        u8* out = p.codes + u64(row) * p.k;
        if (p.order == 0) {
            for (u32 i = threadIdx.x * 8; i < p.k; i += THREADS * 8) {
                float v[8];
                load8(p, x, i, v);
                u32 c[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const u32 lo = e4m3x2(__fmul_rn(v[4 * j], inv), __fmul_rn(v[4 * j + 1], inv));
                    const u32 hi = e4m3x2(__fmul_rn(v[4 * j + 2], inv), __fmul_rn(v[4 * j + 3], inv));
                    c[j] = lo | (hi << 16);
                }
                *reinterpret_cast<uint2*>(out + i) = make_uint2(c[0], c[1]);
            }
            continue;
        }
        // Interleaved: 32 k per thread, two 16-k blocks; bytes 2 r, 2 r + 1 of a block are
        // k r and r + 8.
        for (u32 i = threadIdx.x * 32; i < p.k; i += THREADS * 32) {
            float sum = 0.0f;
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                float lo[8], hi[8];
                load8(p, x, i + 16 * b, lo);
                load8(p, x, i + 16 * b + 8, hi);
                u32 c[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 c0 = e4m3x2(__fmul_rn(lo[2 * j], inv), __fmul_rn(hi[2 * j], inv));
                    const u32 c1 = e4m3x2(__fmul_rn(lo[2 * j + 1], inv), __fmul_rn(hi[2 * j + 1], inv));
                    c[j] = c0 | (c1 << 16);
#pragma unroll
                    for (int e = 0; e < 4; ++e) sum += e4m3_to_f32((c[j] >> (8 * e)) & 0xff);
                }
                *reinterpret_cast<uint4*>(out + i + 16 * b) = make_uint4(c[0], c[1], c[2], c[3]);
            }
            if (p.sums != nullptr) p.sums[u64(row) * (p.k / 32) + i / 32] = sum;
        }
    }
}

// The device copy of stoke_formats::fp8::DelayedScale (HISTORY slots).
constexpr u32 HISTORY = 16;
struct Fp8DelayedState {
    float history[HISTORY];
    float scale;          // the scale the next invocation quantizes with
    u32 amax;             // this invocation's max |h| (f32 bits, atomicMax; 0 between invocations)
    u32 saturated;        // this invocation's saturated values (atomicAdd; 0 between invocations)
    u32 filled, next;     // history slots holding values; the slot the next amax goes to
    float initial_amax;   // the amax the scale follows while the history is empty
    float margin;         // the scale maps amax * margin onto 448
    u32 pad;
    u64 saturated_total;  // over every invocation
    u64 invocations;
};
static_assert(sizeof(Fp8DelayedState) == 112, "Fp8DelayedState layout");

struct Fp8RecordParams {
    Fp8DelayedState* state;
    float* used;          // [1] the scale this invocation used, or null
};
static_assert(sizeof(Fp8RecordParams) == 16, "Fp8RecordParams layout");

// stoke_formats::fp8::scale_for, the same f32 operations.
__device__ __forceinline__ float scale_for(float amax) {
    return amax > 0.0f && amax < __int_as_float(0x7f800000) ? __fdiv_rn(amax, 448.0f) : 1.0f;
}

extern "C" __global__ void __launch_bounds__(32) fp8_delayed_record(const Fp8RecordParams p) {
    if (threadIdx.x != 0) return;
    Fp8DelayedState& s = *p.state;
    if (p.used != nullptr) *p.used = s.scale;
    const float amax = __uint_as_float(s.amax);
    s.invocations += 1;
    s.saturated_total += s.saturated;
    if (amax > 0.0f && amax < __int_as_float(0x7f800000)) {
        s.history[s.next] = amax;
        s.next = (s.next + 1) % HISTORY;
        s.filled = min(s.filled + 1, HISTORY);
    }
    float m = s.initial_amax;
    if (s.filled > 0) {
        m = 0.0f;
        for (u32 i = 0; i < s.filled; ++i) m = fmaxf(m, s.history[i]);
    }
    s.scale = scale_for(__fmul_rn(m, s.margin));
    s.amax = 0;
    s.saturated = 0;
}

struct Fp8DequantParams {
    const u8* codes;      // [rows, k] E4M3
    const float* scales;  // [rows], or [1] with scale_stride 0
    u16* out;             // [rows, k] bf16
    u32 rows, k;
    u32 scale_stride;     // 1: one scale per row; 0: one for all
    u32 pad;
};
static_assert(sizeof(Fp8DequantParams) == 40, "Fp8DequantParams layout");

extern "C" __global__ void __launch_bounds__(THREADS) dequantize_rows_e4m3_bf16(const Fp8DequantParams p) {
    const u64 groups = u64(p.rows) * (p.k / 8);
    for (u64 g = u64(blockIdx.x) * THREADS + threadIdx.x; g < groups; g += u64(gridDim.x) * THREADS) {
        const u64 row = g / (p.k / 8);
        const float s = p.scales[row * p.scale_stride];
        const uint2 c = *reinterpret_cast<const uint2*>(p.codes + g * 8);
        const u32 w[2] = {c.x, c.y};
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 b = w[j / 2] >> (16 * (j % 2));
            o[j] = pack_bf16x2(__fmul_rn(e4m3_to_f32(b & 0xff), s), __fmul_rn(e4m3_to_f32((b >> 8) & 0xff), s));
        }
        *reinterpret_cast<uint4*>(p.out + g * 8) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
