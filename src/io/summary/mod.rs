//! Summary traces: a few statistics per tensor instead of the tensor, one line per rank and
//! step (`papers/summaries.md`).
//!
//! A summary trace is a directory holding one file per rank, `summaries.rank{r}.jsonl`, to
//! which the tracer appends one line per traced step:
//!
//! ```json
//! {"format": "ttrace-summaries", "version": 1, "step": 3, "rank": 0,
//!  "mesh": {"tp": 2, "cp": 1, "dp": 1, "sp": false},
//!  "tensors": [
//!    {"id": "fc1|fwd.output.0", "dtype": "bf16", "shape": [4, 8],
//!     "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
//!                "tp": {"kind": "split", "dim": 1, "groups": 1}},
//!     "nan": 0, "pinf": 0, "ninf": 0, "sum": 1.5, "sum_sq": 9.25, "sum_abs": 7.0,
//!     "k": 4, "top": [2.0, 1.5, 1.0, 0.5], "bottom": [-2.0, -1.0, -0.5, 0.0]}]}
//! ```
//!
//! Per tensor (this rank's shard): `shape` and `layout` as in a trace manifest (`guessed` and
//! `module` optional, as there); the counts of NaN, +∞ and −∞; over the finite elements, in
//! f64 from values exact in f64, `sum` Σx, `sum_sq` Σx², `sum_abs` Σ|x|; `top`, the `k`
//! largest finite values in descending order, and `bottom`, the `k` smallest in ascending
//! order (fewer when the shard has fewer finite elements). Fields this version does not know
//! are ignored; a key named twice is an error at any depth.
//!
//! Lines of one rank come in increasing step order. A run that stopped mid-write leaves a last
//! line without its newline: it is left out, with a note, never read as a step.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::Format;
use crate::io::guard::{ferr, printable, TrustedDir};
use crate::io::manifest::ModuleInfo;
use crate::trace::{Axis, Layout, Mesh};

mod summarize;
pub use summarize::summarize;

/// The `format` field of a summary line.
pub const SUMMARY_FORMAT: &str = "ttrace-summaries";

/// Most values in `top` (and in `bottom`) of one tensor: 1,024.
pub const MAX_K: usize = 1024;

/// Longest line of a summary file: 256 MiB (a step of about a million tensors).
pub const MAX_LINE_BYTES: usize = 256 << 20;

/// The statistics of one tensor (a shard, or the logical tensor once merged).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// NaN elements.
    pub nan: u64,
    /// +∞ elements.
    pub pinf: u64,
    /// −∞ elements.
    pub ninf: u64,
    /// Σx over the finite elements (f64; an unknown summation order).
    pub sum: f64,
    /// Σx² over the finite elements.
    pub sum_sq: f64,
    /// Σ|x| over the finite elements.
    pub sum_abs: f64,
    /// How many extremes each side was asked for.
    pub k: usize,
    /// The min(k, finite) largest finite values, descending.
    pub top: Vec<f64>,
    /// The min(k, finite) smallest finite values, ascending.
    pub bottom: Vec<f64>,
}

/// One tensor of one rank's step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryEntry {
    /// Canonical id, as in a trace manifest.
    pub id: String,
    /// The stored dtype.
    pub dtype: Format,
    /// This rank's shard's shape.
    pub shape: Vec<usize>,
    /// The placement along each mesh axis.
    pub layout: Layout,
    /// Axes whose placement the writer guessed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guessed: Vec<Axis>,
    /// What produced the tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<ModuleInfo>,
    /// The statistics.
    #[serde(flatten)]
    pub summary: Summary,
}

impl SummaryEntry {
    /// Elements of the shard.
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// One rank's step: one line of `summaries.rank{r}.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryStep {
    /// Always [`SUMMARY_FORMAT`].
    pub format: String,
    /// Always 1.
    pub version: u64,
    /// The training step.
    pub step: u64,
    /// The rank that wrote it.
    pub rank: usize,
    /// The mesh.
    pub mesh: Mesh,
    /// The tensors, in execution order.
    pub tensors: Vec<SummaryEntry>,
}

impl SummaryStep {
    /// Parse and validate one line (`path` and `line` name it in errors).
    pub fn parse(text: &[u8], path: &Path, line: usize) -> Result<SummaryStep> {
        let at = |reason: String| ferr(path, format!("line {line}: {reason}"));
        let v = crate::io::guard::parse_json_strict(text).map_err(at)?;
        let s: SummaryStep = serde_json::from_value(v).map_err(|e| at(e.to_string()))?;
        s.validate().map_err(at)?;
        Ok(s)
    }

    /// The line's contents as the writer renders them (compact JSON, no newline).
    pub fn render(&self) -> Result<String> {
        self.validate().map_err(|reason| Error::InvalidParameter {
            name: "summaries",
            reason,
        })?;
        serde_json::to_string(self).map_err(|e| Error::InvalidParameter {
            name: "summaries",
            reason: e.to_string(),
        })
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.format != SUMMARY_FORMAT || self.version != 1 {
            return Err(format!(
                "not a ttrace summary line of version 1 (format '{}', version {})",
                printable(&self.format),
                self.version
            ));
        }
        // The mesh was validated as it was read (`Mesh`'s deserializer).
        let mesh = &self.mesh;
        if self.rank >= mesh.world() {
            return Err(format!(
                "rank {} outside a mesh of {} ranks",
                self.rank,
                mesh.world()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for e in &self.tensors {
            let who = format!("tensor '{}'", printable(&e.id));
            if !seen.insert(e.id.as_str()) {
                return Err(format!("{who} is named twice"));
            }
            if e.shape.len() > crate::io::limits::DIMS {
                return Err(format!(
                    "{who}: more than {} dimensions",
                    crate::io::limits::DIMS
                ));
            }
            let mut n: u64 = 1;
            for &d in &e.shape {
                n = n
                    .checked_mul(d as u64)
                    .ok_or_else(|| format!("{who}: shape {:?} overflows", e.shape))?;
            }
            if let Some((axis, what)) = crate::trace::layout::layout_problem(&e.layout) {
                return Err(format!("{who}: layout along {}: {what}", axis.name()));
            }
            if let Err(axis) = e.layout.completed(mesh) {
                return Err(format!(
                    "{who}: layout places it along axis '{axis}', which the mesh ({}) does not \
                     have",
                    mesh.label()
                ));
            }
            if let Some(m) = &e.module {
                m.arith
                    .check(&printable(&e.id))
                    .map_err(|x| x.to_string())?;
            }
            e.summary.validate(n).map_err(|r| format!("{who}: {r}"))?;
        }
        Ok(())
    }
}

impl Summary {
    /// The statistics of no element, for `k` extremes per side (what merges start from).
    pub fn empty(k: usize) -> Summary {
        Summary {
            nan: 0,
            pinf: 0,
            ninf: 0,
            sum: 0.0,
            sum_sq: 0.0,
            sum_abs: 0.0,
            k,
            top: Vec::with_capacity(k),
            bottom: Vec::with_capacity(k),
        }
    }

    /// Elements counted as finite, of `n`.
    pub fn finite(&self, n: u64) -> u64 {
        n - self.nan - self.pinf - self.ninf
    }

    /// Check the statistics against a shard of `n` elements.
    fn validate(&self, n: u64) -> std::result::Result<(), String> {
        let nonfinite = self
            .nan
            .checked_add(self.pinf)
            .and_then(|x| x.checked_add(self.ninf))
            .filter(|&x| x <= n)
            .ok_or_else(|| format!("more non-finite elements than its {n}"))?;
        let finite = n - nonfinite;
        for (name, v) in [
            ("sum", self.sum),
            ("sum_sq", self.sum_sq),
            ("sum_abs", self.sum_abs),
        ] {
            if !v.is_finite() || (name != "sum" && v < 0.0) {
                return Err(format!(
                    "'{name}' must be a finite{} number",
                    if name == "sum" { "" } else { " non-negative" }
                ));
            }
        }
        if self.k == 0 || self.k > MAX_K {
            return Err(format!("'k' must be 1 to {MAX_K} (got {})", self.k));
        }
        let want = (self.k as u64).min(finite) as usize;
        for (name, v, descending) in [("top", &self.top, true), ("bottom", &self.bottom, false)] {
            if v.len() != want {
                return Err(format!(
                    "'{name}' holds {} values where min(k, finite elements) = {want}",
                    v.len()
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(format!("'{name}' must hold finite values"));
            }
            let sorted = v.windows(2).all(|w| {
                if descending {
                    w[0] >= w[1]
                } else {
                    w[0] <= w[1]
                }
            });
            if !sorted {
                return Err(format!(
                    "'{name}' must be sorted {}",
                    if descending {
                        "descending"
                    } else {
                        "ascending"
                    }
                ));
            }
        }
        Ok(())
    }
}

/// The summary files of a directory: `summaries.rank{r}.jsonl`, one per rank.
fn rank_files(td: &TrustedDir) -> Result<Vec<(usize, String)>> {
    let dir = td.path();
    let rd = std::fs::read_dir(dir).map_err(|e| Error::File {
        path: dir.display().to_string(),
        reason: "cannot list the directory".into(),
        io: Some(crate::error::IoError(std::sync::Arc::new(e))),
    })?;
    let mut files = vec![];
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(r) = name
            .strip_prefix("summaries.rank")
            .and_then(|s| s.strip_suffix(".jsonl"))
        {
            match r.parse::<usize>() {
                Ok(rank) if r == rank.to_string() => files.push((rank, name)),
                _ => {
                    return Err(ferr(
                        dir,
                        format!(
                            "'{}' is not named summaries.rank<N>.jsonl",
                            printable(&name)
                        ),
                    ))
                }
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Whether `dir` holds a summary trace (any `summaries.rank*.jsonl`).
pub fn is_summary_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("summaries.rank") && n.ends_with(".jsonl")
        })
    })
}

/// One rank's file, read a line at a time.
struct RankReader {
    rank: usize,
    path: PathBuf,
    lines: BufReader<File>,
    line: usize,
    last_step: Option<u64>,
}

impl RankReader {
    /// The next complete line's step, `None` at the end; a last line without its newline is
    /// reported in `notes` and ends the file.
    fn next(&mut self, notes: &mut Vec<String>) -> Result<Option<SummaryStep>> {
        let mut buf = vec![];
        let n = (&mut self.lines)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::File {
                path: self.path.display().to_string(),
                reason: "cannot read".into(),
                io: Some(crate::error::IoError(std::sync::Arc::new(e))),
            })?;
        if n == 0 {
            return Ok(None);
        }
        self.line += 1;
        if buf.last() != Some(&b'\n') {
            if buf.len() > MAX_LINE_BYTES {
                return Err(ferr(
                    &self.path,
                    format!("line {} is longer than {MAX_LINE_BYTES} bytes", self.line),
                ));
            }
            notes.push(format!(
                "{}: the last line ({}) is incomplete (its writer stopped mid-step); left out",
                self.path.display(),
                self.line
            ));
            return Ok(None);
        }
        let s = SummaryStep::parse(&buf, &self.path, self.line)?;
        if s.rank != self.rank {
            return Err(ferr(
                &self.path,
                format!(
                    "line {}: rank {} in the file of rank {}",
                    self.line, s.rank, self.rank
                ),
            ));
        }
        if self.last_step.is_some_and(|p| s.step <= p) {
            return Err(ferr(
                &self.path,
                format!(
                    "line {}: step {} after step {} (steps must increase)",
                    self.line,
                    s.step,
                    self.last_step.unwrap_or(0)
                ),
            ));
        }
        self.last_step = Some(s.step);
        Ok(Some(s))
    }
}

/// A summary trace, read one step (every rank's line) at a time.
pub struct SummaryRun {
    path: PathBuf,
    mesh: Option<Mesh>,
    ranks: Vec<RankReader>,
    /// What was left out and why (incomplete last lines, steps some ranks lack).
    pub notes: Vec<String>,
}

impl SummaryRun {
    /// Open the summary trace in `dir`.
    pub fn open(dir: &Path) -> Result<SummaryRun> {
        let td = TrustedDir::new(dir)?;
        let files = rank_files(&td)?;
        if files.is_empty() {
            return Err(ferr(
                dir,
                "no summaries.rank<N>.jsonl files: not a summary trace",
            ));
        }
        let mut ranks = vec![];
        for (i, (rank, name)) in files.into_iter().enumerate() {
            if rank != i {
                return Err(ferr(
                    dir,
                    format!("the summary file of rank {i} is missing (found rank {rank}'s)"),
                ));
            }
            let (path, _, file) = td.open(&name)?;
            ranks.push(RankReader {
                rank,
                path,
                lines: BufReader::new(file),
                line: 0,
                last_step: None,
            });
        }
        Ok(SummaryRun {
            path: dir.to_path_buf(),
            mesh: None,
            ranks,
            notes: vec![],
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next step every rank wrote: its lines in rank order; `None` after the last. Ranks
    /// that disagree on the mesh are an error; a step that only some ranks reached (the end of
    /// a run that stopped) ends the run, with a note.
    pub fn next_step(&mut self) -> Result<Option<Vec<SummaryStep>>> {
        let mut lines = Vec::with_capacity(self.ranks.len());
        for r in &mut self.ranks {
            match r.next(&mut self.notes)? {
                Some(s) => lines.push(s),
                None => break,
            }
        }
        if lines.len() < self.ranks.len() {
            if let Some(s) = lines.first() {
                self.notes.push(format!(
                    "step {}: written by {} of {} ranks (a run that stopped); left out",
                    s.step,
                    lines.len(),
                    self.ranks.len()
                ));
            }
            return Ok(None);
        }
        let first = &lines[0];
        let mesh = self.mesh.get_or_insert_with(|| first.mesh.clone()).clone();
        if mesh.world() != self.ranks.len() {
            return Err(ferr(
                &self.path,
                format!(
                    "a mesh of {} ranks ({}) but {} summary files",
                    mesh.world(),
                    mesh.label(),
                    self.ranks.len()
                ),
            ));
        }
        for s in &lines {
            if s.mesh != mesh || s.step != first.step {
                return Err(ferr(
                    &self.path,
                    format!(
                        "rank {} wrote step {} on mesh {} where rank 0 wrote step {} on mesh {}",
                        s.rank,
                        s.step,
                        s.mesh.label(),
                        first.step,
                        mesh.label()
                    ),
                ));
            }
        }
        Ok(Some(lines))
    }
}

/// The last complete line of a summary file opened for reading and writing: the file is cut
/// after it when a torn line (a writer stopped mid-write) follows it. Returns that line's
/// step, `None` for an empty file.
fn settle_tail(f: &mut File, path: &Path) -> Result<Option<u64>> {
    use std::io::{Seek, SeekFrom};
    let io = |e: std::io::Error| Error::File {
        path: path.display().to_string(),
        reason: "cannot read the end of the file".into(),
        io: Some(crate::error::IoError(std::sync::Arc::new(e))),
    };
    let len = f.metadata().map_err(io)?.len();
    // Newline positions from the end, found a block at a time: the last one, and the one
    // before it (the start of the last complete line).
    let mut newlines: Vec<u64> = vec![];
    let mut end = len;
    const BLOCK: u64 = 1 << 16;
    while end > 0 && newlines.len() < 2 {
        let start = end.saturating_sub(BLOCK);
        let mut buf = vec![0u8; (end - start) as usize];
        f.seek(SeekFrom::Start(start)).map_err(io)?;
        f.read_exact(&mut buf).map_err(io)?;
        for (i, &b) in buf.iter().enumerate().rev() {
            if b == b'\n' {
                newlines.push(start + i as u64);
                if newlines.len() == 2 {
                    break;
                }
            }
        }
        if len - start > MAX_LINE_BYTES as u64 * 2 + 2 {
            break;
        }
        end = start;
    }
    let Some(&last) = newlines.first() else {
        if len > 0 {
            f.set_len(0).map_err(io)?; // one torn line and nothing before it
        }
        return Ok(None);
    };
    if last + 1 < len {
        f.set_len(last + 1).map_err(io)?;
    }
    let begin = newlines.get(1).map_or(0, |&p| p + 1);
    let mut line = vec![0u8; (last + 1 - begin) as usize];
    f.seek(SeekFrom::Start(begin)).map_err(io)?;
    f.read_exact(&mut line).map_err(io)?;
    let s = SummaryStep::parse(&line, path, 0)
        .map_err(|e| ferr(path, format!("its last line cannot be appended to: {e}")))?;
    Ok(Some(s.step))
}

/// Append `step` as one line to `summaries.rank{rank}.jsonl` in `dir` (created if needed),
/// validated as a reader validates it, in one write call; `fsync` flushes it to disk. The
/// tracer's only way to write summaries (one writer of the format).
///
/// Never leaves a torn line: a failed write (a full disk) is cut back off, and a torn last
/// line an earlier writer left is cut off before appending. A step not after the file's last
/// step (a run restarted into the same directory) is refused
/// ([`Error::InvalidParameter`]), as a reader would refuse it.
pub fn append_summary(dir: &Path, step: &SummaryStep, fsync: bool) -> Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut line = step.render()?;
    line.push('\n');
    std::fs::create_dir_all(dir).map_err(|e| Error::File {
        path: dir.display().to_string(),
        reason: "cannot create the directory".into(),
        io: Some(crate::error::IoError(std::sync::Arc::new(e))),
    })?;
    let path = dir.join(format!("summaries.rank{}.jsonl", step.rank));
    let fail = |e: std::io::Error| Error::File {
        path: path.display().to_string(),
        reason: "cannot append".into(),
        io: Some(crate::error::IoError(std::sync::Arc::new(e))),
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(fail)?;
    if !f.metadata().map_err(fail)?.is_file() {
        return Err(ferr(&path, "not a regular file"));
    }
    if let Some(last) = settle_tail(&mut f, &path)? {
        if step.step <= last {
            return Err(Error::InvalidParameter {
                name: "step",
                reason: format!(
                    "step {} cannot follow step {last} in {} (steps must increase: a run \
                     restarted into the same directory?)",
                    step.step,
                    path.display()
                ),
            });
        }
    }
    let len = f.seek(SeekFrom::End(0)).map_err(fail)?;
    let written = f
        .write_all(line.as_bytes())
        .and_then(|_| if fsync { f.sync_data() } else { Ok(()) });
    if let Err(e) = written {
        let _ = f.set_len(len); // no torn line left behind
        return Err(fail(e));
    }
    Ok(())
}
