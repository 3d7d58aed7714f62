//! The admin's side of the sync in process, at virtual time: the real
//! fleet ledgers ([`Ledgers`], in memory as one admin keeps them) and the
//! real provider relay ([`ProviderRelay`]), answering each Envoy's report
//! as the admin's sync endpoint does: the set when the Envoy's is not
//! current, its shares of every global limit, other Envoys' provider news.
//! What the endpoint does besides (the store's bookkeeping, the live view,
//! budgets, watches) is not simulated: no property here depends on it.

use sluice_admin::fleet::Ledgers;
use sluice_admin::relay::ProviderRelay;
use std::collections::BTreeMap;

use sluice_shared::fleet::{Amount, FleetTerms};
use sluice_shared::time::Instant;
use sluice_shared::{PolicySet, Scope};
use sluice_wire::sync::{SharesMessage, SyncReport, WatchRequest};
use sluice_wire::sync_answer::{AdminAnswer, HttpAnswer};

/// The store's epoch the simulated admin names.
const EPOCH: u64 = 1;

pub struct SimAdmin {
    ledgers: Ledgers,
    /// The ledgers' store (Redis) answers: while it does not, syncs get
    /// no shares, as the endpoint answers a sync whose ledgers fail.
    ledgers_up: bool,
    relay: ProviderRelay,
    set: PolicySet,
    /// The ledgers' and relay's calls are async (Redis in production);
    /// in memory they never wait, and this runs them to the end at once.
    runtime: tokio::runtime::Runtime,
}

/// What the admin made of one report.
pub struct Answered {
    pub http: HttpAnswer,
    /// The shares it handed out (empty: none, or the report was refused).
    pub shares: SharesMessage,
    /// The sync freed room the others may take (the admin would tell
    /// them through their watches).
    pub freed: bool,
    /// What went wrong, as the admin would log it.
    pub error: Option<String>,
}

impl SimAdmin {
    /// An admin whose store holds `policies` (a set's JSON) as version 1;
    /// its shares are tagged with a secret drawn from `seed`.
    pub fn new(policies: &str, seed: u64) -> Result<Self, String> {
        let mut set =
            sluice_shared::validate::parse_policy_set(policies).map_err(|e| e.to_string())?;
        set.version = set.version.max(1);
        let mut secret = [0u8; sluice_shared::fleet::share_tag::SECRET_LEN];
        let mut state = seed;
        for chunk in secret.chunks_mut(8) {
            state = crate::rng::splitmix64(state);
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            ledgers: Ledgers::default().with_secret(secret),
            ledgers_up: true,
            relay: ProviderRelay::default(),
            set,
            runtime,
        })
    }

    /// The admin's answer to a sync call whose body is `body`, at `now`.
    pub fn answer(&self, body: &[u8], now: Instant) -> Answered {
        let refused = |status: u16, error: String| Answered {
            http: HttpAnswer {
                status,
                headers: Vec::new(),
                body: Vec::new(),
            },
            shares: SharesMessage::new(),
            freed: false,
            error: Some(error),
        };
        let report = match serde_json::from_slice::<SyncReport>(body) {
            Ok(report) => report,
            Err(e) => return refused(400, format!("sync report: {e}")),
        };
        if let Err(e) = report.check() {
            return refused(400, e);
        }
        let set = &self.set;
        let now_ms = now.as_millis();
        self.runtime.block_on(async {
            // As the endpoint: the relay failing costs news, never the sync.
            let _ = self.relay.hear(&report, set, now_ms).await;
            let provider = self
                .relay
                .news_for(&report, set, now_ms)
                .await
                .unwrap_or_default();
            let shares = if self.ledgers_up {
                self.ledgers
                    .shares_at(set, &report, now)
                    .await
                    .map_err(|e| e.to_string())
            } else {
                Err("the ledgers' store is down".to_string())
            };
            let (shares, freed, error) = match shares {
                Ok(shares) => (shares.message, shares.freed, None),
                Err(e) => (
                    SharesMessage::new(),
                    false,
                    Some(format!("no shares for this sync: {e}")),
                ),
            };
            let same_store = report.policy_epoch == EPOCH || report.policy_epoch == 0;
            let current = set.version == report.policy_version && same_store;
            let answer = AdminAnswer {
                set: (!current).then(|| set.clone()),
                version: Some(set.version),
                epoch: EPOCH,
                shares: shares.clone(),
                budgets: Default::default(),
                provider,
                sync_now: false,
            };
            Answered {
                http: answer.http(),
                shares,
                freed,
                error,
            }
        })
    }

    /// A sync turned away at `now` before it was read (shed).
    pub fn turned_away(&self, now: Instant) {
        self.ledgers.turned_away_at(now);
    }

    /// The ledgers' store stops answering (down), or answers again
    /// (back, empty: a Redis restarted without persistence).
    pub fn set_ledgers_up(&mut self, up: bool) {
        if up && !self.ledgers_up {
            self.ledgers.forget_all();
        }
        self.ledgers_up = up;
    }

    /// The global limits whose ledger is recovering now (a share it did
    /// not know was claimed, or nobody synced for a lease): nobody's share
    /// grows until it ends.
    pub fn recovering(&self, now: Instant) -> Vec<String> {
        if !self.ledgers_up {
            return Vec::new();
        }
        self.runtime
            .block_on(self.ledgers.views_at(&self.set, now))
            .unwrap_or_default()
            .into_iter()
            .filter(|v| v.recovering)
            .map(|v| v.policy)
            .collect()
    }

    /// `instance`'s connections to the admin closed (its process died):
    /// the ledgers give its share away if it does not sync again soon.
    pub fn departed(&self, instance: &str, now: Instant) {
        if !self.ledgers_up {
            return;
        }
        let _ = self
            .runtime
            .block_on(self.ledgers.departed_at(&self.set, instance, now));
    }

    /// A watch call whose body is `body`: answered at once (the Envoy's
    /// set is not current, or the body is bad), else None: the admin holds
    /// it until fleet room is freed or the hold ends ([`Self::watch_end`]).
    pub fn watch(&self, body: &[u8]) -> Option<HttpAnswer> {
        let Ok(request) = serde_json::from_slice::<WatchRequest>(body) else {
            return Some(HttpAnswer {
                status: 400,
                headers: Vec::new(),
                body: Vec::new(),
            });
        };
        let same_store = request.policy_epoch == EPOCH || request.policy_epoch == 0;
        (self.set.version > request.policy_version || !same_store).then(|| {
            AdminAnswer {
                set: Some(self.set.clone()),
                epoch: EPOCH,
                ..AdminAnswer::default()
            }
            .http()
        })
    }

    /// A held watch's answer: sync now (fleet room was freed), or the hold
    /// ended with nothing new.
    pub fn watch_end(&self, sync_now: bool) -> HttpAnswer {
        AdminAnswer {
            epoch: EPOCH,
            sync_now,
            ..AdminAnswer::default()
        }
        .http()
    }

    /// Each global limit the admin leases, by the name its shares carry.
    pub fn global_limits(&self) -> BTreeMap<String, Amount> {
        let policies = self
            .set
            .policies
            .iter()
            .filter(|p| p.scope == Scope::Global)
            .map(|p| (p.name.clone(), FleetTerms::of_policy(p).limit));
        let limits = self
            .set
            .limits()
            .filter(|l| l.scope == Scope::Global)
            .map(|l| (l.fleet_name(), FleetTerms::of_limit(l).limit));
        policies.chain(limits).collect()
    }
}
