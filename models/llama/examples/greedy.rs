use burn::tensor::{Int, Tensor, TensorData};
use stoke_llama::model::KvCache;
type B = burn_ndarray::NdArray<f32>;
fn main() {
    let path = std::env::args().nth(1).unwrap();
    let device = Default::default();
    let t0 = std::time::Instant::now();
    let l = stoke_llama::load::load_gguf::<B>(path.as_ref(), &device, burn::tensor::DType::F32, 256).unwrap();
    println!("loaded in {:?}", t0.elapsed());
    let ids: Vec<i64> = l.tokenizer.encode("Once upon a time", false).unwrap().get_ids().iter().map(|&i| i as i64).collect();
    let mut cache = KvCache::<B>::new(&l.config, 1, 64, burn::tensor::DType::F32, &device);
    let n = ids.len();
    let mut toks = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &device);
    let mut lens = vec![n];
    let mut out = Vec::new();
    for _ in 0..16 {
        let logits = l.model.forward(toks, &lens, &mut cache, true);
        let next = logits.argmax(2).reshape([1]).into_data().to_vec::<i64>().unwrap()[0];
        out.push(next as u32);
        toks = Tensor::from_data(TensorData::new(vec![next], [1, 1]), &device);
        lens = vec![1];
    }
    println!("{:?} in {:?}", l.tokenizer.decode(&out, false).unwrap(), t0.elapsed());
}
