//! The suite's one publisher double: the relay's real `Publisher` port in front of a real
//! broker ([`Double::rabbit`], [`Double::nats`]) or of an in-memory one that fails on a schedule
//! ([`Double::memory`]), with what a test needs to inject: a gate that holds writes, a delay
//! before each, events it refuses (nacked, never written), and an observer of every call.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distribution::broker::{BoxFuture, Error, OnReport, Outcome, PublishReport, Publisher};

use distribution::nats::{NatsConfig, NatsPublisher};
use distribution::rabbit::{RabbitConfig, RabbitPublisher};
use distribution::store::{Fence, OutboxEvent};
use tokio::sync::watch;

/// A fault of the in-memory broker, for one publish call.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// Every event accepted.
    Clean,
    /// The channel dies at event k: before it accepted, k itself stored but unconfirmed,
    /// after it never sent; the publisher actor fails.
    ChannelDiesAt(usize),
    /// Event k nacked (not stored); the rest accepted.
    NackAt(usize),
    /// Event k returned unroutable (not stored); the rest accepted.
    ReturnAt(usize),
    /// Event k stored but its confirm lost (timeout); the publisher actor fails.
    ConfirmLostAt(usize),
}

/// The in-memory broker: a schedule of faults (one per publish call, then clean) and the queue
/// of what it stored, in order.
#[derive(Debug, Default)]
pub struct MemoryBroker {
    pub schedule: Mutex<VecDeque<Fault>>,
    pub stored: Mutex<Vec<OutboxEvent>>,
    pub calls: AtomicU64,
}

impl MemoryBroker {
    fn publish(&self, events: &[OutboxEvent], fence: &Fence) -> PublishReport {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let fault = self
            .schedule
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Fault::Clean);
        let mut stored = self.stored.lock().unwrap();
        let mut outcomes = Vec::with_capacity(events.len());
        let mut fault_error = None;
        for (index, event) in events.iter().enumerate() {
            let at = |k: usize| index == k % events.len();
            let outcome = match fault {
                _ if !fence.is_open() => Outcome::NotSent,
                Fault::ChannelDiesAt(k) if index > k % events.len() => Outcome::NotSent,
                Fault::ChannelDiesAt(k) | Fault::ConfirmLostAt(k) if at(k) => {
                    stored.push(event.clone());
                    fault_error = Some(Error::Unreachable("injected channel fault".into()));
                    Outcome::Unconfirmed
                }
                Fault::NackAt(k) if at(k) => Outcome::Nacked,
                Fault::ReturnAt(k) if at(k) => Outcome::Returned,
                _ => {
                    stored.push(event.clone());
                    Outcome::Accepted
                }
            };
            outcomes.push(outcome);
        }
        PublishReport {
            outcomes,
            fault: fault_error,
        }
    }
}

/// Told of every publish call of a [`Double`], in order.
pub trait Observer: Send + Sync {
    /// A call is about to write `events`; the returned number names the call below.
    fn writing(&self, events: &[OutboxEvent]) -> usize;
    /// The call's writes are done (its confirms may still be out).
    fn written(&self, call: usize);
    /// The call's confirms came back.
    fn confirmed(&self, call: usize, report: &PublishReport);
}

/// Which events a double refuses.
pub type Refuse = Arc<dyn Fn(&OutboxEvent) -> bool + Send + Sync>;

/// What a [`Double`] injects; every field is off by default.
#[derive(Clone, Default)]
pub struct Script {
    /// Each call waits until the gate is open.
    pub gate: Option<watch::Receiver<bool>>,
    /// Each call waits this long first (a slow path to the broker).
    pub delay: Duration,
    /// Events refused: nacked and never written, as a queue at its limit with
    /// `reject-publish` would. The others go to the broker.
    pub refuse: Option<Refuse>,
    /// Told of every call.
    pub observer: Option<Arc<dyn Observer>>,
}

enum Broker {
    Rabbit(Box<RabbitPublisher>),
    Nats(Box<NatsPublisher>),
    Memory(Arc<MemoryBroker>),
}

/// A publisher following a [`Script`].
pub struct Double {
    broker: Broker,
    script: Script,
}

impl Double {
    /// The real broker behind the script.
    pub fn rabbit(config: RabbitConfig, script: Script) -> Box<dyn Publisher> {
        Box::new(Self {
            broker: Broker::Rabbit(Box::new(RabbitPublisher::new(config))),
            script,
        })
    }

    /// The real broker behind the script, reporting each failed connect and each batch's fate
    /// to `health` (as a relay's own publishers do, for its readiness).
    pub fn rabbit_reporting(
        config: RabbitConfig,
        health: distribution::broker::BrokerHealth,
        script: Script,
    ) -> Box<dyn Publisher> {
        Box::new(Self {
            broker: Broker::Rabbit(Box::new(RabbitPublisher::new(config).with_health(health))),
            script,
        })
    }

    /// NATS JetStream behind the script.
    pub fn nats(config: NatsConfig, script: Script) -> Box<dyn Publisher> {
        Box::new(Self {
            broker: Broker::Nats(Box::new(NatsPublisher::new(config))),
            script,
        })
    }

    /// The in-memory broker behind the script.
    pub fn memory(broker: Arc<MemoryBroker>, script: Script) -> Box<dyn Publisher> {
        Box::new(Self {
            broker: Broker::Memory(broker),
            script,
        })
    }
}

impl Publisher for Double {
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
        done: OnReport,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Some(gate) = &mut self.script.gate {
                let _ = gate.wait_for(|open| *open).await;
            }
            if !self.script.delay.is_zero() {
                tokio::time::sleep(self.script.delay).await;
            }
            let refused: Vec<bool> = events
                .iter()
                .map(|event| {
                    self.script
                        .refuse
                        .as_ref()
                        .is_some_and(|refuse| refuse(event))
                })
                .collect();
            let kept: Vec<OutboxEvent>;
            let good: &[OutboxEvent] = if refused.contains(&true) {
                kept = events
                    .iter()
                    .zip(&refused)
                    .filter(|(_, refused)| !**refused)
                    .map(|(event, _)| event.clone())
                    .collect();
                &kept
            } else {
                events
            };
            let observer = self.script.observer.clone();
            let call = observer.as_ref().map(|observer| observer.writing(good));
            let confirmed = {
                let observer = observer.clone();
                Box::new(move |report: PublishReport| {
                    if let (Some(observer), Some(call)) = (&observer, call) {
                        observer.confirmed(call, &report);
                    }
                    // Refused events are nacked; the others have the broker's outcomes.
                    let mut written = report.outcomes.into_iter();
                    let outcomes = refused
                        .iter()
                        .map(|refused| {
                            if *refused {
                                Outcome::Nacked
                            } else {
                                written.next().unwrap_or(Outcome::NotSent)
                            }
                        })
                        .collect();
                    done(PublishReport {
                        outcomes,
                        fault: report.fault,
                    });
                }) as OnReport
            };
            match &mut self.broker {
                Broker::Rabbit(rabbit) => rabbit.send(good, fence, confirmed).await,
                Broker::Nats(nats) => nats.send(good, fence, confirmed).await,
                Broker::Memory(memory) => confirmed(memory.publish(good, fence)),
            }
            if let (Some(observer), Some(call)) = (&observer, call) {
                observer.written(call);
            }
        })
    }
}
