//! Least privilege: the grants that let a host, a relay and a consumer each do only their part
//! (`distribution roles` prints them).
//!
//! - the **host** role may only call the write API (`relay_open_run`, `relay_append`,
//!   `relay_rewind`, `relay_close_run`): no privilege on any table, so it cannot read, drain,
//!   ack or delete outbox rows;
//! - the **relay** role may drain and ack (`relay_ack_and_drain`, reading and deleting outbox
//!   rows), park branches, hold leases and retire closed runs (`relay_retire_runs`), and
//!   nothing else: it cannot write intents or change branches, and needs neither superuser nor
//!   owner rights (run it with `RELAY_SKIP_MIGRATE=true`; the owner migrates);
//! - the **consumer** role may only call `relay_fold`, `relay_fold_retire`, the stream
//!   offset functions (`relay_fold_offset`, `relay_fold_save_offset`, `relay_fold_reset`),
//!   `relay_fold_adopt` (the way out of a divergence after a failover) and `relay_fold_batch`
//!   (and own its projection's tables).
//!
//! - the **operator** role (the console's, or a person's with `distribution status`,
//!   `release` and `discard`) may read the status views (`relay_backlog_status`,
//!   `relay_oldest_wait`, `relay_parked_status`, `relay_relays_status`, `relay_branch_status`) and call
//!   `relay_release` and `relay_discard_branch`: it sees counts, ages and reasons, never a payload, and changes
//!   nothing but parked branches.
//!
//! The write functions and `relay_fold` are `SECURITY DEFINER` (they act as the objects'
//! owner), so the roles need no privilege on the tables behind them. PostgreSQL grants EXECUTE on
//! every new function to PUBLIC; the script revokes that for the relay's functions.
use crate::error::Error;
use crate::schema::Schema;
use crate::schema::identifier;

/// The roles to grant to; each must already exist (`CREATE ROLE ... LOGIN`).
#[derive(Clone, Debug, Default)]
pub struct Roles {
    /// The host's role: the write API only.
    pub host: Option<String>,
    /// The relay's role: drain, ack, park, leases.
    pub relay: Option<String>,
    /// A consumer's role: `relay_fold` only.
    pub consumer: Option<String>,
    /// An operator's role: the status views, release and discard.
    pub operator: Option<String>,
}

/// Which database the grants are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolesFor {
    /// The host's database, migrated with [`crate::migrations::migrate`] (outbox and fold).
    Outbox,
    /// A consumer's own database, migrated with [`crate::migrations::migrate_fold`] (the fold only).
    Fold,
}

const HOST_FUNCTIONS: &[&str] = &[
    "relay_open_run",
    "relay_append",
    "relay_rewind",
    "relay_close_run",
];
const RELAY_FUNCTIONS: &[&str] = &[
    "relay_ack_and_drain",
    "relay_retire_runs",
    "relay_wait_replicated",
];
const OPERATOR_FUNCTIONS: &[&str] = &["relay_release", "relay_discard_branch"];
const OPERATOR_VIEWS: &[&str] = &[
    "relay_backlog_status",
    "relay_oldest_wait",
    "relay_parked_status",
    "relay_relays_status",
    "relay_branch_status",
];
const CONSUMER_FUNCTIONS: &[&str] = &[
    "relay_fold",
    "relay_fold_retire",
    "relay_fold_offset",
    "relay_fold_save_offset",
    "relay_fold_reset",
    "relay_fold_adopt",
    "relay_fold_batch",
];

fn role(kind: &'static str, name: &str) -> Result<String, Error> {
    identifier(kind, name, &["public"])?;
    Ok(name.to_owned())
}

/// The grants for `roles` on a database of kind `on`, with the relay's objects in `schema`
/// (`None`: the applying session's `search_path`, normally `public`). Apply it as the role that
/// migrated (the objects' owner). Role names are lowercase identifiers.
pub fn roles_sql(roles: &Roles, on: RolesFor, schema: Option<&Schema>) -> Result<String, Error> {
    let host = roles
        .host
        .as_deref()
        .map(|r| role("host role", r))
        .transpose()?;
    let relay = roles
        .relay
        .as_deref()
        .map(|r| role("relay role", r))
        .transpose()?;
    let consumer = roles
        .consumer
        .as_deref()
        .map(|r| role("consumer role", r))
        .transpose()?;
    let operator = roles
        .operator
        .as_deref()
        .map(|r| role("operator role", r))
        .transpose()?;
    // Objects named in the schema; role names are never touched.
    let names = |objects: &[&str]| {
        objects
            .iter()
            .map(|object| match schema {
                Some(schema) => format!("{schema}.{object}"),
                None => (*object).to_owned(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut sql = String::from(
        "-- Least-privilege grants for the outbox relay (`distribution roles`). Apply as the owner\n\
         -- of the relay's objects (the role that ran `distribution migrate`); the roles must exist.\n",
    );
    let all: &[&str] = match on {
        RolesFor::Outbox => &[
            "relay_open_run",
            "relay_append",
            "relay_rewind",
            "relay_close_run",
            "relay_require_id",
            "relay_require_meta",
            "relay_require_meta_0018",
            "relay_current_epoch",
            "relay_ack_and_drain",
            "relay_retire_runs",
            "relay_wait_replicated",
            "relay_discard_branch",
            "relay_release",
            "relay_fold",
            "relay_fold_retire",
            "relay_fold_offset",
            "relay_fold_save_offset",
            "relay_fold_reset",
            "relay_fold_adopt",
            "relay_fold_batch",
        ],
        RolesFor::Fold => CONSUMER_FUNCTIONS,
    };
    sql.push_str(&format!(
        "REVOKE EXECUTE ON FUNCTION {} FROM PUBLIC;\n",
        names(all)
    ));
    let usage = |sql: &mut String, role: &str| {
        if let Some(schema) = schema {
            sql.push_str(&format!("GRANT USAGE ON SCHEMA {schema} TO {role};\n"));
        }
    };
    if on == RolesFor::Outbox {
        if let Some(host) = &host {
            sql.push_str(&format!(
                "-- The host: the write API only; it owns its own tables, not the relay's.\n\
                 GRANT EXECUTE ON FUNCTION {} TO {host};\n",
                names(HOST_FUNCTIONS)
            ));
            usage(&mut sql, host);
        }
        if let Some(relay) = &relay {
            sql.push_str(&format!(
                "-- The relay: drain and ack, park branches, hold leases, retire closed runs.\n\
                 GRANT EXECUTE ON FUNCTION {} TO {relay};\n\
                 GRANT SELECT, DELETE ON {} TO {relay};\n\
                 GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {relay};\n\
                 GRANT SELECT, UPDATE ON {} TO {relay};\n",
                names(RELAY_FUNCTIONS),
                names(&["relay_outbox"]),
                names(&["relay_parked_branch", "relay_member"]),
                names(&["relay_lease"]),
            ));
            usage(&mut sql, relay);
        }
        if let Some(operator) = &operator {
            sql.push_str(&format!(
                "-- An operator: the status views (counts, ages, reasons; no payload), release and\n\
                 -- discard parked branches.\n\
                 GRANT EXECUTE ON FUNCTION {} TO {operator};\n\
                 GRANT SELECT ON {} TO {operator};\n",
                names(OPERATOR_FUNCTIONS),
                names(OPERATOR_VIEWS),
            ));
            usage(&mut sql, operator);
        }
    }
    if let Some(consumer) = &consumer {
        sql.push_str(&format!(
            "-- A consumer: the fold only; it owns its projection's tables.\n\
             GRANT EXECUTE ON FUNCTION {} TO {consumer};\n",
            names(CONSUMER_FUNCTIONS)
        ));
        usage(&mut sql, consumer);
    }
    Ok(sql)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_gets_only_its_part() {
        let roles = Roles {
            host: Some("app_host".into()),
            relay: Some("relay_runner".into()),
            consumer: None,
            operator: Some("relay_ops".into()),
        };
        let sql = roles_sql(&roles, RolesFor::Outbox, None).unwrap();
        let host: Vec<&str> = sql
            .lines()
            .filter(|l| l.ends_with("TO app_host;"))
            .collect();
        assert_eq!(
            host,
            [
                "GRANT EXECUTE ON FUNCTION relay_open_run, relay_append, relay_rewind, relay_close_run TO app_host;"
            ]
        );
        assert!(!sql.contains("ON relay_outbox TO app_host"));
        assert!(sql.contains("GRANT SELECT, DELETE ON relay_outbox TO relay_runner;"));
        assert!(sql.starts_with("--") && sql.contains("FROM PUBLIC;"));
        let operator: Vec<&str> = sql
            .lines()
            .filter(|l| l.ends_with("TO relay_ops;"))
            .collect();
        assert_eq!(
            operator,
            [
                "GRANT EXECUTE ON FUNCTION relay_release, relay_discard_branch TO relay_ops;",
                "GRANT SELECT ON relay_backlog_status, relay_oldest_wait, relay_parked_status, relay_relays_status, relay_branch_status TO relay_ops;"
            ]
        );

        let schema = Schema::new("ops").unwrap();
        let fold = Roles {
            consumer: Some("relay_projector".into()),
            ..Roles::default()
        };
        let sql = roles_sql(&fold, RolesFor::Fold, Some(&schema)).unwrap();
        assert!(sql.contains(
            "REVOKE EXECUTE ON FUNCTION ops.relay_fold, ops.relay_fold_retire, ops.relay_fold_offset, ops.relay_fold_save_offset, ops.relay_fold_reset, ops.relay_fold_adopt, ops.relay_fold_batch FROM PUBLIC;"
        ));
        assert!(sql.contains(
            "GRANT EXECUTE ON FUNCTION ops.relay_fold, ops.relay_fold_retire, ops.relay_fold_offset, ops.relay_fold_save_offset, ops.relay_fold_reset, ops.relay_fold_adopt, ops.relay_fold_batch TO relay_projector;"
        ));
        assert!(sql.contains("GRANT USAGE ON SCHEMA ops TO relay_projector;"));
        assert!(!sql.contains("relay_append"));
    }

    #[test]
    fn role_names_are_identifiers() {
        for bad in ["", "App", "a;drop", "pg_x", "public", "1a"] {
            let roles = Roles {
                host: Some(bad.into()),
                ..Roles::default()
            };
            assert!(
                roles_sql(&roles, RolesFor::Outbox, None).is_err(),
                "{bad:?}"
            );
        }
    }
}
