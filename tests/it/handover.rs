//! Lease handovers counted at the broker (every delivery, not just the fold): a planned move (a
//! relay joins and the others shed buckets toward even shares, a relay stops gracefully)
//! delivers nothing twice; a crash duplicates at most what the dead relay had in flight.

mod outbox {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use distribution::store::{Outbox, fixtures};
    use distribution::{Relay, RelayConfig, RelayHandle};
    use sqlx::PgPool;

    use crate::harness::*;
    use crate::node::{PrivateNode, Rabbit};
    use crate::recorder::{
        Recorder, all_delivered, assert_folds_to, keep_writing, writing_while_both_ship,
    };

    /// Leases on a quick clock, and a drain slow enough that a backlog is still being drained
    /// when the next relay joins (a few tenants at a time, small batches).
    fn handover_config(url: &str, topology: &str) -> RelayConfig {
        let mut config = relay_config(url, &amqp_url(), topology);
        config.supervisor.lease.ttl = Duration::from_millis(1500);
        config.supervisor.lease.heartbeat = Duration::from_millis(250);
        config.supervisor.drainer.batch_size = 20;
        config.supervisor.max_drainers = 8;
        config
    }

    async fn even_shares(relays: &[&RelayHandle], what: &str) {
        let share = 128usize.div_ceil(relays.len());
        wait_until(what, Duration::from_secs(30), || async {
            let mut total = 0;
            for relay in relays {
                let held = buckets(relay).await;
                if held + 1 < share || held > share {
                    return false;
                }
                total += held;
            }
            total == 128
        })
        .await;
    }

    /// A backlog of 60 tenants x 3 runs x `per_run` intents in `pool`, and a recorder of the
    /// topology's deliveries started before any relay; returns the intents written too.
    async fn backlog(
        pool: &PgPool,
        label: &str,
        config: &RelayConfig,
        per_run: u32,
    ) -> (Recorder, u64) {
        let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
        let written = fixtures::fill_backlog(pool, &unique(label), 60, 3, per_run, 64)
            .await
            .unwrap();
        (recorder, written)
    }

    /// A relay's first heartbeat claims half the buckets (room for a relay starting beside
    /// it, `LeasePlan::first_step`), and its second comes a quarter heartbeat later: a lone
    /// relay holds every bucket then, not a whole heartbeat (here 16 s) after it started.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_relay_holds_half_the_buckets_then_all_a_quarter_heartbeat_later() {
        let (_pool, url) = fresh_database("firstbeats").await;
        let mut config = relay_config(&url, &amqp_url(), &unique("firstbeats"));
        config.supervisor.lease.heartbeat = Duration::from_secs(16);
        config.supervisor.lease.ttl = Duration::from_secs(48);
        let relay = Relay::start(config.clone()).await.unwrap();
        let first = std::sync::atomic::AtomicUsize::new(0);
        wait_until(
            "the first heartbeat's claim",
            Duration::from_secs(10),
            || async {
                first.store(buckets(&relay).await, Ordering::SeqCst);
                first.load(Ordering::SeqCst) > 0
            },
        )
        .await;
        assert_eq!(
            first.into_inner(),
            64,
            "the first heartbeat claims half the buckets"
        );
        wait_until(
            "every bucket, well before a second full heartbeat",
            Duration::from_secs(10),
            || async { buckets(&relay).await == 128 },
        )
        .await;
        relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    }

    /// Every statement on the lease table takes 30 ms, as a commit does on a loaded disk (the
    /// lease calls commit synchronously).
    async fn slow_lease_statements(pool: &PgPool) {
        sqlx::raw_sql(
            "CREATE FUNCTION slow_lease_statement() RETURNS trigger LANGUAGE plpgsql
                 AS $$ BEGIN PERFORM pg_sleep(0.03); RETURN NULL; END $$;
             CREATE TRIGGER slow_lease_statement BEFORE UPDATE ON relay_lease
                 FOR EACH STATEMENT EXECUTE FUNCTION slow_lease_statement();",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    /// Three relays start one after another on a backlog of 60 tenants x 3 runs: the first
    /// holds every bucket, then sheds two thirds of them while their batches are in flight.
    /// Each event reaches the broker exactly once, and the shares end even. Before: 3-4%
    /// twice when the shed buckets' acks were refused at the fence (the next owner sent the
    /// same rows again); then, once in CI under load, 81 twice: a release per shed bucket
    /// (56 synchronous commits) queued ahead of the next renewal, whose fences counted from
    /// when it was commanded, so they closed by time while PostgreSQL still held the leases.
    /// With every lease statement taking 30 ms here, that failed every run (64 leases lost);
    /// now the renewal goes first, the releases are one call, and the fences count from the
    /// renewal's send.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relays_joining_a_backlog_one_after_another_deliver_each_event_once() {
        joining_one_after_another(&amqp_url()).await;
    }

    /// The same on RabbitMQ 4.0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relays_joining_a_backlog_one_after_another_deliver_each_event_once_on_rabbitmq_4_0() {
        let node = PrivateNode::start_on(Rabbit::V4_0, "join");
        joining_one_after_another(&node.url()).await;
    }

    async fn joining_one_after_another(amqp: &str) {
        let (pool, url) = fresh_database("handoverjoin").await;
        let mut config = handover_config(&url, &unique("join"));
        config.amqp_url = amqp.to_owned();
        let (recorder, written) = backlog(&pool, "jn", &config, 100).await;
        slow_lease_statements(&pool).await;
        let outbox = Outbox::new(pool.clone());

        let first = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "the first relay holds every bucket",
            Duration::from_secs(30),
            || async { buckets(&first).await == 128 },
        )
        .await;
        let second = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "the second relay holds buckets",
            Duration::from_secs(30),
            || async { buckets(&second).await > 0 },
        )
        .await;
        let third = Relay::start(config.clone()).await.unwrap();
        even_shares(&[&first, &second, &third], "even shares of three").await;
        let waiting = pending(&outbox).await;
        println!("{waiting} of {written} intents left once three relays share the backlog");
        assert!(
            waiting > 1_000,
            "the backlog must still be draining once all three share it (else no handover was tested): {waiting} left"
        );
        let deliveries = all_delivered(&pool, &recorder, written as usize).await;
        for relay in [first, second, third] {
            relay.shutdown().await;
        }
        recorder.stop().await;
        let (extra, twice) = Recorder::duplicates(&deliveries);
        assert_eq!(extra, 0, "delivered twice: {twice:?}");
        assert_eq!(deliveries.len() as u64, written);
        drop_topology_at(amqp, &config.rabbit_config().unwrap().topology).await;
    }

    /// A host writes on while each of two relays in turn stops gracefully (SIGTERM) and is
    /// started again: every planned handover (the stop, and the rebalance when it returns)
    /// delivers each event exactly once, and a consumer following WIRE.md folds exactly the
    /// host's history.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rolling_restart_while_a_host_writes_delivers_each_event_once() {
        let (pool, url) = fresh_database("handoverroll").await;
        let topology = unique("roll");
        let config = handover_config(&url, &topology);
        let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
        let mut relays = vec![
            Relay::start(config.clone()).await.unwrap(),
            Relay::start(config.clone()).await.unwrap(),
        ];
        even_shares(&[&relays[0], &relays[1]], "even shares of two").await;

        let workload = Workload::new(&unique("rl"), 6, 3, 2);
        let ran = workload.run(&pool).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
        for turn in 0..2 {
            let stopping = relays.remove(0);
            stopping.shutdown().await;
            wait_until(
                "the survivor holds every bucket",
                Duration::from_secs(30),
                || async { buckets(&relays[0]).await == 128 },
            )
            .await;
            relays.push(Relay::start(config.clone()).await.unwrap());
            even_shares(
                &[&relays[0], &relays[1]],
                &format!("even shares after turn {turn}"),
            )
            .await;
        }
        stop.store(true, Ordering::Release);
        let expected = writer.await.unwrap();
        let deliveries = all_delivered(&pool, &recorder, count(&expected)).await;
        for relay in relays {
            relay.shutdown().await;
        }
        recorder.stop().await;
        let (extra, twice) = Recorder::duplicates(&deliveries);
        assert_eq!(extra, 0, "delivered twice: {twice:?}");
        assert_folds_to(&deliveries, &expected);
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    }

    /// A relay killed mid-drain (no handover: its leases expire) loses nothing, and what it
    /// sends twice is at most what it had in flight (its relay-wide budget of events).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_relay_duplicates_at_most_what_it_had_in_flight() {
        let (pool, url) = fresh_database("handoverkill").await;
        let mut config = handover_config(&url, &unique("kill"));
        config.supervisor.max_in_flight = 200;
        let (recorder, written) = backlog(&pool, "kl", &config, 60).await;
        let doomed = Relay::start(config.clone()).await.unwrap();
        let survivor = Relay::start(config.clone()).await.unwrap();
        even_shares(&[&doomed, &survivor], "even shares of two").await;
        wait_until("the relays ship", Duration::from_secs(30), || async {
            recorder.deliveries().len() > 1_000
        })
        .await;
        doomed.abort().await;
        let deliveries = all_delivered(&pool, &recorder, written as usize).await;
        survivor.shutdown().await;
        recorder.stop().await;
        let (extra, _) = Recorder::duplicates(&deliveries);
        println!("killed relay: {extra} deliveries twice (in-flight budget 200)");
        assert!(
            extra <= config.supervisor.max_in_flight,
            "{extra} duplicates, more than the dead relay could have had in flight"
        );
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    }

    /// Lease buckets held by relays other than `relay` (read from the status view; -1 while
    /// its tree restarts).
    async fn held_by_others(pool: &PgPool, relay: &RelayHandle) -> i64 {
        let Some(tree) = relay.snapshot().await else {
            return -1;
        };
        let mine = tree.relay_id.to_string();
        sqlx::query_scalar(
            "SELECT coalesce(sum(buckets), 0)::bigint FROM relay_relays_status WHERE relay_id <> $1",
        )
        .bind(mine)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// A fault that began just now on the relay beside `other`: waits until `other` holds
    /// every bucket (returns how long that took), then lets the fault last three TTLs from
    /// its start whatever the takeover took (the fault's length, not a wait for anything).
    async fn taken_over_within_the_fault(other: &RelayHandle, ttl: Duration) -> Duration {
        let began = std::time::Instant::now();
        wait_until(
            "the other relay holds every bucket",
            Duration::from_secs(30),
            || async { buckets(other).await == 128 },
        )
        .await;
        let took_over = began.elapsed();
        tokio::time::sleep_until((began + ttl * 3).into()).await;
        took_over
    }

    /// A relay stopped (SIGSTOP, as a VM or GC pause would) for three times its lease TTL
    /// while a host writes on: the other relay takes its buckets once they expire and ships
    /// its tenants; resumed (SIGCONT), the paused relay finds its leases gone, acks nothing it
    /// no longer holds and rejoins for an even share. Nothing is lost, the fold of every
    /// delivery is the host's history, and what went out twice is at most the paused relay's
    /// in-flight budget (what it had sent before the pause). The takeover time is printed and
    /// bounded by the TTL plus two heartbeats and a margin for this 2-core machine.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_paused_past_its_lease_loses_nothing_and_resends_at_most_its_in_flight() {
        let (pool, url) = fresh_database("handoverpause").await;
        let topology = unique("pause");
        let mut config = handover_config(&url, &topology);
        config.supervisor.max_in_flight = 200;
        let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
        let ttl = config.supervisor.lease.ttl;
        let paused = Process(
            run_command(&url, &amqp_url(), &topology, &free_addr())
                .env("RELAY_LEASE_TTL_MS", ttl.as_millis().to_string())
                .env(
                    "RELAY_LEASE_HEARTBEAT_MS",
                    config.supervisor.lease.heartbeat.as_millis().to_string(),
                )
                .env("RELAY_BATCH_SIZE", "20")
                .env("RELAY_MAX_IN_FLIGHT", "200")
                .spawn()
                .unwrap(),
        );
        let other = Relay::start(config.clone()).await.unwrap();
        wait_until("even shares of two", Duration::from_secs(30), || async {
            buckets(&other).await == 64 && held_by_others(&pool, &other).await == 64
        })
        .await;
        let (stop, writer) = writing_while_both_ship(&pool, &recorder, "ps").await;

        paused.signal("-STOP");
        let took_over = taken_over_within_the_fault(&other, ttl).await;
        paused.signal("-CONT");
        wait_until(
            "the resumed relay rejoins for an even share",
            Duration::from_secs(30),
            || async { buckets(&other).await == 64 && held_by_others(&pool, &other).await == 64 },
        )
        .await;
        stop.store(true, Ordering::Release);
        let expected = writer.await.unwrap();
        let deliveries = all_delivered(&pool, &recorder, count(&expected)).await;
        other.shutdown().await;
        drop(paused);
        recorder.stop().await;

        let (extra, twice) = Recorder::duplicates(&deliveries);
        println!(
            "paused relay: buckets taken over {} ms after the pause (TTL {} ms); {extra} deliveries twice (in-flight budget 200)",
            took_over.as_millis(),
            ttl.as_millis()
        );
        assert!(
            extra <= 200,
            "{extra} duplicates, more than the paused relay had in flight: {twice:?}"
        );
        assert!(
            took_over <= ttl + config.supervisor.lease.heartbeat * 2 + Duration::from_secs(3),
            "took {took_over:?} to take over (TTL {ttl:?})"
        );
        assert_folds_to(&deliveries, &expected);
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    }

    /// A relay whose every packet to and from PostgreSQL stops without a reset (its network
    /// to the database silent, both ways; what it sends meanwhile is held and arrives late, as
    /// TCP retransmits it), while another relay reaches the database and a host writes on:
    /// for a third of the lease TTL (leases kept, nothing moves) and for three TTLs (its
    /// buckets go stale, the other relay takes them and ships; its late renewals and acks are
    /// refused by their epochs). Nothing is lost, the fold of every delivery is the host's
    /// history, what went out twice is at most its in-flight budget, and once the network is
    /// back it rejoins for an even share.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_cut_off_from_its_database_without_a_reset_loses_nothing() {
        cut_off_from_the_database("dbcut", &[Silence::Both]).await;
    }

    /// The same, one way at a time, each for three TTLs: what the relay sends is lost (held)
    /// while the database's answers to what it sent before still arrive; then what it sends
    /// arrives while no answer comes back. (Measured and printed: in the second, too, its
    /// heartbeats stop committing at once, as the pool probes a connection before each use and
    /// the first unanswered probe holds everything behind it; so far it acts as a full cut.)
    /// Either way the other relay takes its buckets over, nothing is lost, what went out twice
    /// is at most its in-flight budget per fault, and it rejoins for an even share once the
    /// network heals.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_cut_off_from_its_database_one_way_loses_nothing() {
        cut_off_from_the_database("dbway", &[Silence::Requests, Silence::Answers]).await;
    }

    /// Which way a fault of [`cut_off_from_the_database`] silences.
    #[derive(Clone, Copy, Debug)]
    enum Silence {
        /// Both ways, for a third of the TTL and then for three TTLs.
        Both,
        /// What the relay sends, for three TTLs.
        Requests,
        /// What the database answers, for three TTLs.
        Answers,
    }

    async fn cut_off_from_the_database(label: &str, faults: &[Silence]) {
        use distribution::testing::Direction;
        let (pool, url) = fresh_database(label).await;
        let topology = unique(label);
        let mut config = handover_config(&url, &topology);
        config.supervisor.max_in_flight = 200;
        let ttl = config.supervisor.lease.ttl;
        let recorder = Recorder::start(&config.rabbit_config().unwrap()).await;
        let network = distribution::testing::BrokerProxy::start(&url).unwrap();
        let mut cut_off = config.clone();
        cut_off.database_url = network.url();
        let cut = Relay::start(cut_off).await.unwrap();
        let other = Relay::start(config.clone()).await.unwrap();
        even_shares(&[&cut, &other], "even shares of two").await;
        let (stop, writer) = writing_while_both_ship(&pool, &recorder, &label[..2]).await;

        let mut report = Vec::new();
        for fault in faults {
            if let Silence::Both = fault {
                // Shorter than the TTL: the fault, for its length.
                network.silence();
                tokio::time::sleep(ttl / 3).await;
                network.restore();
                let before = recorder.deliveries().len();
                wait_until("both ship again", Duration::from_secs(30), || async {
                    recorder.deliveries().len() > before + 100
                })
                .await;
            }
            // Longer than the TTL.
            let cut_id = cut.snapshot().await.unwrap().relay_id.to_string();
            let member_beat = || async {
                sqlx::query_scalar::<_, i64>("SELECT beat FROM relay_member WHERE relay_id = $1")
                    .bind(&cut_id)
                    .fetch_optional(&pool)
                    .await
                    .unwrap()
            };
            let beat_before = member_beat().await;
            match fault {
                Silence::Both => network.silence(),
                Silence::Requests => network.silence_one_way(Direction::ToServer),
                Silence::Answers => network.silence_one_way(Direction::ToClient),
            }
            let took_over = taken_over_within_the_fault(&other, ttl).await;
            // What the cut-off relay sent that the database carried out during the fault (its
            // heartbeats: the member row's beat moves with each).
            let committed = member_beat().await != beat_before;
            network.restore();
            let restored_at = std::time::Instant::now();
            even_shares(&[&cut, &other], "even shares once the network is back").await;
            report.push(format!(
                "{fault:?}: its heartbeats {} during the fault, buckets taken over {} ms after the cut, even shares {} ms after the network came back",
                if committed { "committed" } else { "did not commit" },
                took_over.as_millis(),
                restored_at.elapsed().as_millis()
            ));
        }
        stop.store(true, Ordering::Release);
        let expected = writer.await.unwrap();
        let deliveries = all_delivered(&pool, &recorder, count(&expected)).await;
        cut.shutdown().await;
        other.shutdown().await;
        recorder.stop().await;

        let (extra, twice) = Recorder::duplicates(&deliveries);
        println!(
            "database cut without a reset (TTL {} ms): {}; {extra} deliveries twice (in-flight budget 200 per fault)",
            ttl.as_millis(),
            report.join("; ")
        );
        assert!(
            extra <= 200 * faults.len(),
            "{extra} duplicates, more than the cut-off relay had in flight: {twice:?}"
        );
        assert_folds_to(&deliveries, &expected);
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    }
}
