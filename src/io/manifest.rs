//! The trace manifest (`manifest.json`, schema version 1) and trace directories.
//!
//! A trace directory holds one safetensors file per rank (or `.npy` files) and a manifest:
//!
//! ```json
//! {"format": "ttrace-trace", "version": 1, "recipe": "bf16",
//!  "mesh": {"tp": 2, "cp": 1, "dp": 1, "sp": false},
//!  "tensors": [
//!    {"id": "layers.0.mlp.fc1|fwd.output.0", "rank": 0, "file": "rank0.safetensors",
//!     "key": "layers.0.mlp.fc1|fwd.output.0", "dtype": "bf16",
//!     "layout": {"dp": {"kind": "split", "dim": 0, "groups": 1},
//!                "cp": {"kind": "cp_chunks", "dim": 1},
//!                "tp": {"kind": "split", "dim": 2, "groups": 1}},
//!     "module": {"kind": "linear"}}]}
//! ```
//!
//! Required per tensor: `id`, `rank`, `file`, `dtype`, `layout`; `key` defaults to the id (for
//! `.npy` files it is ignored); `module` is optional (what produced the tensor, for pricing).
//! Unknown fields are ignored; a missing required field is an error naming the tensor and the
//! field. Every id must be present once on every rank of the mesh.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::engine::model::ModuleKind;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::io::guard::{limits, printable, TrustedDir};
use crate::io::stored::Stored;
use crate::io::{npy, safetensors};
use crate::shard::layout::{Axis, Layout, Mesh, Placement};
use crate::shard::merge::{keep, merge_fetched, sum_group, take_spare, Joinable};
use crate::tensor::Tensor;

/// The schema version this library writes and reads.
pub const VERSION: u64 = 1;

/// What produced a tensor, for pricing its threshold (see `papers/trace-format.md` and
/// [`price_local`](crate::check::price_local)). Every field is optional: without `kind` the
/// tensor is priced by the generic local model (with its gain allowance); the formats default
/// to the recipe's policy when the manifest names a ttrace recipe, else to "no quantization,
/// FP32 accumulation (FP64 for FP64 tensors), cross-rank combination in the tensor's own
/// dtype".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModuleInfo {
    /// Module kind, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ModuleKind>,
    /// Format the module's inputs are quantized to before its reductions (e.g. `e4m3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<Format>,
    /// Format its reductions accumulate in (e.g. `f32`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulate: Option<Format>,
    /// Format in which partial results of a reduction split across ranks are combined (the
    /// all-reduce dtype, e.g. `bf16` for Megatron's row-parallel output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<Format>,
    /// The arithmetic in force when the module ran, as the tracer found it
    /// (`papers/trace-format.md`): the autocast dtype, the precision of FP32 matmuls and
    /// convolutions, the device.
    #[serde(default, flatten)]
    pub arith: ModuleArith,
    /// The axes along which the module handed its caller a partial sum as a plain tensor (a
    /// DTensor `Partial()` made local with no reduction): merged as the sum it is, so the
    /// output itself passes — but the caller's plain code uses one rank's addend. When a tensor
    /// it feeds is the first to fail, the check names this module: a missing reduction.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreduced: Vec<crate::shard::Axis>,
}

/// The arithmetic settings in force for one module call (PyTorch's `torch.autocast`,
/// `torch.backends.cuda.matmul.allow_tf32` / `fp32_precision`, cuDNN's `allow_tf32`, oneDNN's
/// `fp32_precision`). Absent fields: full precision, no autocast.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleArith {
    /// The autocast dtype (`f16`, `bf16`): the module's matmuls and convolutions took their
    /// inputs in it and rounded their results to it, whatever dtype stores them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autocast: Option<Format>,
    /// The format FP32 matmul inputs are rounded to on the module's device: `tf32` (TF32 tensor
    /// cores), `bf16` (oneDNN's reduced precision); `f32` or absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_matmul: Option<Format>,
    /// The same for convolutions (cuDNN's `allow_tf32`, on by default in PyTorch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_conv: Option<Format>,
    /// The device type the module ran on (`cuda`, `cpu`, …); informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

impl ModuleArith {
    /// Refuse settings ttrace has no model for ([`Error::UnpricedArithmetic`] naming `id`):
    /// an autocast dtype other than F16, BF16 (or F32, no change); an FP32 matmul or
    /// convolution precision other than F32, TF32, BF16.
    pub fn check(&self, id: &str) -> Result<()> {
        let bad = |name: &str, f: Format| Error::UnpricedArithmetic {
            id: id.to_string(),
            setting: format!("{name}={f}"),
        };
        if let Some(f) = self.autocast {
            if !matches!(f, Format::F16 | Format::BF16 | Format::F32) {
                return Err(bad("autocast", f));
            }
        }
        for (name, v) in [
            ("fp32_matmul", self.fp32_matmul),
            ("fp32_conv", self.fp32_conv),
        ] {
            if let Some(f) = v {
                if !matches!(f, Format::F32 | Format::TF32 | Format::BF16) {
                    return Err(bad(name, f));
                }
            }
        }
        Ok(())
    }
}

impl ModuleInfo {
    /// Only the kind; formats from the recipe or the defaults.
    pub fn of(kind: ModuleKind) -> ModuleInfo {
        ModuleInfo {
            kind: Some(kind),
            quantize: None,
            accumulate: None,
            combine: None,
            arith: ModuleArith::default(),
            unreduced: vec![],
        }
    }
}

/// One stored shard.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ManifestEntry {
    /// Canonical id.
    pub id: String,
    /// Global rank.
    pub rank: usize,
    /// File, relative to the trace directory.
    pub file: String,
    /// Name inside a safetensors file.
    pub key: String,
    /// Stored dtype (`f64`, `f32`, `f16`, `bf16`, `e4m3`, `e5m2`).
    pub dtype: Format,
    /// How the ranks' shards merge.
    pub layout: Layout,
    /// What produced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module: Option<ModuleInfo>,
    /// A threshold on ‖cand − ref‖_F of the logical tensor priced by the producer (ttrace's
    /// composed threshold when `ttrace simulate --dump` writes a reference), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
    /// The axes along which the writer did not know the placement and `layout` holds its
    /// guess (a plain tensor of code it cannot see into; the batch dimension under data
    /// parallelism): the checker infers them from the shards' and the reference's shapes (see
    /// [`TraceDir::infer_guessed`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub guessed: Vec<Axis>,
}

/// How each data-parallel rank normalized its loss, where the writer did not know (see
/// `papers/trace-format.md`, "Loss normalization under data parallelism").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpLoss {
    /// Not known to the writer: the gradients of activations split along dp, and the scalars
    /// summed over dp (a loss), are stored as each rank computed them. Each rank's loss either
    /// averaged its own share of the batch — they are then dp times the reference's — or was
    /// normalized by the global count; the checker settles which from the reference.
    Auto,
}

/// A manifest.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Manifest {
    /// Always `ttrace-trace`.
    pub format: String,
    /// Schema version.
    pub version: u64,
    /// The recipe name, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recipe: Option<String>,
    /// How the candidate's data-parallel ranks normalized their loss, where the writer did not
    /// know.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_loss: Option<DpLoss>,
    /// The mesh.
    pub mesh: Mesh,
    /// The run's settings as the Python tracer records them (informational: the PyTorch
    /// version, the FP32 matmul precision, the GPU), kept as written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<serde_json::Value>,
    /// Every shard.
    pub tensors: Vec<ManifestEntry>,
}

fn ferr(path: &Path, reason: impl Into<String>) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.into(),
        io: None,
    }
}

/// A manifest entry as the typed fast path reads it (serde refuses a field named twice; a
/// field it does not know sends the manifest to the strict field-by-field pass, which checks
/// what such a field holds too).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    id: String,
    rank: u64,
    file: String,
    #[serde(default)]
    key: Option<String>,
    dtype: String,
    layout: Layout,
    /// Parsed strictly, then as a [`ModuleInfo`] (which passes over fields it does not know).
    #[serde(default)]
    module: Option<crate::io::guard::Strict>,
    #[serde(default)]
    threshold: Option<f64>,
    #[serde(default)]
    guessed: Vec<Axis>,
}

/// The manifest as the typed fast path reads it (see [`RawEntry`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    /// `"ttrace-trace"` (checked before parsing).
    #[serde(default, rename = "format")]
    _format: Option<String>,
    /// The run's settings as the Python tracer writes them (informational).
    #[serde(default)]
    run: Option<crate::io::guard::Strict>,
    version: u64,
    #[serde(default)]
    recipe: Option<String>,
    #[serde(default)]
    dp_loss: Option<DpLoss>,
    mesh: Mesh,
    tensors: Vec<RawEntry>,
}

/// The checks of one entry, shared by both parsers.
#[allow(clippy::too_many_arguments)]
fn entry(
    i: usize,
    id: String,
    rank: u64,
    file: String,
    key: Option<String>,
    dtype: &str,
    layout: Layout,
    module: Option<ModuleInfo>,
    threshold: Option<f64>,
    guessed: Vec<Axis>,
    mesh: &Mesh,
    path: &Path,
) -> Result<ManifestEntry> {
    let who = format!("tensor #{i} ('{}')", printable(&id));
    let rank = usize::try_from(rank)
        .ok()
        .filter(|&r| r < mesh.world())
        .ok_or_else(|| {
            ferr(
                path,
                format!(
                    "{who}: rank {rank} is outside the mesh ({} ranks)",
                    mesh.world()
                ),
            )
        })?;
    if file.contains("..") || Path::new(&file).is_absolute() {
        return Err(ferr(
            path,
            format!(
                "{who}: file '{}' must stay inside the trace directory",
                printable(&file)
            ),
        ));
    }
    let dtype = dtype
        .parse::<Format>()
        .map_err(|e| ferr(path, format!("{who}: 'dtype': {e}")))?;
    if let Some(m) = &module {
        m.arith.check(&printable(&id))?;
    }
    if threshold.is_some_and(|t| t.is_nan() || t < 0.0) {
        return Err(ferr(
            path,
            format!("{who}: 'threshold' must be a non-negative number"),
        ));
    }
    // Every axis's placement is checked, an axis of size 1 too (it cuts nothing, but a
    // placement no mesh could use is a broken writer, refused the same at any size).
    if let Some((axis, what)) = crate::shard::layout::layout_problem(&layout) {
        return Err(ferr(
            path,
            format!("{who}: layout along {}: {what}", axis.name()),
        ));
    }
    Ok(ManifestEntry {
        key: key.unwrap_or_else(|| id.clone()),
        id,
        rank,
        file,
        dtype,
        layout,
        module,
        threshold,
        guessed,
    })
}

impl Manifest {
    /// Parse and validate a manifest's text (`path` names it in errors). Strict: a field named
    /// twice in one object is an error at any depth — inside a field ttrace does not know too
    /// (which of the two would be meant?) — and so is a field of the wrong JSON type. Typed
    /// parsing first (memory about the size of the entries); when it fails, a second,
    /// field-by-field pass over the strictly parsed JSON reads a manifest with fields this
    /// version does not know, or finds the message that names the tensor and the field.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        let fast = Self::parse_typed(text, path);
        match fast {
            Ok(m) => Ok(m),
            // The strict pass reads what the typed one cannot: fields it does not know (each
            // parsed strictly); else its message names the tensor and the field.
            Err(e) => match Self::parse_detailed(text, path) {
                Err(detailed) => Err(detailed),
                Ok(m) if e.to_string().contains("unknown field") => Ok(m),
                Ok(_) => Err(e),
            },
        }
    }

    fn check_version(version: u64, path: &Path) -> Result<()> {
        if version != VERSION {
            return Err(ferr(
                path,
                format!("schema version {version} is not supported (this ttrace reads {VERSION})"),
            ));
        }
        Ok(())
    }

    fn parse_typed(text: &str, path: &Path) -> Result<Manifest> {
        let raw: RawManifest = serde_json::from_str(text)
            .map_err(|e| ferr(path, format!("not a valid manifest: {e}")))?;
        Self::check_version(raw.version, path)?;
        let mesh = raw.mesh;
        Mesh::new(mesh.tp, mesh.cp, mesh.dp, mesh.sp).map_err(|e| ferr(path, e.to_string()))?;
        let tensors = raw
            .tensors
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let module = match t.module.map(|m| m.0) {
                    None | Some(serde_json::Value::Null) => None,
                    Some(m) => Some(serde_json::from_value(m).map_err(|e| {
                        ferr(
                            path,
                            format!("not a valid manifest: tensor #{i}: 'module': {e}"),
                        )
                    })?),
                };
                entry(
                    i,
                    t.id,
                    t.rank,
                    t.file,
                    t.key,
                    &t.dtype,
                    t.layout,
                    module,
                    t.threshold,
                    t.guessed,
                    &mesh,
                    path,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Manifest {
            format: "ttrace-trace".into(),
            version: raw.version,
            recipe: raw.recipe,
            dp_loss: raw.dp_loss,
            mesh,
            run: raw.run.map(|r| r.0).filter(|r| !r.is_null()),
            tensors,
        })
    }

    /// Field by field on a strictly parsed JSON value, for messages that name the tensor and
    /// the field.
    fn parse_detailed(text: &str, path: &Path) -> Result<Manifest> {
        let v = crate::io::guard::parse_json_strict(text.as_bytes())
            .map_err(|e| ferr(path, format!("not valid JSON: {e}")))?;
        let version = v
            .get("version")
            .and_then(|x| x.as_u64())
            .ok_or_else(|| ferr(path, "missing required field 'version'"))?;
        Self::check_version(version, path)?;
        let mesh: Mesh = serde_json::from_value(
            v.get("mesh")
                .cloned()
                .ok_or_else(|| ferr(path, "missing required field 'mesh'"))?,
        )
        .map_err(|e| ferr(path, format!("field 'mesh': {e}")))?;
        Mesh::new(mesh.tp, mesh.cp, mesh.dp, mesh.sp).map_err(|e| ferr(path, e.to_string()))?;
        let list = v
            .get("tensors")
            .and_then(|x| x.as_array())
            .ok_or_else(|| ferr(path, "missing required field 'tensors' (a list)"))?;
        let mut tensors = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let id = t.get("id").and_then(|x| x.as_str()).map(str::to_string);
            let who = match &id {
                Some(id) => format!("tensor #{i} ('{}')", printable(id)),
                None => format!("tensor #{i}"),
            };
            let need = |field: &str| {
                t.get(field)
                    .ok_or_else(|| ferr(path, format!("{who}: missing required field '{field}'")))
            };
            let id = id.ok_or_else(|| ferr(path, format!("{who}: missing required field 'id'")))?;
            let rank = need("rank")?.as_u64().ok_or_else(|| {
                ferr(
                    path,
                    format!("{who}: 'rank' must be a non-negative integer"),
                )
            })?;
            let file = need("file")?
                .as_str()
                .ok_or_else(|| ferr(path, format!("{who}: 'file' must be a string")))?
                .to_string();
            let dtype = need("dtype")?
                .as_str()
                .ok_or_else(|| ferr(path, format!("{who}: 'dtype' must be a string")))?;
            let layout: Layout = serde_json::from_value(need("layout")?.clone())
                .map_err(|e| ferr(path, format!("{who}: 'layout': {e}")))?;
            let key = match t.get("key") {
                None | Some(serde_json::Value::Null) => None,
                Some(k) => Some(
                    k.as_str()
                        .ok_or_else(|| ferr(path, format!("{who}: 'key' must be a string")))?
                        .to_string(),
                ),
            };
            let module = match t.get("module") {
                None | Some(serde_json::Value::Null) => None,
                Some(m) => Some(
                    serde_json::from_value(m.clone())
                        .map_err(|e| ferr(path, format!("{who}: 'module': {e}")))?,
                ),
            };
            let threshold = match t.get("threshold") {
                None | Some(serde_json::Value::Null) => None,
                Some(x) => Some(x.as_f64().ok_or_else(|| {
                    ferr(
                        path,
                        format!("{who}: 'threshold' must be a non-negative number"),
                    )
                })?),
            };
            let guessed = match t.get("guessed") {
                None | Some(serde_json::Value::Null) => vec![],
                Some(x) => serde_json::from_value(x.clone())
                    .map_err(|e| ferr(path, format!("{who}: 'guessed' (a list of axes): {e}")))?,
            };
            tensors.push(entry(
                i, id, rank, file, key, dtype, layout, module, threshold, guessed, &mesh, path,
            )?);
        }
        let recipe = match v.get("recipe") {
            None | Some(serde_json::Value::Null) => None,
            Some(r) => Some(
                r.as_str()
                    .ok_or_else(|| ferr(path, "'recipe' must be a string"))?
                    .to_string(),
            ),
        };
        let dp_loss = match v.get("dp_loss") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => Some(
                serde_json::from_value(x.clone())
                    .map_err(|e| ferr(path, format!("'dp_loss' (\"auto\"): {e}")))?,
            ),
        };
        Ok(Manifest {
            format: "ttrace-trace".into(),
            version,
            recipe,
            dp_loss,
            mesh,
            run: v.get("run").filter(|r| !r.is_null()).cloned(),
            tensors,
        })
    }
}

/// Read a trace directory's manifest: `manifest.json`, or else every `manifest.rank*.json`
/// fragment (one per rank, as each process of a distributed run writes its own), which must
/// agree on version, mesh and recipe; their tensors are concatenated in rank order. Returns the
/// manifest and the path errors should name.
pub fn read_manifest(dir: &Path) -> Result<(Manifest, PathBuf)> {
    read_manifest_in(&TrustedDir::new(dir)?)
}

/// Read the manifest text `name` of `td` (bounded, strict UTF-8) and parse it.
fn read_one(td: &TrustedDir, name: &str) -> Result<(Manifest, PathBuf)> {
    let (path, bytes) = td.read(name, limits::MANIFEST_BYTES, "manifest")?;
    let text = std::str::from_utf8(&bytes).map_err(|e| ferr(&path, format!("not UTF-8: {e}")))?;
    Ok((Manifest::parse(text, &path)?, path))
}

fn read_manifest_in(td: &TrustedDir) -> Result<(Manifest, PathBuf)> {
    let dir = td.path();
    let mpath = dir.join("manifest.json");
    if std::fs::symlink_metadata(&mpath).is_ok() {
        return read_one(td, "manifest.json");
    }
    read_fragments(td)
}

/// Every `manifest.rank*.json` fragment of `td`, merged in rank order.
fn read_fragments(td: &TrustedDir) -> Result<(Manifest, PathBuf)> {
    let dir = td.path();
    let mpath = dir.join("manifest.json");
    let mut parts: Vec<(usize, String)> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, "cannot list", e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let r = name.strip_prefix("manifest.rank")?.strip_suffix(".json")?;
            Some((r.parse::<usize>().ok()?, name))
        })
        .collect();
    if parts.is_empty() {
        return Err(ferr(
            &mpath,
            "cannot read: no manifest.json and no manifest.rank*.json fragments",
        ));
    }
    parts.sort();
    let mut merged: Option<Manifest> = None;
    for (_, name) in &parts {
        let (m, p) = read_one(td, name)?;
        let p = &p;
        match &mut merged {
            None => merged = Some(m),
            Some(all) => {
                if all.mesh != m.mesh || all.recipe != m.recipe || all.dp_loss != m.dp_loss {
                    return Err(ferr(
                        p,
                        "fragment disagrees with the first fragment on the mesh, the recipe or \
                         the loss normalization",
                    ));
                }
                all.tensors.extend(m.tensors);
            }
        }
    }
    let merged = merged.ok_or_else(|| ferr(&mpath, "no fragments"))?;
    Ok((merged, dir.join("manifest.rank*.json")))
}

/// A layout inferred from shapes (see [`TraceDir::infer_guessed`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InferredLayout {
    /// The tensor's id.
    pub tensor: String,
    /// The layout its shapes imply (the closest to the reference's values among them).
    pub layout: Layout,
    /// How many layouts fitted the shapes (more than 1: the values chose).
    pub fitting: usize,
}

/// Σ (a − b)² over two tensors' values, equal values (masked −∞ scores too) counting 0 and
/// any other non-finite difference making it ∞: how far a candidate merge is from the
/// reference when the shapes allow several layouts.
fn squared_distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let d = if a == b { 0.0 } else { (a - b) * (a - b) };
            if d.is_nan() {
                f64::INFINITY
            } else {
                d
            }
        })
        .sum()
}

/// Where some ranks knew an id's layout and others only guessed it (a tracer recognizes a
/// tensor by its memory on one rank, not on another), the ranks that knew settle it: when they
/// agree, every entry takes their layout and nothing stays guessed. Otherwise nothing changes
/// (ranks that disagree are reported by the caller).
fn settle_guesses(tensors: &mut [ManifestEntry], ks: &[usize]) {
    let known: Vec<Layout> = ks
        .iter()
        .filter(|&&k| tensors[k].guessed.is_empty())
        .map(|&k| tensors[k].layout)
        .collect();
    let Some(&l) = known.first() else { return };
    if known.len() == ks.len() || known.iter().any(|k| *k != l) {
        return;
    }
    for &k in ks {
        tensors[k].layout = l;
        tensors[k].guessed.clear();
    }
}

/// An open trace directory: the manifest, validated against the files' headers.
#[derive(Debug)]
pub struct TraceDir {
    dir: TrustedDir,
    manifest: std::sync::Arc<Manifest>,
    /// Per id: the entries of every rank (index = rank).
    by_id: std::sync::Arc<BTreeMap<String, Vec<usize>>>,
    order: std::sync::Arc<Vec<String>>,
    files: HashMap<String, safetensors::SafetensorsFile>,
    /// Read buffers handed back by [`TraceDir::recycle`], reused by the next reads.
    spare: Vec<Vec<u8>>,
    /// Parameter gradients some ranks do not hold (the parameter received no gradient there:
    /// unused on that rank), with the ranks that lack them: not merged, judged as missing.
    incomplete: std::sync::Arc<BTreeMap<String, Vec<usize>>>,
    /// Set by the checker when the candidate's ranks each averaged their loss over their own
    /// share of the batch ([`DpLoss::Auto`] settled): the loss-dependent tensors are read
    /// divided by this (dp·cp, dp or cp, whichever fit the reference).
    dp_divisor: Option<usize>,
}

impl TraceDir {
    /// Open `dir`: read `manifest.json` (or, when it is absent, the per-rank fragments
    /// `manifest.rank{r}.json` that distributed dumpers write, see [`read_manifest`]), open
    /// every file's header, and check that each entry's
    /// tensor exists with the declared dtype, that every id is present once per rank, and
    /// that all ranks agree on its layout.
    pub fn open(dir: &Path) -> Result<TraceDir> {
        let td = TrustedDir::new(dir)?;
        let (mut manifest, mpath) = read_manifest_in(&td)?;
        let mut files = HashMap::new();
        // Per id, (rank, entry) pairs: memory linear in the entries, whatever the mesh says.
        let mut by_id: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
        let mut order = vec![];
        let world = manifest.mesh.world();
        for (k, e) in manifest.tensors.iter().enumerate() {
            let path = dir.join(&e.file);
            if e.file.ends_with(".safetensors") {
                if !files.contains_key(&e.file) {
                    let (shown, real, file) = td.open(&e.file)?;
                    let mut f = safetensors::SafetensorsFile::from_file(&shown, file)?;
                    // No handle kept between reads: a trace of many ranks stays far below
                    // the open-file limit.
                    f.release(&real)?;
                    files.insert(e.file.clone(), f);
                }
                let f = &files[&e.file];
                let entry = f.entries().get(&e.key).ok_or_else(|| {
                    ferr(
                        &path,
                        format!(
                            "the manifest names tensor '{}' (id '{}'), which is absent",
                            e.key, e.id
                        ),
                    )
                })?;
                if entry.format != e.dtype {
                    return Err(ferr(
                        &path,
                        format!(
                            "tensor '{}' is stored as {} but the manifest says {}",
                            e.key, entry.format, e.dtype
                        ),
                    ));
                }
            } else {
                // Resolved now (inside the directory, or refused); read when compared.
                td.resolve(&e.file).map_err(|er| match er {
                    Error::File { reason, .. } => ferr(
                        &path,
                        format!(
                            "file of tensor {} (rank {}): {reason}",
                            printable(&e.id),
                            e.rank
                        ),
                    ),
                    other => other,
                })?;
            }
            let slots = by_id.entry(e.id.clone()).or_insert_with(|| {
                order.push(e.id.clone());
                Vec::new()
            });
            if slots.len() >= world {
                return Err(ferr(
                    &mpath,
                    format!(
                        "tensor {} has more entries than the mesh has ranks ({world})",
                        printable(&e.id)
                    ),
                ));
            }
            slots.push((e.rank, k));
        }
        let mut complete = BTreeMap::new();
        let mut incomplete = BTreeMap::new();
        for id in &order {
            let Some(mut slots) = by_id.remove(id) else {
                continue;
            };
            slots.sort_unstable();
            if let Some(w) = slots.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(ferr(
                    &mpath,
                    format!(
                        "tensor {} is listed twice for rank {}",
                        printable(id),
                        w[0].0
                    ),
                ));
            }
            if slots.len() < world && id.ends_with("|param_grad") {
                let have: Vec<usize> = slots.iter().map(|(r, _)| *r).collect();
                let missing = (0..world).filter(|r| !have.contains(r)).collect();
                incomplete.insert(id.clone(), missing);
                continue;
            }
            if slots.len() < world {
                let r = slots
                    .iter()
                    .enumerate()
                    .find(|(i, (r, _))| i != r)
                    .map_or(slots.len(), |(i, _)| i);
                return Err(ferr(
                    &mpath,
                    format!("tensor {} has no shard for rank {r}", printable(id)),
                ));
            }
            let ks: Vec<usize> = slots.into_iter().map(|(_, k)| k).collect();
            settle_guesses(&mut manifest.tensors, &ks);
            let l0 = manifest.tensors[ks[0]].layout;
            if ks.iter().any(|&k| manifest.tensors[k].layout != l0) {
                return Err(ferr(
                    &mpath,
                    format!("tensor {}: ranks declare different layouts", printable(id)),
                ));
            }
            complete.insert(id.clone(), ks);
        }
        Ok(TraceDir {
            dir: td,
            manifest: std::sync::Arc::new(manifest),
            by_id: std::sync::Arc::new(complete),
            order: std::sync::Arc::new(order),
            files,
            spare: Vec::new(),
            incomplete: std::sync::Arc::new(incomplete),
            dp_divisor: None,
        })
    }

    /// A second reader of the same directory sharing everything validated on opening (the
    /// manifest, the headers): no copies, no files held open, its own read buffers — what a
    /// thread needs to read other tensors in parallel.
    pub fn share(&self) -> TraceDir {
        TraceDir {
            dir: self.dir.clone(),
            manifest: self.manifest.clone(),
            by_id: self.by_id.clone(),
            order: self.order.clone(),
            files: self
                .files
                .iter()
                .filter_map(|(k, f)| Some((k.clone(), f.share()?)))
                .collect(),
            spare: Vec::new(),
            incomplete: self.incomplete.clone(),
            dp_divisor: self.dp_divisor,
        }
    }

    /// The ranks lacking a parameter gradient other ranks hold (it received no gradient
    /// there), if `id` is such a gradient.
    pub fn missing_ranks(&self, id: &str) -> Option<&[usize]> {
        self.incomplete.get(id).map(Vec::as_slice)
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The directory, as given when it was opened.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the trace holds `id` (a map lookup).
    pub fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// Ids in manifest order.
    pub fn ids(&self) -> &[String] {
        &self.order
    }

    /// Every rank's shard of a tensor, and its layout.
    pub fn shards(&mut self, id: &str) -> Result<(Vec<Tensor>, Layout)> {
        let (stored, layout) = self.stored_shards(id)?;
        let tensors = stored.iter().map(Stored::decode).collect();
        stored.into_iter().for_each(|s| self.recycle(s));
        Ok((tensors, layout))
    }

    /// [`TraceDir::shards`] as stored (patterns not decoded).
    pub(crate) fn stored_shards(&mut self, id: &str) -> Result<(Vec<Stored>, Layout)> {
        let ks = self.entries_of(id)?;
        let out = ks
            .iter()
            .map(|&k| {
                let e = &self.manifest.tensors[k];
                read_entry(&mut self.files, &self.dir, e, &mut self.spare)
            })
            .collect::<Result<_>>()?;
        Ok((out, self.manifest.tensors[ks[0]].layout))
    }

    /// Hand a tensor read from this directory back when it is no longer needed: its buffer is
    /// kept (up to a few) and reused by the next reads, which saves the fresh pages a large
    /// allocation costs. The buffers are freed with the `TraceDir`.
    pub(crate) fn recycle(&mut self, t: Stored) {
        keep(&mut self.spare, t.into_bytes());
    }

    /// The producer's threshold for an id, if the manifest gives one.
    pub fn threshold(&self, id: &str) -> Option<f64> {
        self.by_id
            .get(id)
            .and_then(|ks| self.manifest.tensors[ks[0]].threshold)
    }

    /// The producing module kind of an id, if the manifest gives it.
    pub fn module_kind(&self, id: &str) -> Option<ModuleKind> {
        self.module(id).and_then(|m| m.kind)
    }

    /// What produced an id, if the manifest says.
    pub fn module(&self, id: &str) -> Option<&ModuleInfo> {
        self.by_id
            .get(id)
            .and_then(|ks| self.manifest.tensors[ks[0]].module.as_ref())
    }

    /// The stored dtype of an id (its first rank's shard).
    pub fn dtype(&self, id: &str) -> Option<Format> {
        self.by_id
            .get(id)
            .map(|ks| self.manifest.tensors[ks[0]].dtype)
    }

    /// The axes along which the writer only guessed an id's layout (see
    /// [`TraceDir::infer_guessed`]).
    pub fn guessed(&self, id: &str) -> &[Axis] {
        self.by_id
            .get(id)
            .map_or(&[], |ks| self.manifest.tensors[ks[0]].guessed.as_slice())
    }

    /// The layout of an id (all ranks agree, checked on opening).
    pub fn layout(&self, id: &str) -> Option<Layout> {
        self.by_id
            .get(id)
            .map(|ks| self.manifest.tensors[ks[0]].layout)
    }

    /// The local shape of one manifest entry, from its file's header (`None` for npy files,
    /// whose headers are read only with their data).
    fn entry_shape(&self, k: usize) -> Option<&[usize]> {
        let e = &self.manifest.tensors[k];
        let f = self.files.get(&e.file)?;
        f.entries().get(&e.key).map(|x| x.shape.as_slice())
    }

    /// The logical shape of an id: its first rank's shape, grown by its layout's splits.
    pub fn logical_shape(&self, id: &str) -> Option<Vec<usize>> {
        let ks = self.by_id.get(id)?;
        let e = &self.manifest.tensors[ks[0]];
        crate::shard::infer::logical_shape(&e.layout, self.entry_shape(ks[0])?, &self.manifest.mesh)
    }

    /// This trace with the layouts its writer guessed (the axes an entry lists as `guessed`)
    /// settled against `reference`'s logical shapes: among the layouts that give every rank
    /// its shape (see `fitting_layouts` in `shard/infer.rs`), the only one, or — when several
    /// fit — the one whose merged tensor is closest to the reference's (Frobenius norm; ties to
    /// the fewest changed axes). Returns it and the ids whose layout changed. A guess nothing fits (or shards of unequal shapes) is kept,
    /// so the merge that follows reports it.
    ///
    /// # Errors
    /// Reading a tensor to settle an ambiguous layout can fail as [`TraceDir::logical`] does.
    pub fn infer_guessed(&self, reference: &TraceDir) -> Result<(TraceDir, Vec<InferredLayout>)> {
        let mut changed = vec![];
        // Copied only when a layout changes: most traces guess nothing.
        let mut manifest: Option<Manifest> = None;
        let (mut mine, mut theirs) = (self.share(), reference.share());
        for id in self.order.iter() {
            let Some(ks) = self.by_id.get(id) else {
                continue;
            };
            let first = &self.manifest.tensors[ks[0]];
            if first.guessed.is_empty() {
                continue;
            }
            let Some(logical) = reference.logical_shape(id) else {
                continue;
            };
            let shapes: Option<Vec<&[usize]>> = ks.iter().map(|&k| self.entry_shape(k)).collect();
            let Some(shapes) = shapes else { continue };
            if shapes.windows(2).any(|w| w[0] != w[1]) {
                continue;
            }
            let fits = crate::shard::infer::fitting_layouts(
                first.layout,
                &first.guessed,
                &logical,
                shapes[0],
                &self.manifest.mesh,
            );
            let chosen = match fits.len() {
                0 => continue,
                1 => fits[0],
                _ => {
                    let want = theirs.logical(id)?;
                    let mut best: Option<(f64, Layout)> = None;
                    for &l in &fits {
                        // A layout whose replicas disagree is no explanation.
                        let got = match mine.logical_as(id, l) {
                            Ok(t) => t,
                            Err(Error::ReplicaMismatch { .. } | Error::Layout { .. }) => continue,
                            Err(e) => return Err(e),
                        };
                        let d = squared_distance(got.values(), want.values());
                        // Ties keep the earlier (fewer changes).
                        if best.is_none_or(|(bd, _)| d < bd) {
                            best = Some((d, l));
                        }
                    }
                    best.map_or(fits[0], |b| b.1)
                }
            };
            if chosen != first.layout {
                let m = manifest.get_or_insert_with(|| (*self.manifest).clone());
                for &k in ks {
                    m.tensors[k].layout = chosen;
                }
                changed.push(InferredLayout {
                    tensor: id.clone(),
                    layout: chosen,
                    fitting: fits.len(),
                });
            }
        }
        let mut out = self.share();
        if let Some(m) = manifest {
            out.manifest = std::sync::Arc::new(m);
        }
        Ok((out, changed))
    }

    /// The merged logical tensor of an id (see [`crate::shard::merge`]).
    pub fn logical(&mut self, id: &str) -> Result<Tensor> {
        let stored = self.logical_stored(id)?;
        let t = stored.decode();
        self.recycle(stored);
        Ok(t)
    }

    /// [`TraceDir::logical`] as stored: the shards merged pattern by pattern (a partial sum
    /// is decoded a block at a time and its rounded result stored again), so memory stays
    /// that of the stored format.
    pub(crate) fn logical_stored(&mut self, id: &str) -> Result<Stored> {
        let ks = self.entries_of(id)?;
        let layout = self.manifest.tensors[ks[0]].layout;
        self.logical_stored_as(id, layout)
    }

    /// [`TraceDir::logical`] merged as if the layout were `layout`.
    fn logical_as(&mut self, id: &str, layout: Layout) -> Result<Tensor> {
        let stored = self.logical_stored_as(id, layout)?;
        let t = stored.decode();
        self.recycle(stored);
        Ok(t)
    }

    /// Read the tensors that depend on how each data-parallel rank normalized its loss (see
    /// [`TraceDir::loss_dependent`]) divided by `divisor` (the data ranks a local mean
    /// averaged over), or as stored (`None`).
    pub(crate) fn set_dp_divisor(&mut self, divisor: Option<usize>) {
        self.dp_divisor = divisor;
    }

    /// Whether the tensor `id` merged as `layout` scales with each data-parallel rank's loss
    /// normalization: an activation's gradient held in parts along dp or cp (split, or summed
    /// — a parameter's is reduced by the engine, which knows), or a forward tensor summed over
    /// dp or cp (a scalar loss).
    pub(crate) fn loss_dependent(id: &str, layout: &Layout) -> bool {
        let Some(t) = crate::engine::TensorId::parse(id) else {
            return false;
        };
        let data = [layout.along(Axis::Dp), layout.along(Axis::Cp)];
        match t.pass() {
            crate::policy::Pass::Forward => data.contains(&Placement::Partial),
            crate::policy::Pass::Backward => {
                !matches!(t.role, crate::engine::TensorRole::ParamGrad { .. })
                    && data.iter().any(|&p| p != Placement::Replicate)
            }
        }
    }

    /// [`TraceDir::logical_stored`] merged as if the layout were `layout`.
    pub(crate) fn logical_stored_as(&mut self, id: &str, layout: Layout) -> Result<Stored> {
        let stored = self.merged_as(id, layout)?;
        match self.dp_divisor {
            Some(d) if d > 1 && TraceDir::loss_dependent(id, &layout) => {
                crate::io::stored::divided(&stored, d as f64)
            }
            _ => Ok(stored),
        }
    }

    fn merged_as(&mut self, id: &str, layout: Layout) -> Result<Stored> {
        let ks = self.entries_of(id)?;
        let manifest = self.manifest.clone();
        let (files, dir) = (&mut self.files, &self.dir);
        merge_fetched(
            &mut |ranks, spare| {
                let entries: Vec<&ManifestEntry> =
                    ranks.iter().map(|&r| &manifest.tensors[ks[r]]).collect();
                let streamed = entries.iter().all(|e| e.file.ends_with(".safetensors"));
                if let [e] = entries[..] {
                    read_entry(files, dir, e, spare).map(Cow::Owned)
                } else if streamed {
                    sum_streamed(files, dir, id, ranks, &entries, spare).map(Cow::Owned)
                } else {
                    // Addends in npy files: read whole, summed together.
                    let pieces = entries
                        .iter()
                        .map(|e| read_entry(files, dir, e, spare).map(Cow::Owned))
                        .collect::<Result<Vec<_>>>()?;
                    sum_group(pieces, ranks, id, spare)
                }
            },
            &layout,
            &manifest.mesh,
            id,
            None,
            &mut self.spare,
        )
    }

    /// The manifest entries of an id, by rank.
    fn entries_of(&self, id: &str) -> Result<Vec<usize>> {
        self.by_id
            .get(id)
            .cloned()
            .ok_or_else(|| Error::UnknownName {
                kind: "traced tensor",
                name: id.to_string(),
            })
    }
}

/// The sum of the tensors of `entries` (the addends of one partial sum, held by `ranks`),
/// taken a block at a time from the files: memory for the sum and one block per addend, not
/// for every addend.
fn sum_streamed(
    files: &mut HashMap<String, safetensors::SafetensorsFile>,
    dir: &TrustedDir,
    id: &str,
    ranks: &[usize],
    entries: &[&ManifestEntry],
    spare: &mut Vec<Vec<u8>>,
) -> Result<Stored> {
    let header = |files: &HashMap<String, safetensors::SafetensorsFile>, e: &ManifestEntry| {
        files
            .get(&e.file)
            .and_then(|f| f.entries().get(&e.key).cloned())
            .ok_or_else(|| ferr(dir.path(), "file not open"))
    };
    let first = header(files, entries[0])?;
    for (e, &r) in entries.iter().zip(ranks).skip(1) {
        let h = header(files, e)?;
        if (h.format, &h.shape) != (first.format, &first.shape) {
            return Err(Error::Layout {
                id: id.to_string(),
                reason: format!(
                    "shards differ: rank {} holds {} {:?}, rank {r} holds {} {:?}",
                    ranks[0], first.format, first.shape, h.format, h.shape
                ),
            });
        }
    }
    let w = safetensors::element_size(first.format);
    // The header's validation tied the byte range to the shape.
    let n = usize::try_from(first.range.1 - first.range.0).unwrap_or(0) / w;
    // Blocks of at most 4 MiB over all addends (at least one element).
    let block = ((4 << 20) / (entries.len() * w)).clamp(1, 1 << 16);
    let mut out = take_spare(spare, n * w);
    out.clear();
    let mut buffers: Vec<Vec<u8>> = vec![Vec::new(); entries.len()];
    let mut sum_buffer = Vec::new();
    for start in (0..n).step_by(block) {
        let end = (start + block).min(n);
        let mut pieces = Vec::with_capacity(entries.len());
        for (e, buf) in entries.iter().zip(&mut buffers) {
            let f = files
                .get_mut(&e.file)
                .ok_or_else(|| ferr(dir.path(), "file not open"))?;
            pieces.push(f.read_stored_range(&e.key, start, end, std::mem::take(buf))?);
        }
        let refs: Vec<&Stored> = pieces.iter().collect();
        let sum = Stored::exact_sum(&refs, std::mem::take(&mut sum_buffer))?;
        out.extend_from_slice(sum.bytes());
        sum_buffer = sum.into_bytes();
        for (p, buf) in pieces.into_iter().zip(&mut buffers) {
            *buf = p.into_bytes();
        }
    }
    Ok(Stored::from_parts_unchecked(
        &first.shape,
        first.format,
        out,
    ))
}

/// Read one manifest entry's tensor as stored, in a buffer from `spare`.
fn read_entry(
    files: &mut HashMap<String, safetensors::SafetensorsFile>,
    dir: &TrustedDir,
    e: &ManifestEntry,
    spare: &mut Vec<Vec<u8>>,
) -> Result<Stored> {
    if e.file.ends_with(".safetensors") {
        let f = files
            .get_mut(&e.file)
            .ok_or_else(|| ferr(dir.path(), "file not open"))?;
        let len = f
            .entries()
            .get(&e.key)
            .map_or(0, |x| usize::try_from(x.range.1 - x.range.0).unwrap_or(0));
        f.read_stored(&e.key, take_spare(spare, len))
    } else {
        let (shown, _, file) = dir.open(&e.file)?;
        npy::read_stored_from(&shown, file, Some(e.dtype))
    }
}

/// Write a trace directory: one safetensors file per rank (`rank{r}.safetensors`, keys =
/// canonical ids) and the manifest. `entries` gives every id's per-rank shards and layout;
/// `modules` the producing module kind by id where known, `thresholds` priced thresholds by id.
pub fn write_trace_dir(
    dir: &Path,
    mesh: &Mesh,
    recipe: Option<&str>,
    entries: &[(String, Layout, Vec<Tensor>)],
    modules: &HashMap<String, ModuleKind>,
    thresholds: &HashMap<String, f64>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
    let world = mesh.world();
    let mut tensors = vec![];
    for r in 0..world {
        let file = format!("rank{r}.safetensors");
        let mut list = vec![];
        for (id, layout, shards) in entries {
            let t = shards.get(r).ok_or_else(|| Error::Layout {
                id: id.clone(),
                reason: format!("{} shards for a mesh of {world} ranks", shards.len()),
            })?;
            list.push((id.as_str(), t));
            tensors.push(ManifestEntry {
                id: id.clone(),
                rank: r,
                file: file.clone(),
                key: id.clone(),
                dtype: t.format(),
                layout: *layout,
                module: modules.get(id).map(|&kind| ModuleInfo::of(kind)),
                threshold: thresholds.get(id).copied(),
                guessed: vec![],
            });
        }
        let mut meta = BTreeMap::new();
        meta.insert("rank".to_string(), r.to_string());
        safetensors::write(&dir.join(&file), &list, &meta)?;
    }
    let manifest = Manifest {
        format: "ttrace-trace".into(),
        version: VERSION,
        recipe: recipe.map(str::to_string),
        dp_loss: None,
        mesh: *mesh,
        run: None,
        tensors,
    };
    // Written last and atomically: a dump interrupted before this point has no manifest
    // (and `TraceDir::open` says so) rather than one naming files that are not there.
    write_manifest(&dir.join("manifest.json"), &manifest)
}

/// Write `manifest` to `path` atomically, in the compact form every ttrace writer uses (the
/// header one field per line, one line per entry). The one place that renders a manifest:
/// the simulator's dumps, the Python tracer's steps (through the bindings) and
/// [`merge_fragments`].
pub fn write_manifest(path: &Path, manifest: &Manifest) -> Result<()> {
    let text = manifest_text(manifest).map_err(|e| ferr(path, e.to_string()))?;
    crate::io::write_atomic(path, text.as_bytes())
}

/// Merge every `manifest.rank*.json` fragment of `dir` (rank order; they must agree on the
/// version, mesh, recipe and loss normalization, as [`read_manifest`] requires) into
/// `manifest.json`, written atomically — for several ranks written by one process. Returns
/// the merged manifest's path.
///
/// # Errors
///
/// [`Error::File`] when there is no fragment, one is invalid or they disagree; I/O errors.
pub fn merge_fragments(dir: &Path) -> Result<PathBuf> {
    let td = TrustedDir::new(dir)?;
    let (merged, _) = read_fragments(&td)?;
    let path = dir.join("manifest.json");
    write_manifest(&path, &merged)?;
    Ok(path)
}

/// A manifest as JSON: the header fields one per line, then one line per entry (compact: a
/// trace of 100,000 tensors on 2 ranks takes about 40 MB, not the 92 MB of indented JSON).
fn manifest_text(m: &Manifest) -> serde_json::Result<String> {
    use serde_json::to_string as json;
    let mut out = format!(
        "{{\n  \"format\": {},\n  \"version\": {},\n",
        json(&m.format)?,
        m.version
    );
    if let Some(r) = &m.recipe {
        out += &format!("  \"recipe\": {},\n", json(r)?);
    }
    if let Some(l) = &m.dp_loss {
        out += &format!("  \"dp_loss\": {},\n", json(l)?);
    }
    out += &format!("  \"mesh\": {},\n", json(&m.mesh)?);
    if let Some(r) = &m.run {
        out += &format!("  \"run\": {},\n", json(r)?);
    }
    out += "  \"tensors\": [";
    for (k, e) in m.tensors.iter().enumerate() {
        out += if k == 0 { "\n    " } else { ",\n    " };
        out += &json(e)?;
    }
    out += "\n  ]\n}\n";
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compact text is the manifest: it parses back to the same value as serde's own
    /// (indented) rendering.
    #[test]
    fn compact_text_is_the_manifest() {
        let e = |rank: usize| ManifestEntry {
            id: "a|fwd.output.0".into(),
            rank,
            file: format!("rank{rank}.safetensors"),
            key: "a\u{1b}|\"q\"".into(),
            dtype: Format::BF16,
            layout: Layout::replicated(),
            module: Some(ModuleInfo::of(ModuleKind::Linear)),
            threshold: Some(0.25),
            guessed: vec![],
        };
        let run = serde_json::json!({"torch": "2.11", "gpu": "H100"});
        for (recipe, tensors, dp_loss, run) in [
            (None, vec![], None, None),
            (
                Some("bf16".to_string()),
                vec![e(0), e(1)],
                Some(DpLoss::Auto),
                Some(run),
            ),
        ] {
            let m = Manifest {
                format: "ttrace-trace".into(),
                version: VERSION,
                recipe,
                dp_loss,
                mesh: Mesh::new(2, 1, 1, false).unwrap(),
                run,
                tensors,
            };
            let text = manifest_text(&m).unwrap();
            let a: serde_json::Value = serde_json::from_str(&text).unwrap();
            let b = serde_json::to_value(&m).unwrap();
            assert_eq!(a, b);
        }
    }

    /// The typed fast path and the field-by-field pass read the same manifests alike, and both
    /// refuse a field named twice.
    #[test]
    fn both_parsers_agree() {
        let path = Path::new("manifest.json");
        let text = r#"{"format": "ttrace-trace", "version": 1, "recipe": "bf16",
            "mesh": {"tp": 2, "cp": 1, "dp": 1, "sp": false},
            "tensors": [
              {"id": "a|fwd.output.0", "rank": 0, "file": "rank0.safetensors", "dtype": "bf16",
               "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                          "tp": {"kind": "split", "dim": 1, "groups": 1}},
               "module": {"kind": "linear", "accumulate": "f32"}, "threshold": 0.5},
              {"id": "a|fwd.output.0", "rank": 1, "file": "rank1.safetensors", "key": "k",
               "dtype": "bf16", "threshold": null,
               "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                          "tp": {"kind": "split", "dim": 1, "groups": 1}}}]}"#;
        let fast = Manifest::parse_typed(text, path).unwrap();
        let slow = Manifest::parse_detailed(text, path).unwrap();
        assert_eq!(fast, slow);
        // Fields this version does not know (a newer writer's) are read by the strict pass:
        // the same manifest.
        let extra = text
            .replacen(
                "\"threshold\": null,",
                "\"threshold\": null, \"extra\": [1, 2],",
                1,
            )
            .replacen(
                "\"recipe\"",
                "\"run\": {\"torch\": \"2\"}, \"new\": 1, \"recipe\"",
                1,
            );
        // The run's settings are kept as written, by both parsers.
        let with_run = Manifest {
            run: Some(serde_json::json!({"torch": "2"})),
            ..slow.clone()
        };
        assert!(Manifest::parse_typed(&extra, path).is_err());
        assert_eq!(Manifest::parse(&extra, path).unwrap(), with_run);
        // The Python tracer's "run" is known: typed.
        let run = text.replacen("\"recipe\"", "\"run\": {\"torch\": \"2\"}, \"recipe\"", 1);
        assert_eq!(Manifest::parse_typed(&run, path).unwrap(), with_run);
        assert_eq!(Manifest::parse_detailed(&run, path).unwrap(), with_run);
        assert_eq!(fast.tensors[0].key, "a|fwd.output.0");
        assert_eq!(fast.tensors[1].key, "k");
        let twice = text.replacen("\"rank\": 0,", "\"rank\": 0, \"rank\": 1,", 1);
        assert!(matches!(
            Manifest::parse_typed(&twice, path),
            Err(Error::File { .. })
        ));
        assert!(matches!(
            Manifest::parse_detailed(&twice, path),
            Err(Error::File { .. })
        ));
        let e = Manifest::parse(&twice, path).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    /// The arithmetic a module ran with reads from both parsers; a setting ttrace has no
    /// model for is `UnpricedArithmetic` naming the tensor and the setting, an unknown value
    /// a file error naming the tensor's `module`.
    #[test]
    fn module_arithmetic_reads_and_unpriceable_settings_are_refused() {
        let path = Path::new("manifest.json");
        let text = |module: &str| {
            format!(
                r#"{{"format": "ttrace-trace", "version": 1,
            "mesh": {{"tp": 1, "cp": 1, "dp": 1, "sp": false}},
            "tensors": [
              {{"id": "fc1|grad.input.0", "rank": 0, "file": "rank0.safetensors", "dtype": "f32",
               "layout": {{"dp": {{"kind": "replicate"}}, "cp": {{"kind": "replicate"}},
                          "tp": {{"kind": "replicate"}}}},
               "module": {module}}}]}}"#
            )
        };
        let ok = text(
            r#"{"kind": "linear", "autocast": "f16", "fp32_matmul": "tf32", "device": "cuda"}"#,
        );
        let fast = Manifest::parse_typed(&ok, path).unwrap();
        assert_eq!(fast, Manifest::parse_detailed(&ok, path).unwrap());
        let arith = &fast.tensors[0].module.as_ref().unwrap().arith;
        assert_eq!(arith.autocast, Some(Format::F16));
        assert_eq!(arith.fp32_matmul, Some(Format::TF32));
        assert_eq!(arith.device.as_deref(), Some("cuda"));
        for (module, setting) in [
            (r#"{"kind": "linear", "autocast": "e4m3"}"#, "autocast=e4m3"),
            (
                r#"{"kind": "linear", "fp32_matmul": "f16"}"#,
                "fp32_matmul=f16",
            ),
            (r#"{"fp32_conv": "e5m2"}"#, "fp32_conv=e5m2"),
        ] {
            match Manifest::parse(&text(module), path) {
                Err(Error::UnpricedArithmetic { id, setting: s }) => {
                    assert_eq!(id, "fc1|grad.input.0");
                    assert_eq!(s, setting);
                }
                other => panic!("{module}: {other:?}"),
            }
        }
        let e = Manifest::parse(&text(r#"{"autocast": "fp4"}"#), path).unwrap_err();
        assert!(matches!(e, Error::File { .. }), "{e:?}");
        assert!(e.to_string().contains("fc1|grad.input.0"), "{e}");
    }
}
