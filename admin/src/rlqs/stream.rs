//! One RLQS stream over its life: its reports feed its buckets' counters;
//! its assignments are its ledger shares, sent at once after a report and
//! pushed again whenever the fleet moves (another member freed room or
//! wants some), the policy set changes, or a third of a lease passed (a
//! stock Envoy reports only every 5 s, hard-coded in Envoy 1.40's
//! `filter_persistence.cc`, and an assignment must be renewed before its
//! time to live ends). When the stream ends its shares are freed as a
//! departed Sluice Envoy's are.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use sluice_api::{RlqsAssigned, RlqsUnassigned};
use sluice_shared::fleet::Share;
use sluice_shared::{Instant, PolicySet, Span};
use tokio::sync::mpsc::error::TrySendError;
use tokio_stream::StreamExt;
use tonic::Streaming;

use super::buckets::{time_to_live, Buckets, Terms, Unassigned};
use super::{Answers, Registration};
use crate::fleet::global_limit;
use crate::AppState;

/// Assignments are renewed at least this often, and at most a third of
/// the shortest lease apart.
const RENEW_AT_MOST: Duration = Duration::from_secs(1);
const RENEW_AT_LEAST: Duration = Duration::from_millis(250);

/// Fleet news moves a stream's assignments at most this often: a stream
/// whose own sync tells the others wakes itself too.
const NEWS_AT_MOST: Duration = Duration::from_millis(100);

/// A stream that has read none of its answers for this long is given up:
/// its Envoy cannot be enforcing what it was assigned, and its shares go
/// to the others.
const UNREAD_AT_MOST: Duration = Duration::from_secs(5);

/// The longest `domain` kept for the Fleet page.
const MAX_DOMAIN: usize = 128;

struct Stream {
    registration: Registration,
    buckets: Buckets,
    /// The share this admin last gave the stream of each limit.
    held: BTreeMap<String, Share>,
    /// When its counters were last taken (the lease clock).
    reported_at: Instant,
    answers: Answers,
    /// Since when no answer could be queued.
    unread_since: Option<tokio::time::Instant>,
}

pub(super) async fn run(
    state: Arc<AppState>,
    registration: Registration,
    mut reports: Streaming<RateLimitQuotaUsageReports>,
    answers: Answers,
) {
    let instance = registration.instance.clone();
    let mut replaced = registration.replaced.clone();
    let mut stream = Stream {
        registration,
        buckets: Buckets::default(),
        held: BTreeMap::new(),
        reported_at: state.fleet.now(),
        answers,
        unread_since: None,
    };
    let mut listening = state.changes.listen();
    let mut set = state.store.policy_set().await.ok();
    let mut renew = RENEW_AT_MOST;
    let mut next_renewal = tokio::time::Instant::now() + renew;
    let mut last_assigned = tokio::time::Instant::now();
    loop {
        let event = tokio::select! {
            report = reports.next() => match report {
                Some(Ok(report)) => Event::Report(report),
                Some(Err(status)) => {
                    tracing::info!(%instance, %status, "an RLQS stream ended with an error");
                    Event::End
                }
                None => Event::End,
            },
            () = tokio::time::sleep_until(next_renewal) => Event::Renew,
            news = listening.fleet.changed() => match news {
                Ok(()) => Event::News,
                Err(_) => Event::End,
            },
            version = listening.versions.changed() => match version {
                Ok(()) => Event::Policies,
                Err(_) => Event::End,
            },
            _ = replaced.wait_for(|r| *r) => {
                tracing::info!(%instance, "a newer RLQS stream of the same name replaced this one");
                Event::End
            }
            _ = listening.stopping.wait_for(|s| *s) => Event::End,
        };
        match event {
            Event::Report(report) => stream.take(&state, &report),
            Event::Renew => {}
            Event::News => tokio::time::sleep_until(last_assigned + NEWS_AT_MOST).await,
            Event::Policies => set = state.store.policy_set().await.ok().or(set),
            Event::End => break,
        }
        if set.is_none() {
            set = state.store.policy_set().await.ok();
        }
        // No set read yet (the store is away): nothing to assign from.
        let Some(current) = &set else { continue };
        match stream.assign(&state, current).await {
            Ok(shortest_lease) => {
                renew = (shortest_lease / 3).clamp(RENEW_AT_LEAST, RENEW_AT_MOST);
            }
            Err(Gone::Closed) => break,
            Err(Gone::Unread) => {
                tracing::warn!(%instance, "an RLQS stream read none of its assignments for {UNREAD_AT_MOST:?}: given up, its shares freed");
                break;
            }
        }
        last_assigned = tokio::time::Instant::now();
        next_renewal = last_assigned + renew;
    }
    if let Some(set) = set {
        if let Err(e) = state.fleet.departed(&set, &instance).await {
            tracing::warn!(%instance, error = %e, "an RLQS stream closed; not noted in the fleet ledgers");
        }
    }
    tracing::info!(%instance, "an RLQS stream closed; its fleet shares are freed unless it comes back");
}

/// What wakes a stream.
enum Event {
    Report(RateLimitQuotaUsageReports),
    /// Its assignments are due for renewal.
    Renew,
    /// The fleet moved.
    News,
    /// The policy set changed.
    Policies,
    End,
}

/// Why a stream is given up.
enum Gone {
    Closed,
    Unread,
}

impl Stream {
    fn take(&mut self, state: &AppState, report: &RateLimitQuotaUsageReports) {
        self.buckets.report(&report.bucket_quota_usages);
        self.reported_at = state.fleet.now();
        let domain: String = report.domain.chars().take(MAX_DOMAIN).collect();
        self.registration.show(|view| {
            view.domain = domain;
            view.last_report_ms = crate::store::now_ms();
        });
    }

    /// Sends every assigned bucket its share now; the shortest lease of
    /// the limits assigned (how soon the assignments must be renewed).
    async fn assign(&mut self, state: &AppState, set: &PolicySet) -> Result<Duration, Gone> {
        let now = state.fleet.now();
        let mut actions = Vec::new();
        let mut shown = Vec::new();
        let mut told = false;
        let mut shortest = Span::from_secs(3_600);
        self.buckets.start_assignment();
        for (limit, usage) in self.buckets.usage_by_limit() {
            let Some(global) = global_limit(set, &limit) else {
                self.buckets
                    .refuse_limit(&limit, &Unassigned::NotGlobal(limit.clone()));
                continue;
            };
            let Some(spec) = global.rate else {
                self.buckets
                    .refuse_limit(&limit, &Unassigned::NoRate(limit.clone()));
                continue;
            };
            if global.terms.lease < Span::from_secs(1) {
                self.buckets
                    .refuse_limit(&limit, &Unassigned::LeaseTooShort(limit.clone()));
                continue;
            }
            let held = self.held.get(&limit).copied();
            let usage = usage.at(self.reported_at);
            let instance = &self.registration.instance;
            let (share, tell) = match state
                .fleet
                .share_for(&limit, &global.terms, instance, usage, held, now)
                .await
            {
                Ok(got) => got,
                Err(e) => {
                    // Its last assignment holds until its time to live.
                    tracing::error!(%instance, %limit, error = %e, "no RLQS share this time");
                    continue;
                }
            };
            told |= tell;
            self.held.insert(limit.clone(), share);
            let left = (share.expires_at - now).min(global.terms.lease);
            let Some(ttl) = time_to_live(left.as_millis()) else {
                continue;
            };
            shortest = shortest.min(global.terms.lease);
            let terms = Terms {
                spec,
                limit_rate: global.terms.limit.rate,
            };
            let assigned = self.buckets.assign(&limit, &terms, share.amount.rate, ttl);
            shown.push(RlqsAssigned {
                limit: limit.clone(),
                buckets: assigned.len() as u64,
                rate: share.amount.rate,
            });
            actions.extend(assigned);
        }
        if told {
            state.changes.fleet_news();
        }
        let (refused, refused_count) = self.buckets.refused();
        self.registration.show(|view| {
            view.assigned = shown;
            view.unassigned = refused
                .into_iter()
                .map(|(bucket, reason)| RlqsUnassigned { bucket, reason })
                .collect();
            view.unassigned_count = refused_count;
        });
        if !actions.is_empty() {
            self.send(RateLimitQuotaResponse {
                bucket_action: actions,
            })?;
        }
        Ok(Duration::from_millis(shortest.as_millis()))
    }

    /// Queues an answer; a stream that reads none for
    /// [`UNREAD_AT_MOST`] is given up.
    fn send(&mut self, answer: RateLimitQuotaResponse) -> Result<(), Gone> {
        match self.answers.try_send(Ok(answer)) {
            Ok(()) => {
                self.unread_since = None;
                Ok(())
            }
            Err(TrySendError::Closed(_)) => Err(Gone::Closed),
            Err(TrySendError::Full(_)) => {
                let since = *self
                    .unread_since
                    .get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= UNREAD_AT_MOST {
                    return Err(Gone::Unread);
                }
                Ok(())
            }
        }
    }
}
