//! What a module computes, as a trace names it (`"kind"` in the manifest).

use serde::{Deserialize, Serialize};

/// What a module computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModuleKind {
    /// Token + position embedding (no tensor input; reads the token ids).
    Embedding,
    /// LayerNorm or RMSNorm.
    Norm,
    /// Linear layer (with or without bias).
    Linear,
    /// Causal attention core on the QKV projection.
    Attention,
    /// MLP activation.
    Activation,
    /// Residual addition of two inputs.
    Residual,
    /// Mean cross-entropy against the targets.
    Loss,
}
