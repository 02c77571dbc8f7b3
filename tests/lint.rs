//! Library code reports bad input as typed errors: no `unwrap()`, `expect(…)`, `panic!`,
//! `unreachable!`, `todo!` or `unimplemented!` outside tests. The crate root denies the
//! matching clippy lints; this test is the same check inside `cargo test` (which CI runs), so a
//! new `unwrap` cannot land even where clippy is not run. Doc comments (examples), items
//! under `#[cfg(test)]` and files that are test modules (their first code line is
//! `#![cfg(test)]`) are skipped; `assert!` stays allowed for internal invariants.

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
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = vec![];
    scan(&src, &mut found);
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
