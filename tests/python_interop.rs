//! Files written by Python's `safetensors` and `numpy` packages (with `ml_dtypes` for BF16 and
//! FP8) are read bit for bit. When `python3` lacks the packages, the test makes its own virtual
//! environment under the target directory and installs them from PyPI (once; later runs reuse
//! it), so `cargo test` needs nothing but `python3` with `venv`. Without Python, or without
//! network on the first run, it fails unless `TTRACE_SKIP_PYTHON=1` says to skip it.

use std::process::Command;

use ttrace::io::{npy, safetensors::SafetensorsFile};
use ttrace::Format;

#[test]
fn python_written_safetensors_and_npy_read_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("ttrace-py-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/write_fixtures.py"
    );
    let has_packages = |py: &str| {
        Command::new(py)
            .args(["-c", "import numpy, safetensors, ml_dtypes"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let python = if has_packages("python3") {
        "python3".to_string()
    } else {
        // A private environment, made once.
        let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyenv");
        let py = venv.join("bin/python3").display().to_string();
        if !has_packages(&py) {
            let _ = Command::new("python3")
                .arg("-m")
                .arg("venv")
                .arg(&venv)
                .output();
            let _ = Command::new(&py)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(["numpy", "safetensors", "ml_dtypes"])
                .output();
        }
        py
    };
    let run = Command::new(&python).arg(script).arg(&dir).output();
    let ok = matches!(&run, Ok(o) if o.status.success());
    if !ok {
        if std::env::var("TTRACE_SKIP_PYTHON").as_deref() == Ok("1") {
            eprintln!("skipped: python3 with numpy, safetensors and ml_dtypes is not available");
            return;
        }
        panic!(
            "python3 with numpy, safetensors and ml_dtypes is needed (installing them into \
             a private venv failed; pip install numpy safetensors ml_dtypes): {:?}",
            run.map(|o| String::from_utf8_lossy(&o.stderr).to_string())
        );
    }
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let mut st = SafetensorsFile::open(&dir.join("all.safetensors")).unwrap();
    assert_eq!(
        st.metadata().get("writer").map(String::as_str),
        Some("python safetensors")
    );
    for (name, f) in [
        ("f64", Format::F64),
        ("f32", Format::F32),
        ("f16", Format::F16),
        ("bf16", Format::BF16),
        ("e4m3", Format::E4M3),
        ("e5m2", Format::E5M2),
    ] {
        let want: Vec<u64> = expected[name]["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        for (source, t) in [
            ("safetensors", st.read(name).unwrap()),
            (
                "npy",
                npy::read(&dir.join(format!("{name}.npy")), Some(f)).unwrap(),
            ),
        ] {
            assert_eq!(t.format(), f, "{name} {source}");
            assert_eq!(t.shape(), [4, 4], "{name} {source}");
            let got: Vec<u64> = t.values().iter().map(|&v| f.encode(v).unwrap()).collect();
            // Bit for bit, NaN payloads and signed zeros included.
            assert_eq!(got, want, "{name} {source}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
