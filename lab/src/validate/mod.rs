//! Empirical validation of the thresholds on simulated sharded training steps: run the
//! reference and a sharded configuration, merge, compare every traced tensor against our
//! composed threshold, the perturbation estimate and the folklore baselines.
//!
//! * [`fresh_sites`]: where a sharded run's arithmetic differs from the reference's, and by
//!   how much;
//! * [`composed_thresholds`], [`perturbation_estimate`]: end-to-end thresholds by difference simulation,
//!   and TTrace's perturbation estimate;
//! * [`run_sweep`]: configurations, per-tensor results and the per-kind summary as data
//!   (the `ttrace` binary renders them as tables and SVG).

pub(crate) mod compose;
pub(crate) mod fresh;
pub(crate) mod localize;
pub(crate) mod power;
pub(crate) mod sensitivity;
pub(crate) mod sweep;

pub use compose::{
    composed_thresholds, perturbation_estimate, Composed, OffsetBounds, SimulationConfig,
    OFFSET_SHARE,
};
pub use fresh::{fresh_sites, local_thresholds, FreshSites};
pub use localize::{localize, replayed_outputs};
pub use power::{power_study, synthetic_pair, PowerRow, SyntheticClass};
pub use sensitivity::{sensitivity, Perturbation, Replayed, RuleFigures, Sensitivity, Subject};
pub use sweep::{
    bug_meshes, dump_run, run_bug, run_bug_dumping, run_config, run_config_with_thresholds,
    run_sweep, BugResult, BugRow, KindRow, RunConfig, RunResult, ScaleSummary, SensitivityRow,
    SweepOptions, SweepReport, TensorResult, TestColumn, Thresholds,
};
