//! PostgreSQL itself paused (every process of a private server stopped with SIGSTOP, as a
//! frozen VM or a stalled host would be) while two relays share its outbox and a host writes
//! on: nothing answers and nothing resets, so every lease renewal stalls, both relays' fences
//! close by time and they stop publishing; once it resumes, the late renewals land, the relays
//! find what they still hold, claim the rest and ship again.
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use distribution::Relay;

use crate::harness::*;
use crate::pg_pair::{PgPair, Postgres};
use crate::recorder::{Recorder, all_delivered, assert_folds_to, writing_while_both_ship};

/// The outbox's database paused for three lease TTLs, twice: both relays stop (their fences
/// close), and within 10 s of its return they ship again and hold even shares (measured). Nothing is lost, the fold of every delivery is the host's history, and what went
/// out twice is at most both relays' in-flight budgets per pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_database_stalls_the_relays_and_they_ship_within_seconds_of_its_return() {
    let _serial = crate::failover::SERIAL.lock().await;
    let pair = tokio::task::block_in_place(|| PgPair::start(Postgres::V15, "pause"));
    let url = pair.url(pair.primary_port());
    let (pool, config) = quick_leases_on(&url, "dbpause").await;
    let ttl = config.supervisor.lease.ttl;
    let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
    let first = Relay::start(config.clone()).await.unwrap();
    let second = Relay::start(config.clone()).await.unwrap();
    let even = || async { buckets(&first).await == 64 && buckets(&second).await == 64 };
    wait_until("even shares of two", Duration::from_secs(30), even).await;
    let (stop, writer) = writing_while_both_ship(&pool, &recorder, "dp").await;

    let mut report = Vec::new();
    for _ in 0..2 {
        tokio::task::block_in_place(|| pair.pause_primary());
        // The pause, for its length (not a wait for anything).
        tokio::time::sleep(ttl * 3).await;
        let stalled = recorder.deliveries().len();
        tokio::task::block_in_place(|| pair.resume_primary());
        let resumed = Instant::now();
        wait_until("shipping again", Duration::from_secs(30), || async {
            recorder.deliveries().len() > stalled + 100
        })
        .await;
        let shipping = resumed.elapsed();
        wait_until("even shares again", Duration::from_secs(30), even).await;
        let shares = resumed.elapsed();
        report.push(format!(
            "shipping again {} ms and even shares {} ms after the return",
            shipping.as_millis(),
            shares.as_millis()
        ));
        assert!(
            shipping <= Duration::from_secs(10),
            "shipping again only {shipping:?} after the database returned"
        );
    }

    stop.store(true, Ordering::Release);
    let expected = writer.await.unwrap();
    let deliveries = all_delivered(&pool, &recorder, count(&expected)).await;
    first.shutdown().await;
    second.shutdown().await;
    recorder.stop().await;
    let (extra, twice) = Recorder::duplicates(&deliveries);
    println!(
        "database paused 3 TTLs (TTL {} ms), twice: {}; {extra} deliveries twice",
        ttl.as_millis(),
        report.join("; ")
    );
    assert!(
        extra <= 2 * 200 * 2,
        "{extra} duplicates, more than two relays had in flight in two pauses: {twice:?}"
    );
    assert_folds_to(&deliveries, &expected);
    drop_topology(&config.rabbit_config().unwrap().topology).await;
    pool.close().await;
    drop(pair);
}
