//! Which node should hold which ordered partition: a plain function of the live nodes
//! and the current owners, no I/O (the lease manager applies it).
//!
//! * **Fair share**: with `P` partitions and `N` live nodes every node gets `⌊P/N⌋` or
//!   `⌈P/N⌉` (3 nodes, 8 partitions: 3, 3, 2).
//! * **Minimal movement**: a node keeps its partitions up to its share; only partitions
//!   of departed nodes and a node's excess move. When a node joins, exactly the
//!   partitions it needs move to it (3 → 4 nodes over 8 partitions: 2 moves).
//! * **Deterministic**: every node computes the same plan. Ties are broken by
//!   rendezvous (highest random weight) hashing of `(node, partition)`, with the
//!   wire format's FNV-1a, so the choice spreads evenly and does not depend on order.
//! * **Bounded steps**: [`limit_moves`] applies at most `k` moves of a plan at a time.

use crate::partitioner::fnv1a64;
use std::collections::{BTreeMap, BTreeSet};

/// Owner per partition.
pub type Assignment = BTreeMap<u32, String>;

/// The rendezvous weight of `node` for `partition`.
pub fn weight(node: &str, partition: u32) -> u64 {
    // Mix the partition in after the id so that ids sharing a prefix still spread.
    let h = fnv1a64(format!("{node}/{partition}").as_bytes());
    // A final avalanche step (splitmix64) evens out FNV's weak high bits.
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The target assignment of `partitions` partitions over `nodes`, moving as little as
/// possible from `current` (owners that are not live are ignored).
pub fn plan(partitions: u32, nodes: &BTreeSet<String>, current: &Assignment) -> Assignment {
    let n = nodes.len() as u32;
    if n == 0 || partitions == 0 {
        return Assignment::new();
    }
    let (base, extra) = (partitions / n, partitions % n);
    // What each live node holds now, best-weighted first (it keeps those).
    let mut held: BTreeMap<&str, Vec<u32>> = nodes.iter().map(|id| (id.as_str(), Vec::new())).collect();
    for (&p, owner) in current.iter().filter(|(p, _)| **p < partitions) {
        if let Some(list) = held.get_mut(owner.as_str()) {
            list.push(p);
        }
    }
    for (node, list) in held.iter_mut() {
        list.sort_by_key(|p| std::cmp::Reverse(weight(node, *p)));
    }
    // The `extra` nodes that may hold one more: those holding most now (fewest moves),
    // then by a rendezvous weight of the node itself.
    let mut order: Vec<&str> = nodes.iter().map(String::as_str).collect();
    order.sort_by_key(|node| (std::cmp::Reverse(held[node].len()), std::cmp::Reverse(weight(node, u32::MAX))));
    let target: BTreeMap<&str, usize> =
        order.iter().enumerate().map(|(i, node)| (*node, (base + u32::from((i as u32) < extra)) as usize)).collect();

    let mut out = Assignment::new();
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for (node, list) in &held {
        for &p in list.iter().take(target[node]) {
            out.insert(p, (*node).to_owned());
            *count.entry(node).or_default() += 1;
        }
    }
    // Everything else goes, partition by partition, to the best-weighted node with room.
    for p in 0..partitions {
        if out.contains_key(&p) {
            continue;
        }
        let best = nodes
            .iter()
            .filter(|node| count.get(node.as_str()).copied().unwrap_or(0) < target[node.as_str()])
            .max_by_key(|node| weight(node, p));
        if let Some(node) = best {
            *count.entry(node.as_str()).or_default() += 1;
            out.insert(p, node.clone());
        }
    }
    out
}

/// Partitions whose owner differs between `from` and `to` (including ones `from` had
/// no live owner for).
pub fn moves(from: &Assignment, to: &Assignment) -> Vec<u32> {
    to.iter().filter(|(p, owner)| from.get(p) != Some(owner)).map(|(p, _)| *p).collect()
}

/// `from` with at most `max` of the moves toward `to` applied — the lowest partitions
/// first; partitions with no owner in `from` are always assigned (they are idle).
pub fn limit_moves(from: &Assignment, to: &Assignment, max: usize) -> Assignment {
    let mut out: Assignment = from.iter().filter(|(p, _)| to.contains_key(p)).map(|(p, o)| (*p, o.clone())).collect();
    let mut budget = max;
    for p in moves(from, to) {
        let orphan = !from.contains_key(&p);
        if orphan || budget > 0 {
            if !orphan {
                budget -= 1;
            }
            if let Some(owner) = to.get(&p) {
                out.insert(p, owner.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    fn counts(a: &Assignment) -> BTreeMap<String, usize> {
        let mut c = BTreeMap::new();
        for owner in a.values() {
            *c.entry(owner.clone()).or_default() += 1;
        }
        c
    }

    #[test]
    fn three_nodes_share_eight_partitions_two_or_three_each() {
        let a = plan(8, &nodes(&["a", "b", "c"]), &Assignment::new());
        assert_eq!(a.len(), 8);
        let mut c: Vec<usize> = counts(&a).into_values().collect();
        c.sort_unstable();
        assert_eq!(c, vec![2, 3, 3]);
        assert_eq!(plan(8, &nodes(&["a", "b", "c"]), &a), a, "a plan is stable");
        assert_eq!(plan(8, &nodes(&["c", "a", "b"]), &Assignment::new()), a, "and independent of order");
    }

    #[test]
    fn a_joining_node_takes_only_what_it_needs() {
        let three = plan(8, &nodes(&["a", "b", "c"]), &Assignment::new());
        let four = plan(8, &nodes(&["a", "b", "c", "d"]), &three);
        assert!(counts(&four).values().all(|&n| n == 2), "{four:?}");
        let moved = moves(&three, &four);
        assert_eq!(moved.len(), 2, "{three:?} -> {four:?}");
        assert!(moved.iter().all(|p| four[p] == "d"), "only to the new node");
    }

    #[test]
    fn a_leaving_node_hands_over_only_its_own() {
        let three = plan(8, &nodes(&["a", "b", "c"]), &Assignment::new());
        let two = plan(8, &nodes(&["a", "c"]), &three);
        let moved = moves(&three, &two);
        assert!(moved.iter().all(|p| three[p] == "b"), "only b's partitions move: {moved:?}");
        assert!(counts(&two).values().all(|&n| n == 4));
    }

    #[test]
    fn many_partitions_spread_evenly_and_move_little() {
        let ids: Vec<String> = (0..7).map(|i| format!("node-{i}")).collect();
        let seven: BTreeSet<String> = ids.iter().cloned().collect();
        let a = plan(1000, &seven, &Assignment::new());
        assert!(counts(&a).values().all(|&n| n == 142 || n == 143), "{:?}", counts(&a));
        let mut eight = seven.clone();
        eight.insert("node-7".into());
        let b = plan(1000, &eight, &a);
        assert_eq!(moves(&a, &b).len(), 125, "exactly the new node's share moves");
        let big = plan(10_000, &eight, &Assignment::new());
        assert!(counts(&big).values().all(|&n| n == 1250), "10,000 partitions plan quickly and evenly");
    }

    #[test]
    fn moves_are_applied_in_bounded_steps() {
        let three = plan(8, &nodes(&["a", "b", "c"]), &Assignment::new());
        let target = plan(8, &nodes(&["a", "b", "c", "d"]), &three);
        let step = limit_moves(&three, &target, 1);
        assert_eq!(moves(&three, &step).len(), 1);
        assert_eq!(limit_moves(&step, &target, 1), target, "the second step finishes");
        // Orphans (no live owner) are never held back by the budget.
        let mut gone = three.clone();
        gone.retain(|_, o| o != "b");
        let fill = limit_moves(&gone, &plan(8, &nodes(&["a", "c"]), &gone), 0);
        assert_eq!(fill.len(), 8);
    }

    #[test]
    fn no_nodes_or_no_partitions_means_no_owners() {
        assert!(plan(8, &BTreeSet::new(), &Assignment::new()).is_empty());
        assert!(plan(0, &nodes(&["a"]), &Assignment::new()).is_empty());
        let a = plan(4, &nodes(&["a"]), &Assignment::new());
        assert_eq!(a.len(), 4);
        let shrunk = plan(2, &nodes(&["a"]), &a);
        assert_eq!(shrunk.len(), 2, "partitions beyond the count are dropped");
    }
}

#[cfg(test)]
mod props;
