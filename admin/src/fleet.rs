//! Fleet mode on the admin side: one [`Ledger`] per global policy, turning
//! each Envoy's sync into its share of the policy's limit.
//!
//! One admin keeps the ledgers in memory. Several replicas keep them in
//! Redis, one key per policy, changed only through a compare-and-set Lua
//! script: a replica reads the ledger, runs the same pure allocation, and
//! writes back only if nobody wrote in between (else it reads again). Two
//! replicas therefore never hand out the same room twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sluice_shared::api::FleetPolicy;
use sluice_shared::fleet::{FleetTerms, Ledger, Share, Usage};
use sluice_shared::sync::{ShareMessage, SharesMessage, SyncReport};
use sluice_shared::{Instant, PolicySet, Scope};

/// Attempts before a sync gives up on a contended ledger in Redis.
const MAX_CAS_ATTEMPTS: u32 = 32;

/// Sets the key only if it still holds what the caller read ("" for
/// missing); the expiry drops the ledgers of policies long gone.
const COMPARE_AND_SET: &str = r#"
local current = redis.call('GET', KEYS[1])
if current == false then current = '' end
if current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// Ledgers outlive every reservation in them by far.
const LEDGER_TTL_MS: u64 = 3_600_000;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("ledger of {policy} in redis does not decode: {source}")]
    Corrupt {
        policy: String,
        source: serde_json::Error,
    },
    #[error("ledger of {0} kept changing under us ({MAX_CAS_ATTEMPTS} attempts)")]
    Contended(String),
}

pub enum Ledgers {
    Memory(Mutex<HashMap<String, Ledger>>),
    Redis {
        connection: redis::aio::MultiplexedConnection,
        prefix: String,
    },
}

impl Default for Ledgers {
    fn default() -> Self {
        Ledgers::Memory(Mutex::new(HashMap::new()))
    }
}

impl Ledgers {
    /// Ledgers in Redis at `url` (`redis://host:port/db`).
    pub async fn redis(url: &str) -> Result<Self, FleetError> {
        let client = redis::Client::open(url)?;
        let connection = client.get_multiplexed_async_connection().await?;
        Ok(Ledgers::Redis {
            connection,
            prefix: "sluice:ledger:".to_string(),
        })
    }

    /// The shares for every global policy of `set`, for the Envoy that sent
    /// `report`.
    pub async fn shares(
        &self,
        set: &PolicySet,
        report: &SyncReport,
        now: Instant,
    ) -> Result<SharesMessage, FleetError> {
        let mut out = BTreeMap::new();
        for policy in set.policies.iter().filter(|p| p.scope == Scope::Global) {
            let terms = FleetTerms::of_policy(policy);
            let counters = report
                .policies
                .get(&policy.name)
                .copied()
                .unwrap_or_default();
            let usage = Usage {
                asked: counters.admitted.saturating_add(counters.rejected),
                admitted: counters.admitted,
                in_flight: u32::try_from(counters.in_flight).unwrap_or(u32::MAX),
                waiting: u32::try_from(counters.waiting).unwrap_or(u32::MAX),
                at: Instant::from_millis(report.at_ms),
            };
            // The id of a share is its expiry in milliseconds.
            let newest = report
                .shares
                .get(&policy.name)
                .map(|&id| Instant::from_millis(id));
            let share = self
                .update(&policy.name, |ledger| {
                    ledger.sync_usage(&terms, &report.instance, usage, newest, now)
                })
                .await?;
            out.insert(policy.name.clone(), message(&share, &terms, now));
        }
        Ok(out)
    }

    /// Each global policy's ledger as the UI shows it.
    pub async fn views(
        &self,
        set: &PolicySet,
        now: Instant,
    ) -> Result<Vec<FleetPolicy>, FleetError> {
        let mut out = Vec::new();
        for policy in set.policies.iter().filter(|p| p.scope == Scope::Global) {
            let terms = FleetTerms::of_policy(policy);
            let ledger = self.read(&policy.name).await?;
            out.push(FleetPolicy {
                policy: policy.name.clone(),
                limit: terms.limit,
                lease: terms.lease,
                reserved: ledger.reserved(&terms, now),
                members: ledger.members(&terms, now),
            });
        }
        Ok(out)
    }

    async fn read(&self, policy: &str) -> Result<Ledger, FleetError> {
        match self {
            Ledgers::Memory(ledgers) => Ok(ledgers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .get(policy)
                .cloned()
                .unwrap_or_default()),
            Ledgers::Redis { connection, prefix } => {
                let mut connection = connection.clone();
                let raw: Option<String> = redis::cmd("GET")
                    .arg(format!("{prefix}{policy}"))
                    .query_async(&mut connection)
                    .await?;
                decode(policy, raw.as_deref().unwrap_or(""))
            }
        }
    }

    async fn update(
        &self,
        policy: &str,
        change: impl Fn(&mut Ledger) -> Share,
    ) -> Result<Share, FleetError> {
        match self {
            Ledgers::Memory(ledgers) => {
                let mut ledgers = ledgers
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                Ok(change(ledgers.entry(policy.to_string()).or_default()))
            }
            Ledgers::Redis { connection, prefix } => {
                let key = format!("{prefix}{policy}");
                let script = redis::Script::new(COMPARE_AND_SET);
                let mut connection = connection.clone();
                for _ in 0..MAX_CAS_ATTEMPTS {
                    let raw: Option<String> = redis::cmd("GET")
                        .arg(&key)
                        .query_async(&mut connection)
                        .await?;
                    let raw = raw.unwrap_or_default();
                    let mut ledger = decode(policy, &raw)?;
                    let share = change(&mut ledger);
                    let new =
                        serde_json::to_string(&ledger).map_err(|source| FleetError::Corrupt {
                            policy: policy.to_string(),
                            source,
                        })?;
                    let stored: i64 = script
                        .key(&key)
                        .arg(&raw)
                        .arg(&new)
                        .arg(LEDGER_TTL_MS)
                        .invoke_async(&mut connection)
                        .await?;
                    if stored == 1 {
                        return Ok(share);
                    }
                }
                Err(FleetError::Contended(policy.to_string()))
            }
        }
    }
}

fn decode(policy: &str, raw: &str) -> Result<Ledger, FleetError> {
    if raw.is_empty() {
        return Ok(Ledger::default());
    }
    serde_json::from_str(raw).map_err(|source| FleetError::Corrupt {
        policy: policy.to_string(),
        source,
    })
}

fn message(share: &Share, terms: &FleetTerms, now: Instant) -> ShareMessage {
    ShareMessage {
        rate: share.amount.rate,
        in_flight: share.amount.in_flight,
        lease_ms: (share.expires_at - now).min(terms.lease).as_millis(),
        instances: share.instances,
        id: share.id(),
    }
}
