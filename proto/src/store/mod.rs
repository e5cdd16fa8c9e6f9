//! The rules of durable task state that need no store types: the changelog's records.

pub mod records;

pub use records::{CommitRecord, Record, Resolution, claim, commit_key, hex, record_key, resolve, unhex};
