//! Where the first wrong result was found: what both localizers report.

use serde::Serialize;

use crate::policy::Pass;
use crate::trace::ModuleKind;

/// Where the first wrong result was found — by the replaying localizer of the
/// validation lab (`ttrace_lab::validate::localize`) or by
/// the checker of trace directories ([`check_dirs`](crate::check::check_dirs)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Localization {
    /// Module name.
    pub module: String,
    /// Module kind, if known (the manifest of a trace from elsewhere may not say).
    pub kind: Option<ModuleKind>,
    /// Forward or backward, if the id says.
    pub pass: Option<Pass>,
    /// The failing tensor's canonical id (or FP8 scale key).
    pub tensor: String,
    /// The rank whose copy differs, when replicas disagree.
    pub rank: Option<usize>,
    /// The parameter, when a parameter gradient fails.
    pub parameter: Option<String>,
    /// Local error / local threshold (∞ against a zero threshold).
    pub ratio: f64,
    /// What failed.
    pub detail: String,
    /// When the failing tensor is one the module consumes (an input or an arriving gradient)
    /// and no traced tensor explains it: the module whose traced output last precedes it in
    /// the same pass. The difference was born in the untraced code between that module and
    /// [`module`](Self::module); `None` when no traced output precedes it (the model's input)
    /// or the failure is in a tensor the module produced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub born_after: Option<String>,
    /// In a pipelined candidate: the pipeline stage whose ranks hold the failing tensor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// In a candidate of several microbatches: the failing tensor's relative difference
    /// ‖c − r‖/‖r‖ over each microbatch's slice, in microbatch order (a difference in some
    /// microbatches only is a schedule's or a routing's, not a module's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<Vec<f64>>,
}
