//! The ranges of the numeric settings, once: clap refuses a value outside them at the door
//! (`settings.rs`), and [`super::RelayConfig::validate`] refuses the same for a host that
//! builds its configuration in code.
use std::ops::RangeInclusive;
use std::time::Duration;

use super::ConfigError;

/// A setting's variable and the values it takes, inclusive.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bound {
    pub(crate) var: &'static str,
    min: i64,
    max: i64,
}

impl Bound {
    const fn new(var: &'static str, min: i64, max: i64) -> Self {
        Self { var, min, max }
    }

    /// The range, for clap's `value_parser!(..).range(..)`.
    pub(crate) const fn range(&self) -> RangeInclusive<i64> {
        self.min..=self.max
    }

    /// The range of a `u64` setting (every minimum here is at least 0).
    pub(crate) const fn range_u64(&self) -> RangeInclusive<u64> {
        self.min as u64..=self.max as u64
    }

    /// `value` if within the range, else the error naming the variable.
    pub(crate) fn check(
        &self,
        value: impl TryInto<i64> + ToString + Copy,
    ) -> Result<(), ConfigError> {
        match value.try_into() {
            Ok(number) if self.range().contains(&number) => Ok(()),
            _ => Err(ConfigError::Invalid {
                var: self.var,
                value: value.to_string(),
                reason: format!("must be {} to {}", self.min, self.max),
            }),
        }
    }

    /// [`Bound::check`] of a duration in milliseconds.
    pub(crate) fn check_ms(&self, value: Duration) -> Result<(), ConfigError> {
        self.check(u64::try_from(value.as_millis()).unwrap_or(u64::MAX))
    }
}

pub(crate) const PARTITIONS: Bound = Bound::new("RELAY_PARTITIONS", 1, 1024);
pub(crate) const SHARDS: Bound = Bound::new("RELAY_SHARDS", 1, 256);
pub(crate) const BATCH_SIZE: Bound = Bound::new("RELAY_BATCH_SIZE", 1, 100_000);
pub(crate) const BATCHES_IN_FLIGHT: Bound = Bound::new("RELAY_BATCHES_IN_FLIGHT", 1, 64);
pub(crate) const BATCH_MAX_BYTES: Bound = Bound::new("RELAY_BATCH_MAX_BYTES", 1024, 256 << 20);
pub(crate) const POLL_MS: Bound = Bound::new("RELAY_POLL_MS", 10, 3_600_000);
pub(crate) const LEASE_TTL_MS: Bound = Bound::new("RELAY_LEASE_TTL_MS", 150, 600_000);
pub(crate) const LEASE_HEARTBEAT_MS: Bound = Bound::new("RELAY_LEASE_HEARTBEAT_MS", 50, 200_000);
pub(crate) const PARK_AFTER_ATTEMPTS: Bound = Bound::new("RELAY_PARK_AFTER_ATTEMPTS", 1, 1_000_000);
pub(crate) const THREADS: Bound = Bound::new("RELAY_THREADS", 1, 256);
pub(crate) const DB_CONNECTIONS: Bound = Bound::new("RELAY_DB_CONNECTIONS", 2, 1000);
pub(crate) const AMQP_CONNECT_TIMEOUT_MS: Bound =
    Bound::new("RELAY_AMQP_CONNECT_TIMEOUT_MS", 100, 600_000);
pub(crate) const AMQP_CONFIRM_TIMEOUT_MS: Bound =
    Bound::new("RELAY_AMQP_CONFIRM_TIMEOUT_MS", 100, 600_000);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_outside_its_range_names_the_variable_and_the_range() {
        assert!(SHARDS.check(1u16).is_ok() && SHARDS.check(256u16).is_ok());
        let err = SHARDS.check(0u16).unwrap_err().to_string();
        assert_eq!(err, "RELAY_SHARDS=\"0\" is invalid: must be 1 to 256");
        assert!(POLL_MS.check_ms(Duration::from_millis(9)).is_err());
        assert!(DB_CONNECTIONS.check(u32::MAX).is_err());
        assert!(
            BATCH_SIZE.check(usize::MAX).is_err(),
            "too large for i64 is out of range"
        );
    }
}
