//! A TCP proxy between the relay and the real broker (or database) that its owner can cut,
//! restore and point elsewhere.
//!
//! This is how a broker outage is staged without stopping the machine's RabbitMQ: the relay
//! talks to the proxy; `cut` drops every connection and refuses new ones until `restore`.
//! A failover is staged the same way: `retarget` points it at the promoted standby (sqlx
//! takes one host). It runs on its own thread, so a stalled caller runtime does not stall it.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One direction through a [`BrokerProxy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the client (the relay) to the server.
    ToServer,
    /// From the server back to the client.
    ToClient,
}

/// A TCP proxy to a broker.
#[derive(Debug)]
pub struct BrokerProxy {
    addr: SocketAddr,
    upstream_url: String,
    /// Where new connections go (`host:port`).
    upstream: Arc<Mutex<String>>,
    up: Arc<AtomicBool>,
    /// Connections stay open but nothing passes toward the server (packets dropped one way).
    silent_up: Arc<AtomicBool>,
    /// Nothing passes toward the client.
    silent_down: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// One flag per connection opened so far: set, that connection drops every byte for good.
    frozen: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl BrokerProxy {
    /// A proxy in front of the broker of `amqp_url` (`amqp://user:pass@host:port/vhost`), up.
    pub fn start(amqp_url: &str) -> std::io::Result<Self> {
        let authority = amqp_url
            .split_once("://")
            .map(|(_, rest)| rest)
            .and_then(|rest| rest.rsplit_once('@').map(|(_, host)| host).or(Some(rest)))
            .and_then(|rest| rest.split('/').next())
            .filter(|authority| !authority.is_empty())
            .ok_or_else(|| std::io::Error::other(format!("no host in {amqp_url:?}")))?
            .to_owned();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("broker-proxy")
            .enable_all()
            .build()?;
        // Bound with std so `start` works from inside any runtime (no `block_on`).
        let upstream = Arc::new(Mutex::new(authority));
        let accept_upstream = upstream.clone();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let up = Arc::new(AtomicBool::new(true));
        let silent_up = Arc::new(AtomicBool::new(false));
        let silent_down = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let frozen: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let (accept_up, accept_links) = (up.clone(), links.clone());
        let accept_silent = (silent_up.clone(), silent_down.clone());
        let accept_frozen = frozen.clone();
        let handle = runtime.handle().clone();
        runtime.spawn(async move {
            let Ok(listener) = TcpListener::from_std(std_listener) else {
                return;
            };
            while let Ok((mut client, _)) = listener.accept().await {
                if !accept_up.load(Ordering::SeqCst) {
                    continue; // dropped: the broker is "down"
                }
                let upstream = accept_upstream
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner())
                    .clone();
                let (silent_up, silent_down) = accept_silent.clone();
                let lost = Arc::new(AtomicBool::new(false));
                {
                    let mut frozen = accept_frozen
                        .lock()
                        .unwrap_or_else(|poison| poison.into_inner());
                    frozen.retain(|flag| Arc::strong_count(flag) > 1);
                    frozen.push(lost.clone());
                }
                let link = handle.spawn(async move {
                    if silent_up.load(Ordering::SeqCst) || silent_down.load(Ordering::SeqCst) {
                        // Accept, then swallow everything: no handshake ever completes (one
                        // way lost is enough for that).
                        let mut sink = tokio::io::sink();
                        let _ = tokio::io::copy(&mut client, &mut sink).await;
                        return;
                    }
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::join!(
                            forward(client_read, server_write, silent_up, lost.clone()),
                            forward(server_read, client_write, silent_down, lost),
                        );
                    }
                });
                let mut links = accept_links
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner());
                links.retain(|link| !link.is_finished());
                links.push(link);
            }
        });
        let upstream_url = amqp_url.to_owned();
        Ok(Self {
            addr,
            upstream_url,
            upstream,
            up,
            silent_up,
            silent_down,
            links,
            frozen,
            runtime: Some(runtime),
        })
    }

    /// Makes the broker silent: open connections stay open but nothing passes either way, and
    /// new ones are accepted and never answered (a network dropping packets). What is sent
    /// meanwhile is held, not dropped, and passes in order on `restore`, as TCP retransmits
    /// it once the network heals: a live TCP stream has delays, never gaps. (Dropping bytes
    /// mid-stream made the broker number the publishes after the gap as the ones lost in it,
    /// so their acks confirmed messages it never had: a loss no real network can cause.)
    pub fn silence(&self) {
        self.silent_up.store(true, Ordering::SeqCst);
        self.silent_down.store(true, Ordering::SeqCst);
    }

    /// [`BrokerProxy::silence`] in one `direction` only: what the client sends still arrives
    /// ([`Direction::ToClient`] silent: the server acts on requests whose answers never come
    /// back), or the answers to what arrived before still come back ([`Direction::ToServer`]).
    /// New connections are accepted and never answered, as a handshake needs both ways.
    pub fn silence_one_way(&self, direction: Direction) {
        match direction {
            Direction::ToServer => self.silent_up.store(true, Ordering::SeqCst),
            Direction::ToClient => self.silent_down.store(true, Ordering::SeqCst),
        }
    }

    /// Every connection open now goes silent for good, both ways, while new ones pass: a
    /// middlebox (NAT, firewall) that lost their state and drops their packets without a
    /// reset. Neither side learns when the other closes. `restore` does not bring them back;
    /// `cut` closes them.
    pub fn lose_open_connections(&self) {
        let frozen = self
            .frozen
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for flag in frozen.iter() {
            flag.store(true, Ordering::SeqCst);
        }
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The upstream URL with its host and port replaced by the proxy's.
    pub fn amqp_url(&self) -> String {
        self.url()
    }

    /// The upstream URL (any scheme: `amqp://`, `postgres://`) with its host and port replaced
    /// by the proxy's.
    pub fn url(&self) -> String {
        let (scheme, rest) = self
            .upstream_url
            .split_once("://")
            .unwrap_or(("amqp", &self.upstream_url));
        let (credentials, host_and_path) = match rest.rsplit_once('@') {
            Some((credentials, host)) => (format!("{credentials}@"), host),
            None => (String::new(), rest),
        };
        let path = host_and_path
            .find('/')
            .map(|at| &host_and_path[at..])
            .unwrap_or("/%2f");
        format!("{scheme}://{credentials}{}{path}", self.addr)
    }

    /// Takes the broker down: drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        let mut links = self
            .links
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for link in links.drain(..) {
            link.abort();
        }
    }

    /// Points new connections at `authority` (`host:port`) and drops every open one: what a
    /// failover does to clients of a virtual address (the old server's sessions end, new ones
    /// reach the promoted standby).
    pub fn retarget(&self, authority: &str) {
        *self
            .upstream
            .lock()
            .unwrap_or_else(|poison| poison.into_inner()) = authority.to_owned();
        let mut links = self
            .links
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for link in links.drain(..) {
            link.abort();
        }
    }

    /// Brings the broker back (from a cut or from silence).
    pub fn restore(&self) {
        self.silent_up.store(false, Ordering::SeqCst);
        self.silent_down.store(false, Ordering::SeqCst);
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, holding what it reads while `silent` (and reading no more, so the
/// sender's window fills), dropping everything once `lost`; ends when either side closes.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    silent: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            // A lost connection hides its end too: the other side never learns of it.
            Ok(0) | Err(_) if lost.load(Ordering::SeqCst) => std::future::pending().await,
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        // Held while silent: polled, as nothing else wakes a test tool's forwarding loop.
        while silent.load(Ordering::SeqCst) && !lost.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        if lost.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

impl Drop for BrokerProxy {
    fn drop(&mut self) {
        self.cut();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
