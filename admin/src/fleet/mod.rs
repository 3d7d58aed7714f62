//! Fleet mode on the admin side: one [`Ledger`] per global policy, turning
//! each Envoy's sync into its share of the policy's limit.
//!
//! One admin keeps the ledgers in memory, decoded: a sync changes its
//! Envoy's member in place, under the lock. Several replicas keep them in
//! Redis in parts, each replica a decoded copy, changed only by
//! compare-and-set on the ledger's version (`replicated.rs`): a replica
//! reads what the others changed, runs the same pure allocation, and
//! writes its parts back only if nobody wrote in between (else it reads
//! again). Two replicas therefore never hand out the same room twice.
//! Either way a ledger is kept for an hour after its last sync.

mod replicated;
mod turned_away;

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use sluice_api::FleetPolicy;
use sluice_shared::fair::FairKeyView;
use sluice_shared::fleet::{Amount, FleetTerms, Held, Ledger, Share, ShareTags, Usage};

use crate::clock::MonotonicWall;
use crate::expiring::ExpiringMap;
use crate::kv::{KvError, RedisConnection};
use replicated::ReplicatedLedgers;
use sluice_shared::{Instant, PolicySet, Scope};
use sluice_wire::stats::{LimitCounter, PolicyCounter};
use sluice_wire::sync::{ShareMessage, SharesMessage, SyncReport};
use turned_away::TurnedAway;

/// Attempts before a sync gives up on a contended ledger in Redis.
const MAX_CAS_ATTEMPTS: u32 = 32;

/// A sync that moves this part of a global limit tells every Envoy holding
/// a watch to sync now: one that frees it (a share superseded by a smaller
/// one), or one whose share falls short of its target by it because the
/// others still hold the room (`Ledger::held_back`). A twentieth: at a
/// tenth, room moving in steps of 6 % of the limit (an Envoy that had been
/// lent spare room giving it back) waited for the next regular sync.
const MOVED_TO_TELL: f64 = 0.05;

/// The shares of one sync's answer, and whether the others should sync now
/// (see [`MOVED_TO_TELL`]): room was freed that they may take, or this
/// Envoy wants room they hold.
pub struct Shares {
    pub message: SharesMessage,
    pub freed: bool,
}

/// Whether `moved` is enough of `limit` to tell the others at once.
fn worth_telling(moved: Amount, limit: Amount) -> bool {
    moved.rate >= MOVED_TO_TELL * limit.rate
        || (limit.in_flight > 0
            && f64::from(moved.in_flight) >= MOVED_TO_TELL * f64::from(limit.in_flight))
}

/// Ledgers outlive every reservation in them by far.
const LEDGER_TTL_MS: u64 = 3_600_000;

/// Ledgers held in memory at once: one per global policy and global
/// further limit of a set, far fewer than this.
const MAX_LEDGERS_IN_MEMORY: usize = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Store(#[from] KvError),
    #[error("ledger of {policy} does not decode: {source}")]
    Corrupt {
        policy: String,
        source: serde_json::Error,
    },
    #[error("ledger of {0} kept changing under us ({MAX_CAS_ATTEMPTS} attempts)")]
    Contended(String),
    #[error("ledger of {policy}: Redis answered something unreadable ({what})")]
    Unreadable { policy: String, what: String },
}

pub struct Ledgers {
    /// One ledger per policy (and global further limit).
    ledgers: Store,
    /// Leases are measured on it (see [`MonotonicWall`]).
    clock: MonotonicWall,
    /// Policies whose ledger this process has written: one found missing
    /// afterwards was lost (Redis restarted empty, or failed over).
    seen: Mutex<HashSet<String>>,
    /// What shares are tagged with: only a share this admin (or a replica
    /// on its store) issued is believed back when a ledger lost it.
    tags: ShareTags,
    /// When each instance's claim of a share nobody issued was last
    /// logged: at most once a minute each.
    refused_logged: Mutex<BTreeMap<String, std::time::Instant>>,
    /// When this admin last turned a sync away unheard.
    turned_away: TurnedAway,
}

/// Instances whose refused claims are remembered for the log's sake.
const MAX_REFUSED_LOGGED: usize = 10_000;

/// Where the ledgers are.
enum Store {
    /// One admin's, decoded: no replica reads them.
    Memory(Mutex<ExpiringMap<Ledger>>),
    /// Replicas', in Redis.
    Replicated(ReplicatedLedgers),
}

impl Default for Ledgers {
    fn default() -> Self {
        Self::in_store(Store::Memory(Mutex::new(ExpiringMap::new(
            MAX_LEDGERS_IN_MEMORY,
        ))))
    }
}

impl Ledgers {
    fn in_store(ledgers: Store) -> Self {
        // Until `with_secret`: a secret of this process's own.
        let secret = crate::auth::random_bytes::<{ sluice_shared::fleet::share_tag::SECRET_LEN }>()
            .unwrap_or_default();
        Self {
            ledgers,
            clock: MonotonicWall::now_anchored(),
            seen: Mutex::new(HashSet::new()),
            tags: ShareTags::new(secret),
            refused_logged: Mutex::new(BTreeMap::new()),
            turned_away: TurnedAway::default(),
        }
    }

    /// Tags shares with the store's secret, so that every replica on the
    /// store (and this one after a restart) believes them back.
    pub fn with_secret(
        mut self,
        secret: [u8; sluice_shared::fleet::share_tag::SECRET_LEN],
    ) -> Self {
        self.tags = ShareTags::new(secret);
        self
    }

    /// What `report`'s Envoy holds of `policy`, and whether this admin
    /// issued it; a share nobody issued is logged (once a minute per
    /// instance).
    fn held(&self, report: &SyncReport, policy: &str, terms: &FleetTerms) -> Held {
        let Some((share, tag)) = held_share(report, policy, terms) else {
            return Held {
                share: None,
                vouched: true,
            };
        };
        let vouched = self.tags.vouches(&report.instance, policy, &share, tag);
        if !vouched {
            let mut logged = lock(&self.refused_logged);
            let now = std::time::Instant::now();
            let due = logged
                .get(&report.instance)
                .is_none_or(|at| now.duration_since(*at) >= std::time::Duration::from_secs(60));
            if due && (logged.len() < MAX_REFUSED_LOGGED || logged.contains_key(&report.instance)) {
                logged.insert(report.instance.clone(), now);
                tracing::warn!(
                    instance = %report.instance,
                    limit = policy,
                    "an Envoy named a share of this limit the admin did not issue (its tag does not check out): \
                     not taken as one it holds; an older filter sends none, a holder of the sync token may be probing"
                );
            }
        }
        Held {
            share: Some(share),
            vouched,
        }
    }

    /// Ledgers in Redis, through `connection`. The connection is
    /// re-established by itself after Redis restarts; meanwhile syncs get
    /// no shares and Envoys keep theirs until their leases end.
    pub fn redis(connection: &RedisConnection) -> Self {
        Self::in_store(Store::Replicated(ReplicatedLedgers::new(
            connection.manager(),
        )))
    }

    /// Every ledger kept in memory gone, as a Redis restarted without
    /// persistence (or failed over to a replica that had not got them)
    /// leaves those in it: the simulator's fault. This process still
    /// knows which it wrote, so it learns shares back from the syncs.
    pub fn forget_all(&self) {
        if let Store::Memory(memory) = &self.ledgers {
            lock(memory).clear();
        }
    }

    /// A sync was turned away before its Envoy was heard (shed, or its
    /// record failed): until a lease and a half and two of an Envoy's
    /// longest backoffs after (its next attempt may be lost too: seed 256
    /// of `syncs_shed_never_cost_the_limit_and_shares_come_back` in
    /// `tests/sim/tests/fleet_shares.rs`), every ledger this admin syncs
    /// keeps its silent members' reservations
    /// ([`Ledger::keep_the_silent_until`]), and with replicas tells the
    /// others so through the ledger's head.
    pub fn turned_away(&self) {
        self.turned_away_at(self.now());
    }

    /// [`Self::turned_away`] at `now` on the lease clock.
    pub fn turned_away_at(&self, now: Instant) {
        self.turned_away.note(now);
    }

    /// Now, on the clock leases are measured on.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The shares for every global policy of `set`, for the Envoy that sent
    /// `report`.
    pub async fn shares(&self, set: &PolicySet, report: &SyncReport) -> Result<Shares, FleetError> {
        self.shares_at(set, report, self.now()).await
    }

    /// [`Self::shares`] at `now` on the lease clock (the simulator's
    /// virtual time).
    pub async fn shares_at(
        &self,
        set: &PolicySet,
        report: &SyncReport,
        now: Instant,
    ) -> Result<Shares, FleetError> {
        let now = on_the_wire(now);
        let mut out = BTreeMap::new();
        let mut freed = false;
        for policy in set.policies.iter().filter(|p| p.scope == Scope::Global) {
            let terms = FleetTerms::of_policy(policy);
            let counters = report
                .policies
                .get(&policy.name)
                .copied()
                .unwrap_or_default();
            let (admitted, rejected) = (
                counters.counts[PolicyCounter::Admitted],
                counters.counts[PolicyCounter::Rejected],
            );
            let in_flight = counters.counts[PolicyCounter::InFlight];
            let usage = Usage {
                asked: admitted.saturating_add(rejected),
                admitted,
                in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
                waiting: u32::try_from(counters.waiting).unwrap_or(u32::MAX),
                at: Instant::from_millis(report.at_ms),
                holds_no_slots: false,
            };
            let held = self.held(report, &policy.name, &terms);
            // A policy shared fairly weighs its Envoys' keys.
            let keys = report.fair.get(&policy.name).map_or(&[][..], Vec::as_slice);
            let (share, freed_here) = self
                .sync_one(
                    &policy.name,
                    &terms,
                    &report.instance,
                    (usage, keys),
                    held,
                    now,
                )
                .await?;
            freed |= freed_here;
            let tag = self.tags.tag(&report.instance, &policy.name, &share);
            out.insert(policy.name.clone(), message(&share, &terms, now, tag));
        }
        // Global further limits, once each however many policies name
        // them, leased as global policies are; their demand is what the
        // Envoy counted for the limit.
        for limit in global_limits(set) {
            let name = limit.fleet_name();
            let terms = FleetTerms::of_limit(limit);
            let counters = report.limits.get(&limit.name).cloned().unwrap_or_default();
            // A pool's calls that passed its member over for want of
            // room were asked of it too (`sluice_shared::pool::passed_over`).
            let (admitted, refused) = (
                counters.counts[LimitCounter::Admitted],
                counters.counts[LimitCounter::Refused]
                    .saturating_add(counters.counts[LimitCounter::PassedOver]),
            );
            let usage = Usage {
                asked: admitted.saturating_add(refused),
                admitted,
                in_flight: 0,
                waiting: 0,
                at: Instant::from_millis(report.at_ms),
                holds_no_slots: false,
            };
            let held = self.held(report, &name, &terms);
            // A limit shared fairly weighs its Envoys' keys, as a policy.
            let keys = report.fair.get(&name).map_or(&[][..], Vec::as_slice);
            let (share, freed_here) = self
                .sync_one(&name, &terms, &report.instance, (usage, keys), held, now)
                .await?;
            freed |= freed_here;
            let tag = self.tags.tag(&report.instance, &name, &share);
            out.insert(name, message(&share, &terms, now, tag));
        }
        Ok(Shares {
            message: out,
            freed,
        })
    }

    /// One instance's sync of one ledger: its share, and whether the
    /// others should sync now ([`MOVED_TO_TELL`]): the sync freed room
    /// they may take (what the others cannot be given, before and after
    /// it), or this instance wants room they hold.
    async fn sync_one(
        &self,
        name: &str,
        terms: &FleetTerms,
        instance: &str,
        usage: (Usage, &[FairKeyView]),
        held: Held,
        now: Instant,
    ) -> Result<(Share, bool), FleetError> {
        let kept_until = self.turned_away.silent_kept_until(terms);
        self.update(name, instance, terms, now, |ledger| {
            if let Some(until) = kept_until {
                ledger.keep_the_silent_until(until);
            }
            // The sync changes this instance's member only: what it
            // frees of the whole is what it frees of its own.
            let before = ledger.reserved_by(terms, instance, now);
            let share = ledger.sync_usage(terms, instance, usage, held, now);
            let after = ledger.reserved_by(terms, instance, now);
            let tell = worth_telling(before.minus(after), terms.limit)
                || worth_telling(ledger.held_back(instance), terms.limit);
            (share, tell)
        })
        .await
    }

    /// The share of the ledger `name` (see [`global_limit`]) for a client
    /// that is no Sluice filter (an RLQS stream, `crate::rlqs`): its
    /// counters taken as a sync's, and the share this admin last gave it
    /// as the one it holds. Whether the others should sync now, as
    /// [`Self::shares`] tells.
    pub async fn share_for(
        &self,
        name: &str,
        terms: &FleetTerms,
        instance: &str,
        usage: Usage,
        held: Option<Share>,
        now: Instant,
    ) -> Result<(Share, bool), FleetError> {
        let now = on_the_wire(now);
        let held = Held {
            share: held,
            vouched: true,
        };
        self.sync_one(name, terms, instance, (usage, &[]), held, now)
            .await
    }

    /// A connection `instance` synced or watched over closed (see
    /// `push::departs_on_close`): its process may be gone. Noted in each global ledger it is in, which
    /// gives its share away if it does not sync again within three sync
    /// intervals ([`Ledger::departed`]).
    pub async fn departed(&self, set: &PolicySet, instance: &str) -> Result<(), FleetError> {
        self.departed_at(set, instance, self.now()).await
    }

    /// [`Self::departed`] at `now` on the lease clock.
    pub async fn departed_at(
        &self,
        set: &PolicySet,
        instance: &str,
        now: Instant,
    ) -> Result<(), FleetError> {
        let now = on_the_wire(now);
        let policies = set
            .policies
            .iter()
            .filter(|p| p.scope == Scope::Global)
            .map(|p| (p.name.clone(), FleetTerms::of_policy(p)));
        let limits = set
            .limits()
            .filter(|l| l.scope == Scope::Global)
            .map(|l| (l.fleet_name(), FleetTerms::of_limit(l)));
        let mut done = std::collections::BTreeSet::new();
        for (name, terms) in policies.chain(limits) {
            // A ledger nobody wrote yet has nothing of it to free.
            if !done.insert(name.clone()) || !self.exists(&name).await? {
                continue;
            }
            self.update(&name, instance, &terms, now, |ledger| {
                ledger.departed(instance, now)
            })
            .await?;
        }
        Ok(())
    }

    /// Each global policy's ledger as the UI shows it, then each global
    /// further limit's (as `limits/<name>`).
    pub async fn views(&self, set: &PolicySet) -> Result<Vec<FleetPolicy>, FleetError> {
        self.views_at(set, self.now()).await
    }

    /// [`Self::views`] at `now` on the lease clock.
    pub async fn views_at(
        &self,
        set: &PolicySet,
        now: Instant,
    ) -> Result<Vec<FleetPolicy>, FleetError> {
        let now = on_the_wire(now);
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
        // Global further limits, as `limits/<name>`.
        for limit in global_limits(set) {
            let name = limit.fleet_name();
            let terms = FleetTerms::of_limit(limit);
            let ledger = self.read(&name).await?.unwrap_or_default();
            out.push(FleetPolicy {
                limit: terms.limit,
                lease: terms.lease,
                reserved: ledger.reserved(&terms, now),
                recovering: ledger.recovering(now),
                members: ledger.members(&terms, now),
                policy: name,
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

    /// Whether `policy` has a ledger, without copying it (a connection
    /// closing asks; in memory a copy is the whole ledger).
    async fn exists(&self, policy: &str) -> Result<bool, FleetError> {
        match &self.ledgers {
            Store::Memory(memory) => Ok(lock(memory)
                .get(policy, std::time::Instant::now())
                .is_some()),
            Store::Replicated(replicated) => replicated.exists(policy).await,
        }
    }

    async fn read(&self, policy: &str) -> Result<Option<Ledger>, FleetError> {
        match &self.ledgers {
            Store::Memory(memory) => {
                Ok(lock(memory).get(policy, std::time::Instant::now()).cloned())
            }
            Store::Replicated(replicated) => replicated.read(policy).await,
        }
    }

    /// Runs `change` on the ledger of `policy`, which changes `touched`'s
    /// member (and forgets members whose reservations ended).
    async fn update<R>(
        &self,
        policy: &str,
        touched: &str,
        terms: &FleetTerms,
        now: Instant,
        change: impl Fn(&mut Ledger) -> R,
    ) -> Result<R, FleetError> {
        let fresh = || self.fresh(policy, terms, now);
        let answer = match &self.ledgers {
            Store::Memory(memory) => {
                let at = std::time::Instant::now();
                let keep_until = at + std::time::Duration::from_millis(LEDGER_TTL_MS);
                let mut memory = lock(memory);
                change(memory.keep(policy, keep_until, at, fresh))
            }
            Store::Replicated(replicated) => replicated
                .update(policy, touched, MAX_CAS_ATTEMPTS, fresh, change)
                .await?
                .ok_or_else(|| FleetError::Contended(policy.to_string()))?,
        };
        lock(&self.seen).insert(policy.to_string());
        Ok(answer)
    }
}

/// The share `report`'s Envoy says it holds of `policy`. An Envoy that
/// names a share without describing it (an older filter) is taken to hold
/// the whole limit, which is never too little; values that make no sense
/// are bounded the same way.
fn held_share(report: &SyncReport, policy: &str, terms: &FleetTerms) -> Option<(Share, u64)> {
    let id = *report.shares.get(policy)?;
    let amount = match report.held.get(policy) {
        Some(held) if held.rate.is_finite() && held.rate >= 0.0 => Amount {
            rate: held.rate,
            in_flight: held.in_flight,
        },
        _ => terms.limit,
    };
    let instances = report.held.get(policy).map_or(1, |h| h.instances.max(1));
    let tag = report.held.get(policy).map_or(0, |h| h.tag);
    let share = Share {
        amount: amount.min(terms.limit),
        expires_at: Instant::from_millis(id),
        instances,
    };
    Some((share, tag))
}

/// `now` in whole milliseconds, as the wire and a ledger's records in
/// Redis carry every time: one admin decides as replicas do, and a time
/// kept in a ledger reads back as it was written. (With nanoseconds kept
/// in memory, which of two moments a fraction of a millisecond apart came
/// first changed, and the simulator's seed 51 of
/// `a_dead_envoys_share_moves_and_comes_back` moved a dead Envoy's share
/// one sync later than the property allows.)
fn on_the_wire(now: Instant) -> Instant {
    Instant::from_millis(now.as_millis())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn message(share: &Share, terms: &FleetTerms, now: Instant, tag: u64) -> ShareMessage {
    ShareMessage {
        rate: share.amount.rate,
        in_flight: share.amount.in_flight,
        lease_ms: (share.expires_at - now).min(terms.lease).as_millis(),
        instances: share.instances,
        id: share.id(),
        tag,
    }
}

/// A global limit a fleet ledger is kept for: its terms, and its rate as
/// its policy states it (none: it limits calls in flight only).
pub struct GlobalLimit<'a> {
    pub terms: FleetTerms,
    pub rate: Option<&'a sluice_shared::policy::RateSpec>,
}

/// The global policy named `name`, or the global further limit whose
/// ledger is `name` (`limits/<limit>`); none when `set` has neither.
pub fn global_limit<'a>(set: &'a PolicySet, name: &str) -> Option<GlobalLimit<'a>> {
    if let Some(policy) = set
        .policies
        .iter()
        .find(|p| p.scope == Scope::Global && p.name == name)
    {
        return Some(GlobalLimit {
            terms: FleetTerms::of_policy(policy),
            rate: policy.rate.as_ref(),
        });
    }
    global_limits(set)
        .find(|l| l.fleet_name() == name)
        .map(|limit| GlobalLimit {
            terms: FleetTerms::of_limit(limit),
            rate: limit.rate.as_ref(),
        })
}

/// The set's global further limits, once each however many policies name
/// them (policies naming one limit agree on it: validation).
fn global_limits(set: &PolicySet) -> impl Iterator<Item = &sluice_shared::NamedLimit> {
    let mut seen = std::collections::BTreeSet::new();
    set.limits()
        .filter(|l| l.scope == Scope::Global)
        .filter(move |l| seen.insert(l.name.as_str()))
}
