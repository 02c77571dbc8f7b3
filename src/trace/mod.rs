//! The trace: the vocabulary every producer and consumer of traced tensors shares.
//!
//! * [`TensorId`] and [`TensorRole`]: the canonical ids of traced tensors
//!   (`{module}|fwd.output.0`, `{parameter}|param_grad`), and [`Trace`], tensors by id in
//!   execution order;
//! * [`ModuleKind`]: what a module computes;
//! * [`Mesh`] and [`Axis`]: the device mesh, named axes of any number;
//! * [`Layout`] and [`Placement`]: how a tensor lies on it, one placement per named axis;
//!   [`shard`] to cut a logical tensor and [`merge`] to put the shards back together (with the
//!   values as stored, so a checker merges without widening them).
//!
//! It sits just above the arithmetic (formats, orders, policies, tensors). The reference
//! engine and the sharded simulator *produce* traces, [`io`](crate::io) reads and writes
//! them as files, and [`check`](crate::check) *consumes* them; none of those reaches into
//! another for what a trace means. `papers/trace-format.md` is the file format;
//! `docs/architecture.md` the house.

pub(crate) mod id;
pub(crate) mod infer;
pub(crate) mod kind;
pub(crate) mod layout;
pub(crate) mod merge;
pub(crate) mod mesh;
pub(crate) mod stored;

pub use id::{TensorId, TensorRole, Trace, TraceEntry};
pub use kind::ModuleKind;
pub use layout::{shard, Layout, Placement};
pub use merge::{merge, merge_owned, merge_reusing};
pub use mesh::{Axis, Mesh};
