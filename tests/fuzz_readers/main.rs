//! Fuzzing of the file readers: safetensors, npy, and trace directories (manifest + rank files
//! through `TraceDir` and the whole `check_dirs` pipeline), with corrupted files made from valid
//! seeds by byte-level mutations (bit flips, random bytes, insertions, deletions, truncation,
//! duplicated chunks) and structure-aware ones (a header or manifest JSON node replaced by a
//! hostile value — huge or negative numbers, floats, strings, nulls, nested lists —, keys deleted
//! or duplicated, header lengths that lie); and file-system shapes of a trace directory (reader
//! `fs`: links that leave the directory or stay inside it, dangling links and loops, FIFOs,
//! directories and `/dev/zero` where files belong, a subdirectory linked to `/` or to the
//! parent with the manifest routed through it), where the property also asks that a trace
//! whose files leave the directory or are not regular is refused, and that no run hangs.
//!
//! Every call runs under `catch_unwind` and a counting global allocator: the property is "no
//! panic, and no allocation larger than a fixed budget" (a lying header must not make a reader
//! allocate what the file does not hold). Inputs that break it are written to
//! `target/tmp/fuzz-failures/` for turning into regression cases (`tests/fuzz_regressions/`,
//! replayed by `regression_cases_are_rejected_cleanly`); with `TTRACE_FUZZ_CORPUS=DIR` the first
//! input of every distinct error message is saved too (the regression set holds such a corpus).
//!
//! * In CI: `quick_fuzz_of_every_reader` (a fixed seed, a few thousand inputs per reader).
//! * The long run (10 minutes per reader by default; `TTRACE_FUZZ_SECS` overrides):
//!   `cargo test --release --test fuzz_readers -- --ignored --nocapture`.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ttrace::check::{check_dirs, PricingMode};
use ttrace::io::{npy, safetensors, write_trace_dir, TraceDir};
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::Format;
use ttrace::Tensor;

mod mutate;
use mutate::{json_text, mutate_fs, mutate_json};

// ---------------------------------------------------------------------------------------------
// A global allocator that records the largest single allocation since the last reset.

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// No single allocation of a reader may exceed this (the seeds are a few kilobytes; decoded
/// values take 8 bytes per element of what the file holds).
const ALLOC_BUDGET: usize = 16 << 20;

// ---------------------------------------------------------------------------------------------
// Seeds.

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-fuzz-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tensor(shape: &[usize], f: Format, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut g = ttrace::engine::SplitMix64::for_name("fuzz", seed);
    let v = (0..n)
        .map(|_| f.round(4.0 * g.uniform() - 2.0, ttrace::Overflow::Saturating))
        .collect();
    Tensor::from_vec(shape, v, f).unwrap()
}

fn safetensors_seed(dir: &Path) -> Vec<u8> {
    let p = dir.join("seed.safetensors");
    let ts = [
        ("a", tensor(&[4, 8], Format::BF16, 1)),
        ("b", tensor(&[3], Format::F32, 2)),
        ("c", tensor(&[2, 2], Format::E4M3, 3)),
        ("d", tensor(&[0, 5], Format::F64, 4)),
        ("e", tensor(&[2, 3], Format::F16, 5)),
    ];
    let list: Vec<(&str, &Tensor)> = ts.iter().map(|(n, t)| (*n, t)).collect();
    let mut meta = BTreeMap::new();
    meta.insert("rank".to_string(), "0".to_string());
    safetensors::write(&p, &list, &meta).unwrap();
    std::fs::read(&p).unwrap()
}

fn npy_seeds(dir: &Path) -> Vec<(Vec<u8>, Format)> {
    [
        (tensor(&[3, 4], Format::F32, 6), Format::F32),
        (tensor(&[5], Format::BF16, 7), Format::BF16),
        (tensor(&[2, 3], Format::E5M2, 8), Format::E5M2),
        (tensor(&[2, 2, 2], Format::F64, 9), Format::F64),
    ]
    .into_iter()
    .map(|(t, f)| {
        let p = dir.join("seed.npy");
        npy::write(&p, &t).unwrap();
        (std::fs::read(&p).unwrap(), f)
    })
    .collect()
}

/// A reference (one rank) and a candidate (TP 2: one split and one replicated tensor).
fn trace_seed(dir: &Path) -> (PathBuf, PathBuf) {
    let (single, tp2) = (Mesh::single(), Mesh::megatron(2, 1, 1, false).unwrap());
    let mut split = Layout::replicated();
    split.set(Axis::TP, Placement::split(1));
    let x = tensor(&[4, 6], Format::BF16, 10);
    let y = tensor(&[4, 6], Format::BF16, 11);
    let shards = ttrace::trace::shard(&x, &split, &tp2, "m0|fwd.output.0").unwrap();
    // An FP8 tensor whose candidate is a partial sum (summed a block at a time from the
    // files), and a consumed tensor equal to a produced one (judged against it).
    let mut partial = Layout::replicated();
    partial.set(Axis::TP, Placement::Partial);
    let z = tensor(&[3, 5], Format::E4M3, 12);
    let addends = ttrace::trace::shard(&z, &partial, &tp2, "m2|fwd.output.0").unwrap();
    let kinds = HashMap::new();
    let none = HashMap::new();
    let r = dir.join("reference");
    let c = dir.join("candidate");
    write_trace_dir(
        &r,
        &single,
        None,
        &[
            (
                "m0|fwd.output.0".into(),
                Layout::replicated(),
                vec![x.clone()],
            ),
            (
                "m1|fwd.output.0".into(),
                Layout::replicated(),
                vec![y.clone()],
            ),
            (
                "m2|fwd.input.0".into(),
                Layout::replicated(),
                vec![y.clone()],
            ),
            ("m2|fwd.output.0".into(), Layout::replicated(), vec![z]),
        ],
        &kinds,
        &none,
    )
    .unwrap();
    write_trace_dir(
        &c,
        &tp2,
        None,
        &[
            ("m0|fwd.output.0".into(), split, shards),
            (
                "m1|fwd.output.0".into(),
                Layout::replicated(),
                vec![y.clone(), y.clone()],
            ),
            (
                "m2|fwd.input.0".into(),
                Layout::replicated(),
                vec![y.clone(), y],
            ),
            ("m2|fwd.output.0".into(), partial, addends),
        ],
        &kinds,
        &none,
    )
    .unwrap();
    (r, c)
}

// ---------------------------------------------------------------------------------------------
// Mutations.

fn mutate_bytes(data: &mut Vec<u8>, g: &mut StdRng) {
    let rounds = g.random_range(1..4);
    for _ in 0..rounds {
        if data.is_empty() {
            data.push(g.random());
            continue;
        }
        let i = g.random_range(0..data.len());
        match g.random_range(0..8) {
            0 => data[i] ^= 1 << g.random_range(0..8),
            1 => data[i] = g.random(),
            2 => {
                let extra: Vec<u8> = (0..g.random_range(1..16)).map(|_| g.random()).collect();
                data.splice(i..i, extra);
            }
            3 => {
                let end = (i + g.random_range(1..32)).min(data.len());
                data.drain(i..end);
            }
            4 => data.truncate(i),
            5 => {
                let end = (i + g.random_range(1..64)).min(data.len());
                let chunk = data[i..end].to_vec();
                let at = g.random_range(0..data.len());
                data.splice(at..at, chunk);
            }
            6 => data.extend((0..g.random_range(1..64)).map(|_| g.random::<u8>())),
            _ => {
                // A little-endian integer field somewhere set to an extreme.
                let v: u64 = [0, 1, u64::MAX, 1 << 40, u64::from(u32::MAX)][g.random_range(0..5)];
                let w = g.random_range(1..=8usize).min(data.len() - i);
                data[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
        }
    }
}

/// A corrupted safetensors file: its JSON header mutated (and re-framed, maybe with a lying
/// length) or its bytes.
fn mutate_safetensors(seed: &[u8], g: &mut StdRng) -> Vec<u8> {
    let n = u64::from_le_bytes(seed[..8].try_into().unwrap()) as usize;
    let (header, data) = (&seed[8..8 + n], &seed[8 + n..]);
    if g.random_bool(0.5) {
        let mut v: serde_json::Value = serde_json::from_slice(header).unwrap();
        for _ in 0..g.random_range(1..3) {
            mutate_json(&mut v, g);
        }
        let h = json_text(&v, g);
        let mut len = h.len() as u64;
        if g.random_bool(0.2) {
            len = [0, len + 1, len.saturating_sub(1), u64::MAX, 1 << 40][g.random_range(0..5)];
        }
        let mut out = len.to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        if g.random_bool(0.2) {
            mutate_bytes(&mut out, g);
        }
        out
    } else {
        let mut out = seed.to_vec();
        mutate_bytes(&mut out, g);
        out
    }
}

/// A corrupted npy file: header dictionary text, version/length fields, or bytes.
fn mutate_npy(seed: &[u8], g: &mut StdRng) -> Vec<u8> {
    let mut out = seed.to_vec();
    match g.random_range(0..3) {
        0 => {
            // Replace the header's dictionary text by a mutated one (lengths kept honest).
            let hlen = u16::from_le_bytes([seed[8], seed[9]]) as usize;
            let text = String::from_utf8_lossy(&seed[10..10 + hlen]).to_string();
            let subs = [
                ("'descr': '", "'descr': '>"),
                ("'fortran_order': False", "'fortran_order': True"),
                ("'shape': (", "'shape': (99999999999999999999, "),
                ("'shape': (", "'shape': (-3, "),
                ("'shape': (", "'shape': (1099511627776, 1099511627776, "),
                ("'shape': (", "'shape': ("),
                ("'descr'", "'desc'"),
                ("}", ", 'descr': '<f8'}"),
                ("<", "|"),
                ("'", "\""),
            ];
            let (a, b) = subs[g.random_range(0..subs.len())];
            let new = text.replacen(a, b, 1);
            let mut h = new.into_bytes();
            while (10 + h.len()) % 64 != 0 {
                h.insert(h.len() - 1, b' ');
            }
            out = seed[..8].to_vec();
            out.extend_from_slice(&(h.len() as u16).to_le_bytes());
            out.extend_from_slice(&h);
            out.extend_from_slice(&seed[10 + hlen..]);
        }
        1 => {
            // Version byte and header length.
            out[6] = [1, 2, 3, 0, 9, 255][g.random_range(0..6)];
            let l: u16 = [0, 1, u16::MAX, 9, 64][g.random_range(0..5)];
            out[8..10].copy_from_slice(&l.to_le_bytes());
        }
        _ => mutate_bytes(&mut out, g),
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The harness.

/// What one reader call gave: an error message (the normal outcome for corrupted input), a
/// success, a panic, or an allocation over budget.
enum Outcome {
    Ok,
    Err(String),
    Panic(String),
    Alloc(usize),
}

fn guarded(f: impl FnOnce() -> Result<(), String>) -> Outcome {
    LARGEST.store(0, Ordering::Relaxed);
    let r = catch_unwind(AssertUnwindSafe(f));
    let largest = LARGEST.load(Ordering::Relaxed);
    match r {
        Err(p) => Outcome::Panic(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
        Ok(_) if largest > ALLOC_BUDGET => Outcome::Alloc(largest),
        Ok(Ok(())) => Outcome::Ok,
        Ok(Err(e)) => Outcome::Err(e),
    }
}

fn read_safetensors(p: &Path) -> Result<(), String> {
    let mut f = safetensors::SafetensorsFile::open(p).map_err(|e| e.to_string())?;
    let names: Vec<String> = f.entries().keys().cloned().collect();
    for n in names {
        f.read(&n).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn read_npy(p: &Path, declared: Option<Format>) -> Result<(), String> {
    npy::read(p, declared)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn read_trace(reference: &Path, candidate: &Path) -> Result<(), String> {
    let mut c = TraceDir::open(candidate).map_err(|e| e.to_string())?;
    let ids: Vec<String> = c.ids().to_vec();
    for id in &ids {
        c.logical(id).map_err(|e| e.to_string())?;
    }
    let mut r = TraceDir::open(reference).map_err(|e| e.to_string())?;
    check_dirs(&mut r, &mut c, PricingMode::Auto, &|| {})
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[derive(Default)]
struct Tally {
    runs: u64,
    ok: u64,
    errors: u64,
    kinds: BTreeSet<String>,
    failures: Vec<String>,
    /// Where to save the first input of every new kind of error (`TTRACE_FUZZ_CORPUS`).
    corpus: Option<PathBuf>,
}

impl Tally {
    fn record(&mut self, reader: &str, out: Outcome, input: &[u8]) {
        self.record_as(reader, reader, out, input)
    }

    /// `name` prefixes saved inputs (it carries what replaying needs, e.g. npy's declared
    /// format).
    fn record_as(&mut self, reader: &str, name: &str, out: Outcome, input: &[u8]) {
        self.runs += 1;
        match out {
            Outcome::Ok => self.ok += 1,
            Outcome::Err(e) => {
                self.errors += 1;
                // The error's kind: its text without digits and quoted parts.
                let kind: String = e
                    .split('\'')
                    .step_by(2)
                    .collect::<String>()
                    .chars()
                    .filter(|c| !c.is_ascii_digit())
                    .take(90)
                    .collect();
                if self.kinds.insert(kind) {
                    if let Some(dir) = &self.corpus {
                        std::fs::create_dir_all(dir).unwrap();
                        let p = dir.join(format!("{name}-kind{}.bin", self.kinds.len()));
                        std::fs::write(p, input).unwrap();
                    }
                }
            }
            Outcome::Panic(m) => self.fail(reader, format!("panic: {m}"), input),
            Outcome::Alloc(n) => self.fail(reader, format!("allocation of {n} bytes"), input),
        }
    }

    fn fail(&mut self, reader: &str, what: String, input: &[u8]) {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{reader}-{}.bin", self.failures.len()));
        std::fs::write(&p, input).unwrap();
        self.failures
            .push(format!("{reader}: {what} (input saved to {})", p.display()));
    }
}

/// Run `f` on another thread; a run that does not finish within `limit` is a hang.
fn with_deadline(limit: Duration, f: impl FnOnce() -> Outcome + Send + 'static) -> Outcome {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| Outcome::Panic(format!("no answer within {limit:?} (a hang)")))
}

/// Fuzz one reader for `budget` (or `max_runs` inputs, whichever comes first).
fn fuzz(reader: &str, budget: Duration, max_runs: u64, seed: u64) -> Tally {
    let dir = tmp(reader);
    let mut g = StdRng::seed_from_u64(seed);
    let mut tally = Tally {
        corpus: std::env::var_os("TTRACE_FUZZ_CORPUS").map(PathBuf::from),
        ..Tally::default()
    };
    let start = Instant::now();
    let st_seed = safetensors_seed(&dir);
    let npy_seed = npy_seeds(&dir);
    let (rdir, cdir) = trace_seed(&dir);
    let manifest = std::fs::read(cdir.join("manifest.json")).unwrap();
    let rank1 = std::fs::read(cdir.join("rank1.safetensors")).unwrap();
    while start.elapsed() < budget && tally.runs < max_runs {
        match reader {
            #[cfg(unix)]
            "fs" => {
                // A fresh copy of the candidate, one to three file-system mutations.
                let run = dir.join("fs");
                let _ = std::fs::remove_dir_all(&run);
                let (c, outside) = (run.join("candidate"), run.join("outside"));
                std::fs::create_dir_all(&c).unwrap();
                std::fs::create_dir_all(&outside).unwrap();
                for f in ["manifest.json", "rank0.safetensors", "rank1.safetensors"] {
                    std::fs::copy(cdir.join(f), c.join(f)).unwrap();
                }
                let mut done = vec![];
                let mut state = BTreeMap::new();
                for _ in 0..g.random_range(1..4) {
                    done.push(mutate_fs(&c, &cdir, &outside, &mut g, &mut state));
                }
                let refuse = state.values().any(|&b| b);
                let (rd, cd) = (rdir.clone(), c.clone());
                let out = with_deadline(Duration::from_secs(20), move || {
                    guarded(|| read_trace(&rd, &cd))
                });
                let input = done.join("\n").into_bytes();
                match out {
                    Outcome::Ok if refuse => tally.fail(
                        reader,
                        "accepted a trace whose files leave the directory or are not regular"
                            .into(),
                        &input,
                    ),
                    out => tally.record(reader, out, &input),
                }
            }
            "safetensors" => {
                let input = mutate_safetensors(&st_seed, &mut g);
                let p = dir.join("x.safetensors");
                std::fs::write(&p, &input).unwrap();
                tally.record(reader, guarded(|| read_safetensors(&p)), &input);
            }
            "npy" => {
                let (seed_bytes, f) = &npy_seed[g.random_range(0..npy_seed.len())];
                let input = mutate_npy(seed_bytes, &mut g);
                let p = dir.join("x.npy");
                std::fs::write(&p, &input).unwrap();
                let declared = match g.random_range(0..3) {
                    0 => None,
                    1 => Some(*f),
                    _ => Some(Format::ALL[g.random_range(0..Format::ALL.len())]),
                };
                let name = format!(
                    "npy-{}",
                    declared.map_or("none".to_string(), |f| f.to_string())
                );
                tally.record_as(reader, &name, guarded(|| read_npy(&p, declared)), &input);
            }
            _ => {
                // The manifest (structure-aware or bytes), or a rank file of the candidate.
                let mut m = manifest.clone();
                let mut r1 = rank1.clone();
                match g.random_range(0..3) {
                    0 => {
                        let mut v: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
                        for _ in 0..g.random_range(1..3) {
                            mutate_json(&mut v, &mut g);
                        }
                        m = json_text(&v, &mut g);
                    }
                    1 => mutate_bytes(&mut m, &mut g),
                    _ => r1 = mutate_safetensors(&rank1, &mut g),
                }
                std::fs::write(cdir.join("manifest.json"), &m).unwrap();
                std::fs::write(cdir.join("rank1.safetensors"), &r1).unwrap();
                let mut input = m.clone();
                input.extend_from_slice(b"\n--- rank1.safetensors ---\n");
                input.extend_from_slice(&r1);
                tally.record(reader, guarded(|| read_trace(&rdir, &cdir)), &input);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    tally
}

fn report(reader: &str, t: &Tally, elapsed: Duration) {
    println!(
        "{reader}: {} inputs in {:.0} s ({:.0}/s): {} rejected with an error ({} kinds of message), \
         {} accepted, {} failures",
        t.runs,
        elapsed.as_secs_f64(),
        t.runs as f64 / elapsed.as_secs_f64().max(1e-9),
        t.errors,
        t.kinds.len(),
        t.ok,
        t.failures.len()
    );
    for f in &t.failures {
        println!("  FAILURE {f}");
    }
}

const READERS: [&str; 4] = ["safetensors", "npy", "trace", "fs"];

/// Quick and deterministic: a fixed number of inputs per reader.
#[test]
fn quick_fuzz_of_every_reader() {
    for (i, reader) in READERS.iter().enumerate() {
        let start = Instant::now();
        let t = fuzz(reader, Duration::from_secs(3600), 1500, 2026 + i as u64);
        report(reader, &t, start.elapsed());
        assert!(t.failures.is_empty(), "{reader}: {:?}", t.failures);
        // The mutations must mostly produce rejected input (else they test nothing).
        assert!(
            t.errors > t.runs / 3,
            "{reader}: only {} of {} rejected",
            t.errors,
            t.runs
        );
    }
}

/// The long run: `TTRACE_FUZZ_SECS` seconds per reader (default 600), seeds from the clock.
#[test]
#[ignore]
fn long_fuzz_of_every_reader() {
    let secs: u64 = std::env::var("TTRACE_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let only = std::env::var("TTRACE_FUZZ_READER").ok();
    let mut failures = vec![];
    for reader in READERS {
        if only.as_deref().is_some_and(|o| o != reader) {
            continue;
        }
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        println!("{reader}: seed {seed}");
        let start = Instant::now();
        let t = fuzz(reader, Duration::from_secs(secs), u64::MAX, seed);
        report(reader, &t, start.elapsed());
        for k in &t.kinds {
            println!("    error kind: {k}");
        }
        failures.extend(t.failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Inputs kept from fuzzing (`tests/fuzz_regressions/{reader}-*.bin`): each must be rejected
/// with an error (no panic, no allocation over budget).
#[test]
fn regression_cases_are_rejected_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    let work = tmp("regressions");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let bytes = std::fs::read(&p).unwrap();
        let out = if name.starts_with("safetensors-") {
            let f = work.join("x.safetensors");
            std::fs::write(&f, &bytes).unwrap();
            guarded(|| read_safetensors(&f))
        } else if let Some(rest) = name.strip_prefix("npy-") {
            // npy-{declared format or "none"}-….bin
            let declared = rest
                .split('-')
                .next()
                .and_then(|d| d.parse::<Format>().ok());
            let f = work.join("x.npy");
            std::fs::write(&f, &bytes).unwrap();
            guarded(|| read_npy(&f, declared))
        } else if name.starts_with("trace-") {
            let (r, c) = trace_seed(&work);
            let text = String::from_utf8_lossy(&bytes).to_string();
            let (m, rank1) = match bytes
                .windows(27)
                .position(|w| w == b"\n--- rank1.safetensors ---\n")
            {
                Some(i) => (bytes[..i].to_vec(), Some(bytes[i + 27..].to_vec())),
                None => (text.into_bytes(), None),
            };
            std::fs::write(c.join("manifest.json"), &m).unwrap();
            if let Some(r1) = rank1 {
                std::fs::write(c.join("rank1.safetensors"), &r1).unwrap();
            }
            guarded(|| read_trace(&r, &c))
        } else {
            continue;
        };
        seen += 1;
        match out {
            Outcome::Err(_) => {}
            Outcome::Ok => panic!("{name}: accepted"),
            Outcome::Panic(m) => panic!("{name}: panicked: {m}"),
            Outcome::Alloc(n) => panic!("{name}: allocated {n} bytes"),
        }
    }
    assert!(seen > 0, "no regression cases in {}", dir.display());
}
