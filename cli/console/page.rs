//! The console's pages, rendered from plain data (no I/O): every value is escaped by maud,
//! bodies are cut and shown as text or hex, and every form carries the CSRF token.
use distribution::broker::DeadLetterView as DeadLetter;
use distribution::rabbit::QueueCount;
use distribution::store::{Backlog, BranchBacklog, ParkCause, ParkedBranch, RelayShare, TenantId};
use maud::{DOCTYPE, Markup, html};

use super::lag::LagHistory;
use super::readable::{age, clock};

/// Bytes of a dead letter's body shown; the rest is counted, not shown.
pub const BODY_SHOWN: usize = 4096;

/// Tenants per page of the backlog table.
pub const TENANTS_PER_PAGE: u32 = 25;

/// Dead letters listed per page.
pub const LETTERS_LISTED: u64 = 100;

/// Dead letters read to count those a replay or purge would take, before it asks.
pub const LETTERS_COUNTED: u64 = 10_000;

/// Dead letters read per group for a tenant's page (its own are counted among them).
pub const TENANT_LETTERS_READ: u64 = 1_000;

/// A tenant's waiting branches listed on its page.
pub const BRANCHES_LISTED: u32 = 100;

/// A body as shown: UTF-8 text, else hex; cut to `limit` bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Shown {
    /// `text` or `hex`.
    pub kind: &'static str,
    /// What is shown.
    pub shown: String,
    /// Bytes left out.
    pub cut: usize,
}

/// `body` as shown: the longest valid UTF-8 prefix within `limit` bytes if the whole shown part
/// is text, else hex of the first `limit / 2` bytes (two characters per byte).
pub fn shown(body: &[u8], limit: usize) -> Shown {
    let head = &body[..body.len().min(limit)];
    let text = match std::str::from_utf8(head) {
        Ok(text) => Some(text),
        // Cut inside a character: what comes before the cut.
        Err(err) if err.error_len().is_none() => {
            std::str::from_utf8(&head[..err.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    match text {
        Some(text) => Shown {
            kind: "text",
            shown: text.to_owned(),
            cut: body.len() - text.len(),
        },
        None => {
            let head = &body[..body.len().min(limit / 2)];
            Shown {
                kind: "hex",
                shown: head.iter().map(|byte| format!("{byte:02x}")).collect(),
                cut: body.len() - head.len(),
            }
        }
    }
}

/// When the page was read, and a link that reads it again.
pub fn as_of(at: std::time::SystemTime, here: &str) -> Markup {
    html! {
        p .asof { "As of " (clock(at)) ". " a href=(here) { "Refresh" } }
    }
}

/// A link to a tenant's page.
fn tenant_link(tenant: &TenantId) -> Markup {
    html! { a href={ "/tenant/" (tenant) } { (tenant) } }
}

/// The sections of the navigation bar.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Overview,
    Parked,
    Dead,
    None,
}

/// A whole page: `title`, the navigation (groups with a dead-letter page), `body`.
pub fn layout(title: &str, section: Section, groups: &[String], body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox relay" }
                link rel="stylesheet" href="/console.css";
            }
            body {
                nav {
                    a href="/" class=[(section == Section::Overview).then_some("on")] { "Overview" }
                    a href="/parked" class=[(section == Section::Parked).then_some("on")] { "Parked branches" }
                    @for group in groups {
                        a href={ "/dead/" (group) } class=[(section == Section::Dead).then_some("on")] {
                            "Dead letters: " (group)
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// The hidden CSRF field every form carries.
fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// What the overview shows.
pub struct Overview {
    pub relays: Vec<RelayShare>,
    pub backlog: Vec<Backlog>,
    pub tenants: u64,
    pub page: u64,
    pub parked: usize,
    /// `None`: no broker configured (AMQP_URL, or NATS_URL with RELAY_BROKER=nats).
    pub broker: Option<(String, Result<BrokerStatus, String>)>,
    /// Per group (in RELAY_GROUPS order): its queues as the broker counts them.
    pub groups: Vec<GroupQueues>,
}

/// What the broker said when asked.
pub struct BrokerStatus {
    /// `Some(reason)` while RabbitMQ blocks publishing (a resource alarm).
    pub blocked: Option<String>,
    /// What it is (`RabbitMQ 3.10.8 (cluster ...)`, `NATS 2.9.10, stream ... holds N messages`).
    pub what: String,
    /// What an operator should know of it (NATS: what an ack means for durability).
    pub note: Option<String>,
}

/// A consumer group's queues, as the broker counts them.
pub struct GroupQueues {
    pub group: String,
    /// Where its dead letters are kept (queue, or NATS subject).
    pub dead_queue: String,
    /// How many dead letters (or why it is unknown).
    pub dead: Result<u64, String>,
    /// What it reads.
    pub partitions: Partitions,
}

/// What a group reads, as the broker counts it.
pub enum Partitions {
    /// RabbitMQ: its partition queues (or why they are unknown).
    Queues(Result<Vec<QueueCount>, String>),
    /// NATS: the stream, from its consumers' stored positions (no queues of its own).
    Stream,
}

pub fn overview(data: &Overview, lag: &LagHistory, now: std::time::SystemTime) -> Markup {
    let pages = data.tenants.div_ceil(u64::from(TENANTS_PER_PAGE)).max(1);
    let here = match data.page {
        0 => "/".to_owned(),
        page => format!("/?page={page}"),
    };
    let dead: u64 = data
        .groups
        .iter()
        .filter_map(|group| group.dead.as_ref().ok())
        .sum();
    html! {
        (as_of(now, &here))
        @if dead > 0 || data.parked > 0 {
            p .warn #attention {
                @if dead > 0 { (dead) " dead letter(s) wait in the groups below. " }
                @if data.parked > 0 { a href="/parked" { (data.parked) " parked branch(es)" } " wait for an operator." }
            }
        }
        section #broker {
            h2 { "Broker" }
            @match &data.broker {
                None => p { "No broker configured: set AMQP_URL (or RELAY_BROKER=nats and NATS_URL) to see its health and the dead letters." },
                Some((shown, Ok(status))) => {
                    p {
                        span .state.(if status.blocked.is_some() { "bad" } else { "good" }) {
                            @if let Some(reason) = &status.blocked { "blocked: " (reason) } @else { "up" }
                        }
                        " " (status.what) " at " (shown)
                    }
                    @if let Some(note) = &status.note { p .note { (note) } }
                },
                Some((shown, Err(err))) => p { span .state.bad { "down" } " " (shown) ": " (err) },
            }
        }
        section #groups {
            h2 { "Consumer groups" }
            @if data.groups.is_empty() {
                p { "No broker configured." }
            } @else {
                table {
                    thead { tr {
                        th { "group" } th { "dead letters" } th { "dead letters kept in" }
                        th { "partition queues" } th { "messages ready" } th { "consumers" }
                    } }
                    tbody {
                        @for group in &data.groups {
                            tr {
                                td { a href={ "/dead/" (group.group) } { (group.group) } }
                                @match &group.dead {
                                    Ok(0) => td .num { "0" },
                                    Ok(depth) => td .num.bad { a href={ "/dead/" (group.group) } { (depth) } },
                                    Err(err) => td { "unknown: " (err) },
                                }
                                td { (group.dead_queue) }
                                (partition_cells(&group.partitions))
                            }
                        }
                    }
                }
                @if data.groups.iter().any(|group| matches!(group.partitions, Partitions::Queues(_))) {
                    p .note { "Messages ready: what waits in the group's partition queues (not counting what a consumer holds unacked); a partition without a consumer is not folded." }
                }
                @for group in &data.groups {
                    @if let Partitions::Queues(Ok(queues)) = &group.partitions {
                        details {
                            summary { "Partition queues of " (group.group) }
                            table .partitions {
                                thead { tr { th { "queue" } th { "messages ready" } th { "consumers" } } }
                                tbody {
                                    @for queue in queues {
                                        tr {
                                            td { (queue.queue) }
                                            @match queue.counted {
                                                Some(counted) => {
                                                    td .num { (counted.messages) }
                                                    td .num.bad[counted.consumers == 0] { (counted.consumers) }
                                                }
                                                None => td colspan="2" { "no such queue" },
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        section #relays {
            h2 { "Relays alive" }
            @if data.relays.is_empty() {
                p .warn { "No relay is alive: nothing is shipped." }
            } @else {
                table {
                    thead { tr { th { "relay" } th { "member for" } th { "lease buckets held (of 128)" } } }
                    tbody {
                        @for relay in &data.relays {
                            tr { td { (relay.relay) } td { (age(relay.member_for)) } td .num { (relay.buckets) } }
                        }
                    }
                }
            }
        }
        section #lag {
            h2 { "Oldest waiting intent" }
            p .note { "The age of the oldest intent not yet confirmed by the broker, of any tenant, sampled every "
                (lag.every().as_secs()) " s by this console (last " (age(lag.span())) ")." }
            (lag.svg(now))
        }
        section #backlog {
            h2 { "Backlog: " (data.tenants) " tenant(s) with intents waiting" }
            @if data.parked > 0 {
                p .warn { a href="/parked" { (data.parked) " parked branch(es)" } " wait for an operator." }
            }
            @if !data.backlog.is_empty() {
                table {
                    thead { tr { th { "tenant" } th { "waiting" } th { "oldest waits for" } } }
                    tbody {
                        @for tenant in &data.backlog {
                            tr { td { (tenant_link(&tenant.tenant)) } td .num { (tenant.pending) } td { (age(tenant.oldest_age)) } }
                        }
                    }
                }
                p .pages {
                    "Page " (data.page + 1) " of " (pages) ", the longest waits first. "
                    @if data.page > 0 { a href={ "/?page=" (data.page - 1) } { "newer waits" } " " }
                    @if data.page + 1 < pages { a href={ "/?page=" (data.page + 1) } { "longer waits" } }
                }
            }
        }
    }
}

/// A group's partition queues in three cells: how many exist, messages ready, consumers
/// (and how many partitions have none).
fn partition_cells(partitions: &Partitions) -> Markup {
    match partitions {
        Partitions::Stream => html! {
            td colspan="3" { "none on NATS: the group reads the stream from the positions its fold database stored" }
        },
        Partitions::Queues(Err(err)) => html! { td colspan="3" { "unknown: " (err) } },
        Partitions::Queues(Ok(queues)) => {
            let counted: Vec<_> = queues.iter().filter_map(|queue| queue.counted).collect();
            let ready: u64 = counted.iter().map(|c| u64::from(c.messages)).sum();
            let consumers: u64 = counted.iter().map(|c| u64::from(c.consumers)).sum();
            let unread = counted.iter().filter(|c| c.consumers == 0).count();
            html! {
                td .num.bad[counted.len() < queues.len()] {
                    (counted.len()) " of " (queues.len())
                }
                td .num { (ready) }
                td .num.bad[unread > 0] {
                    (consumers)
                    @if unread > 0 { " (" (unread) " partition(s) without one)" }
                }
            }
        }
    }
}

/// A branch's three ids as hidden fields.
fn branch_fields(branch: &distribution::store::BranchKey) -> Markup {
    html! {
        input type="hidden" name="tenant" value=(branch.tenant);
        input type="hidden" name="run" value=(branch.run);
        input type="hidden" name="branch" value=(branch.branch);
    }
}

pub fn parked(branches: &[ParkedBranch], csrf: &str, now: std::time::SystemTime) -> Markup {
    html! {
        (as_of(now, "/parked"))
        p .note {
            "A branch is parked when the broker kept refusing its events, or a row of it cannot be read: its events wait, in order, and the relay tries again on its own at the next retry. "
            b { "Release" } " tries again now. " b { "Discard" } " drops its waiting events for good (you will be asked to confirm)."
        }
        @if branches.is_empty() {
            p #none { "No parked branches." }
        } @else {
            (parked_table(branches, csrf))
        }
    }
}

/// Parked branches with their actions, then each of their causes with its way out.
fn parked_table(branches: &[ParkedBranch], csrf: &str) -> Markup {
    html! {
        table #parked {
            thead { tr {
                th { "tenant" } th { "run" } th { "branch" } th { "cause" } th { "reason" }
                th { "attempts" } th { "failing for" } th { "next try in" } th { "waiting" } th {}
            } }
            tbody {
                @for parked in branches {
                    tr {
                        td { (tenant_link(&parked.branch.tenant)) } td .run { (parked.branch.run) } td { (parked.branch.branch) }
                        td .cause { (parked.cause.label()) } td .reason { (parked.reason) } td .num { (parked.attempts) }
                        td { (age(parked.failing_for)) } td { (age(parked.retry_in)) } td .num { (parked.pending) }
                        td .actions {
                            form method="post" action="/parked/act" {
                                (csrf_field(csrf)) (branch_fields(&parked.branch))
                                button name="action" value="release" { "Release" }
                                button name="action" value="discard" class="danger" { "Discard…" }
                            }
                        }
                    }
                }
            }
        }
        dl #causes {
            @for cause in causes(branches) {
                dt { (cause.label()) }
                dd { (prose(cause.what())) ". " b { "Way out: " } (prose(cause.way_out())) "." }
            }
        }
    }
}

/// What a tenant's page shows.
pub struct TenantPage {
    pub backlog: Backlog,
    /// Its branches with intents waiting (the first [`BRANCHES_LISTED`]) and how many in all.
    pub branches: (Vec<BranchBacklog>, u64),
    /// Its parked branches.
    pub parked: Vec<ParkedBranch>,
    /// Per group: the tenant's dead letters among the first [`TENANT_LETTERS_READ`] read, and
    /// the queue's depth (or why they are unknown).
    pub dead: Vec<(String, Result<TenantLetters, String>)>,
}

/// A tenant's dead letters in one group.
pub struct TenantLetters {
    /// The tenant's, among those read.
    pub letters: Vec<DeadLetter>,
    /// What the group's dead-letter queue holds in all.
    pub depth: u64,
}

pub fn tenant(data: &TenantPage, csrf: &str, now: std::time::SystemTime) -> Markup {
    let tenant = &data.backlog.tenant;
    let (branches, branch_count) = &data.branches;
    html! {
        (as_of(now, &format!("/tenant/{tenant}")))
        section #tenant-backlog {
            h2 { "Backlog" }
            @if data.backlog.pending == 0 {
                p { "Nothing waits: every intent of " (tenant) " was confirmed by the broker." }
            } @else {
                p {
                    b { (data.backlog.pending) } " intent(s) wait on " (branch_count) " branch(es); the oldest for "
                    b { (age(data.backlog.oldest_age)) } " (the tenant's lag)."
                }
                table #branches {
                    thead { tr {
                        th { "run" } th { "branch" } th { "waiting" } th { "lsns waiting" } th { "oldest waits for" }
                    } }
                    tbody {
                        @for branch in branches {
                            tr {
                                td .run { (branch.branch.run) } td { (branch.branch.branch) }
                                td .num { (branch.pending) }
                                td { (branch.first.get()) "–" (branch.last.get()) }
                                td { (age(branch.oldest_age)) }
                            }
                        }
                    }
                }
                @if *branch_count > branches.len() as u64 {
                    p .note { "The " (branches.len()) " oldest waits of " (branch_count) " branches." }
                }
            }
        }
        section #tenant-parked {
            h2 { "Parked branches" }
            @if data.parked.is_empty() {
                p { "None." }
            } @else {
                (parked_table(&data.parked, csrf))
            }
        }
        section #tenant-dead {
            h2 { "Dead letters" }
            @if data.dead.is_empty() {
                p { "No broker configured." }
            }
            @for (group, letters) in &data.dead {
                h3 { "Group " a href={ "/dead/" (group) } { (group) } }
                @match letters {
                    Err(err) => p { "Unknown: " (err) },
                    Ok(TenantLetters { letters, depth }) => {
                        p {
                            (letters.len()) " of the group's " (depth) " dead letter(s) are " (tenant) "'s"
                            @if *depth > TENANT_LETTERS_READ { " (among the first " (TENANT_LETTERS_READ) " read)" }
                            "."
                        }
                        @if !letters.is_empty() {
                            (letters_table(group, &letters[..letters.len().min(LETTERS_LISTED as usize)], csrf))
                            form method="post" action={ "/dead/" (group) "/act" } .tenant-actions {
                                (csrf_field(csrf))
                                input type="hidden" name="select" value="tenant";
                                input type="hidden" name="tenant" value=(tenant);
                                button name="action" value="replay" { "Replay " (tenant) "'s…" }
                                button name="action" value="purge" class="danger" { "Purge " (tenant) "'s…" }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Text with `quoted` words (commands, settings) shown as code, without the backticks.
fn prose(text: &str) -> Markup {
    html! {
        @for (at, part) in text.split('`').enumerate() {
            @if at % 2 == 1 { code { (part) } } @else { (part) }
        }
    }
}

/// The causes of `branches`, each once, in the docs' order.
fn causes(branches: &[ParkedBranch]) -> std::collections::BTreeSet<ParkCause> {
    branches.iter().map(|parked| parked.cause).collect()
}

/// The confirmation of a discard: what it does on the wire, and the new branch's name.
pub fn confirm_discard(
    branch: &distribution::store::BranchKey,
    waiting: Option<u64>,
    to: &str,
    csrf: &str,
) -> Markup {
    html! {
        p #asked {
            "Discard the waiting events of " b { (branch) } " for good? "
            @match waiting {
                Some(waiting) => { (waiting) " event(s) wait now: every one it has not shipped." }
                None => { "It is not parked now (a relay shipped it, or someone released it): a discard would be refused." }
            }
        }
        ul .note {
            li { "Its waiting intents are deleted from the outbox; they are never shipped." }
            li { "Consumers get a rewind marker at its last shipped Lsn (never a silent gap): they undo nothing they applied." }
            li { "The run goes on on a new live branch; the host's later appends to this branch are refused as abandoned." }
        }
        form method="post" action="/parked/act" {
            (csrf_field(csrf)) (branch_fields(branch))
            input type="hidden" name="confirmed" value="yes";
            label { "New live branch " input type="text" name="to" value=(to) maxlength="64"; }
            " "
            button name="action" value="discard" class="danger" { "Discard for good" }
            " " a href="/parked" { "Cancel" }
        }
    }
}

/// What an action did, and where to look next.
pub fn done(message: &str, back: &str) -> Markup {
    html! {
        p #done { (message) }
        p { a href=(back) { "Back" } }
    }
}

/// The selection form of the dead-letter page (all, or a tenant and maybe a run).
fn selection_form(group: &str, csrf: &str) -> Markup {
    html! {
        form method="post" action={ "/dead/" (group) "/act" } #selection {
            (csrf_field(csrf))
            label { input type="radio" name="select" value="all" checked; " every dead letter" }
            " "
            label { input type="radio" name="select" value="tenant"; " of tenant " input type="text" name="tenant" maxlength="64"; }
            " "
            label { "run (optional) " input type="text" name="run" maxlength="64"; }
            " "
            button name="action" value="replay" { "Replay…" }
            " "
            button name="action" value="purge" class="danger" { "Purge…" }
        }
    }
}

pub fn dead_list(
    group: &str,
    queue: &str,
    depth: u64,
    letters: &[DeadLetter],
    csrf: &str,
    now: std::time::SystemTime,
) -> Markup {
    html! {
        (as_of(now, &format!("/dead/{group}")))
        p {
            (depth) " dead letter(s) in " code { (queue) }
            @if depth > LETTERS_LISTED { " (the first " (LETTERS_LISTED) " below)" }
            ". " b { "Replay" } " publishes them back to their partitions for the consumers to fold again (duplicates are ignored); "
            b { "purge" } " removes them for good. Both ask first."
        }
        (selection_form(group, csrf))
        @if !letters.is_empty() {
            div #letters { (letters_table(group, letters, csrf)) }
        }
    }
}

/// Dead letters, each with a link to its page and its own Replay and Purge (each asks first).
fn letters_table(group: &str, letters: &[DeadLetter], csrf: &str) -> Markup {
    html! {
        table .letters {
            thead { tr { th { "#" } th { "message id" } th { "kind" } th { "why" } th {} } }
            tbody {
                @for letter in letters {
                    tr {
                        td .num { (letter.position) }
                        td {
                            @if let Some(id) = &letter.message_id {
                                a href={ "/dead/" (group) "/show?id=" (urlencode(id)) } { (id) }
                            } @else { "(no message id)" }
                        }
                        td { (letter.kind()) }
                        td .reason { (letter.reason.as_deref().unwrap_or("(no reason)")) }
                        td .actions {
                            @if let Some(id) = &letter.message_id {
                                form method="post" action={ "/dead/" (group) "/act" } {
                                    (csrf_field(csrf))
                                    input type="hidden" name="select" value="message";
                                    input type="hidden" name="message_id" value=(id);
                                    button name="action" value="replay" { "Replay…" }
                                    button name="action" value="purge" class="danger" { "Purge…" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A query-string value.
pub fn urlencode(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

pub fn dead_show(group: &str, letter: &DeadLetter, csrf: &str) -> Markup {
    let body = shown(&letter.body, BODY_SHOWN);
    html! {
        dl #letter {
            dt { "position" } dd { (letter.position) }
            dt { "message id" } dd { (letter.message_id.as_deref().unwrap_or("(none)")) }
            dt { "kind" } dd { (letter.kind()) }
            dt { "why" } dd .reason { (letter.reason.as_deref().unwrap_or("(no reason)")) }
            @if let Err(err) = &letter.event { dt { "not an event" } dd { (err) } }
            @for (name, value) in letter.properties() { dt { (name) } dd { (value) } }
        }
        @if let Some(id) = &letter.message_id {
            // This letter alone: each asks to confirm first, as from the list.
            form method="post" action={ "/dead/" (group) "/act" } #letter-actions {
                (csrf_field(csrf))
                input type="hidden" name="select" value="message";
                input type="hidden" name="message_id" value=(id);
                button name="action" value="replay" { "Replay…" }
                button name="action" value="purge" class="danger" { "Purge…" }
            }
        }
        h2 { "Headers" }
        table #headers {
            tbody {
                @for (name, value) in &letter.headers {
                    tr { td { (name) } td { code { (value) } } }
                }
            }
        }
        h2 { "Body: " (letter.body.len()) " bytes, shown as " (body.kind) }
        pre #body { (body.shown) }
        @if body.cut > 0 { p .note { (body.cut) " more byte(s) not shown." } }
        p { a href={ "/dead/" (group) } { "All dead letters of " (group) } }
    }
}

/// What a dead-letter action does: publish letters back, or remove them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadAction {
    Replay,
    Purge,
}

impl DeadAction {
    /// Its value in a form (`replay`, `purge`).
    fn value(self) -> &'static str {
        match self {
            DeadAction::Replay => "replay",
            DeadAction::Purge => "purge",
        }
    }

    /// The question's verb (`Replay`, `Purge`).
    pub fn verb(self) -> &'static str {
        match self {
            DeadAction::Replay => "Replay",
            DeadAction::Purge => "Purge",
        }
    }
}

/// The confirmation of a replay or purge: what it takes, and how many of the listed match.
pub fn confirm_dead(
    group: &str,
    action: DeadAction,
    fields: &[(&str, String)],
    what: &str,
    matching: usize,
    listed: usize,
    csrf: &str,
) -> Markup {
    let purge = action == DeadAction::Purge;
    html! {
        p {
            (action.verb()) " " (what) "? "
            (matching) " of the " (listed) " dead letter(s) read now match."
        }
        p .note {
            @if purge { "Purged letters are removed for good. An intent purged leaves its branch's later intents held at the fold for good: prefer Replay once the consumer is fixed, or discard the branch upstream." }
            @else { "Each leaves the dead-letter queue once its partition confirmed it; the consumers fold it again." }
        }
        form method="post" action={ "/dead/" (group) "/act" } {
            (csrf_field(csrf))
            @for (name, value) in fields { input type="hidden" name=(name) value=(value); }
            input type="hidden" name="confirmed" value="yes";
            button name="action" value=(action.value()) class=[purge.then_some("danger")] {
                (if purge { "Purge for good" } else { "Replay" })
            }
            " " a href={ "/dead/" (group) } { "Cancel" }
        }
    }
}

pub fn error(status: u16, message: &str) -> Markup {
    html! {
        p #error { (message) }
        p .note { "HTTP " (status) ". " a href="/" { "Overview" } }
    }
}

/// The console's one style sheet (served as /console.css: the pages carry no inline style,
/// so the content security policy allows styles from the console alone).
pub const STYLE: &str = "
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; color: #1d232a; background: #f6f7f9; }
nav { background: #1d232a; padding: .6em 1em; }
nav a { color: #cfd6de; margin-right: 1.2em; text-decoration: none; }
nav a.on { color: #fff; font-weight: 600; }
main { padding: 1em 1.5em; max-width: 110em; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: .4em 1em 1em; margin-bottom: 1em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #eceff2; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table#parked th, table#parked td { white-space: nowrap; } table#parked td.reason, table#parked td.run { white-space: normal; overflow-wrap: anywhere; }
dl#causes dd { margin: .2em 0 .8em 1.5em; } dl#causes dt { font-weight: 600; }
td.reason, dd.reason { font-family: ui-monospace, monospace; font-size: 90%; }
.state { padding: .1em .5em; border-radius: 4px; color: #fff; }
.good { background: #2f855a; } .bad { background: #c53030; color: #fff; }
.warn { color: #9c4221; font-weight: 600; } .note { color: #5a6572; }
button { margin-right: .3em; } button.danger { color: #c53030; }
pre#body { background: #fff; border: 1px solid #dde1e6; padding: .6em; white-space: pre-wrap; word-break: break-all; }
p#error { color: #c53030; font-weight: 600; }
p.asof { color: #5a6572; margin: 0 0 .6em; } p#attention { margin: 0 0 .8em; }
details { margin-top: .6em; } summary { cursor: pointer; color: #2b6cb0; }
td.num a { color: #fff; } svg.lag circle { fill: #2b6cb0; } p.readout { margin: .2em 0; }
svg.lag { background: #fff; } svg.lag polyline { fill: none; stroke: #2b6cb0; stroke-width: 2; }
svg.lag text { font-size: 11px; fill: #5a6572; } svg.lag line { stroke: #dde1e6; }
";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_body_is_shown_as_text_or_hex_and_cut() {
        assert_eq!(
            shown(b"{\"a\":1}", 100),
            Shown {
                kind: "text",
                shown: "{\"a\":1}".into(),
                cut: 0
            }
        );
        // Cut inside a two-byte character: the text before it.
        let text = "é".repeat(10);
        let cut = shown(text.as_bytes(), 5);
        assert_eq!((cut.kind, cut.shown.as_str(), cut.cut), ("text", "éé", 16));
        let binary = [0u8, 159, 146, 150, 1, 2];
        assert_eq!(
            shown(&binary, 8),
            Shown {
                kind: "hex",
                shown: "009f9296".into(),
                cut: 2
            }
        );
    }

    #[test]
    fn what_a_page_shows_is_escaped() {
        let page = error(400, "<script>alert(1)</script>").into_string();
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{page}"
        );
        assert!(!page.contains("<script>"));
        let page = done("\"><img src=x onerror=alert(1)>", "/parked").into_string();
        assert!(!page.contains("<img"), "{page}");
    }

    fn branch(tenant: &str, run: &str) -> distribution::store::BranchKey {
        use distribution::store::{BranchId, BranchKey, RunId};
        BranchKey::new(
            TenantId::new(tenant).unwrap(),
            RunId::new(run).unwrap(),
            BranchId::new("main").unwrap(),
        )
    }

    #[test]
    fn a_group_names_its_missing_queues_and_partitions_nobody_reads() {
        use distribution::rabbit::Counted;
        let queue = |name: &str, counted| QueueCount {
            queue: name.into(),
            counted,
        };
        let cells = partition_cells(&Partitions::Queues(Ok(vec![
            queue(
                "o.p0",
                Some(Counted {
                    messages: 5,
                    consumers: 1,
                }),
            ),
            queue(
                "o.p1",
                Some(Counted {
                    messages: 7,
                    consumers: 0,
                }),
            ),
            queue("o.p2", None),
        ])))
        .into_string();
        assert_eq!(
            cells,
            "<td class=\"num bad\">2 of 3</td><td class=\"num\">12</td>\
             <td class=\"num bad\">1 (1 partition(s) without one)</td>"
        );
    }

    #[test]
    fn a_tenants_page_shows_its_branches_parked_and_dead_letters() {
        use distribution::store::Lsn;
        let acme = TenantId::new("acme").unwrap();
        let data = TenantPage {
            backlog: Backlog {
                tenant: acme,
                pending: 5,
                oldest_age: Duration::from_secs(90),
            },
            branches: (
                vec![BranchBacklog {
                    branch: branch("acme", "r1"),
                    pending: 5,
                    first: Lsn::new(4),
                    last: Lsn::new(8),
                    oldest_age: Duration::from_secs(90),
                }],
                3,
            ),
            parked: vec![ParkedBranch {
                branch: branch("acme", "r1"),
                cause: ParkCause::Unreadable,
                reason: "unreadable: lsn 4: bad meta".into(),
                attempts: 2,
                failing_for: Duration::from_secs(60),
                retry_in: Duration::from_secs(5),
                pending: 5,
            }],
            dead: vec![
                (
                    "default".into(),
                    Ok(TenantLetters {
                        letters: Vec::new(),
                        depth: 4,
                    }),
                ),
                ("audit".into(), Err("no such queue".into())),
            ],
        };
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let page = tenant_page_text(&tenant(&data, "t0k", now));
        for expected in [
            "As of 2027-01-15 08:00:00 UTC. Refresh",
            "5 intent(s) wait on 3 branch(es); the oldest for 1 min 30 s (the tenant's lag).",
            "r1 main 5 4–8 1 min 30 s",
            "The 1 oldest waits of 3 branches.",
            "unreadable: lsn 4: bad meta",
            "0 of the group's 4 dead letter(s) are acme's.",
            "Unknown: no such queue",
        ] {
            assert!(page.contains(expected), "{expected:?} in {page}");
        }
    }

    /// A page's text as a browser shows it, roughly: tags dropped, whitespace collapsed.
    fn tenant_page_text(page: &Markup) -> String {
        let html = page.clone().into_string();
        let mut text = String::new();
        let mut in_tag = false;
        for c in html.chars() {
            match c {
                '<' => {
                    in_tag = true;
                    text.push(' ');
                }
                '>' => in_tag = false,
                c if !in_tag => text.push(c),
                _ => {}
            }
        }
        text.replace("&#39;", "'")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }
}
