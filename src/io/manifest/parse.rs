//! The manifest's parsers — a typed fast path and a strict field-by-field pass — and the
//! reading of `manifest.json` or its per-rank fragments.

use super::*;

/// A manifest entry as the typed fast path reads it (serde refuses a field named twice; a
/// field it does not know sends the manifest to the strict field-by-field pass, which checks
/// what such a field holds too).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEntry {
    pub(super) id: String,
    pub(super) rank: u64,
    pub(super) file: String,
    #[serde(default)]
    pub(super) key: Option<String>,
    pub(super) dtype: String,
    pub(super) layout: Layout,
    /// Parsed strictly, then as a [`ModuleInfo`] (which passes over fields it does not know).
    #[serde(default)]
    pub(super) module: Option<crate::io::guard::Strict>,
    #[serde(default)]
    pub(super) threshold: Option<f64>,
    #[serde(default)]
    pub(super) guessed: Vec<Axis>,
    #[serde(default)]
    pub(super) stage: Option<u64>,
    #[serde(default)]
    pub(super) owned: Option<Axis>,
}

/// The manifest as the typed fast path reads it (see [`RawEntry`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawManifest {
    /// `"ttrace-trace"` (checked before parsing).
    #[serde(default, rename = "format")]
    pub(super) _format: Option<String>,
    /// The run's settings as the Python tracer writes them (informational).
    #[serde(default)]
    pub(super) run: Option<crate::io::guard::Strict>,
    pub(super) version: u64,
    #[serde(default)]
    pub(super) recipe: Option<String>,
    #[serde(default)]
    pub(super) dp_loss: Option<DpLoss>,
    #[serde(default)]
    pub(super) pipeline: Option<Pipeline>,
    pub(super) mesh: Mesh,
    pub(super) tensors: Vec<RawEntry>,
}

/// The checks of one entry, shared by both parsers.
#[allow(clippy::too_many_arguments)]
pub(super) fn entry(
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
    (stage, pipeline, owned): (Option<u64>, Option<Pipeline>, Option<Axis>),
    mesh: &Mesh,
    path: &Path,
) -> Result<ManifestEntry> {
    let who = format!("tensor #{i} ('{}')", printable(&id));
    if let Some(axis) = &owned {
        // Held whole by one coordinate of the axis: replicated along it as far as the merge
        // of the owner's ranks goes, and known (no guess) along it.
        let problem = if !mesh.has(axis) {
            Some(format!("the mesh ({}) does not have it", mesh.label()))
        } else if layout.along(axis) != Placement::Replicate {
            Some("its layout must replicate the tensor along it (its owner holds it whole)".into())
        } else if guessed.contains(axis) {
            Some("it is also listed as guessed".into())
        } else {
            None
        };
        if let Some(why) = problem {
            return Err(ferr(path, format!("{who}: 'owned' axis '{axis}': {why}")));
        }
    }
    let stage = match (stage, pipeline) {
        (None, _) => None,
        (Some(s), Some(p)) if s < p.stages as u64 => Some(s as usize),
        (Some(s), p) => {
            return Err(ferr(
                path,
                format!(
                    "{who}: 'stage' {s} is not a stage of the pipeline ({})",
                    p.map_or("the manifest declares none".to_string(), |p| format!(
                        "{} stages",
                        p.stages
                    ))
                ),
            ))
        }
    };
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
    if let Some((axis, what)) = crate::trace::layout::layout_problem(&layout) {
        return Err(ferr(
            path,
            format!("{who}: layout along {}: {what}", axis.name()),
        ));
    }
    // One placement per axis of the mesh, in its order (replication where none is named).
    let layout = layout.completed(mesh).map_err(|axis| {
        ferr(
            path,
            format!(
                "{who}: 'layout' places the tensor along axis '{axis}', which the mesh ({}) \
                 does not have",
                mesh.label()
            ),
        )
    })?;
    for axis in guessed
        .iter()
        .chain(module.iter().flat_map(|m| &m.unreduced))
    {
        if !mesh.has(axis) {
            return Err(ferr(
                path,
                format!(
                    "{who}: names axis '{axis}' (guessed or unreduced), which the mesh ({}) \
                     does not have",
                    mesh.label()
                ),
            ));
        }
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
        stage,
        owned,
    })
}

/// A manifest's `pipeline`, checked: at least one and at most [`Pipeline::MAX`] stages and
/// microbatches.
pub(super) fn check_pipeline(p: Option<Pipeline>, path: &Path) -> Result<Option<Pipeline>> {
    match p {
        Some(q)
            if !(1..=Pipeline::MAX).contains(&q.stages)
                || !(1..=Pipeline::MAX).contains(&q.microbatches) =>
        {
            Err(ferr(
                path,
                format!(
                    "'pipeline': stages ({}) and microbatches ({}) must be between 1 and {}",
                    q.stages,
                    q.microbatches,
                    Pipeline::MAX
                ),
            ))
        }
        _ => Ok(p),
    }
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

    pub(super) fn check_version(version: u64, path: &Path) -> Result<()> {
        if !VERSIONS.contains(&version) {
            return Err(ferr(
                path,
                format!(
                    "schema version {version} is not supported (this ttrace reads versions \
                     {VERSIONS:?})"
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn parse_typed(text: &str, path: &Path) -> Result<Manifest> {
        let raw: RawManifest = serde_json::from_str(text)
            .map_err(|e| ferr(path, format!("not a valid manifest: {e}")))?;
        Self::check_version(raw.version, path)?;
        let mesh = raw.mesh;
        let pipeline = check_pipeline(raw.pipeline, path)?;
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
                    (t.stage, pipeline, t.owned),
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
            pipeline,
            mesh,
            run: raw.run.map(|r| r.0).filter(|r| !r.is_null()),
            tensors,
        })
    }

    /// Field by field on a strictly parsed JSON value, for messages that name the tensor and
    /// the field.
    pub(super) fn parse_detailed(text: &str, path: &Path) -> Result<Manifest> {
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
        let pipeline = match v.get("pipeline") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => Some(serde_json::from_value(x.clone()).map_err(|e| {
                ferr(
                    path,
                    format!("'pipeline' ({{\"stages\", \"microbatches\"}}): {e}"),
                )
            })?),
        };
        let pipeline = check_pipeline(pipeline, path)?;
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
            let stage = match t.get("stage") {
                None | Some(serde_json::Value::Null) => None,
                Some(x) => Some(x.as_u64().ok_or_else(|| {
                    ferr(
                        path,
                        format!("{who}: 'stage' must be a non-negative integer"),
                    )
                })?),
            };
            let owned = match t.get("owned") {
                None | Some(serde_json::Value::Null) => None,
                Some(x) => Some(
                    serde_json::from_value(x.clone())
                        .map_err(|e| ferr(path, format!("{who}: 'owned' (an axis): {e}")))?,
                ),
            };
            let guessed = match t.get("guessed") {
                None | Some(serde_json::Value::Null) => vec![],
                Some(x) => serde_json::from_value(x.clone())
                    .map_err(|e| ferr(path, format!("{who}: 'guessed' (a list of axes): {e}")))?,
            };
            tensors.push(entry(
                i,
                id,
                rank,
                file,
                key,
                dtype,
                layout,
                module,
                threshold,
                guessed,
                (stage, pipeline, owned),
                &mesh,
                path,
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
            pipeline,
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
pub(super) fn read_one(td: &TrustedDir, name: &str) -> Result<(Manifest, PathBuf)> {
    let (path, bytes) = td.read(name, limits::MANIFEST_BYTES, "manifest")?;
    let text = std::str::from_utf8(&bytes).map_err(|e| ferr(&path, format!("not UTF-8: {e}")))?;
    Ok((Manifest::parse(text, &path)?, path))
}

pub(super) fn read_manifest_in(td: &TrustedDir) -> Result<(Manifest, PathBuf)> {
    let dir = td.path();
    let mpath = dir.join("manifest.json");
    if std::fs::symlink_metadata(&mpath).is_ok() {
        return read_one(td, "manifest.json");
    }
    read_fragments(td)
}

/// Every `manifest.rank*.json` fragment of `td`, merged in rank order.
pub(super) fn read_fragments(td: &TrustedDir) -> Result<(Manifest, PathBuf)> {
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
    let mut read = Vec::with_capacity(parts.len());
    for (_, name) in &parts {
        read.push(read_one(td, name)?);
    }
    let merged = merge_parts(read, &mpath)?;
    Ok((merged, dir.join("manifest.rank*.json")))
}

/// Per-rank manifest fragments (each with the path it came from, for messages), in rank
/// order, as one manifest: they must agree on the mesh, the recipe and the loss
/// normalization.
pub(crate) fn merge_parts(parts: Vec<(Manifest, PathBuf)>, mpath: &Path) -> Result<Manifest> {
    let mut merged: Option<Manifest> = None;
    for (m, p) in parts {
        match &mut merged {
            None => merged = Some(m),
            Some(all) => {
                if all.mesh != m.mesh
                    || all.recipe != m.recipe
                    || all.dp_loss != m.dp_loss
                    || all.pipeline != m.pipeline
                {
                    return Err(ferr(
                        &p,
                        "fragment disagrees with the first fragment on the mesh, the recipe, \
                         the loss normalization or the pipeline",
                    ));
                }
                all.tensors.extend(m.tensors);
            }
        }
    }
    merged.ok_or_else(|| ferr(mpath, "no fragments"))
}
