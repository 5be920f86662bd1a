//! Prints, as JSON lines, the relative decode-attention error of the INT4 and FP8 cache rows with
//! and without the Hadamard rotation, on synthetic caches whose keys have outlier channels
//! (`stoke_formats::kv::rotation_experiment`), for the Llama-3.1-8B and 70B attention shapes.
//!
//! cargo run --release -p stoke-formats --bin kv-rotation

use stoke_formats::kv::rotation_experiment;

fn main() {
    // (name, query heads, kv heads, head_dim)
    let shapes = [("llama8b", 32, 8, 128), ("llama70b", 64, 8, 128)];
    let ctx = 1024;
    for (name, heads, kv_heads, d) in shapes {
        for (outliers, factor) in [(0, 1.0f32), (4, 8.0), (8, 8.0), (4, 16.0)] {
            for block in [d, 64, 32] {
                let (int4, fp8) =
                    rotation_experiment(heads, kv_heads, d, ctx, outliers, factor, block, 17)
                        .expect("valid shapes");
                println!(
                    "{{\"shape\": \"{name}\", \"heads\": {heads}, \"kv_heads\": {kv_heads}, \"head_dim\": {d}, \"ctx\": {ctx}, \"outlier_channels\": {outliers}, \"outlier_factor\": {factor}, \"block\": {block}, \"int4_unrotated\": {:.5}, \"int4_rotated\": {:.5}, \"fp8_unrotated\": {:.5}, \"fp8_rotated\": {:.5}}}",
                    int4.unrotated, int4.rotated, fp8.unrotated, fp8.rotated
                );
            }
        }
    }
}
