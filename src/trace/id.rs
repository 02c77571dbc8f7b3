//! Traces: named intermediate tensors of one training step, in execution order.
//!
//! Canonical ids (TTrace's canonical mapping):
//! * `{module}|fwd.input.{i}` and `{module}|fwd.output.0` — a module's forward inputs/output;
//! * `{module}|grad.output.0` — the gradient arriving at the module's output;
//! * `{module}|grad.input.{i}` — the gradient the module sends to its input i;
//! * `{parameter}|param_grad` — a parameter's gradient (e.g. `layers.3.mlp.fc1.weight|param_grad`).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::policy::Pass;
use crate::tensor::Tensor;

/// What a canonical id names about its module (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TensorRole {
    /// Forward input `i` (`fwd.input.i`).
    FwdInput(usize),
    /// Forward output `i` (`fwd.output.i`).
    FwdOutput(usize),
    /// The gradient arriving at output `i` (`grad.output.i`).
    GradOutput(usize),
    /// The gradient sent to input `i` (`grad.input.i`).
    GradInput(usize),
    /// The gradient of the module's parameter `param` (`{module}.{param}|param_grad`).
    ParamGrad {
        /// The parameter's name within the module (`weight`).
        param: String,
    },
}

/// A canonical id, parsed: the module and what of it the tensor is. Its `Display` is the
/// canonical text, and parsing that text gives the id back.
///
/// # Examples
///
/// ```
/// use ttrace::trace::{TensorId, TensorRole};
/// let id = TensorId::parse("layers.0.mlp.fc1.weight|param_grad").unwrap();
/// assert_eq!(id.module, "layers.0.mlp.fc1");
/// assert_eq!(id.role, TensorRole::ParamGrad { param: "weight".into() });
/// assert_eq!(id.to_string(), "layers.0.mlp.fc1.weight|param_grad");
/// assert_eq!(TensorId::fwd_output("ln1", 0).to_string(), "ln1|fwd.output.0");
/// assert_eq!(TensorId::param_grad("layers.0.mlp.fc1.weight"), id);
/// assert!(TensorId::parse("ln1|fwd.output").is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorId {
    /// The module's name (for a parameter gradient, the parameter's module).
    pub module: String,
    /// What of the module.
    pub role: TensorRole,
}

impl TensorId {
    /// `{module}|fwd.input.{i}`.
    pub fn fwd_input(module: &str, i: usize) -> TensorId {
        TensorId::of(module, TensorRole::FwdInput(i))
    }

    /// `{module}|fwd.output.{i}`.
    pub fn fwd_output(module: &str, i: usize) -> TensorId {
        TensorId::of(module, TensorRole::FwdOutput(i))
    }

    /// `{module}|grad.output.{i}`.
    pub fn grad_output(module: &str, i: usize) -> TensorId {
        TensorId::of(module, TensorRole::GradOutput(i))
    }

    /// `{module}|grad.input.{i}`.
    pub fn grad_input(module: &str, i: usize) -> TensorId {
        TensorId::of(module, TensorRole::GradInput(i))
    }

    /// `{parameter}|param_grad`: the gradient of the parameter with the full name `parameter`
    /// (`layers.0.mlp.fc1.weight`; its module is everything before the last `.`, as
    /// [`parse`](Self::parse) reads it).
    pub fn param_grad(parameter: &str) -> TensorId {
        let (module, param) = parameter.rsplit_once('.').unwrap_or((parameter, ""));
        TensorId::of(
            module,
            TensorRole::ParamGrad {
                param: param.to_string(),
            },
        )
    }

    fn of(module: &str, role: TensorRole) -> TensorId {
        TensorId {
            module: module.to_string(),
            role,
        }
    }

    /// Parse a canonical id; `None` for text outside the convention (a parameter gradient's
    /// module is everything before the last `.` of its name).
    pub fn parse(id: &str) -> Option<TensorId> {
        let (name, what) = id.split_once('|')?;
        if what == "param_grad" {
            let (module, param) = name.rsplit_once('.').unwrap_or((name, ""));
            return Some(TensorId::of(
                module,
                TensorRole::ParamGrad {
                    param: param.to_string(),
                },
            ));
        }
        let (head, index) = what.rsplit_once('.')?;
        let i = index.parse::<usize>().ok()?;
        let role = match head {
            "fwd.input" => TensorRole::FwdInput(i),
            "fwd.output" => TensorRole::FwdOutput(i),
            "grad.output" => TensorRole::GradOutput(i),
            "grad.input" => TensorRole::GradInput(i),
            _ => return None,
        };
        Some(TensorId::of(name, role))
    }

    /// Forward or backward.
    pub fn pass(&self) -> Pass {
        match self.role {
            TensorRole::FwdInput(_) | TensorRole::FwdOutput(_) => Pass::Forward,
            _ => Pass::Backward,
        }
    }

    /// Produced by its module (outputs, input gradients, parameter gradients), rather than
    /// consumed (inputs, arriving output gradients).
    pub fn produced(&self) -> bool {
        !matches!(
            self.role,
            TensorRole::FwdInput(_) | TensorRole::GradOutput(_)
        )
    }
}

impl std::fmt::Display for TensorId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.module;
        match &self.role {
            TensorRole::FwdInput(i) => write!(f, "{m}|fwd.input.{i}"),
            TensorRole::FwdOutput(i) => write!(f, "{m}|fwd.output.{i}"),
            TensorRole::GradOutput(i) => write!(f, "{m}|grad.output.{i}"),
            TensorRole::GradInput(i) => write!(f, "{m}|grad.input.{i}"),
            TensorRole::ParamGrad { param } if param.is_empty() => write!(f, "{m}|param_grad"),
            TensorRole::ParamGrad { param } => write!(f, "{m}.{param}|param_grad"),
        }
    }
}

/// One traced tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    /// Canonical id.
    pub id: String,
    /// The tensor.
    pub tensor: Tensor,
}

/// An ordered collection of traced tensors with unique ids.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    entries: Vec<TraceEntry>,
    index: HashMap<String, usize>,
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Append a tensor; a repeated id is an error ([`Error::InvalidParameter`]).
    pub fn push(&mut self, id: impl Into<String>, tensor: Tensor) -> Result<()> {
        let id = id.into();
        if self.index.contains_key(&id) {
            return Err(Error::InvalidParameter {
                name: "id",
                reason: format!("trace id '{id}' recorded twice"),
            });
        }
        self.index.insert(id.clone(), self.entries.len());
        self.entries.push(TraceEntry { id, tensor });
        Ok(())
    }

    /// The tensor recorded under `id`.
    pub fn get(&self, id: &str) -> Option<&Tensor> {
        self.index.get(id).map(|&i| &self.entries[i].tensor)
    }

    /// The tensor under `id`, or [`Error::UnknownName`].
    pub fn require(&self, id: &str) -> Result<&Tensor> {
        self.get(id).ok_or_else(|| Error::UnknownName {
            kind: "trace id",
            name: id.to_string(),
        })
    }

    /// Entries in execution order.
    pub fn entries(&self) -> &[TraceEntry] {
        &self.entries
    }

    /// Ids in execution order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.id.as_str())
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the trace is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
