//! `Stoke<B>` on the CPU: it forwards every op unchanged, its tensors may hold Stoke-owned data
//! that materializes on demand, and its fused ops' reference compositions match the f64
//! references.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive};
use burn_backend::TensorMetadata;
use burn_backend::ops::FloatTensorOps;
use rand::{SeedableRng, rngs::StdRng};
use stoke::{Stoke, StokeData, StokeTensor};
use stoke_formats::reference;
use stoke_tests::f64s;
use stoke_tests::{Cpu, suite};

type S = Stoke<Cpu>;

#[test]
fn forwarded_ops_are_bitwise_identical_to_the_inner_backend() {
    let seed = stoke_tests::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (a, b) = (
        suite::random(&mut rng, 8, 16),
        suite::random(&mut rng, 16, 12),
    );
    let got = suite::run::<S>(a.clone(), b.clone(), false, &Default::default());
    let want = suite::run::<Cpu>(a, b, false, &Default::default());
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(g.shape, w.shape, "{name} (seed {seed})");
        assert_eq!(g.as_bytes(), w.as_bytes(), "{name} differs (seed {seed})");
    }
}

#[test]
fn backend_is_named_after_its_inner_backend() {
    let name = S::name(&Default::default());
    assert!(
        name.starts_with("stoke<") && name.contains(&Cpu::name(&Default::default())),
        "{name}"
    );
}

#[test]
fn no_cuda_runtime_for_a_cpu_inner_backend() {
    assert!(stoke::cuda::runtime_for::<Cpu>(&Default::default()).is_none());
}

/// Stoke-owned data of a kind no op knows: everything must work through materialization.
#[derive(Debug)]
struct HostOwned {
    data: TensorData,
    materialized: std::sync::atomic::AtomicUsize,
}

impl StokeData<Cpu> for HostOwned {
    fn shape(&self) -> burn::tensor::Shape {
        self.data.shape.clone()
    }
    fn dtype(&self) -> burn::tensor::DType {
        self.data.dtype
    }
    fn device(&self) -> <Cpu as burn::tensor::backend::BackendTypes>::Device {
        Default::default()
    }
    fn materialize(&self) -> <Cpu as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive {
        self.materialized
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Cpu::float_from_data(self.data.clone(), &Default::default())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn host_owned<const D: usize>(t: Tensor<S, D>) -> Tensor<S, D> {
    let data = t.to_data();
    let owned = StokeTensor::owned(HostOwned {
        data,
        materialized: 0.into(),
    });
    Tensor::from_primitive(TensorPrimitive::Float(owned))
}

#[test]
fn burn_nn_model_runs_unchanged_on_stoke_owned_weights() {
    let device = Default::default();
    let model: Linear<S> = LinearConfig::new(64, 32).init(&device);
    // Parameters initialize lazily, per clone: materialize them before cloning the model.
    let _ = (model.weight.val(), model.bias.as_ref().map(|b| b.val()));
    struct ToOwned;
    impl burn::module::ModuleMapper<S> for ToOwned {
        fn map_float<const D: usize>(
            &mut self,
            p: burn::module::Param<Tensor<S, D>>,
        ) -> burn::module::Param<Tensor<S, D>> {
            let (id, t, m) = p.consume();
            burn::module::Param::from_mapped_value(id, host_owned(t), m)
        }
    }
    let converted = model.clone().map(&mut ToOwned);
    let weight = converted.weight.val().into_primitive();
    let TensorPrimitive::Float(w) = weight else {
        panic!("float weight")
    };
    assert!(
        w.downcast_ref::<HostOwned>().is_some(),
        "weights are Stoke-owned after conversion"
    );
    assert_eq!(w.shape().as_slice(), &[64, 32]);

    let x = Tensor::<S, 2>::random([5, 64], Distribution::Default, &device);
    let want = model.forward(x.clone()).to_data();
    let got = converted.forward(host_owned(x)).to_data();
    assert_eq!(got.as_bytes(), want.as_bytes());
}

#[test]
fn rms_norm_reference_matches_f64() {
    let device = Default::default();
    for &(rows, hidden) in &[(1usize, 576usize), (7, 64), (3, 577)] {
        let x = Tensor::<S, 2>::random([rows, hidden], Distribution::Uniform(-3.0, 3.0), &device);
        let g = Tensor::<S, 1>::random([hidden], Distribution::Uniform(0.5, 1.5), &device);
        let got = f64s(stoke::rms_norm(x.clone(), g.clone(), 1e-5).to_data());
        let want = reference::rms_norm(&f64s(x.to_data()), &f64s(g.to_data()), hidden, 1e-5);
        let err = reference::relative_error(&got, &want);
        assert!(err < 1e-6, "[{rows}, {hidden}]: {err:e}");
    }
}

#[test]
fn residual_rms_norm_reference_returns_sum_and_normed() {
    let device = Default::default();
    let (rows, hidden) = (4, 96);
    let x = Tensor::<S, 2>::random([rows, hidden], Distribution::Uniform(-1.0, 1.0), &device);
    let r = Tensor::<S, 2>::random([rows, hidden], Distribution::Uniform(-1.0, 1.0), &device);
    let g = Tensor::<S, 1>::random([hidden], Distribution::Uniform(0.5, 1.5), &device);
    let (sum, normed) = stoke::residual_rms_norm(x.clone(), r.clone(), g.clone(), 1e-6);
    let sum_want: Vec<f64> = f64s(x.to_data())
        .iter()
        .zip(f64s(r.to_data()))
        .map(|(a, b)| a + b)
        .collect();
    assert!(reference::relative_error(&f64s(sum.to_data()), &sum_want) < 1e-7);
    let want = reference::rms_norm(&sum_want, &f64s(g.to_data()), hidden, 1e-6);
    assert!(reference::relative_error(&f64s(normed.to_data()), &want) < 1e-6);
}

/// Model code written against `FusedOps` trains: under autodiff the reference composition
/// runs and gradients flow. d/dgamma_j of sum(rms_norm(x)) is sum_r x_rj / rms_r.
#[test]
fn fused_ops_train_under_autodiff() {
    type A = burn_autodiff::Autodiff<Cpu>;
    let device = Default::default();
    let (rows, hidden) = (3, 16);
    let x = Tensor::<A, 2>::random([rows, hidden], Distribution::Uniform(-2.0, 2.0), &device);
    let g =
        Tensor::<A, 1>::random([hidden], Distribution::Uniform(0.5, 1.5), &device).require_grad();
    let grads = stoke::rms_norm(x.clone(), g.clone(), 1e-5).sum().backward();
    let got = f64s(g.grad(&grads).expect("gamma has a gradient").to_data());
    let ones = vec![1.0; hidden];
    let normed = reference::rms_norm(&f64s(x.to_data()), &ones, hidden, 1e-5);
    let want: Vec<f64> = (0..hidden)
        .map(|j| (0..rows).map(|r| normed[r * hidden + j]).sum())
        .collect();
    assert!(reference::relative_error(&got, &want) < 1e-5);
}

/// The fused-epilogue linears' reference compositions: on the CPU backend with dequantized
/// weights, and on `Stoke<NdArray>` with packed ones (gate/up interleaved), against f64.
#[test]
fn linear_epilogue_compositions_match_the_reference() {
    let seed = stoke_tests::seed();
    for rows in [1, 5] {
        for (res, glu) in [
            stoke_tests::int4::linear_epilogues::<Cpu>(rows, burn::tensor::DType::F32, seed),
            stoke_tests::int4::linear_epilogues::<S>(rows, burn::tensor::DType::F32, seed),
        ] {
            assert!(
                res < 1e-5 && glu < 1e-5,
                "seed {seed} rows {rows}: {res:e} {glu:e}"
            );
        }
    }
}
