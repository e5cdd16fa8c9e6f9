//! Properties of the assignment plan: balance, minimal movement and stability, over
//! arbitrary live nodes and arbitrary current owners (live or departed, partitions
//! beyond the count included).

use super::*;
use proptest::prelude::*;

fn node_set(max: usize) -> impl Strategy<Value = BTreeSet<String>> {
    proptest::collection::btree_set((0u32..12).prop_map(|i| format!("node-{i}")), 1..=max)
}

/// Owners as they may be found: some live, some gone, some beyond the partition count.
fn current(partitions: u32) -> impl Strategy<Value = Assignment> {
    proptest::collection::btree_map(0..partitions + 4, (0u32..14).prop_map(|i| format!("node-{i}")), 0..64)
}

fn counts(a: &Assignment) -> BTreeMap<&str, usize> {
    let mut c = BTreeMap::new();
    for owner in a.values() {
        *c.entry(owner.as_str()).or_default() += 1;
    }
    c
}

/// The fewest moves any balanced assignment needs from `current`: each node can keep
/// at most its target of what it holds, and the larger targets go to the largest holders.
fn fewest_moves(partitions: u32, nodes: &BTreeSet<String>, current: &Assignment) -> usize {
    let n = nodes.len() as u32;
    let (base, extra) = ((partitions / n) as usize, (partitions % n) as usize);
    let mut held: Vec<usize> =
        nodes.iter().map(|node| current.iter().filter(|(p, o)| **p < partitions && *o == node).count()).collect();
    held.sort_unstable_by(|a, b| b.cmp(a));
    let kept: usize = held.iter().enumerate().map(|(i, &h)| h.min(base + usize::from(i < extra))).sum();
    partitions as usize - kept
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn every_partition_has_exactly_one_live_owner_and_shares_differ_by_at_most_one(
        partitions in 0u32..200,
        nodes in node_set(8),
        current in (0u32..200).prop_flat_map(current),
    ) {
        let a = plan(partitions, &nodes, &current);
        prop_assert_eq!(a.keys().copied().collect::<Vec<_>>(), (0..partitions).collect::<Vec<_>>());
        prop_assert!(a.values().all(|o| nodes.contains(o)), "an owner that is not live");
        let c = counts(&a);
        let share = |node: &String| c.get(node.as_str()).copied().unwrap_or(0);
        let (lo, hi) = (nodes.iter().map(share).min().unwrap_or(0), nodes.iter().map(share).max().unwrap_or(0));
        prop_assert!(hi - lo <= 1, "shares from {} to {}: {:?}", lo, hi, c);
    }

    #[test]
    fn a_plan_moves_no_more_than_balance_requires(
        partitions in 1u32..200,
        nodes in node_set(8),
        current in (0u32..200).prop_flat_map(current),
    ) {
        let a = plan(partitions, &nodes, &current);
        prop_assert_eq!(moves(&current, &a).len(), fewest_moves(partitions, &nodes, &current));
    }

    #[test]
    fn a_joining_node_takes_its_share_and_nothing_else_moves(
        partitions in 1u32..300,
        nodes in node_set(7),
        joiner in 0u32..12,
        seed in (0u32..300).prop_flat_map(current),
    ) {
        let before = plan(partitions, &nodes, &seed);
        let joiner = format!("node-{joiner}");
        prop_assume!(!nodes.contains(&joiner));
        let mut more = nodes.clone();
        more.insert(joiner.clone());
        let after = plan(partitions, &more, &before);
        let moved = moves(&before, &after);
        prop_assert!(moved.iter().all(|p| after[p] == joiner), "a move to another than the new node");
        prop_assert_eq!(moved.len(), (partitions / more.len() as u32) as usize, "the new node's share, no more");
    }

    #[test]
    fn a_leaving_node_hands_over_only_its_own(
        partitions in 1u32..300,
        nodes in node_set(8),
        leaver in any::<prop::sample::Index>(),
        seed in (0u32..300).prop_flat_map(current),
    ) {
        prop_assume!(nodes.len() >= 2);
        let before = plan(partitions, &nodes, &seed);
        let leaver = leaver.get(&nodes.iter().cloned().collect::<Vec<_>>()).clone();
        let mut fewer = nodes.clone();
        fewer.remove(&leaver);
        let after = plan(partitions, &fewer, &before);
        let moved = moves(&before, &after);
        prop_assert!(moved.iter().all(|p| before[p] == leaver), "a partition of a staying node moved");
        prop_assert_eq!(moved.len(), counts(&before).get(leaver.as_str()).copied().unwrap_or(0));
    }

    #[test]
    fn a_plan_is_a_fixed_point_and_ignores_owners_that_do_not_count(
        partitions in 0u32..200,
        nodes in node_set(8),
        current in (0u32..200).prop_flat_map(current),
    ) {
        let a = plan(partitions, &nodes, &current);
        prop_assert_eq!(&plan(partitions, &nodes, &current), &a, "the same input, the same plan");
        let again = plan(partitions, &nodes, &a);
        prop_assert!(moves(&a, &again).is_empty(), "a plan applied to itself moves {:?}", moves(&a, &again));
        prop_assert_eq!(&again, &a);
        // Departed owners and partitions beyond the count are as good as absent.
        let live: Assignment =
            current.iter().filter(|(p, o)| **p < partitions && nodes.contains(*o)).map(|(p, o)| (*p, o.clone())).collect();
        prop_assert_eq!(&plan(partitions, &nodes, &live), &a);
    }

    #[test]
    fn bounded_steps_move_at_most_the_budget_and_reach_the_plan(
        partitions in 1u32..100,
        nodes in node_set(6),
        current in (0u32..100).prop_flat_map(current),
        budget in 1usize..6,
    ) {
        let target = plan(partitions, &nodes, &current);
        let mut at = current.clone();
        for _ in 0..=partitions {
            if at == target {
                break;
            }
            let next = limit_moves(&at, &target, budget);
            let stepped = moves(&at, &next);
            prop_assert!(stepped.iter().all(|p| next[p] == target[p]), "a step away from the plan");
            let reassigned = stepped.iter().filter(|p| at.contains_key(p)).count();
            prop_assert!(reassigned <= budget, "{} owned partitions moved with a budget of {}", reassigned, budget);
            prop_assert!(target.keys().all(|p| next.contains_key(p)), "a partition left without an owner");
            prop_assert!(next.keys().all(|p| target.contains_key(p)), "a partition beyond the count kept");
            at = next;
        }
        prop_assert_eq!(at, target);
    }
}
