//! The crate's one error type.
//!
//! Every fallible library function returns [`Result<T>`](Result). Messages name the offending
//! value, format, order or parameter so that a user can act on them without reading the source.

use std::fmt;

use crate::format::kind::Format;

/// Everything that can go wrong in `ttrace`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A value was handed to a format that cannot hold it exactly (for example `encode` of 0.1 in
    /// BF16, or an input to `sum` that is not a value of the declared input format).
    NotRepresentable {
        /// The value.
        value: f64,
        /// The format that cannot represent it.
        format: Format,
        /// What the value was (e.g. `input x[3]`).
        what: String,
    },
    /// A bit pattern wider than the format (e.g. `0x1FF` for an 8-bit format).
    BitPatternTooWide {
        /// The pattern.
        bits: u64,
        /// The format.
        format: Format,
    },
    /// A format name that is not known.
    UnknownFormat(String),
    /// A parameter outside its valid range (block size 0, zero split-K parts, ...).
    InvalidParameter {
        /// The parameter's name.
        name: &'static str,
        /// Why it is invalid, including the value passed.
        reason: String,
    },
    /// Two inputs whose lengths or shapes must agree do not.
    LengthMismatch {
        /// What was being computed.
        what: &'static str,
        /// Length of the first operand.
        left: usize,
        /// Length of the second operand.
        right: usize,
    },
    /// A tensor's shape is not what the operation needs.
    ShapeMismatch {
        /// What was being done, naming the tensor or operand.
        what: String,
        /// The shape (or dimension) expected.
        expected: Vec<usize>,
        /// The shape found.
        found: Vec<usize>,
    },
    /// A name (module, parameter, trace entry) that does not exist.
    UnknownName {
        /// What kind of thing was looked up.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// Shards that cannot be merged under their declared layout (wrong shapes, a split that
    /// does not divide, a layout that does not fit the mesh).
    Layout {
        /// The tensor's canonical id.
        id: String,
        /// What is wrong.
        reason: String,
    },
    /// Copies of a replicated tensor that should agree bit for bit do not.
    ReplicaMismatch {
        /// The tensor's canonical id.
        id: String,
        /// The mesh axis along which the copies are replicated (`dp`, `tp`, …).
        axis: String,
        /// The first rank (global index) whose copy differs from its group's first copy.
        rank: usize,
        /// Flat index of the first differing element.
        index: usize,
        /// The two values (first copy, differing copy).
        values: (f64, f64),
    },
    /// A file that cannot be used: unreadable, truncated, malformed, or contradicting its
    /// manifest.
    File {
        /// The file's path.
        path: String,
        /// What is wrong.
        reason: String,
        /// The operating system's error behind it, if any (also [`std::error::Error::source`]).
        io: Option<IoError>,
    },
    /// A rounding may overflow: a value the computation rounds can reach the format's
    /// overflow threshold, so the result may be infinite, NaN or clamped and no finite
    /// threshold holds. Scale the data (or accumulate in a wider format).
    Overflow {
        /// What may overflow (e.g. `a partial sum`, `product 3`, `output element 7`).
        what: String,
        /// The format it is rounded to.
        format: Format,
        /// The largest magnitude the value may reach.
        magnitude: f64,
    },
    /// The computation can lose every significant digit on these inputs (a one-pass variance
    /// of rows whose mean dwarfs their spread may come out zero or negative), so its output
    /// may be infinite or NaN and no finite threshold holds.
    NoFiniteBound {
        /// What cannot be priced.
        what: String,
        /// Why, with the magnitudes involved.
        reason: String,
    },
    /// An input that must be finite is NaN or infinite.
    NonFinite {
        /// What the value was (e.g. `input x[3]`).
        what: String,
        /// The value.
        value: f64,
    },
    /// A trace records an arithmetic setting ttrace has no model for (an autocast to FP8, an
    /// FP32 matmul precision it does not know): the tensor cannot be priced, and is never
    /// priced as something else.
    UnpricedArithmetic {
        /// The tensor's canonical id (or what else was being priced).
        id: String,
        /// The setting, as `name=value`.
        setting: String,
    },
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotRepresentable {
                value,
                format,
                what,
            } => write!(
                f,
                "{what} = {value:e} is not exactly representable in {format}; round it first"
            ),
            Error::BitPatternTooWide { bits, format } => write!(
                f,
                "bit pattern {bits:#x} does not fit in the {} bits of {format}",
                format.bit_width()
            ),
            Error::UnknownFormat(name) => write!(
                f,
                "unknown format '{name}'; expected one of: {}",
                Format::ALL
                    .iter()
                    .map(|f| f.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Error::InvalidParameter { name, reason } => {
                write!(f, "invalid parameter '{name}': {reason}")
            }
            Error::LengthMismatch { what, left, right } => {
                write!(f, "{what}: operand lengths differ ({left} vs {right})")
            }
            Error::ShapeMismatch {
                what,
                expected,
                found,
            } => write!(f, "{what}: expected shape {expected:?}, found {found:?}"),
            Error::UnknownName { kind, name } => write!(f, "unknown {kind} '{name}'"),
            Error::Layout { id, reason } => write!(f, "tensor '{id}': {reason}"),
            Error::File { path, reason, .. } => write!(f, "{path}: {reason}"),
            Error::ReplicaMismatch {
                id,
                axis,
                rank,
                index,
                values,
            } => write!(
                f,
                "tensor '{id}' is declared replicated along {axis}, but rank {rank}'s copy \
                 differs at flat index {index} ({:e} vs {:e}); the layout is wrong or a \
                 synchronization is missing",
                values.0, values.1
            ),
            Error::Overflow {
                what,
                format,
                magnitude,
            } => write!(
                f,
                "{what} may reach {magnitude:.3e}, beyond the largest finite {format} value \
                 ({:.3e}): the rounding may overflow and no finite threshold holds",
                format.max_finite()
            ),
            Error::NoFiniteBound { what, reason } => {
                write!(f, "no finite threshold holds for {what}: {reason}")
            }
            Error::NonFinite { what, value } => {
                write!(f, "{what} is {value}, but a finite value is required")
            }
            Error::UnpricedArithmetic { id, setting } => write!(
                f,
                "tensor '{id}' was computed with {setting}, an arithmetic ttrace has no model \
                 for: it cannot be priced (autocast: f16, bf16; FP32 matmul and convolution \
                 precision: f32, tf32, bf16)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::File { io: Some(e), .. } => Some(&*e.0),
            _ => None,
        }
    }
}

/// An operating-system error kept inside an [`Error::File`]: shared, so the error stays
/// `Clone`; two are equal when their kind and message are.
#[derive(Debug, Clone)]
pub struct IoError(pub std::sync::Arc<std::io::Error>);

impl PartialEq for IoError {
    fn eq(&self, other: &IoError) -> bool {
        self.0.kind() == other.0.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Error {
    /// A file error caused by the operating system's `e`: `reason` is followed by its message,
    /// and `e` is the error's source.
    pub(crate) fn io(
        path: &std::path::Path,
        reason: impl fmt::Display,
        e: std::io::Error,
    ) -> Error {
        Error::File {
            path: path.display().to_string(),
            reason: format!("{reason}: {e}"),
            io: Some(IoError(std::sync::Arc::new(e))),
        }
    }
}
