//! Whether a relay can do its job now: the rules of the binary's `/readyz`, for a host that
//! embeds the relay and answers its own readiness probe.
//!
//! [`Readiness::check`] reads the facts (the outbox's waiting intents and parked branches, the
//! broker's last state, the relay's lease buckets and replication hold-back) and applies the
//! pure rules ([`rules`]). Not ready means look at it (the database is unreachable, the broker
//! is down or blocks the relay while intents wait, too many branches are parked): restarting
//! fixes none of these, so it is not a liveness probe.
use std::time::{Duration, Instant};

use broker::{BrokerHealth, BrokerState};
use store::Outbox;

use crate::RelayProbe;

/// Longest a readiness check waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(1);

/// Drains held back this long make the relay not ready.
const HELD_BACK_NOT_READY: Duration = Duration::from_secs(5);

/// No lease bucket held this long makes the relay not ready: a relay that has just started (or
/// just handed its buckets over) claims them within a heartbeat or two, and is not to be called
/// stuck before then (cli::a_running_relay_answers_health_and_readiness failed once in CI
/// with the probe racing the first claims under load, as far as its truncated log shows).
const NO_BUCKETS_NOT_READY: Duration = Duration::from_secs(5);

/// Why a relay is not ready: one line per problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotReady(Vec<String>);

impl NotReady {
    /// Each problem, in the order the rules name them.
    pub fn problems(&self) -> &[String] {
        &self.0
    }
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join("; "))
    }
}

impl std::error::Error for NotReady {}

/// A relay's readiness probe: what it reads, and since when the relay has held no lease
/// bucket. Build one per relay ([`crate::RelayHandle::readiness`]) and ask it as often as
/// the probe comes.
#[derive(Debug)]
pub struct Readiness {
    /// Best on its own small pool, so a busy relay pool does not make the probe time out.
    outbox: Outbox,
    broker: BrokerHealth,
    relay: RelayProbe,
    without_buckets: WithoutBuckets,
    max_parked: u64,
}

impl Readiness {
    /// Reads `outbox` (waiting intents, parked branches), `broker` (what the relay's
    /// publishers last learned) and `relay`; more than `max_parked` parked branches is not
    /// ready.
    pub fn new(outbox: Outbox, broker: BrokerHealth, relay: RelayProbe, max_parked: u64) -> Self {
        Self {
            outbox,
            broker,
            relay,
            without_buckets: WithoutBuckets::default(),
            max_parked,
        }
    }

    /// Ready, or why not (at most about two seconds: a second for the database, one for the
    /// relay's actors).
    pub async fn check(&self) -> Result<(), NotReady> {
        let database = store::within(READY_TIMEOUT, self.outbox.pending_and_parked())
            .await
            .map_err(|err| err.to_string());
        let buckets_held = self.relay.buckets_held().await;
        let relay = RelayFacts {
            without_buckets_for: self.without_buckets.observe(buckets_held, Instant::now()),
            held_back_for: self.relay.held_back_for(),
        };
        rules(
            database,
            self.broker.state(),
            self.broker.blocked(),
            relay,
            self.max_parked,
        )
        .map_err(NotReady)
    }
}

/// What the relay itself says for a readiness check: how long it has held no lease bucket,
/// as the probes saw it (`None`: it holds some, or does not answer), and how long its drains
/// have been held back for replication.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RelayFacts {
    without_buckets_for: Option<Duration>,
    held_back_for: Option<Duration>,
}

/// Since when the probes have seen the relay hold no lease bucket.
#[derive(Debug, Default)]
struct WithoutBuckets(std::sync::Mutex<Option<Instant>>);

impl WithoutBuckets {
    /// How long the relay has held none, given what it answers now (`None`: some, or no answer).
    fn observe(&self, buckets_held: Option<usize>, now: Instant) -> Option<Duration> {
        let mut since = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match buckets_held {
            Some(0) => Some(now.duration_since(*since.get_or_insert(now))),
            Some(_) => {
                *since = None;
                None
            }
            None => None,
        }
    }
}

/// What the database said for a readiness check: whether intents wait, and parked branches.
type DatabaseFacts = Result<(bool, u64), String>;

/// Ready, or not with the reasons (pure: the rules of `/readyz`).
fn rules(
    database: DatabaseFacts,
    broker: BrokerState,
    blocked: bool,
    relay: RelayFacts,
    max_parked: u64,
) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    match database {
        Err(why) => problems.push(format!("database unreachable: {why}")),
        Ok((pending, parked)) => {
            if let Some(without) = relay
                .without_buckets_for
                .filter(|without| pending && *without >= NO_BUCKETS_NOT_READY)
            {
                problems.push(format!(
                    "holds no lease bucket while intents wait, for {} s (its lease renewals do not commit: the database is slow, or waits for a synchronous standby that is down)",
                    without.as_secs()
                ));
            }
            if let Some(held) = relay
                .held_back_for
                .filter(|held| *held >= HELD_BACK_NOT_READY)
            {
                problems.push(format!(
                    "drains held back for {} s: what they read is not yet flushed where RELAY_PUBLISH_REPLICATED requires (a standby down or behind)",
                    held.as_secs()
                ));
            }
            if pending && broker == BrokerState::Down {
                problems.push("broker down while intents wait".into());
            }
            if pending && blocked {
                problems.push(
                    "broker blocks the relay (connection.blocked: a memory or disk alarm) while intents wait"
                        .into(),
                );
            }
            if parked > max_parked {
                problems.push(format!(
                    "{parked} branches parked (more than RELAY_READY_MAX_PARKED={max_parked})"
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_names_what_the_relay_says() {
        let none = RelayFacts {
            without_buckets_for: Some(Duration::from_secs(6)),
            held_back_for: None,
        };
        let problems = rules(Ok((true, 0)), BrokerState::Up, false, none, 0).unwrap_err();
        assert!(
            problems[0].starts_with("holds no lease bucket while intents wait, for 6 s"),
            "{problems:?}"
        );
        assert!(
            rules(Ok((false, 0)), BrokerState::Up, false, none, 0).is_ok(),
            "nothing waits"
        );
        let starting = RelayFacts {
            without_buckets_for: Some(Duration::from_secs(1)),
            held_back_for: None,
        };
        assert!(
            rules(Ok((true, 0)), BrokerState::Up, false, starting, 0).is_ok(),
            "a relay still claiming its first buckets is not stuck"
        );
        let held = RelayFacts {
            without_buckets_for: None,
            held_back_for: Some(Duration::from_secs(6)),
        };
        let problems = rules(Ok((true, 0)), BrokerState::Up, false, held, 0).unwrap_err();
        assert!(
            problems[0].starts_with("drains held back for 6 s"),
            "{problems:?}"
        );
        let briefly = RelayFacts {
            without_buckets_for: None,
            held_back_for: Some(Duration::from_secs(1)),
        };
        assert!(rules(Ok((true, 0)), BrokerState::Up, false, briefly, 0).is_ok());
    }

    #[test]
    fn the_time_without_buckets_counts_from_the_first_probe_that_saw_none() {
        let without = WithoutBuckets::default();
        let start = std::time::Instant::now();
        let later = |secs| start + Duration::from_secs(secs);
        assert_eq!(without.observe(Some(0), start), Some(Duration::ZERO));
        assert_eq!(
            without.observe(None, later(1)),
            None,
            "no answer says nothing"
        );
        assert_eq!(
            without.observe(Some(0), later(6)),
            Some(Duration::from_secs(6))
        );
        assert_eq!(without.observe(Some(4), later(7)), None);
        assert_eq!(
            without.observe(Some(0), later(9)),
            Some(Duration::ZERO),
            "counted anew"
        );
    }

    /// The rules with nothing said by the relay itself.
    fn plain(
        database: DatabaseFacts,
        broker: BrokerState,
        blocked: bool,
        max_parked: u64,
    ) -> Result<(), Vec<String>> {
        rules(database, broker, blocked, RelayFacts::default(), max_parked)
    }

    #[test]
    fn readiness_names_each_problem() {
        assert!(
            plain(Ok((false, 0)), BrokerState::Down, false, 0).is_ok(),
            "nothing waits"
        );
        assert!(plain(Ok((true, 0)), BrokerState::Unknown, false, 0).is_ok());
        assert!(plain(Ok((true, 0)), BrokerState::Up, false, 0).is_ok());
        let down = plain(Ok((true, 0)), BrokerState::Down, false, 0).unwrap_err();
        assert_eq!(down, vec!["broker down while intents wait".to_owned()]);
        let parked = plain(Ok((false, 3)), BrokerState::Up, false, 2).unwrap_err();
        assert!(parked[0].starts_with("3 branches parked"), "{parked:?}");
        assert!(plain(Ok((false, 2)), BrokerState::Up, false, 2).is_ok());
        let database = plain(Err("refused".into()), BrokerState::Up, false, 0).unwrap_err();
        assert_eq!(database, vec!["database unreachable: refused".to_owned()]);
        // Issue 16: a broker alarm blocks every publishing connection while the last state
        // reported stays Up (nothing faults): blocked with intents waiting is not ready.
        let blocked = plain(Ok((true, 0)), BrokerState::Up, true, 0).unwrap_err();
        assert!(
            blocked[0].starts_with("broker blocks the relay"),
            "{blocked:?}"
        );
        assert!(
            plain(Ok((false, 0)), BrokerState::Up, true, 0).is_ok(),
            "blocked with nothing waiting"
        );
    }
}
