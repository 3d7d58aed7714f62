//! Fleet mode on the admin side: one [`Ledger`] per global policy, turning
//! each Envoy's sync into its share of the policy's limit.
//!
//! One admin keeps the ledgers in memory. Several replicas keep them in
//! Redis, one key per policy, changed only through a compare-and-set Lua
//! script: a replica reads the ledger, runs the same pure allocation, and
//! writes back only if nobody wrote in between (else it reads again). Two
//! replicas therefore never hand out the same room twice.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use sluice_shared::api::FleetPolicy;
use sluice_shared::fleet::{Amount, FleetTerms, Ledger, Share, Usage};

use crate::clock::MonotonicWall;
use sluice_shared::sync::{ShareMessage, SharesMessage, SyncReport};
use sluice_shared::{Instant, PolicySet, Scope};

/// Attempts before a sync gives up on a contended ledger in Redis.
const MAX_CAS_ATTEMPTS: u32 = 32;

/// A sync that frees this part of a global limit (a share superseded by a
/// smaller one) tells every Envoy holding a watch to sync now.
const FREED_TO_TELL: f64 = 0.1;

/// The shares of one sync's answer, and whether it freed room others may
/// take (see [`FREED_TO_TELL`]).
pub struct Shares {
    pub message: SharesMessage,
    pub freed: bool,
}

/// Ledgers outlive every reservation in them by far.
const LEDGER_TTL_MS: u64 = 3_600_000;

/// How long a Redis call (or reconnection) may take before the sync that
/// needed it goes on without shares.
const REDIS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

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
    #[error("reading Redis's CA certificate {0}: {1}")]
    Ca(String, std::io::Error),
}

pub struct Ledgers {
    backend: Backend,
    /// Leases are measured on it (see [`MonotonicWall`]).
    clock: MonotonicWall,
    /// Policies whose ledger this process has written: one found missing
    /// afterwards was lost (Redis restarted empty, or failed over).
    seen: Mutex<HashSet<String>>,
}

enum Backend {
    Memory(Mutex<HashMap<String, Ledger>>),
    Redis {
        /// Reconnects on its own when Redis restarts or the link drops.
        connection: redis::aio::ConnectionManager,
        prefix: String,
    },
}

impl Default for Ledgers {
    fn default() -> Self {
        Self::with_backend(Backend::Memory(Mutex::new(HashMap::new())))
    }
}

impl Ledgers {
    fn with_backend(backend: Backend) -> Self {
        Self {
            backend,
            clock: MonotonicWall::now_anchored(),
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// Ledgers in Redis at `url` (`redis://host:port/db`, or
    /// `rediss://` for TLS checked against the system's CAs and `ca`).
    /// The connection is re-established by itself after Redis restarts;
    /// meanwhile syncs get no shares and Envoys keep theirs until their
    /// leases end.
    pub async fn redis(url: &str, ca: Option<&std::path::Path>) -> Result<Self, FleetError> {
        let client = match ca {
            Some(ca) => {
                let root_cert =
                    std::fs::read(ca).map_err(|e| FleetError::Ca(ca.display().to_string(), e))?;
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
        let connection = client.get_connection_manager_with_config(config).await?;
        Ok(Self::with_backend(Backend::Redis {
            connection,
            prefix: "sluice:ledger:".to_string(),
        }))
    }

    /// The Redis connection the ledgers live behind, if they do.
    pub fn redis_connection(&self) -> Option<redis::aio::ConnectionManager> {
        match &self.backend {
            Backend::Memory(_) => None,
            Backend::Redis { connection, .. } => Some(connection.clone()),
        }
    }

    /// Now, on the clock leases are measured on.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The shares for every global policy of `set`, for the Envoy that sent
    /// `report`.
    pub async fn shares(&self, set: &PolicySet, report: &SyncReport) -> Result<Shares, FleetError> {
        let now = self.now();
        let mut out = BTreeMap::new();
        let mut freed = false;
        // What the others cannot be given, before and after this sync: a
        // drop of a tenth of the limit or more is room someone may want.
        let sync_freeing = |ledger: &mut Ledger, terms: &FleetTerms, usage, held| {
            let before = ledger.reserved(terms, now);
            let share = ledger.sync_usage(terms, &report.instance, usage, held, now);
            let after = ledger.reserved(terms, now);
            let freed = before.rate - after.rate >= FREED_TO_TELL * terms.limit.rate
                || (terms.limit.in_flight > 0
                    && f64::from(before.in_flight.saturating_sub(after.in_flight))
                        >= FREED_TO_TELL * f64::from(terms.limit.in_flight));
            (share, freed)
        };
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
            let held = held_share(report, &policy.name, &terms);
            let (share, freed_here) = self
                .update(&policy.name, &terms, now, |ledger| {
                    sync_freeing(ledger, &terms, usage, held)
                })
                .await?;
            freed |= freed_here;
            out.insert(policy.name.clone(), message(&share, &terms, now));
        }
        // Global further limits, once each however many policies name
        // them, leased as global policies are; their demand is what the
        // Envoy counted for the limit.
        let global_limits = set
            .policies
            .iter()
            .flat_map(|p| p.limits.iter())
            .filter(|l| l.scope == Scope::Global);
        for limit in global_limits {
            let name = limit.fleet_name();
            if out.contains_key(&name) {
                continue;
            }
            let terms = FleetTerms::of_limit(limit);
            let counters = report.limits.get(&limit.name).copied().unwrap_or_default();
            let usage = Usage {
                asked: counters.admitted.saturating_add(counters.refused),
                admitted: counters.admitted,
                in_flight: 0,
                waiting: 0,
                at: Instant::from_millis(report.at_ms),
            };
            let held = held_share(report, &name, &terms);
            let (share, freed_here) = self
                .update(&name, &terms, now, |ledger| {
                    sync_freeing(ledger, &terms, usage, held)
                })
                .await?;
            freed |= freed_here;
            out.insert(name, message(&share, &terms, now));
        }
        Ok(Shares {
            message: out,
            freed,
        })
    }

    /// `instance`'s watch connection closed before it was answered: its
    /// process may be gone. Noted in each global ledger it is in, which
    /// gives its share away if it does not sync again within two sync
    /// intervals ([`Ledger::departed`]).
    pub async fn departed(&self, set: &PolicySet, instance: &str) -> Result<(), FleetError> {
        let now = self.now();
        let policies = set
            .policies
            .iter()
            .filter(|p| p.scope == Scope::Global)
            .map(|p| (p.name.clone(), FleetTerms::of_policy(p)));
        let limits = set
            .policies
            .iter()
            .flat_map(|p| p.limits.iter())
            .filter(|l| l.scope == Scope::Global)
            .map(|l| (l.fleet_name(), FleetTerms::of_limit(l)));
        let mut done = std::collections::BTreeSet::new();
        for (name, terms) in policies.chain(limits) {
            // A ledger nobody wrote yet has nothing of it to free.
            if !done.insert(name.clone()) || self.read(&name).await?.is_none() {
                continue;
            }
            self.update(&name, &terms, now, |ledger| ledger.departed(instance, now))
                .await?;
        }
        Ok(())
    }

    /// Each global policy's ledger as the UI shows it.
    pub async fn views(&self, set: &PolicySet) -> Result<Vec<FleetPolicy>, FleetError> {
        let now = self.now();
        let mut out = Vec::new();
        for policy in set.policies.iter().filter(|p| p.scope == Scope::Global) {
            let terms = FleetTerms::of_policy(policy);
            let ledger = self.read(&policy.name).await?.unwrap_or_default();
            out.push(FleetPolicy {
                policy: policy.name.clone(),
                limit: terms.limit,
                lease: terms.lease,
                reserved: ledger.reserved(&terms, now),
                recovering: ledger.recovering(now),
                members: ledger.members(&terms, now),
            });
        }
        Ok(out)
    }

    /// A ledger that is missing though this process wrote it was lost; so
    /// may be any missing ledger while this process is younger than a
    /// lease and a half (it cannot know what was there before it).
    fn presumed_lost(&self, policy: &str, terms: &FleetTerms, now: Instant) -> bool {
        let young = now < self.clock.at_start() + terms.lease + terms.lease.div(2);
        young || lock(&self.seen).contains(policy)
    }

    /// The ledger of `policy` as it is, or one to start it from.
    fn fresh(&self, policy: &str, terms: &FleetTerms, now: Instant) -> Ledger {
        let mut ledger = Ledger::default();
        if self.presumed_lost(policy, terms, now) {
            tracing::warn!(
                policy,
                "the fleet ledger is gone (Redis restarted or failed over, or this admin restarted): \
                 shares held by Envoys are learned back from their syncs"
            );
            ledger.lost();
        }
        ledger
    }

    async fn read(&self, policy: &str) -> Result<Option<Ledger>, FleetError> {
        match &self.backend {
            Backend::Memory(ledgers) => Ok(lock(ledgers).get(policy).cloned()),
            Backend::Redis { connection, prefix } => {
                let mut connection = connection.clone();
                let raw: Option<String> = redis::cmd("GET")
                    .arg(format!("{prefix}{policy}"))
                    .query_async(&mut connection)
                    .await?;
                match raw.as_deref() {
                    None | Some("") => Ok(None),
                    Some(raw) => decode(policy, raw).map(Some),
                }
            }
        }
    }

    async fn update<R>(
        &self,
        policy: &str,
        terms: &FleetTerms,
        now: Instant,
        change: impl Fn(&mut Ledger) -> R,
    ) -> Result<R, FleetError> {
        let share = match &self.backend {
            Backend::Memory(ledgers) => {
                let mut ledgers = lock(ledgers);
                let ledger = match ledgers.entry(policy.to_string()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(self.fresh(policy, terms, now))
                    }
                };
                change(ledger)
            }
            Backend::Redis { connection, prefix } => {
                let key = format!("{prefix}{policy}");
                crate::redis_cas::update(connection, &key, MAX_CAS_ATTEMPTS, |raw| {
                    let mut ledger = if raw.is_empty() {
                        self.fresh(policy, terms, now)
                    } else {
                        decode(policy, raw)?
                    };
                    let share = change(&mut ledger);
                    let new =
                        serde_json::to_string(&ledger).map_err(|source| FleetError::Corrupt {
                            policy: policy.to_string(),
                            source,
                        })?;
                    Ok::<_, FleetError>((share, new, LEDGER_TTL_MS))
                })
                .await?
                .ok_or_else(|| FleetError::Contended(policy.to_string()))?
            }
        };
        lock(&self.seen).insert(policy.to_string());
        Ok(share)
    }
}

/// The share `report`'s Envoy says it holds of `policy`. An Envoy that
/// names a share without describing it (an older filter) is taken to hold
/// the whole limit, which is never too little; values that make no sense
/// are bounded the same way.
fn held_share(report: &SyncReport, policy: &str, terms: &FleetTerms) -> Option<Share> {
    let id = *report.shares.get(policy)?;
    let amount = match report.held.get(policy) {
        Some(held) if held.rate.is_finite() && held.rate >= 0.0 => Amount {
            rate: held.rate,
            in_flight: held.in_flight,
        },
        _ => terms.limit,
    };
    let instances = report.held.get(policy).map_or(1, |h| h.instances.max(1));
    Some(Share {
        amount: amount.min(terms.limit),
        expires_at: Instant::from_millis(id),
        instances,
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
