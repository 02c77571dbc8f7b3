//! The mutations: hostile JSON values, structure-aware edits of headers and manifests, their text with duplicated keys and odd spacing, and file-system mutations of a trace directory.

use super::*;

pub(super) fn hostile_value(g: &mut StdRng) -> serde_json::Value {
    use serde_json::json;
    match g.random_range(0..16) {
        0 => json!(u64::MAX),
        1 => json!(1u64 << 62),
        2 => json!(-1),
        3 => json!(1.5),
        4 => json!(null),
        5 => json!(""),
        6 => json!("../../etc/passwd"),
        7 => json!(true),
        8 => json!([]),
        9 => json!([u64::MAX, u64::MAX]),
        10 => json!([1u64 << 40, 1u64 << 40]),
        11 => json!({"x": [1, 2, {"y": null}]}),
        12 => json!("F8_E4M3"),
        13 => json!(g.random_range(0..64u64)),
        14 => json!("\u{fffd}\u{0}é"),
        _ => json!([g.random_range(0..8u64), g.random_range(0..8u64)]),
    }
}

/// Replace a random node of `v` (descending at random) by a hostile value, or delete a key.
pub(super) fn mutate_json(v: &mut serde_json::Value, g: &mut StdRng) {
    let depth = g.random_range(0..4);
    mutate_at(v, depth, g);
}

pub(super) fn mutate_at(node: &mut serde_json::Value, depth: u32, g: &mut StdRng) {
    if depth > 0 {
        match node {
            serde_json::Value::Object(m) if !m.is_empty() => {
                let k = m.keys().nth(g.random_range(0..m.len())).cloned().unwrap();
                if g.random_bool(0.15) {
                    m.remove(&k);
                } else {
                    mutate_at(m.get_mut(&k).unwrap(), depth - 1, g);
                }
                return;
            }
            serde_json::Value::Array(a) if !a.is_empty() => {
                let i = g.random_range(0..a.len());
                mutate_at(&mut a[i], depth - 1, g);
                return;
            }
            _ => {}
        }
    }
    *node = hostile_value(g);
}

/// Serialize, then maybe duplicate one `"key": value` member textually (JSON objects with
/// duplicate names, which a map would silently collapse).
pub(super) fn json_text(v: &serde_json::Value, g: &mut StdRng) -> Vec<u8> {
    let mut text = serde_json::to_string(v).unwrap();
    if g.random_bool(0.2) {
        if let serde_json::Value::Object(m) = v {
            if let Some((k, x)) = m.iter().nth(g.random_range(0..m.len().max(1))) {
                let member = format!("{}:{}", serde_json::to_string(k).unwrap(), x);
                if let Some(pos) = text.find('{') {
                    text.insert_str(pos + 1, &format!("{member},"));
                }
            }
        }
    }
    text.into_bytes()
}

/// One file-system mutation of the candidate trace directory `c` (rank files `rank0/1`, the
/// manifest): links that leave the directory or stay inside, dangling links and loops, FIFOs,
/// directories and devices where files belong, a subdirectory linked to `/` or to the parent
/// with the manifest pointing through it. Returns what it did; `refuse` records, per file,
/// whether its present state must make the trace be refused (a later mutation of the same
/// file replaces the earlier one's verdict).
#[cfg(unix)]
pub(super) fn mutate_fs(
    c: &Path,
    seed: &Path,
    outside: &Path,
    g: &mut StdRng,
    refuse: &mut BTreeMap<&'static str, bool>,
) -> String {
    use std::os::unix::fs::symlink;
    let targets = ["rank0.safetensors", "rank1.safetensors", "manifest.json"];
    let name = targets[g.random_range(0..targets.len())];
    let p = c.join(name);
    // The seed's bytes (the file here may already be a FIFO, which a read would wait on).
    let saved = std::fs::read(seed.join(name)).unwrap();
    if std::fs::remove_file(&p).is_err() {
        let _ = std::fs::remove_dir_all(&p);
    }
    let what = g.random_range(0..9);
    let mut bad = true;
    match what {
        0 => {
            // A link to an identical copy outside.
            let o = outside.join(name);
            std::fs::write(&o, &saved).unwrap();
            symlink(&o, &p).unwrap();
        }
        1 => {
            // A link to an identical copy inside (allowed).
            let o = c.join(format!("data-{name}"));
            std::fs::write(&o, &saved).unwrap();
            symlink(format!("data-{name}"), &p).unwrap();
            bad = false;
        }
        2 => symlink(c.join("nowhere"), &p).unwrap(),
        3 => {
            let _ = symlink(c.join("loop-b"), c.join("loop-a"));
            let _ = symlink(c.join("loop-a"), c.join("loop-b"));
            symlink(c.join("loop-a"), &p).unwrap();
        }
        4 => {
            let path = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o644) }, 0);
        }
        5 => std::fs::create_dir(&p).unwrap(),
        6 => symlink("/dev/zero", &p).unwrap(),
        7 => {
            // Put the file back; route the manifest through a subdirectory linked to `/` (an
            // escape) or to the parent directory (back inside: allowed).
            std::fs::write(&p, &saved).unwrap();
            bad = false;
            let sub = c.join("sub");
            let _ = std::fs::remove_file(&sub);
            let to_root = g.random_bool(0.5);
            symlink(
                if to_root {
                    Path::new("/")
                } else {
                    Path::new("..")
                },
                &sub,
            )
            .unwrap();
            let m = c.join("manifest.json");
            let is_file = std::fs::symlink_metadata(&m).is_ok_and(|t| t.file_type().is_file());
            let text = if is_file {
                std::fs::read_to_string(&m).unwrap_or_default()
            } else {
                String::new()
            };
            let via = if to_root {
                "sub/etc/passwd"
            } else {
                "sub/candidate/rank1.safetensors"
            };
            if is_file && name != "manifest.json" {
                std::fs::write(&m, text.replacen("rank1.safetensors", via, 1)).unwrap();
                refuse.insert("route", to_root);
            } else if name == "manifest.json" {
                // The manifest was just restored from the seed: no route any more.
                refuse.insert("route", false);
            }
        }
        _ => {
            // An empty file.
            std::fs::write(&p, b"").unwrap();
        }
    }
    refuse.insert(name, bad);
    if name == "manifest.json" && what != 7 {
        refuse.insert("route", false);
    }
    format!("{name}: mutation {what}")
}
