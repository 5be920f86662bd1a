//! GPU tests through `cargo test`. Without a usable GPU each prints `skipped: no CUDA device`.

macro_rules! gpu_tests {
    ($($name:ident),* $(,)?) => {
        $(#[test] fn $name() { stoke_tests::cargo_test(stringify!($name)); })*

        #[test]
        fn every_case_has_a_cargo_test() {
            let listed = [$(stringify!($name)),*];
            for (case, _) in stoke_tests::gpu::CASES {
                assert!(listed.contains(case), "GPU case {case} has no cargo test");
            }
        }
    };
}

gpu_tests!(
    forwarded_ops_match_burn_cuda,
    rms_norm_matches_reference,
    residual_rms_norm_matches_reference,
    stream_crossing_1000_alternations,
    burn_nn_model_with_stoke_tensors,
    synthetic_llama_stoke_matches_burn_cuda,
    smollm2_greedy_on_gpu,
    int4_gemm_matches_dequantized_reference,
    int4_tuned_plan_matches_reference,
    int4_linear_epilogues_match_reference,
    int4_folded_norm_matches_reference,
    int4_qkv_epilogue_matches_rope_append,
    fused_step_matches_separate_launches,
    bf16_gemm_matches_reference,
    bf16_head_matches_reference,
    rms_norm_then_int4_gemm_matches_synchronized,
    smollm2_int4_decode_matches_dequantized,
    smollm2_rtn_int4_decode_warpgroup_matches_simulated,
    decode_attention_matches_reference,
    prefill_attention_matches_reference,
    decode_step_matches_reference,
    smollm2_decode_matches_reference,
    packed_prefill_matches_reference,
    smollm2_graphed_text_matches_burn_cuda,
    two_plans_in_one_process,
    engine_matches_f32_reference,
    sample_matches_reference,
    lane_sampling_matches_reference,
    fp8_rows_match_reference,
    fp8_gemm_matches_reference,
    fp8_i4_gemm_matches_reference,
    bf16_tc_gemm_matches_reference,
    qkv_epilogue_matches_rope_append,
    fp8_delayed_swiglu_matches_reference,
    fp8_folded_norm_matches_reference,
    smollm2_fp8_prefill_matches_bf16,
);
