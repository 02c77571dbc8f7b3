//! Checking a traced step that was never written (`Tracer(..., online=REFERENCE)`): every
//! traced rank holds its own shards in memory ([`TraceDir::in_memory`]); the ranks fetch
//! from each other what the check's set-up reads ([`setup_needs`]), then each rank receives
//! the shards of the tensors [`share_owners`] gives it, checks its share ([`check_share`])
//! and the shares are combined ([`combine_shares`]) into the report a check of the written
//! step gives.

use super::*;

/// The candidate ids whose shards the check's set-up (layouts the tracer only guessed, the
/// loss normalization, a sharded reference's layouts) reads and `candidate` does not hold, in
/// order: empty when the set-up has everything it needs. Every process of an online check
/// holds its own shards and whatever was fetched for all, so all of them find the same ids;
/// once those are fetched to every process, the set-up decides as it would on the written
/// trace (it reads the same bytes).
///
/// # Errors
///
/// What the set-up returns when nothing was missing (a trace that cannot be checked).
pub fn setup_needs(reference: &TraceDir, candidate: &TraceDir) -> Result<Vec<String>> {
    let before = candidate.not_held();
    let setup = Setup::new(reference, candidate);
    let needs: Vec<String> = candidate
        .not_held()
        .into_iter()
        .filter(|id| !before.contains(id))
        .collect();
    match setup {
        Err(e) if needs.is_empty() => Err(e),
        _ => Ok(needs),
    }
}
