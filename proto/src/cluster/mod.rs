//! The cluster's rules: which node should hold which partition ([`assignment`]), and
//! what the nodes share: the records in the job's KV buckets and the control requests
//! and replies, with one decode policy ([`control`]); when a partition is done in a run
//! and when the run is over ([`run_end`]).

pub mod assignment;
pub mod control;
pub mod run_end;
