//! Times as a person reads them on the console's pages: an age and a wall-clock time.
use std::time::Duration;

/// A duration as a person reads it: `850 ms`, `12 s`, `4 min 5 s`, `3 h 20 min`.
pub fn age(duration: Duration) -> String {
    let secs = duration.as_secs();
    match secs {
        0 => format!("{} ms", duration.as_millis()),
        1..60 => format!("{secs} s"),
        60..3600 => format!("{} min {} s", secs / 60, secs % 60),
        _ => format!("{} h {} min", secs / 3600, secs % 3600 / 60),
    }
}

/// A wall-clock time as a person reads it: `2026-12-05 19:03:12 UTC`.
pub fn clock(at: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(at)
        .format("%Y-%m-%d %H:%M:%S UTC")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_a_person_reads_them() {
        assert_eq!(age(Duration::from_millis(850)), "850 ms");
        assert_eq!(age(Duration::from_secs(12)), "12 s");
        assert_eq!(age(Duration::from_secs(245)), "4 min 5 s");
        assert_eq!(age(Duration::from_secs(12_000)), "3 h 20 min");
    }
}
