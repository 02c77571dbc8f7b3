//! Source rules checked inside `cargo test`.
//!
//! * Library code reports bad input as typed errors: no `unwrap()`, `expect(…)`, `panic!`,
//!   `unreachable!`, `todo!` or `unimplemented!` outside tests. The crate root denies the
//!   matching clippy lints; this test is the same check inside `cargo test` (which CI runs),
//!   so a new `unwrap` cannot land even where clippy is not run.
//! * The house plan (`docs/architecture.md`): the rooms import each other without a cycle,
//!   and the checker/reader side never imports the simulator side.
//!
//! Doc comments (examples), items under `#[cfg(test)]` and files that are test modules (their
//! first code line is `#![cfg(test)]`) are skipped; `assert!` stays allowed for internal
//! invariants.

use std::path::Path;

const FORBIDDEN: [&str; 6] = [
    ".unwrap()",
    ".expect(",
    "panic!(",
    "unreachable!(",
    "todo!(",
    "unimplemented!(",
];

/// The library lines of a source file: comments dropped, `#[cfg(test)]` items skipped (by
/// brace matching from the attribute to the end of the item), none in a test module's file.
fn library_lines(text: &str) -> Vec<(usize, String)> {
    let first_code = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("//"));
    if first_code == Some("#![cfg(test)]") {
        return vec![];
    }
    let mut out = vec![];
    let mut skipping = false;
    let mut depth = 0i64;
    let mut opened = false;
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("").to_string();
        if !skipping && line.trim_start().starts_with("#[cfg(test)]") {
            skipping = true;
            depth = 0;
            opened = false;
            continue;
        }
        if skipping {
            for ch in code.chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            // An item without a body (`#[cfg(test)] use …;`) ends at its semicolon.
            if (opened && depth == 0) || (!opened && code.trim_end().ends_with(';')) {
                skipping = false;
            }
            continue;
        }
        out.push((i + 1, code));
    }
    out
}

fn scan(dir: &Path, found: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            scan(&p, found);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            for (n, code) in library_lines(&text) {
                for f in FORBIDDEN {
                    if code.contains(f) {
                        found.push(format!("{}:{n}: {}", p.display(), code.trim()));
                    }
                }
            }
        }
    }
}

#[test]
fn library_code_has_no_unwrap_expect_or_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = vec![];
    // The library and the lab's library (its binary is `lab/src/bin`, scanned too: it reports
    // errors with exit codes, never a panic).
    scan(&root.join("src"), &mut found);
    scan(&root.join("lab/src"), &mut found);
    assert!(
        found.is_empty(),
        "panicking calls in library code:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_what_it_forbids() {
    let text = "fn f() { x.unwrap(); }\n/// y.unwrap()\n#[cfg(test)]\nmod t {\n    fn g() { z.unwrap(); }\n}\nfn h() { panic!(\"no\") }\n";
    let lines: Vec<String> = library_lines(text).into_iter().map(|(_, c)| c).collect();
    let hits: Vec<&String> = lines
        .iter()
        .filter(|c| FORBIDDEN.iter().any(|f| c.contains(f)))
        .collect();
    assert_eq!(hits.len(), 2, "{hits:?}");
}

// ------------------------------------------------------------------------- the house plan

/// The checker/reader side of the house.
const JUDGE: [&str; 5] = ["trace", "io", "check", "bounds", "verdict"];
/// The simulator side: the lab's rooms (in the `ttrace-lab` crate, `lab/src/`, which the
/// library cannot import at all), plus the reference engine's model (its kernels are the
/// reference arithmetic the bounds execute).
const LAB: [&str; 3] = ["shard", "bugs", "validate"];

/// The room a `crate::` path names: its first segment, except the format names
/// (`format::kind`), which sit below `error` while the rest of `format` sits above it.
fn room_of(path: &[&str]) -> String {
    match path {
        ["format", "kind", ..] => "format::kind".into(),
        [first, ..] => (*first).into(),
        [] => String::new(),
    }
}

/// Every `crate::` path in `code`, as its segments (a `crate::{a::b, c}` group gives one path
/// per item).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = vec![];
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let segs: Vec<String> = item
                    .split("::")
                    .map(|s| s.trim().trim_start_matches('{').to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                if !segs.is_empty() {
                    out.push(segs);
                }
            }
            continue;
        }
        let segs: Vec<String> = rest
            .split("::")
            .map(|s| {
                s.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|s| !s.is_empty())
            .collect();
        if !segs.is_empty() {
            out.push(segs);
        }
    }
    out
}

/// The room of a source file (`src/check/dirs/mod.rs` → `check`; `src/format/kind.rs` →
/// `format::kind`).
fn room_of_file(rel: &Path) -> String {
    let parts: Vec<&str> = rel
        .iter()
        .map(|s| s.to_str().unwrap_or(""))
        .map(|s| s.trim_end_matches(".rs"))
        .collect();
    room_of(&parts)
}

/// Arrows between rooms, each with a file and line that draws it: (from, to, where, path).
fn arrows(files: &[(String, String)], model_names: &[String]) -> Vec<(String, String, String)> {
    let mut out = vec![];
    for (rel, text) in files {
        let from = room_of_file(Path::new(rel));
        for (n, code) in library_lines(text) {
            for segs in crate_paths(&code) {
                let s: Vec<&str> = segs.iter().map(String::as_str).collect();
                let mut to = room_of(&s);
                // The engine's model is the simulator side; its kernels are not.
                if to == "engine"
                    && (s.get(1) == Some(&"model")
                        || s.get(1).is_some_and(|x| model_names.iter().any(|m| m == x)))
                {
                    to = "engine::model".into();
                }
                let known = ["Result", "Error", "IoError"];
                if s.len() == 1 && known.contains(&s[0]) {
                    to = "error".into();
                }
                if to != from && !to.is_empty() {
                    out.push((from.clone(), to, format!("{rel}:{n}: {}", code.trim())));
                }
            }
        }
    }
    out
}

/// A cycle among the rooms, as the rooms in order, if there is one.
fn find_cycle(arrows: &[(String, String, String)]) -> Option<Vec<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut g: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (a, b, _) in arrows {
        g.entry(a).or_default().insert(b);
    }
    // Depth-first search with colours: 1 on the stack, 2 done.
    fn visit<'a>(
        v: &'a str,
        g: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        colour: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        colour.insert(v, 1);
        stack.push(v);
        for &w in g.get(v).into_iter().flatten() {
            match colour.get(w) {
                Some(1) => {
                    let at = stack.iter().position(|x| *x == w).unwrap_or(0);
                    let mut c: Vec<String> = stack[at..].iter().map(|s| s.to_string()).collect();
                    c.push(w.to_string());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(w, g, colour, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        colour.insert(v, 2);
        None
    }
    let mut colour = BTreeMap::new();
    let keys: Vec<&str> = g.keys().copied().collect();
    for v in keys {
        if !colour.contains_key(v) {
            if let Some(c) = visit(v, &g, &mut colour, &mut vec![]) {
                return Some(c);
            }
        }
    }
    None
}

/// Forbidden arrows: from the checker/reader side to the simulator side.
fn judge_to_lab(arrows: &[(String, String, String)]) -> Vec<String> {
    arrows
        .iter()
        .filter(|(a, b, _)| {
            JUDGE.contains(&a.as_str()) && (LAB.contains(&b.as_str()) || b == "engine::model")
        })
        .map(|(a, b, at)| format!("{a} -> {b}: {at}"))
        .collect()
}

fn library_files(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "bin") {
                library_files(&p, root, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().to_string();
            out.push((rel, std::fs::read_to_string(&p).unwrap()));
        }
    }
}

/// The names the engine publishes from its model (`pub use model::{…}` in engine/mod.rs).
fn model_names(src: &Path) -> Vec<String> {
    let face = std::fs::read_to_string(src.join("engine/mod.rs")).unwrap();
    let at = face
        .find("pub use model::{")
        .expect("engine/mod.rs publishes its model");
    let group = &face[at + "pub use model::{".len()..];
    group[..group.find('}').unwrap()]
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

#[test]
fn the_rooms_import_without_a_cycle_and_the_checker_never_imports_the_simulator() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    library_files(&src, &src, &mut files);
    let names = model_names(&src);
    assert!(names.iter().any(|n| n == "Gpt"), "{names:?}");
    let a = arrows(&files, &names);
    // The scan sees the house: the checker imports the verdict, the bounds the engine's kernels.
    assert!(a.iter().any(|(x, y, _)| x == "check" && y == "verdict"));
    assert!(a.iter().any(|(x, y, _)| x == "bounds" && y == "engine"));
    // The lab lives in its own crate.
    for room in LAB {
        assert!(
            !src.join(room).exists() && !src.join(format!("{room}.rs")).exists(),
            "{room} belongs to lab/"
        );
    }
    let bad = judge_to_lab(&a);
    assert!(
        bad.is_empty(),
        "checker/reader side -> simulator side:\n{}",
        bad.join("\n")
    );
    if let Some(c) = find_cycle(&a) {
        let at: Vec<&String> = a
            .iter()
            .filter(|(x, y, _)| c.windows(2).any(|w| w[0] == *x && w[1] == *y))
            .map(|(_, _, at)| at)
            .collect();
        panic!(
            "a cycle of rooms: {}\n{}",
            c.join(" -> "),
            at.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
        );
    }
}

/// The house plan's scan finds what it forbids: a cycle, an arrow from the checker to the
/// simulator (directly and through the engine's model), grouped imports and comments left out.
#[test]
fn the_plan_scan_sees_what_it_forbids() {
    let files = vec![
        (
            "check/a.rs".to_string(),
            "use crate::{verdict::X, shard::Y};\n// crate::bugs::Z\n".to_string(),
        ),
        (
            "verdict/mod.rs".to_string(),
            "fn f() { crate::check::g(); }\n".to_string(),
        ),
        (
            "io/x.rs".to_string(),
            "use crate::engine::Gpt;\nuse crate::engine::matmul;\n".to_string(),
        ),
        (
            "error.rs".to_string(),
            "use crate::format::kind::Format;\n".to_string(),
        ),
        (
            "format/mod.rs".to_string(),
            "use crate::error::{Error, Result};\n".to_string(),
        ),
    ];
    let a = arrows(&files, &["Gpt".to_string()]);
    let bad = judge_to_lab(&a);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(bad[0].starts_with("check -> shard") && bad[1].starts_with("io -> engine::model"));
    let c = find_cycle(&a).expect("check <-> verdict");
    assert!(
        c.contains(&"check".to_string()) && c.contains(&"verdict".to_string()),
        "{c:?}"
    );
    // error -> format::kind and format -> error is no cycle.
    let a2: Vec<_> = a.into_iter().filter(|(x, _, _)| x != "verdict").collect();
    assert_eq!(find_cycle(&a2), None);
}
