//! Files written by Python's `safetensors` and `numpy` packages (with `ml_dtypes` for BF16 and
//! FP8) are read bit for bit. `.ci/run` installs the packages; without Python this test fails
//! unless `TTRACE_SKIP_PYTHON=1` says to skip it.

use std::process::Command;

use ttrace::io::{npy, SafetensorsFile};
use ttrace::Format;

#[test]
fn python_written_safetensors_and_npy_read_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("ttrace-py-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/write_fixtures.py"
    );
    let run = Command::new("python3").arg(script).arg(&dir).output();
    let ok = matches!(&run, Ok(o) if o.status.success());
    if !ok {
        if std::env::var("TTRACE_SKIP_PYTHON").as_deref() == Ok("1") {
            eprintln!("skipped: python3 with numpy, safetensors and ml_dtypes is not available");
            return;
        }
        panic!(
            "python3 with numpy, safetensors and ml_dtypes is needed (pip install numpy \
             safetensors ml_dtypes; .ci/run does it): {:?}",
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
