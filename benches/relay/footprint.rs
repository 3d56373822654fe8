//! What the relay costs at rest and at scale: many tenants, peak RSS (5), idle queries and CPU (6).
use super::*;

/// Section 11: `tenants` tenants x 2 intents drained by the standalone relay while a host
/// appends beside it; then the same relay idle with that many tenants seen.
/// Returns (drain ev/s, peak RSS MB, host appends, host appends refused, idle queries/s,
/// idle CPU %, idle RSS MB).
pub(crate) async fn many_tenants(
    env: &mut Env,
    tenants: u32,
    idle_secs: u64,
) -> Result<(f64, u64, u64, u64, f64, f64, u64)> {
    let (pool, url) = env.database("many").await?;
    let rabbit = env.rabbit("many", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "m", tenants, 1, 2, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    let started = Instant::now();
    // The host, beside the relay: one transaction per append, counting what PostgreSQL refuses.
    let host = {
        let pool = pool.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let writer = IntentWriter::default();
            let key = BranchKey::new(
                TenantId::new("host-beside").expect("valid id"),
                RunId::new("r").expect("valid id"),
                BranchId::new("main").expect("valid id"),
            );
            let (mut appended, mut refused) = (0u64, 0u64);
            if writer
                .open_run(&mut pool.acquire().await.expect("conn"), &key)
                .await
                .is_err()
            {
                return (0, 1);
            }
            let mut lsn = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                lsn += 1;
                let result = async {
                    let mut tx = pool.begin().await?;
                    writer.append(&mut tx, &key, Lsn::new(lsn), b"host").await?;
                    tx.commit().await?;
                    anyhow::Ok(())
                }
                .await;
                match result {
                    Ok(()) => appended += 1,
                    Err(_) => {
                        refused += 1;
                        lsn -= 1;
                    }
                }
            }
            (appended, refused)
        });
        (stop, task)
    };
    // Drained: the backlog's tenants, not the host's own, which keeps writing meanwhile.
    let drained = async {
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            let left: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM relay_outbox WHERE tenant_id <> 'host-beside')",
            )
            .fetch_one(&pool)
            .await?;
            if !left {
                return anyhow::Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "backlog not drained");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    .await;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    host.0.store(true, std::sync::atomic::Ordering::Relaxed);
    let (appended, refused) = host.1.await?;
    drained?;
    let peak = proc_status_kb(child.id(), "VmHWM")? / 1024;
    // Idle with every tenant seen: as in section 6, after PostgreSQL's statistics settle.
    let database = url.rsplit_once('/').context("url")?.1.to_owned();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(&mut env.admin, &database).await?;
    let cpu_before = cpu_ticks(child.id())?;
    let idle_started = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let after = transactions(&mut env.admin, &database).await?;
    let cpu_after = cpu_ticks(child.id())?;
    let elapsed = idle_started.elapsed().as_secs_f64();
    let idle_rss = proc_status_kb(child.id(), "VmRSS")? / 1024;
    child.kill()?;
    child.wait()?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    let qps = (after - before) as f64 / elapsed;
    let cpu = (cpu_after - cpu_before) as f64 / 100.0 / elapsed * 100.0;
    Ok((rate, peak, appended, refused, qps, cpu, idle_rss))
}

/// 5. Peak RSS (VmHWM) of the standalone relay draining a backlog of 50 x 20 x `per_run`.
pub(crate) async fn peak_rss(env: &mut Env, per_run: u32) -> Result<(u64, f64)> {
    let (pool, url) = env.database("rss").await?;
    let rabbit = env.rabbit("rss", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    let started = Instant::now();
    let drained = wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let peak = proc_status_kb(child.id(), "VmHWM");
    child.kill()?;
    child.wait()?;
    drained?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((peak? / 1024, written as f64 / elapsed))
}

/// 6. Queries per second and CPU of the standalone relay holding `tenants` idle tenants.
pub(crate) async fn idle(env: &mut Env, tenants: u32, seconds: u64) -> Result<(f64, f64)> {
    let (pool, url) = env.database("idle").await?;
    let rabbit = env.rabbit("idle", 8)?;
    store::fixtures::fill_backlog(&pool, "idle", tenants, 1, 1, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(120)).await?;
    pool.close().await;
    let database = url.rsplit_once('/').context("url")?.1.to_owned();
    // A measurement window, not synchronisation: PostgreSQL 15 backends flush their statistics
    // up to 10 s after going idle (PGSTAT_IDLE_INTERVAL), so wait that out or the drain that
    // just finished is counted as idle load.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(&mut env.admin, &database).await?;
    let cpu_before = cpu_ticks(child.id())?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let after = transactions(&mut env.admin, &database).await?;
    let cpu_after = cpu_ticks(child.id())?;
    let elapsed = started.elapsed().as_secs_f64();
    child.kill()?;
    child.wait()?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    let ticks_per_second = 100.0; // USER_HZ on Linux
    let cpu_percent = (cpu_after - cpu_before) as f64 / ticks_per_second / elapsed * 100.0;
    Ok(((after - before) as f64 / elapsed, cpu_percent))
}
