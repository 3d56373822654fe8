//! The supervisor's decisions, tested without actors, sockets or clocks: fake child handles,
//! made-up instants, and a fake tree that performs the commands.
use std::collections::{BTreeMap, BTreeSet, HashSet};

use proptest::prelude::*;
use store::LeaseEpoch;

use super::leases::LeasesAt;
use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Fake(u64);

impl Handle for Fake {
    type Id = u64;
    fn id(&self) -> u64 {
        self.0
    }
}

fn tenant(name: &str) -> TenantId {
    TenantId::new(name).expect("valid id")
}

/// `count` tenants that all fall in different buckets, with their buckets.
fn tenants_in_distinct_buckets(count: usize) -> Vec<TenantId> {
    let mut seen = HashSet::new();
    (0..)
        .map(|n| tenant(&format!("t{n}")))
        .filter(|tenant| seen.insert(bucket_of(tenant)))
        .take(count)
        .collect()
}

fn config(max_drainers: usize) -> CoreConfig {
    CoreConfig {
        publishers: 2,
        max_drainers,
        restart: RetryPolicy {
            min: Duration::from_millis(100),
            max: Duration::from_secs(5),
        },
        finish_grace: Duration::from_secs(10),
        broker_check: Some(Duration::from_millis(500)),
        // Beats far apart: a test that wants one asks for it ([`Leasing::beat`]).
        lease: LeaseConfig {
            ttl: Duration::from_secs(3 * 3_600),
            heartbeat: Duration::from_secs(3_600),
        },
    }
}

/// The earliest timer other than the heartbeat's.
fn due(core: &Core<Fake>) -> Option<Instant> {
    core.timers
        .iter()
        .filter(|(timer, _)| **timer != Timer::LeaseBeat)
        .map(|(_, at)| at)
        .min()
}

/// The lease tables as the core's calls find them, and the fence cells as the actor writes
/// them; answers each call at once. Only `offered` buckets can be claimed; one released goes
/// to another relay.
#[derive(Debug, Default)]
struct Leasing {
    /// Rows held by this relay, with their epochs.
    mine: BTreeMap<Bucket, LeaseEpoch>,
    /// Free rows (claimable), with their last epochs.
    free: BTreeMap<Bucket, LeaseEpoch>,
    members: u32,
    /// PostgreSQL does not answer.
    down: bool,
    /// Fence cells: epoch and until, per bucket (a closed one is removed).
    fences: BTreeMap<Bucket, (LeaseEpoch, Instant)>,
    released: Vec<Bucket>,
    /// Release calls carried out.
    release_calls: usize,
}

impl Leasing {
    fn offering(buckets: impl IntoIterator<Item = Bucket>) -> Self {
        Self {
            free: buckets
                .into_iter()
                .map(|bucket| (bucket, LeaseEpoch(0)))
                .collect(),
            members: 1,
            ..Self::default()
        }
    }

    /// Another relay takes `bucket` over (its epoch moves on).
    fn steal(&mut self, bucket: Bucket) {
        self.mine.remove(&bucket);
        self.free.remove(&bucket);
    }

    /// `bucket` becomes claimable.
    fn offer(&mut self, bucket: Bucket) {
        if !self.mine.contains_key(&bucket) {
            self.free.entry(bucket).or_insert(LeaseEpoch(0));
        }
    }

    /// A beat now, whatever the heartbeat's timer says (the core must be between beats).
    fn beat(&mut self, core: &mut Core<Fake>, now: Instant) {
        assert_eq!(core.leases.stage, leases::LeaseStage::Waiting);
        core.timers.stop(&Timer::LeaseBeat);
        core.beat(leases::Beat::Later, now);
    }

    /// Carries out `command` if it is the leases' (answering calls at once), checking that a
    /// fence is closed before its bucket is released; returns any other command.
    fn carry(
        &mut self,
        core: &mut Core<Fake>,
        command: Command<Fake>,
        now: Instant,
    ) -> Option<Command<Fake>> {
        match command {
            Command::Lease(LeaseCall::Beat { held }) => {
                let (members, renewed) = if self.down {
                    (None, None)
                } else {
                    let renewed = held
                        .into_iter()
                        .filter(|(bucket, epoch)| self.mine.get(bucket) == Some(epoch))
                        .collect();
                    let sent = now;
                    (
                        Some(self.members),
                        Some(LeasesAt {
                            leases: renewed,
                            sent,
                        }),
                    )
                };
                core.lease_beaten(members, renewed, false, now);
            }
            Command::Lease(LeaseCall::Claim(n)) => {
                let claimed = (!self.down).then(|| {
                    let chosen: Vec<Bucket> =
                        self.free.keys().take(usize::from(n)).copied().collect();
                    chosen
                        .into_iter()
                        .map(|bucket| {
                            let epoch =
                                LeaseEpoch(self.free.remove(&bucket).map_or(0, |e| e.0) + 1);
                            self.mine.insert(bucket, epoch);
                            (bucket, epoch)
                        })
                        .collect()
                });
                let claimed = claimed.map(|leases| LeasesAt { leases, sent: now });
                core.lease_claimed(claimed, now);
            }
            Command::Lease(LeaseCall::Release(leases)) => {
                self.release_calls += 1;
                for (bucket, epoch) in leases {
                    assert!(
                        !self.fences.contains_key(&bucket),
                        "{bucket:?} released before its fence closed"
                    );
                    if !self.down && self.mine.get(&bucket) == Some(&epoch) {
                        self.mine.remove(&bucket);
                    }
                    self.released.push(bucket);
                }
            }
            Command::OpenFence { bucket, held } => {
                self.fences.insert(bucket, (held.epoch, held.until));
            }
            Command::ExtendFences { buckets, until } => {
                for bucket in buckets {
                    if let Some((_, at)) = self.fences.get_mut(&bucket) {
                        *at = (*at).max(until);
                    }
                }
            }
            Command::CloseFence(bucket) => {
                self.fences.remove(&bucket);
            }
            Command::PollNow => {}
            other => return Some(other),
        }
        None
    }

    /// Whether `bucket`'s fence is open at `now`.
    fn open(&self, bucket: Bucket, now: Instant) -> bool {
        self.fences
            .get(&bucket)
            .is_some_and(|(_, until)| now < *until)
    }
}

/// A bare core holding `buckets` (its lease calls answered; every other command dropped).
fn core_holding(
    max_drainers: usize,
    buckets: impl IntoIterator<Item = Bucket>,
) -> (Core<Fake>, Leasing) {
    let now = Instant::now();
    let mut core = Core::new(config(max_drainers));
    let mut leasing = Leasing::offering(buckets);
    core.start_leases(now);
    while let Some(command) = core.poll() {
        leasing.carry(&mut core, command, now);
    }
    (core, leasing)
}

/// Performs what the core commands like the actor would, every spawn succeeding, and returns
/// what it did besides spawning.
struct Tree {
    core: Core<Fake>,
    next_id: u64,
    /// Running fake drainers: id -> tenant.
    drainers: BTreeMap<u64, TenantId>,
    publishers: BTreeMap<u16, u64>,
    done: Vec<Command<Fake>>,
    /// What the core told, as the actor takes it after each event.
    notes: Vec<Note>,
    leasing: Leasing,
}

impl Tree {
    fn new(max_drainers: usize) -> Self {
        let mut tree = Self {
            core: Core::new(config(max_drainers)),
            next_id: 0,
            drainers: BTreeMap::new(),
            publishers: BTreeMap::new(),
            done: Vec::new(),
            notes: Vec::new(),
            leasing: Leasing::default(),
        };
        tree.perform(Instant::now());
        tree
    }

    /// A tree holding a lease on each of `buckets` (claimed by its first heartbeat).
    fn holding(max_drainers: usize, buckets: impl IntoIterator<Item = Bucket>) -> Self {
        let now = Instant::now();
        let mut tree = Self::new(max_drainers);
        tree.leasing = Leasing::offering(buckets);
        tree.core.start_leases(now);
        tree.perform(now);
        tree
    }

    /// A heartbeat now.
    fn beat(&mut self, now: Instant) {
        self.leasing.beat(&mut self.core, now);
        self.perform(now);
    }

    fn perform(&mut self, now: Instant) {
        while let Some(command) = self.core.poll() {
            let Some(command) = self.leasing.carry(&mut self.core, command, now) else {
                continue;
            };
            match command {
                Command::SpawnDrainer { tenant } => {
                    assert!(
                        self.leasing.open(bucket_of(&tenant), now),
                        "a drainer starts under an open fence"
                    );
                    self.next_id += 1;
                    self.drainers.insert(self.next_id, tenant.clone());
                    self.core.drainer_started(tenant, Fake(self.next_id), now);
                }
                Command::SpawnPublisher(shard) => {
                    self.next_id += 1;
                    self.publishers.insert(shard.0, self.next_id);
                    self.core.publisher_started(shard, self.next_id);
                }
                Command::Kill(Fake(id)) => {
                    self.drainers.remove(&id);
                    self.done.push(Command::Kill(Fake(id)));
                }
                other => self.done.push(other),
            }
        }
        self.notes
            .extend(std::iter::from_fn(|| self.core.poll_note()));
    }

    fn take(&mut self) -> Vec<Command<Fake>> {
        std::mem::take(&mut self.done)
    }

    fn drainer_of(&self, tenant: &TenantId) -> Option<u64> {
        self.drainers
            .iter()
            .find(|(_, running)| *running == tenant)
            .map(|(id, _)| *id)
    }

    /// The drainer of `tenant` stops by itself.
    fn end(&mut self, tenant: &TenantId, orderly: bool, now: Instant) {
        let id = self.drainer_of(tenant).expect("a drainer runs");
        self.drainers.remove(&id);
        let why = if orderly { "idle" } else { "database down" };
        self.core
            .child_ended(id, why, orderly.then_some(actors::StopReason::Idle), now);
        self.perform(now);
    }
}

#[test]
fn every_publisher_starts_and_a_dead_one_restarts_after_its_backoff() {
    let now = Instant::now();
    let mut tree = Tree::new(10);
    assert_eq!(tree.publishers.len(), 2);
    let first = tree.publishers[&1];
    tree.core.child_ended(first, "connection lost", None, now);
    tree.perform(now);
    assert!(matches!(
        tree.take()[..],
        [Command::PublisherGone(ShardId(1))]
    ));
    let at = due(&tree.core).expect("a respawn is due");
    assert!(at >= now + Duration::from_millis(100) && at <= now + Duration::from_secs(10));
    tree.core.handle_timeout(at - Duration::from_millis(1));
    tree.perform(at);
    assert_eq!(tree.publishers[&1], first, "not before its backoff");
    tree.core.handle_timeout(at);
    tree.perform(at);
    assert_ne!(tree.publishers[&1], first);
    assert_eq!(tree.core.publisher_failures(ShardId(1)), 1);
    tree.core.publisher_healthy(ShardId(1));
    assert_eq!(tree.core.publisher_failures(ShardId(1)), 0);
    // The end of a child the core no longer knows (or never knew) changes nothing.
    tree.core.child_ended(first, "late", None, at);
    tree.core.child_ended(999, "unknown", None, at);
    tree.perform(at);
    assert!(tree.take().is_empty());
}

/// What an operator hears of is decided here, in order, as data (the actor only writes it to
/// logs and metrics, `tree::record`): the leases held, a drainer retired and one restarting
/// after its first failure, a publisher restarting, then recovered, which is the broker back.
#[test]
fn the_core_says_what_an_operator_is_told_and_the_actor_only_records_it() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(2);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    assert!(
        tree.notes
            .iter()
            .any(|note| matches!(note, Note::Leases { held: 2, .. })),
        "{:?}",
        tree.notes
    );
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    tree.notes.clear();
    tree.end(&tenants[0], true, now);
    tree.end(&tenants[1], false, now);
    let restart = due(&tree.core).expect("a restart is due");
    assert_eq!(
        tree.notes,
        [
            Note::DrainerStopped {
                tenant: tenants[0].clone(),
                reason: "idle".into(),
            },
            Note::DrainerRestarting {
                tenant: tenants[1].clone(),
                failures: 1,
                retry_in: restart - now,
                reason: "database down".into(),
            },
        ]
    );
    tree.notes.clear();
    let publisher = tree.publishers[&1];
    tree.core
        .child_ended(publisher, "connection lost", None, now);
    tree.perform(now);
    assert!(
        matches!(&tree.notes[..], [Note::PublisherRestarting { shard: ShardId(1), failures: 1, reason, .. }] if reason == "connection lost"),
        "{:?}",
        tree.notes
    );
    tree.notes.clear();
    tree.core.publisher_healthy(ShardId(1));
    tree.perform(now);
    assert_eq!(
        tree.notes,
        [Note::PublisherRecovered {
            shard: ShardId(1),
            failures: 1,
        }]
    );
}

/// A broker outage: both publishers fail again and again, so their restart delays grow. When
/// one of them has a publish confirmed again, the other restarts at once (not at its delay,
/// drawn while the broker was down) and every drainer is told to stop backing off.
#[test]
fn a_recovered_publisher_restarts_the_others_now_and_resumes_every_drainer() {
    let mut now = Instant::now();
    let tenants = tenants_in_distinct_buckets(2);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    for tenant in &tenants {
        tree.core.notified(tenant.clone(), now);
    }
    tree.perform(now);
    assert_eq!(tree.drainers.len(), 2);
    tree.take();
    for _ in 0..6 {
        let ended = [tree.publishers[&0], tree.publishers[&1]];
        for id in ended {
            tree.core
                .child_ended(id, "the broker session faulted", None, now);
        }
        tree.perform(now);
        // Both restart, each after its own delay.
        while ended.contains(&tree.publishers[&0]) || ended.contains(&tree.publishers[&1]) {
            now = due(&tree.core).expect("respawns are due");
            tree.core.handle_timeout(now);
            tree.perform(now);
        }
    }
    tree.take();
    // Shard 1 fails once more: its restart waits a grown delay.
    let id = tree.publishers[&1];
    tree.core
        .child_ended(id, "the broker session faulted", None, now);
    tree.perform(now);
    tree.take();
    let at = due(&tree.core).expect("shard 1's respawn is due");
    assert!(
        at >= now + Duration::from_millis(1_000),
        "grown: {:?}",
        at - now
    );
    // Shard 0 has a publish confirmed: the broker is back.
    tree.core.publisher_healthy(ShardId(0));
    tree.perform(now);
    assert_ne!(tree.publishers[&1], id, "shard 1 restarted at once");
    assert_eq!(tree.core.publisher_failures(ShardId(1)), 0);
    assert_eq!(due(&tree.core), None, "its timer is gone");
    let mut resumed: Vec<u64> = tree
        .take()
        .into_iter()
        .filter_map(|command| match command {
            Command::Resume(Fake(id)) => Some(id),
            _ => None,
        })
        .collect();
    resumed.sort_unstable();
    let mut running: Vec<u64> = tree.drainers.keys().copied().collect();
    running.sort_unstable();
    assert_eq!(resumed, running, "every drainer resumes");
    // A healthy publish without failures before it is no news.
    tree.core.publisher_healthy(ShardId(0));
    tree.perform(now);
    assert!(tree.take().is_empty());
}

/// While publishers wait out long restart delays, the broker is checked every 500 ms: a
/// check it fails is made again; one it answers restarts every publisher at once. A broker
/// that answers checks but fails publishes restarts no one again: a check after a later
/// failure that it answers too is no news, and its publishers keep their own backoff.
#[test]
fn the_broker_is_checked_while_publishers_wait_and_its_answer_restarts_them() {
    let mut now = Instant::now();
    let mut tree = Tree::new(10);
    let fail_both = |tree: &mut Tree, now: Instant| {
        let ended = [tree.publishers[&0], tree.publishers[&1]];
        for id in ended {
            tree.core
                .child_ended(id, "the broker session faulted", None, now);
        }
        tree.perform(now);
        ended
    };
    // Short delays first: no check (the respawns come sooner).
    let ended = fail_both(&mut tree, now);
    assert!(
        !tree
            .take()
            .iter()
            .any(|c| matches!(c, Command::CheckBroker))
    );
    while ended.contains(&tree.publishers[&0]) || ended.contains(&tree.publishers[&1]) {
        now = due(&tree.core).unwrap();
        tree.core.handle_timeout(now);
        tree.perform(now);
    }
    assert!(
        !tree
            .take()
            .iter()
            .any(|c| matches!(c, Command::CheckBroker))
    );
    // Grown delays: a check 500 ms after the failure, long before the respawns.
    for _ in 0..4 {
        let ended = fail_both(&mut tree, now);
        tree.take();
        let mut checks = 0;
        while ended.contains(&tree.publishers[&0]) || ended.contains(&tree.publishers[&1]) {
            now = due(&tree.core).unwrap();
            tree.core.handle_timeout(now);
            tree.perform(now);
            if tree
                .take()
                .iter()
                .any(|c| matches!(c, Command::CheckBroker))
            {
                checks += 1;
                // Still down.
                tree.core.broker_checked(false, now);
                tree.perform(now);
            }
        }
        assert!(checks <= 10, "{checks} checks");
    }
    let ended = fail_both(&mut tree, now);
    tree.take();
    // A check comes first: scheduled now, or still scheduled from the last failures (checks
    // go on while no publish has been confirmed since a failure).
    let check = due(&tree.core).unwrap();
    assert!(
        check <= now + Duration::from_millis(500),
        "the check comes first"
    );
    assert!(
        tree.core
            .timers
            .iter()
            .any(|(timer, at)| matches!(timer, Timer::CheckBroker) && at == check)
    );
    let waited_until = tree.core.timers.iter().map(|(_, at)| at).max().unwrap();
    assert!(waited_until >= now + Duration::from_secs(1), "grown delays");
    tree.core.handle_timeout(check);
    tree.perform(check);
    assert!(matches!(tree.take()[..], [Command::CheckBroker]));
    // The broker answers: both restart now.
    tree.core.broker_checked(true, check);
    tree.perform(check);
    assert!(!ended.contains(&tree.publishers[&0]) && !ended.contains(&tree.publishers[&1]));
    assert_eq!(due(&tree.core), None);
    // It fails their publishes again and again: their delays grow on their own backoff, and
    // the checks it answers restart no one.
    now = check;
    tree.notes.clear();
    let mut answered = 0;
    for _ in 0..6 {
        let ended = fail_both(&mut tree, now);
        tree.take();
        while ended.contains(&tree.publishers[&0]) || ended.contains(&tree.publishers[&1]) {
            now = due(&tree.core).unwrap();
            tree.core.handle_timeout(now);
            tree.perform(now);
            if tree
                .take()
                .iter()
                .any(|c| matches!(c, Command::CheckBroker))
            {
                answered += 1;
                let respawns = tree.core.timers.iter().count();
                tree.core.broker_checked(true, now);
                tree.perform(now);
                assert!(tree.take().is_empty(), "an answer again restarts no one");
                assert_eq!(tree.core.timers.iter().count(), respawns);
            }
        }
    }
    assert!(answered <= 6, "at most one check per failure: {answered}");
    assert!(!tree.notes.iter().any(|n| matches!(n, Note::BrokerAnswers)));
    let grown = tree.core.publisher_failures(ShardId(0));
    assert!(grown >= 6, "its own backoff: {grown} failures");
    // A confirmed publish: no longer in doubt, and the next answer after a failure is news.
    tree.core.publisher_healthy(ShardId(0));
    assert!(!tree.core.doubt && !tree.core.answered);
}

/// A drainer's retries from `from` for `span`: 100 ms doubling to 5 s.
fn drainer_retries(from: Instant, span: Duration) -> Vec<Instant> {
    let (mut at, mut retry) = (from, Duration::from_millis(100));
    std::iter::from_fn(|| {
        let this = at;
        at += retry;
        retry = (retry * 2).min(Duration::from_secs(5));
        Some(this)
    })
    .take_while(|at| *at < from + span)
    .collect()
}

/// Asserts no gap between `checks` beyond the check's interval.
fn assert_checked_every_interval(checks: &[Instant]) {
    for pair in checks.windows(2) {
        assert!(
            pair[1] - pair[0] <= Duration::from_millis(500),
            "{:?} without a check",
            pair[1] - pair[0]
        );
    }
}

impl Tree {
    /// A broker that takes no connections, under a drainer's `retries`: publisher 0 fails at
    /// each (it connects at its first publish), respawns and checks come between, each check
    /// answered `answer`. The checks' times.
    fn fail_at_retries(
        &mut self,
        now: &mut Instant,
        retries: &[Instant],
        answer: bool,
    ) -> Vec<Instant> {
        let mut checks = Vec::new();
        for fail_at in retries {
            while let Some(at) = due(&self.core).filter(|at| at <= fail_at) {
                *now = at;
                self.core.handle_timeout(at);
                self.perform(at);
                if self
                    .take()
                    .iter()
                    .any(|c| matches!(c, Command::CheckBroker))
                {
                    checks.push(at);
                    self.core.broker_checked(answer, at);
                    self.perform(at);
                }
            }
            *now = *fail_at;
            let id = self.publishers[&0];
            if self.core.children.contains_key(&id) {
                self.core.child_ended(id, "connection refused", None, *now);
                self.perform(*now);
                self.take();
            }
        }
        checks
    }

    /// The next due timer, which must be a check within the interval of `now`, fired and
    /// answered: the broker is back. Returns when, with what the core told and commanded.
    fn answer_next_check(&mut self, now: Instant) -> (Instant, Vec<Note>, Vec<Command<Fake>>) {
        let check = due(&self.core).expect("a check is due");
        assert!(check - now <= Duration::from_millis(500));
        self.core.handle_timeout(check);
        self.perform(check);
        assert!(
            self.take()
                .iter()
                .any(|c| matches!(c, Command::CheckBroker))
        );
        self.notes.clear();
        self.core.broker_checked(true, check);
        self.perform(check);
        (check, std::mem::take(&mut self.notes), self.take())
    }

    /// Whether `commands` resume the drainer of `tenant`.
    fn resumes(&self, commands: &[Command<Fake>], tenant: &TenantId) -> bool {
        let drainer = self.drainer_of(tenant).unwrap();
        commands
            .iter()
            .any(|c| matches!(c, Command::Resume(Fake(id)) if *id == drainer))
    }
}

/// A broker down while publishers restart at once (they connect at their first publish) and
/// fail only when a drainer retries, on its own backoff: it is checked every 500 ms from the
/// first long delay until it answers, though no publisher waits to restart, and its answer
/// resumes every drainer. Before, checks stopped with the respawns and its return was noticed
/// at the drainers' next retry, up to 5 s later.
#[test]
fn a_broker_down_is_checked_until_it_answers_while_drainers_wait_out_their_retries() {
    let mut now = Instant::now();
    let mut tree = Tree::holding(10, [bucket_of(&tenant("a"))]);
    tree.core.notified(tenant("a"), now);
    tree.perform(now);
    tree.take();
    let retries = drainer_retries(now, Duration::from_secs(20));
    let checks = tree.fail_at_retries(&mut now, &retries, false);
    let first = *checks.first().expect("the broker is checked");
    assert!(
        first < now - Duration::from_secs(10),
        "checked from {first:?}"
    );
    assert_checked_every_interval(&checks);
    // Back: the next check, within 500 ms, resumes the drainer.
    let (_, _, commands) = tree.answer_next_check(now);
    assert!(tree.resumes(&commands, &tenant("a")));
    assert_eq!(due(&tree.core), None, "no check once it answered");
}

/// A broker that answers a check while it is stopping, then takes no connections: the
/// publishers it let restart fail at their first publish, when their drainers retry. It is
/// checked again every 500 ms once their delays outgrow that, and its return is news: every
/// drainer resumes. Before, one answer spent the check until a publish was confirmed, and its
/// return was noticed only at the drainers' next retry.
#[test]
fn a_broker_that_answered_then_went_down_again_is_checked_until_it_answers_again() {
    let mut now = Instant::now();
    let mut tree = Tree::holding(10, [bucket_of(&tenant("a"))]);
    tree.core.notified(tenant("a"), now);
    tree.perform(now);
    tree.take();
    // Down, then its one answer while it stops.
    let down = drainer_retries(now, Duration::from_secs(12));
    let first = tree.fail_at_retries(&mut now, &down, false);
    assert!(!first.is_empty(), "checked while down");
    let (check, notes, _) = tree.answer_next_check(now);
    assert!(notes.contains(&Note::BrokerAnswers));
    // Down again: its publishers fail at the drainer's retries, restarting from 100 ms.
    now = check;
    let down_again = drainer_retries(check, Duration::from_secs(12));
    let checks = tree.fail_at_retries(&mut now, &down_again, false);
    let settled: Vec<Instant> = checks
        .iter()
        .copied()
        .filter(|at| *at >= check + Duration::from_secs(3))
        .collect();
    assert!(
        settled.len() >= 10,
        "{} checks after 3 s: {checks:?}",
        settled.len()
    );
    assert_checked_every_interval(&settled);
    // Back: the next check, within 500 ms, is news, and the drainer resumes.
    let (_, notes, commands) = tree.answer_next_check(now);
    assert!(notes.contains(&Note::BrokerAnswers));
    assert!(tree.resumes(&commands, &tenant("a")));
}

/// A publish confirmed while the broker is checked ends the checks: the broker takes
/// publishes, so a check that cannot succeed (its declaration refused, say) is not made every
/// 500 ms for ever.
#[test]
fn a_confirmed_publish_ends_the_checks() {
    let mut now = Instant::now();
    let mut tree = Tree::new(10);
    // Shard 0 fails until its delay outgrows the interval and a check comes.
    let check = loop {
        let id = tree.publishers[&0];
        tree.core.child_ended(id, "connection refused", None, now);
        tree.perform(now);
        tree.take();
        if tree
            .core
            .timers
            .iter()
            .any(|(timer, _)| matches!(timer, Timer::CheckBroker))
        {
            break due(&tree.core).unwrap();
        }
        now = due(&tree.core).unwrap();
        tree.core.handle_timeout(now);
        tree.perform(now);
        tree.take();
    };
    tree.core.handle_timeout(check);
    tree.perform(check);
    assert!(
        tree.take()
            .iter()
            .any(|c| matches!(c, Command::CheckBroker))
    );
    // Shard 1's publish is confirmed while the check runs; the check itself fails.
    tree.core.publisher_healthy(ShardId(1));
    tree.core.broker_checked(false, check);
    tree.perform(check);
    assert!(
        !tree
            .core
            .timers
            .iter()
            .any(|(timer, _)| matches!(timer, Timer::CheckBroker)),
        "no further check"
    );
    assert!(tree.notes.contains(&Note::BrokerSilent { again: false }));
}

#[test]
fn a_publisher_that_cannot_start_is_tried_again_and_none_restarts_while_finishing() {
    let now = Instant::now();
    let mut core: Core<Fake> = Core::new(config(10));
    let mut started = Vec::new();
    while let Some(command) = core.poll() {
        if let Command::SpawnPublisher(shard) = command {
            started.push(shard);
        }
    }
    core.publisher_failed_to_start(ShardId(0), now);
    core.publisher_started(ShardId(1), 7);
    let at = due(&core).expect("a retry is due");
    core.handle_timeout(at);
    assert!(matches!(
        core.poll(),
        Some(Command::SpawnPublisher(ShardId(0)))
    ));
    core.finish(at);
    assert!(matches!(core.poll(), Some(Command::Finished)));
    core.child_ended(7, "stopped", None, at);
    assert!(matches!(
        core.poll(),
        Some(Command::PublisherGone(ShardId(1)))
    ));
    assert_eq!(due(&core), None, "nothing restarts once finished");
    assert_eq!(started, vec![ShardId(0), ShardId(1)]);
}

#[test]
fn tenants_beyond_the_cap_wait_in_order_and_get_the_slots_that_free_up() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(4);
    let mut tree = Tree::holding(2, tenants.iter().map(bucket_of));
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    assert_eq!(tree.drainers.len(), 2);
    assert_eq!(tree.core.drainers_alive(), 2);
    assert!(tree.core.crowded());
    assert!(tree.drainer_of(&tenants[0]).is_some() && tree.drainer_of(&tenants[1]).is_some());
    // A retiring drainer's slot goes to the tenant that waited longest.
    tree.end(&tenants[1], true, now);
    assert!(tree.drainer_of(&tenants[2]).is_some());
    assert!(tree.drainer_of(&tenants[3]).is_none());
    // A poll that no longer lists a waiting tenant drops it from the queue.
    tree.core
        .pending(vec![tenants[0].clone(), tenants[2].clone()], now);
    tree.perform(now);
    assert!(!tree.core.crowded());
    tree.end(&tenants[0], true, now);
    assert!(tree.drainer_of(&tenants[3]).is_none());
    assert_eq!(tree.core.drainers_alive(), 1);
}

#[test]
fn wake_ups_coalesce_until_the_drainer_takes_one() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(2);
    let mut tree = Tree::holding(10, [bucket_of(&tenants[0])]);
    tree.core.notified(tenants[0].clone(), now);
    tree.perform(now);
    assert_eq!(tree.drainers.len(), 1);
    for _ in 0..3 {
        tree.core.notified(tenants[0].clone(), now);
        tree.core.pending(vec![tenants[0].clone()], now);
    }
    // A tenant in a bucket not held is not drained here.
    tree.core.notified(tenants[1].clone(), now);
    tree.perform(now);
    let done = tree.take();
    assert!(matches!(done[..], [Command::Drain(_)]), "{done:?}");
    // The drainer takes its wake-up: the ones that came meanwhile are one more `Drain` (its
    // drain may have read before their commits), and after that one is taken, none.
    let drainer = tree.drainer_of(&tenants[0]).unwrap();
    tree.core.drainer_took_wake(drainer);
    tree.perform(now);
    assert!(matches!(tree.take()[..], [Command::Drain(_)]));
    tree.core.drainer_took_wake(drainer);
    tree.perform(now);
    assert!(tree.take().is_empty());
    // Nothing queued: the next wake-up is sent at once.
    tree.core.notified(tenants[0].clone(), now);
    tree.perform(now);
    assert!(matches!(tree.take()[..], [Command::Drain(_)]));
    // A report of a drainer that is gone changes nothing.
    tree.core.drainer_took_wake(drainer + 1_000);
    tree.perform(now);
    assert!(tree.take().is_empty());
}

/// An idle drainer is told to retire only while tenants wait for a slot, with the activity
/// count it reported (it retires only if still idle since then).
#[test]
fn an_idle_drainer_is_told_to_retire_only_while_tenants_wait() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(3);
    let mut tree = Tree::holding(2, tenants.iter().map(bucket_of));
    tree.core.pending(tenants[..2].to_vec(), now);
    tree.perform(now);
    tree.take();
    let first = tree.drainer_of(&tenants[0]).unwrap();
    tree.core.drainer_idle(first, 7);
    tree.perform(now);
    assert!(
        tree.take().is_empty(),
        "no one waits: it retires on its own timer"
    );
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    tree.take();
    assert!(tree.core.crowded());
    tree.core.drainer_idle(first, 8);
    tree.perform(now);
    assert!(
        matches!(tree.take()[..], [Command::Retire(Fake(id), 8)] if id == first),
        "crowded: retire now"
    );
}

#[test]
fn a_failed_drainer_restarts_after_its_backoff_and_an_orderly_one_does_not() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(2);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    tree.end(&tenants[0], true, now);
    assert_eq!(due(&tree.core), None, "retired: nothing to restart");
    assert_eq!(tree.core.slots(), 1, "retired: nothing kept");
    tree.end(&tenants[1], false, now);
    assert_eq!(tree.core.drainers_alive(), 0);
    let first = due(&tree.core).expect("a restart is due");
    assert!(first >= now + Duration::from_millis(100));
    tree.core.handle_timeout(first);
    tree.perform(first);
    assert!(tree.drainer_of(&tenants[1]).is_some());
    // Failing again at once: the delay grows (jitter at most doubles a delay).
    tree.end(&tenants[1], false, first);
    let second = due(&tree.core).expect("a restart is due");
    assert!(second.duration_since(first) >= Duration::from_millis(200));
    // A wake-up waits for the backoff: the host's commits do not restart it early.
    tree.core.notified(tenants[1].clone(), now);
    tree.core.pending(tenants.clone(), now);
    tree.perform(first);
    assert!(tree.drainer_of(&tenants[1]).is_none());
    // Its timer does.
    tree.core.handle_timeout(second);
    tree.perform(second);
    assert!(tree.drainer_of(&tenants[1]).is_some());
}

/// A tenant whose drainer fails on every start, woken 1,000 times a second (the host's
/// commits' NOTIFY), is restarted no more often than its backoff allows: each restart at least
/// the backoff's shortest delay after the failure before it, the delays growing to the policy's
/// longest, and about a dozen restarts in 30 s. Before, every wake-up restarted it: about
/// 30,000 restarts in 30 s.
#[test]
fn a_failing_drainer_woken_a_thousand_times_a_second_restarts_only_on_its_backoff() {
    let start = Instant::now();
    let tenants = tenants_in_distinct_buckets(1);
    let tenant = &tenants[0];
    let mut tree = Tree::holding(10, [bucket_of(tenant)]);
    let mut restarts: Vec<Instant> = Vec::new();
    let mut failed_at = None;
    for ms in 0..30_000u64 {
        let now = start + Duration::from_millis(ms);
        tree.core.handle_timeout(now);
        tree.core.notified(tenant.clone(), now);
        tree.perform(now);
        if tree.drainer_of(tenant).is_some() {
            if failed_at.is_some() {
                restarts.push(now);
            }
            // It fails at once, every time.
            tree.end(tenant, false, now);
            let failure = now;
            if let (Some(previous), Some(&restart)) = (failed_at, restarts.last()) {
                let waited = restart.duration_since(previous);
                assert!(
                    waited >= Duration::from_millis(50),
                    "restarted {waited:?} after its failure (backoff's shortest: 100 ms, at least half of it with jitter)"
                );
            }
            failed_at = Some(failure);
        }
    }
    let gaps: Vec<Duration> = restarts.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        restarts.len() <= 20,
        "{} restarts in 30 s: {gaps:?}",
        restarts.len()
    );
    assert!(restarts.len() >= 5, "it is restarted: {gaps:?}");
    assert!(
        gaps.iter()
            .rev()
            .take(2)
            .all(|gap| *gap >= Duration::from_millis(2_500)),
        "the delay reached the policy's longest (5 s, jitter down to half): {gaps:?}"
    );
}

#[test]
fn a_drainer_that_cannot_start_is_tried_again() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(1);
    let (mut core, _) = core_holding(1, [bucket_of(&tenants[0])]);
    core.notified(tenants[0].clone(), now);
    while let Some(command) = core.poll() {
        if let Command::SpawnDrainer { tenant, .. } = command {
            core.drainer_failed_to_start(tenant, now);
        }
    }
    assert_eq!(core.drainers_alive(), 0);
    let at = due(&core).expect("a retry is due");
    core.handle_timeout(at);
    assert!(matches!(core.poll(), Some(Command::SpawnDrainer { .. })));
}

#[test]
fn a_lost_lease_stops_its_drainers_and_forgets_them() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(3);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    let killed = tree.drainer_of(&tenants[0]).expect("running");
    tree.end(&tenants[2], false, now);
    assert_eq!(tree.core.slots(), 3, "one restarting");
    // Another relay took two buckets over: the next renewal does not return them.
    tree.leasing.steal(bucket_of(&tenants[0]));
    tree.leasing.steal(bucket_of(&tenants[2]));
    tree.beat(now);
    assert!(matches!(tree.take()[..], [Command::Kill(Fake(id))] if id == killed));
    assert!(
        !tree.leasing.open(bucket_of(&tenants[0]), now),
        "its fence closed"
    );
    assert!(tree.leasing.released.is_empty(), "not ours to release");
    assert_eq!(tree.core.slots(), 1, "nothing kept for lost buckets");
    // The killed drainer's end arrives later and restarts nothing; neither does the timer.
    tree.core.child_ended(killed, "killed", None, now);
    tree.core.handle_timeout(now + Duration::from_secs(60));
    tree.core.notified(tenants[0].clone(), now);
    tree.perform(now);
    assert!(tree.take().is_empty());
    assert_eq!(tree.drainers.len(), 1);
    assert_eq!(tree.core.buckets_held(), 1);
}

/// `count` tenants in distinct buckets, ordered by bucket (a handover gives up the
/// highest-numbered buckets first).
fn tenants_by_bucket(count: usize) -> Vec<TenantId> {
    let mut tenants = tenants_in_distinct_buckets(count);
    tenants.sort_by_key(bucket_of);
    tenants
}

#[test]
fn a_handover_finishes_the_buckets_drainers_and_settles_each_bucket_once_empty() {
    let now = Instant::now();
    let tenants = tenants_by_bucket(3);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    assert_eq!(tree.core.buckets_held(), 3);
    tree.core.pending(tenants[..2].to_vec(), now);
    tree.perform(now);
    // Many relays now: this one's share is 1, so it hands the two highest buckets over;
    // tenants[1] drains, tenants[2]'s bucket has no drainer.
    tree.leasing.members = 128;
    tree.beat(now);
    let done = tree.take();
    assert!(matches!(done[..], [Command::Finish(_)]), "{done:?}");
    assert_eq!(
        tree.leasing.released,
        vec![bucket_of(&tenants[2])],
        "empty: released at once"
    );
    assert!(
        tree.leasing.open(bucket_of(&tenants[1]), now),
        "open while its batches settle"
    );
    // No drainer starts in a leaving bucket, whatever wakes it.
    tree.core.pending(tenants.clone(), now);
    tree.core.notified(tenants[2].clone(), now);
    tree.core.notified(tenants[1].clone(), now);
    tree.perform(now);
    assert!(
        !tree
            .take()
            .iter()
            .any(|c| matches!(c, Command::SpawnDrainer { .. }))
    );
    assert_eq!(tree.core.buckets_held(), 1);
    // Its drainer finishes: the bucket is released, after its fence closed.
    tree.end(&tenants[1], true, now);
    assert!(tree.take().is_empty());
    assert_eq!(
        tree.leasing.released,
        vec![bucket_of(&tenants[2]), bucket_of(&tenants[1])]
    );
    assert!(!tree.leasing.open(bucket_of(&tenants[1]), now));
    assert_eq!(tree.core.leases.book.len(), 1);
}

/// A shed of many buckets without drainers (a relay joins a busy one) releases them in one
/// call, each fence closed before it: a release per bucket once queued dozens of synchronous
/// commits ahead of the next renewal, long enough for the fences to close by time while the
/// leases were still held, and a planned handover sent events twice.
#[test]
fn buckets_settled_together_are_released_by_one_call_after_their_fences_close() {
    let now = Instant::now();
    let mut tree = Tree::holding(10, (0..64).map(Bucket));
    assert_eq!(tree.core.buckets_held(), 64);
    let calls = tree.leasing.release_calls;
    // Four relays: a share of 32.
    tree.leasing.members = 4;
    tree.beat(now);
    assert_eq!(tree.leasing.released.len(), 32);
    assert_eq!(tree.leasing.release_calls, calls + 1, "one call for the 32");
    assert_eq!(tree.core.buckets_held(), 32);
}

/// A fence's deadline counts from when the lease runner sent the renewal, not from when the core
/// commanded the beat: time the call waited behind others is not lease time.
#[test]
fn a_renewal_extends_the_fences_from_when_it_was_sent() {
    let now = Instant::now();
    let (mut core, _) = core_holding(10, [Bucket(3)]);
    core.timers.stop(&Timer::LeaseBeat);
    core.beat(leases::Beat::Later, now);
    let Some(Command::Lease(LeaseCall::Beat { held })) = core.poll() else {
        panic!("a beat is commanded");
    };
    let sent = now + Duration::from_millis(700);
    let renewed = LeasesAt { leases: held, sent };
    core.lease_beaten(Some(1), Some(renewed), false, sent);
    let Some(Command::ExtendFences { buckets, until }) = core.poll() else {
        panic!("the fences are extended");
    };
    assert_eq!(buckets, vec![Bucket(3)]);
    assert_eq!(until, sent + config(10).lease.ttl.mul_f64(0.9));
}

/// A tree holding two buckets, each with a tenant, that hands the higher one over (its share
/// is 1 among 128 relays) while that tenant's drainer runs: the drainer is told to finish.
fn handing_over_a_busy_bucket(now: Instant) -> (Tree, Vec<TenantId>) {
    let tenants = tenants_by_bucket(2);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    tree.core.notified(tenants[1].clone(), now);
    tree.perform(now);
    tree.leasing.members = 128;
    tree.beat(now);
    assert!(matches!(tree.take()[..], [Command::Finish(_)]));
    (tree, tenants)
}

#[test]
fn a_failed_drainer_of_a_leaving_bucket_settles_it_and_does_not_restart() {
    let now = Instant::now();
    let (mut tree, tenants) = handing_over_a_busy_bucket(now);
    tree.end(&tenants[1], false, now);
    assert_eq!(tree.leasing.released, vec![bucket_of(&tenants[1])]);
    assert_eq!(due(&tree.core), None, "no restart");
}

/// A handover whose drainers do not finish within the grace is forced at a later beat (their
/// drainers are stopped, then the bucket released), but never while the broker blocks a
/// connection of this relay.
#[test]
fn a_handover_that_does_not_settle_is_forced_at_a_beat_after_the_grace_unless_blocked() {
    let now = Instant::now();
    let (mut tree, tenants) = handing_over_a_busy_bucket(now);
    // Past the grace (10 s), with the broker blocking a connection: nothing is forced.
    let later = now + Duration::from_secs(11);
    tree.core.timers.stop(&Timer::LeaseBeat);
    tree.core.beat(leases::Beat::Later, later);
    let Some(Command::Lease(LeaseCall::Beat { held })) = tree.core.poll() else {
        panic!("a beat is commanded");
    };
    let renewed = LeasesAt {
        leases: held,
        sent: later,
    };
    tree.core
        .lease_beaten(Some(128), Some(renewed), true, later);
    tree.perform(later);
    assert!(tree.take().is_empty());
    assert!(tree.leasing.released.is_empty());
    assert!(tree.core.leases.book.is_leaving(bucket_of(&tenants[1])));
    // The alarm cleared: the next beat forces it.
    tree.beat(later);
    assert!(matches!(tree.take()[..], [Command::Kill(_)]));
    assert_eq!(tree.leasing.released, vec![bucket_of(&tenants[1])]);
    assert!(tree.drainers.is_empty());
}

#[test]
fn finishing_waits_for_every_drainer_then_the_deadline_kills_the_rest() {
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(3);
    let mut tree = Tree::holding(10, tenants.iter().map(bucket_of));
    tree.core.pending(tenants.clone(), now);
    tree.perform(now);
    tree.core.finish(now);
    tree.perform(now);
    let done = tree.take();
    assert_eq!(
        done.iter()
            .filter(|c| matches!(c, Command::Finish(_)))
            .count(),
        3
    );
    // Nothing new starts, a failure restarts nothing.
    tree.core.notified(tenant("newcomer"), now);
    tree.end(&tenants[0], false, now);
    assert!(tree.take().is_empty());
    tree.end(&tenants[1], true, now);
    assert!(tree.take().is_empty());
    let deadline = tree
        .core
        .timers
        .iter()
        .find(|(timer, _)| **timer == Timer::FinishDeadline)
        .map(|(_, at)| at)
        .expect("the grace is armed");
    assert_eq!(deadline, now + Duration::from_secs(10));
    tree.core.handle_timeout(deadline);
    tree.perform(deadline);
    let done = tree.take();
    assert!(
        matches!(done[..], [Command::Kill(_), Command::Finished]),
        "{done:?}"
    );
    assert!(tree.drainers.is_empty());
    // Once only.
    tree.core.finish(deadline);
    tree.perform(deadline);
    assert!(tree.take().is_empty());
}

#[test]
fn a_finish_waiting_on_drainers_of_a_lost_lease_is_done_when_they_are_stopped() {
    // Found by the property below: the finish waited out its whole grace.
    let now = Instant::now();
    let tenants = tenants_in_distinct_buckets(1);
    let mut tree = Tree::holding(10, [bucket_of(&tenants[0])]);
    tree.core.notified(tenants[0].clone(), now);
    tree.perform(now);
    tree.core.finish(now);
    tree.perform(now);
    tree.leasing.steal(bucket_of(&tenants[0]));
    tree.beat(now);
    let done = tree.take();
    assert!(
        matches!(
            done[..],
            [Command::Finish(_), Command::Kill(_), Command::Finished]
        ),
        "{done:?}"
    );
}

#[test]
fn finishing_with_no_drainer_is_done_at_once() {
    let mut tree = Tree::new(10);
    tree.core.finish(Instant::now());
    tree.perform(Instant::now());
    assert!(matches!(tree.take()[..], [Command::Finished]));
}

#[test]
fn a_drainer_that_starts_after_its_bucket_left_is_not_left_running() {
    let now = Instant::now();
    let tenants = tenants_by_bucket(3);
    let (mut core, mut leasing) = core_holding(10, tenants.iter().map(bucket_of));
    core.pending(tenants[1..].to_vec(), now);
    let spawns: Vec<TenantId> = std::iter::from_fn(|| core.poll())
        .filter_map(|command| match command {
            Command::SpawnDrainer { tenant } => Some(tenant),
            _ => None,
        })
        .collect();
    assert_eq!(spawns.len(), 2);
    // While they start: tenants[1]'s bucket is lost, tenants[2]'s handed over (share 1).
    leasing.steal(bucket_of(&tenants[1]));
    leasing.members = 128;
    leasing.beat(&mut core, now);
    while let Some(command) = core.poll() {
        leasing.carry(&mut core, command, now);
    }
    assert!(core.leases.book.is_leaving(bucket_of(&tenants[2])));
    core.drainer_started(tenants[2].clone(), Fake(1), now);
    assert!(matches!(core.poll(), Some(Command::Finish(Fake(1)))));
    core.drainer_started(tenants[1].clone(), Fake(2), now);
    assert!(matches!(core.poll(), Some(Command::Kill(Fake(2)))));
    // A start the core never commanded is stopped.
    core.drainer_started(tenant("stranger"), Fake(3), now);
    assert!(matches!(core.poll(), Some(Command::Kill(Fake(3)))));
}

// ----- Properties -----

#[derive(Clone, Debug)]
enum Event {
    /// The tenant's bucket becomes claimable.
    Gain(usize),
    /// Another relay takes the tenant's bucket over.
    Lose(usize),
    /// This many relays are live (shares of 128, 5, 3 and 1 buckets: hand overs).
    Members(u32),
    /// PostgreSQL stops or starts answering the lease calls.
    Database(bool),
    /// A heartbeat now (if none is out).
    Beat,
    Pending(Vec<usize>),
    Notified(usize),
    /// The nth running drainer stops: orderly or failed.
    DrainerEnds(usize, bool),
    /// The nth running drainer takes its wake-up.
    TakesWakeUp(usize),
    /// The nth running drainer found nothing to do.
    Idle(usize),
    SpawnFails,
    PublisherEnds(u16),
    /// The shard's publisher (if one runs) has a publish confirmed.
    PublisherHealthy(u16),
    /// A broker check running (if any) reports.
    BrokerAnswers(bool),
    Finish,
    Advance(u64),
}

fn event(tenants: usize) -> impl Strategy<Value = Event> {
    prop_oneof![
        2 => (0..tenants).prop_map(Event::Gain),
        1 => (0..tenants).prop_map(Event::Lose),
        1 => prop::sample::select(vec![1u32, 26, 43, 128]).prop_map(Event::Members),
        1 => any::<bool>().prop_map(Event::Database),
        2 => Just(Event::Beat),
        3 => proptest::collection::vec(0..tenants, 0..tenants).prop_map(Event::Pending),
        3 => (0..tenants).prop_map(Event::Notified),
        3 => (0..8usize, any::<bool>()).prop_map(|(n, orderly)| Event::DrainerEnds(n, orderly)),
        1 => (0..8usize).prop_map(Event::TakesWakeUp),
        1 => (0..8usize).prop_map(Event::Idle),
        1 => Just(Event::SpawnFails),
        1 => (0..2u16).prop_map(Event::PublisherEnds),
        1 => (0..2u16).prop_map(Event::PublisherHealthy),
        1 => any::<bool>().prop_map(Event::BrokerAnswers),
        1 => Just(Event::Finish),
        2 => (1..3_000u64).prop_map(Event::Advance),
    ]
}

/// A fake tree that can also fail spawns, and checks the core after every step.
struct Checked {
    core: Core<Fake>,
    max: usize,
    now: Instant,
    next_id: u64,
    fail_next_spawn: bool,
    drainers: BTreeMap<u64, TenantId>,
    publishers: BTreeMap<u16, u64>,
    leasing: Leasing,
    finished: usize,
    finish_asked: bool,
    /// A broker check is running.
    checking: bool,
}

impl Checked {
    fn perform(&mut self) {
        while let Some(command) = self.core.poll() {
            if let Command::Lease(LeaseCall::Release(leases)) = &command {
                for (bucket, _) in leases {
                    assert!(
                        !self
                            .drainers
                            .values()
                            .any(|tenant| bucket_of(tenant) == *bucket),
                        "released {bucket:?} with a drainer running on it"
                    );
                }
            }
            let Some(command) = self.leasing.carry(&mut self.core, command, self.now) else {
                continue;
            };
            match command {
                Command::SpawnDrainer { tenant } => {
                    assert!(
                        self.leasing.open(bucket_of(&tenant), self.now),
                        "a drainer starts under an open fence"
                    );
                    assert!(!self.finish_asked, "nothing starts once finishing");
                    assert!(
                        !self.drainers.values().any(|running| *running == tenant),
                        "two drainers for {tenant}"
                    );
                    if std::mem::take(&mut self.fail_next_spawn) {
                        self.core.drainer_failed_to_start(tenant, self.now);
                    } else {
                        self.next_id += 1;
                        self.drainers.insert(self.next_id, tenant.clone());
                        self.core
                            .drainer_started(tenant, Fake(self.next_id), self.now);
                    }
                }
                Command::SpawnPublisher(shard) => {
                    assert!(!self.publishers.contains_key(&shard.0), "two publishers");
                    self.next_id += 1;
                    self.publishers.insert(shard.0, self.next_id);
                    self.core.publisher_started(shard, self.next_id);
                }
                Command::PublisherGone(shard) => {
                    assert!(!self.publishers.contains_key(&shard.0));
                }
                Command::CheckBroker => {
                    assert!(!self.checking, "two broker checks at once");
                    assert!(!self.finish_asked, "no check once finishing");
                    self.checking = true;
                }
                Command::Kill(Fake(id)) => {
                    // ractor reports a killed child's end as well.
                    if self.drainers.remove(&id).is_some() {
                        self.core.child_ended(id, "killed", None, self.now);
                    }
                }
                Command::Retire(Fake(id), _) => {
                    assert!(self.drainers.contains_key(&id), "told a dead drainer");
                    assert!(self.core.crowded(), "retired while no tenant waits");
                }
                Command::Drain(Fake(id))
                | Command::Resume(Fake(id))
                | Command::Finish(Fake(id)) => {
                    assert!(self.drainers.contains_key(&id), "told a dead drainer");
                }
                Command::Finished => {
                    assert!(self.finish_asked);
                    assert!(self.drainers.is_empty(), "finished with drainers running");
                    self.finished += 1;
                }
                other => panic!("not the tree's: {other:?}"),
            }
        }
        self.check();
    }

    fn check(&self) {
        let running: BTreeMap<u64, TenantId> = self
            .core
            .drainers()
            .map(|(tenant, drainer)| (drainer.0, tenant.clone()))
            .collect();
        assert_eq!(running, self.drainers, "the core's drainers are the tree's");
        assert_eq!(self.core.drainers_alive(), self.drainers.len());
        assert!(self.drainers.len() <= self.max, "over the cap");
        let held: BTreeSet<Bucket> = self.core.leases.book.buckets().collect();
        let fenced: BTreeSet<Bucket> = self.leasing.fences.keys().copied().collect();
        assert_eq!(held, fenced, "a fence per lease the book holds, no other");
        for tenant in self.drainers.values() {
            assert!(
                held.contains(&bucket_of(tenant)),
                "{tenant} drains in a bucket not held"
            );
        }
        assert!(self.finished <= 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Under any sequence of leases gained, lost and handed over (by the share), database
    /// outages, wake-ups and failures: the core's drainers are exactly the tree's, at most one
    /// per tenant, never over the cap, never in a bucket not held or under a closed fence;
    /// every lease the book holds has a fence and no other does; a fence closes before its
    /// bucket is released, and a bucket is released with no drainer on it; every bucket
    /// handed over is released once its drainers end; a finish ends once, with nothing
    /// running.
    #[test]
    fn the_tree_follows_the_core_under_any_sequence(
        max in 1..4usize,
        events in proptest::collection::vec(event(5), 1..60),
    ) {
        let tenants = tenants_in_distinct_buckets(5);
        let start = Instant::now();
        let mut core = Core::new(CoreConfig {
            lease: LeaseConfig {
                ttl: Duration::from_secs(3),
                heartbeat: Duration::from_secs(1),
            },
            ..config(max)
        });
        core.start_leases(start);
        let mut tree = Checked {
            core,
            max,
            now: start,
            next_id: 0,
            fail_next_spawn: false,
            drainers: BTreeMap::new(),
            publishers: BTreeMap::new(),
            leasing: Leasing::offering([]),
            finished: 0,
            finish_asked: false,
            checking: false,
        };
        tree.perform();
        for event in events {
            match event {
                Event::Gain(n) => tree.leasing.offer(bucket_of(&tenants[n])),
                Event::Lose(n) => tree.leasing.steal(bucket_of(&tenants[n])),
                Event::Members(members) => tree.leasing.members = members,
                Event::Database(up) => tree.leasing.down = !up,
                Event::Beat => {
                    if tree.core.leases.stage == leases::LeaseStage::Waiting {
                        tree.leasing.beat(&mut tree.core, tree.now);
                    }
                }
                Event::Pending(list) => {
                    tree.core.pending(list.into_iter().map(|n| tenants[n].clone()).collect(), tree.now);
                }
                Event::Notified(n) => tree.core.notified(tenants[n].clone(), tree.now),
                Event::DrainerEnds(n, orderly) => {
                    if let Some((&id, _)) = tree.drainers.iter().nth(n % tree.drainers.len().max(1)) {
                        tree.drainers.remove(&id);
                        tree.core.child_ended(
                            id,
                            "ended",
                            orderly.then_some(actors::StopReason::Finished),
                            tree.now,
                        );
                    }
                }
                Event::TakesWakeUp(n) => {
                    if let Some((&id, _)) = tree.drainers.iter().nth(n % tree.drainers.len().max(1)) {
                        tree.core.drainer_took_wake(id);
                    }
                }
                Event::Idle(n) => {
                    if let Some((&id, _)) = tree.drainers.iter().nth(n % tree.drainers.len().max(1)) {
                        tree.core.drainer_idle(id, n as u64);
                    }
                }
                Event::SpawnFails => tree.fail_next_spawn = true,
                Event::PublisherEnds(shard) => {
                    if let Some(id) = tree.publishers.remove(&shard) {
                        tree.core.child_ended(id, "connection lost", None, tree.now);
                    }
                }
                Event::PublisherHealthy(shard) => {
                    if tree.publishers.contains_key(&shard) {
                        tree.core.publisher_healthy(ShardId(shard));
                    }
                }
                Event::BrokerAnswers(answered) => {
                    if std::mem::take(&mut tree.checking) {
                        tree.core.broker_checked(answered, tree.now);
                    }
                }
                Event::Finish => {
                    tree.finish_asked = true;
                    tree.core.finish(tree.now);
                }
                Event::Advance(ms) => {
                    tree.now += Duration::from_millis(ms);
                    tree.core.handle_timeout(tree.now);
                }
            }
            tree.perform();
        }
        // Every drainer ends by itself: each bucket still being handed over is released.
        let ids: Vec<u64> = tree.drainers.keys().copied().collect();
        for id in ids {
            tree.drainers.remove(&id);
            tree.core.child_ended(id, "finished", Some(actors::StopReason::Finished), tree.now);
            tree.perform();
        }
        prop_assert!(tree.core.leases.book.leaving().is_empty(), "a handover never settled");
        if tree.finish_asked {
            prop_assert_eq!(tree.finished, 1, "a finish ends once everything stopped");
        }
    }
}
