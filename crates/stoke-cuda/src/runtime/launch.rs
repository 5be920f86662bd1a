//! Kernel launches: [`Runtime::launch`] and [`Runtime::launch_cluster`], the thread-block
//! cluster rules, the programmatic dependent launch bookkeeping, and
//! [`Runtime::hold_until_done`] for borrowed memory a queued kernel reads.

use super::{Kernel, KernelInfo, Runtime};
use crate::kernels::KernelParams;
use crate::{DriverContext, Error, Result};
use cudarc::driver::{result, sys};
use std::any::Any;
use std::ffi::c_void;

/// Most CTAs in one cluster Stoke launches (the portable cluster size).
pub const MAX_CLUSTER_CTAS: u32 = 8;

/// Whether thread-block clusters of `cluster` CTAs tile `grid`: each dimension a positive
/// divisor of the grid's, and at most 8 CTAs in all (the portable cluster size).
pub fn cluster_tiles_grid(grid: (u32, u32, u32), cluster: (u32, u32, u32)) -> bool {
    let (x, y, z) = cluster;
    let ctas = u128::from(x) * u128::from(y) * u128::from(z);
    (1..=8).contains(&ctas)
        && grid.0.is_multiple_of(x)
        && grid.1.is_multiple_of(y)
        && grid.2.is_multiple_of(z)
}

/// Whether a grid of `grid` CTAs in clusters of `cluster` would not have all its clusters
/// resident at once beside `holding` CTAs of another kernel, each taking the place of one
/// cluster at most, where the GPU holds `most` such clusters at once
/// ([`Runtime::launch_cluster`]'s crowding rule).
pub fn crowded_clusters(
    grid: (u32, u32, u32),
    cluster: (u32, u32, u32),
    holding: u64,
    most: u32,
) -> bool {
    let per_cluster = u64::from(cluster.0) * u64::from(cluster.1) * u64::from(cluster.2);
    let ctas = u64::from(grid.0) * u64::from(grid.1) * u64::from(grid.2);
    ctas / per_cluster.max(1) + holding > u64::from(most)
}

/// The launch attribute that cuts a grid into clusters of `cluster` CTAs.
pub(super) fn cluster_attribute((x, y, z): (u32, u32, u32)) -> sys::CUlaunchAttribute {
    // SAFETY: zero is a valid bit pattern for the attribute (a plain C union).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = x;
    attr.value.clusterDim.y = y;
    attr.value.clusterDim.z = z;
    attr
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// The shape of an RMSNorm launch rule's launch (the rule itself depends on nothing but `std`).
impl From<crate::kernels::rms_norm::Launch> for LaunchShape {
    fn from(l: crate::kernels::rms_norm::Launch) -> Self {
        LaunchShape {
            grid: l.grid,
            block: l.block,
            shared_mem_bytes: l.shared_mem_bytes,
        }
    }
}

impl Runtime {
    /// Launches `kernel` on Stoke's stream with `params` as its single by-value argument.
    ///
    /// # Safety
    /// Every device pointer in `params` must stay valid until the kernel finishes (owned by a [`DeviceBuffer`](super::DeviceBuffer) that
    /// is dropped only on this stream, or held with [`Runtime::hold_until_done`]).
    pub unsafe fn launch<P: KernelParams>(
        &self,
        kernel: &Kernel<P>,
        shape: LaunchShape,
        params: &P,
    ) -> Result<()> {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.launch_cluster(kernel, shape, None, params) }
    }

    /// [`Runtime::launch`] with the grid cut into thread-block clusters of `cluster` CTAs
    /// (each grid dimension a multiple of the cluster's; at most 8 CTAs, the portable size).
    /// `None`: an ordinary launch.
    ///
    /// A kernel with [`KernelInfo::pdl`] is launched programmatically (it may start while the
    /// previous kernel runs), except a clustered launch right after an early-triggering kernel
    /// ([`KernelInfo::early_trigger`]) of c CTAs whose clusters, c more, would not all be resident
    /// at once. Started early, such a grid finds a CTA slot taken on the SMs the previous
    /// kernel's CTAs still hold (one slot per CTA for the RMSNorm kernels at decode sizes:
    /// each uses fewer registers than one GEMM CTA), which costs at most one cluster each; when
    /// those CTAs end, the freed slots are scattered, one or two per processing cluster, too
    /// few for a whole cluster, so the clusters that did not fit wait for the first wave to
    /// finish. Measured
    /// (`results/experiments/h200-rms-gemm-pairs-dd16a4e.json`): 70B qkv at 16 rows, RMSNorm
    /// then the GEMM (3 splits in clusters of 3), 28.2 us programmatically against 21.3 us in
    /// stream order.
    ///
    /// # Safety
    /// As [`Runtime::launch`]; with a cluster, the kernel must be written for one.
    pub unsafe fn launch_cluster<P: KernelParams>(
        &self,
        kernel: &Kernel<P>,
        shape: LaunchShape,
        cluster: Option<(u32, u32, u32)>,
        params: &P,
    ) -> Result<()> {
        if self.profiling.load(std::sync::atomic::Ordering::Relaxed) {
            let (start, end) = (self.timing_event()?, self.timing_event()?);
            self.record(&start)?;
            // SAFETY: the caller's guarantees.
            unsafe { self.launch_now(kernel, shape, cluster, params) }?;
            self.record(&end)?;
            if let Some(p) = self.profile.lock().unwrap().as_mut() {
                p.push((kernel.entry, start, end));
            }
            return Ok(());
        }
        // SAFETY: the caller's guarantees.
        unsafe { self.launch_now(kernel, shape, cluster, params) }
    }

    /// [`Runtime::launch_cluster`] without the profiling hook.
    unsafe fn launch_now<P: KernelParams>(
        &self,
        kernel: &Kernel<P>,
        shape: LaunchShape,
        cluster: Option<(u32, u32, u32)>,
        params: &P,
    ) -> Result<()> {
        self.bind()?;
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        if let Some((x, y, z)) = cluster
            && !cluster_tiles_grid(shape.grid, (x, y, z))
        {
            return Err(Error::Shape(crate::ShapeError::new(
                format!("{} cluster", kernel.entry),
                "at most 8 CTAs per cluster, tiling the grid",
                format!("cluster ({x}, {y}, {z}) over grid {:?}", shape.grid),
            )));
        }
        let ctas = u64::from(shape.grid.0) * u64::from(shape.grid.1) * u64::from(shape.grid.2);
        let before = self.after_early_trigger.swap(
            if kernel.early_trigger { ctas } else { 0 },
            std::sync::atomic::Ordering::Relaxed,
        );
        let programmatic = kernel.pdl
            && !(before > 0
                && match cluster {
                    Some(c) => self.crowded(kernel, shape, c, before)?,
                    None => false,
                });
        if kernel.pdl && !programmatic {
            self.pdl_held
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if programmatic || cluster.is_some() {
            // SAFETY: zero is a valid bit pattern for the attributes (plain C unions).
            let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if programmatic {
                attrs[n].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if let Some(c) = cluster {
                attrs[n] = cluster_attribute(c);
                n += 1;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: shape.grid.0,
                gridDimY: shape.grid.1,
                gridDimZ: shape.grid.2,
                blockDimX: shape.block.0,
                blockDimY: shape.block.1,
                blockDimZ: shape.block.2,
                sharedMemBytes: shape.shared_mem_bytes,
                hStream: self.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            // SAFETY: as below; the kernel waits for the previous one before it touches what
            // that one writes (Kernel::pdl), a clustered kernel is written for its cluster (the
            // caller), and the config and attributes outlive the call.
            return unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    kernel.func.cu_function(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .call("cuLaunchKernelEx");
        }
        // SAFETY: the caller guarantees the parameter layout and pointer lifetimes; the driver
        // copies the argument block before returning.
        unsafe {
            result::launch_kernel(
                kernel.func.cu_function(),
                shape.grid,
                shape.block,
                shape.shared_mem_bytes,
                self.cu_stream(),
                &mut args,
            )
        }
        .call("cuLaunchKernel")?;
        Ok(())
    }

    /// Whether a launch of `kernel` in `shape` as clusters of `cluster` would not have all its
    /// clusters resident at once beside `holding` CTAs of another kernel (each taking the place
    /// of one cluster at most).
    fn crowded(
        &self,
        kernel: &KernelInfo,
        shape: LaunchShape,
        cluster: (u32, u32, u32),
        holding: u64,
    ) -> Result<bool> {
        let most = self.max_active_clusters(kernel, shape.block.0, cluster)?;
        Ok(crowded_clusters(shape.grid, cluster, holding, most))
    }

    /// Keeps `keep` (e.g. a burn-cuda buffer pin) alive until everything queued on Stoke's
    /// stream so far has finished. Completed entries are dropped on later calls.
    pub fn hold_until_done(&self, keep: Box<dyn Any + Send>) -> Result<()> {
        let event = self.ctx.new_event(None).call("cuEventCreate")?;
        event.record(&self.stream).call("cuEventRecord")?;
        let mut list = self.in_flight.lock().unwrap();
        while list.front().is_some_and(|(e, _)| e.is_complete()) {
            list.pop_front();
        }
        list.push_back((event, keep));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{cluster_tiles_grid, crowded_clusters};

    #[test]
    fn crowding_counts_one_cluster_place_per_holding_cta() {
        // 160 clusters of 3 (70B qkv at 16 rows, 3 splits): with 16 norm CTAs beside them
        // they need 176 places.
        assert!(crowded_clusters((160, 3, 1), (1, 3, 1), 16, 175));
        assert!(!crowded_clusters((160, 3, 1), (1, 3, 1), 16, 176));
        // Nothing holding: crowded only past what fits at all.
        assert!(!crowded_clusters((96, 4, 1), (1, 4, 1), 0, 96));
        assert!(crowded_clusters((96, 4, 1), (1, 4, 1), 0, 95));
        // One norm CTA beside 96 clusters of 4 where 120 fit.
        assert!(!crowded_clusters((96, 4, 1), (1, 4, 1), 1, 120));
    }

    #[test]
    fn clusters_must_tile_the_grid() {
        assert!(cluster_tiles_grid((96, 4, 1), (1, 4, 1)));
        assert!(cluster_tiles_grid((160, 3, 1), (1, 3, 1)));
        assert!(cluster_tiles_grid((64, 8, 1), (1, 8, 1)));
        assert!(
            !cluster_tiles_grid((64, 6, 1), (1, 4, 1)),
            "6 splits in clusters of 4"
        );
        assert!(
            !cluster_tiles_grid((64, 16, 1), (1, 16, 1)),
            "past the portable size"
        );
        assert!(
            !cluster_tiles_grid((64, 4, 1), (0, 4, 1)),
            "an empty dimension"
        );
        assert!(
            !cluster_tiles_grid((64, 4, 1), (u32::MAX, u32::MAX, 2)),
            "no overflow"
        );
    }
}
