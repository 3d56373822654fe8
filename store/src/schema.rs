//! An optional PostgreSQL schema for the relay's objects (tables, the drain function, the
//! migration table), so they never mix with a host's own.
//!
//! The relay's connections get `search_path` = the schema ([`Schema::apply`]); the host's
//! statements name the schema explicitly (`IntentWriter::with_schema`), so the host's own
//! `search_path` is never touched.
use sqlx::postgres::PgConnectOptions;

use crate::error::Error;
use crate::key::InvalidId;

/// A schema name: lowercase ASCII letters, digits and `_`, starting with a letter or `_`, at
/// most 63 bytes, not `pg_*` or `information_schema` (so it never needs quoting).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Schema(String);

impl Schema {
    /// Validates `name`.
    pub fn new(name: impl AsRef<str>) -> Result<Self, Error> {
        let name = name.as_ref();
        identifier("schema", name, &["information_schema"])?;
        Ok(Self(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `options` whose connections find the relay's objects (and create them, when
    /// migrating) in this schema only.
    pub fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.options([("search_path", self.0.as_str())])
    }

    /// `statement` with every `relay_*` identifier outside string literals qualified by this
    /// schema.
    pub(crate) fn qualify(&self, statement: &str) -> String {
        let mut out = String::with_capacity(statement.len() + 32);
        let mut in_literal = false;
        let mut previous: Option<char> = None;
        let mut rest = statement;
        while let Some(c) = rest.chars().next() {
            let starts_identifier = !in_literal
                && rest.starts_with("relay_")
                && !previous.is_some_and(|p| p.is_ascii_alphanumeric() || p == '_' || p == '.');
            if starts_identifier {
                out.push_str(&self.0);
                out.push('.');
            }
            if c == '\'' {
                in_literal = !in_literal;
            }
            out.push(c);
            previous = Some(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

/// Checks that `name` is a PostgreSQL identifier that never needs quoting: lowercase ASCII
/// letters, digits and `_`, starting with a letter or `_`, at most 63 bytes, not `pg_*` and
/// none of `reserved`. A refusal names `kind`.
pub(crate) fn identifier(kind: &'static str, name: &str, reserved: &[&str]) -> Result<(), Error> {
    let invalid = |reason| {
        Error::from(InvalidId {
            kind,
            reason,
            value: name.chars().take(80).collect(),
        })
    };
    let mut bytes = name.bytes();
    match bytes.next() {
        Some(b'a'..=b'z' | b'_') => {}
        _ => return Err(invalid("must start with a lowercase letter or _")),
    }
    if !bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_')) {
        return Err(invalid("only lowercase letters, digits and _"));
    }
    if name.len() > 63 {
        return Err(invalid("at most 63 bytes"));
    }
    if name.starts_with("pg_") || reserved.contains(&name) {
        return Err(invalid("reserved by PostgreSQL"));
    }
    Ok(())
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Creates `schema` if it does not exist (before [`crate::migrations::migrate`] on a pool whose options
/// carry it).
pub async fn create_schema(pool: &sqlx::PgPool, schema: &Schema) -> Result<(), Error> {
    // The name is validated: no quoting or injection possible.
    let statement = format!("CREATE SCHEMA IF NOT EXISTS {}", schema.as_str());
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .execute(pool)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(Schema::new("relay").is_ok());
        assert!(Schema::new("_relay_2").is_ok());
        for bad in [
            "",
            "Relay",
            "2relay",
            "re-lay",
            "pg_relay",
            "information_schema",
            "a b",
        ] {
            assert!(Schema::new(bad).is_err(), "{bad:?}");
        }
        assert!(Schema::new("a".repeat(64)).is_err());
    }

    #[test]
    fn only_relay_identifiers_outside_literals_are_qualified() {
        let schema = Schema::new("ops").unwrap();
        let sql = "INSERT INTO relay_outbox SELECT * FROM relay_branch b, x.relay_other, \
                   my_relay_t, pg_notify('relay_outbox', $1)";
        assert_eq!(
            schema.qualify(sql),
            "INSERT INTO ops.relay_outbox SELECT * FROM ops.relay_branch b, x.relay_other, \
             my_relay_t, pg_notify('relay_outbox', $1)"
        );
    }
}
