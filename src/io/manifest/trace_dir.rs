//! An open trace directory: the manifest validated against the files' headers, layouts
//! inferred from shapes where a tracer only guessed them, and the logical tensors read back
//! shard by shard.

use super::*;

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
pub(super) fn squared_distance(a: &[f64], b: &[f64]) -> f64 {
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
pub(super) fn settle_guesses(tensors: &mut [ManifestEntry], ks: &[usize]) {
    let known: Vec<Layout> = ks
        .iter()
        .filter(|&&k| tensors[k].guessed.is_empty())
        .map(|&k| tensors[k].layout.clone())
        .collect();
    let Some(l) = known.first() else { return };
    if known.len() == ks.len() || known.iter().any(|k| k != l) {
        return;
    }
    for &k in ks {
        tensors[k].layout = l.clone();
        tensors[k].guessed.clear();
    }
}

/// An open trace directory: the manifest, validated against the files' headers.
#[derive(Debug)]
pub struct TraceDir {
    pub(super) dir: TrustedDir,
    pub(super) manifest: std::sync::Arc<Manifest>,
    /// Per id: the entries of every rank (index = rank).
    pub(super) by_id: std::sync::Arc<BTreeMap<String, Vec<usize>>>,
    pub(super) order: std::sync::Arc<Vec<String>>,
    pub(super) files: HashMap<String, safetensors::SafetensorsFile>,
    /// Read buffers handed back by [`TraceDir::recycle`], reused by the next reads.
    pub(super) spare: Vec<Vec<u8>>,
    /// Parameter gradients some ranks do not hold (the parameter received no gradient there:
    /// unused on that rank), with the ranks that lack them: not merged, judged as missing.
    pub(super) incomplete: std::sync::Arc<BTreeMap<String, Vec<usize>>>,
    /// Set by the checker when the candidate's ranks each averaged their loss over their own
    /// share of the batch ([`DpLoss::Auto`] settled): the loss-dependent tensors are read
    /// divided by this (dp·cp, dp or cp, whichever fit the reference).
    pub(super) dp_divisor: Option<usize>,
    /// For a trace held in memory ([`TraceDir::in_memory`]): the ids a read found some shard
    /// of not held (shared by every reader made by [`TraceDir::share`]).
    pub(super) held: Option<std::sync::Arc<Held>>,
    /// The ids one coordinate of an axis holds ([`ManifestEntry::owned`]): the mesh of the
    /// owner's ranks (the axis of size 1) and their global ranks, by rank in it — `by_id`
    /// lists their entries alone.
    pub(super) owners: std::sync::Arc<HashMap<String, Owner>>,
}

/// Who holds an owned id (see [`TraceDir::owner`]).
#[derive(Debug, Clone)]
pub(super) struct Owner {
    axis: Axis,
    coord: usize,
    mesh: Mesh,
    ranks: Vec<usize>,
}

/// Opens a trace directory's safetensors file by name.
type Opener = dyn Fn(&TrustedDir, &str) -> Result<safetensors::SafetensorsFile>;

/// What reads of a trace held in memory lacked.
#[derive(Debug, Default)]
pub(super) struct Held {
    not_held: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl TraceDir {
    /// Open `dir`: read `manifest.json` (or, when it is absent, the per-rank fragments
    /// `manifest.rank{r}.json` that distributed dumpers write, see [`read_manifest`]), open
    /// every file's header, and check that each entry's
    /// tensor exists with the declared dtype, that every id is present once per rank, and
    /// that all ranks agree on its layout.
    pub fn open(dir: &Path) -> Result<TraceDir> {
        let td = TrustedDir::new(dir)?;
        let (manifest, mpath) = read_manifest_in(&td)?;
        let opener = |td: &TrustedDir, name: &str| {
            let (shown, real, file) = td.open(name)?;
            let mut f = safetensors::SafetensorsFile::from_file(&shown, file)?;
            // No handle kept between reads: a trace of many ranks stays far below the
            // open-file limit.
            f.release(&real)?;
            Ok(f)
        };
        Self::assemble(td, manifest, mpath, HashMap::new(), Some(&opener))
    }

    /// A trace that was never written (a traced step checked online, `ttrace.tracer.online`):
    /// its manifest and its safetensors files held in memory
    /// ([`SafetensorsFile::in_memory`](safetensors::SafetensorsFile::in_memory)), each holding
    /// the bytes of some of its tensors. It is validated as a directory is; `label` names it
    /// in messages and reports. Reading a tensor some shard of which is not held is an error,
    /// and the id is remembered ([`TraceDir::not_held`]): a process that reads what others
    /// hold learns what to fetch.
    ///
    /// # Errors
    ///
    /// As [`TraceDir::open`]; an entry in an npy file or in a file not given is refused.
    pub fn in_memory(
        label: &Path,
        manifest: Manifest,
        files: HashMap<String, safetensors::SafetensorsFile>,
    ) -> Result<TraceDir> {
        let mpath = label.join("manifest.json");
        let mut t = Self::assemble(TrustedDir::label(label), manifest, mpath, files, None)?;
        t.held = Some(std::sync::Arc::new(Held::default()));
        Ok(t)
    }

    /// [`TraceDir::in_memory`] from per-rank manifest fragments as a tracer writes them
    /// (`manifest.rank{r}.json`'s text, in rank order; merged as a directory's fragments are).
    ///
    /// # Errors
    ///
    /// As [`TraceDir::in_memory`], and for a fragment that is not a valid manifest or that
    /// disagrees with the first on the mesh, the recipe or the loss normalization.
    pub fn from_fragments(
        label: &Path,
        fragments: &[String],
        files: HashMap<String, safetensors::SafetensorsFile>,
    ) -> Result<TraceDir> {
        let parts = fragments
            .iter()
            .enumerate()
            .map(|(r, text)| {
                let p = label.join(format!("manifest.rank{r}.json"));
                Ok((Manifest::parse(text, &p)?, p))
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = merge_parts(parts, &label.join("manifest.json"))?;
        Self::in_memory(label, merged, files)
    }

    /// The trace of `manifest` (read from `mpath`) in `td`: each entry checked against its
    /// file's header — from `files`, or opened by `opener` (none: every file is in `files`
    /// and none is npy).
    fn assemble(
        td: TrustedDir,
        mut manifest: Manifest,
        mpath: PathBuf,
        mut files: HashMap<String, safetensors::SafetensorsFile>,
        opener: Option<&Opener>,
    ) -> Result<TraceDir> {
        let dir = td.path().to_path_buf();
        let dir = dir.as_path();
        // Per id, (rank, entry) pairs: memory linear in the entries, whatever the mesh says.
        let mut by_id: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
        let mut order = vec![];
        let world = manifest.mesh.world();
        for (k, e) in manifest.tensors.iter().enumerate() {
            let path = dir.join(&e.file);
            if e.file.ends_with(".safetensors") {
                if !files.contains_key(&e.file) {
                    let f = match opener {
                        Some(open) => open(&td, &e.file)?,
                        None => {
                            return Err(ferr(
                                &path,
                                format!("file of tensor {} is not held", printable(&e.id)),
                            ))
                        }
                    };
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
            } else if opener.is_none() {
                return Err(ferr(
                    &path,
                    format!(
                        "tensor {}: a trace held in memory holds safetensors files only",
                        printable(&e.id)
                    ),
                ));
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
        let mut owners = HashMap::new();
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
            // Held by one coordinate of an axis: its entries are exactly that coordinate's.
            let owner = owner_of(&manifest, id, &slots).map_err(|e| ferr(&mpath, e))?;
            if owner.is_none() && slots.len() < world && id.ends_with("|param_grad") {
                let have: Vec<usize> = slots.iter().map(|(r, _)| *r).collect();
                let missing = (0..world).filter(|r| !have.contains(r)).collect();
                incomplete.insert(id.clone(), missing);
                continue;
            }
            if owner.is_none() && slots.len() < world {
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
            let l0 = &manifest.tensors[ks[0]].layout;
            if ks.iter().any(|&k| manifest.tensors[k].layout != *l0) {
                return Err(ferr(
                    &mpath,
                    format!("tensor {}: ranks declare different layouts", printable(id)),
                ));
            }
            if let Some(owner) = owner {
                owners.insert(id.clone(), owner);
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
            held: None,
            owners: std::sync::Arc::new(owners),
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
            held: self.held.clone(),
            owners: self.owners.clone(),
        }
    }

    /// For an id one coordinate of an axis holds ([`ManifestEntry::owned`], an expert's
    /// tensor): the axis and the coordinate.
    pub fn owner(&self, id: &str) -> Option<(&Axis, usize)> {
        self.owners.get(id).map(|o| (&o.axis, o.coord))
    }

    /// The mesh an id's entries are merged over: the manifest's, or for an owned id its
    /// owner's ranks (the owned axis of size 1).
    pub fn mesh_of(&self, id: &str) -> &Mesh {
        self.owners.get(id).map_or(&self.manifest.mesh, |o| &o.mesh)
    }

    /// The global rank of rank `r` of [`TraceDir::mesh_of`]`(id)`.
    pub fn global_rank(&self, id: &str, r: usize) -> usize {
        self.owners
            .get(id)
            .and_then(|o| o.ranks.get(r).copied())
            .unwrap_or(r)
    }

    /// For a trace held in memory: the ids whose reads found a shard not held (by this
    /// reader or any sharing it), in order; empty for a directory.
    pub fn not_held(&self) -> Vec<String> {
        self.held.as_ref().map_or_else(Vec::new, |h| {
            h.not_held
                .lock()
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default()
        })
    }

    /// Whether every shard of `id` can be read; for a trace held in memory, an id some shard
    /// of which is not held is remembered (see [`TraceDir::not_held`]).
    fn check_held(&self, id: &str, ks: &[usize]) -> Result<()> {
        let Some(h) = &self.held else { return Ok(()) };
        let all = ks.iter().all(|&k| {
            let e = &self.manifest.tensors[k];
            self.files.get(&e.file).is_some_and(|f| f.holds(&e.key))
        });
        if all {
            return Ok(());
        }
        if let Ok(mut s) = h.not_held.lock() {
            s.insert(id.to_string());
        }
        Err(Error::Layout {
            id: id.to_string(),
            reason: "some of its shards are held by other processes (not fetched)".into(),
        })
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
        self.check_held(id, &ks)?;
        let out = ks
            .iter()
            .map(|&k| {
                let e = &self.manifest.tensors[k];
                read_entry(&mut self.files, &self.dir, e, &mut self.spare)
            })
            .collect::<Result<_>>()?;
        Ok((out, self.manifest.tensors[ks[0]].layout.clone()))
    }

    /// Hand a tensor read from this directory back when it is no longer needed: its buffer is
    /// kept (up to a few) and reused by the next reads, which saves the fresh pages a large
    /// allocation costs. The buffers are freed with the `TraceDir`.
    pub(crate) fn recycle(&mut self, t: Stored) {
        keep(&mut self.spare, t.into_bytes());
    }

    /// The bytes an id's shards occupy in their files, over every rank (from the headers; for
    /// an npy file, its length on disk): what reading it costs. 0 for an unknown id.
    pub fn stored_bytes(&self, id: &str) -> u64 {
        let Some(ks) = self.by_id.get(id) else {
            return 0;
        };
        ks.iter()
            .map(|&k| {
                let e = &self.manifest.tensors[k];
                match self
                    .files
                    .get(&e.file)
                    .and_then(|f| f.entries().get(&e.key))
                {
                    Some(x) => x.range.1.saturating_sub(x.range.0),
                    None => std::fs::metadata(self.path().join(&e.file)).map_or(0, |m| m.len()),
                }
            })
            .sum()
    }

    /// Where every rank's shard of an id is stored (file and key, by rank): two ids with the
    /// same places hold the same bytes (a tracer stores a tensor passed between modules once).
    pub(crate) fn storage(&self, id: &str) -> Option<Vec<(&str, &str)>> {
        let ks = self.by_id.get(id)?;
        Some(
            ks.iter()
                .map(|&k| {
                    let e = &self.manifest.tensors[k];
                    (e.file.as_str(), e.key.as_str())
                })
                .collect(),
        )
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
            .map(|ks| self.manifest.tensors[ks[0]].layout.clone())
    }

    /// The local shape of one manifest entry, from its file's header (`None` for npy files,
    /// whose headers are read only with their data).
    pub(super) fn entry_shape(&self, k: usize) -> Option<&[usize]> {
        let e = &self.manifest.tensors[k];
        let f = self.files.get(&e.file)?;
        f.entries().get(&e.key).map(|x| x.shape.as_slice())
    }

    /// The logical shape of an id: its first rank's shape, grown by its layout's splits.
    pub fn logical_shape(&self, id: &str) -> Option<Vec<usize>> {
        let ks = self.by_id.get(id)?;
        let e = &self.manifest.tensors[ks[0]];
        crate::trace::infer::logical_shape(&e.layout, self.entry_shape(ks[0])?, &self.manifest.mesh)
    }

    /// This trace with the layouts its writer guessed (the axes an entry lists as `guessed`)
    /// settled against `reference`'s logical shapes: among the layouts that give every rank
    /// its shape (see `fitting_layouts` in `trace/infer.rs`), the only one, or — when several
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
            let fits = crate::trace::infer::fitting_layouts(
                &first.layout,
                &first.guessed,
                &logical,
                shapes[0],
                &self.manifest.mesh,
            );
            let chosen = match fits.len() {
                0 => continue,
                1 => fits[0].clone(),
                _ => {
                    let want = theirs.logical(id)?;
                    let mut best: Option<(f64, Layout)> = None;
                    for l in &fits {
                        let Some(got) = mine.explained_by(id, l)? else {
                            continue;
                        };
                        let d = squared_distance(got.values(), want.values());
                        // Ties keep the earlier (fewer changes).
                        if best.as_ref().is_none_or(|(bd, _)| d < *bd) {
                            best = Some((d, l.clone()));
                        }
                    }
                    best.map_or_else(|| fits[0].clone(), |b| b.1)
                }
            };
            self.settle(&mut manifest, &mut changed, id, chosen, fits.len());
        }
        Ok((self.with_manifest(manifest), changed))
    }

    /// The merged tensor of `id` read with `layout`, or `None` when its shards do not merge
    /// so (replicas that disagree, shapes that do not fit): a layout that is no explanation.
    fn explained_by(&mut self, id: &str, layout: &Layout) -> Result<Option<Tensor>> {
        match self.logical_as(id, layout) {
            Ok(t) => Ok(Some(t)),
            Err(Error::ReplicaMismatch { .. } | Error::Layout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Record `chosen` as `id`'s layout (in a copy of the manifest, made on the first change)
    /// when it differs from the written one.
    fn settle(
        &self,
        manifest: &mut Option<Manifest>,
        changed: &mut Vec<InferredLayout>,
        id: &str,
        chosen: Layout,
        fitting: usize,
    ) {
        let ks = &self.by_id[id];
        if chosen == self.manifest.tensors[ks[0]].layout {
            return;
        }
        let m = manifest.get_or_insert_with(|| (*self.manifest).clone());
        for &k in ks {
            m.tensors[k].layout = chosen.clone();
        }
        changed.push(InferredLayout {
            tensor: id.to_string(),
            layout: chosen,
            fitting,
        });
    }

    /// A reader of this directory with `manifest` (when given) in place of its own.
    fn with_manifest(&self, manifest: Option<Manifest>) -> TraceDir {
        let mut out = self.share();
        if let Some(m) = manifest {
            out.manifest = std::sync::Arc::new(m);
        }
        out
    }

    /// This *sharded reference*'s guessed layouts settled against `candidate`, another sharded
    /// run of the same model, whose layouts may be guessed too: for each guessed id, the
    /// logical shapes both runs' shards can form (every layout their guessed axes allow; the
    /// candidate's own logical shape where it knew its layout), the reference layouts that
    /// give each rank its shape for one of them — the only one, or the one whose merged tensor
    /// is closest to the candidate's merged by one of its fitting layouts (see
    /// [`TraceDir::infer_guessed`], whose rule this extends to two guessing runs). Returns it
    /// and the ids whose layout changed; a guess nothing fits is kept.
    ///
    /// # Errors
    /// Reading a tensor to settle an ambiguous layout can fail as [`TraceDir::logical`] does.
    pub fn infer_guessed_jointly(
        &self,
        candidate: &TraceDir,
    ) -> Result<(TraceDir, Vec<InferredLayout>)> {
        use crate::trace::infer::{fitting_layouts, possible_logical_shapes};
        let mut changed = vec![];
        let mut manifest: Option<Manifest> = None;
        let (mut mine, mut theirs) = (self.share(), candidate.share());
        let (mesh, cmesh) = (&self.manifest.mesh, &candidate.manifest.mesh);
        for id in self.order.iter() {
            let (Some(ks), Some(cks)) = (self.by_id.get(id), candidate.by_id.get(id)) else {
                continue;
            };
            let (first, cfirst) = (
                &self.manifest.tensors[ks[0]],
                &candidate.manifest.tensors[cks[0]],
            );
            if first.guessed.is_empty() {
                continue;
            }
            let shapes: Option<Vec<&[usize]>> = ks.iter().map(|&k| self.entry_shape(k)).collect();
            let (Some(shapes), Some(clocal)) = (shapes, candidate.entry_shape(cks[0])) else {
                continue;
            };
            if shapes.windows(2).any(|w| w[0] != w[1]) {
                continue;
            }
            let targets: Vec<Vec<usize>> = if cfirst.guessed.is_empty() {
                candidate.logical_shape(id).into_iter().collect()
            } else {
                let theirs =
                    possible_logical_shapes(&cfirst.layout, &cfirst.guessed, clocal, cmesh);
                possible_logical_shapes(&first.layout, &first.guessed, shapes[0], mesh)
                    .into_iter()
                    .filter(|s| theirs.contains(s))
                    .collect()
            };
            let pairs: Vec<(&Vec<usize>, Layout)> = targets
                .iter()
                .flat_map(|t| {
                    fitting_layouts(&first.layout, &first.guessed, t, shapes[0], mesh)
                        .into_iter()
                        .map(move |l| (t, l))
                })
                .collect();
            let chosen = match pairs.len() {
                0 => continue,
                1 => pairs[0].1.clone(),
                _ => {
                    let mut best: Option<(f64, Layout)> = None;
                    for (t, l) in &pairs {
                        let Some(got) = mine.explained_by(id, l)? else {
                            continue;
                        };
                        let theirs_fit = if cfirst.guessed.is_empty() {
                            vec![cfirst.layout.clone()]
                        } else {
                            fitting_layouts(&cfirst.layout, &cfirst.guessed, t, clocal, cmesh)
                        };
                        for cl in &theirs_fit {
                            let Some(want) = theirs.explained_by(id, cl)? else {
                                continue;
                            };
                            if want.shape() != got.shape() {
                                continue;
                            }
                            let d = squared_distance(got.values(), want.values());
                            // Ties keep the earlier (fewer changes).
                            if best.as_ref().is_none_or(|(bd, _)| d < *bd) {
                                best = Some((d, l.clone()));
                            }
                        }
                    }
                    best.map_or_else(|| pairs[0].1.clone(), |b| b.1)
                }
            };
            self.settle(&mut manifest, &mut changed, id, chosen, pairs.len());
        }
        Ok((self.with_manifest(manifest), changed))
    }

    /// The merged logical tensor of an id (see [`crate::trace::merge()`]).
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
        let layout = self.manifest.tensors[ks[0]].layout.clone();
        self.logical_stored_as(id, &layout)
    }

    /// [`TraceDir::logical`] merged as if the layout were `layout`.
    pub(super) fn logical_as(&mut self, id: &str, layout: &Layout) -> Result<Tensor> {
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

    /// The divisor the tensor `id` is read divided by ([`TraceDir::set_dp_divisor`]), where
    /// it is: more than one, and `id` loss-dependent under its own layout.
    pub(crate) fn divisor_of(&self, id: &str) -> Option<usize> {
        let d = self.dp_divisor.filter(|&d| d > 1)?;
        let layout = self.layout(id)?;
        self.loss_dependent(id, &layout).then_some(d)
    }

    /// Whether the tensor `id` merged as `layout` scales with each data-parallel rank's loss
    /// normalization: an activation's gradient held in parts along dp or cp (split, or summed
    /// — a parameter's is reduced by the engine, which knows), or a forward tensor summed over
    /// dp or cp (a scalar loss). In a trace of several microbatches each one's loss may be its
    /// own mean too: every activation gradient then (a parameter's is accumulated and scaled by
    /// the engine, which knows).
    pub(crate) fn loss_dependent(&self, id: &str, layout: &Layout) -> bool {
        let Some(t) = crate::trace::TensorId::parse(id) else {
            return false;
        };
        let data = [layout.along(&Axis::DP), layout.along(&Axis::CP)];
        // An expert's tensors, held by one data coordinate, gather every data rank's tokens.
        let gathered = self
            .owner(id)
            .is_some_and(|(a, _)| *a == Axis::DP || *a == Axis::CP);
        match t.pass() {
            crate::policy::Pass::Forward => data.contains(&Placement::Partial),
            crate::policy::Pass::Backward => {
                !matches!(t.role, crate::trace::TensorRole::ParamGrad { .. })
                    && (self.manifest.microbatches() > 1
                        || gathered
                        || data.iter().any(|&p| p != Placement::Replicate))
            }
        }
    }

    /// [`TraceDir::logical_stored`] merged as if the layout were `layout`.
    pub(crate) fn logical_stored_as(&mut self, id: &str, layout: &Layout) -> Result<Stored> {
        let stored = self.merged_as(id, layout)?;
        match self.dp_divisor {
            Some(d) if d > 1 && self.loss_dependent(id, layout) => {
                crate::trace::stored::divided(&stored, d as f64)
            }
            _ => Ok(stored),
        }
    }

    pub(super) fn merged_as(&mut self, id: &str, layout: &Layout) -> Result<Stored> {
        let ks = self.entries_of(id)?;
        self.check_held(id, &ks)?;
        let manifest = self.manifest.clone();
        let owners = self.owners.clone();
        let mesh = owners.get(id).map_or(&manifest.mesh, |o| &o.mesh);
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
            layout,
            mesh,
            id,
            None,
            &mut self.spare,
        )
    }

    /// The manifest entries of an id, by rank.
    pub(super) fn entries_of(&self, id: &str) -> Result<Vec<usize>> {
        self.by_id
            .get(id)
            .cloned()
            .ok_or_else(|| Error::UnknownName {
                kind: "traced tensor",
                name: id.to_string(),
            })
    }
}

/// The owner of an id whose entries say [`ManifestEntry::owned`] (`None` for others), checked:
/// every entry names the same axis, and the ranks holding it are exactly those of one
/// coordinate along it (`slots`: (rank, entry), in rank order).
fn owner_of(
    manifest: &Manifest,
    id: &str,
    slots: &[(usize, usize)],
) -> std::result::Result<Option<Owner>, String> {
    let axis = manifest.tensors[slots[0].1].owned.clone();
    if slots
        .iter()
        .any(|&(_, k)| manifest.tensors[k].owned != axis)
    {
        return Err(format!(
            "tensor {}: ranks disagree on whether (and along which axis) it is owned",
            printable(id)
        ));
    }
    let Some(axis) = axis else { return Ok(None) };
    let mesh = &manifest.mesh;
    let coord = mesh.coord(slots[0].0, &axis);
    let ranks: Vec<usize> = (0..mesh.world())
        .filter(|&r| mesh.coord(r, &axis) == coord)
        .collect();
    if slots.len() != ranks.len() || slots.iter().zip(&ranks).any(|(s, r)| s.0 != *r) {
        return Err(format!(
            "tensor {} is owned along '{axis}' but held by ranks {:?}, not by the ranks of one \
             coordinate along it ({coord}: ranks {ranks:?})",
            printable(id),
            slots.iter().map(|s| s.0).collect::<Vec<_>>()
        ));
    }
    let sub = Mesh::new(
        mesh.axes()
            .iter()
            .map(|(a, n)| (a.clone(), if *a == axis { 1 } else { *n })),
    )
    .map_err(|e| e.to_string())?
    .with_sequence_parallel(mesh.sp());
    Ok(Some(Owner {
        axis,
        coord,
        mesh: sub,
        ranks,
    }))
}

/// The sum of the tensors of `entries` (the addends of one partial sum, held by `ranks`),
/// taken a block at a time from the files: memory for the sum and one block per addend, not
/// for every addend.
pub(super) fn sum_streamed(
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
pub(super) fn read_entry(
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
