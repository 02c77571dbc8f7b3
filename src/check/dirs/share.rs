//! A directory check shared among checker processes (`python -m ttrace check --distributed`,
//! `ttrace.check(reference, candidate, group=…)` on torch.distributed): every checker rank
//! reads, merges and compares only the tensors assigned to it ([`check_share`]), and the
//! shares — a few hundred bytes per tensor: the verdict's columns and the statistics pricing
//! needs — are combined into the report a single-machine check writes ([`combine_shares`]).
//!
//! The assignment ([`share_owners`]) is a pure function of the two traces' headers and the
//! number of checker ranks: the tensors, largest first, each to the rank with the fewest bytes
//! so far (balanced by bytes read, not by tensor count; the number of checker ranks is
//! independent of the traced run's layout). A tensor's first-pass result does not depend on
//! which process computed it, and the second pass (pricing, localization) runs on all of them
//! in the reference's order, so the combined report is the single-machine check's, bit for
//! bit. The shares are CBOR ([RFC 8949](https://www.rfc-editor.org/rfc/rfc8949)): every `f64`
//! travels exactly, NaN and infinities included.
//!
//! What every rank repeats: opening both traces (headers and manifests), settling guessed
//! layouts and the loss normalization (which read the few tensors they need) and the plan.

use serde::{Deserialize, Serialize};

use super::*;

/// Marks a share's bytes (and its format's version).
const MAGIC: &str = "ttrace-check-share-1";

/// One tensor's first-pass result as it travels between checker ranks: [`Gathered`] without
/// what the combining rank reads from the manifests itself (the modules).
#[derive(Serialize, Deserialize)]
struct Item {
    /// Position in the reference's ids.
    index: usize,
    verdict: TensorVerdict,
    ref_norm: f64,
    ref_max_abs: f64,
    diff_norm: f64,
    elements: usize,
    last_dim: usize,
    ndim: usize,
    format: Format,
    layout: crate::trace::Layout,
    ref_layout: crate::trace::Layout,
    norm_gain: f64,
    chain_error: f64,
    op: Option<crate::check::price::OpMeasure>,
    rank: Option<usize>,
    content: u64,
    shape: Vec<usize>,
    inferred: Option<crate::trace::Layout>,
    dtype_change: Option<String>,
}

/// One checker rank's share.
#[derive(Serialize, Deserialize)]
struct Wire {
    magic: String,
    /// Of the traces' headers and the number of ranks: shares of other traces (or of another
    /// split) are refused, not combined.
    fingerprint: u64,
    rank: usize,
    ranks: usize,
    items: Vec<Item>,
}

/// Where both runs store an id's shards (file and key by rank): the reference's, the
/// candidate's.
type Places<'a> = (Vec<(&'a str, &'a str)>, Vec<(&'a str, &'a str)>);

fn bad(reason: String) -> Error {
    Error::InvalidParameter {
        name: "shares",
        reason,
    }
}

/// Which checker rank reads each of the reference's ids (in the reference's order) when
/// `ranks` ranks share the check: largest first (reference and candidate bytes together),
/// each to the rank with the fewest bytes so far, ties to the lower rank and the earlier id;
/// ids stored in the same places in both runs (read once) go together, counted once.
///
/// # Examples
///
/// ```no_run
/// use ttrace::io::TraceDir;
/// let r = TraceDir::open("traces/reference".as_ref())?;
/// let c = TraceDir::open("traces/candidate".as_ref())?;
/// let owners = ttrace::check::share_owners(&r, &c, 4)?;
/// assert!(owners.iter().all(|&o| o < 4));
/// # Ok::<(), ttrace::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for zero ranks.
pub fn share_owners(
    reference: &TraceDir,
    candidate: &TraceDir,
    ranks: usize,
) -> Result<Vec<usize>> {
    if ranks == 0 {
        return Err(Error::InvalidParameter {
            name: "ranks",
            reason: "a check shared by zero ranks: give at least one".into(),
        });
    }
    let ids = super::verdicts::checked_ids(reference, candidate);
    // Ids stored in the same places in both runs (a tensor handed on between modules, stored
    // once by the tracer under both ids) go to one rank, their bytes counted once: it reads
    // them once (`gather_reusing`).
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut by_place: HashMap<Places<'_>, usize> = HashMap::new();
    for (k, id) in ids.iter().enumerate() {
        match (reference.storage(id), candidate.storage(id)) {
            (Some(r), Some(c)) => match by_place.entry((r, c)) {
                std::collections::hash_map::Entry::Occupied(u) => units[*u.get()].push(k),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(units.len());
                    units.push(vec![k]);
                }
            },
            _ => units.push(vec![k]),
        }
    }
    let mut bytes: Vec<u64> = units
        .iter()
        .map(|u| reference.stored_bytes(&ids[u[0]]) + candidate.stored_bytes(&ids[u[0]]))
        .collect();
    // A linear's weight gradient is tested element by element against its operands
    // (`check::weight_grad`): the rank that checks it reads them, so they go with it.
    let mut unit_of = vec![0usize; ids.len()];
    for (u, members) in units.iter().enumerate() {
        for &k in members {
            unit_of[k] = u;
        }
    }
    let index: HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(k, i)| (i.as_str(), k))
        .collect();
    for (k, id) in ids.iter().enumerate() {
        for operand in crate::check::weight_grad::operands(reference, id) {
            let (Some(&j), into) = (index.get(operand.as_str()), unit_of[k]) else {
                continue;
            };
            let from = unit_of[j];
            if from == into {
                continue;
            }
            let moved = std::mem::take(&mut units[from]);
            for &m in &moved {
                unit_of[m] = into;
            }
            units[into].extend(moved);
            bytes[into] += std::mem::take(&mut bytes[from]);
        }
    }
    let live: Vec<usize> = (0..units.len()).filter(|&u| !units[u].is_empty()).collect();
    let (units, bytes): (Vec<Vec<usize>>, Vec<u64>) = live
        .into_iter()
        .map(|u| (std::mem::take(&mut units[u]), bytes[u]))
        .unzip();
    let units: Vec<Vec<usize>> = units
        .into_iter()
        .map(|mut u| {
            u.sort_unstable();
            u
        })
        .collect();
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by_key(|&k| (std::cmp::Reverse(bytes[k]), units[k][0]));
    let mut load = vec![0u64; ranks];
    let mut owner = vec![0usize; ids.len()];
    for k in order {
        let (r, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(r, l)| (*l, r))
            .unwrap_or((0, &0));
        for &i in &units[k] {
            owner[i] = r;
        }
        load[r] += bytes[k].max(1);
    }
    Ok(owner)
}

/// 64-bit FNV-1a over what identifies a pair of traces and a split: every manifest entry (id,
/// rank, file, key, dtype, its bytes' range in the file), the meshes, and `ranks`. Not the
/// values: two copies of a trace with equal headers fingerprint alike.
fn fingerprint(reference: &TraceDir, candidate: &TraceDir, ranks: usize) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b.iter().chain(&[0xff]) {
            h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(MAGIC.as_bytes());
    eat(&(ranks as u64).to_le_bytes());
    for t in [reference, candidate] {
        let m = t.manifest();
        eat(m.mesh.label().as_bytes());
        for e in &m.tensors {
            eat(e.id.as_bytes());
            eat(&(e.rank as u64).to_le_bytes());
            eat(e.file.as_bytes());
            eat(e.key.as_bytes());
            eat(e.dtype.to_string().as_bytes());
        }
        for id in t.ids() {
            eat(&t.stored_bytes(id).to_le_bytes());
        }
    }
    h
}

/// Checker rank `rank` of `ranks`'s share of checking `candidate` against `reference`: the
/// first pass (read, merge, compare) over the ids [`share_owners`] gives it, on this process's
/// thread pool, as bytes for [`combine_shares`]. `progress` is called once per id read.
///
/// # Examples
///
/// ```no_run
/// use ttrace::io::TraceDir;
/// let r = TraceDir::open("traces/reference".as_ref())?;
/// let c = TraceDir::open("traces/candidate".as_ref())?;
/// let shares = (0..2)
///     .map(|rank| ttrace::check::check_share(&r, &c, rank, 2, &|| {}))
///     .collect::<ttrace::Result<Vec<_>>>()?;
/// let check = ttrace::check::combine_shares(&r, &c, Default::default(), &shares)?;
/// println!("{}", ttrace::check::render_dir_check(&check));
/// # Ok::<(), ttrace::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for a rank outside `0..ranks`; otherwise what
/// [`check_dir_traces`] returns for the tensors this rank reads.
pub fn check_share(
    reference: &TraceDir,
    candidate: &TraceDir,
    rank: usize,
    ranks: usize,
    progress: &(dyn Fn() + Sync),
) -> Result<Vec<u8>> {
    let owners = share_owners(reference, candidate, ranks)?;
    if rank >= ranks {
        return Err(Error::InvalidParameter {
            name: "rank",
            reason: format!(
                "checker rank {rank} of {ranks}: ranks are 0 to {}",
                ranks - 1
            ),
        });
    }
    let setup = Setup::new(reference, candidate)?;
    let mine: Vec<usize> = (0..owners.len()).filter(|&k| owners[k] == rank).collect();
    let gathered = gather_ids(&setup, &mine, progress)?;
    if let Some(id) = setup.candidate.not_held().first() {
        // A trace held in memory lacking a tensor this rank checks (or its set-up read).
        return Err(Error::Layout {
            id: id.clone(),
            reason: format!(
                "checker rank {rank} does not hold every shard of it: fetch them before \
                 checking its share"
            ),
        });
    }
    let items = mine
        .iter()
        .zip(gathered)
        .map(|(&index, g)| Item {
            index,
            verdict: g.verdict,
            ref_norm: g.stat.ref_norm,
            ref_max_abs: g.stat.ref_max_abs,
            diff_norm: g.stat.diff_norm,
            elements: g.stat.elements,
            last_dim: g.stat.last_dim,
            ndim: g.stat.ndim,
            format: g.stat.format,
            layout: g.stat.layout,
            ref_layout: g.stat.ref_layout,
            norm_gain: g.stat.norm_gain,
            chain_error: g.stat.chain_error,
            op: g.stat.op,
            rank: g.rank,
            content: g.content,
            shape: g.shape,
            inferred: g.inferred,
            dtype_change: g.dtype_change,
        })
        .collect();
    let wire = Wire {
        magic: MAGIC.into(),
        fingerprint: fingerprint(reference, candidate, ranks),
        rank,
        ranks,
        items,
    };
    let mut out = Vec::new();
    ciborium::into_writer(&wire, &mut out).map_err(|e| bad(format!("cannot encode: {e}")))?;
    Ok(out)
}

/// The report of checking `candidate` against `reference` from every checker rank's
/// [`check_share`] (`shares[r]` from rank `r`): the same [`DirCheck`] a single-machine
/// [`check_dir_traces`] gives.
///
/// # Errors
///
/// [`Error::InvalidParameter`] (`shares`) for bytes that are no share, a share of other
/// traces or of another number of ranks, shares out of rank order, or an id no share (or two)
/// holds; otherwise what settling the check's plan returns (see [`check_dir_traces`]).
pub fn combine_shares<B: AsRef<[u8]>>(
    reference: &TraceDir,
    candidate: &TraceDir,
    mode: PricingMode,
    shares: &[B],
) -> Result<DirCheck> {
    let ranks = shares.len();
    let owners = share_owners(reference, candidate, ranks)?;
    let print = fingerprint(reference, candidate, ranks);
    let setup = Setup::new(reference, candidate)?;
    let ids = &setup.plan.ids;
    let mut slots: Vec<Option<Gathered>> = (0..ids.len()).map(|_| None).collect();
    for (r, bytes) in shares.iter().enumerate() {
        let wire: Wire = ciborium::from_reader(bytes.as_ref())
            .map_err(|e| bad(format!("share {r} is not a checker rank's share: {e}")))?;
        if wire.magic != MAGIC {
            return Err(bad(format!(
                "share {r} is not a checker rank's share of this version (it says {})",
                printable(&wire.magic)
            )));
        }
        if (wire.rank, wire.ranks) != (r, ranks) {
            return Err(bad(format!(
                "share {r} comes from checker rank {} of {}, not rank {r} of {ranks}",
                wire.rank, wire.ranks
            )));
        }
        if wire.fingerprint != print {
            return Err(bad(format!(
                "checker rank {r} read other traces than these (their manifests or headers \
                 differ): every rank must check the same pair"
            )));
        }
        for it in wire.items {
            let Some(slot) = slots.get_mut(it.index) else {
                return Err(bad(format!(
                    "checker rank {r} sent tensor {} of {}",
                    it.index,
                    ids.len()
                )));
            };
            if owners[it.index] != r || slot.is_some() {
                return Err(bad(format!(
                    "checker rank {r} sent {}, which is not its own",
                    printable(&ids[it.index])
                )));
            }
            let id = &ids[it.index];
            *slot = Some(Gathered {
                stat: TensorStat {
                    ref_norm: it.ref_norm,
                    ref_max_abs: it.ref_max_abs,
                    diff_norm: it.diff_norm,
                    elements: it.elements,
                    last_dim: it.last_dim,
                    ndim: it.ndim,
                    format: it.format,
                    layout: it.layout,
                    ref_layout: it.ref_layout,
                    norm_gain: it.norm_gain,
                    chain_error: it.chain_error,
                    op: it.op,
                    module: reference.module(id).cloned(),
                    cand_module: setup.candidate.module(id).cloned(),
                },
                verdict: it.verdict,
                rank: it.rank,
                content: it.content,
                shape: it.shape,
                inferred: it.inferred,
                dtype_change: it.dtype_change,
            });
        }
    }
    let gathered = slots
        .into_iter()
        .enumerate()
        .map(|(k, g)| {
            g.ok_or_else(|| {
                bad(format!(
                    "no share holds {} (checker rank {}'s)",
                    printable(&ids[k]),
                    owners[k]
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(setup.conclude(gathered, mode))
}

/// [`check_share`] on directory paths (a traced step picked as [`resolve_steps`] does).
///
/// # Errors
///
/// As [`check_share`], and opening the traces.
pub fn check_share_paths(
    reference: &Path,
    candidate: &Path,
    rank: usize,
    ranks: usize,
    progress: &(dyn Fn() + Sync),
) -> Result<Vec<u8>> {
    let (r, c) = resolve_steps(reference, candidate)?;
    check_share(
        &TraceDir::open(&r)?,
        &TraceDir::open(&c)?,
        rank,
        ranks,
        progress,
    )
}

/// [`combine_shares`] on directory paths (a traced step picked as [`resolve_steps`] does).
///
/// # Errors
///
/// As [`combine_shares`], and opening the traces.
pub fn combine_share_paths<B: AsRef<[u8]>>(
    reference: &Path,
    candidate: &Path,
    mode: PricingMode,
    shares: &[B],
) -> Result<DirCheck> {
    let (r, c) = resolve_steps(reference, candidate)?;
    combine_shares(&TraceDir::open(&r)?, &TraceDir::open(&c)?, mode, shares)
}
