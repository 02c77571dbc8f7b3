//! Trace files: safetensors and `.npy` tensors, and the manifest that says what each stored
//! tensor is (see `papers/trace-format.md`).

pub mod manifest;
pub mod npy;
pub mod safetensors;

pub use manifest::{read_manifest, write_trace_dir, Manifest, ManifestEntry, ModuleInfo, TraceDir};
pub use safetensors::SafetensorsFile;
