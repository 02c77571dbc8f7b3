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

/// Name `op` as the module op of every entry of the trace in `dir` (as the tracer does for
/// its sites).
fn name_op(dir: &std::path::Path, op: &str) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for e in m["tensors"].as_array_mut().unwrap() {
        e["module"]["op"] = serde_json::Value::String(op.into());
    }
    std::fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
}
