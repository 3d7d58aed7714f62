//! The fleet ledgers admin replicas share, in Redis, in parts
//! (`sluice_shared::fleet::ledger_parts`): a hash per ledger holding its
//! head and one field per member, with a version the writes go through,
//! and a log of which members each version changed.
//!
//! Each replica keeps every ledger it serves decoded in memory. A sync
//! first reads what the other replicas changed since this copy's version
//! (one script: the members the log names, and the head), changes its own
//! member, and writes that member, the head and the members it forgot,
//! only if the version is still the one it read (a second script); else
//! it reads again. So the replicas still never hand out the same room
//! twice, and a sync moves a few members through Redis instead of the
//! whole ledger twice (at a thousand Envoys, 3.4 MB a sync before). A
//! replica whose copy is further behind than the log reaches, or of
//! another incarnation of the ledger (Redis lost it and it was started
//! again), reads it whole. The syncs of one ledger on one replica take
//! turns (a lock held across the two scripts), so that only the other
//! replicas' writes can race.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use sluice_shared::fleet::Ledger;

use super::FleetError;
use crate::expiring::ExpiringMap;
use crate::kv::{after_a_race, KvError};

/// The members changed since a version, the head, or the whole ledger
/// when the caller's copy is of another incarnation or further behind
/// than the log reaches.
///
/// KEYS: the ledger's hash, its log. ARGV: the incarnation and version
/// of the caller's copy, then names to read whatever the log says.
/// Returns `{id, version}` when there is no ledger; `{id, version, 'all',
/// HGETALL}`; or `{id, version, 'some', head, {name, record or ''}...}`.
const READ: &str = r#"
local id = redis.call('HGET', KEYS[1], '~id')
if not id then return {'', 0} end
local v = tonumber(redis.call('HGET', KEYS[1], '~v') or '0')
local known = tonumber(ARGV[2])
if id ~= ARGV[1] or v < known or v - known > redis.call('LLEN', KEYS[2]) then
  return {id, v, 'all', redis.call('HGETALL', KEYS[1])}
end
local names = {}
for i = 3, #ARGV do names[ARGV[i]] = true end
if v > known then
  for _, entry in ipairs(redis.call('LRANGE', KEYS[2], known - v, -1)) do
    for _, name in ipairs(cjson.decode(entry)) do names[name] = true end
  end
end
local out = {}
for name in pairs(names) do
  table.insert(out, name)
  table.insert(out, redis.call('HGET', KEYS[1], 'm:' .. name) or '')
end
return {id, v, 'some', redis.call('HGET', KEYS[1], '~head') or '', out}
"#;

/// Writes a head and members ('' deletes one) if the ledger is still the
/// incarnation and version the caller read ('' and 0: none yet, and it is
/// started as incarnation ARGV[2]); logs the names under the new version.
///
/// KEYS: the hash, the log. ARGV: incarnation read, new incarnation,
/// version read, keep ms, log entries kept, head, then name, record pairs.
/// Returns the new version, or 0 when another write came first.
const WRITE: &str = r#"
local id = redis.call('HGET', KEYS[1], '~id') or ''
local v = tonumber(redis.call('HGET', KEYS[1], '~v') or '0')
if id ~= ARGV[1] or v ~= tonumber(ARGV[3]) then return 0 end
if id == '' then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], '~id', ARGV[2])
end
redis.call('HSET', KEYS[1], '~head', ARGV[6])
local names = {}
for i = 7, #ARGV, 2 do
  local field = 'm:' .. ARGV[i]
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, ARGV[i + 1])
  end
  table.insert(names, ARGV[i])
end
local new = redis.call('HINCRBY', KEYS[1], '~v', 1)
redis.call('RPUSH', KEYS[2], cjson.encode(names))
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[5]), -1)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return new
"#;

/// Versions the log reaches back: a replica that missed more reads the
/// ledger whole. A few seconds of a thousand Envoys' syncs.
const LOG_KEPT: u64 = 4_096;

/// One replica's copy of one ledger (at most as many as one admin keeps
/// in memory).
#[derive(Default)]
struct Copy {
    /// Which incarnation of the ledger in Redis it is of ("": none).
    id: String,
    version: u64,
    ledger: Option<Ledger>,
    /// Members this copy changed that Redis did not take: read again.
    stale: Vec<String>,
}

pub(super) struct ReplicatedLedgers {
    connection: ConnectionManager,
    copies: Mutex<ExpiringMap<Arc<tokio::sync::Mutex<Copy>>>>,
    read: redis::Script,
    write: redis::Script,
}

impl ReplicatedLedgers {
    pub(super) fn new(connection: ConnectionManager) -> Self {
        Self {
            connection,
            copies: Mutex::new(ExpiringMap::new(super::MAX_LEDGERS_IN_MEMORY)),
            read: redis::Script::new(READ),
            write: redis::Script::new(WRITE),
        }
    }

    fn copy_of(&self, name: &str) -> Arc<tokio::sync::Mutex<Copy>> {
        let now = std::time::Instant::now();
        let keep = now + Duration::from_millis(super::LEDGER_TTL_MS);
        let mut copies = self
            .copies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Arc::clone(copies.keep(name, keep, now, Arc::default))
    }

    /// The ledger `name` as Redis has it now; None when it has none.
    pub(super) async fn read(&self, name: &str) -> Result<Option<Ledger>, FleetError> {
        self.with_current(name, |ledger| ledger.cloned()).await
    }

    /// Whether Redis has a ledger `name` now (the copy is brought up to
    /// date, not cloned).
    pub(super) async fn exists(&self, name: &str) -> Result<bool, FleetError> {
        self.with_current(name, |ledger| ledger.is_some()).await
    }

    /// `look` at the copy of `name` once it is what Redis has.
    async fn with_current<T>(
        &self,
        name: &str,
        look: impl FnOnce(Option<&Ledger>) -> T,
    ) -> Result<T, FleetError> {
        let copy = self.copy_of(name);
        let mut copy = copy.lock().await;
        if let Err(e) = self.refresh(name, &mut copy).await {
            // Half read: read whole next time.
            *copy = Copy::default();
            return Err(e);
        }
        Ok(look(copy.ledger.as_ref()))
    }

    /// Runs `change` on the ledger `name` (`fresh()` when Redis has none)
    /// and writes what it changed: the head, `touched`'s member and the
    /// members the change forgot. When another replica wrote first, reads
    /// what it wrote and runs `change` again, at most `tries` times.
    pub(super) async fn update<R>(
        &self,
        name: &str,
        touched: &str,
        tries: u32,
        fresh: impl Fn() -> Ledger,
        change: impl Fn(&mut Ledger) -> R,
    ) -> Result<Option<R>, FleetError> {
        let copy = self.copy_of(name);
        let mut copy = copy.lock().await;
        let outcome = self
            .update_copy(name, touched, tries, &fresh, &change, &mut copy)
            .await;
        if outcome.is_err() {
            // Redis failed between reading and writing (or answered
            // something unreadable): what the copy holds may be neither
            // what Redis has nor what it had, so it is read whole next
            // time.
            *copy = Copy::default();
        }
        outcome
    }

    async fn update_copy<R>(
        &self,
        name: &str,
        touched: &str,
        tries: u32,
        fresh: &impl Fn() -> Ledger,
        change: &impl Fn(&mut Ledger) -> R,
        copy: &mut Copy,
    ) -> Result<Option<R>, FleetError> {
        for attempt in 0..tries {
            if attempt > 0 {
                tokio::time::sleep(after_a_race(attempt)).await;
            }
            self.refresh(name, copy).await?;
            let ledger = copy.ledger.get_or_insert_with(fresh);
            // Only the members this change forgets are to delete.
            ledger.take_forgotten();
            let answer = change(ledger);
            let forgotten = ledger.take_forgotten();
            let corrupt = |source| FleetError::Corrupt {
                policy: name.to_string(),
                source,
            };
            let head = ledger.head_record().map_err(corrupt)?;
            let mut parts = vec![(
                touched.to_string(),
                ledger
                    .member_record(touched)
                    .transpose()
                    .map_err(corrupt)?
                    .unwrap_or_default(),
            )];
            parts.extend(
                forgotten
                    .into_iter()
                    .filter(|n| n.as_str() != touched)
                    .map(|n| (n, String::new())),
            );
            let new_id = if copy.id.is_empty() {
                incarnation()
            } else {
                copy.id.clone()
            };
            let mut invocation = self.write.key(hash_key(name));
            invocation
                .key(log_key(name))
                .arg(&copy.id)
                .arg(&new_id)
                .arg(copy.version)
                .arg(super::LEDGER_TTL_MS)
                .arg(LOG_KEPT)
                .arg(head);
            for (member, record) in &parts {
                invocation.arg(member).arg(record);
            }
            let mut connection = self.connection.clone();
            let written: u64 = invocation
                .invoke_async(&mut connection)
                .await
                .map_err(KvError::from)?;
            if written > 0 {
                copy.id = new_id;
                copy.version = written;
                return Ok(Some(answer));
            }
            // Another replica wrote first: this copy's changed parts are
            // read again with what it wrote.
            copy.stale = parts.into_iter().map(|(member, _)| member).collect();
        }
        Ok(None)
    }

    /// Brings `copy` up to what Redis has: the members changed since its
    /// version (and its stale ones) and the head, or the whole ledger.
    async fn refresh(&self, name: &str, copy: &mut Copy) -> Result<(), FleetError> {
        let mut invocation = self.read.key(hash_key(name));
        invocation
            .key(log_key(name))
            .arg(&copy.id)
            .arg(if copy.ledger.is_some() {
                copy.version
            } else {
                0
            });
        for member in &copy.stale {
            invocation.arg(member);
        }
        let mut connection = self.connection.clone();
        let answer: redis::Value = invocation
            .invoke_async(&mut connection)
            .await
            .map_err(KvError::from)?;
        let corrupt = |what: &str| FleetError::Unreadable {
            policy: name.to_string(),
            what: what.to_string(),
        };
        let parts = match answer {
            redis::Value::Array(parts) => parts,
            _ => return Err(corrupt("not an array")),
        };
        let text = |value: Option<&redis::Value>| -> Option<String> {
            match value? {
                redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
                redis::Value::SimpleString(s) => Some(s.clone()),
                _ => None,
            }
        };
        let id = text(parts.first()).ok_or_else(|| corrupt("no incarnation"))?;
        let version = match parts.get(1) {
            Some(redis::Value::Int(v)) => u64::try_from(*v).map_err(|_| corrupt("version"))?,
            _ => return Err(corrupt("no version")),
        };
        let decode_error = |source| FleetError::Corrupt {
            policy: name.to_string(),
            source,
        };
        copy.stale.clear();
        match text(parts.get(2)).as_deref() {
            None => {
                // No ledger in Redis: a fresh one is started at the write.
                *copy = Copy::default();
            }
            Some("all") => {
                let Some(redis::Value::Array(fields)) = parts.get(3) else {
                    return Err(corrupt("no fields"));
                };
                let mut ledger = Ledger::default();
                for pair in fields.chunks(2) {
                    let (Some(field), Some(value)) = (text(pair.first()), text(pair.get(1))) else {
                        return Err(corrupt("a field"));
                    };
                    if field == "~head" {
                        ledger.set_head_record(&value).map_err(decode_error)?;
                    } else if let Some(member) = field.strip_prefix("m:") {
                        ledger
                            .set_member_record(member, Some(&value))
                            .map_err(decode_error)?;
                    }
                }
                *copy = Copy {
                    id,
                    version,
                    ledger: Some(ledger),
                    stale: Vec::new(),
                };
            }
            Some("some") => {
                let ledger = copy.ledger.get_or_insert_with(Ledger::default);
                if let Some(head) = text(parts.get(3)).filter(|h| !h.is_empty()) {
                    ledger.set_head_record(&head).map_err(decode_error)?;
                }
                if let Some(redis::Value::Array(members)) = parts.get(4) {
                    for pair in members.chunks(2) {
                        let (Some(member), Some(record)) = (text(pair.first()), text(pair.get(1)))
                        else {
                            return Err(corrupt("a member"));
                        };
                        let record = (!record.is_empty()).then_some(record.as_str());
                        ledger
                            .set_member_record(&member, record)
                            .map_err(decode_error)?;
                    }
                }
                copy.id = id;
                copy.version = version;
            }
            Some(_) => return Err(corrupt("unknown answer")),
        }
        Ok(())
    }
}

/// A new ledger's incarnation: random, so that a copy of one Redis lost
/// is never taken for a copy of the one started after it.
fn incarnation() -> String {
    let bytes = crate::auth::random_bytes::<8>().unwrap_or_default();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// In braces: a ledger's hash and log hash to one Redis Cluster slot, as
/// a script touching both needs.
fn hash_key(name: &str) -> String {
    format!("sluice:fleet:{{{name}}}")
}

fn log_key(name: &str) -> String {
    format!("sluice:fleet-log:{{{name}}}")
}
