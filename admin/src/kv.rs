//! The key-value store that what admin replicas change together lives in
//! (relayed provider news; fleet ledgers have a store of their own,
//! `fleet/replicated.rs`): one admin keeps it in memory, replicas sharing
//! Redis keep it there. Callers see one type with one set of operations,
//! never the backend: a read, and a read-compute-write that replaces a
//! value only if nobody changed it in between (a compare-and-set script
//! in Redis; the lock in memory).
//!
//! Both backends keep a value for the time its writer asked (Redis's
//! `PX`), so what is in memory lives as long as it would in Redis. Memory
//! is bounded whatever Envoys send ([`ExpiringMap`]).

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;

use crate::expiring::ExpiringMap;

/// How long a Redis call (or reconnection) may take before the sync that
/// needed it goes on without it.
const REDIS_TIMEOUT: Duration = Duration::from_secs(2);

/// Sets ARGV[2] (expiring after ARGV[3] ms) if the value is still ARGV[1]
/// ("" for none).
const COMPARE_AND_SET: &str = r#"
local current = redis.call('GET', KEYS[1])
if current == false then current = '' end
if current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// How long a change that lost its compare-and-set to another replica's
/// waits before reading again: a random part of 200 µs times the races
/// lost so far, at most 5 ms. Trying again at once, the loser met the
/// winner's next change every time: two replicas bumping one counter
/// (`store_backends`), one lost 50 races in a row.
pub(crate) fn after_a_race(lost: u32) -> Duration {
    let most = Duration::from_micros(200)
        .saturating_mul(lost)
        .min(Duration::from_millis(5));
    let random = crate::auth::random_bytes::<2>().map_or(0, u16::from_le_bytes);
    most.mul_f64(f64::from(random) / f64::from(u16::MAX))
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("reading Redis's CA certificate {0}: {1}")]
    Ca(String, std::io::Error),
}

/// What an update does with the value it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Leaves it as it is (nothing is written, nothing can race).
    Keep,
    /// Replaces it, kept for `keep_ms` from now.
    Set { value: String, keep_ms: u64 },
}

/// A connection to Redis that several stores (each under its own prefix)
/// share; it reconnects by itself when Redis restarts or the link drops.
#[derive(Clone)]
pub struct RedisConnection(ConnectionManager);

impl RedisConnection {
    /// Redis at `url` (`redis://host:port/db`, or `rediss://` for TLS
    /// checked against the system's CAs and `ca`).
    pub async fn open(url: &str, ca: Option<&std::path::Path>) -> Result<Self, KvError> {
        let client = match ca {
            Some(ca) => {
                let root_cert =
                    std::fs::read(ca).map_err(|e| KvError::Ca(ca.display().to_string(), e))?;
                redis::Client::build_with_tls(
                    url,
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(root_cert),
                    },
                )?
            }
            None => redis::Client::open(url)?,
        };
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(REDIS_TIMEOUT))
            .set_response_timeout(Some(REDIS_TIMEOUT))
            .set_number_of_retries(2);
        Ok(Self(
            client.get_connection_manager_with_config(config).await?,
        ))
    }
}

impl RedisConnection {
    /// The connection itself, for a store with scripts of its own.
    pub(crate) fn manager(&self) -> ConnectionManager {
        self.0.clone()
    }
}

/// Values by key, under a prefix, in memory or in Redis.
pub struct Kv {
    backend: Backend,
    prefix: String,
}

enum Backend {
    Memory(Mutex<ExpiringMap<String>>),
    Redis(ConnectionManager),
}

impl Kv {
    /// Values in this process's memory, at most `max_entries` at once.
    pub fn memory(prefix: &str, max_entries: usize) -> Self {
        Self {
            backend: Backend::Memory(Mutex::new(ExpiringMap::new(max_entries))),
            prefix: prefix.to_string(),
        }
    }

    /// Values in Redis, through `connection`, under `prefix`.
    pub fn redis(connection: &RedisConnection, prefix: &str) -> Self {
        Self {
            backend: Backend::Redis(connection.0.clone()),
            prefix: prefix.to_string(),
        }
    }

    /// Whether admin replicas share these values (Redis) or this process
    /// keeps them alone (memory).
    pub fn is_shared(&self) -> bool {
        matches!(self.backend, Backend::Redis(_))
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value of `key`, if it has one that has not expired.
    pub async fn get(&self, key: &str) -> Result<Option<String>, KvError> {
        Ok(self.get_many(&[key]).await?.pop().flatten())
    }

    /// The values of `keys`, in their order.
    pub async fn get_many(&self, keys: &[&str]) -> Result<Vec<Option<String>>, KvError> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        match &self.backend {
            Backend::Memory(memory) => {
                let now = Instant::now();
                let memory = lock(memory);
                Ok(full.iter().map(|k| memory.get(k, now).cloned()).collect())
            }
            Backend::Redis(connection) => {
                if full.is_empty() {
                    return Ok(Vec::new());
                }
                let mut connection = connection.clone();
                let raw: Vec<Option<String>> = redis::cmd("MGET")
                    .arg(&full)
                    .query_async(&mut connection)
                    .await?;
                Ok(raw)
            }
        }
    }

    /// Reads `key` ("" for none) and does what `change` makes of it;
    /// `change` also returns what the caller wants back. When another
    /// replica wrote the key in between, it reads and tries again, at most
    /// `tries` times. None: every try lost the race.
    pub async fn update<T, E>(
        &self,
        key: &str,
        tries: u32,
        mut change: impl FnMut(&str) -> Result<(T, Write), E>,
    ) -> Result<Option<T>, E>
    where
        E: From<KvError>,
    {
        let key = self.key(key);
        match &self.backend {
            Backend::Memory(memory) => {
                let now = Instant::now();
                let mut memory = lock(memory);
                let current = memory.get(&key, now).cloned().unwrap_or_default();
                let (answer, write) = change(&current)?;
                if let Write::Set { value, keep_ms } = write {
                    memory.set(key, value, now + Duration::from_millis(keep_ms), now);
                }
                Ok(Some(answer))
            }
            Backend::Redis(connection) => {
                let script = redis::Script::new(COMPARE_AND_SET);
                let mut connection = connection.clone();
                for attempt in 0..tries {
                    if attempt > 0 {
                        tokio::time::sleep(after_a_race(attempt)).await;
                    }
                    let raw: Option<String> = redis::cmd("GET")
                        .arg(&key)
                        .query_async(&mut connection)
                        .await
                        .map_err(KvError::from)?;
                    let raw = raw.unwrap_or_default();
                    let (answer, write) = change(&raw)?;
                    let Write::Set { value, keep_ms } = write else {
                        return Ok(Some(answer));
                    };
                    let stored: i64 = script
                        .key(&key)
                        .arg(&raw)
                        .arg(&value)
                        .arg(keep_ms.max(1))
                        .invoke_async(&mut connection)
                        .await
                        .map_err(KvError::from)?;
                    if stored == 1 {
                        return Ok(Some(answer));
                    }
                }
                Ok(None)
            }
        }
    }

    /// Forgets every value held in this process's memory, as a Redis
    /// restarted without persistence forgets its own (the simulator's
    /// fault; nothing in Redis is touched).
    pub fn forget_memory(&self) {
        if let Backend::Memory(memory) = &self.backend {
            lock(memory).clear();
        }
    }

    /// Values held in this process's memory now (0 in Redis).
    pub fn len(&self) -> usize {
        match &self.backend {
            Backend::Memory(memory) => lock(memory).len(),
            Backend::Redis(_) => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data: keep going.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(value: &str, keep_ms: u64) -> Write {
        Write::Set {
            value: value.to_string(),
            keep_ms,
        }
    }

    async fn put(kv: &Kv, key: &str, value: &str, keep_ms: u64) {
        kv.update(key, 1, |_| Ok::<_, KvError>(((), set(value, keep_ms))))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn an_update_sees_the_value_it_replaces_and_keep_writes_nothing() {
        let kv = Kv::memory("p:", 10);
        assert_eq!(kv.get("a").await.unwrap(), None);
        let seen = kv
            .update("a", 1, |raw| {
                Ok::<_, KvError>((raw.to_string(), set("1", 60_000)))
            })
            .await
            .unwrap();
        assert_eq!(seen.as_deref(), Some(""));
        let seen = kv
            .update("a", 1, |raw| {
                Ok::<_, KvError>((raw.to_string(), Write::Keep))
            })
            .await
            .unwrap();
        assert_eq!(seen.as_deref(), Some("1"));
        assert_eq!(kv.get("a").await.unwrap().as_deref(), Some("1"));
        assert_eq!(
            kv.get_many(&["a", "b"]).await.unwrap(),
            vec![Some("1".to_string()), None]
        );
    }

    #[tokio::test]
    async fn an_error_of_the_change_writes_nothing() {
        let kv = Kv::memory("p:", 10);
        put(&kv, "a", "1", 60_000).await;
        let failed = kv
            .update("a", 1, |_| -> Result<((), Write), KvError> {
                Err(KvError::Ca("x".into(), std::io::Error::other("no")))
            })
            .await;
        assert!(failed.is_err());
        assert_eq!(kv.get("a").await.unwrap().as_deref(), Some("1"));
    }

    #[tokio::test]
    async fn values_expire_as_in_redis() {
        let kv = Kv::memory("p:", 10);
        put(&kv, "short", "1", 1).await;
        put(&kv, "long", "2", 60_000).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(kv.get("short").await.unwrap(), None);
        assert_eq!(kv.get("long").await.unwrap().as_deref(), Some("2"));
        let seen = kv
            .update("short", 1, |raw| {
                Ok::<_, KvError>((raw.to_string(), Write::Keep))
            })
            .await
            .unwrap();
        assert_eq!(seen.as_deref(), Some(""), "an expired value is none");
    }

    #[tokio::test]
    async fn memory_is_bounded_and_what_expires_first_goes_first() {
        let kv = Kv::memory("p:", 3);
        put(&kv, "soon", "1", 1_000).await;
        put(&kv, "later", "2", 60_000).await;
        put(&kv, "latest", "3", 120_000).await;
        put(&kv, "new", "4", 90_000).await;
        assert_eq!(kv.len(), 3);
        assert_eq!(kv.get("soon").await.unwrap(), None);
        // Replacing a value already held takes no room.
        put(&kv, "new", "5", 90_000).await;
        assert_eq!(kv.len(), 3);
        for (key, value) in [("later", "2"), ("latest", "3"), ("new", "5")] {
            assert_eq!(kv.get(key).await.unwrap().as_deref(), Some(value));
        }
        // Hostile numbers of keys: still bounded.
        for i in 0..1_000 {
            put(&kv, &format!("k{i}"), "x", 60_000).await;
        }
        assert_eq!(kv.len(), 3);
    }
}
