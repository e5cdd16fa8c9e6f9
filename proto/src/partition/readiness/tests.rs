use super::*;

fn now() -> Instant {
    Instant::now()
}

fn task(max: usize, async_commit: bool) -> TaskState<&'static str> {
    TaskState::new([0], max, async_commit, "run-1")
}

fn expect_process(s: &mut TaskState<&'static str>) -> Pending<&'static str> {
    match s.next_op(now()) {
        Op::Process(p) => p,
        other => panic!("expected process, got {other:?}"),
    }
}

#[test]
fn messages_are_processed_in_order() {
    let mut s = task(1, false);
    for m in ["a", "b", "c"] {
        s.insert(0, EnvelopeKind::Data, m);
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        let p = expect_process(&mut s);
        assert!(matches!(s.next_op(now()), Op::NoOp), "max concurrency 1 holds the next one");
        seen.push(p.msg);
        s.done(p.order);
    }
    assert_eq!(seen, ["a", "b", "c"]);
}

#[test]
fn out_of_order_callbacks_commit_only_the_contiguous_prefix() {
    let mut s = task(3, false);
    for m in ["a", "b", "c"] {
        s.insert(0, EnvelopeKind::Data, m);
    }
    let (a, b, c) = (expect_process(&mut s), expect_process(&mut s), expect_process(&mut s));
    assert_eq!(s.done(c.order), None, "c done, a and b not: nothing committable");
    assert_eq!(s.done(a.order), Some((0, a.order)), "a done: prefix is a");
    assert_eq!(s.committable_for(0), Some(0));
    assert_eq!(s.done(b.order), Some((0, c.order)), "b done: prefix jumps to c");
}

#[test]
fn a_released_envelope_frees_its_slot_and_holds_the_commit_position_before_it() {
    let mut s = task(2, false);
    for m in ["a", "b", "c"] {
        s.insert(0, EnvelopeKind::Data, m);
    }
    let (a, b) = (expect_process(&mut s), expect_process(&mut s));
    assert_eq!(s.done(a.order), Some((0, a.order)));
    s.attempt_paused(b.order);
    s.release(b.order);
    assert_eq!(s.in_flight(), 0, "a stop handed b back: nothing runs");
    let c = expect_process(&mut s);
    assert_eq!(s.done(c.order), None, "c is done, but the commit never passes b");
    assert_eq!(s.committable_for(0), Some(a.order));
}

#[test]
fn effects_gate_the_commit_position() {
    let mut s = task(2, false);
    s.insert(0, EnvelopeKind::Data, "a");
    let a = expect_process(&mut s);
    s.process_done(a.order);
    assert_eq!(s.in_flight(), 0, "the slot is free once process returns");
    assert_eq!(s.committable_for(0), None, "but nothing is committable before its outputs are stored");
    assert_eq!(s.effects_done(a.order), Some((0, a.order)));
}

#[test]
fn max_concurrency_bounds_in_flight() {
    let mut s = task(2, false);
    for m in ["a", "b", "c"] {
        s.insert(0, EnvelopeKind::Data, m);
    }
    let a = expect_process(&mut s);
    let _b = expect_process(&mut s);
    assert!(matches!(s.next_op(now()), Op::NoOp));
    assert_eq!(s.in_flight(), 2);
    s.done(a.order);
    assert_eq!(expect_process(&mut s).msg, "c");
}

#[test]
fn window_and_commit_take_priority_over_process_and_never_overlap_it() {
    let mut s = task(2, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Data, "b");
    let a = expect_process(&mut s);
    s.request_window();
    s.request_commit();
    assert!(matches!(s.next_op(now()), Op::NoOp), "nothing may start while a process runs and window/commit wait");
    s.done(a.order);
    assert!(matches!(s.next_op(now()), Op::Commit), "commit first");
    assert!(matches!(s.next_op(now()), Op::NoOp), "commit in flight blocks window and process");
    s.commit_done(s.committable().clone());
    assert!(matches!(s.next_op(now()), Op::Window), "then window");
    assert!(matches!(s.next_op(now()), Op::NoOp), "window in flight blocks process");
    s.window_done();
    assert_eq!(expect_process(&mut s).msg, "b");
}

#[test]
fn async_commit_may_overlap_process() {
    let mut s = task(2, true);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Data, "b");
    let _a = expect_process(&mut s);
    s.request_commit();
    assert!(matches!(s.next_op(now()), Op::Commit), "commit runs while a is in flight");
    assert_eq!(expect_process(&mut s).msg, "b", "and process goes on during the commit");
}

#[test]
fn a_task_commit_request_is_honoured() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Data, "a");
    let a = expect_process(&mut s);
    s.done(a.order);
    s.request_commit(); // TaskContext::commit() during processing
    assert!(matches!(s.next_op(now()), Op::Commit));
    assert!(s.uncommitted());
    s.commit_done(s.committable().clone());
    assert!(!s.uncommitted());
}

#[test]
fn shutdown_requests_with_both_scopes() {
    let mut c = CoordinatorRequests::new([0u32, 1, 2]);
    c.request(0, ShutdownScope::CurrentTask);
    c.request(1, ShutdownScope::CurrentTask);
    assert!(c.asked(&0) && !c.asked(&2));
    assert!(!c.should_shutdown(), "the container stops only when every task asked");
    c.request(2, ShutdownScope::CurrentTask);
    assert!(c.should_shutdown());
    let mut c = CoordinatorRequests::new([0u32, 1, 2]);
    c.request(1, ShutdownScope::AllTasksInContainer);
    assert!(c.should_shutdown(), "one all-tasks request stops the container");
    assert!(c.asked(&0));
}

#[test]
fn end_of_stream_waits_for_in_flight_then_commits() {
    let mut s: TaskState<&str> = TaskState::new([0, 1], 2, false, "run-1");
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::EndOfStream, "eos-0");
    s.insert(1, EnvelopeKind::EndOfStream, "eos-1");
    let a = expect_process(&mut s);
    assert!(matches!(s.next_op(now()), Op::NoOp), "end of stream waits for a");
    s.done(a.order);
    assert!(matches!(s.next_op(now()), Op::EndOfStream));
    assert!(s.is_complete());
    assert_eq!(s.committable_for(0), Some(1), "the markers' positions are committable too");
    assert_eq!(s.committable_for(1), Some(2));
    assert!(matches!(s.next_op(now()), Op::NoOp));
}

#[test]
fn end_of_stream_needs_every_input() {
    let mut s: TaskState<&str> = TaskState::new([0, 1], 1, false, "run-1");
    s.insert(0, EnvelopeKind::EndOfStream, "eos-0");
    s.insert(1, EnvelopeKind::Data, "b");
    assert_eq!(expect_process(&mut s).msg, "b", "input 1 is still open");
    assert!(!s.is_complete());
}

#[test]
fn drain_with_the_current_run_id_completes_the_task() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Drain { run_id: "run-1".into() }, "marker");
    s.insert(0, EnvelopeKind::Data, "after");
    let a = expect_process(&mut s);
    assert!(matches!(s.next_op(now()), Op::NoOp), "drain waits for in-flight work");
    s.done(a.order);
    // The marker is consumed; the message after it is held, never processed.
    assert!(matches!(s.next_op(now()), Op::Drain));
    assert!(s.is_complete());
    let unstarted = s.take_unstarted();
    assert_eq!(unstarted.iter().map(|p| p.msg).collect::<Vec<_>>(), ["after"]);
    assert_eq!(s.committable_for(0), Some(1), "everything up to the marker is committable");
}

#[test]
fn drain_waits_for_every_input_and_holds_what_follows_a_marker() {
    let mut s: TaskState<&str> = TaskState::new([0, 1], 1, false, "run-1");
    s.insert(0, EnvelopeKind::Drain { run_id: "run-1".into() }, "m0");
    s.insert(0, EnvelopeKind::Data, "x0 after marker");
    s.insert(1, EnvelopeKind::Data, "b1 before marker");
    s.insert(1, EnvelopeKind::Drain { run_id: "run-1".into() }, "m1");
    let b = expect_process(&mut s);
    assert_eq!(b.msg, "b1 before marker", "input 1 is not drained yet; x0 is held");
    s.done(b.order);
    assert!(matches!(s.next_op(now()), Op::Drain));
    assert_eq!(s.take_unstarted().iter().map(|p| p.msg).collect::<Vec<_>>(), ["x0 after marker"]);
    assert_eq!(s.committable_for(0), Some(0), "x0 (order 1) is never committed: input 0 stops at m0");
    assert_eq!(s.committable_for(1), Some(3), "input 1 commits through its marker");
}

#[test]
fn markers_after_a_drained_input_are_held_too() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Drain { run_id: "run-1".into() }, "m1");
    s.insert(0, EnvelopeKind::Data, "d2");
    s.insert(0, EnvelopeKind::Drain { run_id: "run-1".into() }, "m2 (a second drain request)");
    assert!(matches!(s.next_op(now()), Op::Drain));
    assert_eq!(s.committable_for(0), Some(0), "the commit stops at the first marker, before held d2");
    assert_eq!(s.take_unstarted().len(), 2, "d2 and the later marker are handed back");
}

#[test]
fn drain_waits_for_outputs_to_be_stored() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Drain { run_id: "run-1".into() }, "m");
    let a = expect_process(&mut s);
    s.process_done(a.order);
    assert!(matches!(s.next_op(now()), Op::NoOp), "a's outputs are not stored yet");
    s.effects_done(a.order);
    assert!(matches!(s.next_op(now()), Op::Drain));
}

#[test]
fn a_stale_drain_marker_is_dropped() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Drain { run_id: "run-0".into() }, "old marker");
    s.insert(0, EnvelopeKind::Data, "a");
    assert_eq!(expect_process(&mut s).msg, "a");
    assert!(!s.is_complete());
    assert_eq!(s.committable_for(0), Some(0), "the stale marker is acknowledged, not kept");
}

#[test]
fn a_failed_task_does_nothing_more() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.fail("process error: boom");
    assert!(matches!(s.next_op(now()), Op::NoOp));
    assert_eq!(s.failure(), Some("process error: boom"));
}

#[test]
fn callbacks_past_their_timeout_are_reported() {
    let mut s = task(2, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Data, "b");
    let t0 = now();
    let a = match s.next_op(t0) {
        Op::Process(p) => p,
        other => panic!("{other:?}"),
    };
    let b = match s.next_op(t0 + Duration::from_secs(5)) {
        Op::Process(p) => p,
        other => panic!("{other:?}"),
    };
    assert_eq!(s.timed_out(t0 + Duration::from_secs(9), Duration::from_secs(10)), Vec::<u64>::new());
    assert_eq!(s.timed_out(t0 + Duration::from_secs(10), Duration::from_secs(10)), vec![a.order]);
    s.done(a.order);
    assert_eq!(s.timed_out(t0 + Duration::from_secs(16), Duration::from_secs(10)), vec![b.order]);
}

#[test]
fn timers_run_between_messages() {
    let mut s = task(1, false);
    s.insert(0, EnvelopeKind::Data, "a");
    s.insert(0, EnvelopeKind::Data, "b");
    let a = expect_process(&mut s);
    s.request_timer();
    assert!(matches!(s.next_op(now()), Op::NoOp), "timer waits for a");
    s.done(a.order);
    s.request_window();
    assert!(matches!(s.next_op(now()), Op::Window), "window before timer");
    s.window_done();
    assert!(matches!(s.next_op(now()), Op::Timer));
    assert!(matches!(s.next_op(now()), Op::NoOp), "timer blocks process");
    s.timer_done();
    assert_eq!(expect_process(&mut s).msg, "b");
}

#[test]
fn paused_intake_starts_nothing_but_steps_exactly_one_at_a_time() {
    let mut s = task(4, false);
    for m in ["a", "b", "c"] {
        s.insert(0, EnvelopeKind::Data, m);
    }
    s.pause();
    assert!(matches!(s.next_op(now()), Op::NoOp), "paused: nothing starts");
    s.request_commit();
    assert!(matches!(s.next_op(now()), Op::Commit), "commits still run while paused");
    s.commit_done(BTreeMap::new());
    assert!(s.step());
    assert_eq!(expect_process(&mut s).msg, "a");
    assert!(matches!(s.next_op(now()), Op::NoOp), "one step, one message");
    s.resume();
    assert!(!s.step(), "step does nothing when not paused");
    assert_eq!(expect_process(&mut s).msg, "b");
    assert_eq!(expect_process(&mut s).msg, "c");
}
