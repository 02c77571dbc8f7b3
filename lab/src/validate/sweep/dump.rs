//! Runs dumped as trace directories (reference and candidate), for the checker's own tests.

use super::*;

/// Run `run` (with `bug`, if any) and write two trace directories under `dir`: `reference`
/// (the single-device step — for FP8, quantized with the candidate's scales, as the checks
/// compare) and `candidate` (every rank's shards with their layouts), in the format of
/// [`Manifest`](ttrace::io::Manifest); the reference's manifest carries the clean run's composed
/// `thresholds` so that `ttrace check` can use them.
pub fn dump_run(
    options: &SweepOptions,
    run: &RunConfig,
    bug: Option<Bug>,
    thresholds: &Thresholds,
    dir: &Path,
) -> Result<()> {
    let (_, mut reference, mut sharded) = prepare(options, run, bug)?;
    let cand = sharded.step()?;
    if !sharded.scales().is_empty() {
        reference.set_scale_overrides(sharded.scales().clone());
    }
    let ref_trace = reference.step()?.trace;
    write_dump(run, &reference, &ref_trace, &cand, thresholds, dir)
}

/// Write the two trace directories of [`dump_run`] from a step already run.
pub(super) fn write_dump(
    run: &RunConfig,
    reference: &Gpt,
    ref_trace: &Trace,
    cand: &ShardedStep,
    thresholds: &Thresholds,
    dir: &Path,
) -> Result<()> {
    let mut kinds = HashMap::new();
    for e in ref_trace.entries() {
        let module = TensorId::parse(&e.id).map(|t| t.module);
        if let Some(m) = module.and_then(|m| reference.module(&m).ok()) {
            kinds.insert(e.id.clone(), m.kind);
        }
    }
    let single = Mesh::single();
    let ref_entries: Vec<_> = ref_trace
        .entries()
        .iter()
        .map(|e| {
            (
                e.id.clone(),
                ttrace::trace::Layout::replicated(),
                vec![e.tensor.clone()],
            )
        })
        .collect();
    write_trace_dir(
        &dir.join("reference"),
        &single,
        Some(&run.recipe),
        &ref_entries,
        &kinds,
        &thresholds.composed,
    )?;
    let cand_entries: Vec<_> = cand
        .entries
        .iter()
        .map(|e| (e.id.clone(), e.layout.clone(), e.shards.clone()))
        .collect();
    write_trace_dir(
        &dir.join("candidate"),
        &run.mesh,
        Some(&run.recipe),
        &cand_entries,
        &kinds,
        &HashMap::new(),
    )
}
