//! What the bench reads from /proc (CPU ticks, RSS) and its summaries (percentiles, min/median/max).
use super::*;

/// CPU ticks (user + system, 1/100 s) so far of every process whose name starts with `name`
/// (`beam` for RabbitMQ, `postgres` for the server and its backends): processes that end
/// meanwhile are not counted, so this is a lower bound.
pub(crate) fn cpu_ticks_named(name: &str) -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (head, tail) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1;
            if !comm.starts_with(name) {
                return None;
            }
            let fields: Vec<&str> = tail.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

/// Waits until RabbitMQ and PostgreSQL together use under a tenth of a core for half a second
/// (at most 30 s), so that a timed run does not pay for the background work the run before it
/// left (RabbitMQ collecting a deleted queue's message files, PostgreSQL writing pages back):
/// what `CHECKPOINT` does for PostgreSQL alone. Returns how long it waited.
pub(crate) async fn servers_quiet() -> Duration {
    let started = Instant::now();
    let busy = || cpu_ticks_named("beam") + cpu_ticks_named("postgres");
    let mut last = busy();
    while started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = busy();
        if now.saturating_sub(last) <= 5 {
            break;
        }
        last = now;
    }
    started.elapsed()
}

/// What PostgreSQL's CPU spends on `VACUUM relay_outbox` on `pool` (its table and TOAST), in
/// ticks: the work a run's deletes left for autovacuum, paid now and measured.
pub(crate) async fn vacuum_ticks(pool: &PgPool) -> Result<u64> {
    let before = cpu_ticks_named("postgres");
    sqlx::raw_sql("VACUUM relay_outbox").execute(pool).await?;
    Ok(cpu_ticks_named("postgres") - before)
}

pub(crate) fn min_median_max(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (
        values[0],
        values[values.len() / 2],
        values[values.len() - 1],
    )
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The machine's CPU time so far, in ticks: stolen by the hypervisor, and in all.
pub(crate) fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice, counted in user]
    Some((*ticks.get(7)?, ticks.iter().take(8).sum()))
}

pub(crate) fn proc_status_kb(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|line| line.starts_with(field))
        .context("no such field")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("no value")?
        .parse()?)
}

pub(crate) fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_name = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat; 12 and 13 after the name.
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}
