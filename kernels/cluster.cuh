// Thread-block cluster helpers shared by the kernel files that merge through distributed shared
// memory. They include this file after their integer typedefs; the runtime writes its text in
// place of that line before NVRTC compiles (kernels::expand_includes). Without a cluster launch
// a CTA is its own cluster of one.

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
