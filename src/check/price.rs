//! Pricing thresholds for traces written by other programs (PyTorch dumps): from the manifest's
//! metadata and the data of both runs, without re-running the model.
//!
//! # The local model
//!
//! A tensor `t` produced by module `m` differs between a correct candidate and the reference
//! for two reasons only: the difference carried in by `m`'s inputs, and the rounding
//! differences `m` itself adds because the candidate splits one of its reductions across
//! ranks. Both runs' inputs of `m` are in the traces, so the carried part is *measured*, not
//! composed through the network: with ρ(x) = ‖x_cand − x_ref‖_F / ‖x_ref‖_F,
//!
//! * carried (before `m`'s output rounding): ρ_c = κ_kind · g · Σ_inputs ρ(x), where κ_kind is
//!   the module kind's gain allowance ([`gain_allowance`]) and g = 1 except for norms, whose
//!   relative gain is measured on the reference input as g = sqrt(mean_rows ‖x_r‖² / ‖x_r −
//!   x̄_r‖²) (normalisation divides by the row's spread). A residual addition is exactly
//!   linear: ρ_c = Σ ‖Δx‖ / ‖t_ref‖ with κ = 1.
//! * input quantization (FP8 recipes): an input difference moves elements across the
//!   quantization grid of unit roundoff u_q: ρ_q = sqrt(ρ_c² + 2·u_q·ρ_c) (a pre-rounding
//!   difference d flips an element with probability |d|/ulp by one ulp ≤ 2u|x|, so
//!   E|Δ|² ≈ |d|·ulp; the square adds the part that moves without a flip).
//! * order: when the candidate splits a reduction over s ranks (an input is split along a mesh
//!   axis on which the output is replicated or partial — row-parallel linears, sequence- or
//!   data-split weight gradients, vocabulary-split losses — or attention with context
//!   parallelism, whose keys are split over the CP ranks), the s partial results are combined
//!   in another association. Each of the ≤ 2s roundings involved (the partials' and the
//!   combining additions', in the reference and the candidate) has a relative error of at most
//!   u and variance at most u²/3 (round to nearest), so ρ_order = u_acc·sqrt(2s/3) when the
//!   combination runs in the accumulation format, and ρ_comb = u_comb·sqrt(2s/3) in units of
//!   the combining format when that is coarser (Megatron's BF16 all-reduce). A sharded
//!   reference splits reductions of its own over s_ref ranks (its layouts, its mesh): then
//!   s = s_cand + s_ref, both runs' roundings counted.
//! * kernels: the candidate's kernels may reorder the module's *local* reductions too (a GEMM
//!   on a column-parallel slice can pick another kernel and blocking than the full-size one),
//!   so two complete reorderings of a length-K sum differ by ρ_kernel = u_acc·sqrt(K/3)
//!   (each order's error has variance ≈ (u²/3)·Σ_k S_k² ≈ u²·K·‖y‖²/6 for random-sign terms
//!   with partial sums S_k; Higham & Mary 2019). K is read off the data: the last dimension of
//!   the first input (the tokens, elements / last dimension, for a weight gradient). Skipped
//!   only when the module's inputs are identical in both runs and none of its tensors is
//!   sharded on the candidate's mesh: the same program on the same data and shapes is
//!   deterministic (a kernel on a sharded shape may block, and so sum, differently — PyTorch's
//!   CPU column sum of a [32, 16] slice does not add in the order of the [32, 32] one).
//! * output rounding: ρ_pre = ρ_q + ρ_order + ρ_kernel; when the tensor's dtype is coarser than the
//!   accumulation format, elements flip by one ulp with probability |d|/ulp: the flip energy
//!   (relative to ‖t‖²) has mean μ ≤ 2·u_out·ρ_pre and terms ≤ W = (2u_out·max|t|)²/‖t‖².
//! * tail, x = ln(1/δ), δ = 10⁻⁶: the continuous parts (ρ_pre² + ρ_comb², n contributions)
//!   get the Laurent–Massart χ² factor 1 + 2·sqrt(x/n) + 2x/n (Ann. Statist. 28(5), 2000,
//!   Lemma 1); the flip energy, a sum of independent bounded terms, its Bernstein bound
//!   μ + W·x/3 + sqrt(W²x²/9 + 2Wμx) (Boucheron, Lugosi & Massart, *Concentration
//!   Inequalities*, 2013, Thm. 2.10) — which stays valid when fewer than one flip is expected.
//!   threshold = ‖t_ref‖·sqrt(continuous·χ² factor + flip bound).
//!
//! u is the unit roundoff 2^-p of each format (not machine epsilon 2^(1-p)).
//!
//! This is a statistical model with calibrated gain allowances κ, not a proof: the sources are
//! the round-to-nearest error model (Higham, *Accuracy and Stability of Numerical
//! Algorithms*, 2nd ed., §2.2 and Thm. 2.2), the probabilistic rounding analysis of Higham &
//! Mary (SIAM J. Sci. Comput. 41(5), 2019) for the variance of independent rounding errors,
//! and κ measured on ttrace's own simulated runs (`papers/checking.md` §4 gives the
//! calibration and the false-alarm and detection rates measured with it). Because every
//! tensor is judged against the differences its *own inputs* carry, the first failing tensor
//! in execution order is the first module whose output its inputs do not explain: checking
//! and localization are the same test.

use serde::{Deserialize, Serialize};

use crate::format::Format;
use crate::io::ModuleInfo;
use crate::policy::{OpClass, Pass, Recipe};
use crate::trace::id::{TensorId, TensorRole};
use crate::trace::ModuleKind;
use crate::trace::{Axis, Layout, Mesh, Placement};

/// How a tensor's threshold was priced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pricing {
    /// The producer's threshold from the reference manifest (`ttrace simulate --dump`).
    Producer,
    /// The local model with the module kind from the manifest.
    Local,
    /// The local model with the generic gain allowance: the manifest gives no module kind.
    LocalGeneric,
    /// Not judged: an input of the module already differs by a non-finite amount.
    InputFailed,
    /// A model input (a consumed tensor listed before any produced one), which consistent
    /// generation makes identical, or a consumed tensor that cannot be merged or disagrees on
    /// non-finite values: threshold 0.
    ModelInput,
    /// Megatron's 4·1.03^(L+1)·ε·‖ref‖, ε of the coarser of the training and the stored
    /// dtypes: no inputs of the tensor are traced (its id does not follow the `{module}|…`
    /// convention).
    Megatron,
    /// A consumed tensor equal in the reference to an earlier produced one (the tensor passed
    /// between modules): it may differ no more than that tensor does, plus one unit roundoff
    /// of its format relative to its norm (a cast or a collective may lie between).
    Carried,
    /// A consumed tensor made by untraced code (equal to no earlier produced tensor): the
    /// larger of Megatron's rule and κ = 3 times the largest relative difference of an earlier
    /// produced tensor of its shape in the same pass.
    Untraced,
    /// Through the registry's op the manifest names (an attention core's output, a
    /// cross-entropy's loss and logits gradient): the exact op of both runs' inputs compared
    /// (the carried difference, measured) plus the op's threshold on both runs' own roundings
    /// (`check::attention_site`, `check::loss_site`).
    Op,
}

impl Pricing {
    /// The rule in words.
    pub fn describe(self) -> &'static str {
        match self {
            Pricing::Producer => "threshold priced by the producer (reference manifest)",
            Pricing::Local => "local model: measured input differences + the module's own rounding",
            Pricing::LocalGeneric => {
                "local model with the generic gain allowance (no module kind in the manifest)"
            }
            Pricing::InputFailed => {
                "not judged: an input already failed to merge or differs by NaN/Inf"
            }
            Pricing::ModelInput => {
                "consumed tensor: must merge, and the model's inputs must be identical"
            }
            Pricing::Megatron => {
                "fallback Megatron 4*1.03^(L+1)*eps*||ref||, eps of the coarser of the training \
                 and stored dtypes (no traced inputs for this id)"
            }
            Pricing::Carried => {
                "consumed tensor: may differ no more than the produced tensor it equals in the \
                 reference (+ u ||ref||)"
            }
            Pricing::Untraced => {
                "consumed tensor made by untraced code: max(Megatron's rule, 3 x the largest \
                 relative difference upstream: of its shape, or into a traced module enclosing \
                 its consumer)"
            }
            Pricing::Op => {
                "the registry's op: the exact op of both runs' inputs compared + the op's \
                 threshold on both runs' roundings"
            }
        }
    }
}

/// A tensor's difference priced through the registry's op it comes from (an attention core's
/// output, `check::attention_site`; a cross-entropy's loss or logits gradient,
/// `check::loss_site`): both parts absolute, on the Frobenius norm.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OpMeasure {
    /// The exact op of each run's inputs compared: the difference the inputs carry.
    pub carried: f64,
    /// The op's threshold on both runs' own roundings (probabilistic, at the check's δ).
    pub own: f64,
}

impl OpMeasure {
    /// The threshold: carried + own (the candidate minus the reference is the exact
    /// difference plus the two runs' rounding errors).
    pub fn threshold(&self) -> f64 {
        self.carried + self.own
    }
}

/// What pricing needs to know about one traced tensor of both runs.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorStat {
    /// ‖ref‖_F over the finite pairs.
    pub ref_norm: f64,
    /// Largest finite |ref| element.
    pub ref_max_abs: f64,
    /// ‖cand − ref‖_F over the finite pairs (∞ when non-finite values disagree).
    pub diff_norm: f64,
    /// Elements.
    pub elements: usize,
    /// Length of the last dimension (1 for a scalar).
    pub last_dim: usize,
    /// Number of dimensions.
    pub ndim: usize,
    /// Stored dtype of the reference.
    pub format: Format,
    /// The candidate's layout.
    pub layout: Layout,
    /// The reference's layout (replicated for a one-device reference; a sharded reference —
    /// a trusted configuration such as TP 2 — splits reductions of its own).
    pub ref_layout: Layout,
    /// Norm gain g measured on the reference (1 unless the tensor is a norm's input).
    pub norm_gain: f64,
    /// For the gradient arriving at a norm on the CPU in a format narrower than FP32: the
    /// relative error of its rows summed in order with every partial sum rounded to that
    /// format (`check::chain`), the stagnation of the norm's parameter gradients, which
    /// PyTorch's CPU kernel sums that way; 0 elsewhere.
    pub chain_error: f64,
    /// For a tensor whose module's manifest entry names its op (an attention core's output, a
    /// cross-entropy's loss and logits gradient): its difference priced through the op, which
    /// replaces the local model.
    pub op: Option<OpMeasure>,
    /// What produced it (the reference manifest's `module`).
    pub module: Option<ModuleInfo>,
    /// What produced it in the candidate (the candidate manifest's `module`): its arithmetic
    /// may differ from the reference's (a TF32 run checked against an FP32 one).
    pub cand_module: Option<ModuleInfo>,
}

impl TensorStat {
    /// ρ = ‖Δ‖/‖ref‖ (0 for identical tensors, ∞ for a difference against a zero reference).
    pub fn rel(&self) -> f64 {
        if self.diff_norm == 0.0 {
            0.0
        } else if self.ref_norm > 0.0 {
            self.diff_norm / self.ref_norm
        } else {
            f64::INFINITY
        }
    }
}

/// The norm gain g = sqrt(mean_rows ‖x_r‖² / ‖x_r − x̄_r‖²) of a tensor viewed as rows of
/// its last dimension (rows with zero spread are skipped; 1 for an empty tensor).
#[cfg(test)]
pub(crate) fn measured_norm_gain(values: &[f64], row: usize) -> f64 {
    norm_gain_by(values.len(), row, &mut |s, e, f| f(&values[s..e]))
}

/// A reader of a tensor's values: `read(start, end, f)` hands `f` the values `start..end`.
pub(crate) type ReadRange<'a> = dyn FnMut(usize, usize, &mut dyn FnMut(&[f64])) + 'a;

/// [`norm_gain`] of `len` values read through `read(start, end, f)`, which hands `f` the
/// values `start..end` in order (in pieces if it likes): each row is visited twice (its sums,
/// then its spread about the mean), so a stored tensor need not be decoded whole.
pub(crate) fn norm_gain_by(len: usize, row: usize, read: &mut ReadRange<'_>) -> f64 {
    if row < 2 || len == 0 {
        return 1.0;
    }
    let (mut acc, mut n) = (0.0, 0usize);
    for start in (0..len).step_by(row) {
        let end = (start + row).min(len);
        let (mut sum, mut total) = (0.0f64, 0.0f64);
        read(start, end, &mut |p| {
            for &x in p {
                sum += x;
                total += x * x;
            }
        });
        let mean = sum / (end - start) as f64;
        let mut spread = 0.0f64;
        read(start, end, &mut |p| {
            for &x in p {
                spread += (x - mean) * (x - mean);
            }
        });
        if spread > 0.0 && total.is_finite() {
            acc += total / spread;
            n += 1;
        }
    }
    if n == 0 {
        1.0
    } else {
        (acc / n as f64).sqrt()
    }
}

/// κ: how much a module kind may amplify a relative input difference (before its output
/// rounding). Calibrated on ttrace's simulated GPT runs, where the largest observed gains were
/// 1.7 (norm, before the measured norm gain is applied), 1.6 (linear backward), 1.25
/// (attention) and 1.1 (activation); `papers/checking.md` §4.
pub fn gain_allowance(kind: Option<ModuleKind>) -> f64 {
    match kind {
        Some(ModuleKind::Residual) => 1.0,
        Some(_) => 2.0,
        None => 3.0,
    }
}

/// The role of a traced id under the naming convention: the module it belongs to, the pass,
/// and whether it is produced by that module (outputs, input gradients, parameter gradients)
/// rather than consumed (inputs, arriving output gradients).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    /// The module's name.
    pub module: String,
    /// Forward or backward.
    pub pass: Pass,
    /// A parameter gradient.
    pub param_grad: bool,
    /// Produced by the module.
    pub produced: bool,
}

/// Parse `{module}|fwd.input.i`, `|fwd.output.i`, `|grad.output.i`, `|grad.input.i` and
/// `{module}.{param}|param_grad`; `None` for other ids.
pub fn role(id: &str) -> Option<Role> {
    let t = TensorId::parse(id)?;
    Some(Role {
        pass: t.pass(),
        param_grad: matches!(t.role, TensorRole::ParamGrad { .. }),
        produced: t.produced(),
        module: t.module,
    })
}

/// Every module's traced forward inputs and arriving gradients, in trace order, so that
/// [`price_local`] finds a tensor's inputs without scanning the trace.
#[derive(Debug, Clone, Default)]
pub struct InputIndex<'a> {
    fwd: std::collections::HashMap<&'a str, Vec<&'a String>>,
    bwd: std::collections::HashMap<&'a str, Vec<&'a String>>,
}

impl<'a> InputIndex<'a> {
    /// Index the consumed ids of a trace.
    pub fn new(ids: &'a [String]) -> InputIndex<'a> {
        let mut index = InputIndex::default();
        for id in ids {
            let Some(t) = TensorId::parse(id) else {
                continue;
            };
            let map = match t.role {
                TensorRole::FwdInput(_) => &mut index.fwd,
                TensorRole::GradOutput(_) => &mut index.bwd,
                _ => continue,
            };
            // The module's name as a slice of the id (the index borrows the ids).
            map.entry(&id[..t.module.len()]).or_default().push(id);
        }
        index
    }

    /// The traced inputs of module `module` in `pass`: its forward inputs, and in the backward
    /// pass also its arriving output gradients.
    pub fn of_module(&self, module: &str, pass: Pass) -> Vec<&'a String> {
        let mut out = self.fwd.get(module).cloned().unwrap_or_default();
        if pass == Pass::Backward {
            out.extend(self.bwd.get(module).cloned().unwrap_or_default());
        }
        out
    }

    /// The traced inputs of a produced id: the module's forward inputs, and for backward
    /// tensors also its arriving output gradients, in trace order; empty for consumed ids and
    /// ids outside the naming convention.
    pub fn of(&self, id: &str) -> Vec<&'a String> {
        let Some(r) = role(id) else {
            return vec![];
        };
        if !r.produced {
            return vec![];
        }
        let mut out = self.fwd.get(r.module.as_str()).cloned().unwrap_or_default();
        if r.pass == Pass::Backward {
            out.extend(self.bwd.get(r.module.as_str()).cloned().unwrap_or_default());
        }
        out
    }
}

/// The format PyTorch's CPU kernels accumulate a norm's parameter gradients in over the
/// tokens, where either run computed them there in a format narrower than FP32: that format,
/// not FP32. ATen's CPU LayerNorm backward (`aten/src/ATen/native/cpu/layer_norm_kernel.cpp`,
/// `LayerNormBackwardKernelImplInternal`) gives each thread a buffer of the input's dtype and
/// adds every row's term (computed in FP32) into it — a sequential accumulation rounded to
/// BF16 or FP16 after each row — then adds the threads' buffers in FP32. Measured (torch 2.x,
/// CPU, BF16, 2 threads, Gaussian data, 64 channels): the bias gradient errs from the exact
/// sum by 0.85 ε at 64 rows, 2.7 ε at 512 and 5.6 ε at 4,096; a correct DTensor TP 2 + SP
/// step (hidden 128, 2,048 tokens) failed the FP32 model's thresholds by up to 3.6× on all
/// four norm parameter gradients (each rank sums its half of the tokens in other chains).
/// Such a sum stagnates beyond the model's random walk (√k) once its terms are small against
/// the running sum: the kernel term then takes twice the error of the chain run on the
/// arriving gradient's rows (`check::chain`; `papers/checking.md` §6). `None` elsewhere (a
/// GPU's kernels accumulate in FP32).
pub(crate) fn cpu_narrow_accumulation(
    kind: Option<ModuleKind>,
    role: &Role,
    reference: Option<&ModuleInfo>,
    candidate: Option<&ModuleInfo>,
    format: Format,
) -> Option<Format> {
    (kind == Some(ModuleKind::Norm) && role.param_grad)
        .then(|| narrow_on_cpu(reference, candidate, format))
        .flatten()
}

/// `format` where it is narrower than FP32 and either run's module ran on the CPU.
pub(crate) fn narrow_on_cpu(
    reference: Option<&ModuleInfo>,
    candidate: Option<&ModuleInfo>,
    format: Format,
) -> Option<Format> {
    let on_cpu = |m: Option<&ModuleInfo>| {
        m.and_then(|m| m.arith.device.as_deref())
            .is_some_and(|d| d == "cpu")
    };
    (format.precision() < Format::F32.precision() && (on_cpu(reference) || on_cpu(candidate)))
        .then_some(format)
}

fn class(kind: ModuleKind, role: &Role) -> OpClass {
    match (kind, role.pass, role.param_grad) {
        (ModuleKind::Linear, Pass::Forward, _) | (ModuleKind::Attention, Pass::Forward, _) => {
            OpClass::Matmul
        }
        (ModuleKind::Linear, Pass::Backward, true) => OpClass::MatmulGradWeight,
        (ModuleKind::Linear, Pass::Backward, false)
        | (ModuleKind::Attention, Pass::Backward, _) => OpClass::MatmulGradInput,
        (ModuleKind::Norm, _, _) => OpClass::Norm,
        (ModuleKind::Loss, _, _) => OpClass::Loss,
        _ => OpClass::Elementwise,
    }
}

/// Which input dimensions a module reduces over (`None`: unknown, judge by layouts alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduced {
    /// No reduction (elementwise).
    Nothing,
    /// The last dimension (a linear's contraction, a norm's statistics, a softmax row).
    Last,
    /// Every dimension but the last (the tokens of a weight or embedding gradient).
    AllButLast,
    /// Every dimension (a loss).
    All,
}

/// The dimensions the module of `role` reduces over, by kind.
pub fn reduced(kind: Option<ModuleKind>, role: &Role) -> Option<Reduced> {
    use ModuleKind as K;
    Some(match (kind?, role.param_grad) {
        (_, true) => Reduced::AllButLast,
        (K::Linear, false) | (K::Norm, false) => Reduced::Last,
        (K::Loss, false) => Reduced::All,
        // Attention reduces over keys, which context parallelism splits (handled apart).
        (K::Attention, false) => Reduced::Nothing,
        (K::Activation | K::Residual | K::Embedding, false) => Reduced::Nothing,
    })
}

fn split_dim(p: Placement) -> Option<usize> {
    match p {
        Placement::Split { dim, .. } | Placement::CpChunks { dim } => Some(dim),
        _ => None,
    }
}

/// The number of ranks a reduction of the module is split over: the product of the sizes of
/// the mesh axes along which some input (of `ranks` dimensions) is split along a reduced
/// dimension — or, when the reduced dimensions are unknown, split while the output is
/// replicated or partial along that axis.
pub fn split_factor(
    output: &Layout,
    inputs: &[(Layout, usize)],
    mesh: &Mesh,
    reduced: Option<Reduced>,
) -> usize {
    mesh.axes()
        .iter()
        .filter(|(a, _)| {
            let out = output.along(a);
            inputs.iter().any(|(l, ranks)| {
                let Some(d) = split_dim(l.along(a)) else {
                    return false;
                };
                let last = ranks.saturating_sub(1);
                match reduced {
                    Some(Reduced::Nothing) => false,
                    Some(Reduced::Last) => d == last,
                    Some(Reduced::AllButLast) => d != last,
                    Some(Reduced::All) => true,
                    None => matches!(out, Placement::Replicate | Placement::Partial),
                }
            }) || matches!(out, Placement::Partial)
        })
        .map(|(_, n)| n)
        .product()
}

/// Everything the local model needs besides the tensors' statistics.
#[derive(Debug, Clone)]
pub struct PriceContext {
    /// The candidate's mesh.
    pub mesh: Mesh,
    /// The reference's mesh ([`Mesh::single`] for a one-device reference).
    pub ref_mesh: Mesh,
    /// The microbatches the candidate's step ran as (1: none): a parameter's gradient is
    /// accumulated over them, another split of its tokens.
    pub microbatches: usize,
    /// The same of the reference.
    pub ref_microbatches: usize,
    /// The recipe named by the reference manifest, if ttrace knows it.
    pub recipe: Option<Recipe>,
    /// ln(1/δ) for the tail.
    pub log_inv_delta: f64,
}

/// A priced threshold: absolute, on ‖cand − ref‖_F.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Priced {
    /// The threshold.
    pub threshold: f64,
    /// How it was priced.
    pub pricing: Pricing,
}

/// Whether a tensor of `layout` is split or partial along an axis of more than one rank: its
/// shards have other shapes than the logical tensor.
fn sharded(layout: &Layout, mesh: &Mesh) -> bool {
    mesh.axes()
        .iter()
        .any(|(a, n)| *n > 1 && !matches!(layout.along(a), Placement::Replicate))
}

fn coarser(a: Format, b: Format) -> bool {
    a.precision() < b.precision()
}

fn coarser_of(a: Format, b: Format) -> Format {
    if coarser(b, a) {
        b
    } else {
        a
    }
}

/// What one run's recorded arithmetic does to a module's reductions.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Effective {
    /// The format its matmuls round their inputs to, when coarser than the inputs' own.
    quantize: Option<Format>,
    /// The format its results are rounded to: the stored dtype, or the autocast dtype where
    /// that is coarser.
    out: Format,
}

/// The arithmetic of a module call (its `module` entry's autocast and FP32 matmul precision)
/// applied to a module of `kind`: matmuls (linear, attention, and modules of unknown kind,
/// which may hold any) take their inputs in the autocast dtype and round their results to it
/// (autocast's lower-precision op list), or round FP32 inputs to TF32 / BF16; norms, losses,
/// activations, residual additions and embeddings run in their tensors' dtypes (autocast's
/// FP32 list or unaffected).
fn effective(
    info: Option<&ModuleInfo>,
    kind: Option<ModuleKind>,
    input: Option<Format>,
    stored: Format,
) -> Effective {
    let none = Effective {
        quantize: None,
        out: stored,
    };
    let Some(a) = info.map(|m| &m.arith) else {
        return none;
    };
    if !matches!(
        kind,
        None | Some(ModuleKind::Linear) | Some(ModuleKind::Attention)
    ) {
        return none;
    }
    let coarser_than_input = |q: Format| input.is_some_and(|f| coarser(q, f));
    if let Some(dtype) = a.autocast.filter(|f| coarser(*f, Format::F32)) {
        return Effective {
            quantize: Some(dtype).filter(|q| coarser_than_input(*q)),
            out: coarser_of(stored, dtype),
        };
    }
    // FP32 inputs only: the precision settings concern FP32 matmuls (and, for a module of
    // unknown kind, convolutions).
    let reduced = match kind {
        None => [a.fp32_matmul, a.fp32_conv]
            .into_iter()
            .flatten()
            .min_by_key(|f| f.precision()),
        _ => a.fp32_matmul,
    };
    Effective {
        quantize: reduced.filter(|q| input == Some(Format::F32) && coarser(*q, Format::F32)),
        out: stored,
    }
}

/// Price the threshold of the produced tensor `id` by the local model (module docs).
/// `inputs` indexes the trace's consumed ids; `stat(j)` gives the statistics of any traced
/// id, `None` for an id that is not traced.
/// Returns `None` when the id has no traced inputs and is not an embedding output (the caller
/// falls back).
pub fn price_local<'s>(
    id: &str,
    inputs: &InputIndex<'_>,
    stat: &dyn Fn(&str) -> Option<&'s TensorStat>,
    ctx: &PriceContext,
) -> Option<Priced> {
    let role = role(id)?;
    let me = stat(id)?;
    if let Some(m) = me.op {
        return Some(Priced {
            threshold: m.threshold(),
            pricing: Pricing::Op,
        });
    }
    let info = me.module.clone();
    let kind = info.as_ref().and_then(|m| m.kind);
    let input_ids = inputs.of(id);
    let input_ids: Vec<&String> = input_ids
        .into_iter()
        .filter(|j| stat(j).is_some())
        .collect();
    let inputs: Vec<&TensorStat> = input_ids.iter().filter_map(|j| stat(j)).collect();
    if inputs.is_empty() && !(kind == Some(ModuleKind::Embedding) && role.pass == Pass::Forward) {
        return None;
    }
    let pricing = if kind.is_some() {
        Pricing::Local
    } else {
        Pricing::LocalGeneric
    };
    let out_norm = me.ref_norm;
    // Carried difference, relative to ‖t_ref‖.
    let carried = if kind == Some(ModuleKind::Residual) {
        // Linear in its inputs: the backward pass sees only the arriving gradient.
        // A parameter's gradient (an added bias's) sums the arriving gradient over the rows
        // the parameter was broadcast to: ‖Σ_t Δ_t‖ ≤ √rows·‖Δ‖_F (Cauchy–Schwarz), reached
        // when the rows' differences align — as a one-sided TF32 or autocast run makes them.
        let abs: f64 = input_ids
            .iter()
            .zip(&inputs)
            .filter(|(j, _)| {
                role.pass == Pass::Forward
                    || TensorId::parse(j)
                        .is_some_and(|t| matches!(t.role, TensorRole::GradOutput(_)))
            })
            .map(|(_, s)| {
                if role.param_grad {
                    let rows = s.elements as f64 / me.elements.max(1) as f64;
                    s.diff_norm * rows.max(1.0).sqrt()
                } else {
                    s.diff_norm
                }
            })
            .sum();
        if abs == 0.0 {
            0.0
        } else if out_norm > 0.0 {
            abs / out_norm
        } else {
            // An all-zero reference output: x + y = 0 exactly (round-to-nearest gives 0 only
            // for an exact 0, gradual underflow assumed), so the candidate is fl(Δx + Δy) and
            // ‖cand − ref‖ ≤ (1 + u)·Σ‖Δ‖ — an absolute bound where relative ones divide by 0.
            return Some(Priced {
                threshold: abs * (1.0 + me.format.unit_roundoff()),
                pricing,
            });
        }
    } else {
        let gain = if kind == Some(ModuleKind::Norm) {
            inputs.iter().map(|s| s.norm_gain).fold(1.0, f64::max)
        } else {
            1.0
        };
        gain_allowance(kind) * gain * inputs.iter().map(|s| s.rel()).sum::<f64>()
    };
    if !carried.is_finite() {
        if inputs.iter().any(|s| !s.diff_norm.is_finite()) {
            // An input failed (it is judged, and reported, itself).
            return Some(Priced {
                threshold: f64::INFINITY,
                pricing: Pricing::InputFailed,
            });
        }
        // An input whose reference is all zero differs: no relative measure carries it, and
        // nothing failed — priced by the fallback rule instead of left unjudged.
        return None;
    }
    // Formats: metadata, else the recipe's policy, else defaults.
    let policy = match (&ctx.recipe, kind) {
        (Some(r), Some(k)) => Some(r.policy(class(k, &role), role.pass).clone()),
        _ => None,
    };
    let input_format = inputs
        .iter()
        .map(|s| s.format)
        .min_by_key(|f| f.precision());
    // The arithmetic each run recorded (autocast, TF32): what its matmuls quantized their
    // inputs to and rounded their results to, beyond the stored dtypes.
    let (ar, ac) = (
        effective(info.as_ref(), kind, input_format, me.format),
        effective(
            me.cand_module.as_ref().or(info.as_ref()),
            kind,
            input_format,
            me.format,
        ),
    );
    let out = ar.out;
    let declared = info
        .as_ref()
        .and_then(|m| m.quantize)
        .or_else(|| policy.as_ref().map(|p| p.accumulation.input))
        .filter(|q| input_format.is_some_and(|f| coarser(*q, f)));
    // Both runs round their inputs to the same grid: differences flip roundings (below). Only
    // one of them does, or to another grid: an input difference of its own (`one_sided`).
    let quantize = declared.or(if ar.quantize == ac.quantize {
        ar.quantize
    } else {
        None
    });
    let one_sided = if declared.is_none() && ar.quantize != ac.quantize {
        let u = |q: Option<Format>| q.map_or(0.0, Format::unit_roundoff);
        // Each operand's elements move by at most u of themselves, with mean square at most
        // u²/3 of theirs (rounding to nearest, uniform phase); two operands, the kind's gain.
        gain_allowance(kind) * 2.0 * u(ar.quantize).max(u(ac.quantize)) / 3f64.sqrt()
    } else {
        0.0
    };
    let carried = carried + one_sided;
    let default_acc = if out == Format::F64 {
        Format::F64
    } else {
        Format::F32
    };
    let narrow = info.as_ref().and_then(|m| m.accumulate).is_none()
        && cpu_narrow_accumulation(
            kind,
            &role,
            info.as_ref(),
            me.cand_module.as_ref(),
            me.format,
        )
        .is_some();
    let acc = info
        .as_ref()
        .and_then(|m| m.accumulate)
        .or_else(|| narrow.then_some(me.format))
        .or_else(|| policy.as_ref().map(|p| p.accumulation.accumulator))
        .unwrap_or(default_acc);
    // Partial results split across ranks are rounded to the module's output format (the
    // autocast dtype, where the stored one is wider) before they are combined.
    let combine = info
        .as_ref()
        .and_then(|m| m.combine)
        .unwrap_or(coarser_of(out, ac.out));
    // Below a format's smallest normal value its spacing stops shrinking: a rounding there errs
    // by up to half the smallest subnormal λ whatever the value (FP16 gradients without loss
    // scaling live there). Per rounding of n values of norm ‖x‖ this adds at most n·λ²/12 to
    // the squared error (uniform phase), relative λ²·n/(12‖x‖²); a flip moves a value by one
    // spacing, at most max(2u|x|, λ).
    let floor = |f: Format, elements: usize, norm: f64| -> f64 {
        if norm > 0.0 {
            f.min_subnormal() * (elements as f64).sqrt() / norm
        } else {
            0.0
        }
    };
    let rho_q = match quantize {
        Some(q) if carried > 0.0 => {
            let sub = inputs
                .iter()
                .map(|i| floor(q, i.elements, i.ref_norm))
                .fold(0.0, f64::max);
            (carried * carried + (2.0 * q.unit_roundoff() + sub) * carried).sqrt()
        }
        _ => carried,
    };
    // Order: reductions split across ranks.
    let layouts: Vec<(Layout, usize)> = inputs.iter().map(|s| (s.layout.clone(), s.ndim)).collect();
    // Attention under context parallelism reduces over keys split across the CP ranks.
    let cp = |layouts: &[(Layout, usize)], mesh: &crate::trace::Mesh| {
        let split_keys = layouts.iter().any(|(l, _)| {
            matches!(
                l.along(&Axis::CP),
                Placement::CpChunks { .. } | Placement::Split { .. }
            )
        });
        if kind == Some(ModuleKind::Attention) && mesh.size(&Axis::CP) > 1 && split_keys {
            mesh.size(&Axis::CP)
        } else {
            1
        }
    };
    // Microbatches split a parameter gradient's tokens as ranks do: one more partial sum each.
    let accumulated = |m: usize| if role.param_grad { m.max(1) } else { 1 };
    let mut s = split_factor(&me.layout, &layouts, &ctx.mesh, reduced(kind, &role))
        * cp(&layouts, &ctx.mesh)
        * accumulated(ctx.microbatches);
    // A sharded reference combines partial results of its own: its roundings join the
    // candidate's (the order term counts both runs' splits).
    let ref_layouts: Vec<(Layout, usize)> = inputs
        .iter()
        .map(|s| (s.ref_layout.clone(), s.ndim))
        .collect();
    let s_ref = split_factor(
        &me.ref_layout,
        &ref_layouts,
        &ctx.ref_mesh,
        reduced(kind, &role),
    ) * cp(&ref_layouts, &ctx.ref_mesh)
        * accumulated(ctx.ref_microbatches);
    if s_ref > 1 {
        s = if s > 1 { s + s_ref } else { s_ref };
    }
    let spread = |f: Format| {
        let lambda = floor(f, me.elements, out_norm);
        (2.0 * s as f64 * (f.unit_roundoff().powi(2) / 3.0 + lambda * lambda / 12.0)).sqrt()
    };
    let (rho_order, rho_comb) = if s <= 1 {
        (0.0, 0.0)
    } else if coarser(combine, acc) {
        (0.0, spread(combine))
    } else {
        (spread(acc), 0.0)
    };
    let k = inputs.first().map_or(1, |f| {
        if role.param_grad {
            f.elements / f.last_dim.max(1)
        } else {
            f.last_dim
        }
    });
    // The candidate runs the module's kernels on other shapes when anything it reads or writes
    // is sharded (a column-parallel slice, a batch shard): another blocking, another order.
    let reshaped = sharded(&me.layout, &ctx.mesh)
        || layouts.iter().any(|(l, _)| sharded(l, &ctx.mesh))
        || sharded(&me.ref_layout, &ctx.ref_mesh)
        || ref_layouts.iter().any(|(l, _)| sharded(l, &ctx.ref_mesh));
    // FP8 products on a GPU accumulate in its tensor cores' 14-bit truncating accumulator
    // (papers/formats-and-orders.md §5.1), not in FP32: each block step of their reduction
    // errs by up to ε₁₄ = 2^-13 of the running sum, so the kernel term takes that unit in
    // place of the accumulation format's — conservative against the measured errors (relative
    // 1e-4 to 1.4e-3 for K = 2048 to 16384 on an H100, against 2^-13·sqrt(K/3) = 3e-3 to 9e-3).
    let on_gpu = |m: Option<&ModuleInfo>| {
        m.and_then(|m| m.arith.device.as_deref())
            .is_some_and(|d| d == "cuda")
    };
    let fp8_tensor_cores = quantize.is_some_and(|q| matches!(q, Format::E4M3 | Format::E5M2))
        && (on_gpu(info.as_ref()) || on_gpu(me.cand_module.as_ref()));
    let u_kernel = if fp8_tensor_cores {
        crate::format::pow2(-13).max(acc.unit_roundoff())
    } else {
        acc.unit_roundoff()
    };
    // A narrow sequential sum on the CPU stagnates beyond the random walk: its error run on
    // the arriving gradient's rows (`check::chain`) stands for each run's, so the two runs
    // differ by up to twice it.
    let chain = if narrow {
        inputs.iter().map(|i| i.chain_error).fold(0.0, f64::max)
    } else {
        0.0
    };
    let rho_kernel = if carried > 0.0 || s > 1 || reshaped {
        (u_kernel * (k.max(1) as f64 / 3.0).sqrt()).max(2.0 * chain)
    } else {
        0.0
    };
    let pre = rho_q + rho_order + rho_kernel;
    // One run rounds its results to a coarser format than the other (autocast on one side
    // only): an independent rounding, relative mean square at most u²/3.
    let rho_out = if ar.out != ac.out {
        let f = coarser_of(ar.out, ac.out);
        let lambda = floor(f, me.elements, out_norm);
        (f.unit_roundoff().powi(2) / 3.0 + lambda * lambda / 12.0).sqrt()
    } else {
        0.0
    };
    let out = coarser_of(out, ac.out);
    let u_out = out.unit_roundoff();
    let flips = coarser(out, acc) && pre > 0.0;
    let n = me.elements.max(1) as f64;
    let x = ctx.log_inv_delta;
    // Continuous parts (n contributions): χ² tail.
    let tail2 = 1.0 + 2.0 * (x / n).sqrt() + 2.0 * x / n;
    let mut energy = (pre * pre + rho_comb * rho_comb + rho_out * rho_out) * tail2;
    if flips {
        // Flip energy Σ B_i·ulp_i² with P(B_i) = |d_i|/ulp_i: mean μ ≤ 2u·ρ_pre (relative to
        // ‖t‖²), each term ≤ W = (2u·max|t|)²/‖t‖²; Bernstein's inequality bounds it at
        // δ by μ + W·x/3 + sqrt(W²x²/9 + 2Wμx) — valid however few flips are expected.
        // Spacings at the subnormal floor: Σ|d_i|·λ ≤ λ·√n·‖d‖ adds λ√n/‖t‖ · ρ_pre.
        let mu = (2.0 * u_out + floor(out, me.elements, out_norm)) * pre;
        let w = if out_norm > 0.0 {
            ((2.0 * u_out * me.ref_max_abs).max(out.min_subnormal()) / out_norm).powi(2)
        } else {
            0.0
        };
        energy += mu + w * x / 3.0 + (w * w * x * x / 9.0 + 2.0 * w * mu * x).sqrt();
    }
    Some(Priced {
        threshold: out_norm * energy.sqrt(),
        pricing,
    })
}

#[cfg(test)]
mod tests;
