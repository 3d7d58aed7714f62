//! The two databases the store runs on, behind one small interface: SQLite
//! (one file; the default, for one admin) and PostgreSQL (for admin
//! replicas on different hosts). The store's SQL is written once, with
//! `$1`-style parameters and types both accept (BIGINT, TEXT); each
//! backend runs it in a transaction of its own kind.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::TransactionBehavior;
use rusqlite_migration::{Migrations, M};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::StoreError;

const SQLITE_MIGRATIONS: &[M<'static>] = &[
    M::up(include_str!("../../migrations/0001_init.sql")),
    M::up(include_str!("../../migrations/0002_budgets.sql")),
    M::up(include_str!("../../migrations/0003_people.sql")),
    M::up(include_str!("../../migrations/0004_sources.sql")),
    M::up(include_str!("../../migrations/0005_prices.sql")),
    M::up(include_str!("../../migrations/0006_budget_keys.sql")),
];

/// PostgreSQL migrations, in order; applied once each, under an advisory
/// lock so replicas starting together do not race.
const POSTGRES_MIGRATIONS: &[&str] = &[
    include_str!("../../migrations/postgres/0001_init.sql"),
    include_str!("../../migrations/postgres/0002_budgets.sql"),
    include_str!("../../migrations/postgres/0003_people.sql"),
    include_str!("../../migrations/postgres/0004_sources.sql"),
    include_str!("../../migrations/postgres/0005_prices.sql"),
    include_str!("../../migrations/postgres/0006_budget_keys.sql"),
];

/// PostgreSQL's advisory lock taken while migrating (any fixed number).
const MIGRATION_LOCK: i64 = 0x51_1CE;

/// One SQL value: the store needs no other types.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Text(String),
    Null,
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}

impl From<Option<String>> for Value {
    fn from(v: Option<String>) -> Self {
        v.map_or(Value::Null, Value::Text)
    }
}

/// A result row; columns by index, as the query selected them.
#[derive(Debug)]
pub struct Row(Vec<Value>);

impl Row {
    pub fn int(&self, i: usize) -> Result<i64, StoreError> {
        match self.0.get(i) {
            Some(Value::Int(v)) => Ok(*v),
            other => Err(StoreError::Corrupt(format!(
                "column {i}: wanted an integer, found {other:?}"
            ))),
        }
    }

    pub fn uint(&self, i: usize) -> Result<u64, StoreError> {
        Ok(u64::try_from(self.int(i)?).unwrap_or(0))
    }

    pub fn text(&self, i: usize) -> Result<String, StoreError> {
        match self.0.get(i) {
            Some(Value::Text(v)) => Ok(v.clone()),
            other => Err(StoreError::Corrupt(format!(
                "column {i}: wanted text, found {other:?}"
            ))),
        }
    }

    pub fn optional_uint(&self, i: usize) -> Result<Option<u64>, StoreError> {
        match self.0.get(i) {
            Some(Value::Null) => Ok(None),
            _ => self.uint(i).map(Some),
        }
    }

    pub fn optional_text(&self, i: usize) -> Result<Option<String>, StoreError> {
        match self.0.get(i) {
            Some(Value::Null) => Ok(None),
            _ => self.text(i).map(Some),
        }
    }
}

/// What the store's queries run on: one open transaction.
pub trait Sql {
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, StoreError>;
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StoreError>;

    fn query_one(&mut self, sql: &str, params: &[Value]) -> Result<Option<Row>, StoreError> {
        Ok(self.query(sql, params)?.into_iter().next())
    }
}

/// What a transaction does, which decides how it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    /// A policy change: under the store's write lock.
    Write,
    /// A change outside the write lock.
    Touch,
    /// A change outside the write lock that the next one of its kind
    /// replaces (an Envoy's last sync and report, once a second, and the
    /// per-minute counts of warn lines crossed read off it): its
    /// commit does not wait for the disk. A crash of the admin loses none
    /// of it; a crash of the machine may lose the last moments of it,
    /// never the database (SQLite's WAL with `synchronous = NORMAL`,
    /// PostgreSQL's `synchronous_commit = off`): a sync, a thousand a
    /// second in a large fleet, needs no flush of its own.
    Note,
}

/// PostgreSQL connections: a small pool, so that one connection being
/// re-established (the server restarted, failed over) does not hold up
/// every request, each wait bounded by [`POSTGRES_WAIT`].
pub struct PostgresPool(Option<Pool>);

type Pool = r2d2::Pool<r2d2_postgres::PostgresConnectionManager<MakeRustlsConnect>>;

impl PostgresPool {
    fn get(
        &self,
    ) -> Result<
        r2d2::PooledConnection<r2d2_postgres::PostgresConnectionManager<MakeRustlsConnect>>,
        StoreError,
    > {
        self.0
            .as_ref()
            .ok_or(StoreError::Poisoned)?
            .get()
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }
}

/// The blocking client closes each connection with a runtime of its own,
/// which must not run on an async runtime's thread: a store dropped there
/// (at shutdown, or when a later start step fails) closes them on a
/// thread of their own.
impl Drop for PostgresPool {
    fn drop(&mut self) {
        let Some(pool) = self.0.take() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            let _ = std::thread::spawn(move || drop(pool)).join();
        }
    }
}

pub enum Db {
    Sqlite(Mutex<rusqlite::Connection>),
    Postgres(PostgresPool),
}

/// Connections to PostgreSQL kept at once.
const POSTGRES_CONNECTIONS: u32 = 4;
/// How long a request waits for a connection, and a connection attempt
/// for the server.
pub const POSTGRES_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// TLS to PostgreSQL when the URL asks for it (`sslmode=require`): the
/// server's certificate checked against the system's CAs and `ca` (a PEM
/// file, for a private CA). Without `sslmode=require` the connection is
/// plain, as before (libpq's `prefer` without verification protects
/// nothing).
pub fn postgres_tls(
    config: &mut postgres::Config,
    ca: Option<&Path>,
) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(ca) = ca {
        use rustls::pki_types::pem::PemObject;
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(ca)
            .map_err(|e| StoreError::Tls(format!("{}: {e}", ca.display())))?;
        for cert in certs {
            let cert = cert.map_err(|e| StoreError::Tls(format!("{}: {e}", ca.display())))?;
            roots
                .add(cert)
                .map_err(|e| StoreError::Tls(format!("{}: {e}", ca.display())))?;
        }
    }
    if config.get_ssl_mode() != postgres::config::SslMode::Require {
        config.ssl_mode(postgres::config::SslMode::Disable);
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(tls))
}

/// More than the store's distinct statements.
const SQLITE_STATEMENTS_CACHED: usize = 256;

impl Db {
    /// Opens (creating if needed) the SQLite file, in WAL mode, and runs
    /// the migrations.
    pub fn sqlite(path: &Path) -> Result<Self, StoreError> {
        let mut conn = rusqlite::Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        // Every statement the store runs stays prepared: parsing them
        // again took a tenth of the CPU of a sync.
        conn.set_prepared_statement_cache_capacity(SQLITE_STATEMENTS_CACHED);
        Migrations::from_slice(SQLITE_MIGRATIONS).to_latest(&mut conn)?;
        Ok(Db::Sqlite(Mutex::new(conn)))
    }

    /// Connects to PostgreSQL at `url` (`postgres://user:pass@host/db`,
    /// `?sslmode=require` for TLS checked against the system's CAs and
    /// `ca`) and runs the migrations. Blocking: call it off the async
    /// runtime.
    pub fn postgres(url: &str, ca: Option<&Path>) -> Result<Self, StoreError> {
        let mut config: postgres::Config = url.parse()?;
        config.connect_timeout(POSTGRES_WAIT);
        let tls = postgres_tls(&mut config, ca)?;
        // One connection first: a wrong address, password or certificate
        // fails the start at once with the server's own words.
        let mut first = config.connect(tls.clone())?;
        migrate_postgres(&mut first)?;
        drop(first);
        let manager = r2d2_postgres::PostgresConnectionManager::new(config, tls);
        let pool = r2d2::Pool::builder()
            .max_size(POSTGRES_CONNECTIONS)
            .min_idle(Some(1))
            .connection_timeout(POSTGRES_WAIT)
            .test_on_check_out(true)
            .build_unchecked(manager);
        Ok(Db::Postgres(PostgresPool(Some(pool))))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Db::Sqlite(_) => "sqlite",
            Db::Postgres { .. } => "postgres",
        }
    }

    /// Runs `f` on one consistent snapshot.
    pub fn read<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.transaction(Access::Read, f)
    }

    /// Runs `f` in a transaction that holds the store's write lock from its
    /// first statement: writers from every replica go one at a time, and
    /// each sees what the one before committed.
    pub fn write<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.transaction(Access::Write, f)
    }

    /// Runs `f` outside the write lock, for a single-statement change that
    /// must not queue behind policy edits (an Envoy's sync).
    pub fn touch<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.transaction(Access::Touch, f)
    }

    /// [`Self::touch`] for a change whose last moments may be lost to a
    /// crash of the machine (see [`Access::Note`]).
    pub fn note<T>(
        &self,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.transaction(Access::Note, f)
    }

    fn transaction<T>(
        &self,
        access: Access,
        f: impl FnOnce(&mut dyn Sql) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self {
            Db::Sqlite(conn) => {
                let mut conn = lock(conn)?;
                let behavior = match access {
                    Access::Read => TransactionBehavior::Deferred,
                    // SQLite has one writer at a time: taking it at the
                    // start is the write lock.
                    Access::Write | Access::Touch | Access::Note => TransactionBehavior::Immediate,
                };
                // Set for every transaction: the connection's setting
                // outlives the transaction that chose it.
                let synchronous = if access == Access::Note {
                    "NORMAL"
                } else {
                    "FULL"
                };
                conn.pragma_update(None, "synchronous", synchronous)?;
                let mut tx = conn.transaction_with_behavior(behavior)?;
                let out = f(&mut SqliteTx(&mut tx))?;
                tx.commit()?;
                Ok(out)
            }
            Db::Postgres(pool) => {
                // A connection the pool checked (a dropped one is replaced).
                let mut client = pool.get()?;
                let mut tx = match access {
                    Access::Read => client
                        .build_transaction()
                        .isolation_level(postgres::IsolationLevel::RepeatableRead)
                        .read_only(true)
                        .start()?,
                    // Read committed: after the lock, every statement sees
                    // the latest commit.
                    Access::Write | Access::Touch | Access::Note => client.transaction()?,
                };
                if access == Access::Note {
                    tx.batch_execute("SET LOCAL synchronous_commit = off")?;
                }
                if access == Access::Write {
                    tx.execute(
                        "SELECT value FROM settings WHERE key = 'policy_set_version' FOR UPDATE",
                        &[],
                    )?;
                }
                let out = f(&mut PostgresTx(&mut tx))?;
                tx.commit()?;
                Ok(out)
            }
        }
    }

    /// SQLite's own settings and checks (`PRAGMA ...`); None on PostgreSQL.
    pub fn sqlite_pragma(&self, pragma: &str) -> Result<Option<String>, StoreError> {
        match self {
            Db::Sqlite(conn) => {
                let conn = lock(conn)?;
                Ok(Some(conn.query_row(
                    &format!("PRAGMA {pragma}"),
                    [],
                    |r| r.get(0),
                )?))
            }
            Db::Postgres { .. } => Ok(None),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> Result<MutexGuard<'_, T>, StoreError> {
    mutex.lock().map_err(|_| StoreError::Poisoned)
}

fn migrate_postgres(client: &mut postgres::Client) -> Result<(), StoreError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )?;
    let applied: i64 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            &[],
        )?
        .get(0);
    for (index, migration) in POSTGRES_MIGRATIONS.iter().enumerate() {
        let version = i64::try_from(index + 1).unwrap_or(i64::MAX);
        if version > applied {
            tx.batch_execute(migration)?;
            tx.execute(
                "INSERT INTO schema_migrations (version) VALUES ($1)",
                &[&version],
            )?;
        }
    }
    tx.commit()?;
    Ok(())
}

struct SqliteTx<'a, 'c>(&'a mut rusqlite::Transaction<'c>);

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Value::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(*v)),
            Value::Text(v) => ToSqlOutput::Borrowed(ValueRef::Text(v.as_bytes())),
            Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
        })
    }
}

/// SQLite numbers `?N` parameters as PostgreSQL does `$N`.
fn sqlite_sql(sql: &str) -> String {
    sql.replace('$', "?")
}

impl Sql for SqliteTx<'_, '_> {
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, StoreError> {
        let changed = self
            .0
            .prepare_cached(&sqlite_sql(sql))?
            .execute(rusqlite::params_from_iter(params))?;
        Ok(changed as u64)
    }

    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StoreError> {
        let mut stmt = self.0.prepare_cached(&sqlite_sql(sql))?;
        let columns = stmt.column_count();
        let rows = stmt.query_map(rusqlite::params_from_iter(params), |r| {
            (0..columns)
                .map(|i| {
                    Ok(match r.get_ref(i)? {
                        ValueRef::Integer(v) => Value::Int(v),
                        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
                        ValueRef::Null => Value::Null,
                        ValueRef::Real(v) => Value::Int(v as i64),
                        ValueRef::Blob(b) => Value::Text(String::from_utf8_lossy(b).into_owned()),
                    })
                })
                .collect::<rusqlite::Result<Vec<Value>>>()
                .map(Row)
        })?;
        Ok(rows.collect::<rusqlite::Result<Vec<Row>>>()?)
    }
}

struct PostgresTx<'a, 'c>(&'a mut postgres::Transaction<'c>);

/// Typed for PostgreSQL, which checks each parameter's type against the
/// column's (a NULL only ever goes into a TEXT column here).
fn postgres_params(params: &[Value]) -> Vec<Box<dyn postgres::types::ToSql + Sync>> {
    params
        .iter()
        .map(|p| -> Box<dyn postgres::types::ToSql + Sync> {
            match p {
                Value::Int(v) => Box::new(*v),
                Value::Text(v) => Box::new(v.clone()),
                Value::Null => Box::new(None::<String>),
            }
        })
        .collect()
}

fn borrowed(
    params: &[Box<dyn postgres::types::ToSql + Sync>],
) -> Vec<&(dyn postgres::types::ToSql + Sync)> {
    params.iter().map(|p| p.as_ref()).collect()
}

impl Sql for PostgresTx<'_, '_> {
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, StoreError> {
        let params = postgres_params(params);
        Ok(self.0.execute(sql, &borrowed(&params))?)
    }

    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StoreError> {
        let params = postgres_params(params);
        let rows = self.0.query(sql, &borrowed(&params))?;
        rows.iter()
            .map(|row| {
                (0..row.len())
                    .map(|i| {
                        let ty = row.columns().get(i).map(|c| c.type_().clone());
                        match ty {
                            Some(t) if t == postgres::types::Type::INT8 => Ok(row
                                .try_get::<_, Option<i64>>(i)?
                                .map_or(Value::Null, Value::Int)),
                            Some(t) if t == postgres::types::Type::INT4 => Ok(row
                                .try_get::<_, Option<i32>>(i)?
                                .map_or(Value::Null, |v| Value::Int(i64::from(v)))),
                            _ => Ok(row
                                .try_get::<_, Option<String>>(i)?
                                .map_or(Value::Null, Value::Text)),
                        }
                    })
                    .collect::<Result<Vec<Value>, StoreError>>()
                    .map(Row)
            })
            .collect()
    }
}
