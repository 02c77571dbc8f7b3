//! The trace manifest (`manifest.json`, schema version 2; version 1 still read) and trace
//! directories.
//!
//! A trace directory holds one safetensors file per rank (or `.npy` files) and a manifest:
//!
//! ```json
//! {"format": "ttrace-trace", "version": 2, "recipe": "bf16",
//!  "mesh": {"tp": 2, "cp": 1, "dp": 1, "sp": false},
//!  "tensors": [
//!    {"id": "layers.0.mlp.fc1|fwd.output.0", "rank": 0, "file": "rank0.safetensors",
//!     "key": "layers.0.mlp.fc1|fwd.output.0", "dtype": "bf16",
//!     "layout": {"dp": {"kind": "split", "dim": 0, "groups": 1},
//!                "cp": {"kind": "cp_chunks", "dim": 1},
//!                "tp": {"kind": "split", "dim": 2, "groups": 1}},
//!     "module": {"kind": "linear"}}]}
//! ```
//!
//! Required per tensor: `id`, `rank`, `file`, `dtype`, `layout`; `key` defaults to the id (for
//! `.npy` files it is ignored); `module` is optional (what produced the tensor, for pricing).
//! Unknown fields are ignored; a missing required field is an error naming the tensor and the
//! field. Every id must be present once on every rank of the mesh. The mesh above is
//! Megatron's `[dp, cp, tp]` in its short form (all version 1 could say); version 2 names axes
//! of any number, outermost first — `"mesh": {"axes": [{"name": "dp_shard", "size": 4},
//! {"name": "tp", "size": 2}]}` — and a layout places the tensor per named axis (an axis it
//! does not name: replicated). `papers/trace-format.md` is the full schema.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::Format;
use crate::io::guard::ferr;
use crate::io::guard::{limits, printable, TrustedDir};
use crate::io::{npy, safetensors};
use crate::tensor::Tensor;
use crate::trace::merge::{keep, merge_fetched, sum_group, take_spare, Joinable};
use crate::trace::stored::Stored;
use crate::trace::ModuleKind;
use crate::trace::{Axis, Layout, Mesh, Placement};

mod parse;
#[cfg(test)]
mod tests;
mod trace_dir;
mod write;

pub use parse::read_manifest;
use parse::*;
pub use trace_dir::{InferredLayout, TraceDir};
pub use write::{merge_fragments, write_manifest, write_trace_dir};

/// The schema version this library writes (it reads it and every earlier one: [`VERSIONS`]).
pub const VERSION: u64 = 2;

/// The schema versions this library reads: 1 (Megatron's `tp`, `cp`, `dp` mesh) and 2 (named
/// mesh axes).
pub const VERSIONS: [u64; 2] = [1, 2];

/// What produced a tensor, for pricing its threshold (see `papers/trace-format.md` and
/// [`price_local`](crate::check::price_local)). Every field is optional: without `kind` the
/// tensor is priced by the generic local model (with its gain allowance); the formats default
/// to the recipe's policy when the manifest names a ttrace recipe, else to "no quantization,
/// FP32 accumulation (FP64 for FP64 tensors), cross-rank combination in the tensor's own
/// dtype".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModuleInfo {
    /// Module kind, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ModuleKind>,
    /// Format the module's inputs are quantized to before its reductions (e.g. `e4m3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<Format>,
    /// Format its reductions accumulate in (e.g. `f32`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulate: Option<Format>,
    /// Format in which partial results of a reduction split across ranks are combined (the
    /// all-reduce dtype, e.g. `bf16` for Megatron's row-parallel output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<Format>,
    /// The arithmetic in force when the module ran, as the tracer found it
    /// (`papers/trace-format.md`): the autocast dtype, the precision of FP32 matmuls and
    /// convolutions, the device.
    #[serde(default, flatten)]
    pub arith: ModuleArith,
    /// The axes along which the module handed its caller a partial sum as a plain tensor (a
    /// DTensor `Partial()` made local with no reduction): merged as the sum it is, so the
    /// output itself passes — but the caller's plain code uses one rank's addend. When a tensor
    /// it feeds is the first to fail, the check names this module: a missing reduction.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreduced: Vec<crate::trace::Axis>,
    /// The registry's op the module computes, where the writer knows it exactly (the tracer's
    /// attention sites: `attention` or `attention:causal` for a `scaled_dot_product_attention`
    /// call with no mask, no dropout and the default scale). The checker prices the output of
    /// an attention op through the op (`check::attention_site`); other ops are recorded only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<crate::bounds::Op>,
}

/// The arithmetic settings in force for one module call (PyTorch's `torch.autocast`,
/// `torch.backends.cuda.matmul.allow_tf32` / `fp32_precision`, cuDNN's `allow_tf32`, oneDNN's
/// `fp32_precision`). Absent fields: full precision, no autocast.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleArith {
    /// The autocast dtype (`f16`, `bf16`): the module's matmuls and convolutions took their
    /// inputs in it and rounded their results to it, whatever dtype stores them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autocast: Option<Format>,
    /// The format FP32 matmul inputs are rounded to on the module's device: `tf32` (TF32 tensor
    /// cores), `bf16` (oneDNN's reduced precision); `f32` or absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_matmul: Option<Format>,
    /// The same for convolutions (cuDNN's `allow_tf32`, on by default in PyTorch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_conv: Option<Format>,
    /// The device type the module ran on (`cuda`, `cpu`, …); informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

impl ModuleArith {
    /// Refuse settings ttrace has no model for ([`Error::UnpricedArithmetic`] naming `id`):
    /// an autocast dtype other than F16, BF16 (or F32, no change); an FP32 matmul or
    /// convolution precision other than F32, TF32, BF16.
    pub fn check(&self, id: &str) -> Result<()> {
        let bad = |name: &str, f: Format| Error::UnpricedArithmetic {
            id: id.to_string(),
            setting: format!("{name}={f}"),
        };
        if let Some(f) = self.autocast {
            if !matches!(f, Format::F16 | Format::BF16 | Format::F32) {
                return Err(bad("autocast", f));
            }
        }
        for (name, v) in [
            ("fp32_matmul", self.fp32_matmul),
            ("fp32_conv", self.fp32_conv),
        ] {
            if let Some(f) = v {
                if !matches!(f, Format::F32 | Format::TF32 | Format::BF16) {
                    return Err(bad(name, f));
                }
            }
        }
        Ok(())
    }
}

impl ModuleInfo {
    /// Only the kind; formats from the recipe or the defaults.
    pub fn of(kind: ModuleKind) -> ModuleInfo {
        ModuleInfo {
            kind: Some(kind),
            quantize: None,
            accumulate: None,
            combine: None,
            arith: ModuleArith::default(),
            unreduced: vec![],
            op: None,
        }
    }
}

/// One stored shard.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ManifestEntry {
    /// Canonical id.
    pub id: String,
    /// Global rank.
    pub rank: usize,
    /// File, relative to the trace directory.
    pub file: String,
    /// Name inside a safetensors file.
    pub key: String,
    /// Stored dtype (`f64`, `f32`, `f16`, `bf16`, `e4m3`, `e5m2`).
    pub dtype: Format,
    /// How the ranks' shards merge.
    pub layout: Layout,
    /// What produced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module: Option<ModuleInfo>,
    /// A threshold on ‖cand − ref‖_F of the logical tensor priced by the producer (ttrace's
    /// composed threshold when `ttrace simulate --dump` writes a reference), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
    /// The axes along which the writer did not know the placement and `layout` holds its
    /// guess (a plain tensor of code it cannot see into; the batch dimension under data
    /// parallelism): the checker infers them from the shards' and the reference's shapes (see
    /// [`TraceDir::infer_guessed`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub guessed: Vec<Axis>,
    /// The pipeline stage whose ranks hold the tensor, in a pipelined trace (see
    /// [`Pipeline`]); informational (the report names it), below the pipeline's stages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// The axis along which one coordinate holds the tensor whole and the others hold no
    /// entry of it (an expert's tensors under expert parallelism: its owner's; see
    /// `papers/trace-format.md`, "Experts"). Its layout replicates it along the axis; the
    /// reader merges it over the owner's ranks alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owned: Option<Axis>,
}

/// How a pipelined (or gradient-accumulating) run was traced (`papers/trace-format.md`,
/// "Pipelines and microbatches"). The mesh of such a trace is one stage's: each tensor lives
/// on the ranks of one stage, which write it with their rank within the stage (the pipeline
/// axis places modules, not tensors). Each module call's `microbatches` calls are stored as
/// one tensor, concatenated along the batch dimension in microbatch order (the tracer does
/// it), and a parameter's gradient is the one accumulated over them — `microbatches` partial
/// sums rounded to its format and added, which the pricing counts as it counts ranks.
///
/// # Examples
///
/// ```
/// use ttrace::io::Pipeline;
/// let p: Pipeline = serde_json::from_str(r#"{"stages": 2, "microbatches": 4}"#).unwrap();
/// assert_eq!((p.stages, p.microbatches), (2, 4));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pipeline {
    /// The pipeline stages (pipeline-parallel ranks; 1: gradient accumulation alone).
    pub stages: usize,
    /// The microbatches each step ran as.
    pub microbatches: usize,
    /// The dimension the microbatches were concatenated along (the batch dimension; 0 when
    /// not said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dim: Option<usize>,
}

impl Pipeline {
    /// The largest number of stages or microbatches a manifest may declare.
    pub const MAX: usize = 1 << 20;
}

impl Manifest {
    /// The microbatches each step ran as (1 without a [`Pipeline`]).
    pub fn microbatches(&self) -> usize {
        self.pipeline.map_or(1, |p| p.microbatches)
    }
}

/// How each data-parallel rank normalized its loss, where the writer did not know (see
/// `papers/trace-format.md`, the `dp_loss` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpLoss {
    /// Not known to the writer: the gradients of activations split along dp, and the scalars
    /// summed over dp (a loss), are stored as each rank computed them. Each rank's loss either
    /// averaged its own share of the batch — they are then dp times the reference's — or was
    /// normalized by the global count; the checker settles which from the reference.
    Auto,
}

/// A manifest.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Manifest {
    /// Always `ttrace-trace`.
    pub format: String,
    /// Schema version.
    pub version: u64,
    /// The recipe name, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recipe: Option<String>,
    /// How the candidate's data-parallel ranks normalized their loss, where the writer did not
    /// know.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_loss: Option<DpLoss>,
    /// Pipeline stages and microbatches, for a pipelined or gradient-accumulating run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
    /// The mesh (one stage's, in a pipelined trace).
    pub mesh: Mesh,
    /// The run's settings as the Python tracer records them (informational: the PyTorch
    /// version, the FP32 matmul precision, the GPU), kept as written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<serde_json::Value>,
    /// Every shard.
    pub tensors: Vec<ManifestEntry>,
}
