//! # ttrace
//!
//! Tell floating-point round-off apart from real bugs when a distributed training run is
//! compared against a single-device reference, in the spirit of *TTrace: Lightweight Error
//! Checking and Diagnosis for Distributed Training* (arXiv 2506.09280).
//!
//! What is here:
//! * [`Format`]: FP64, FP32, TF32, FP16, BF16 and the OCP FP8 formats E4M3 and E5M2, with
//!   their constants (unit roundoff **u = 2^-p**, machine epsilon **ε = 2^(1-p)** — never
//!   confused), correct rounding from `f64` ([`Format::round`]) under two [`Overflow`]
//!   policies, and exact bit-pattern encoding ([`Format::encode`], [`Format::decode`]).
//! * [`Order`] and [`Accumulation`]: sequential, pairwise, blocked (with a sequential or
//!   block-FMA inner sum), split-K with sequential / tree / ring combination, and Kahan
//!   summation; [`sum`] and [`dot`] execute them with every addition correctly rounded to the
//!   accumulator format, and report the rounding depth of each term.
//! * [`ExactAccumulator`], [`exact_sum`], [`exact_dot`]: exact arithmetic for oracles.
//! * [`engine`]: tensors of exact emulated values, ops forward and backward under an arithmetic
//!   [`Policy`] (which embeds the same [`Accumulation`]), a tiny GPT
//!   ([`engine::Gpt`]) whose training step records a [`trace::Trace`] of every intermediate
//!   tensor under canonical ids, and replay of any module on substituted inputs.
//! * [`trace`]: what a trace is — canonical tensor ids, module kinds, the device mesh and
//!   tensor layouts (TP, SP, CP, DP), cutting a tensor into shards and the canonical merge.
//! * [`bounds`]: comparison thresholds (guaranteed and probabilistic) for "reference order vs
//!   candidate order" of reductions, matmuls, softmax, norms and elementwise ops.
//! * [`check`]: per-tensor verdicts, the localizer that names the first module whose own output
//!   is wrong, and the checking of two trace directories ([`check::check_dir_paths`]) with
//!   thresholds priced from the manifest and the data ([`check::price_local`]).
//! * [`io`]: trace directories — safetensors / `.npy` tensors (BF16 and FP8 read as stored)
//!   and a versioned manifest of ids, ranks, dtypes and layouts (`papers/trace-format.md`).
//!
//! ## Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `parallel` | yes | checking trace directories and large emulated matmuls (and the lab's validation sweep) on rayon's thread pool; without it they run on the calling thread with the same results |
//!
//! `default-features = false` gives the thresholds, the engine, the checker and the readers
//! with 15 crates in the dependency tree (serde, serde_json, statrs without its defaults, libc
//! and theirs).
//!
//! The validation lab — the sharded simulator, the silent-bug catalog, the validation sweep —
//! and the `ttrace` command are the workspace crate `ttrace-lab` (`lab/`), which builds on
//! this library and is not published with it (`docs/architecture.md`).
//!
//! The derivations and sources are in `papers/` (`formats-and-orders.md`,
//! `bounds-*.md`, `sharding.md`, `checking.md`, `trace-format.md`); measured speeds against
//! same-run baselines in `docs/performance.md`.
//!
//! ## Example: the same dot product, reference order versus split-K order
//!
//! ```
//! use ttrace::{dot, exact_dot, Accumulation, Combine, Format, Order, Overflow};
//!
//! # fn main() -> ttrace::Result<()> {
//! // BF16 inputs (every value below is exactly a BF16 number).
//! let x: Vec<f64> = (0..64).map(|i| Format::BF16.round(1.0 + i as f64 / 7.0, Overflow::NonSaturating)).collect();
//! let y: Vec<f64> = (0..64).map(|i| Format::BF16.round(0.5 - i as f64 / 100.0, Overflow::NonSaturating)).collect();
//!
//! // Reference: one GEMM, FP32 accumulation, sequential FMAs.
//! let reference = Accumulation::new(Format::BF16, Format::F32, Order::Sequential);
//! // Candidate: tensor parallelism over 4 ranks; each rank's partial result is rounded to BF16
//! // and the partials are all-reduced in BF16 in ring order.
//! let candidate = Accumulation::new(
//!     Format::BF16,
//!     Format::F32,
//!     Order::SplitK {
//!         parts: 4,
//!         inner: Box::new(Order::Sequential),
//!         partial: Format::BF16,
//!         combine: Combine::ring_for_chunk(0, 4)?,
//!     },
//! );
//! let r = dot(&x, &y, &reference)?;
//! let c = dot(&x, &y, &candidate)?;
//! let exact = exact_dot(&x, &y)?;
//!
//! // Higham's bound for each: |error| <= (prod_f (1 + u_f)^depth_f - 1) * sum |x_i y_i|.
//! let scale: f64 = x.iter().zip(&y).map(|(a, b)| (a * b).abs()).sum();
//! for (value, policy) in [(r, &reference), (c, &candidate)] {
//!     let worst = policy.dot_depths(x.len())?.iter().map(|d| d.relative_error_bound()).fold(0.0, f64::max);
//!     assert!((value - exact).abs() <= worst * scale);
//! }
//! // The candidate's BF16 roundings make it differ from the reference, within the sum of bounds.
//! assert_ne!(r, c);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
// Library code reports bad input as errors: no unwrap/expect/panic outside tests (CI runs
// clippy with -D warnings; `assert!` remains for internal invariants guarding unsafe code).
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

mod arch;
pub mod bounds;

pub mod check;
mod decimal;
pub mod engine;
pub(crate) mod error;
pub(crate) mod exact;
pub(crate) mod format;
pub mod io;
mod limits;
pub(crate) mod order;
mod parallel;
pub(crate) mod policy;
pub(crate) mod random;

pub(crate) mod tensor;
pub mod trace;

pub(crate) mod verdict;

pub use error::{Error, IoError, Result};
pub use exact::{exact_dot, exact_sum, exact_sum_abs, ExactAccumulator};
pub use format::{Format, FormatInfo, Overflow};
pub use order::{
    dot, sum, AccRounding, Accumulation, BlockSum, Combine, Order, Products, TensorCoreSum,
    TermDepth,
};
pub use policy::{Policy, Recipe, Scaling};
pub use tensor::Tensor;

/// The library's internals that the validation lab (`lab/`, the `ttrace-lab` crate: the
/// sharded simulator, the bug catalog, the validation sweep) builds on. Not part of the
/// public API: no stability, no documentation beyond the items' own.
#[doc(hidden)]
pub mod __lab {
    pub use crate::bounds::reduction::random_rounding_error;
    pub use crate::engine::attention::{
        attention_with_scale, forward_arith, split_heads, widest_of, OnlineArith, OnlineRow,
    };
    pub use crate::order::exec::dot_unchecked;
    pub use crate::parallel::map;
    pub use crate::policy::arith::Arith;
    pub use crate::verdict::detect::detect;
    pub use crate::verdict::{compare_with_sums, detection_for};
}

/// The README's Rust example, compiled and run as a doctest so the README stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
pub struct GuideDoctests;
