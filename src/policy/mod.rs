//! Arithmetic policies: how one op executes (input, products, accumulator, order, output,
//! FP8 scaling), and recipes that assign a policy to every op of a model.
//!
//! A [`Policy`] embeds the foundation's [`Accumulation`] unchanged, so the engine (which
//! executes) and the bounds (which price) read the very same description of the arithmetic.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::order::{Accumulation, Order, Products};

mod algorithm;
pub(crate) mod arith;
mod quantize;

pub(crate) use algorithm::{gelu_f64, gelu_grad_f64};
pub use algorithm::{AttentionImpl, Variance};
pub use quantize::{quantize, Quantized};
pub(crate) use quantize::{quantize_cow, QuantizedCow};

/// How operands are scaled before being quantized to an FP8 input format.
///
/// Quantization always saturates (the mode FP8 training kernels use) and follows the
/// TransformerEngine cast kernel: q = sat_fp8(fl32(x · s)), with the scale s and its inverse
/// held in FP32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scaling {
    /// No scaling: operands are rounded to the input format directly (BF16, FP16, FP32 inputs).
    #[default]
    None,
    /// Per-tensor current scaling: s = fl32(max_fp8 / amax(x) / 2^margin) from this tensor's own
    /// amax (s = 1 when amax is 0 or not finite).
    PerTensorCurrent {
        /// Power-of-two safety margin (TransformerEngine's `margin`, usually 0).
        margin: i32,
    },
    /// Per-tensor delayed scaling: the same formula with amax taken as the maximum of an amax
    /// history passed in by the caller ([`delayed_scale`]). Ops that cannot see a history use
    /// the tensor's own amax.
    PerTensorDelayed {
        /// Power-of-two safety margin.
        margin: i32,
    },
    /// OCP Microscaling (MX v1.0): blocks of `size` consecutive elements along the reduction
    /// dimension share a power-of-two scale X = 2^(⌊log2 amax_block⌋ − e_max(fp8)), and
    /// elements are q = sat_fp8(x / X). The dequantized values q·X are exact.
    Block {
        /// Elements per block (32 in MX).
        size: usize,
    },
}

/// The arithmetic of one op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Input (left operand) format, product handling, accumulator, reduction order, overflow
    /// for intermediate roundings. Inputs in a wider format are rounded into `input` first.
    pub accumulation: Accumulation,
    /// Format of the right operand of a matmul when it differs from the left one (the hybrid
    /// FP8 recipe multiplies E5M2 gradients by E4M3 weights). `None`: the same as the left.
    pub rhs_input: Option<Format>,
    /// Format every output element is rounded to.
    pub output: Format,
    /// FP8 scaling recipe for quantizing inputs (only meaningful for FP8 input formats).
    pub scaling: Scaling,
}

impl Policy {
    /// A policy with inputs in `input`, sequential accumulation in `accumulator` with exact
    /// products (FMA), outputs in `output`, no scaling.
    pub fn new(input: Format, accumulator: Format, output: Format) -> Policy {
        Policy {
            accumulation: Accumulation::new(input, accumulator, Order::Sequential),
            rhs_input: None,
            output,
            scaling: Scaling::None,
        }
    }

    /// Everything in one format (e.g. `Policy::uniform(Format::F64)` for gradient checks).
    pub fn uniform(format: Format) -> Policy {
        Policy::new(format, format, format)
    }

    /// The same policy with another reduction order.
    pub fn with_order(mut self, order: Order) -> Policy {
        self.accumulation.order = order;
        self
    }

    /// The same policy with another product handling.
    pub fn with_products(mut self, products: Products) -> Policy {
        self.accumulation.products = products;
        self
    }

    /// The same policy with FP8 scaling.
    pub fn with_scaling(mut self, scaling: Scaling) -> Policy {
        self.scaling = scaling;
        self
    }

    /// The same policy with a different right-operand format.
    pub fn with_rhs_input(mut self, format: Format) -> Policy {
        self.rhs_input = Some(format);
        self
    }

    /// Input format of the left operand.
    pub fn input(&self) -> Format {
        self.accumulation.input
    }

    /// Input format of the right operand.
    pub fn rhs(&self) -> Format {
        self.rhs_input.unwrap_or(self.accumulation.input)
    }

    /// Accumulator format.
    pub fn accumulator(&self) -> Format {
        self.accumulation.accumulator
    }

    /// Whether two executions under `self` and `other` compute the same bits: equal policies
    /// whose order names one kernel (no [`Order::AnyOf`] family — two runs of a kernel of
    /// unknown order may pick different members, as cuBLAS does for different shapes).
    pub(crate) fn same_execution(&self, other: &Policy) -> bool {
        self == other && !self.accumulation.order.has_family()
    }

    /// Check the order parameters and the scaling parameters.
    pub fn validate(&self) -> Result<()> {
        self.accumulation.validate()?;
        if let Scaling::Block { size: 0 } = self.scaling {
            return Err(Error::InvalidParameter {
                name: "size",
                reason: "an MX scaling block needs at least one element (got 0)".into(),
            });
        }
        Ok(())
    }

    /// Overflow policy used when quantizing inputs: saturating for FP8 (as FP8 training
    /// kernels do), the accumulation's policy otherwise.
    pub fn input_overflow(&self, format: Format) -> Overflow {
        if matches!(format, Format::E4M3 | Format::E5M2) {
            Overflow::Saturating
        } else {
            self.accumulation.overflow
        }
    }
}

/// The text form read by [`Policy::from_str`](std::str::FromStr::from_str), one grammar for
/// the CLI, the library and the Python bindings: comma-separated `key=value` items —
/// `in=FMT`, `acc=FMT`, `out=FMT`, `order=ORDER` (see [`Order`]'s text form), and when not the
/// default `products=exact|FMT`, `rhs=FMT` (the right operand's format), `scaling=none|
/// current[:MARGIN]|delayed[:MARGIN]|mx|block:SIZE` and `overflow=saturating`. Parsing the
/// text gives the policy back.
impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = &self.accumulation;
        write!(
            f,
            "in={},acc={},out={},order={}",
            a.input, a.accumulator, self.output, a.order
        )?;
        if let Products::Rounded(p) = a.products {
            write!(f, ",products={p}")?;
        }
        if let Some(r) = self.rhs_input {
            write!(f, ",rhs={r}")?;
        }
        match self.scaling {
            Scaling::None => {}
            Scaling::PerTensorCurrent { margin: 0 } => f.write_str(",scaling=current")?,
            Scaling::PerTensorCurrent { margin } => write!(f, ",scaling=current:{margin}")?,
            Scaling::PerTensorDelayed { margin: 0 } => f.write_str(",scaling=delayed")?,
            Scaling::PerTensorDelayed { margin } => write!(f, ",scaling=delayed:{margin}")?,
            Scaling::Block { size: 32 } => f.write_str(",scaling=mx")?,
            Scaling::Block { size } => write!(f, ",scaling=block:{size}")?,
        }
        if a.overflow == Overflow::Saturating {
            f.write_str(",overflow=saturating")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Policy {
    type Err = Error;

    /// Parse the text form of [`Policy`]'s `Display`. Keys may come in any order and be left
    /// out: `in=bf16`, `acc=f32`, `out=bf16`, `order=sequential` by default (the long names
    /// `input`, `accumulator` and `output` are accepted too). The policy is validated.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::{Format, Policy};
    /// let p: Policy = "in=bf16,acc=f32,out=bf16,order=splitk:4:bf16:ring:1".parse()?;
    /// assert_eq!(p.accumulator(), Format::F32);
    /// assert_eq!(p.to_string().parse::<Policy>()?, p);
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidParameter`] (`name` "policy") for an item that is not `key=value`, an
    /// unknown or repeated key, or a bad value; the errors of [`Format`] and [`Order`] parsing
    /// and of [`Policy::validate`].
    fn from_str(s: &str) -> Result<Policy> {
        let bad = |why: String| Error::InvalidParameter {
            name: "policy",
            reason: format!("'{s}': {why}"),
        };
        let mut p = Policy::new(Format::BF16, Format::F32, Format::BF16);
        let mut seen: Vec<&str> = vec![];
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| bad(format!("'{item}' is not key=value")))?;
            let (key, value) = (key.trim(), value.trim());
            let canonical = match key {
                "input" => "in",
                "accumulator" => "acc",
                "output" => "out",
                k => k,
            };
            if seen.contains(&canonical) {
                return Err(bad(format!("'{key}' is given twice")));
            }
            seen.push(canonical);
            let margin = |t: Option<&str>| match t {
                None => Ok(0),
                Some(t) => t
                    .parse::<i32>()
                    .map_err(|_| bad(format!("scaling margin '{t}' is not an integer"))),
            };
            match canonical {
                "in" => p.accumulation.input = value.parse()?,
                "acc" => p.accumulation.accumulator = value.parse()?,
                "out" => p.output = value.parse()?,
                "order" => p.accumulation.order = value.parse()?,
                "rhs" => p.rhs_input = Some(value.parse()?),
                "products" => {
                    p.accumulation.products = match value {
                        "exact" => Products::Exact,
                        v => Products::Rounded(v.parse()?),
                    }
                }
                "scaling" => {
                    let (kind, arg) = match value.split_once(':') {
                        Some((k, a)) => (k, Some(a)),
                        None => (value, None),
                    };
                    p.scaling = match (kind, arg) {
                        ("none", None) => Scaling::None,
                        ("current", a) => Scaling::PerTensorCurrent { margin: margin(a)? },
                        ("delayed", a) => Scaling::PerTensorDelayed { margin: margin(a)? },
                        ("mx", None) => Scaling::Block { size: 32 },
                        ("block", Some(a)) => Scaling::Block {
                            size: a
                                .parse()
                                .map_err(|_| bad(format!("block size '{a}' is not a number")))?,
                        },
                        _ => {
                            return Err(bad(format!(
                                "unknown scaling '{value}' (none, current[:MARGIN], \
                                 delayed[:MARGIN], mx, block:SIZE)"
                            )))
                        }
                    }
                }
                "overflow" => {
                    p.accumulation.overflow = match value {
                        "saturating" => Overflow::Saturating,
                        "nonsaturating" => Overflow::NonSaturating,
                        v => {
                            return Err(bad(format!(
                                "unknown overflow '{v}' (saturating, nonsaturating)"
                            )))
                        }
                    }
                }
                other => {
                    return Err(bad(format!(
                        "unknown key '{other}' (in, acc, out, order, products, rhs, scaling, \
                         overflow)"
                    )))
                }
            }
        }
        p.validate()?;
        Ok(p)
    }
}

/// The scale s = fl32(max_fp8 / amax / 2^margin) used by per-tensor FP8 scaling, with amax the
/// maximum of `amax_history` (delayed scaling) — 1 when that maximum is 0 or not finite, as a
/// fresh TransformerEngine scaling state starts.
pub fn delayed_scale(amax_history: &[f64], fp8: Format, margin: i32) -> f64 {
    let amax = amax_history.iter().fold(0.0f64, |m, &a| m.max(a.abs()));
    per_tensor_scale(amax, fp8, margin)
}

/// s = fl32(max_fp8 / amax / 2^margin), or 1 for an amax of 0 or non-finite.
pub fn per_tensor_scale(amax: f64, fp8: Format, margin: i32) -> f64 {
    if !(amax.is_finite() && amax > 0.0) {
        return 1.0;
    }
    let s = fp8.max_finite() / amax / 2f64.powi(margin);
    let s = Format::F32.round(s, Overflow::Saturating);
    if s == 0.0 {
        f64::from(f32::MIN_POSITIVE)
    } else {
        s
    }
}

/// Which family an op belongs to, for [`Recipe::policy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// Matmuls and linear layers (forward), and attention's two batched matmuls.
    Matmul,
    /// The data-gradient matmuls of the backward pass (dX = dY·W).
    MatmulGradInput,
    /// The weight-gradient matmuls of the backward pass (dW = dYᵀ·X) and bias gradients.
    MatmulGradWeight,
    /// LayerNorm / RMSNorm.
    Norm,
    /// Softmax (inside attention).
    Softmax,
    /// Elementwise ops: residual add, scale, GELU, SiLU, embedding lookup.
    Elementwise,
    /// Cross-entropy loss.
    Loss,
}

/// Whether a policy is for the forward or the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
}

/// A training recipe: the policy of every op class in each pass, plus storage formats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    /// Short name ("fp32", "bf16", "fp8-delayed", ...).
    pub name: String,
    /// Format parameters are stored in (values are generated, then rounded into it).
    pub param_format: Format,
    /// Format of activations and activation gradients between modules.
    pub activation_format: Format,
    /// Format of parameter gradients.
    pub grad_format: Format,
    /// Amax history length for delayed FP8 scaling.
    pub amax_history_len: usize,
    policies: Vec<(OpClass, Pass, Policy)>,
}

impl Recipe {
    /// Every op in `format`, accumulation included (F64 for gradient checks, F32 for an FP32
    /// reference).
    pub fn uniform(format: Format) -> Recipe {
        let p = Policy::uniform(format);
        let name = format!("uniform-{}", format.name());
        Recipe::from_default(&name, format, format, format, p)
    }

    /// FP32 everywhere (`uniform-f32`, named `fp32`).
    pub fn fp32() -> Recipe {
        Recipe {
            name: "fp32".into(),
            ..Recipe::uniform(Format::F32)
        }
    }

    /// BF16 storage of parameters and activations, FP32 accumulation (FMA) in every reduction,
    /// BF16 outputs, FP32 parameter gradients and loss (Megatron's `--bf16` with FP32 main grads).
    pub fn bf16() -> Recipe {
        let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
        let mut r = Recipe::from_default("bf16", Format::BF16, Format::BF16, Format::F32, p);
        r.set(
            OpClass::MatmulGradWeight,
            Pass::Backward,
            Policy::new(Format::BF16, Format::F32, Format::F32),
        );
        r.set(
            OpClass::Loss,
            Pass::Forward,
            Policy::new(Format::BF16, Format::F32, Format::F32),
        );
        r.set(
            OpClass::Loss,
            Pass::Backward,
            Policy::new(Format::F32, Format::F32, Format::BF16),
        );
        r
    }

    /// The BF16 recipe with FP8 matmuls: E4M3 operands in the forward pass, E5M2 gradients
    /// times E4M3 weights/activations in the backward pass (TransformerEngine's HYBRID
    /// format), FP32 accumulation, BF16 outputs, with the given scaling.
    pub fn fp8(scaling: Scaling) -> Recipe {
        let mut r = Recipe::bf16();
        r.name = match scaling {
            Scaling::None => "fp8-unscaled",
            Scaling::PerTensorCurrent { .. } => "fp8-current",
            Scaling::PerTensorDelayed { .. } => "fp8-delayed",
            Scaling::Block { .. } => "fp8-mx",
        }
        .to_string();
        r.amax_history_len = 16;
        let fwd = Policy::new(Format::E4M3, Format::F32, Format::BF16).with_scaling(scaling);
        let dgrad = Policy::new(Format::E5M2, Format::F32, Format::BF16)
            .with_rhs_input(Format::E4M3)
            .with_scaling(scaling);
        let wgrad = Policy::new(Format::E5M2, Format::F32, Format::F32)
            .with_rhs_input(Format::E4M3)
            .with_scaling(scaling);
        r.set(OpClass::Matmul, Pass::Forward, fwd);
        r.set(OpClass::MatmulGradInput, Pass::Backward, dgrad);
        r.set(OpClass::MatmulGradWeight, Pass::Backward, wgrad);
        r
    }

    /// Look a recipe up by name: `f64`, `fp32`, `bf16`, `fp8-current`, `fp8-delayed`, `fp8-mx`,
    /// `fp8-unscaled`, `uniform-FMT` (one format everywhere); every recipe's `name` reads back.
    pub fn by_name(name: &str) -> Result<Recipe> {
        if let Some(f) = name.strip_prefix("uniform-") {
            if let Ok(format) = f.parse::<Format>() {
                return Ok(Recipe::uniform(format));
            }
        }
        Ok(match name {
            "f64" | "fp64" => Recipe {
                name: "f64".into(),
                ..Recipe::uniform(Format::F64)
            },
            "fp32" | "f32" => Recipe::fp32(),
            "bf16" => Recipe::bf16(),
            "fp8-current" => Recipe::fp8(Scaling::PerTensorCurrent { margin: 0 }),
            "fp8-delayed" => Recipe::fp8(Scaling::PerTensorDelayed { margin: 0 }),
            "fp8-mx" => Recipe::fp8(Scaling::Block { size: 32 }),
            "fp8-unscaled" => Recipe::fp8(Scaling::None),
            _ => {
                return Err(Error::UnknownName {
                    kind: "recipe (f64, fp32, bf16, fp8-current, fp8-delayed, fp8-mx, \
                           fp8-unscaled, uniform-FMT)",
                    name: name.to_string(),
                })
            }
        })
    }

    fn from_default(name: &str, param: Format, act: Format, grad: Format, p: Policy) -> Recipe {
        let mut policies = vec![];
        for class in [
            OpClass::Matmul,
            OpClass::MatmulGradInput,
            OpClass::MatmulGradWeight,
            OpClass::Norm,
            OpClass::Softmax,
            OpClass::Elementwise,
            OpClass::Loss,
        ] {
            for pass in [Pass::Forward, Pass::Backward] {
                policies.push((class, pass, p.clone()));
            }
        }
        Recipe {
            name: name.to_string(),
            param_format: param,
            activation_format: act,
            grad_format: grad,
            amax_history_len: 1,
            policies,
        }
    }

    /// Replace the policy of one op class in one pass.
    pub fn set(&mut self, class: OpClass, pass: Pass, policy: Policy) {
        for entry in &mut self.policies {
            if entry.0 == class && entry.1 == pass {
                entry.2 = policy;
                return;
            }
        }
        self.policies.push((class, pass, policy));
    }

    /// The same recipe with every reduction in `order` (e.g. pairwise, or a split-K that
    /// models a sharded execution).
    pub fn with_order(mut self, order: Order) -> Recipe {
        for entry in &mut self.policies {
            entry.2.accumulation.order = order.clone();
        }
        self
    }

    /// The policy of an op class in a pass.
    pub fn policy(&self, class: OpClass, pass: Pass) -> &Policy {
        // Every (class, pass) pair is present by construction.
        self.policies
            .iter()
            .find(|e| e.0 == class && e.1 == pass)
            .map(|e| &e.2)
            .unwrap_or(&self.policies[0].2)
    }

    /// The narrowest format any of its reductions accumulates in (FP32 for every built-in
    /// recipe but `uniform-bf16`, `uniform-f16` and the like).
    pub fn narrowest_accumulator(&self) -> Format {
        self.policies
            .iter()
            .map(|(_, _, p)| p.accumulator())
            .min_by_key(|f| f.precision())
            .unwrap_or(Format::F32)
    }

    /// Validate every policy.
    pub fn validate(&self) -> Result<()> {
        for (_, _, p) in &self.policies {
            p.validate()?;
        }
        Ok(())
    }
}
