//! The operators' console (`distribution console`), against a real relay, consumer, database
//! and broker: headless Chromium (Debian's `chromium` and `chromium-driver`, which `.ci/run`
//! installs) releases a parked branch and replays a dead letter, and the fold shows both; a
//! screenshot of each page is kept (target/console-screenshots). Then hostile and malformed
//! requests, without a browser: wrong tokens, forged and cross-site forms, huge bodies, script
//! in every field and in a dead letter's headers and body. The console connects as a role with
//! only `distribution roles --operator`'s grants.
#[path = "it/harness.rs"]
mod harness;

mod console {
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use distribution::Relay;
    use distribution::rabbit::{DeadLetters, RabbitConfig};
    use distribution::store::{self, BranchKey, IntentWriter, Lsn, Outbox};
    use fantoccini::{ClientBuilder, Locator};
    use hyper_util::client::legacy::connect::HttpConnector;
    use sqlx::PgPool;

    use crate::harness::*;

    /// Kills a child process on drop, also when the test fails.
    struct Running(Child);

    impl Drop for Running {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A login role with `distribution roles --operator`'s grants on `pool`'s database (dropped
    /// with the guard), and the database URL that connects as it.
    struct OperatorRole {
        pool: PgPool,
        name: String,
        url: String,
    }

    impl OperatorRole {
        async fn create(pool: &PgPool, url: &str, label: &str) -> Self {
            let name = format!("console_op_{label}_{}", std::process::id());
            let grants = store::roles_sql(
                &store::Roles {
                    operator: Some(name.clone()),
                    ..store::Roles::default()
                },
                store::RolesFor::Outbox,
                None,
            )
            .unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP ROLE IF EXISTS {name}; CREATE ROLE {name} LOGIN; {grants}"
            )))
            .execute(pool)
            .await
            .unwrap();
            let mut as_role = url::Url::parse(url).unwrap();
            as_role.set_username(&name).unwrap();
            as_role.set_password(None).unwrap();
            Self {
                pool: pool.clone(),
                name,
                url: as_role.to_string(),
            }
        }
    }

    impl Drop for OperatorRole {
        fn drop(&mut self) {
            let (pool, name) = (self.pool.clone(), self.name.clone());
            // The role owns nothing; its grants go with it.
            let _ = std::thread::spawn(move || {
                tokio::runtime::Runtime::new().unwrap().block_on(async {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP OWNED BY {name}; DROP ROLE {name}"
                    )))
                    .execute(&pool)
                    .await;
                })
            })
            .join();
        }
    }

    /// A fresh database, a topology named after `label` (its config and broker settings), and an
    /// operator's role on the database named after `role`.
    async fn setup(
        label: &str,
        role: &str,
    ) -> (
        PgPool,
        distribution::RelayConfig,
        RabbitConfig,
        OperatorRole,
    ) {
        let (pool, url) = fresh_database(label).await;
        let config = relay_config(&url, &amqp_url(), &unique(label));
        let rabbit = config.rabbit_config().unwrap();
        let operator = OperatorRole::create(&pool, &url, role).await;
        (pool, config, rabbit, operator)
    }

    /// `distribution console` on `addr`, as the operator's role; waits until it serves.
    async fn console(
        database: &str,
        rabbit: &RabbitConfig,
        addr: &str,
        token: Option<&str>,
    ) -> Running {
        let mut command = relay_command();
        command
            .args(["console", "--listen", addr])
            .env("DATABASE_URL", database)
            .env("AMQP_URL", amqp_url())
            .env("RELAY_TOPOLOGY", rabbit.topology.exchange().as_str())
            .env("RELAY_PARTITIONS", rabbit.topology.partitions().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(token) = token {
            command.env("RELAY_CONSOLE_TOKEN", token);
        }
        let running = Running(command.spawn().unwrap());
        wait_until("the console serves", Duration::from_secs(20), || async {
            http_send(addr, "GET", "/console.css", &[], Vec::new())
                .await
                .is_some()
        })
        .await;
        running
    }

    /// Writes `bodies` as lsn 1.. of a new run of `tenant`; returns its branch.
    async fn write(pool: &PgPool, tenant: &str, bodies: &[&str]) -> BranchKey {
        let branch = BranchKey::new(
            store::TenantId::new(tenant).unwrap(),
            store::RunId::new(unique("r").replace(['_'], "-")).unwrap(),
            store::BranchId::new("main").unwrap(),
        );
        let writer = IntentWriter::default();
        let mut conn = pool.acquire().await.unwrap();
        writer.open_run(&mut conn, &branch).await.unwrap();
        for (lsn, body) in bodies.iter().enumerate() {
            writer
                .append(
                    &mut conn,
                    &branch,
                    Lsn::new(lsn as u64 + 1),
                    body.as_bytes(),
                )
                .await
                .unwrap();
        }
        branch
    }

    /// The payloads the fold applied on `branch`, by lsn.
    async fn folded(pool: &PgPool, branch: &BranchKey) -> Vec<String> {
        let rows: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT payload FROM relay_fold_event
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 ORDER BY lsn",
        )
        .bind(branch.tenant.as_str())
        .bind(branch.run.as_str())
        .bind(branch.branch.as_str())
        .fetch_all(pool)
        .await
        .unwrap();
        rows.into_iter()
            .map(|row| String::from_utf8(row).unwrap())
            .collect()
    }

    /// chromedriver on a free port, and a headless Chromium session through it.
    async fn browser() -> (Running, fantoccini::Client) {
        let port = free_addr().rsplit_once(':').unwrap().1.to_owned();
        let driver = Running(
            Command::new("chromedriver")
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("chromedriver (Debian's chromium-driver; .ci/run installs it)"),
        );
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                         "--no-first-run", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync",
                         "--window-size=1200,1000"],
            }),
        );
        let driver_addr = format!("127.0.0.1:{port}");
        wait_until("chromedriver listens", Duration::from_secs(20), || async {
            tokio::net::TcpStream::connect(&driver_addr).await.is_ok()
        })
        .await;
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://{driver_addr}"))
            .await
            .expect("a Chromium session");
        (driver, client)
    }

    /// Keeps a screenshot of the page the browser shows (a picture of each page, in addition
    /// to the checks on its content).
    async fn screenshot(browser: &fantoccini::Client, name: &str) {
        let png = browser.screenshot().await.unwrap();
        assert!(png.starts_with(b"\x89PNG"), "{name}: a PNG");
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    async fn text_of(browser: &fantoccini::Client, css: &str) -> String {
        browser
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|err| panic!("{css}: {err}"))
            .text()
            .await
            .unwrap()
    }

    /// Clicks `what`, waits for the page that has `arrives` (an element the page clicked on
    /// does not have), and returns that page's text.
    async fn follow(browser: &fantoccini::Client, what: Locator<'_>, arrives: &str) -> String {
        browser.find(what).await.unwrap().click().await.unwrap();
        browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(arrives))
            .await
            .unwrap_or_else(|err| panic!("no {arrives} after the click: {err}"));
        text_of(browser, "main").await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_browser_releases_a_parked_branch_and_replays_a_dead_letter() {
        let (pool, config, rabbit, operator) = setup("console", "browser").await;
        let test = async {
            // A branch parked before any relay ran (as after the broker kept refusing it),
            // for an hour; and a branch whose first event the consumer dead-letters.
            let parked = write(&pool, "console-parked", &["p1", "p2", "p3"]).await;
            Outbox::new(pool.clone())
                .park_branch(
                    &parked,
                    "nacked",
                    4,
                    Duration::from_secs(30),
                    Duration::from_secs(3600),
                )
                .await
                .unwrap();
            let poisoned = write(&pool, "console-dead", &["poison 1", "fine 2"]).await;
            declare_topology(&rabbit.topology).await;
            let relay = Relay::start(config.clone()).await.unwrap();
            let consumer = PickyConsumer::start(&rabbit, &pool);
            let dead = DeadLetters::open(&rabbit).await.unwrap();
            wait_until("a dead letter", Duration::from_secs(30), || async {
                dead.depth().await.unwrap() == 1 && consumer.progress.totals().rejected == 1
            })
            .await;
            // Nothing of the parked branch ships before the release.
            assert!(folded(&pool, &parked).await.is_empty());

            let addr = free_addr();
            let _console = console(&operator.url, &rabbit, &addr, None).await;
            let (_driver, browser) = browser().await;
            let base = format!("http://{addr}");

            browser.goto(&format!("{base}/")).await.unwrap();
            let relays = text_of(&browser, "#relays").await;
            assert!(
                relays.contains("128"),
                "one relay holds every bucket: {relays}"
            );
            let broker = text_of(&browser, "#broker").await;
            assert!(
                broker.contains("up") && broker.contains("RabbitMQ"),
                "{broker}"
            );
            assert!(!broker.contains("guest"), "no credentials shown: {broker}");
            let backlog = text_of(&browser, "#backlog").await;
            assert!(
                backlog.contains("console-parked") && backlog.contains("1 parked branch"),
                "{backlog}"
            );
            let groups = text_of(&browser, "#groups").await;
            assert!(
                groups.contains(rabbit.topology.dead_letter_queue().as_str()),
                "{groups}"
            );
            // What needs an operator first, when the page was read, the group's partitions.
            let attention = text_of(&browser, "#attention").await;
            assert!(
                attention.contains("1 dead letter(s)") && attention.contains("1 parked branch"),
                "{attention}"
            );
            let as_of = text_of(&browser, ".asof").await;
            assert!(
                as_of.starts_with("As of 20") && as_of.ends_with("UTC. Refresh"),
                "{as_of}"
            );
            let partitions = rabbit.topology.partitions();
            assert!(
                groups.contains(&format!("{partitions} of {partitions}")),
                "every partition queue counted: {groups}"
            );
            // The lag plot's readout (the console samples every 5 s, the first at its start).
            wait_until("a lag sample", Duration::from_secs(20), || async {
                browser.goto(&format!("{base}/")).await.unwrap();
                browser.find(Locator::Css("#lag .readout")).await.is_ok()
            })
            .await;
            let readout = text_of(&browser, "#lag .readout").await;
            assert!(readout.starts_with("Now "), "{readout}");
            screenshot(&browser, "overview").await;

            // A tenant's page, from its name in the backlog: its waiting branch (Lsns 1-3),
            // its parked branch; then the other tenant's dead letter.
            let tenant = follow(
                &browser,
                Locator::LinkText("console-parked"),
                "#tenant-backlog",
            )
            .await;
            assert!(
                tenant.contains("3 intent(s) wait on 1 branch(es)")
                    && tenant.contains("1–3")
                    && tenant.contains("broker nacked"),
                "{tenant}"
            );
            screenshot(&browser, "tenant").await;
            browser
                .goto(&format!("{base}/tenant/console-dead"))
                .await
                .unwrap();
            let theirs = text_of(&browser, "#tenant-dead").await;
            assert!(
                theirs.contains(&format!("{poisoned}/1"))
                    && theirs.contains("1 of the group's 1 dead letter(s)"),
                "{theirs}"
            );
            screenshot(&browser, "tenant-dead").await;

            // Parked branches: the cause, the reason and count, the way out, then Release.
            browser.goto(&format!("{base}/parked")).await.unwrap();
            let row = text_of(&browser, "#parked tbody tr").await;
            assert!(
                row.contains("console-parked")
                    && row.contains("broker nacked")
                    && row.contains("nacked")
                    && row.contains('3'),
                "{row}"
            );
            let causes = text_of(&browser, "#causes").await;
            assert!(
                causes.contains(
                    &distribution::store::ParkCause::Nacked
                        .way_out()
                        .replace('`', "")
                ),
                "{causes}"
            );
            screenshot(&browser, "parked").await;
            // Discard asks first and says what it does on the wire; cancelled here.
            let asked = follow(
                &browser,
                Locator::Css("#parked button[value=discard]"),
                "input[name=to]",
            )
            .await;
            assert!(asked.contains("rewind marker"), "{asked}");
            assert!(
                asked.contains("3 event(s) wait now"),
                "what it drops: {asked}"
            );
            screenshot(&browser, "discard-confirm").await;
            follow(&browser, Locator::LinkText("Cancel"), "#parked").await;
            follow(
                &browser,
                Locator::Css("#parked button[value=release]"),
                "#done",
            )
            .await;
            let done = text_of(&browser, "#done").await;
            assert!(done.starts_with("Released console-parked/"), "{done}");
            wait_until(
                "the released branch folds",
                Duration::from_secs(30),
                || async { folded(&pool, &parked).await == ["p1", "p2", "p3"] },
            )
            .await;

            // The dead letter: listed, shown, replayed once the handler is fixed.
            browser.goto(&format!("{base}/dead/default")).await.unwrap();
            let letters = text_of(&browser, "#letters").await;
            let id = format!("{poisoned}/1");
            assert!(
                letters.contains(&id) && letters.contains("poison"),
                "{letters}"
            );
            screenshot(&browser, "dead-letters").await;
            follow(&browser, Locator::LinkText(&id), "#body").await;
            assert_eq!(text_of(&browser, "#body").await, "poison 1");
            let letter = text_of(&browser, "#letter").await;
            assert!(letter.contains("written at"), "{letter}");
            screenshot(&browser, "dead-letter").await;
            // Its own Replay asks first, naming this letter alone; cancelled by going back.
            let asked = follow(
                &browser,
                Locator::Css("#letter-actions button[value=replay]"),
                "input[name=confirmed]",
            )
            .await;
            assert!(asked.contains(&id), "{asked}");
            browser.back().await.unwrap();
            browser.back().await.unwrap();
            browser
                .wait()
                .for_element(Locator::Css("#letters"))
                .await
                .unwrap();
            consumer.fixed();
            let asked = follow(
                &browser,
                Locator::Css("#letters button[value=replay]"),
                "input[name=confirmed]",
            )
            .await;
            assert!(asked.contains("1 of the 1 dead letter(s)"), "{asked}");
            follow(
                &browser,
                Locator::Css("main form button[value=replay]"),
                "#done",
            )
            .await;
            let done = text_of(&browser, "#done").await;
            assert!(
                done.starts_with("Replayed 1 dead letter(s)") && done.ends_with("now holds 0."),
                "{done}"
            );
            screenshot(&browser, "replayed").await;
            wait_until(
                "the replayed letter folds",
                Duration::from_secs(30),
                || async { folded(&pool, &poisoned).await == ["poison 1", "fine 2"] },
            )
            .await;
            browser.close().await.unwrap();
            consumer.stop().await;
            relay.shutdown().await;
        };
        // The operator's role goes when `operator` drops, on a failure too.
        then_clean_up(test, drop_topology(&rabbit.topology)).await;
    }

    /// A POST of a form `body` with `headers`.
    async fn post(addr: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        let mut all = vec![("content-type", "application/x-www-form-urlencoded")];
        all.extend_from_slice(headers);
        let (status, _, body) = http_send(addr, "POST", path, &all, body.as_bytes().to_vec())
            .await
            .unwrap();
        (status, body)
    }

    /// The CSRF token of the first form on `page`.
    fn csrf_of(page: &str) -> String {
        let at = page.find("name=\"csrf\" value=\"").expect("a form") + 19;
        page[at..at + 64].to_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn hostile_and_malformed_requests_get_a_clear_refusal_and_change_nothing() {
        let (pool, _, rabbit, operator) = setup("consolehostile", "hostile").await;
        let test = async {
            // Not loopback and no token, or a short one: refused at the door, one line, exit 2.
            for (args, says) in [
                (vec!["--listen", "0.0.0.0:0"], "not loopback"),
                (vec!["--token", "short"], "shorter than 16"),
            ] {
                let output = relay_command()
                    .arg("console")
                    .args(&args)
                    .env("DATABASE_URL", &operator.url)
                    .output()
                    .unwrap();
                let stderr = String::from_utf8_lossy(&output.stderr);
                assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
                assert!(
                    stderr.contains(says) && stderr.lines().count() == 1,
                    "{stderr}"
                );
            }

            let parked = write(&pool, "hostile", &["x"]).await;
            Outbox::new(pool.clone())
                .park_branch(
                    &parked,
                    "<script>alert('reason')</script>",
                    1,
                    Duration::ZERO,
                    Duration::from_secs(3600),
                )
                .await
                .unwrap();
            declare_topology(&rabbit.topology).await;
            // Dead letters a person could not trust: script in the id, a header and the body,
            // and a binary body.
            let connection = lapin::Connection::connect(&amqp_url(), Default::default())
                .await
                .unwrap();
            let channel = connection.create_channel().await.unwrap();
            let mut headers = lapin::types::FieldTable::default();
            headers.insert(
                "x-relay-dead-letter-reason".into(),
                lapin::types::AMQPValue::LongString("<img src=x onerror=alert(1)>".into()),
            );
            for (id, body) in [
                (
                    "<script>alert('id')</script>",
                    b"<script>alert('body')</script>".to_vec(),
                ),
                ("binary", vec![0u8, 0xff, 0xfe, b'<', 7]),
            ] {
                channel
                    .basic_publish(
                        "".into(),
                        rabbit.topology.dead_letter_queue(),
                        Default::default(),
                        &body,
                        lapin::BasicProperties::default()
                            .with_message_id(id.into())
                            .with_headers(headers.clone()),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            let _ = connection.close(200, "done".into()).await;

            let addr = free_addr();
            let token = "a-console-token-of-32-characters";
            let _console = console(&operator.url, &rabbit, &addr, Some(token)).await;
            let bearer = format!("Bearer {token}");
            let auth = [("authorization", bearer.as_str())];

            // The token: none, a wrong one, then the right one as basic auth's password and as
            // a bearer token.
            let (status, headers, page) =
                http_send(&addr, "GET", "/", &[], Vec::new()).await.unwrap();
            assert_eq!(status, 401, "{page}");
            assert!(headers.get("www-authenticate").is_some());
            // A refusal for want of the token shows nothing of the console's settings.
            assert!(!page.contains("/dead/default"), "{page}");
            let wrong = [("authorization", "Bearer a-console-token-of-32-characterZ")];
            assert_eq!(
                http_send(&addr, "GET", "/", &wrong, Vec::new())
                    .await
                    .unwrap()
                    .0,
                401
            );
            // user:token in basic auth ("op:a-console-token-of-32-characters").
            let basic = [(
                "authorization",
                "Basic b3A6YS1jb25zb2xlLXRva2VuLW9mLTMyLWNoYXJhY3RlcnM=",
            )];
            assert_eq!(
                http_send(&addr, "GET", "/", &basic, Vec::new())
                    .await
                    .unwrap()
                    .0,
                200
            );
            let (status, headers, page) = http_send(&addr, "GET", "/parked", &auth, Vec::new())
                .await
                .unwrap();
            assert_eq!(status, 200);
            assert!(
                headers["content-security-policy"]
                    .to_str()
                    .unwrap()
                    .starts_with("default-src 'none'"),
                "{headers:?}"
            );
            // Script in the reason is shown as text.
            assert!(
                page.contains("&lt;script&gt;alert('reason')&lt;/script&gt;"),
                "{page}"
            );
            assert!(!page.contains("<script"), "{page}");
            let csrf = csrf_of(&page);
            let release = format!(
                "csrf={csrf}&action=release&tenant=hostile&run={}&branch=main",
                parked.run
            );

            // Forged, cross-site, malformed and huge actions: each refused with a page that
            // says why, and the branch stays parked.
            let forged = release.replace(&csrf, &"0".repeat(64));
            for (what, headers, body, status, says) in [
                (
                    "no csrf",
                    vec![],
                    "action=release&tenant=hostile&run=r&branch=main".to_owned(),
                    422,
                    "csrf",
                ),
                (
                    "a forged csrf",
                    vec![],
                    forged,
                    403,
                    "not one of the console's",
                ),
                (
                    "another site's origin",
                    vec![("origin", "http://evil.example")],
                    release.clone(),
                    403,
                    "own pages",
                ),
                (
                    "a cross-site fetch",
                    vec![("sec-fetch-site", "cross-site")],
                    release.clone(),
                    403,
                    "own pages",
                ),
                (
                    "an unknown action",
                    vec![],
                    release.replace("release", "explode"),
                    422,
                    "action",
                ),
                (
                    "a script for a tenant",
                    vec![],
                    release.replace("tenant=hostile", "tenant=%3Cscript%3E"),
                    400,
                    "tenant",
                ),
                (
                    "a huge body",
                    vec![],
                    format!("{release}&pad={}", "x".repeat(1 << 20)),
                    413,
                    "limit",
                ),
            ] {
                let mut all = auth.to_vec();
                all.extend(headers);
                let (got, page) = post(&addr, "/parked/act", &all, &body).await;
                assert_eq!(got, status, "{what}: {page}");
                assert!(page.to_lowercase().contains(says), "{what}: {page}");
                assert!(!page.contains("<script"), "{what}: {page}");
            }
            assert_eq!(
                Outbox::new(pool.clone())
                    .parked_branches()
                    .await
                    .unwrap()
                    .len(),
                1
            );
            // The same form, well made, releases.
            let (got, page) = post(&addr, "/parked/act", &auth, &release).await;
            assert_eq!(got, 200, "{page}");
            assert!(page.contains("Released hostile/"), "{page}");
            assert!(
                Outbox::new(pool.clone())
                    .parked_branches()
                    .await
                    .unwrap()
                    .is_empty()
            );

            // Routes and queries that are not the console's.
            for (method, path, status) in [
                ("GET", "/nothing", 404),
                ("GET", "/dead/nope", 404),
                ("GET", "/dead/default/show?id=missing", 404),
                ("GET", "/dead/default/show", 400),
                ("GET", "/?page=abc", 400),
                ("GET", "/?page=18446744073709551615", 400),
                ("GET", "/tenant/not%20an%20id", 400),
                ("GET", "/tenant/%3Cscript%3E", 400),
                ("DELETE", "/", 405),
            ] {
                let (got, _, page) = http_send(&addr, method, path, &auth, Vec::new())
                    .await
                    .unwrap();
                assert_eq!(got, status, "{method} {path}: {page}");
                assert!(page.contains("<p id=\"error\">"), "{method} {path}: {page}");
                // An error page keeps the navigation: the dead letters are one click away.
                assert!(
                    page.contains("<a href=\"/dead/default\">Dead letters: default</a>"),
                    "{method} {path}: {page}"
                );
                assert!(!page.contains("<script>"), "{method} {path}: {page}");
            }

            // The hostile dead letters: escaped in the list and on their page; binary as hex.
            let (_, _, page) = http_send(&addr, "GET", "/dead/default", &auth, Vec::new())
                .await
                .unwrap();
            assert!(
                page.contains("&lt;script&gt;alert('id')&lt;/script&gt;"),
                "{page}"
            );
            assert!(
                page.contains("&lt;img src=x onerror=alert(1)&gt;"),
                "{page}"
            );
            assert!(
                !page.contains("<script") && !page.contains("<img"),
                "{page}"
            );
            let show = format!(
                "/dead/default/show?id={}",
                "%3Cscript%3Ealert('id')%3C%2Fscript%3E"
            );
            let (got, _, page) = http_send(&addr, "GET", &show, &auth, Vec::new())
                .await
                .unwrap();
            assert_eq!(got, 200, "{page}");
            assert!(
                page.contains("&lt;script&gt;alert('body')&lt;/script&gt;"),
                "{page}"
            );
            assert!(!page.contains("<script"), "{page}");
            let (_, _, page) = http_send(
                &addr,
                "GET",
                "/dead/default/show?id=binary",
                &auth,
                Vec::new(),
            )
            .await
            .unwrap();
            assert!(
                page.contains("shown as hex") && page.contains("00fffe3c07"),
                "{page}"
            );
            // A purge asks first; the letters are still there until it is confirmed.
            let (got, page) = post(
                &addr,
                "/dead/default/act",
                &auth,
                &format!("csrf={csrf}&action=purge&select=all"),
            )
            .await;
            assert_eq!(got, 200, "{page}");
            assert!(page.contains("2 of the 2 dead letter(s)"), "{page}");
            let dead = DeadLetters::open(&rabbit).await.unwrap();
            assert_eq!(dead.depth().await.unwrap(), 2);
            let (_, page) = post(
                &addr,
                "/dead/default/act",
                &auth,
                &format!("csrf={csrf}&action=purge&select=message&message_id=binary&confirmed=yes"),
            )
            .await;
            assert!(
                page.contains("Purged 1 dead letter(s)") && page.contains("now holds 1"),
                "{page}"
            );
        };
        // The operator's role goes when `operator` drops, on a failure too.
        then_clean_up(test, drop_topology(&rabbit.topology)).await;
    }

    /// The console with `RELAY_BROKER=nats`: the overview names the NATS server, what its acks
    /// mean and what the stream holds; a group's dead letters (its subject of the dead-letter
    /// stream) are counted, listed, shown whole and purged, and another group's are left alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_nats_the_console_shows_the_server_and_a_groups_dead_letters() {
        use distribution::nats::{NatsConfig, NatsDeadLetters, Reading};

        let (pool, url) = fresh_database("consolenats").await;
        let operator = OperatorRole::create(&pool, &url, "nats").await;
        let stream = distribution::nats::scratch::unique_stream("console");
        let nats = NatsConfig::new(&testkit::nats_url(), &stream, 2).unwrap();
        let test = async {
            // The streams, as a consumer declares them, and two letters: the group's and
            // another group's.
            Reading::connect(&nats).await.unwrap();
            let client = async_nats::connect(testkit::nats_url()).await.unwrap();
            let context = async_nats::jetstream::new(client);
            for (group, id) in [("projector", "kept-1"), ("other", "kept-2")] {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id);
                headers.insert(
                    distribution::broker::DEAD_LETTER_REASON,
                    "contract: <b>not</b> an event",
                );
                context
                    .publish_with_headers(
                        format!("{stream}_dead.{group}"),
                        headers,
                        "<script>alert('body')</script>".into(),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            let addr = free_addr();
            let _console = {
                let running = Running(
                    relay_command()
                        .args(["console", "--listen", &addr])
                        .env("DATABASE_URL", &operator.url)
                        .env("RELAY_BROKER", "nats")
                        .env("NATS_URL", testkit::nats_url())
                        .env("RELAY_TOPOLOGY", &stream)
                        .env("RELAY_PARTITIONS", "2")
                        .env("RELAY_GROUPS", "projector")
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .unwrap(),
                );
                wait_until("the console serves", Duration::from_secs(20), || async {
                    http_send(&addr, "GET", "/console.css", &[], Vec::new())
                        .await
                        .is_some()
                })
                .await;
                running
            };
            let get = |path: String| {
                let addr = addr.clone();
                async move {
                    let (status, _, body) = http_send(&addr, "GET", &path, &[], Vec::new())
                        .await
                        .unwrap();
                    assert_eq!(status, 200, "{path}: {body}");
                    body
                }
            };
            let overview = get("/".into()).await;
            let version = async_nats::connect(testkit::nats_url())
                .await
                .unwrap()
                .server_info()
                .version;
            let durability = distribution::nats::durability_note(&version, 1)
                .expect("a one-replica stream has a note on every version");
            for expected in [
                format!("NATS {version}"),
                format!("stream {stream} holds 0 messages"),
                durability,
                "1 dead letter(s) wait".to_owned(),
                format!("{stream}_dead.projector"),
                "none on NATS".to_owned(),
            ] {
                assert!(overview.contains(&expected), "{expected:?} in {overview}");
            }
            let listed = get("/dead/projector".into()).await;
            assert!(
                listed.contains("kept-1") && !listed.contains("kept-2"),
                "{listed}"
            );
            assert!(!listed.contains("<b>not</b>"), "escaped: {listed}");
            let shown = get("/dead/projector/show?id=kept-1".into()).await;
            assert!(
                shown.contains("&lt;script&gt;alert(&#39;body&#39;)&lt;/script&gt;")
                    || shown.contains("&lt;script&gt;alert('body')&lt;/script&gt;"),
                "{shown}"
            );
            let csrf = csrf_of(&listed);
            let (got, page) = post(
                &addr,
                "/dead/projector/act",
                &[],
                &format!("csrf={csrf}&action=purge&select=all&confirmed=yes"),
            )
            .await;
            assert_eq!(got, 200, "{page}");
            assert!(
                page.contains("Purged 1 dead letter(s)") && page.contains("now holds 0"),
                "{page}"
            );
            let depth = |group: &'static str| {
                let nats = nats.clone();
                async move {
                    NatsDeadLetters::open(&nats, group)
                        .await
                        .unwrap()
                        .depth()
                        .await
                        .unwrap()
                }
            };
            assert_eq!(depth("projector").await, 0);
            assert_eq!(depth("other").await, 1, "another group's letter stays");
        };
        then_clean_up(
            test,
            distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream),
        )
        .await;
    }
}
