// Named wrappers of the PTX instructions Stoke's kernels use, shared by every kernel file. A
// kernel file includes this header first; the runtime writes its text in place of the
// include line before NVRTC compiles (kernels::expand_includes), so no CUDA header and no
// include path is needed: bf16 and f16 values are raw 16-bit patterns converted with PTX.
//
// Each wrapper is one instruction (or a fixed short sequence) with the exact qualifiers, the
// `volatile` and the memory clobber the kernels were tuned with: changing one changes the
// schedule ptxas produces for every kernel that uses it.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- conversions ------------------------------------------------------------------------------

// The low / high bf16 of a packed pair as f32.
__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round (lo, hi) to bf16, packed with lo at the lower address (one F2FP; NaN stays NaN).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The same to f16 (F16) or bf16.
template <bool F16>
__device__ __forceinline__ u32 pack_x2(float lo, float hi) {
    u32 r;
    if (F16)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two E4M3 codes (nearest, ties to even, saturating to +-448; NaN stays NaN) of (lo, hi), lo
// in the low byte.
__device__ __forceinline__ u16 e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- global memory ----------------------------------------------------------------------------

// 16 bytes read once: no L1 allocation, the L2 policy `policy` (createpolicy; evict-first for
// weights streamed once).
__device__ __forceinline__ uint4 load_stream(const uint4* p, u64 policy) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(policy));
    return r;
}

// Read-only loads through the non-coherent path: only for what no grid writes while this one
// runs (weights, scales). ptxas may move such a load above griddepcontrol.wait, so what an
// earlier kernel on the stream writes is read with load_u32_after_wait.
__device__ __forceinline__ u32 load_u32(const u32* p) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 load_u16(const u16* p) {
    u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// A word the previous kernel on the stream wrote, read by a programmatically launched kernel
// after griddepcontrol.wait: a coherent load through the L2 (.cg), which stays after the wait
// (ptxas hoisted the non-coherent load_u32 above it, so the read could see the buffer before
// the previous kernel wrote it), and no L1 line from before the wait can serve it.
__device__ __forceinline__ u32 load_u32_after_wait(const u32* p) {
    u32 r;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// A float other CTAs wrote (cache at L2 only, so no stale L1 line is read).
__device__ __forceinline__ float load_cg(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// ---- shared memory ----------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void sts32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 r;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr) : "memory");
    return r;
}
__device__ __forceinline__ float2 lds64f(u32 addr) {
    float2 r;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "r"(addr) : "memory");
    return r;
}
__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
    return r;
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The same, each 8x8 matrix transposed (a row-major [k][n] tile as an mma B operand).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// -infinity as an f32 bit pattern (no CUDA header needed).
#define NEG_INF __int_as_float(0xff800000)

// 2^x, ex2.approx (flushes subnormals; 2^-inf = 0).
__device__ __forceinline__ float exp2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// ---- cp.async ---------------------------------------------------------------------------------

// Copies `bytes` (16, or 0: zero fill) from src to shared dst; 16-byte aligned src.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// The same in four 4-byte copies, for a source that is only 4-byte aligned.
__device__ __forceinline__ void cp_async16_by4(u32 dst, const void* src, u32 bytes) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst + 4 * i),
                     "l"(static_cast<const char*>(src) + 4 * i), "r"(bytes / 4) : "memory");
}
// 16 bytes read once, with an L2 policy.
__device__ __forceinline__ void cp_async16_stream(u32 dst, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(policy)
                 : "memory");
}
// 16 bytes with a 128-byte L2 prefetch of the source's line (cache rows read once, in order).
__device__ __forceinline__ void cp_async16_l2pf(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of the calling thread's cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Waits until at most n of the calling thread's cp.async groups are pending (n a constant after
// unrolling; above 3 it waits for 3, which is stricter).
__device__ __forceinline__ void cp_async_wait_n(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
}

// ---- tensor cores -----------------------------------------------------------------------------

// c += a b, m16n8k16, f16 (F16) or bf16 operands, f32 accumulators.
template <bool F16>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The bf16 form with the A fragment as an array.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    mma_m16n8k16<false>(c, a[0], a[1], a[2], a[3], b0, b1);
}


// Shared-memory matrix descriptor of a wgmma operand at shared address `addr`: K-major,
// 128-byte swizzle (the copy engine's layout: 8-row atoms of 128-byte rows, 1024 bytes apart:
// the stride byte offset), leading byte offset unused (1). A k-slice 32 bytes further along
// the rows starts at addr + 32.
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr) {
    return u64((addr & 0x3ffffu) >> 4) | (u64(1) << 16) | (u64(1024 >> 4) << 32) | (u64(1) << 62);
}

// One wgmma.m64n128 of `kind` (the k and operand types), d (+)= A B^T from two shared-memory
// descriptors; `tail` ends the operand list (the immediates the type takes). The 64 f32
// accumulators of a thread are d[0..64].
#define WGMMA_M64N128(kind, tail)                                                                      \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n128" kind " "                                               \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "           \
        "%64, %65, p, " tail ";\n}"                                                                   \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),    \
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),    \
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])     \
        : "l"(a), "l"(b), "r"(scale_d))

// d (+)= A B^T for one k16 slice of bf16: 64 rows of A, 128 of B, both K-major in shared
// memory (the transpose immediates 0).
__device__ __forceinline__ void wgmma_bf16_n128(float (&d)[64], u64 a, u64 b, u32 scale_d) {
    WGMMA_M64N128("k16.f32.bf16.bf16", "1, 1, 0, 0");
}

// Warpgroup MMA ordering: fence before the first wgmma that reads registers written since,
// commit the issued wgmma as a group, wait until at most N groups are pending.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// ---- programmatic dependent launch ------------------------------------------------------------

// Waits until the grids this one depends on have completed and their writes are visible.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel on the stream (if launched for programmatic dependent launch) start
// launching now; its CTAs take SM slots as this grid's exit.
__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---- thread-block clusters --------------------------------------------------------------------
// Without a cluster launch a CTA is its own cluster of one.

__device__ __forceinline__ u32 cluster_ctas() {
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Every thread of every CTA of the cluster: shared-memory writes before it are visible to the
// cluster's reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// E (2 or 4) floats at shared address `addr` (this CTA's layout) of cluster CTA `rank`.
template <int E>
__device__ __forceinline__ void ld_cluster_floats(u32 addr, u32 rank, float (&x)[E]) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    if (E == 4)
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(x[0]), "=f"(x[1 % E]), "=f"(x[2 % E]), "=f"(x[3 % E])
                     : "r"(remote)
                     : "memory");
    else
        asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(x[0]), "=f"(x[E - 1]) : "r"(remote) : "memory");
}
// Two floats at shared address `addr` (this CTA's layout) of cluster CTA `rank`, as a float2:
// the W4A16 split-K reduction's form (ld_cluster_floats<2> there issues the same two
// instructions but changes the surrounding register allocation and schedule).
__device__ __forceinline__ float2 ld_cluster_f2(u32 addr, u32 rank) {
    float2 v;
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
    return v;
}

// ---- mbarriers and the copy engine (TMA) ------------------------------------------------------

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` more of the copy engine's transfers.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// One plain arrival.
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// A tensor map (CUtensorMap) the runtime encodes, passed as a __grid_constant__ parameter.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// The copy engine's copy of the box at (0, 0, block) of the 3-D `map` to shared `dst`,
// completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, u32 block, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(0), "r"(0), "r"(block), "r"(bar)
        : "memory");
}

// The copy engine's copy of the 2-D box at (x, y) of `map` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, u32 x, u32 y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
