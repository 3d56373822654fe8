//! Opening AMQP connections: extra TLS trust and client certificates for `amqps://`, and
//! lapin's returned-message log kept from every subscriber.
//!
//! lapin 4.12 logs each message the broker returns at WARN with its whole `Debug`, payload
//! included (`returned_messages.rs`), and every incoming frame at TRACE (`channels.rs`, field
//! `frame`: a delivery's or a return's body bytes), on its own I/O thread (`lapin-io-loop`);
//! frames discarded after a connection failure are logged at TRACE too (`frames.rs`, fields
//! `frame`/`frames`). A filter in the host's subscriber would be the host's job and is easily
//! missed, so the relay connects through [`lapin::Connection::connector`], whose transport
//! closure runs on that I/O thread, and installs there a thread-local dispatcher that
//! forwards everything to the process's dispatcher except those events. The relay's own
//! runtime threads get the same dispatcher ([`quiet_lapin_payload_logs_on_this_thread`]).
use std::cell::Cell;
use std::sync::{LazyLock, OnceLock};

use lapin::tcp::{AMQPUriTcpExt, OwnedIdentity, OwnedTLSConfig};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::{Interest, Subscriber};
use tracing::{Dispatch, Event, Metadata};

/// The target of lapin's returned-message log line.
const RETURNED_MESSAGES: &str = "lapin::returned_messages";
/// Fields in which lapin logs whole frames (their bodies are payloads).
const FRAME_FIELDS: [&str; 2] = ["frame", "frames"];

/// TLS settings for `amqps://` besides the URL (which alone turns TLS on, verified against the
/// system's roots; never downgraded to plain text).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AmqpTls {
    /// PEM certificates trusted in addition to the system's roots (a private CA).
    pub ca_pem: Option<String>,
    /// PEM certificate chain and PEM private key presented to the broker (mutual TLS).
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpTls")
            .field("ca_pem", &self.ca_pem.as_ref().map(|pem| pem.len()))
            .field("client_identity", &self.client_identity.is_some())
            .finish()
    }
}

impl AmqpTls {
    pub(crate) fn owned(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .client_identity
                .as_ref()
                .map(|(pem, key)| OwnedIdentity::PKCS8 {
                    pem: pem.clone(),
                    key: key.clone(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }
}

/// The frame size the relay asks for unless the URL sets `frame_max`. lapin keeps a send and a
/// receive buffer of 32 frames per connection (`io_loop.rs`, `FRAMES_STORAGE`): at RabbitMQ's
/// default of 128 KiB that is 8 MiB of memory per connection; at 32 KiB, 2 MiB. Measured: a
/// standalone relay draining 100,000 intents peaked at 106 MB with 128 KiB frames and 45 MB
/// with 32 KiB.
pub const DEFAULT_FRAME_MAX: u32 = 32 * 1024;

/// A lapin connection that is closed when it is dropped, whatever its channels and consumers
/// are doing: a session abandoned at any await (a task aborted, a step timed out) leaves
/// nothing open on the broker.
///
/// Two defects of lapin 4.12.3 (the newest release) decide its shape:
/// - lapin closes a dropped connection only once every handle on its channels is gone, and a
///   `basic.consume` whose future is dropped before its `consume-ok` arrives breaks that:
///   lapin then registers the consumer with a handle on its channel and without the canceller
///   a returned consumer gets (`channel.rs`, `on_basic_consume_ok_received`; `consumer.rs`,
///   `external`). So the connection is closed explicitly, never left to its handles.
/// - a lock-order deadlock. lapin's I/O thread handles a delivery's body holding the channel's
///   status lock and then takes the consumers' lock (`channel_status.rs`, `receive`;
///   `consumers.rs`, `handle_body_frame`); its RPC task drains the consumers holding their
///   lock (`consumers.rs`, `error`), and when the drained consumer was the last handle on its
///   channel, dropping it takes the channel's status lock (`channel_closer.rs`). A consumer
///   dropped while deliveries stream in (its `basic.cancel` then fails on the closing
///   connection and errors it) deadlocks both: the connection stays open with its prefetch of
///   unacked messages, and two runtime threads block for good. Seen about 1 kill in 4 (gdb:
///   the I/O thread in `Consumers::read`, a worker in `ChannelCloser::drop` under
///   `Consumers::error`). Hence [`ClosingConnection::hold`]: the connection keeps handles on
///   its channels and consumers, and drops them only after its close has completed, when
///   lapin has drained its consumers and reads no more frames; lapin's own drops are then
///   never the last.
pub struct ClosingConnection {
    /// `None` only while it is dropped.
    connection: Option<Connection>,
    /// Handles on the connection's channels and consumers, by name (see `hold`).
    held: Vec<(&'static str, Box<dyn Send + Sync>)>,
}

impl std::fmt::Debug for ClosingConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held: Vec<&str> = self.held.iter().map(|(name, _)| *name).collect();
        f.debug_struct("ClosingConnection")
            .field("connection", &self.connection)
            .field("held", &held)
            .finish()
    }
}

impl std::ops::Deref for ClosingConnection {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.connection
            .as_ref()
            .expect("a connection is taken only by its drop")
    }
}

impl ClosingConnection {
    fn new(connection: Connection) -> Self {
        Self {
            connection: Some(connection),
            held: Vec::new(),
        }
    }

    /// Keeps `handle` (a clone of one of this connection's channels or consumers) until the
    /// connection has closed; a handle held under the same `name` before is dropped now (hold
    /// a replaced channel's handles only while it is open). Hold every consumer a session
    /// makes, and its channel: see the type's documentation.
    pub fn hold(&mut self, name: &'static str, handle: impl Send + Sync + 'static) {
        let handle: Box<dyn Send + Sync> = Box::new(handle);
        match self.held.iter_mut().find(|(held, _)| *held == name) {
            Some(slot) => slot.1 = handle,
            None => self.held.push((name, handle)),
        }
    }
}

impl Drop for ClosingConnection {
    fn drop(&mut self) {
        use futures_util::FutureExt;
        let Some(connection) = self.connection.take() else {
            return;
        };
        let held = std::mem::take(&mut self.held);
        match tokio::runtime::Handle::try_current() {
            // The close is awaited on a task of its own (bounded by the connection's heartbeat:
            // a silent broker fails the connection, which completes the close), and only then
            // are the handles dropped.
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = connection.close(200, "closed".into()).await;
                    drop(held);
                });
            }
            // Outside a runtime (a process ending): the close is handed to lapin's I/O thread
            // on the first poll (it fails at once if the connection is no longer open), not
            // awaited.
            Err(_) => {
                let _ = connection.close(200, "closed".into()).now_or_never();
                drop(held);
            }
        }
    }
}

/// Connects to `uri` with `tls`; lapin's I/O thread never logs a returned payload.
pub(crate) async fn connect(
    uri: &str,
    tls: &AmqpTls,
    properties: ConnectionProperties,
) -> Result<ClosingConnection, lapin::Error> {
    let mut uri: AMQPUri = uri
        .parse()
        .map_err(|why: String| lapin::Error::from(std::io::Error::other(why)))?;
    if uri.query.frame_max.is_none() {
        uri.query.frame_max = Some(DEFAULT_FRAME_MAX);
    }
    let runtime = lapin::runtime::default_runtime()?;
    let tls = tls.owned();
    Connection::connector(
        uri,
        runtime,
        async move |uri, runtime| {
            // This closure runs on lapin's I/O thread (also when it reconnects).
            quiet_lapin_payload_logs_on_this_thread();
            uri.connect_with_config_async(tls.as_ref(), &runtime)
                .await
                .map_err(lapin::Error::from)
        },
        properties,
    )
    .await
    .map(ClosingConnection::new)
}

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// From now on, this thread's events go to the process's global dispatcher (also one a host
/// installs later), minus lapin's events that carry payloads (returned messages, frames).
/// Idempotent. The relay calls it on lapin's I/O threads and on its own runtime threads.
pub fn quiet_lapin_payload_logs_on_this_thread() {
    if QUIET.with(|quiet| quiet.replace(true)) {
        return;
    }
    let quiet = Dispatch::new(WithoutReturnedMessages);
    // The guard would restore the previous default when dropped; this thread keeps the quiet
    // dispatcher for its whole life.
    std::mem::forget(tracing::dispatcher::set_default(&quiet));
}

/// The process's global dispatcher, once one is set (found on a fresh thread: on a quiet one
/// the thread-local default is the quiet dispatcher itself; cached). A span that a subscriber's
/// extensions must reach (`tracing-opentelemetry`'s `set_parent`) is created under it
/// directly: the quiet dispatcher of this module forwards calls, not downcasts.
pub(crate) fn global_dispatch() -> Option<&'static Dispatch> {
    static GLOBAL: OnceLock<Dispatch> = OnceLock::new();
    if let Some(global) = GLOBAL.get() {
        return Some(global);
    }
    if !tracing::dispatcher::has_been_set() {
        return None;
    }
    let found = std::thread::spawn(|| tracing::dispatcher::get_default(Dispatch::clone))
        .join()
        .ok()?;
    Some(GLOBAL.get_or_init(|| found))
}

/// Forwards to the process's global dispatcher, except lapin's events that carry payloads.
struct WithoutReturnedMessages;

impl WithoutReturnedMessages {
    /// The global dispatcher, or none (events dropped) while no global one is set.
    fn inner(&self) -> &Dispatch {
        static NONE: LazyLock<Dispatch> = LazyLock::new(Dispatch::none);
        global_dispatch().unwrap_or(&NONE)
    }
}

fn carries_payload(metadata: &Metadata<'_>) -> bool {
    metadata.target() == RETURNED_MESSAGES
        || (metadata.target().starts_with("lapin")
            && FRAME_FIELDS
                .iter()
                .any(|field| metadata.fields().field(field).is_some()))
}

impl Subscriber for WithoutReturnedMessages {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if carries_payload(metadata) {
            Interest::never()
        } else if tracing::dispatcher::has_been_set() {
            self.inner().register_callsite(metadata)
        } else {
            // Decided per event until a global dispatcher exists.
            Interest::sometimes()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        !carries_payload(metadata) && self.inner().enabled(metadata)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        // The wrapped dispatcher's own hint is not public; the process's current maximum
        // (from every dispatcher) keeps its fast level check as it is.
        Some(LevelFilter::current())
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        self.inner().new_span(span)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        self.inner().record(span, values)
    }

    fn record_follows_from(&self, span: &Id, follows: &Id) {
        self.inner().record_follows_from(span, follows)
    }

    fn event(&self, event: &Event<'_>) {
        if !carries_payload(event.metadata()) {
            self.inner().event(event)
        }
    }

    fn enter(&self, span: &Id) {
        self.inner().enter(span)
    }

    fn exit(&self, span: &Id) {
        self.inner().exit(span)
    }

    fn clone_span(&self, id: &Id) -> Id {
        self.inner().clone_span(id)
    }

    fn try_close(&self, id: Id) -> bool {
        self.inner().try_close(id)
    }

    fn current_span(&self) -> tracing_core::span::Current {
        self.inner().current_span()
    }
}

/// A lapin error as the core's: the connection or channel failed ([`broker::Error::Channel`]).
pub(crate) fn amqp_error(err: lapin::Error) -> broker::Error {
    broker::Error::channel(err)
}

/// `?` on a lapin result, in the core's error: `channel.basic_qos(..).await.amqp()?`.
pub(crate) trait Amqp<T> {
    fn amqp(self) -> Result<T, broker::Error>;
}

impl<T> Amqp<T> for Result<T, lapin::Error> {
    fn amqp(self) -> Result<T, broker::Error> {
        self.map_err(amqp_error)
    }
}
