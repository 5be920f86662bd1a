//! What a model's ops compute, as data: a [`Plan`] is decided when the model is loaded and owned
//! by the model (or its engine); it reaches the ops through the weights it prepares
//! ([`FusedOps::prepare_weight`](crate::FusedOps::prepare_weight) with a [`WeightPlan`]) and the
//! decoder made for it, never through a process-wide switch, so two models with different plans
//! live in one process.

use crate::decode::KvCacheFormat;

/// How a projection runs in prefill-sized calls (more than the decode kernels' rows) on
/// `Stoke<Cuda>`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PrefillMode {
    /// Stoke's wgmma GEMM on a bf16 copy of the weight (made at its first prefill).
    #[default]
    Bf16,
    /// The FP8 GEMM on an E4M3 copy of the weight (one scale per output channel) and E4M3
    /// activations; an RMSNorm before it folds its gain into a second copy.
    Fp8,
    /// The FP8 GEMM reading a packed INT4 weight as it is (expanded to E4M3 in its mainloop; no
    /// copy); dense weights and groups the kernel does not take use an E4M3 copy.
    Fp8Int4,
}

impl PrefillMode {
    /// Whether the prefill GEMM runs in FP8.
    pub fn is_fp8(self) -> bool {
        self != Self::Bf16
    }
}

impl std::str::FromStr for PrefillMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "fp8" => Ok(Self::Fp8),
            "fp8-int4" => Ok(Self::Fp8Int4),
            other => Err(format!(
                "unknown prefill mode {other:?} (bf16, fp8, fp8-int4)"
            )),
        }
    }
}

/// A model's plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The projections' prefill mode (the output head always runs on bf16: its logits take its
    /// rounding directly).
    pub prefill: PrefillMode,
    /// The format of the KV cache decode attention reads.
    pub kv_format: KvCacheFormat,
    /// The decode step's fused launches, for steps of up to this many rows (0: never;
    /// default [`FUSED_STEP_ROWS`], 32): each RMSNorm between two projections folded into the
    /// projections' W4A16 GEMMs
    /// ([`FusedOps::linear_residual_rms_norm`](crate::FusedOps::linear_residual_rms_norm)) and,
    /// for heads of 64, RoPE with the cache append in the q|k|v GEMM's epilogue
    /// ([`FusedOps::decode_qkv_attention`](crate::FusedOps::decode_qkv_attention)). Larger
    /// steps and prefills run the reference layout, each of them a launch of its own.
    pub fused_step_rows: usize,
}

/// [`Plan::fused_step_rows`]' default: the fused step where it measured at least as fast as the
/// reference layout (docs/PERFORMANCE.md, "The fused step"; H100): SmolLM2 shape 0.89x the
/// reference layout's step time at 1 row, 0.85x at 8, 0.99x at 32; 8B shape 1.00x at 1 row
/// and at 32 rows with context 4096. Steps of 33-64 rows were not measured and run the
/// reference layout.
pub const FUSED_STEP_ROWS: usize = 32;

impl Default for Plan {
    fn default() -> Self {
        Self {
            prefill: PrefillMode::default(),
            kv_format: KvCacheFormat::default(),
            fused_step_rows: FUSED_STEP_ROWS,
        }
    }
}

/// What a weight is to its model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    /// A projection inside a layer (q|k|v, o, gate|up, down).
    Projection,
    /// The output head.
    Head,
    /// An RMSNorm's gain; `feeds_projections`: its output goes to projections (not the head).
    NormGain { feeds_projections: bool },
    /// Anything else (embeddings, tables, biases).
    Other,
}

/// What the plan decides for one weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightPlan {
    /// Its prefill mode, where it is a projection's weight.
    pub prefill: PrefillMode,
    /// For a norm's gain: the norm is deferred where its rows go to FP8 projections, which fold
    /// the gain into their weights (no normalized activation is written).
    pub fold_into_fp8: bool,
    /// An output head: a bf16 head is kept as its rows `[n, k]` (one row per output column)
    /// for the output-head kernel, which streams whole rows of it.
    pub head: bool,
}

impl Plan {
    /// Whether a decode step of `rows` rows runs the fused launches
    /// ([`Plan::fused_step_rows`]).
    pub fn fuses_step(&self, rows: usize) -> bool {
        rows <= self.fused_step_rows
    }

    /// The plan of a weight of `role`.
    pub fn weight(&self, role: WeightRole) -> WeightPlan {
        match role {
            WeightRole::Projection => WeightPlan {
                prefill: self.prefill,
                ..WeightPlan::default()
            },
            WeightRole::NormGain { feeds_projections } => WeightPlan {
                prefill: PrefillMode::Bf16,
                fold_into_fp8: feeds_projections && self.prefill.is_fp8(),
                ..WeightPlan::default()
            },
            WeightRole::Head => WeightPlan {
                head: true,
                ..WeightPlan::default()
            },
            WeightRole::Other => WeightPlan::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_plan_fuses_decode_steps_of_up_to_32_rows() {
        let plan = Plan::default();
        assert!((1..=FUSED_STEP_ROWS).all(|rows| plan.fuses_step(rows)));
        assert!(plan.fuses_step(32));
        assert!(!plan.fuses_step(FUSED_STEP_ROWS + 1) && !plan.fuses_step(64));
        let never = Plan {
            fused_step_rows: 0,
            ..plan
        };
        assert!((1..=64).all(|rows| !never.fuses_step(rows)));
    }

    #[test]
    fn the_head_and_other_weights_stay_on_bf16() {
        let plan = Plan {
            prefill: PrefillMode::Fp8,
            ..Plan::default()
        };
        assert_eq!(
            plan.weight(WeightRole::Projection).prefill,
            PrefillMode::Fp8
        );
        assert_eq!(
            plan.weight(WeightRole::Head),
            WeightPlan {
                head: true,
                ..WeightPlan::default()
            }
        );
        assert_eq!(plan.weight(WeightRole::Head).prefill, PrefillMode::Bf16);
        assert!(
            plan.weight(WeightRole::NormGain {
                feeds_projections: true
            })
            .fold_into_fp8
        );
        assert!(
            !plan
                .weight(WeightRole::NormGain {
                    feeds_projections: false
                })
                .fold_into_fp8
        );
        assert!(
            !Plan::default()
                .weight(WeightRole::NormGain {
                    feeds_projections: true
                })
                .fold_into_fp8
        );
        assert_eq!("fp8-int4".parse::<PrefillMode>(), Ok(PrefillMode::Fp8Int4));
        assert!("fp4".parse::<PrefillMode>().is_err());
    }
}
