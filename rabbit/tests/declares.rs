//! WIRE.md, "Declares, exactly", as written: its tables of queue names and arguments are read
//! from the file; the relay's own arguments must be exactly them, and a consumer's declare of
//! every queue as the tables say is accepted by the broker beside the relay's declare, for
//! classic, quorum and stream topologies, default and named groups, settings set and unset.
use broker::{Group, Partition};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use rabbit::{QueueType, StreamRetention, Topology};

mod support;
use support::*;

const WIRE: &str = include_str!("../../broker/WIRE.md");

/// One row of the arguments table.
#[derive(Debug)]
struct Row {
    queue: String,
    on: Vec<String>,
    argument: String,
    amqp_type: String,
    value: String,
}

/// The rows of the markdown table whose header line is `header`.
fn table<'a>(doc: &'a str, header: &str) -> Vec<Vec<&'a str>> {
    let mut lines = doc.lines().skip_while(|line| line.trim() != header).skip(2);
    let mut rows = Vec::new();
    for line in lines.by_ref() {
        let Some(inner) = line.trim().strip_prefix('|') else {
            break;
        };
        let inner = inner.strip_suffix('|').unwrap_or(inner);
        rows.push(inner.split(" | ").map(str::trim).collect());
    }
    assert!(!rows.is_empty(), "WIRE.md has the table {header}");
    rows
}

fn unquote(cell: &str) -> &str {
    cell.trim_matches('`')
}

fn argument_rows() -> Vec<Row> {
    table(WIRE, "| queue | on | argument | AMQP type | value |")
        .into_iter()
        .map(|cells| {
            let [queue, on, argument, amqp_type, value] = cells[..] else {
                panic!("five cells: {cells:?}")
            };
            Row {
                queue: queue.to_owned(),
                on: on.split(", ").map(str::to_owned).collect(),
                argument: unquote(argument).to_owned(),
                amqp_type: amqp_type.to_owned(),
                value: value.to_owned(),
            }
        })
        .collect()
}

/// The relay's settings a test topology was made with, as the table's values name them.
struct Settings {
    queue_type: QueueType,
    delivery_limit: u32,
    replicas: Option<u16>,
    retention: StreamRetention,
}

impl Settings {
    fn type_name(&self) -> &'static str {
        match self.queue_type {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
            QueueType::Stream => "stream",
        }
    }

    fn topology(&self, name: &str) -> Topology {
        Topology::new(name, 2)
            .unwrap()
            .with_queue_type(self.queue_type)
            .with_delivery_limit(self.delivery_limit)
            .with_replicas(self.replicas)
            .with_stream_retention(self.retention.clone())
            .declaring(vec![Group::Default, Group::parse("billing").unwrap()])
    }

    /// A value cell as the setting it names: `None` for "if set" and unset.
    fn value(&self, cell: &str, dead_letter_queue: &str) -> Option<String> {
        let (cell, optional) = match cell.strip_suffix(", if set") {
            Some(cell) => (cell, true),
            None => (cell, false),
        };
        let setting = |name: &str| cell.starts_with(&format!("`{name}`"));
        let value = if cell == "empty" {
            Some(String::new())
        } else if cell == "the group's dead-letter queue" {
            Some(dead_letter_queue.to_owned())
        } else if setting("RELAY_QUEUE_REPLICAS") {
            self.replicas.map(|r| r.to_string())
        } else if setting("RELAY_DELIVERY_LIMIT") {
            Some(self.delivery_limit.to_string())
        } else if setting("RELAY_STREAM_MAX_AGE") {
            self.retention.max_age.clone()
        } else if setting("RELAY_STREAM_MAX_BYTES") {
            self.retention.max_bytes.map(|b| b.to_string())
        } else if setting("RELAY_STREAM_SEGMENT_BYTES") {
            self.retention.segment_bytes.map(|b| b.to_string())
        } else {
            assert!(
                cell.starts_with('`') && cell.ends_with('`'),
                "a value this test cannot read: {cell}"
            );
            Some(unquote(cell).to_owned())
        };
        assert!(
            value.is_some() || optional,
            "{cell} is unset but not marked \"if set\""
        );
        value
    }

    /// The arguments of `queue` ("partition" or "dead-letter") as the table gives them.
    fn arguments(&self, queue: &str, dead_letter_queue: &str) -> FieldTable {
        let mut arguments = FieldTable::default();
        for row in argument_rows() {
            if row.queue != queue || !row.on.iter().any(|on| on == self.type_name()) {
                continue;
            }
            let Some(value) = self.value(&row.value, dead_letter_queue) else {
                continue;
            };
            let value = match row.amqp_type.as_str() {
                "boolean" => AMQPValue::Boolean(value.parse().unwrap()),
                "long string" => AMQPValue::LongString(value.as_str().into()),
                "long long int" => AMQPValue::LongLongInt(value.parse().unwrap()),
                other => panic!("an AMQP type this test cannot write: {other}"),
            };
            arguments.insert(row.argument.as_str().into(), value);
        }
        arguments
    }
}

/// A queue's name by the names table: `row` is "partition, classic and quorum",
/// "partition, stream" or "dead-letter"; `group` `None` for the default group.
fn name(row: &str, topology: &str, group: Option<&str>, partition: u16) -> String {
    let names = table(WIRE, "| queue | default group | named group `<group>` |");
    let cells = names
        .iter()
        .find(|cells| cells[0] == row)
        .unwrap_or_else(|| panic!("no names row {row}"));
    let pattern = unquote(
        cells[if group.is_some() { 2 } else { 1 }]
            .split(' ')
            .next()
            .unwrap(),
    );
    pattern
        .replace("<topology>", topology)
        .replace("<group>", group.unwrap_or(""))
        .replace("<N>", &partition.to_string())
}

fn cases() -> Vec<Settings> {
    let retention = StreamRetention {
        max_age: Some("7D".into()),
        max_bytes: Some(1 << 30),
        segment_bytes: Some(1 << 24),
    };
    vec![
        Settings {
            queue_type: QueueType::Classic,
            delivery_limit: 20,
            replicas: None,
            retention: StreamRetention::default(),
        },
        Settings {
            queue_type: QueueType::Quorum,
            delivery_limit: 20,
            replicas: None,
            retention: StreamRetention::default(),
        },
        Settings {
            queue_type: QueueType::Quorum,
            delivery_limit: 7,
            replicas: Some(1),
            retention: StreamRetention::default(),
        },
        Settings {
            queue_type: QueueType::Stream,
            delivery_limit: 20,
            replicas: None,
            retention: StreamRetention::default(),
        },
        Settings {
            queue_type: QueueType::Stream,
            delivery_limit: 20,
            replicas: Some(1),
            retention,
        },
    ]
}

#[tokio::test]
async fn a_consumer_declares_every_queue_exactly_as_wire_md_says() {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    for settings in cases() {
        let label = format!("declares-{}", settings.type_name());
        let topology = settings.topology(&rabbit::scratch::unique(&label));
        let exchange = topology.exchange().to_string();
        let channel = connection.create_channel().await.unwrap();
        topology.declare(&channel).await.unwrap();
        for group in [None, Some("billing")] {
            let dead = name("dead-letter", &exchange, group, 0);
            let partition_row = match settings.queue_type {
                QueueType::Stream => "partition, stream",
                _ => "partition, classic and quorum",
            };
            let relays = match group {
                None => Group::Default,
                Some(name) => Group::parse(name).unwrap(),
            };
            let mut queues = vec![(
                dead.clone(),
                settings.arguments("dead-letter", &dead),
                topology.dead_letter_arguments(),
            )];
            for partition in 0..topology.partitions() {
                assert_eq!(
                    name(partition_row, &exchange, group, partition),
                    topology.queue_of(&relays, Partition(partition)).as_str(),
                    "{label}"
                );
                queues.push((
                    name(partition_row, &exchange, group, partition),
                    settings.arguments("partition", &dead),
                    topology.partition_arguments(&relays),
                ));
            }
            assert_eq!(dead, topology.dead_letter_queue_of(&relays).as_str());
            for (queue, documented, relays) in queues {
                assert_eq!(documented, relays, "{label}: {queue}");
                // It exists (the relay declared it under this name) ...
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .unwrap_or_else(|err| panic!("{label}: {queue} is not there: {err}"));
                // ... and the consumer's declare as written is accepted beside it.
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..QueueDeclareOptions::default()
                        },
                        documented,
                    )
                    .await
                    .unwrap_or_else(|err| panic!("{label}: {queue} refused: {err}"));
            }
        }
        topology
            .delete(&channel)
            .await
            .expect("delete the test's topology");
    }
}
