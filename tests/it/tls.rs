//! TLS is honoured and never downgraded: PostgreSQL `sslmode` and `amqps://`.

use distribution::broker::Preflight;
use distribution::rabbit::{AmqpTls, RabbitConfig, Topology};
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
        let outcome = distribution::rabbit::preflight(&config).await;
        assert!(
            !matches!(outcome, Ok(Preflight::Ready)),
            "amqps:// connected to a plain-text port: {outcome:?}"
        );
        // The same broker in plain text, for contrast, is ready.
        let config = RabbitConfig::new(plain, topology.clone()).unwrap();
        assert_eq!(
            distribution::rabbit::preflight(&config).await.unwrap(),
            Preflight::Ready
        );
        drop_topology(&topology).await;
    });
}

/// Certificates made here: a private CA, a server certificate for 127.0.0.1 and a client
/// certificate, both signed by it.
struct Pki {
    ca_pem: String,
    server_chain: Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
    server_key: Vec<u8>,
    ca_der: tokio_rustls::rustls::pki_types::CertificateDer<'static>,
    client_cert_pem: String,
    client_key_pem: String,
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&server_key, &ca)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client = CertificateParams::new(vec!["relay".to_owned()])
        .unwrap()
        .signed_by(&client_key, &ca)
        .unwrap();
    Pki {
        ca_pem: ca.pem(),
        server_chain: vec![server.der().clone()],
        server_key: server_key.serialize_der(),
        ca_der: ca.der().clone(),
        client_cert_pem: client.pem(),
        client_key_pem: client_key.serialize_pem(),
    }
}

/// A TLS-terminating proxy in front of the real RabbitMQ that requires a client
/// certificate signed by `pki`'s CA. Returns its port.
async fn tls_proxy(pki: &Pki) -> u16 {
    use std::sync::Arc;
    use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(pki.ca_der.clone()).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(pki.server_key.clone().into());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(pki.server_chain.clone(), key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = broker_authority();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else {
                    return; // the client refused our certificate, or we refused its
                };
                let Ok(mut broker) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut broker).await;
            });
        }
    });
    port
}

fn broker_authority() -> String {
    amqp_url()
        .split_once('@')
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned()
}

/// `amqps://` through a TLS-terminating proxy with a private CA and client certificates:
/// ready only with the right CA and a client certificate; a wrong CA, no CA (the system's
/// roots do not know ours) or no client certificate are refused.
#[test]
fn amqps_trusts_a_given_ca_presents_a_client_certificate_and_refuses_a_wrong_ca() {
    host_runtime().block_on(async {
        let ours = pki();
        let theirs = pki();
        let port = tls_proxy(&ours).await;
        let topology = Topology::new(&unique("relay-mtls"), 1).unwrap();
        let url = format!("amqps://guest:guest@127.0.0.1:{port}/%2f");
        let settings = |ca: Option<&Pki>, client: Option<&Pki>| {
            let mut config = RabbitConfig::new(url.clone(), topology.clone()).unwrap();
            config.connect_timeout = std::time::Duration::from_secs(3);
            config.tls = AmqpTls {
                ca_pem: ca.map(|pki| pki.ca_pem.clone()),
                client_identity: client.map(|pki| {
                    (
                        pki.client_cert_pem.clone().into_bytes(),
                        pki.client_key_pem.clone().into_bytes(),
                    )
                }),
            };
            config
        };
        let ready = distribution::rabbit::preflight(&settings(Some(&ours), Some(&ours))).await;
        assert_eq!(
            ready.unwrap(),
            Preflight::Ready,
            "the right CA and certificate"
        );
        for (what, ca, client) in [
            ("a wrong CA", Some(&theirs), Some(&ours)),
            ("no CA (system roots only)", None, Some(&ours)),
            ("no client certificate", Some(&ours), None),
            (
                "a client certificate of another CA",
                Some(&ours),
                Some(&theirs),
            ),
        ] {
            let outcome = distribution::rabbit::preflight(&settings(ca, client)).await;
            assert!(
                !matches!(outcome, Ok(Preflight::Ready)),
                "{what}: connected anyway"
            );
        }
        drop_topology(&topology).await;
    });
}
