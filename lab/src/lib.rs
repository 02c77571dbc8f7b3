//! # ttrace-lab
//!
//! The validation lab of ttrace, kept apart from the checking library as rand_distr keeps its
//! `distr_test/`: what ttrace uses to *validate* its thresholds, not what a user needs to
//! *check* a run.
//!
//! * [`shard`]: collectives with explicit order and format, ring attention, the
//!   tensor-parallel plan as data, and the tiny GPT executed the Megatron-LM way on a
//!   [`ttrace::trace::Mesh`] ([`shard::ShardedGpt`]), bit-identical to the reference on one
//!   device.
//! * [`bugs`]: fifteen injectable silent bugs, each modelling a real one.
//! * [`validate`]: where a sharded run's arithmetic differs from the reference's, end-to-end
//!   thresholds by difference simulation, TTrace's perturbation estimate, sensitivity,
//!   detection power, the replaying localizer, and the sweep that `ttrace validate` runs.
//!
//! The `ttrace` command (this package's binary) runs the library's subcommands (`check`,
//! `threshold`, `round`, `formats`) and the lab's (`validate`, `simulate`, `bugs`).
//! `docs/architecture.md` draws the house.
//!
//! ## Example: a sharded training step, merged back and compared
//!
//! ```
//! use ttrace::engine::{AttentionImpl, Gpt, GptConfig};
//! use ttrace::{Recipe};
//! use ttrace_lab::shard::{Algorithm, ShardedGpt};
//! use ttrace::trace::Mesh;
//!
//! # fn main() -> ttrace::Result<()> {
//! let config = GptConfig { layers: 1, hidden: 16, heads: 2, seq: 8, batch: 2, vocab: 16,
//!     attention: AttentionImpl::Online { block: 2 }, ..GptConfig::default() };
//! let reference = Gpt::new(config.clone(), Recipe::bf16())?.step()?.trace;
//! // Tensor parallel 2 with sequence parallelism, context parallel 2, data parallel 2.
//! let mesh = Mesh::megatron(2, 2, 2, true)?;
//! let mut sharded = ShardedGpt::new(Gpt::new(config, Recipe::bf16())?, mesh, Algorithm::Ring)?;
//! let merged = sharded.step()?.merge(Some(&reference))?;
//! // Same tensors under the same canonical ids; the embedding is computed identically.
//! assert_eq!(merged.len(), reference.len());
//! assert_eq!(merged.require("embedding|fwd.output.0")?, reference.require("embedding|fwd.output.0")?);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]

pub mod bugs;
pub mod shard;
pub mod validate;
