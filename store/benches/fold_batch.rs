//! What `relay_fold_batch` saves over one `relay_fold` call per delivery, on this machine's
//! PostgreSQL, side by side in one run: the same in-order history (BENCH_BRANCHES branches,
//! default 64, of BENCH_EVENTS intents in all, default 40,000, 64-byte bodies) folded in
//! transactions of BENCH_BATCH deliveries (default 128) by one connection, once with one
//! `relay_fold` call per delivery (as the Rust consumer and WIRE.md's "Several deliveries in
//! one transaction" do) and once with one `relay_fold_batch` call per transaction (as the
//! Python example does), each in a fresh fold database, BENCH_TURNS turns each (default 3),
//! alternating. Prints deliveries/s per turn, the medians and their ratio, and PostgreSQL's CPU
//! per 1,000 deliveries (its backends' utime + stime from /proc, where readable).
//!
//! `cargo bench -p store --bench fold_batch`
use std::time::Instant;

use sqlx::{Connection, PgConnection};

mod support;
use support::{database, drop_database, setting};

/// CPU time (ms) of the backend serving `conn`, from /proc (None where unreadable).
async fn backend_cpu_ms(conn: &mut PgConnection) -> Option<f64> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks * 10.0) // USER_HZ is 100 here
}

/// The history, in delivery order: (branch, lsn), round-robin over the branches.
fn history(branches: u64, events: u64) -> Vec<(String, i64)> {
    (0..events)
        .map(|n| (format!("b{}", n % branches), (n / branches + 1) as i64))
        .collect()
}

const SINGLE: &str =
    "SELECT action FROM relay_fold('t', 'r', $1, 'intent', $2, $3, 0, NULL, NULL, now(), $4)";
const BATCH: &str = "SELECT action FROM relay_fold_batch(array_fill('t'::text, ARRAY[$5]), \
     array_fill('r'::text, ARRAY[$5]), $1, array_fill('intent'::text, ARRAY[$5]), $2, $3, \
     array_fill(0::bigint, ARRAY[$5]), array_fill(NULL::text, ARRAY[$5]), \
     array_fill(NULL::text, ARRAY[$5]), array_fill(now(), ARRAY[$5]), $4)";

/// Folds `history` in transactions of `batch`; returns (deliveries/s, backend CPU ms per 1,000).
async fn turn(batched: bool, history: &[(String, i64)], batch: usize) -> (f64, Option<f64>) {
    let (pool, name) = database(if batched { "foldbatch" } else { "foldsingle" }, true).await;
    let mut conn = pool.acquire().await.expect("bench connection").detach();
    let body = vec![b'x'; 64];
    let cpu_before = backend_cpu_ms(&mut conn).await;
    let started = Instant::now();
    for chunk in history.chunks(batch) {
        let mut tx = conn.begin().await.expect("begin");
        if batched {
            let branches: Vec<&str> = chunk.iter().map(|(b, _)| b.as_str()).collect();
            let lsns: Vec<i64> = chunk.iter().map(|(_, l)| *l).collect();
            let prevs: Vec<i64> = lsns.iter().map(|l| l - 1).collect();
            let bodies: Vec<&[u8]> = chunk.iter().map(|_| body.as_slice()).collect();
            let actions: Vec<String> = sqlx::query_scalar(BATCH)
                .bind(&branches)
                .bind(&lsns)
                .bind(&prevs)
                .bind(&bodies)
                .bind(chunk.len() as i32)
                .fetch_all(&mut *tx)
                .await
                .expect("relay_fold_batch");
            assert!(actions.iter().all(|a| a == "apply"), "{actions:?}");
        } else {
            for (branch, lsn) in chunk {
                let action: String = sqlx::query_scalar(SINGLE)
                    .bind(branch)
                    .bind(lsn)
                    .bind(lsn - 1)
                    .bind(&body)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("relay_fold");
                assert_eq!(action, "apply");
            }
        }
        tx.commit().await.expect("commit");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = match (cpu_before, backend_cpu_ms(&mut conn).await) {
        (Some(before), Some(after)) => Some((after - before) * 1000.0 / history.len() as f64),
        _ => None,
    };
    drop(conn);
    pool.close().await;
    drop_database(&name).await;
    (history.len() as f64 / elapsed, cpu)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn main() {
    let branches = setting("BENCH_BRANCHES", 64);
    let events = setting("BENCH_EVENTS", 40_000);
    let batch = setting("BENCH_BATCH", 128) as usize;
    let turns = setting("BENCH_TURNS", 3);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let history = history(branches, events);
        println!(
            "# {events} in-order intents over {branches} branches, {batch} per transaction, one connection"
        );
        let (mut single, mut batched) = (Vec::new(), Vec::new());
        let (mut single_cpu, mut batched_cpu) = (Vec::new(), Vec::new());
        for n in 0..turns {
            let (rate, cpu) = turn(false, &history, batch).await;
            println!("turn {n}: relay_fold per delivery   {rate:>8.0} deliveries/s, PostgreSQL {cpu:.0?} ms CPU per 1,000");
            single.push(rate);
            single_cpu.extend(cpu);
            let (rate, cpu) = turn(true, &history, batch).await;
            println!("turn {n}: relay_fold_batch per batch {rate:>8.0} deliveries/s, PostgreSQL {cpu:.0?} ms CPU per 1,000");
            batched.push(rate);
            batched_cpu.extend(cpu);
        }
        let (single, batched) = (median(single), median(batched));
        println!(
            "median: per delivery {single:.0}/s, batched {batched:.0}/s, batched / per delivery {:.2}",
            batched / single
        );
        if !single_cpu.is_empty() && !batched_cpu.is_empty() {
            println!(
                "median PostgreSQL CPU per 1,000 deliveries: per delivery {:.0} ms, batched {:.0} ms",
                median(single_cpu),
                median(batched_cpu)
            );
        }
    });
}
