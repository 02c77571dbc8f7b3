//! A tiny GPT-style model on the engine: one training step (forward and backward) with a full
//! trace, and replay of any single module on substituted inputs.
//!
//! Architecture: embedding (token + position) → N × [LN → attention (QKV linear, causal
//! attention core, output projection) → residual → LN → MLP (fc1, GELU, fc2) → residual] →
//! final LN → LM head (no bias) → mean cross-entropy loss.
//!
//! Module names (canonical, as in the trace): `embedding`, `layers.{i}.ln1`,
//! `layers.{i}.attn.qkv`, `layers.{i}.attn.core`, `layers.{i}.attn.proj`, `layers.{i}.resid1`,
//! `layers.{i}.ln2`, `layers.{i}.mlp.fc1`, `layers.{i}.mlp.act`, `layers.{i}.mlp.fc2`,
//! `layers.{i}.resid2`, `final_ln`, `lm_head`, `loss`. Parameters are `{module}.weight`,
//! `{module}.bias`, `embedding.wte`, `embedding.wpe`; linear weights use PyTorch's
//! [out_features, in_features] layout.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::engine::attention::{attention, attention_backward, AttentionSaved};
use crate::engine::matmul::{column_sums, matmul_scaled, transpose};
use crate::engine::nn::{
    self, cross_entropy, cross_entropy_backward, embedding, embedding_backward, gelu,
    gelu_backward, layer_norm, norm_backward, rms_norm, silu, silu_backward, NormSaved,
};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::{delayed_scale, per_tensor_scale, OpClass, Pass, Policy, Recipe, Scaling};
use crate::policy::{AttentionImpl, Variance};
use crate::random::{normal_values, uniform_ints};
use crate::tensor::Tensor;
use crate::trace::id::TensorId;
use crate::trace::id::Trace;
use crate::trace::ModuleKind;

/// Which normalization the blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// LayerNorm with weight and bias.
    #[default]
    LayerNorm,
    /// RMSNorm with weight only.
    RmsNorm,
}

/// Which activation the MLP uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// GELU, tanh form.
    #[default]
    Gelu,
    /// SiLU.
    Silu,
}

/// Shape and options of the tiny GPT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Number of transformer blocks.
    pub layers: usize,
    /// Hidden size (divisible by `heads`).
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Sequence length.
    pub seq: usize,
    /// Batch size.
    pub batch: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// MLP expansion (fc1 has `ffn_mult · hidden` outputs).
    pub ffn_mult: usize,
    /// Normalization epsilon.
    pub norm_eps: f64,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
    /// LayerNorm variance algorithm.
    pub variance: Variance,
    /// MLP activation.
    pub activation: Activation,
    /// Attention algorithm.
    pub attention: AttentionImpl,
    /// Global seed of the consistent generator.
    pub seed: u64,
}

impl Default for GptConfig {
    /// 2 layers, hidden 64, 4 heads, sequence 32, batch 2, vocabulary 128.
    fn default() -> Self {
        GptConfig {
            layers: 2,
            hidden: 64,
            heads: 4,
            seq: 32,
            batch: 2,
            vocab: 128,
            ffn_mult: 4,
            norm_eps: 1e-5,
            norm: NormKind::LayerNorm,
            variance: Variance::TwoPass,
            activation: Activation::Gelu,
            attention: AttentionImpl::Standard,
            seed: 1234,
        }
    }
}

impl GptConfig {
    /// Check sizes: all positive, hidden divisible by heads.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("seq", self.seq),
            ("batch", self.batch),
            ("vocab", self.vocab),
            ("ffn_mult", self.ffn_mult),
        ] {
            if v == 0 {
                return Err(Error::InvalidParameter {
                    name,
                    reason: "must be at least 1 (got 0)".into(),
                });
            }
        }
        if self.hidden % self.heads != 0 {
            return Err(Error::InvalidParameter {
                name: "heads",
                reason: format!(
                    "hidden = {} is not divisible by heads = {}",
                    self.hidden, self.heads
                ),
            });
        }
        if !(self.norm_eps >= 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::InvalidParameter {
                name: "norm_eps",
                reason: format!("must be finite and non-negative (got {})", self.norm_eps),
            });
        }
        Ok(())
    }
}

/// One module invocation in the model's execution order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Module {
    /// Canonical name.
    pub name: String,
    /// What it computes.
    pub kind: ModuleKind,
    /// Value slots it reads.
    pub inputs: Vec<usize>,
    /// Value slot it writes.
    pub output: usize,
    /// Parameter names it uses.
    pub params: Vec<String>,
}

#[derive(Debug, Clone)]
enum Saved {
    None,
    Norm(NormSaved),
    Attention(Box<AttentionSaved>),
}

/// Gradients of one module: one per input, then (parameter name, gradient) pairs.
pub type ModuleGrads = (Vec<Tensor>, Vec<(String, Tensor)>);

/// A hook called by [`Gpt::step_with`] with the canonical id of each produced tensor.
pub type StepHook<'a> = dyn FnMut(&str, &mut Tensor) -> Result<()> + 'a;

/// Result of one training step.
#[derive(Debug, Clone)]
pub struct StepResult {
    /// The loss value.
    pub loss: f64,
    /// Every traced tensor, in execution order.
    pub trace: Trace,
}

/// Builds the module list and generates the parameters of [`Gpt::new`].
struct Builder {
    modules: Vec<Module>,
    params: BTreeMap<String, Tensor>,
    next_value: usize,
    seed: u64,
    format: Format,
    norm: NormKind,
    hidden: usize,
}

impl Builder {
    /// Generate the parameter `name` (mean + std·normal, rounded to the parameter format).
    fn param(&mut self, name: &str, shape: &[usize], mean: f64, std: f64) -> Result<String> {
        let values = normal_values(name, shape.iter().product(), mean, std, self.seed);
        let t = Tensor::rounded(shape, values, self.format, Overflow::Saturating)?;
        self.params.insert(name.to_string(), t);
        Ok(name.to_string())
    }

    /// Append a module reading `inputs`; returns the value slot of its output.
    fn push(
        &mut self,
        name: &str,
        kind: ModuleKind,
        inputs: Vec<usize>,
        params: Vec<String>,
    ) -> usize {
        self.next_value += 1;
        self.modules.push(Module {
            name: name.to_string(),
            kind,
            inputs,
            output: self.next_value,
            params,
        });
        self.next_value
    }

    /// A linear layer [out, in] with N(0, 0.02²) weights and bias.
    fn linear(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
        input: usize,
    ) -> Result<usize> {
        let mut names = vec![self.param(&format!("{name}.weight"), &[out, inp], 0.0, 0.02)?];
        if bias {
            names.push(self.param(&format!("{name}.bias"), &[out], 0.0, 0.02)?);
        }
        Ok(self.push(name, ModuleKind::Linear, vec![input], names))
    }

    /// A normalization with weight N(1, 0.1²) and (LayerNorm) bias N(0, 0.1²).
    fn norm(&mut self, name: &str, input: usize) -> Result<usize> {
        let h = self.hidden;
        let mut names = vec![self.param(&format!("{name}.weight"), &[h], 1.0, 0.1)?];
        if self.norm == NormKind::LayerNorm {
            names.push(self.param(&format!("{name}.bias"), &[h], 0.0, 0.1)?);
        }
        Ok(self.push(name, ModuleKind::Norm, vec![input], names))
    }
}

/// The tiny GPT with its parameters, data and FP8 scaling state.
#[derive(Debug, Clone)]
pub struct Gpt {
    config: GptConfig,
    recipe: Recipe,
    modules: Vec<Module>,
    params: BTreeMap<String, Tensor>,
    tokens: Vec<usize>,
    targets: Vec<usize>,
    /// Amax history per quantized operand (`{module}.input`, `.weight`, `.grad`).
    amax_history: HashMap<String, Vec<f64>>,
    /// Scales used in the last step, for exact replay.
    scales_used: HashMap<String, f64>,
    /// FP8 scales imposed on the next steps (see [`Gpt::set_scale_overrides`]).
    scale_overrides: HashMap<String, f64>,
}

impl Gpt {
    /// Build the model: modules, parameters and data generated from the config's seed and
    /// each tensor's canonical name, rounded into the recipe's parameter format.
    pub fn new(config: GptConfig, recipe: Recipe) -> Result<Gpt> {
        config.validate()?;
        recipe.validate()?;
        let c = config.clone();
        let mut b = Builder {
            modules: vec![],
            params: BTreeMap::new(),
            next_value: 0,
            seed: c.seed,
            format: recipe.param_format,
            norm: c.norm,
            hidden: c.hidden,
        };
        let wte = b.param("embedding.wte", &[c.vocab, c.hidden], 0.0, 0.02)?;
        let wpe = b.param("embedding.wpe", &[c.seq, c.hidden], 0.0, 0.01)?;
        let mut x = b.push("embedding", ModuleKind::Embedding, vec![], vec![wte, wpe]);
        let (h, ffn) = (c.hidden, c.ffn_mult * c.hidden);
        for l in 0..c.layers {
            let p = format!("layers.{l}");
            let ln1 = b.norm(&format!("{p}.ln1"), x)?;
            let qkv = b.linear(&format!("{p}.attn.qkv"), 3 * h, h, true, ln1)?;
            let core = b.push(
                &format!("{p}.attn.core"),
                ModuleKind::Attention,
                vec![qkv],
                vec![],
            );
            let proj = b.linear(&format!("{p}.attn.proj"), h, h, true, core)?;
            let r1 = b.push(
                &format!("{p}.resid1"),
                ModuleKind::Residual,
                vec![x, proj],
                vec![],
            );
            let ln2 = b.norm(&format!("{p}.ln2"), r1)?;
            let fc1 = b.linear(&format!("{p}.mlp.fc1"), ffn, h, true, ln2)?;
            let act = b.push(
                &format!("{p}.mlp.act"),
                ModuleKind::Activation,
                vec![fc1],
                vec![],
            );
            let fc2 = b.linear(&format!("{p}.mlp.fc2"), h, ffn, true, act)?;
            x = b.push(
                &format!("{p}.resid2"),
                ModuleKind::Residual,
                vec![r1, fc2],
                vec![],
            );
        }
        let fln = b.norm("final_ln", x)?;
        let logits = b.linear("lm_head", c.vocab, h, false, fln)?;
        b.push("loss", ModuleKind::Loss, vec![logits], vec![]);
        let ntok = c.batch * c.seq;
        let tokens = uniform_ints("input.tokens", ntok, c.vocab, c.seed);
        let targets = uniform_ints("input.targets", ntok, c.vocab, c.seed);
        Ok(Gpt {
            config,
            recipe,
            modules: b.modules,
            params: b.params,
            tokens,
            targets,
            amax_history: HashMap::new(),
            scales_used: HashMap::new(),
            scale_overrides: HashMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The recipe.
    pub fn recipe(&self) -> &Recipe {
        &self.recipe
    }

    /// Modules in execution order.
    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// A module by name.
    pub fn module(&self, name: &str) -> Result<&Module> {
        self.modules
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| Error::UnknownName {
                kind: "module",
                name: name.to_string(),
            })
    }

    /// Every parameter, by name.
    pub fn params(&self) -> &BTreeMap<String, Tensor> {
        &self.params
    }

    /// A parameter by name.
    pub fn param(&self, name: &str) -> Result<&Tensor> {
        self.params.get(name).ok_or_else(|| Error::UnknownName {
            kind: "parameter",
            name: name.to_string(),
        })
    }

    /// Replace a parameter (same shape; values must be in the recipe's parameter format).
    pub fn set_param(&mut self, name: &str, value: Tensor) -> Result<()> {
        let old = self.param(name)?;
        if old.shape() != value.shape() {
            return Err(Error::ShapeMismatch {
                what: format!("set_param '{name}'"),
                expected: old.shape().to_vec(),
                found: value.shape().to_vec(),
            });
        }
        let v = value.cast(self.recipe.param_format, Overflow::NonSaturating);
        if v.values() != value.values() {
            return Err(Error::NotRepresentable {
                value: f64::NAN,
                format: self.recipe.param_format,
                what: format!("a value of parameter '{name}'"),
            });
        }
        self.params.insert(name.to_string(), v);
        Ok(())
    }

    /// Token ids, [batch, seq] row-major.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// Target ids, [batch, seq] row-major.
    pub fn targets(&self) -> &[usize] {
        &self.targets
    }

    fn policy(&self, class: OpClass, pass: Pass) -> &Policy {
        self.recipe.policy(class, pass)
    }

    fn scale_for(
        &mut self,
        key: String,
        t: &Tensor,
        policy: &Policy,
        fmt: Format,
        record: bool,
    ) -> Option<f64> {
        if !matches!(fmt, Format::E4M3 | Format::E5M2) {
            return None;
        }
        match policy.scaling {
            Scaling::PerTensorDelayed { margin } => {
                let s = if record {
                    let hist = self.amax_history.get(&key).cloned().unwrap_or_default();
                    let s = delayed_scale(&hist, fmt, margin);
                    let entry = self.amax_history.entry(key.clone()).or_default();
                    entry.push(t.amax());
                    let keep = self.recipe.amax_history_len.max(1);
                    if entry.len() > keep {
                        let drop = entry.len() - keep;
                        entry.drain(..drop);
                    }
                    let s = self.scale_overrides.get(&key).copied().unwrap_or(s);
                    self.scales_used.insert(key, s);
                    s
                } else {
                    self.scales_used.get(&key).copied().unwrap_or(1.0)
                };
                Some(s)
            }
            Scaling::PerTensorCurrent { margin } => {
                // The scale the quantizer would compute from this operand, unless imposed.
                let s = self
                    .scale_overrides
                    .get(&key)
                    .copied()
                    .unwrap_or_else(|| per_tensor_scale(t.amax(), fmt, margin));
                if record {
                    self.scales_used.insert(key, s);
                }
                Some(s)
            }
            _ => None,
        }
    }

    /// The per-tensor FP8 scales of the last step, by operand (`{module}.input`,
    /// `{module}.weight`, `{module}.grad`).
    pub fn scales(&self) -> &HashMap<String, f64> {
        &self.scales_used
    }

    /// Impose per-tensor FP8 scales (by operand key, as [`Gpt::scales`] names them) on the next
    /// steps instead of computing them (current scaling) or taking them from the amax history
    /// (delayed scaling; the history still advances). Comparing a sharded FP8 run against a
    /// reference that quantizes with the *candidate's* scales separates the continuous
    /// round-off from a scale that moved because one amax element differs — a discrete jump
    /// of every quantized value, checked on its own.
    pub fn set_scale_overrides(&mut self, scales: HashMap<String, f64>) {
        self.scale_overrides = scales;
    }

    /// Run one module forward on the given inputs (replay), with the parameters of this model
    /// and, for delayed FP8 scaling, the scales of the last step.
    pub fn forward_module(&mut self, name: &str, inputs: &[Tensor]) -> Result<Tensor> {
        let module = self.module(name)?.clone();
        Ok(self.run_forward(&module, inputs, false)?.0)
    }

    /// Run one module backward on the given forward inputs and output gradient (replay):
    /// returns the gradients for each input and each parameter (by name).
    pub fn backward_module(
        &mut self,
        name: &str,
        inputs: &[Tensor],
        grad_output: &Tensor,
    ) -> Result<ModuleGrads> {
        let module = self.module(name)?.clone();
        let (_, saved) = self.run_forward(&module, inputs, false)?;
        self.run_backward(&module, inputs, &saved, grad_output, false)
    }

    fn check_inputs(module: &Module, inputs: &[Tensor]) -> Result<()> {
        if inputs.len() != module.inputs.len() {
            return Err(Error::LengthMismatch {
                what: "module inputs",
                left: module.inputs.len(),
                right: inputs.len(),
            });
        }
        Ok(())
    }

    fn flatten(t: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let shape = t.shape().to_vec();
        let last = *shape.last().unwrap_or(&0);
        let rows = t.len().checked_div(last).unwrap_or(0);
        Ok((t.reshape(&[rows, last])?, shape))
    }

    fn run_forward(
        &mut self,
        m: &Module,
        inputs: &[Tensor],
        record: bool,
    ) -> Result<(Tensor, Saved)> {
        Self::check_inputs(m, inputs)?;
        let c = self.config.clone();
        match m.kind {
            ModuleKind::Embedding => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward).clone();
                let out = embedding(
                    &self.tokens,
                    c.batch,
                    c.seq,
                    self.param("embedding.wte")?,
                    self.param("embedding.wpe")?,
                    &p,
                )?;
                Ok((out, Saved::None))
            }
            ModuleKind::Norm => {
                let p = self.policy(OpClass::Norm, Pass::Forward).clone();
                let w = self.param(&m.params[0])?;
                let (out, saved) = match c.norm {
                    NormKind::LayerNorm => layer_norm(
                        &inputs[0],
                        w,
                        self.param(&m.params[1])?,
                        c.norm_eps,
                        c.variance,
                        &p,
                    )?,
                    NormKind::RmsNorm => rms_norm(&inputs[0], w, c.norm_eps, &p)?,
                };
                Ok((out, Saved::Norm(saved)))
            }
            ModuleKind::Linear => {
                let p = self.policy(OpClass::Matmul, Pass::Forward).clone();
                let (x2, shape) = Self::flatten(&inputs[0])?;
                let w = self.param(&m.params[0])?.clone();
                let sx = self.scale_for(format!("{}.input", m.name), &x2, &p, p.input(), record);
                let sw = self.scale_for(format!("{}.weight", m.name), &w, &p, p.rhs(), record);
                let b = match m.params.get(1) {
                    Some(n) => Some(self.param(n)?.clone()),
                    None => None,
                };
                let y = crate::engine::matmul::linear_scaled(&x2, &w, b.as_ref(), &p, sx, sw)?;
                let mut out_shape = shape;
                let last = out_shape.len() - 1;
                out_shape[last] = w.shape()[0];
                Ok((y.reshape(&out_shape)?, Saved::None))
            }
            ModuleKind::Attention => {
                let p = self.policy(OpClass::Softmax, Pass::Forward).clone();
                let (out, saved) = attention(&inputs[0], c.heads, true, c.attention, &p)?;
                Ok((out, Saved::Attention(Box::new(saved))))
            }
            ModuleKind::Activation => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward).clone();
                let out = match c.activation {
                    Activation::Gelu => gelu(&inputs[0], &p)?,
                    Activation::Silu => silu(&inputs[0], &p)?,
                };
                Ok((out, Saved::None))
            }
            ModuleKind::Residual => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward).clone();
                Ok((nn::add(&inputs[0], &inputs[1], &p)?, Saved::None))
            }
            ModuleKind::Loss => {
                let p = self.policy(OpClass::Loss, Pass::Forward).clone();
                let (z, _) = Self::flatten(&inputs[0])?;
                Ok((cross_entropy(&z, &self.targets, &p)?, Saved::None))
            }
        }
    }

    fn run_backward(
        &mut self,
        m: &Module,
        inputs: &[Tensor],
        saved: &Saved,
        g: &Tensor,
        record: bool,
    ) -> Result<ModuleGrads> {
        let c = self.config.clone();
        let gf = self.recipe.grad_format;
        match (m.kind, saved) {
            (ModuleKind::Embedding, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward).clone();
                let (dte, dpe) =
                    embedding_backward(&self.tokens, c.batch, c.seq, c.vocab, c.seq, g, &p, gf)?;
                Ok((
                    vec![],
                    vec![(m.params[0].clone(), dte), (m.params[1].clone(), dpe)],
                ))
            }
            (ModuleKind::Norm, Saved::Norm(s)) => {
                let p = self.policy(OpClass::Norm, Pass::Backward).clone();
                let w = self.param(&m.params[0])?;
                let (dx, dw, db) = norm_backward(s, w, g, c.norm == NormKind::LayerNorm, &p, gf)?;
                let mut pg = vec![(m.params[0].clone(), dw)];
                if let Some(db) = db {
                    pg.push((m.params[1].clone(), db));
                }
                Ok((vec![dx], pg))
            }
            (ModuleKind::Linear, _) => {
                let dg = self
                    .policy(OpClass::MatmulGradInput, Pass::Backward)
                    .clone();
                let wg = self
                    .policy(OpClass::MatmulGradWeight, Pass::Backward)
                    .clone();
                let (x2, xshape) = Self::flatten(&inputs[0])?;
                let (g2, _) = Self::flatten(g)?;
                let w = self.param(&m.params[0])?.clone();
                let s_g = self.scale_for(format!("{}.grad", m.name), &g2, &dg, dg.input(), record);
                let s_w = self.scale_for(format!("{}.weight", m.name), &w, &dg, dg.rhs(), false);
                let s_x = self.scale_for(format!("{}.input", m.name), &x2, &wg, wg.rhs(), false);
                let dx = matmul_scaled(&g2, &w, &dg, s_g, s_w)?;
                let gt = transpose(&g2, "linear output gradient")?;
                let dw = matmul_scaled(&gt, &x2, &wg, s_g, s_x)?;
                let dw = dw.cast(gf, Overflow::NonSaturating);
                let mut pg = vec![(m.params[0].clone(), dw)];
                if let Some(bn) = m.params.get(1) {
                    let mut bp = wg.clone();
                    bp.output = gf;
                    pg.push((bn.clone(), column_sums(&g2, &bp)?));
                }
                Ok((vec![dx.reshape(&xshape)?], pg))
            }
            (ModuleKind::Attention, Saved::Attention(s)) => {
                let p = self.policy(OpClass::Softmax, Pass::Backward).clone();
                Ok((vec![attention_backward(s, g, &p)?], vec![]))
            }
            (ModuleKind::Activation, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward).clone();
                let dx = match c.activation {
                    Activation::Gelu => gelu_backward(&inputs[0], g, &p)?,
                    Activation::Silu => silu_backward(&inputs[0], g, &p)?,
                };
                Ok((vec![dx], vec![]))
            }
            (ModuleKind::Residual, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward).clone();
                let d = g.cast(p.output, p.input_overflow(p.output));
                Ok((vec![d.clone(), d], vec![]))
            }
            (ModuleKind::Loss, _) => {
                let p = self.policy(OpClass::Loss, Pass::Backward).clone();
                let (z, zshape) = Self::flatten(&inputs[0])?;
                let dloss = g.values().first().copied().unwrap_or(1.0);
                let dz = cross_entropy_backward(&z, &self.targets, dloss, &p)?;
                Ok((vec![dz.reshape(&zshape)?], vec![]))
            }
            (kind, _) => Err(Error::InvalidParameter {
                name: "saved",
                reason: format!(
                    "module '{}' of kind {kind:?} has no saved forward state",
                    m.name
                ),
            }),
        }
    }

    /// One training step: forward through every module, loss, backward with gradient
    /// accumulation where a value feeds two modules (the residual stream), recording the
    /// trace. Delayed-scaling amax histories advance by one step.
    pub fn step(&mut self) -> Result<StepResult> {
        self.step_with(&mut |_, _| Ok(()))
    }

    /// [`Gpt::step`] with a hook that sees, and may change, every tensor the step produces —
    /// module outputs, input gradients and parameter gradients, by canonical id — before it is
    /// traced and used downstream. Forward inputs and arriving output gradients are not
    /// hooked (they are produced tensors seen earlier under their producer's id). This is how
    /// difference simulation injects modelled round-off differences and how the perturbation
    /// estimate perturbs the input.
    pub fn step_with(&mut self, hook: &mut StepHook<'_>) -> Result<StepResult> {
        let modules = self.modules.clone();
        let mut trace = Trace::new();
        let nvalues = modules.iter().map(|m| m.output).max().unwrap_or(0) + 1;
        let mut values: Vec<Option<Tensor>> = vec![None; nvalues];
        let mut saved = Vec::with_capacity(modules.len());
        for m in &modules {
            let inputs: Vec<Tensor> = m
                .inputs
                .iter()
                .map(|&v| {
                    values[v].clone().ok_or_else(|| Error::UnknownName {
                        kind: "value",
                        name: v.to_string(),
                    })
                })
                .collect::<Result<_>>()?;
            for (i, t) in inputs.iter().enumerate() {
                trace.push(TensorId::fwd_input(&m.name, i).to_string(), t.clone())?;
            }
            let (mut out, s) = self.run_forward(m, &inputs, true)?;
            let id = TensorId::fwd_output(&m.name, 0).to_string();
            hook(&id, &mut out)?;
            trace.push(id, out.clone())?;
            values[m.output] = Some(out);
            saved.push((inputs, s));
        }
        let loss_value = values[modules.last().map(|m| m.output).unwrap_or(0)]
            .as_ref()
            .and_then(|t| t.values().first().copied())
            .unwrap_or(f64::NAN);
        // Backward.
        let mut grads: Vec<Option<Tensor>> = vec![None; nvalues];
        let last = modules.len() - 1;
        grads[modules[last].output] = Some(Tensor::from_vec(&[], vec![1.0], Format::F32)?);
        let mut param_grads: Vec<(String, Tensor)> = vec![];
        let acc_policy = self.policy(OpClass::Elementwise, Pass::Backward).clone();
        for (idx, m) in modules.iter().enumerate().rev() {
            let g = grads[m.output].take().ok_or_else(|| Error::UnknownName {
                kind: "gradient of value",
                name: m.output.to_string(),
            })?;
            trace.push(TensorId::grad_output(&m.name, 0).to_string(), g.clone())?;
            let (inputs, s) = &saved[idx];
            let (gin, pg) = self.run_backward(m, inputs, s, &g, true)?;
            for (i, (mut gi, &v)) in gin.into_iter().zip(&m.inputs).enumerate() {
                let id = TensorId::grad_input(&m.name, i).to_string();
                hook(&id, &mut gi)?;
                trace.push(id, gi.clone())?;
                grads[v] = Some(match grads[v].take() {
                    None => gi,
                    // A value read by two modules: its gradient is the sum of both, added in
                    // backward order.
                    Some(prev) => nn::add(&prev, &gi, &acc_policy)?,
                });
            }
            for (name, t) in pg {
                param_grads.push((name, t));
            }
        }
        for (name, mut t) in param_grads {
            let id = TensorId::param_grad(&name).to_string();
            hook(&id, &mut t)?;
            trace.push(id, t)?;
        }
        Ok(StepResult {
            loss: loss_value,
            trace,
        })
    }
}
