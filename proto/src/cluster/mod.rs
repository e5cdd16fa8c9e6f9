//! The cluster's rules: which node should hold which partition.

pub mod assignment;
