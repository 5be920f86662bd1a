//! Occupancy and the copy engine: resident CTAs and clusters of a kernel, tensor maps
//! ([`TensorMap`]) and the device's L2 size, which the launch plans size their grids by.

use super::launch::cluster_attribute;
use super::{KernelInfo, MAX_CLUSTER_CTAS, Runtime};
use crate::{DriverContext, Error, Result};
use cudarc::driver::sys;

/// A tensor map for the copy engine (the driver's opaque 128-byte `CUtensorMap`), passed to
/// kernels by value (`__grid_constant__`), 64-byte aligned as the kernels declare it.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(pub [u64; 16]);

impl Runtime {
    /// Resident CTAs per SM of `kernel` launched with `block_threads` threads and its dynamic
    /// shared memory (`Kernel::dyn_smem`): the occupancy calculator over its registers, shared
    /// memory and launch bounds (cached). Launch plans size their grids by it.
    pub fn resident_ctas(&self, kernel: &KernelInfo, block_threads: u32) -> Result<u32> {
        let key = (kernel.entry, block_threads);
        if let Some(n) = self.occupancy.lock().unwrap().get(&key) {
            return Ok(*n);
        }
        self.bind()?;
        let n = kernel
            .func
            .occupancy_max_active_blocks_per_multiprocessor(
                block_threads,
                kernel.dyn_smem as usize,
                None,
            )
            .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?
            .max(1);
        self.occupancy.lock().unwrap().insert(key, n);
        Ok(n)
    }

    /// Whether `count` clusters of `cluster` CTAs of `kernel` (`block_threads` threads each)
    /// can all be resident at once ([`Runtime::max_active_clusters`]). Never for a kernel not
    /// built for clusters (`Kernel::cluster`) or a cluster of fewer than 2 or more than
    /// [`MAX_CLUSTER_CTAS`] CTAs (the driver is not asked then).
    pub fn clusters_fit(
        &self,
        kernel: &KernelInfo,
        block_threads: u32,
        cluster: (u32, u32, u32),
        count: u64,
    ) -> Result<bool> {
        let ctas = cluster.0 * cluster.1 * cluster.2;
        if !kernel.cluster || !(2..=MAX_CLUSTER_CTAS).contains(&ctas) {
            return Ok(false);
        }
        let resident = self.max_active_clusters(kernel, block_threads, cluster)?;
        Ok(count <= u64::from(resident))
    }

    /// Clusters of `cluster` CTAs of `kernel` (`block_threads` threads each, its dynamic shared
    /// memory) the GPU holds resident at once: the driver's occupancy calculator for cluster
    /// launches (cached), which counts where clusters fit in the GPU's processing clusters, so
    /// it may be less than the resident CTAs divided by the cluster size.
    pub fn max_active_clusters(
        &self,
        kernel: &KernelInfo,
        block_threads: u32,
        cluster: (u32, u32, u32),
    ) -> Result<u32> {
        let key = (kernel.entry, block_threads, cluster);
        if let Some(n) = self.cluster_occupancy.lock().unwrap().get(&key) {
            return Ok(*n);
        }
        self.bind()?;
        let mut attr = cluster_attribute(cluster);
        let config = sys::CUlaunchConfig {
            gridDimX: cluster.0,
            gridDimY: cluster.1,
            gridDimZ: cluster.2,
            blockDimX: block_threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: kernel.dyn_smem,
            hStream: self.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: the function is loaded in this context, the config and its attribute outlive
        // the call, and `n` is a valid out pointer.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, kernel.func.cu_function(), &config) }
            .result()
            .call("cuOccupancyMaxActiveClusters")?;
        let n = n.max(0) as u32;
        self.cluster_occupancy.lock().unwrap().insert(key, n);
        Ok(n)
    }

    /// A tensor map for the copy engine over a row-major bf16 matrix of `rows` x `cols` at
    /// `ptr`, seen as 3-D (`box_cols` columns, rows, column blocks of `box_cols`): boxes of
    /// `box_cols` x `box_rows` x `box_blocks` consecutive column blocks, landing in shared
    /// memory block after block (each `box_rows` rows of `box_cols` columns), 128-byte swizzle
    /// (`box_cols * 2` must be 128 or less and divide `cols * 2`), elements past the matrix
    /// read as zeros. `ptr` must be 16-byte aligned and the row pitch (`cols * 2`) a multiple
    /// of 16.
    pub fn bf16_tensor_map(
        &self,
        ptr: u64,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
        box_blocks: u32,
    ) -> Result<TensorMap> {
        if !ptr.is_multiple_of(16)
            || (u64::from(cols) * 2) % 16 != 0
            || box_cols == 0
            || box_cols * 2 > 128
            || !box_cols.is_multiple_of(8)
            || !cols.is_multiple_of(box_cols)
        {
            return Err(Error::Shape(crate::ShapeError::new(
                "bf16 tensor map",
                "a 16-byte aligned address, a row pitch that is a multiple of 16 bytes and boxes \
                 at most 128 bytes wide, a multiple of 16 bytes, dividing the row",
                format!("[{rows}, {cols}] at {ptr:#x}, box {box_rows} x {box_cols} x {box_blocks}"),
            )));
        }
        let dims = [
            u64::from(box_cols),
            u64::from(rows),
            u64::from(cols / box_cols),
        ];
        let strides = [u64::from(cols) * 2, u64::from(box_cols) * 2];
        self.encode_tiled(
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            ptr,
            &dims,
            &strides,
            &[box_cols, box_rows, box_blocks],
            true,
        )
    }

    /// A 2-D tensor map of a row-major byte matrix (`[rows, cols]` u8: FP8 codes, or bf16 rows
    /// as bytes) for the copy engine: boxes of `box_rows` rows x `box_cols` bytes with the
    /// 128-byte swizzle, elements past the matrix read as zeros. `ptr` must be 16-byte aligned, `cols` a
    /// multiple of 16 and `box_cols` at most 128.
    pub fn u8_tensor_map_2d(
        &self,
        ptr: u64,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
    ) -> Result<TensorMap> {
        if !ptr.is_multiple_of(16)
            || cols == 0
            || rows == 0
            || !cols.is_multiple_of(16)
            || box_cols == 0
            || box_cols > 128
            || !box_cols.is_multiple_of(16)
            || box_rows == 0
            || box_rows > 256
        {
            return Err(Error::Shape(crate::ShapeError::new(
                "byte tensor map (E4M3 codes, or bf16 rows as bytes)",
                "a 16-byte aligned address, a positive row pitch that is a multiple of 16 bytes \
                 and boxes of 1-256 rows and at most 128 bytes, a multiple of 16",
                format!("[{rows}, {cols}] at {ptr:#x}, box {box_rows} x {box_cols}"),
            )));
        }
        self.encode_tiled(
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            ptr,
            &[u64::from(cols), u64::from(rows)],
            &[u64::from(cols)],
            &[box_cols, box_rows],
            true,
        )
    }

    /// A 2-D tensor map of a row-major matrix of `[rows, cols]` elements of `elem_bytes` (2:
    /// u16, 4: u32) for the copy engine, boxes of `box_rows` x `box_cols` elements landing in
    /// shared memory row after row, unswizzled, elements past the matrix read as zeros: the
    /// INT4 weights' words, scales and offsets. `ptr` must be 16-byte aligned, the row pitch a
    /// multiple of 16 bytes, `box_cols` at most 256 with `box_cols * elem_bytes` a multiple of
    /// 16, and `box_rows` 1-256.
    pub fn plain_tensor_map_2d(
        &self,
        elem_bytes: u32,
        ptr: u64,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
    ) -> Result<TensorMap> {
        let dtype = match elem_bytes {
            2 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            4 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
            _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        };
        let pitch = u64::from(cols) * u64::from(elem_bytes);
        if !matches!(elem_bytes, 1 | 2 | 4)
            || !ptr.is_multiple_of(16)
            || rows == 0
            || cols == 0
            || !pitch.is_multiple_of(16)
            || box_cols == 0
            || box_cols > 256
            || !(box_cols * elem_bytes).is_multiple_of(16)
            || box_rows == 0
            || box_rows > 256
        {
            return Err(Error::Shape(crate::ShapeError::new(
                "unswizzled tensor map (INT4 words, scales or offsets)",
                "elements of 1, 2 or 4 bytes, a 16-byte aligned address, a row pitch that is a \
                 multiple of 16 bytes and boxes of 1-256 rows and at most 256 elements, a \
                 multiple of 16 bytes",
                format!(
                    "[{rows}, {cols}] x {elem_bytes} bytes at {ptr:#x}, box {box_rows} x {box_cols}"
                ),
            )));
        }
        self.encode_tiled(
            dtype,
            ptr,
            &[u64::from(cols), u64::from(rows)],
            &[pitch],
            &[box_cols, box_rows],
            false,
        )
    }

    /// A tiled tensor map of `dims` (innermost first) with byte `strides` of the outer
    /// dimensions, boxes `boxes`, the 128-byte swizzle (or none), zeros past the tensor.
    fn encode_tiled(
        &self,
        dtype: sys::CUtensorMapDataType,
        ptr: u64,
        dims: &[u64],
        strides: &[u64],
        boxes: &[u32],
        swizzle: bool,
    ) -> Result<TensorMap> {
        debug_assert!(strides.len() + 1 == dims.len() && boxes.len() == dims.len());
        self.bind()?;
        let mut map = TensorMap([0; 16]);
        let elem = [1u32; 5];
        // SAFETY: `map` is 64-byte aligned and 128 bytes (the driver's CUtensorMap); the slices
        // have the rank's lengths (strides: rank - 1) and outlive the call.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                (&mut map as *mut TensorMap).cast::<sys::CUtensorMap>(),
                dtype,
                dims.len() as u32,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                if swizzle {
                    sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
                } else {
                    sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
                },
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .call("cuTensorMapEncodeTiled")?;
        Ok(map)
    }

    /// The device's L2 cache size in bytes.
    pub fn l2_bytes(&self) -> Result<usize> {
        let b = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .call("cuDeviceGetAttribute")?;
        Ok(b.max(0) as usize)
    }
}
