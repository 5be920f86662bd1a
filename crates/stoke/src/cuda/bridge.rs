//! Runtime lookup, Stoke-owned tensors and the crossings between burn-cuda and Stoke.

use crate::stoke::Stoke;
use crate::tensor::{StokeData, StokeTensor};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::{Backend, DType, DeviceOps, ExecutionError, Shape, TensorData, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use stoke_cuda::{DeviceBuffer, Runtime, Unavailable};

type Cube = CubeTensor<CudaRuntime>;

/// Whether the inner backend's float tensors are burn-cuda tensors (`CubeTensor<CudaRuntime>`).
fn inner_is_cuda<I: Backend>() -> bool {
    TypeId::of::<I::FloatTensorPrimitive>() == TypeId::of::<Cube>()
}

fn to_cube<I: Backend>(t: I::FloatTensorPrimitive) -> Cube {
    let boxed: Box<dyn Any> = Box::new(t);
    *boxed
        .downcast::<Cube>()
        .expect("inner float primitive is a burn-cuda tensor")
}

fn from_cube<I: Backend>(t: Cube) -> I::FloatTensorPrimitive {
    let boxed: Box<dyn Any> = Box::new(t);
    *boxed
        .downcast::<I::FloatTensorPrimitive>()
        .expect("inner float primitive is a burn-cuda tensor")
}

/// A new burn-cuda tensor with dense row-major strides. `float_empty` may pad rows (cubecl's
/// pitched layout), which a flat copy of a Stoke buffer must not write into.
fn empty_contiguous<I: Backend>(shape: Shape, device: &I::Device, dtype: DType) -> Cube {
    let device = (device as &dyn Any)
        .downcast_ref::<<CudaRuntime as cubecl::Runtime>::Device>()
        .expect("inner device is a burn-cuda device")
        .clone();
    let client = <CudaRuntime as cubecl::Runtime>::client(&device);
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(client, device, shape, dtype)
}

/// Stoke's runtime for `device`, or why Stoke's kernels can't run there (the inner backend is
/// not burn-cuda, no driver, not a Hopper GPU, `STOKE_DISABLE` set). Opened once per device;
/// the reason is logged once, at `warn` level, when the inner backend is burn-cuda.
pub fn runtime_status<I: Backend>(device: &I::Device) -> Result<Arc<Runtime>, Unavailable> {
    if !inner_is_cuda::<I>() {
        return Err(Unavailable::InnerBackend);
    }
    type Runtimes = HashMap<usize, Result<Arc<Runtime>, Unavailable>>;
    static RUNTIMES: OnceLock<Mutex<Runtimes>> = OnceLock::new();
    let ordinal = device.id().index_id as usize;
    let mut map = RUNTIMES.get_or_init(Default::default).lock().unwrap();
    map.entry(ordinal)
        .or_insert_with(|| {
            let rt = Runtime::new(ordinal);
            match &rt {
                Ok(rt) => tracing::info!(
                    "stoke: kernels enabled on GPU {ordinal} ({}, {})",
                    rt.name,
                    rt.arch
                ),
                Err(reason) => tracing::warn!(
                    "stoke: falling back to the inner backend on GPU {ordinal}: {reason}"
                ),
            }
            rt
        })
        .clone()
}

/// Stoke's runtime for `device`, or `None` where Stoke's kernels can't run (see
/// [`runtime_status`] for why).
pub fn runtime_for<I: Backend>(device: &I::Device) -> Option<Arc<Runtime>> {
    runtime_status::<I>(device).ok()
}

/// Fatal CUDA failure inside an op that Burn's API gives no error channel for.
fn fatal(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("stoke: {what} failed: {e}")
}

/// A burn-cuda buffer pinned so that its device pointer stays valid. When dropped, the pin is
/// handed to the runtime, which releases it once Stoke's queued kernels are done with it.
struct Pin {
    rt: Arc<Runtime>,
    held: Option<Box<dyn Any + Send + Sync>>,
    ptr: u64,
}

/// Holds cubecl's `ManagedResource` (the pin), whose raw pointer field makes it `!Sync`. Stoke
/// reads the device address out of it once, at creation, and afterwards only keeps and drops
/// it: no shared access ever happens.
struct Held<T>(#[allow(dead_code)] T);
// SAFETY: see above: the value is never accessed through a shared reference.
unsafe impl<T: Send> Sync for Held<T> {}

impl Pin {
    /// Pins `t` (made contiguous first) and waits for burn-cuda's stream: the one
    /// synchronization of a crossing into Stoke.
    fn new<I: Backend>(rt: &Arc<Runtime>, t: Cube, device: &I::Device) -> Pin {
        rt.note_crossing(|| {
            format!(
                "a burn-cuda tensor {:?} ({:?}) read by a Stoke kernel",
                t.shape().as_slice(),
                t.dtype
            )
        });
        let t = if t.is_contiguous() {
            t
        } else {
            burn_cubecl::kernel::into_contiguous(t)
        };
        let res = t
            .client
            .get_resource(t.handle.clone())
            .unwrap_or_else(|e| fatal("get_resource on a burn-cuda tensor", format!("{e:?}")));
        let ptr = res.resource().ptr;
        I::sync(device).unwrap_or_else(|e| fatal("synchronizing burn-cuda", e));
        Pin {
            rt: rt.clone(),
            held: Some(Box::new(Held((res, t)))),
            ptr,
        }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if let Some(held) = self.held.take()
            && let Err(e) = self.rt.hold_until_done(held)
        {
            // Without the event the only safe release is after a full synchronization.
            tracing::error!("stoke: {e}; synchronizing before releasing a pinned buffer");
            let _ = self.rt.synchronize();
        }
    }
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pin({:#x})", self.ptr)
    }
}

/// Output of a Stoke kernel, in memory Stoke owns on its stream.
pub struct DeviceTensor<I: Backend> {
    buf: DeviceBuffer,
    shape: Shape,
    dtype: DType,
    device: I::Device,
    materialized: OnceLock<I::FloatTensorPrimitive>,
}

impl<I: Backend> std::fmt::Debug for DeviceTensor<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceTensor({:?}, {:?}, {:?})",
            self.shape, self.dtype, self.buf
        )
    }
}

impl<I: Backend> DeviceTensor<I> {
    pub(crate) fn alloc(rt: &Arc<Runtime>, shape: Shape, dtype: DType, device: I::Device) -> Self {
        let bytes = shape.num_elements() * dtype.size();
        let buf = rt
            .alloc(bytes)
            .unwrap_or_else(|e| fatal("allocating a Stoke buffer", e));
        Self {
            buf,
            shape,
            dtype,
            device,
            materialized: OnceLock::new(),
        }
    }

    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    /// Copies the values to the host (after Stoke's queued work).
    fn copy_to_host(&self) -> TensorData {
        let mut bytes = vec![0u8; self.buf.bytes()];
        // SAFETY: the buffer holds exactly `bytes()` bytes and lives for the copy.
        unsafe { self.buf.runtime().copy_dtoh(&mut bytes, self.buf.ptr()) }
            .unwrap_or_else(|e| fatal("reading a Stoke buffer", e));
        TensorData::from_bytes_vec(bytes, self.shape.clone(), self.dtype)
    }
}

impl<I: Backend> StokeData<I> for DeviceTensor<I> {
    fn shape(&self) -> Shape {
        self.shape.clone()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> I::Device {
        self.device.clone()
    }
    /// Straight from Stoke's buffer, unless it has crossed out already.
    fn read(&self) -> Option<TensorData> {
        self.materialized
            .get()
            .is_none()
            .then(|| self.copy_to_host())
    }
    /// The crossing out of Stoke; see the module docs.
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.materialized
            .get_or_init(|| {
                let rt = self.buf.runtime();
                rt.note_crossing(|| {
                    format!(
                        "a Stoke tensor {:?} ({:?}) read by a burn-cuda op",
                        self.shape.as_slice(),
                        self.dtype
                    )
                });
                let out = empty_contiguous::<I>(self.shape.clone(), &self.device, self.dtype);
                let res = out
                    .client
                    .get_resource(out.handle.clone())
                    .unwrap_or_else(|e| {
                        fatal("get_resource on a new burn-cuda tensor", format!("{e:?}"))
                    });
                I::sync(&self.device).unwrap_or_else(|e| fatal("synchronizing burn-cuda", e));
                // SAFETY: both buffers hold `bytes()` bytes; `res` pins the destination and the
                // synchronize below completes the copy before it is released.
                unsafe { rt.copy_dtod(res.resource().ptr, self.buf.ptr(), self.buf.bytes()) }
                    .and_then(|_| rt.synchronize())
                    .unwrap_or_else(|e| fatal("copying a Stoke buffer to burn-cuda", e));
                drop(res);
                from_cube::<I>(out)
            })
            .clone()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A burn-cuda tensor whose device pointer Stoke resolved once (weights, caches), with the plan
/// its model prepared it with.
pub struct ResidentTensor<I: Backend> {
    tensor: I::FloatTensorPrimitive,
    device: I::Device,
    pin: Pin,
    pub(crate) plan: crate::plan::WeightPlan,
    /// Its copies for the prefill GEMMs and the FP8 SwiGLU output's delayed scale, made at
    /// first use.
    pub(crate) prefill: Arc<super::prefill_linear::PrefillCopies>,
}

impl<I: Backend> std::fmt::Debug for ResidentTensor<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResidentTensor({:?})", self.pin)
    }
}

impl<I: Backend> ResidentTensor<I> {
    pub fn ptr(&self) -> u64 {
        self.pin.ptr
    }

    /// The plan it was prepared with.
    pub fn plan(&self) -> crate::plan::WeightPlan {
        self.plan
    }
}

impl<I: Backend> StokeData<I> for ResidentTensor<I> {
    fn shape(&self) -> Shape {
        self.tensor.shape()
    }
    fn dtype(&self) -> DType {
        self.tensor.dtype()
    }
    fn device(&self) -> I::Device {
        self.device.clone()
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.tensor.clone()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An output head `[k, n]` (Burn's Linear layout) kept as its rows `[n, k]`, one row of `k`
/// weights per output column (the layout a checkpoint stores a head in), pinned: the output-head
/// kernel (`kernels/bf16_head.cu`) streams whole rows of it. Every other op sees `[k, n]` as a
/// transposed view of the rows.
pub struct HeadWeight<I: Backend> {
    /// `[n, k]`, contiguous.
    rows: I::FloatTensorPrimitive,
    device: I::Device,
    pin: Pin,
}

impl<I: Backend> std::fmt::Debug for HeadWeight<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HeadWeight({:?} rows, {:?})",
            self.rows.shape(),
            self.pin
        )
    }
}

impl<I: Backend> HeadWeight<I> {
    /// The rows' device address.
    pub fn ptr(&self) -> u64 {
        self.pin.ptr
    }

    /// `(k, n)`: the weight's input and output sizes.
    pub fn k_n(&self) -> (usize, usize) {
        let s = self.rows.shape();
        (s.as_slice()[1], s.as_slice()[0])
    }
}

impl<I: Backend> StokeData<I> for HeadWeight<I> {
    fn shape(&self) -> Shape {
        let (k, n) = self.k_n();
        Shape::new([k, n])
    }
    fn dtype(&self) -> DType {
        self.rows.dtype()
    }
    fn device(&self) -> I::Device {
        self.device.clone()
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        I::float_swap_dims(self.rows.clone(), 0, 1)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Pins a float primitive for Stoke's kernels (with the default plan); returns it unchanged
/// where Stoke's kernels don't run or it is already Stoke-owned.
pub fn pin_tensor<I: Backend>(t: StokeTensor<I>) -> StokeTensor<I> {
    prepare_tensor(t, crate::plan::WeightPlan::default())
}

/// Prepares a weight with `plan`: an inner tensor is pinned ([`ResidentTensor`]) where Stoke's
/// kernels run; a packed weight takes the plan (a new handle on the same packed data, nothing
/// uploaded yet); a pinned one is pinned again with the plan (sharing the burn-cuda buffer).
/// Anything else is returned unchanged.
pub fn prepare_tensor<I: Backend>(
    t: StokeTensor<I>,
    plan: crate::plan::WeightPlan,
) -> StokeTensor<I> {
    if let Some(p) = t.downcast_ref::<crate::packed::PackedWeight<I>>() {
        return StokeTensor::owned(p.with_prefill(plan.prefill));
    }
    if t.downcast_ref::<HeadWeight<I>>().is_some() {
        return t;
    }
    let inner = match t {
        StokeTensor::Inner(inner) => inner,
        StokeTensor::Owned(ref data) => match data.as_any().downcast_ref::<ResidentTensor<I>>() {
            Some(r) => r.tensor.clone(),
            None => return t,
        },
    };
    let device = I::float_device(&inner);
    let Some(rt) = runtime_for::<I>(&device) else {
        return StokeTensor::Inner(inner);
    };
    if plan.head && inner.dtype() == DType::BF16 && inner.shape().num_dims() == 2 {
        // The rows `[n, k]`: a contiguous transpose, made once; the `[k, n]` tensor is dropped
        // with the model's old parameter.
        let rows = to_cube::<I>(I::float_swap_dims(inner, 0, 1));
        let rows = if rows.is_contiguous() {
            rows
        } else {
            burn_cubecl::kernel::into_contiguous(rows)
        };
        let pin = Pin::new::<I>(&rt, rows.clone(), &device);
        return StokeTensor::owned(HeadWeight::<I> {
            rows: from_cube::<I>(rows),
            device,
            pin,
        });
    }
    let pin = Pin::new::<I>(&rt, to_cube::<I>(inner.clone()), &device);
    StokeTensor::owned(ResidentTensor::<I> {
        tensor: inner,
        device,
        pin,
        plan,
        prefill: Default::default(),
    })
}

/// Pins a weight once so that Stoke's kernels use it with no per-op resolution. The tensor
/// still behaves as an ordinary tensor for every other op.
pub fn pin<I: Backend, const D: usize>(t: Tensor<Stoke<I>, D>) -> Tensor<Stoke<I>, D> {
    match t.into_primitive() {
        TensorPrimitive::Float(p) => Tensor::from_primitive(TensorPrimitive::Float(pin_tensor(p))),
        q => Tensor::from_primitive(q),
    }
}

/// [`pin`] with `plan` ([`prepare_tensor`]): a weight made ready as its model's plan says.
pub fn prepare<I: Backend, const D: usize>(
    t: Tensor<Stoke<I>, D>,
    plan: crate::plan::WeightPlan,
) -> Tensor<Stoke<I>, D> {
    match t.into_primitive() {
        TensorPrimitive::Float(p) => {
            Tensor::from_primitive(TensorPrimitive::Float(prepare_tensor(p, plan)))
        }
        q => Tensor::from_primitive(q),
    }
}

/// A kernel argument resolved to a device pointer, with whatever keeps it valid.
pub(crate) struct KernelInput {
    pub ptr: u64,
    /// A crossing's pin; released (after the kernel) when this value is dropped.
    _pin: Option<Pin>,
}

impl KernelInput {
    pub(crate) fn resolve<I: Backend>(
        rt: &Arc<Runtime>,
        t: &StokeTensor<I>,
        device: &I::Device,
    ) -> Self {
        if let Some(d) = t.downcast_ref::<DeviceTensor<I>>() {
            // Freed on Stoke's stream: stream order keeps it valid for this kernel.
            return Self {
                ptr: d.ptr(),
                _pin: None,
            };
        }
        if let Some(a) = t.downcast_ref::<super::prefill_linear::Fp8Activation<I>>() {
            // Its bf16 values, dequantized on Stoke's stream and kept as long as `t`.
            return Self {
                ptr: a.bf16().ptr(),
                _pin: None,
            };
        }
        if let Some(n) = t.downcast_ref::<super::int4_linear::FoldedNorm<I>>() {
            // Its normalized rows, computed on Stoke's stream and kept as long as `t`.
            return Self::resolve(rt, n.normed(), device);
        }
        if let Some(n) = t.downcast_ref::<super::prefill_linear::RmsNormed<I>>() {
            // Its normalized rows, computed on Stoke's stream and kept as long as `t`.
            return Self::resolve(rt, n.normed(), device);
        }
        if let Some(r) = t.downcast_ref::<ResidentTensor<I>>() {
            // Its pin is released through the runtime when the tensor drops, i.e. after every
            // kernel queued before that: nothing to hold per launch.
            return Self {
                ptr: r.ptr(),
                _pin: None,
            };
        }
        let pin = Pin::new::<I>(rt, to_cube::<I>(t.clone().into_inner()), device);
        Self {
            ptr: pin.ptr,
            _pin: Some(pin),
        }
    }
}

/// `Backend::sync` for `Stoke<I>`: also waits for Stoke's stream on that device.
pub(crate) fn sync_device<I: Backend>(device: &I::Device) -> Result<(), ExecutionError> {
    if let Some(rt) = runtime_for::<I>(device) {
        rt.synchronize().map_err(|e| ExecutionError::WithContext {
            reason: format!("stoke: {e}"),
        })?;
    }
    Ok(())
}

/// Pins every float parameter of a module (see [`pin`]): weights are resolved once, at load.
pub fn pin_module<I: Backend, M: burn::module::Module<Stoke<I>>>(module: M) -> M {
    use burn::module::{ModuleMapper, Param};
    struct Pinner;
    impl<I: Backend> ModuleMapper<Stoke<I>> for Pinner {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<Stoke<I>, D>>,
        ) -> Param<Tensor<Stoke<I>, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, pin(tensor), mapper)
        }
    }
    module.map(&mut Pinner)
}

/// `Backend::memory_cleanup` for `Stoke<I>`: returns Stoke's pooled buffers to the driver.
pub(crate) fn memory_cleanup<I: Backend>(device: &I::Device) {
    if let Some(rt) = runtime_for::<I>(device)
        && let Err(e) = rt.release_pool()
    {
        tracing::warn!("stoke: releasing pooled buffers: {e}");
    }
}
