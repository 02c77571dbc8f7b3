//! The limits on what ttrace reads from files and arguments, in one place (published as
//! [`ttrace::io::limits`](crate::io::limits)). They sit at the bottom of the house: the
//! arithmetic (split parts), the trace vocabulary (ranks, dimensions) and the readers all
//! check against them.

/// Largest manifest file (each `manifest.json` or per-rank fragment): 512 MiB, about two
/// million entries as ttrace writes them (one compact line each; a trace of 100,000
/// tensors on 2 ranks is 52 MB). A checked trace is held at about 4× its manifests' size
/// (the entries, the safetensors headers they name and the per-id index).
pub const MANIFEST_BYTES: u64 = 512 << 20;
/// Largest safetensors header: 100 MB (the `safetensors` crate's own cap).
pub const SAFETENSORS_HEADER_BYTES: u64 = 100_000_000;
/// Largest `.npy` header: 1 MiB (NumPy writes a few hundred bytes).
pub const NPY_HEADER_BYTES: u64 = 1 << 20;
/// Most ranks in a mesh: 2^20.
pub const RANKS: usize = 1 << 20;
/// Most axes of a mesh: 16 (Megatron-LM and torchtitan use at most six: pp, dp_replicate,
/// dp_shard, cp, tp, ep).
pub const MESH_AXES: usize = 16;
/// Longest mesh axis name: 32 bytes.
pub const AXIS_NAME_BYTES: usize = 32;
/// Most dimensions of a tensor: 64.
pub const DIMS: usize = 64;
/// Most parts of a split (split-K parts, groups × parts of a nested split): 2^20.
pub const SPLIT_PARTS: usize = 1 << 20;
/// Most seeds or samples of a validation sweep: 10^7.
pub const SWEEP_RUNS: u64 = 10_000_000;
