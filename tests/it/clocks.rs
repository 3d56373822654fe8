//! Steps of PostgreSQL's clock (libfaketime on a private server, `pg_pair::FakedClock`) while
//! two relays share the outbox and a host writes on. Leases go by the beat each renewal bumps,
//! seen on each relay's own monotonic clock (`supervisor/src/core/leases/sightings.rs`), never by the database's
//! wall clock: a step forward past the TTL takes no lease away and a step back holds no dead
//! relay's buckets for the length of the step.
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use distribution::Relay;
use sqlx::PgPool;

use crate::harness::*;
use crate::pg_pair::{FakedClock, PgPair, Postgres};
use crate::recorder::{Recorder, all_delivered, assert_folds_to, writing_while_both_ship};

/// Every bucket's owner and epoch.
async fn leases(pool: &PgPool) -> BTreeMap<i32, (Option<String>, i64)> {
    let rows: Vec<(i32, Option<String>, i64)> =
        sqlx::query_as("SELECT bucket, owner, epoch FROM relay_lease")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter()
        .map(|(bucket, owner, epoch)| (bucket, (owner, epoch)))
        .collect()
}

/// PostgreSQL's clock ahead of the real time, in seconds (the test's own clock is real).
async fn offset(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8 - $1::float8")
        .bind(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs_f64(),
        )
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Two relays (one in this process, one the binary) hold even shares on a private
/// PostgreSQL whose clock the test steps while a host writes on:
/// - two hours forward (every lease's expires_at far behind the new clock, the members' rows
///   deleted as an hour stale), for three TTLs;
/// - back to the real time (two hours back: every expires_at far ahead), for three TTLs;
///
/// after each, every bucket has the owner and epoch it had before: no lease lost, none taken
/// over. Then the binary relay killed (SIGKILL: nothing released) and the clock stepped one
/// hour back before its leases ran out: the other holds every bucket within the TTL and two
/// heartbeats (plus a margin for this 2-core machine), not an hour later. Nothing is lost, the fold of every delivery is the host's
/// history, and what went out twice is at most the killed relay's in-flight budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_the_database_clock_move_no_lease_and_hold_no_dead_relays_buckets() {
    let _serial = crate::failover::SERIAL.lock().await;
    let clock = FakedClock::new("steps");
    let pair =
        tokio::task::block_in_place(|| PgPair::start_with_clock(Postgres::V15, "clocks", &clock));
    let url = pair.url(pair.primary_port());
    let (pool, config) = quick_leases_on(&url, "clocks").await;
    let topology = config.topology.clone();
    let ttl = config.supervisor.lease.ttl;
    let heartbeat = config.supervisor.lease.heartbeat;
    let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
    let binary = Process(
        run_command(&url, &amqp_url(), &topology, &free_addr())
            .env("RELAY_LEASE_TTL_MS", ttl.as_millis().to_string())
            .env(
                "RELAY_LEASE_HEARTBEAT_MS",
                heartbeat.as_millis().to_string(),
            )
            .env("RELAY_BATCH_SIZE", "20")
            .env("RELAY_MAX_IN_FLIGHT", "200")
            .spawn()
            .unwrap(),
    );
    let relay = Relay::start(config.clone()).await.unwrap();
    wait_until("even shares of two", Duration::from_secs(30), || async {
        buckets(&relay).await == 64
            && leases(&pool)
                .await
                .values()
                .filter(|(owner, _)| owner.is_some())
                .count()
                == 128
    })
    .await;
    let (stop, writer) = writing_while_both_ship(&pool, &recorder, "ck").await;

    for (step, ahead) in [("+2h", 7200.0), ("+0", 0.0)] {
        let before = leases(&pool).await;
        clock.set(step);
        let seen = offset(&pool).await;
        assert!(
            (seen - ahead).abs() < 60.0,
            "the database's clock is {seen:.0} s off, not {ahead} s: the step did not happen"
        );
        let shipped = recorder.deliveries().len();
        // The step's consequences, for three TTLs (the fault's length, not a wait for
        // anything).
        tokio::time::sleep(ttl * 3).await;
        let after = leases(&pool).await;
        let moved: Vec<_> = before
            .iter()
            .filter(|(bucket, held)| after.get(bucket) != Some(held))
            .map(|(bucket, held)| (bucket, held, after.get(bucket)))
            .collect();
        assert!(
            moved.is_empty(),
            "a step of the database's clock to {step} moved {} leases, the first {:?}",
            moved.len(),
            moved.first()
        );
        assert_eq!(buckets(&relay).await, 64, "after the step to {step}");
        wait_until(
            "both relays ship after the step",
            Duration::from_secs(30),
            || async { recorder.deliveries().len() > shipped + 100 },
        )
        .await;
    }

    // The binary relay dies, and the clock steps an hour back before its leases ran out:
    // their rows' expires_at lie an hour ahead of the new clock.
    binary.signal("-KILL");
    let killed = Instant::now();
    clock.set("-1h");
    assert!(
        offset(&pool).await < -3000.0,
        "the step back did not happen"
    );
    wait_until(
        "the other relay holds every bucket",
        Duration::from_secs(30),
        || async { buckets(&relay).await == 128 },
    )
    .await;
    let took_over = killed.elapsed();
    println!(
        "clock stepped +2h and back to +0: no lease moved; a relay killed, the clock stepped to -1h: its buckets taken over {} ms after the kill (TTL {} ms)",
        took_over.as_millis(),
        ttl.as_millis()
    );
    assert!(
        took_over <= ttl + heartbeat * 2 + Duration::from_secs(3),
        "took {took_over:?} to take over (TTL {ttl:?})"
    );

    stop.store(true, Ordering::Release);
    let expected = writer.await.unwrap();
    let deliveries = all_delivered(&pool, &recorder, count(&expected)).await;
    relay.shutdown().await;
    drop(binary);
    recorder.stop().await;
    let (extra, twice) = Recorder::duplicates(&deliveries);
    println!("{extra} deliveries twice (the killed relay's in-flight budget: 200)");
    assert!(
        extra <= 200,
        "{extra} duplicates, more than the killed relay had in flight: {twice:?}"
    );
    assert_folds_to(&deliveries, &expected);
    drop_topology(&config.rabbit_config().unwrap().topology).await;
    pool.close().await;
    drop(pair);
}
