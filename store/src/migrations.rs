//! The relay's schema in a database: the embedded migrations (the outbox's, with the fold's
//! among them, and the fold's alone for a consumer's database), running them, and checking
//! that a schema migrated by someone else has what the relay needs.
use crate::error::Error;

/// Where the relay records its migrations: a table of its own, so a host's own sqlx migrations
/// (in `_sqlx_migrations`) and the relay's never see each other.
pub const MIGRATIONS_TABLE: &str = "relay_migrations";

/// The embedded migrations (`store/migrations`), compiled in: no database is needed to build.
/// Tracked in [`MIGRATIONS_TABLE`]. Hosts with another migration tool can apply the same SQL
/// (`MIGRATOR.iter()` or `distribution sql`, in version order).
///
/// Versions 4, 6, 9, 10, 13 and 16 are the fold's SQL (`relay_fold`, end markers and
/// `relay_fold_retire`, metadata, stream offsets, epochs, `relay_fold_batch`), the very files
/// the fold migrations of a consumer's own database apply, so a database with the outbox folds
/// too. The next file in `store/migrations` after `0008_*` is `0011_*` (versions 9 and 10 are
/// the fold's), after `0012_*` it is `0014_*` (13 is the fold's), after `0015_*` it is
/// `0017_*` (16 is the fold's).
pub static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        let mut migrations = migrator.migrations.into_owned();
        for (version, description, sql) in FOLD_IN_OUTBOX {
            migrations.push(sqlx::migrate::Migration::new(
                version,
                description.into(),
                sqlx::migrate::MigrationType::Simple,
                sqlx::SqlStr::from_static(sql),
                false,
            ));
        }
        migrations.sort_by_key(|migration| migration.version);
        migrator.migrations = migrations.into();
        migrator
    });

/// The fold's SQL in the outbox's migrations: (outbox version, description, the fold file).
/// `relay_fold` is what a consumer in any language calls once per delivery, `relay_fold_batch`
/// once per batch (see WIRE.md).
const FOLD_IN_OUTBOX: [(i64, &str, &str); 6] = [
    (
        4,
        "fold function",
        include_str!("../fold_migrations/0002_fold_function.sql"),
    ),
    (
        6,
        "fold end and retire",
        include_str!("../fold_migrations/0003_end_and_retire.sql"),
    ),
    (
        9,
        "fold metadata",
        include_str!("../fold_migrations/0004_metadata.sql"),
    ),
    (
        10,
        "fold stream offsets",
        include_str!("../fold_migrations/0005_stream_offsets.sql"),
    ),
    (
        13,
        "fold epochs",
        include_str!("../fold_migrations/0006_epochs.sql"),
    ),
    (
        16,
        "fold batch",
        include_str!("../fold_migrations/0007_fold_batch.sql"),
    ),
];

/// Brings the database schema up to date. Safe to run concurrently and repeatedly, beside a
/// host's own sqlx migrations, in either order.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), Error> {
    adopt_legacy_migrations(pool).await?;
    MIGRATOR.run(pool).await.map_err(Error::Migrate)
}

/// What the relay needs from the schema, one object per migration that added something it
/// uses (extend it with each new migration): `to_regclass`/`to_regproc` names (a column as
/// `table.column`), resolved on the connection's `search_path`.
const REQUIRED_OBJECTS: &[(&str, &str)] = &[
    ("relation", "relay_outbox"),
    ("relation", "relay_branch"),
    ("relation", "relay_lease"),
    ("relation", "relay_member"),
    ("relation", "relay_parked_branch"),
    ("function", "relay_ack_and_drain"),
    ("function", "relay_append"),
    ("function", "relay_fold"),
    ("function", "relay_close_run"),
    ("function", "relay_retire_runs"),
    ("function", "relay_fold_retire"),
    ("function", "relay_discard_branch"),
    ("function", "relay_current_epoch"),
    ("function", "relay_fold_adopt"),
    ("function", "relay_fold_batch"),
    ("function", "relay_wait_replicated"),
    ("relation", "relay_branch_status"),
    ("column", "relay_lease.beat"),
    ("column", "relay_member.beat"),
    ("function", "relay_require_meta_0018"),
];

/// Checks that the schema the relay needs is there, without changing anything: for a relay
/// that does not migrate (`RELAY_SKIP_MIGRATE`), whose host applies `distribution sql` with its
/// own tool. Names every missing object in [`Error::SchemaMissing`].
pub async fn check_schema(pool: &sqlx::PgPool) -> Result<(), Error> {
    let (kinds, names): (Vec<&str>, Vec<&str>) = REQUIRED_OBJECTS.iter().copied().unzip();
    let found: Vec<bool> = sqlx::query_scalar(
        "SELECT CASE k.kind WHEN 'relation' THEN to_regclass(k.name) IS NOT NULL
                            WHEN 'column' THEN EXISTS (
                                SELECT 1 FROM pg_attribute a
                                 WHERE a.attrelid = to_regclass(split_part(k.name, '.', 1))
                                   AND a.attname = split_part(k.name, '.', 2)
                                   AND NOT a.attisdropped)
                            ELSE to_regproc(k.name) IS NOT NULL END
           FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(kind, name, n)
          ORDER BY k.n",
    )
    .bind(&kinds)
    .bind(&names)
    .fetch_all(pool)
    .await?;
    let missing: Vec<&'static str> = REQUIRED_OBJECTS
        .iter()
        .zip(found)
        .filter(|(_, found)| !found)
        .map(|((_, name), _)| *name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::SchemaMissing(missing))
    }
}

/// Versions before 0.2 recorded their migrations in sqlx's default `_sqlx_migrations`, where a
/// host's sqlx migrator then saw unknown versions. Moves exactly those rows (same version and
/// checksum as ours) to [`MIGRATIONS_TABLE`]; the host's own rows are never touched.
async fn adopt_legacy_migrations(pool: &sqlx::PgPool) -> Result<(), Error> {
    let legacy: Option<String> = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
        .fetch_one(pool)
        .await?;
    if legacy.is_none() {
        return Ok(());
    }
    let (versions, checksums): (Vec<i64>, Vec<Vec<u8>>) = MIGRATOR
        .iter()
        .map(|migration| (migration.version, migration.checksum.to_vec()))
        .unzip();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS relay_migrations (
             version BIGINT PRIMARY KEY,
             description TEXT NOT NULL,
             installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
             success BOOLEAN NOT NULL,
             checksum BYTEA NOT NULL,
             execution_time BIGINT NOT NULL)",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO relay_migrations
         SELECT l.version, l.description, l.installed_on, l.success, l.checksum, l.execution_time
           FROM _sqlx_migrations l
           JOIN unnest($1::bigint[], $2::bytea[]) AS m(version, checksum)
             ON l.version = m.version AND l.checksum = m.checksum
         ON CONFLICT (version) DO NOTHING",
    )
    .bind(&versions)
    .bind(&checksums)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM _sqlx_migrations l
          USING unnest($1::bigint[], $2::bytea[]) AS m(version, checksum)
          WHERE l.version = m.version AND l.checksum = m.checksum",
    )
    .bind(&versions)
    .bind(&checksums)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The fold's tables alone (`store/fold_migrations`), for a consumer's own database; tracked in
/// `relay_fold_migrations`, so they never clash with the host's or the outbox's migrations.
pub static FOLD_MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| {
        let mut migrator = sqlx::migrate!("./fold_migrations");
        migrator.dangerous_set_table_name("relay_fold_migrations");
        migrator
    });

/// Creates or updates the fold's tables only: what a consumer's database needs (the outbox's
/// tables are not created). A database migrated with [`migrate`] has them already: there this
/// runs [`migrate`] (its fold migrations are the same, recorded in its own table).
pub async fn migrate_fold(pool: &sqlx::PgPool) -> Result<(), Error> {
    let full: bool = sqlx::query_scalar("SELECT to_regclass('relay_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    if full {
        return migrate(pool).await;
    }
    FOLD_MIGRATOR.run(pool).await.map_err(Error::Migrate)
}
