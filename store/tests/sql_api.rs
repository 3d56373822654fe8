//! docs/sql-api.md as written: every signature in its functions tables is the one PostgreSQL
//! reports, every function a host or consumer may call is in a table, and every `sql` block runs,
//! in order, in one migrated database, with the results and refusals its comments state. The
//! examples are read from the file, so the doc and this test cannot drift apart.
mod common;

use std::collections::BTreeSet;

use common::fresh_database;
use sqlx::{Connection, Row};

const DOC: &str = include_str!("../../docs/sql-api.md");

/// The relay's own functions that no host or consumer calls (the drain, the checks behind
/// `relay_append`), so the doc need not show them.
const INTERNAL: &[&str] = &[
    "relay_ack_and_drain",
    "relay_require_id",
    "relay_require_meta",
    "relay_require_meta_0018",
    "relay_fold_epoch_at",
    "relay_wait_replicated",
    // Triggers (lease and member beats): nobody calls them.
    "relay_lease_beat",
    "relay_member_beat",
];

/// A documented signature: `name(arguments)` and, unless the function returns `void`,
/// ` returns <result>`.
#[derive(Debug, PartialEq, Eq)]
struct Signature {
    name: String,
    arguments: String,
    result: String,
}

/// The first cell of every functions-table row that names a `relay_` function.
fn documented_signatures(doc: &str) -> Vec<Signature> {
    doc.lines()
        .filter_map(|line| line.strip_prefix("| `relay_"))
        .map(|rest| {
            let cell = rest
                .split_once("` |")
                .expect("a signature cell ends with ` |")
                .0;
            let (name, rest) = cell.split_once('(').expect("a signature has arguments");
            let (arguments, result) = match rest.rsplit_once(") returns ") {
                Some((arguments, result)) => (arguments, result),
                None => (rest.strip_suffix(')').expect("closing parenthesis"), "void"),
            };
            Signature {
                name: format!("relay_{name}"),
                arguments: arguments.to_owned(),
                result: result.to_owned(),
            }
        })
        .collect()
}

/// One statement of an example and what its comment says of it.
#[derive(Debug)]
struct Statement {
    sql: String,
    expect: Expect,
}

#[derive(Debug, PartialEq, Eq)]
enum Expect {
    /// No comment about the result: it must succeed.
    Success,
    /// `-- = a, b`: its first row, columns as text joined by `, ` (NULL as `NULL`).
    Row(String),
    /// `-- refused: RL110`: it fails with this SQLSTATE.
    Refused(String),
}

/// The doc's ```sql blocks, split into statements. A statement ends on a line whose code (what
/// precedes `--`) ends with `;`; the examples keep `--` out of their string literals.
fn examples(doc: &str) -> Vec<Statement> {
    let mut statements = Vec::new();
    let mut in_block = false;
    let mut sql = String::new();
    let mut expect = Expect::Success;
    for line in doc.lines() {
        if !in_block {
            in_block = line.trim_end() == "```sql";
            continue;
        }
        if line.trim_end() == "```" {
            assert!(sql.trim().is_empty(), "a statement without `;`: {sql}");
            in_block = false;
            continue;
        }
        let (code, comment) = line.split_once("--").unwrap_or((line, ""));
        let comment = comment.trim();
        if let Some(row) = comment.strip_prefix("= ") {
            expect = Expect::Row(row.to_owned());
        } else if let Some(state) = comment.strip_prefix("refused: ") {
            expect = Expect::Refused(state.to_owned());
        }
        sql.push_str(code);
        sql.push('\n');
        if code.trim_end().ends_with(';') {
            statements.push(Statement {
                sql: std::mem::take(&mut sql),
                expect: std::mem::replace(&mut expect, Expect::Success),
            });
        }
    }
    assert!(!in_block, "an unclosed sql block");
    statements
}

#[tokio::test]
async fn every_signature_in_the_sql_api_doc_is_the_databases() {
    let pool = fresh_database("sql_api_signatures").await;
    let rows = sqlx::query(
        "SELECT p.proname::text AS name, pg_get_function_arguments(p.oid) AS arguments,
                pg_get_function_result(p.oid) AS result
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE n.nspname = current_schema() AND p.proname LIKE 'relay\\_%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let actual: Vec<Signature> = rows
        .iter()
        .map(|row| Signature {
            name: row.get("name"),
            arguments: row.get("arguments"),
            result: row.get("result"),
        })
        .collect();
    let documented = documented_signatures(DOC);
    assert!(
        documented.len() >= 10,
        "the tables were found: {documented:?}"
    );
    for signature in &documented {
        assert!(
            actual.contains(signature),
            "docs/sql-api.md shows {signature:?}; PostgreSQL has {:?}",
            actual
                .iter()
                .filter(|a| a.name == signature.name)
                .collect::<Vec<_>>()
        );
    }
    let shown: BTreeSet<&str> = documented.iter().map(|s| s.name.as_str()).collect();
    for function in &actual {
        assert!(
            shown.contains(function.name.as_str()) || INTERNAL.contains(&function.name.as_str()),
            "{} is callable but docs/sql-api.md does not show it",
            function.name
        );
    }
}

#[tokio::test]
async fn every_example_in_the_sql_api_doc_runs_as_written() {
    let pool = fresh_database("sql_api_examples").await;
    let statements = examples(DOC);
    assert!(
        statements.len() >= 20,
        "the examples were found: {statements:?}"
    );
    let mut conn = pool.acquire().await.unwrap().detach();
    for statement in &statements {
        let outcome = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.sql.clone()))
            .fetch_all(&mut conn)
            .await;
        match (&statement.expect, outcome) {
            (Expect::Success, Ok(_)) => {}
            (Expect::Row(expected), Ok(rows)) => {
                let row = rows
                    .first()
                    .unwrap_or_else(|| panic!("no row from {}", statement.sql));
                // The simple query protocol returns every column as text.
                let columns: Vec<String> = (0..row.len())
                    .map(|i| {
                        row.try_get_unchecked::<Option<String>, _>(i)
                            .unwrap()
                            .unwrap_or_else(|| "NULL".to_owned())
                    })
                    .collect();
                assert_eq!(&columns.join(", "), expected, "{}", statement.sql);
            }
            (Expect::Refused(state), Err(sqlx::Error::Database(err))) => {
                assert_eq!(
                    err.code().as_deref(),
                    Some(state.as_str()),
                    "{}",
                    statement.sql
                );
            }
            (expect, outcome) => {
                panic!("{} should give {expect:?}, gave {outcome:?}", statement.sql)
            }
        }
    }
    conn.close().await.unwrap();
}
