//! The window's invariants, in memory: unit tests and properties.
use std::collections::BTreeMap;

use proptest::prelude::*;
use store::{BranchId, RunId, TenantId};

use super::*;

fn branch(name: &str) -> BranchKey {
    BranchKey::new(
        TenantId::new("t").unwrap(),
        RunId::new("r").unwrap(),
        BranchId::new(name).unwrap(),
    )
}

fn key(name: &str, lsn: u64) -> EventKey {
    EventKey {
        branch: branch(name),
        lsn: Lsn::new(lsn),
    }
}

fn config(max_batches: usize, park_after_attempts: u32) -> WindowConfig {
    WindowConfig {
        max_batches,
        park_after_attempts,
        nack_grace: Duration::ZERO,
        retry: RetryPolicy {
            min: Duration::from_millis(100),
            max: Duration::from_secs(1),
        },
        express_max_events: 2,
    }
}

const SHARD: ShardId = ShardId(0);

/// Opens a batch of `keys`, all sent to one publisher, and answers it with `outcomes`.
fn answered(window: &mut Window<()>, keys: &[EventKey], outcomes: &[Outcome]) -> BatchId {
    let id = sent(window, keys);
    window.confirmed(id, SHARD, outcomes.to_vec());
    id
}

fn sent(window: &mut Window<()>, keys: &[EventKey]) -> BatchId {
    let lane = window.lane_for(keys.len(), 0);
    let id = window.open(keys.to_vec(), vec![Utc::now(); keys.len()], lane, ());
    window.dispatched(id, SHARD, Dispatch::Sent, (0..keys.len()).collect());
    id
}

use Outcome::{Accepted, Nacked, NoRoom, NotSent, Returned, TooLarge, Unconfirmed};

/// An event of branch `a` goes unanswered and its batch settles: the tenant backs off, by
/// this delay.
fn backs_off(window: &mut Window<()>, now: Instant) -> Duration {
    answered(window, &[key("a", 1)], &[Unconfirmed]);
    let Some(Settlement {
        next: Next::Retry(delay),
        ..
    }) = window.settle(now)
    else {
        panic!("the tenant backs off");
    };
    delay
}

/// A tenant that backed off through an outage (its retry grown to the policy's longest)
/// drains at once when the broker is back, with its backoff started over; a tenant that is
/// not backing off, or a cooling branch (a refusal, not an outage), is left as it was.
#[test]
fn the_broker_back_ends_a_tenants_backoff_and_only_that() {
    let now = Instant::now();
    let mut window = Window::new(config(1, 5));
    assert!(!window.resume(), "nothing to resume while flowing");
    let mut delay = Duration::ZERO;
    for _ in 0..6 {
        delay = backs_off(&mut window, now);
        window.handle_timeout(now + delay);
    }
    assert!(delay >= Duration::from_millis(500), "grown: {delay:?}");
    answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
    window.settle(now).unwrap();
    assert!(!window.may_start());
    assert!(window.resume(), "the broker is back: drain now");
    assert!(window.may_start());
    assert_eq!(window.poll_timeout(), None, "its retry is gone");
    assert!(!window.resume(), "once");
    // Its backoff starts over: the next failure waits about the shortest delay.
    let next = backs_off(&mut window, now);
    // (The policy's shortest, 100 ms, plus at most as much jitter.)
    assert!(next <= Duration::from_millis(200), "{next:?}");

    // A refused branch cools on its own timer, which the broker's return leaves.
    let mut window = Window::new(config(1, 5));
    answered(&mut window, &[key("b", 1)], &[Nacked]);
    let settled = window.settle(now).unwrap();
    assert_eq!(settled.refusals.len(), 1);
    let cooling = window.poll_timeout();
    assert!(cooling.is_some());
    assert!(!window.resume());
    assert_eq!(window.poll_timeout(), cooling);
}

/// A tenant whose batches go unanswered is named once its stall has lasted
/// [`STALL_NOTICE_AFTER`] (with why), once more when it ships again, and never for a short
/// outage.
#[test]
fn a_long_stall_is_told_once_and_its_end_once_a_short_one_never() {
    let start = Instant::now();
    let mut window = Window::new(config(1, 5));
    let fail = |window: &mut Window<()>, at: Duration, outcome| {
        answered(window, &[key("a", 1)], &[outcome]);
        let settled = window.settle(start + at).unwrap();
        window.resume();
        settled.stall
    };
    // A short outage: failures, then a confirm within the notice's delay.
    assert_eq!(fail(&mut window, Duration::ZERO, Unconfirmed), None);
    assert_eq!(fail(&mut window, Duration::from_secs(2), NotSent), None);
    answered(&mut window, &[key("a", 1)], &[Accepted]);
    let settled = window.settle(start + Duration::from_secs(3)).unwrap();
    assert_eq!(settled.stall, None, "short: nothing said");

    // A long one: told once, past the delay, with the latest cause.
    let at = |secs| Duration::from_secs(secs);
    assert_eq!(fail(&mut window, at(10), Unconfirmed), None);
    assert_eq!(fail(&mut window, at(13), NotSent), None);
    assert_eq!(
        fail(&mut window, at(15), NotSent),
        Some(StallNotice::Waiting {
            waited: at(5),
            failures: 3,
            cause: StallCause::NotSent
        })
    );
    assert_eq!(fail(&mut window, at(20), Unconfirmed), None, "once");
    // A settlement with nothing shipped ends nothing.
    answered(&mut window, &[key("a", 1)], &[Nacked]);
    assert_eq!(window.settle(start + at(21)).unwrap().stall, None);
    answered(&mut window, &[key("b", 1)], &[Accepted]);
    assert_eq!(
        window.settle(start + at(22)).unwrap().stall,
        Some(StallNotice::Shipping {
            waited: at(12),
            failures: 4
        })
    );
    answered(&mut window, &[key("b", 2)], &[Accepted]);
    assert_eq!(window.settle(start + at(23)).unwrap().stall, None, "once");
}

/// The window's one timer table: the tenant's retry, a cooling branch's retry and the idle
/// check each wake the drainer when due, not before, and for what is due.
#[test]
fn the_window_owns_its_timers_and_wakes_the_drainer_for_what_is_due() {
    let now = Instant::now();
    let mut window = Window::new(config(1, 5));
    assert_eq!(window.poll_timeout(), None);
    // A session failure: the tenant backs off, its retry is the one timer.
    let delay = backs_off(&mut window, now);
    assert_eq!(window.poll_timeout(), Some(now + delay));
    assert!(!window.may_start());
    let early = window.handle_timeout(now + delay - Duration::from_millis(1));
    assert_eq!(early, Woken::Nothing, "nothing before it is due");
    let due = window.handle_timeout(now + delay);
    assert_eq!(due, Woken::Drain);
    assert!(window.may_start(), "the retry ends the backoff");
    assert_eq!(window.poll_timeout(), None);
    // A refusal: its branch's retry wakes the drainer to drain again.
    answered(&mut window, &[key("b", 1)], &[Nacked]);
    let settled = window.settle(now).unwrap();
    let RefusalAction::RetryAfter(delay) = settled.refusals[0].action else {
        panic!("the branch cools");
    };
    assert_eq!(window.poll_timeout(), Some(now + delay));
    assert_eq!(window.handle_timeout(now + delay), Woken::Drain);
}

/// A branch refused again before its retry keeps one retry timer, at its newest deadline;
/// another branch's refusal keeps its own.
#[test]
fn a_branch_refused_again_keeps_one_retry_at_its_newest_deadline() {
    let retry = |window: &mut Window<()>, at: Instant| {
        let settled = window.settle(at).unwrap();
        let RefusalAction::RetryAfter(delay) = settled.refusals[0].action else {
            panic!("the branch cools");
        };
        at + delay
    };
    let now = Instant::now();
    let mut window = Window::new(config(2, 5));
    answered(&mut window, &[key("b", 1)], &[Nacked]);
    let first = retry(&mut window, now);
    assert_eq!(window.poll_timeout(), Some(first));
    let later = now + Duration::from_millis(1);
    answered(&mut window, &[key("b", 1)], &[Nacked]);
    let second = retry(&mut window, later);
    assert_eq!(window.timers(), 1, "one retry per branch");
    assert_eq!(window.poll_timeout(), Some(second));
    answered(&mut window, &[key("c", 1)], &[Nacked]);
    let other = retry(&mut window, later);
    assert_eq!(window.timers(), 2);
    assert_eq!(window.poll_timeout(), Some(second.min(other)));
}

#[test]
fn an_idle_spell_keeps_one_check_and_a_busy_one_retires_nothing() {
    let now = Instant::now();
    let idle = Duration::from_secs(30);
    let mut window: Window<()> = Window::new(config(1, 5));
    window.idle(now, idle);
    // Checked again and again in the same spell: one timer, the first deadline.
    for later in 1..100 {
        window.idle(now + Duration::from_millis(later), idle);
    }
    assert_eq!(window.timers(), 1);
    assert_eq!(window.poll_timeout(), Some(now + idle));
    assert_eq!(window.handle_timeout(now + idle), Woken::Retire);
    // A batch opened in between: the old spell's check cannot retire the drainer, and a
    // new spell's check replaces it.
    window.idle(now, idle);
    answered(&mut window, &[key("a", 1)], &[Accepted]);
    window.settle(now).unwrap();
    assert_ne!(
        window.handle_timeout(now + idle),
        Woken::Retire,
        "busy since"
    );
    window.idle(now, idle);
    answered(&mut window, &[key("a", 2)], &[Accepted]);
    window.settle(now).unwrap();
    window.idle(now + idle, idle);
    assert_eq!(window.timers(), 1, "the older spell's check went");
    assert_eq!(window.poll_timeout(), Some(now + idle + idle));
    assert_eq!(window.handle_timeout(now + idle + idle), Woken::Retire);
}

#[test]
fn the_prefix_rule_holds_across_the_window() {
    let mut window = Window::new(config(2, 5));
    answered(
        &mut window,
        &[key("a", 1), key("a", 2), key("a", 3), key("b", 1)],
        &[Accepted, Nacked, Accepted, Accepted],
    );
    answered(
        &mut window,
        &[key("a", 4), key("b", 2)],
        &[Accepted, Accepted],
    );
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.acks, vec![key("a", 1), key("b", 1), key("b", 2)]);
    assert_eq!(settled.failed, 3);
    assert_eq!(settled.refusals.len(), 1);
    assert_eq!(settled.refusals[0].branch, branch("a"));
}

#[test]
fn batches_settle_in_the_order_they_opened() {
    let mut window = Window::new(config(2, 5));
    let first = sent(&mut window, &[key("a", 1)]);
    answered(&mut window, &[key("a", 2)], &[Accepted]);
    assert!(
        window.settle(Instant::now()).is_none(),
        "the first is unanswered"
    );
    window.confirmed(first, SHARD, vec![Accepted]);
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.acks, vec![key("a", 1), key("a", 2)]);
    assert!(window.is_empty());
}

/// The mutation "a failing branch blocks its tenant" fails here.
#[test]
fn a_refused_branch_cools_alone_while_its_tenant_flows() {
    let mut window = Window::new(config(1, 5));
    let now = Instant::now();
    answered(
        &mut window,
        &[key("bad", 1), key("bad", 2), key("good", 1)],
        &[Returned, Accepted, Accepted],
    );
    let settled = window.settle(now).unwrap();
    assert_eq!(settled.acks, vec![key("good", 1)]);
    assert_eq!(settled.next, Next::Flow);
    assert!(window.may_start(), "the tenant keeps draining");
    let [refusal] = settled.refusals.as_slice() else {
        panic!("one refusal: {:?}", settled.refusals)
    };
    assert_eq!(refusal.reason, "returned");
    let RefusalAction::RetryAfter(delay) = refusal.action else {
        panic!("retried, not parked: {refusal:?}")
    };
    // The next drain skips the cooling branch until its retry is due, and only it.
    let skip = window.skip(now);
    assert_eq!(skip.len(), 1);
    assert_eq!(skip[0].branch, branch("bad"));
    assert!(window.skip(now + delay).is_empty());
}

#[test]
fn a_branch_refused_again_and_again_parks_and_an_accepted_event_forgives_it() {
    let mut window = Window::new(config(1, 3));
    let now = Instant::now();
    for attempt in 1..=2 {
        answered(&mut window, &[key("bad", 1)], &[Nacked]);
        let settled = window.settle(now).unwrap();
        assert_eq!(settled.refusals[0].attempts, attempt);
        assert!(matches!(
            settled.refusals[0].action,
            RefusalAction::RetryAfter(_)
        ));
    }
    // One success starts the count over.
    answered(&mut window, &[key("bad", 1)], &[Accepted]);
    window.settle(now).unwrap();
    for _ in 1..=2 {
        answered(&mut window, &[key("bad", 2)], &[Nacked]);
        window.settle(now).unwrap();
    }
    answered(&mut window, &[key("bad", 2)], &[Nacked]);
    let later = now + Duration::from_secs(4);
    let settled = window.settle(later).unwrap();
    assert_eq!(settled.refusals[0].attempts, 3);
    assert_eq!(
        settled.refusals[0].action,
        RefusalAction::Park {
            failing_for: Duration::from_secs(4)
        }
    );
    // Parked branches are skipped by the store, not by the window.
    assert!(window.skip(later).is_empty());
}

/// A message the broker refused for its size is a refusal of its branch (reason
/// `too_large`): the branch cools alone, its tenant's other branches are acked and flow.
#[test]
fn a_message_too_large_for_the_broker_cools_its_branch_alone() {
    let mut window = Window::new(config(1, 5));
    answered(
        &mut window,
        &[key("big", 1), key("ok", 1)],
        &[TooLarge, Accepted],
    );
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.acks, [key("ok", 1)]);
    assert_eq!(settled.refusals.len(), 1);
    assert_eq!(settled.refusals[0].branch, branch("big"));
    assert_eq!(settled.refusals[0].reason, "too_large");
    assert_eq!(settled.next, Next::Flow);
    assert_eq!(window.phase(), Phase::Flowing);
}

/// The broker closes the channel at a message too large for it: the events before it are
/// left unconfirmed, yet the refusal still counts against its branch (else it would never
/// cool or park, and its tenant would back off on it for ever).
#[test]
fn a_refusal_behind_an_unconfirmed_event_of_its_branch_still_counts() {
    let mut window = Window::new(config(1, 5));
    answered(
        &mut window,
        &[key("big", 1), key("big", 2), key("ok", 1)],
        &[Unconfirmed, TooLarge, Unconfirmed],
    );
    let settled = window.settle(Instant::now()).unwrap();
    assert!(settled.acks.is_empty());
    assert_eq!(settled.refusals.len(), 1);
    assert_eq!(settled.refusals[0].branch, branch("big"));
    assert_eq!(settled.refusals[0].reason, "too_large");
    assert!(
        matches!(settled.next, Next::Retry(_)),
        "the session failed too"
    );
}

#[test]
fn an_unanswered_event_backs_the_tenant_off_once_the_window_is_empty() {
    let mut window = Window::new(config(2, 5));
    let lost = sent(&mut window, &[key("a", 1), key("b", 1)]);
    let later = sent(&mut window, &[key("c", 1)]);
    // The publisher died with both: each batch's dropped reply answers it, empty.
    window.confirmed(lost, SHARD, Vec::new());
    window.confirmed(later, SHARD, Vec::new());
    // Both settle, nothing acked.
    let settled = window.settle(Instant::now()).unwrap();
    assert!(settled.acks.is_empty());
    assert!(matches!(settled.next, Next::Retry(_)));
    assert_eq!(window.phase(), Phase::BackingOff);
    assert!(!window.may_start());
    assert!(window.is_answered(lost) && window.is_answered(later));
    window.handle_timeout(Instant::now() + Duration::from_secs(10));
    assert!(window.may_start());
}

#[test]
fn a_failed_window_waits_for_its_later_batches_before_backing_off() {
    let mut window = Window::new(config(2, 5));
    answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
    let second = sent(&mut window, &[key("a", 2), key("b", 1)]);
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.next, Next::Wait);
    assert!(!window.may_start(), "no new batch after a session failure");
    window.confirmed(second, SHARD, Vec::new());
    let settled = window.settle(Instant::now()).unwrap();
    assert!(settled.acks.is_empty());
    assert!(matches!(settled.next, Next::Retry(_)));
}

#[test]
fn a_part_that_could_not_be_sent_is_not_sent() {
    let mut window = Window::new(config(1, 5));
    let id = window.open(
        vec![key("a", 1), key("b", 1)],
        vec![Utc::now(); 2],
        Lane::Bulk,
        (),
    );
    window.dispatched(id, ShardId(0), Dispatch::NotSent, vec![0]);
    window.dispatched(id, ShardId(1), Dispatch::Sent, vec![1]);
    assert!(!window.is_answered(id));
    window.confirmed(id, ShardId(1), vec![Accepted]);
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.acks, vec![key("b", 1)]);
    assert!(matches!(settled.next, Next::Retry(_)));
    let _ = NotSent;
}

#[test]
fn shutdown_stops_once_the_window_is_empty() {
    let mut window = Window::new(config(2, 5));
    let first = sent(&mut window, &[key("a", 1)]);
    window.finish();
    assert!(!window.may_start() && !window.finished());
    window.confirmed(first, SHARD, vec![Accepted]);
    let settled = window.settle(Instant::now()).unwrap();
    assert_eq!(settled.acks, vec![key("a", 1)]);
    assert_eq!(settled.next, Next::Stop);
    assert!(window.finished());
}

#[test]
fn an_idle_check_sees_any_batch_opened_since() {
    let mut window = Window::new(config(1, 5));
    let activity = window.activity();
    assert!(window.idle_since(activity));
    answered(&mut window, &[key("a", 1)], &[Accepted]);
    window.settle(Instant::now()).unwrap();
    assert!(!window.idle_since(activity));
    assert!(window.idle_since(window.activity()));
}

/// A quiet tenant's small batch takes the express lane; a large one, or any batch while
/// another of the tenant is in flight on the other lane, does not switch lanes.
#[test]
fn small_batches_take_the_express_lane_but_never_beside_a_bulk_batch() {
    let mut window = Window::new(config(3, 5));
    assert_eq!(window.lane_for(1, 100), Lane::Express);
    assert_eq!(
        window.lane_for(3, 100),
        Lane::Bulk,
        "over express_max_events"
    );
    assert_eq!(window.lane_for(1, EXPRESS_MAX_BYTES + 1), Lane::Bulk);
    let big = sent(&mut window, &[key("a", 1), key("a", 2), key("a", 3)]);
    assert_eq!(
        window.lane_for(1, 1),
        Lane::Bulk,
        "sticks to the lane in flight"
    );
    window.confirmed(big, SHARD, vec![Accepted; 3]);
    window.settle(Instant::now()).unwrap();
    let small = sent(&mut window, &[key("a", 4)]);
    assert_eq!(
        window.lane_for(3, 1),
        Lane::Express,
        "sticks to the lane in flight"
    );
    window.confirmed(small, SHARD, vec![Accepted]);
    window.settle(Instant::now()).unwrap();
    let mut no_lane = Window::<()>::new(WindowConfig {
        express_max_events: 0,
        ..config(1, 5)
    });
    assert_eq!(no_lane.lane_for(1, 1), Lane::Bulk);
    let _ = &mut no_lane;
}

/// A tenant with a few intents reserves a small share of the budgets; one whose drain came
/// back full reserves a whole batch until a drain comes back short.
#[test]
fn a_full_drain_reserves_a_whole_batch_next_time() {
    let mut window = Window::<()>::new(config(1, 5));
    assert_eq!(window.reservation(1000, 4 << 20), (32, 256 << 10));
    assert_eq!(
        window.reservation(10, 1024),
        (10, 1024),
        "never above the batch"
    );
    window.drained(32, 32, 100, 256 << 10);
    assert_eq!(window.reservation(1000, 4 << 20), (1000, 4 << 20));
    window.drained(3, 1000, 100, 4 << 20);
    assert_eq!(window.reservation(1000, 4 << 20), (32, 256 << 10));
    window.drained(1, 32, 300 << 10, 256 << 10);
    assert_eq!(
        window.reservation(1000, 4 << 20),
        (1000, 4 << 20),
        "bytes filled"
    );
}

fn any_outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        6 => Just(Accepted),
        1 => Just(Nacked),
        1 => Just(Returned),
        1 => Just(TooLarge),
        1 => Just(Unconfirmed),
        1 => Just(NotSent),
    ]
}

proptest! {
    /// Over any outcomes in any window: per branch, what is acked is a prefix of what was
    /// sent, made only of accepted events; everything else is left pending.
    #[test]
    fn acks_are_accepted_prefixes_of_each_branch(
        batches in prop::collection::vec(
            prop::collection::vec((0..3usize, any_outcome()), 1..6), 1..5),
    ) {
        let mut window = Window::new(config(batches.len(), 100));
        let mut next_lsn = [1u64; 3];
        let mut sent_by_branch: BTreeMap<usize, Vec<(u64, Outcome)>> = BTreeMap::new();
        for batch in &batches {
            let keys: Vec<EventKey> = batch.iter().map(|(b, _)| {
                let lsn = next_lsn[*b];
                next_lsn[*b] += 1;
                key(&format!("b{b}"), lsn)
            }).collect();
            for ((b, outcome), key) in batch.iter().zip(&keys) {
                sent_by_branch.entry(*b).or_default().push((key.lsn.get(), *outcome));
            }
            let outcomes: Vec<Outcome> = batch.iter().map(|(_, o)| *o).collect();
            answered(&mut window, &keys, &outcomes);
        }
        let settled = window.settle(Instant::now()).unwrap();
        prop_assert!(window.is_empty());
        for (b, sent) in sent_by_branch {
            let acked: Vec<u64> = settled.acks.iter()
                .filter(|k| k.branch == branch(&format!("b{b}")))
                .map(|k| k.lsn.get())
                .collect();
            let prefix: Vec<u64> = sent.iter()
                .take_while(|(_, outcome)| *outcome == Accepted)
                .map(|(lsn, _)| *lsn)
                .collect();
            prop_assert_eq!(acked, prefix);
        }
    }
}

/// A quorum queue nacks while it elects a leader (RabbitMQ 3.10 also nacks a new channel's
/// first publishes to it until it finds the new leader): a branch nacked again and again is
/// retried alone, not parked, until the nacks have lasted the grace; a returned event (no
/// queue took it: an operator must act) parks after the attempts alone. In the cluster test,
/// 13 branches once parked for a minute after five nacks in 0.6 s of a leader change.
#[test]
fn nacks_park_a_branch_only_once_they_have_lasted_the_grace() {
    let grace = Duration::from_secs(30);
    let mut window = Window::new(WindowConfig {
        nack_grace: grace,
        ..config(1, 3)
    });
    let start = Instant::now();
    for attempt in 1..=10u32 {
        answered(&mut window, &[key("electing", 1)], &[Nacked]);
        let at = start + Duration::from_secs(u64::from(attempt));
        let settled = window.settle(at).unwrap();
        assert!(
            matches!(settled.refusals[0].action, RefusalAction::RetryAfter(_)),
            "attempt {attempt}: {:?}",
            settled.refusals[0]
        );
    }
    answered(&mut window, &[key("electing", 1)], &[Nacked]);
    // The first nack was at start + 1 s.
    let settled = window
        .settle(start + Duration::from_secs(1) + grace)
        .unwrap();
    assert!(matches!(
        settled.refusals[0].action,
        RefusalAction::Park { .. }
    ));

    let mut window = Window::new(WindowConfig {
        nack_grace: grace,
        ..config(1, 3)
    });
    for attempt in 1..=3u32 {
        answered(&mut window, &[key("unrouted", 1)], &[Returned]);
        let settled = window.settle(start).unwrap();
        assert_eq!(
            matches!(settled.refusals[0].action, RefusalAction::Park { .. }),
            attempt == 3
        );
    }
}

/// A broker with no room for an event (NATS: the stream at its limits, the server's store
/// full) refuses every branch until room is made: each branch is retried alone on its backoff
/// and never parked, however long the refusals last, so all of them ship again with no
/// operator releasing each. Its first accepted event ends the cooling.
#[test]
fn a_broker_with_no_room_never_parks_a_branch() {
    let mut window = Window::new(WindowConfig {
        nack_grace: Duration::ZERO,
        ..config(1, 3)
    });
    let start = Instant::now();
    for attempt in 1..=50u32 {
        answered(&mut window, &[key("full", 1)], &[NoRoom]);
        let settled = window
            .settle(start + Duration::from_secs(u64::from(attempt) * 60))
            .unwrap();
        assert_eq!(settled.refusals[0].reason, "no_room");
        assert_eq!(settled.refusals[0].attempts, attempt);
        assert!(
            matches!(settled.refusals[0].action, RefusalAction::RetryAfter(_)),
            "attempt {attempt}: {:?}",
            settled.refusals[0]
        );
    }
    // Another cause after it starts its own run: a nack is not parked at once for the
    // attempts the full store made.
    answered(&mut window, &[key("full", 1)], &[Nacked]);
    let settled = window.settle(start + Duration::from_secs(3_500)).unwrap();
    assert_eq!(settled.refusals[0].attempts, 1);
    assert!(matches!(
        settled.refusals[0].action,
        RefusalAction::RetryAfter(_)
    ));
    answered(&mut window, &[key("full", 1)], &[Accepted]);
    let settled = window.settle(start + Duration::from_secs(3_600)).unwrap();
    assert_eq!(settled.acks, [key("full", 1)]);
    answered(&mut window, &[key("full", 2)], &[NoRoom]);
    let settled = window.settle(start + Duration::from_secs(3_601)).unwrap();
    assert_eq!(settled.refusals[0].attempts, 1, "a new run of refusals");
}
