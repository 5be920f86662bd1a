//! Stoke's data formats and plain reference implementations. No GPU code: everything here is
//! the specification that kernels are tested against, written for clarity in f64.

pub mod bf16;
pub mod fp8;
pub mod gguf;
pub mod gptq;
pub mod int4;
pub mod kv;
pub mod reference;
pub mod sample;
pub mod shard;

/// `[rows, cols]` row-major to `[cols, rows]` (Burn's `[k, n]` Linear layout to the kernels'
/// `[n, k]` and back).
pub fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = v[r * cols + c];
        }
    }
    t
}
