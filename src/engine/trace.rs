//! Traces: named intermediate tensors of one training step, in execution order.
//!
//! Canonical ids (TTrace's canonical mapping):
//! * `{module}|fwd.input.{i}` and `{module}|fwd.output.0` — a module's forward inputs/output;
//! * `{module}|grad.output.0` — the gradient arriving at the module's output;
//! * `{module}|grad.input.{i}` — the gradient the module sends to its input i;
//! * `{parameter}|param_grad` — a parameter's gradient (e.g. `layers.3.mlp.fc1.weight|param_grad`).

use std::collections::HashMap;

use crate::engine::tensor::Tensor;
use crate::error::{Error, Result};

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
