//! The cluster's rules: which node should hold which partition ([`assignment`]), and
//! what the nodes share: the records in the job's KV buckets and the control requests
//! and replies, with one decode policy ([`control`]).

pub mod assignment;
pub mod control;
