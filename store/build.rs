//! Rebuilds the crate when a migration is added or removed: `sqlx::migrate!` embeds the files
//! it found and tracks only those, so without this a new migration stayed out of an
//! incremental build (sqlx's documented build script).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=fold_migrations");
}
