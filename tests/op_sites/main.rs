//! Tensors the checker prices through the op registry's models (`papers/checking.md` §8): an
//! attention core's output (`attention`), a cross-entropy's loss and logits gradient (`loss`),
//! each against kernels written in its file and exact f64 values.

mod attention;
mod loss;

/// A fresh directory for one trace of a test (`{what}-{pid}-{name}` under the temporary
/// directory).
fn temp(what: &str, name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-{what}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
