//! A catalog of silent bugs that can be injected into the sharded model
//! ([`ShardedGpt::with_bug`](crate::shard::ShardedGpt::with_bug)), each modelling a real class
//! of distributed-training bug (sources in `papers/ttrace-paper-notes.md` §3 and
//! the issue trackers named below). None of them crashes or changes a shape: they only change
//! values, which is what makes them silent.

use serde::Serialize;

use ttrace::engine::Pass;
use ttrace::trace::ModuleKind;
use ttrace::{Error, Result};

/// An injectable bug (serialized as its catalog name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bug {
    /// LayerNorm weight and bias gradients are not all-reduced across the TP group under
    /// sequence parallelism (Megatron-LM #1446).
    SpNormGradNotReduced,
    /// Gradients of a replicated parameter (the row-parallel biases) are not synchronized
    /// across the TP group under sequence parallelism (Megatron-LM #599: replicated weights
    /// never synchronized within TP).
    SpRowBiasGradNotReduced,
    /// Context-parallel attention backward recomputes the probabilities of remote key blocks
    /// with a wrong log-sum-exp correction (off by ln 2) (TransformerEngine #1557,
    /// Megatron-LM #1464/#1465).
    CpWrongLseCorrection,
    /// The causal mask of context-parallel attention assumes contiguous chunks: the
    /// load-balanced order (rank i holds chunks i and 2·cp − 1 − i) is not inverted.
    CpChunkOrderNotInverted,
    /// Context-parallel attention backward uses a stale KV block (the rank's own) for the
    /// remote steps of the ring.
    CpStaleKvBlock,
    /// FP8 amax is not reduced across the TP group: every rank scales its shard with its own
    /// amax (TransformerEngine #335, fixed by Megatron-LM PR #442).
    Fp8AmaxNotReduced,
    /// Data-parallel gradients are summed instead of averaged (the loss is not divided by the
    /// DP size).
    DpGradSummedNotAveraged,
    /// The row-parallel bias is added on every TP rank before the all-reduce (counted tp times).
    RowBiasOnEveryRank,
    /// The softmax scale is computed from the per-rank width (hidden/tp over all heads), i.e.
    /// 1/√(d/tp) instead of 1/√d.
    SoftmaxScaleFromLocalWidth,
    /// Gradients are all-reduced in BF16 where FP32 is required.
    GradAllReduceInBf16,
    /// The loss is not divided by the number of micro-batches it is accumulated over — here the
    /// context-parallel ranks' shares (Megatron-LM's CP loss scaling), so gradients are cp
    /// times too large.
    MissingMicrobatchDivision,
    /// Embedding gradients are not all-reduced across data-parallel ranks (the shared /
    /// tied-embedding synchronization class, Megatron-LM #656).
    EmbeddingGradNotDpReduced,
    /// The LayerNorm epsilon differs from the reference's (10× larger).
    NormEpsMismatch,
    /// The row-parallel output is reduce-scattered along the batch dimension instead of the
    /// sequence under sequence parallelism, then viewed as a sequence shard ([s, b, h] vs
    /// [b, s, h] confusion).
    ReduceScatterWrongDim,
    /// QKV heads are split across TP ranks contiguously instead of per [Q | K | V] group, so a
    /// rank's "Q, K, V" are slices of the wrong projections.
    QkvWrongInterleave,
}

/// Where a bug is expected to be localized: the module kind and pass whose own output goes
/// wrong first, and optionally a predicate on the module name.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Site {
    /// Module kind.
    pub kind: ModuleKind,
    /// Forward or backward.
    pub pass: Pass,
    /// Required suffix of the module name (e.g. `attn.qkv`), if any.
    pub name_suffix: Option<&'static str>,
}

impl Bug {
    /// Every bug, in catalog order.
    pub const ALL: [Bug; 15] = [
        Bug::SpNormGradNotReduced,
        Bug::SpRowBiasGradNotReduced,
        Bug::CpWrongLseCorrection,
        Bug::CpChunkOrderNotInverted,
        Bug::CpStaleKvBlock,
        Bug::Fp8AmaxNotReduced,
        Bug::DpGradSummedNotAveraged,
        Bug::RowBiasOnEveryRank,
        Bug::SoftmaxScaleFromLocalWidth,
        Bug::GradAllReduceInBf16,
        Bug::MissingMicrobatchDivision,
        Bug::EmbeddingGradNotDpReduced,
        Bug::NormEpsMismatch,
        Bug::ReduceScatterWrongDim,
        Bug::QkvWrongInterleave,
    ];

    /// The catalog name (kebab case), as `ttrace simulate --bug` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Bug::SpNormGradNotReduced => "sp-norm-grad-not-reduced",
            Bug::SpRowBiasGradNotReduced => "sp-row-bias-grad-not-reduced",
            Bug::CpWrongLseCorrection => "cp-wrong-lse-correction",
            Bug::CpChunkOrderNotInverted => "cp-chunk-order-not-inverted",
            Bug::CpStaleKvBlock => "cp-stale-kv-block",
            Bug::Fp8AmaxNotReduced => "fp8-amax-not-reduced",
            Bug::DpGradSummedNotAveraged => "dp-grad-summed-not-averaged",
            Bug::RowBiasOnEveryRank => "row-bias-on-every-rank",
            Bug::SoftmaxScaleFromLocalWidth => "softmax-scale-from-local-width",
            Bug::GradAllReduceInBf16 => "grad-allreduce-in-bf16",
            Bug::MissingMicrobatchDivision => "missing-microbatch-division",
            Bug::EmbeddingGradNotDpReduced => "embedding-grad-not-dp-reduced",
            Bug::NormEpsMismatch => "norm-eps-mismatch",
            Bug::ReduceScatterWrongDim => "reduce-scatter-wrong-dim",
            Bug::QkvWrongInterleave => "qkv-wrong-interleave",
        }
    }

    /// A bug by catalog name.
    pub fn by_name(name: &str) -> Result<Bug> {
        Bug::ALL
            .iter()
            .copied()
            .find(|b| b.name() == name)
            .ok_or_else(|| Error::UnknownName {
                kind: "bug (see `ttrace bugs`)",
                name: name.to_string(),
            })
    }

    /// The real-world bug it models.
    pub fn models(self) -> &'static str {
        match self {
            Bug::SpNormGradNotReduced => {
                "Megatron-LM #1446: final_layernorm grads not reduced across TP with SP"
            }
            Bug::SpRowBiasGradNotReduced => {
                "Megatron-LM #599: replicated parameters not synchronized within TP"
            }
            Bug::CpWrongLseCorrection => {
                "TransformerEngine #1557 / Megatron-LM #1464: wrong CP attention backward"
            }
            Bug::CpChunkOrderNotInverted => {
                "CP load-balanced chunk order not inverted in the causal mask"
            }
            Bug::CpStaleKvBlock => "stale KV block in the CP ring backward (TTrace notes §3.4)",
            Bug::Fp8AmaxNotReduced => {
                "TransformerEngine #335 / Megatron-LM PR #442: FP8 amax not reduced over TP"
            }
            Bug::DpGradSummedNotAveraged => "DP gradients summed instead of averaged",
            Bug::RowBiasOnEveryRank => {
                "row-parallel bias added on every rank before the all-reduce"
            }
            Bug::SoftmaxScaleFromLocalWidth => "softmax scale from the per-rank width",
            Bug::GradAllReduceInBf16 => "gradients all-reduced in BF16 instead of FP32",
            Bug::MissingMicrobatchDivision => {
                "loss not divided by the number of micro-batches (CP shares)"
            }
            Bug::EmbeddingGradNotDpReduced => {
                "Megatron-LM #656 class: embedding grads not synchronized over DP"
            }
            Bug::NormEpsMismatch => "LayerNorm epsilon differs from the reference",
            Bug::ReduceScatterWrongDim => "reduce-scatter along the wrong dimension under SP",
            Bug::QkvWrongInterleave => "QKV heads split across TP ranks in the wrong interleaving",
        }
    }

    /// When the bug can show at all (the parallelism it needs), as text.
    pub fn needs(self) -> &'static str {
        match self {
            Bug::SpNormGradNotReduced | Bug::SpRowBiasGradNotReduced => "tp > 1 with SP",
            Bug::CpWrongLseCorrection
            | Bug::CpChunkOrderNotInverted
            | Bug::CpStaleKvBlock
            | Bug::MissingMicrobatchDivision => "cp > 1",
            Bug::Fp8AmaxNotReduced => "an FP8 recipe, tp > 1",
            Bug::DpGradSummedNotAveraged | Bug::EmbeddingGradNotDpReduced => "dp > 1",
            Bug::RowBiasOnEveryRank | Bug::SoftmaxScaleFromLocalWidth | Bug::QkvWrongInterleave => {
                "tp > 1"
            }
            Bug::GradAllReduceInBf16 => "dp·cp > 1, FP32 gradients",
            Bug::NormEpsMismatch => "always",
            Bug::ReduceScatterWrongDim => "tp > 1 with SP, batch/dp divisible by tp",
        }
    }

    /// Where the localizer should find it.
    pub fn site(self) -> Site {
        let s = |kind, pass, name_suffix| Site {
            kind,
            pass,
            name_suffix,
        };
        use ModuleKind as K;
        use Pass::{Backward as B, Forward as F};
        match self {
            Bug::SpNormGradNotReduced => s(K::Norm, B, None),
            Bug::SpRowBiasGradNotReduced => s(K::Linear, B, None),
            Bug::CpWrongLseCorrection | Bug::CpStaleKvBlock => s(K::Attention, B, None),
            Bug::CpChunkOrderNotInverted | Bug::SoftmaxScaleFromLocalWidth => {
                s(K::Attention, F, None)
            }
            Bug::Fp8AmaxNotReduced => s(K::Linear, F, None),
            Bug::DpGradSummedNotAveraged | Bug::MissingMicrobatchDivision => s(K::Loss, B, None),
            Bug::RowBiasOnEveryRank | Bug::ReduceScatterWrongDim => s(K::Linear, F, None),
            Bug::GradAllReduceInBf16 => s(K::Linear, B, None),
            Bug::EmbeddingGradNotDpReduced => s(K::Embedding, B, None),
            Bug::NormEpsMismatch => s(K::Norm, F, None),
            Bug::QkvWrongInterleave => s(K::Linear, F, Some("attn.qkv")),
        }
    }
}

impl Serialize for Bug {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl std::fmt::Display for Bug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut names: Vec<&str> = Bug::ALL.iter().map(|b| b.name()).collect();
        for b in Bug::ALL {
            assert_eq!(Bug::by_name(b.name()).unwrap(), b);
            assert!(!b.models().is_empty() && !b.needs().is_empty());
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Bug::ALL.len());
        assert_eq!(
            serde_json::to_string(&Bug::GradAllReduceInBf16).unwrap(),
            "\"grad-allreduce-in-bf16\""
        );
        assert!(matches!(
            Bug::by_name("no-such-bug"),
            Err(Error::UnknownName { .. })
        ));
    }
}
