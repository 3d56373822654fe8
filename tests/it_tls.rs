//! TLS is honoured and never downgraded: PostgreSQL `sslmode` and `amqps://`.
#[path = "support/harness.rs"]
mod harness;

mod tls {
    use distribution::broker::{Preflight, RabbitConfig, Topology};
    use sqlx::{Connection, PgConnection};

    use crate::harness::*;

    fn with_query(url: &str, query: &str) -> String {
        format!("{url}{}{query}", if url.contains('?') { '&' } else { '?' })
    }

    /// `sslmode=require` encrypts (PostgreSQL says so), and `verify-full` with a certificate
    /// no system root signed is refused: never a silent fall back to plain text.
    #[test]
    fn postgres_sslmode_is_honoured() {
        host_runtime().block_on(async {
            let url = std::env::var("DATABASE_URL").unwrap();
            let mut tls = PgConnection::connect(&with_query(&url, "sslmode=require"))
                .await
                .expect("this machine's PostgreSQL has TLS on");
            let encrypted: bool =
                sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                    .fetch_one(&mut tls)
                    .await
                    .unwrap();
            assert!(encrypted, "sslmode=require connected in plain text");
            let refused = PgConnection::connect(&with_query(&url, "sslmode=verify-full")).await;
            assert!(refused.is_err(), "an untrusted certificate was accepted");
            let mut plain = PgConnection::connect(&with_query(&url, "sslmode=disable"))
                .await
                .unwrap();
            let encrypted: bool =
                sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                    .fetch_one(&mut plain)
                    .await
                    .unwrap();
            assert!(!encrypted);
        });
    }

    /// `amqps://` speaks TLS: pointed at a plain-text AMQP port it fails instead of falling
    /// back to plain AMQP (and so never reports Ready).
    #[test]
    fn amqps_never_falls_back_to_plain_text() {
        host_runtime().block_on(async {
            let plain = amqp_url();
            let authority = plain
                .split_once('@')
                .map(|(_, rest)| rest)
                .and_then(|rest| rest.split('/').next())
                .unwrap();
            let topology = Topology::new(&unique("relay-tls"), 1).unwrap();
            let mut config = RabbitConfig::new(
                format!("amqps://guest:guest@{authority}/%2f"),
                topology.clone(),
            )
            .unwrap();
            config.connect_timeout = std::time::Duration::from_secs(2);
            let outcome = distribution::broker::preflight(&config).await;
            assert!(
                !matches!(outcome, Ok(Preflight::Ready)),
                "amqps:// connected to a plain-text port: {outcome:?}"
            );
            // The same broker in plain text, for contrast, is ready.
            let config = RabbitConfig::new(plain, topology.clone()).unwrap();
            assert_eq!(
                distribution::broker::preflight(&config).await.unwrap(),
                Preflight::Ready
            );
            drop_topology(&topology).await;
        });
    }
}
