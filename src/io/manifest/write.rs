//! Writing traces: a directory of per-rank safetensors files and its manifest, the one
//! renderer of a manifest's text, and the merge of per-rank fragments.

use super::*;

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
    // One placement per mesh axis, in its order, as the reader completes them.
    let layouts = entries
        .iter()
        .map(|(id, layout, _)| {
            layout.completed(mesh).map_err(|axis| Error::Layout {
                id: id.clone(),
                reason: format!(
                    "placed along axis '{axis}', which the mesh ({}) does not have",
                    mesh.label()
                ),
            })
        })
        .collect::<Result<Vec<Layout>>>()?;
    let mut tensors = vec![];
    for r in 0..world {
        let file = format!("rank{r}.safetensors");
        let mut list = vec![];
        for ((id, _, shards), layout) in entries.iter().zip(&layouts) {
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
                layout: layout.clone(),
                module: modules.get(id).map(|&kind| ModuleInfo::of(kind)),
                threshold: thresholds.get(id).copied(),
                guessed: vec![],
                stage: None,
                owned: None,
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
        pipeline: None,
        mesh: mesh.clone(),
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
/// Always the current [`VERSION`] (a version-1 manifest read and written again is written in
/// version 2's form: the mesh's named axes).
pub(super) fn manifest_text(m: &Manifest) -> serde_json::Result<String> {
    use serde_json::to_string as json;
    let mut out = format!(
        "{{\n  \"format\": {},\n  \"version\": {VERSION},\n",
        json(&m.format)?,
    );
    if let Some(r) = &m.recipe {
        out += &format!("  \"recipe\": {},\n", json(r)?);
    }
    if let Some(l) = &m.dp_loss {
        out += &format!("  \"dp_loss\": {},\n", json(l)?);
    }
    if let Some(p) = &m.pipeline {
        out += &format!("  \"pipeline\": {},\n", json(p)?);
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
