//! Every counter Sluice keeps, by family, each with its meaning and kind
//! ([`crate::counts`]): a policy's, a further limit's, what a limit's
//! provider said, and the filter's own. A counter added here is an Envoy
//! stat (`sluice.policy.<policy>.<name>`, `sluice.limit.<limit>.<name>`,
//! `sluice.<name>`); a reported one also travels in the sync report and
//! shows in the live view and in Prometheus, as its kind says.

use crate::counters;

counters! {
    /// A policy's counters, per Envoy: `sluice.policy.<policy>.<name>`.
    pub enum PolicyCounter {
        /// Requests admitted.
        Admitted = "admitted", Rate;
        /// Requests refused.
        Rejected = "rejected", Rate;
        /// Requests that waited in the queue.
        Queued = "queued", Rate;
        /// Queued requests refused when their wait ran out.
        QueueTimeouts = "queue_timeouts", Total;
        /// Queued requests whose caller went away first.
        QueueAbandoned = "queue_abandoned", Local;
        /// Requests a shadow policy would have refused.
        ShadowLimited = "shadow_limited", Rate;
        /// Requests refused (in `rejected` too) because their key was past
        /// its fair share while other keys wanted theirs (`fair`).
        FairRefused = "fair_refused", Rate;
        /// Requests holding a concurrency slot now.
        InFlight = "in_flight", Gauge;
        /// Concurrency leases taken back from workers that stopped renewing
        /// them.
        LeasesExpired = "leases_expired", Local;
        /// Keys whose bucket was taken over by another key.
        KeyEvictions = "key_evictions", Local;
        /// Requests of keys that found no bucket of their own and shared
        /// the overflow bucket.
        KeyOverflow = "key_overflow", Local;
        /// Calls matched by their host alone: the policy names a port the
        /// requests did not carry (Envoy may strip ports before filters
        /// run).
        PortHidden = "port_hidden", Total;
        /// Calls passed over to the next policy because their body, which
        /// this policy's `match.json` reads, was not JSON (or too large to
        /// read) or lacked a field the match names.
        BodyUnmatched = "body_unmatched", Total;
        /// Calls whose key (`key.json`) was not in their body: they share
        /// the bucket of calls without a key.
        KeyUnread = "key_unread", Total;
        /// Calls decided under this policy though their body, which it
        /// reads, could not be (not JSON, too large): their costs at
        /// their most (`match.unreadable`).
        BodyUnreadable = "body_unreadable", Total;
        /// Calls refused because their body, which this policy reads,
        /// named one key twice in an object.
        BodyRefused = "body_refused", Total;
        /// Streamed calls that did not ask for their usage, sent asking
        /// (`usage.ask_stream_usage`).
        StreamUsageAsked = "stream_usage_asked", Total;
        /// Of their answers' usage chunks, those taken out before the
        /// caller saw them.
        StreamUsageStripped = "stream_usage_stripped", Total;
    }
}

counters! {
    /// A further limit's counters (`limits`), over every policy naming it:
    /// `sluice.limit.<limit>.<name>`. What its provider said is reported
    /// as [`ProviderCounter`]s (see [`LimitCounter::provider`]).
    pub enum LimitCounter {
        /// Calls this limit let through (every limit of the policy did).
        Admitted = "admitted", Rate;
        /// Calls this limit refused first.
        Refused = "refused", Rate;
        /// Calls that queued (queue mode) because this limit had no room
        /// yet.
        Queued = "queued", Local;
        /// Tokens the admitted calls took from it (with `usage`: what each
        /// was charged in the end, counted when its response ended).
        Tokens = "tokens", Rate;
        /// Responses whose usage was read and reconciled with the estimate.
        UsageRead = "usage_read", Local;
        /// Responses larger than `max_body_bytes`, or beyond what the
        /// worker holds of all responses at once: charged the unread
        /// charge.
        UsageTooLarge = "usage_too_large", Local;
        /// Responses whose usage was not a whole number (not JSON, a bad
        /// header): charged the unread charge.
        UsageMalformed = "usage_malformed", Local;
        /// Calls that ended before their response did (aborted, reset):
        /// charged the unread charge.
        UsageAborted = "usage_aborted", Local;
        /// Responses that carried no usage (an OpenAI stream that did not
        /// ask for it, a missing header or path): charged the unread
        /// charge.
        UsageMissing = "usage_missing", Local;
        /// Calls whose key for this limit (`key.json`) was not in their
        /// body: they share the limit's bucket of calls without a key.
        KeyUnread = "key_unread", Total;
        /// Calls that left it past one of its warning lines (`warn_at`):
        /// their answers carry `x-sluice-warn`.
        Warned = "warned", Rate;
        /// Warning lines crossed: once per line per period (per key).
        WarnCrossed = "warn_crossed", Total;
        /// Calls sent for a cheaper model past its `downgrade` line: their
        /// answers carry `x-sluice-downgraded`.
        Downgraded = "downgraded", Rate;
        /// Pool calls sent to a member past this limit's `route` line:
        /// their answers carry `x-sluice-routed`.
        Routed = "routed", Rate;
        /// Calls its `queue` rung's pace held on arrival, past its line:
        /// queued for their turn, or refused (`x-sluice-reason: paced`)
        /// when it was further than their wait.
        Paced = "paced", Rate;
        /// Calls refused because this budget's spending before a restart
        /// is not known yet (the admin has not answered since).
        BudgetUnknown = "budget_unknown", Local;
        /// Answers the provider refused with a status in `pause_on`.
        ProviderRefused = "provider_refused", Local;
        /// Pauses this worker began on the provider's `Retry-After`.
        Paused = "paused", Local;
        /// Of those, pauses cut to `max_pause` (the provider asked for
        /// more).
        PauseCapped = "pause_capped", Local;
        /// Provider signals that did not parse: ignored.
        SignalMalformed = "signal_malformed", Local;
        /// Answers whose count of what is left was read and followed.
        CountRead = "count_read", Local;
        /// Cuts of an adaptive limit's rate on the provider's refusals.
        RateCut = "rate_cut", Local;
        /// Calls a pool sent to another member that Envoy retried on this
        /// limit's member (that member refused them): counted here too.
        PoolRetried = "pool_retried", Rate;
        /// Pool calls that went to another member (or were refused)
        /// because this limit left its member no room: demand the member
        /// could not take, which fleet mode counts as asked when it sizes
        /// this Envoy's share of a global limit.
        PassedOver = "passed_over", Rate;
    }
}

counters! {
    /// What a further limit's provider said, since the Envoy started:
    /// reported in the limit's `provider` part.
    pub enum ProviderCounter {
        /// Calls the provider refused.
        Refused = "refused", Rate;
        /// Pauses begun on the provider's word.
        Pauses = "pauses", Total;
        /// Cuts of the limit's adapted rate.
        Cuts = "cuts", Total;
    }
}

impl LimitCounter {
    /// The provider's counter this limit's stat is reported as, if any.
    pub fn provider(self) -> Option<ProviderCounter> {
        match self {
            LimitCounter::ProviderRefused => Some(ProviderCounter::Refused),
            LimitCounter::Paused => Some(ProviderCounter::Pauses),
            LimitCounter::RateCut => Some(ProviderCounter::Cuts),
            _ => None,
        }
    }
}

counters! {
    /// The filter's own counters: `sluice.<name>`.
    pub enum FilterCounter {
        /// Compare-and-swap writes to shared data that lost a race and
        /// tried again.
        CasRetries = "cas_retries", Local;
        /// Changes to shared data given up after every try lost a race.
        CasExhausted = "cas_exhausted", Local;
        /// Values in shared data that did not decode: started afresh.
        StateDecodeErrors = "state_decode_errors", Local;
        /// Calls into Envoy that failed.
        HostErrors = "host_errors", Local;
        /// Syncs the admin answered.
        SyncOk = "sync_ok", Local;
        /// Syncs that failed (the admin away, a timeout, a bad answer).
        SyncFailures = "sync_failures", Local;
        /// Sync answers older than the set this filter holds: ignored.
        SyncStale = "sync_stale", Local;
        /// Policy sets installed.
        PolicySetsInstalled = "policy_sets_installed", Local;
        /// Requests whose body was too large to read an estimate from.
        RequestBodyTooLarge = "request_body_too_large", Local;
        /// Admin answers whose budgets header was not one (too large, not
        /// JSON): budgets stayed unknown.
        BudgetsMalformed = "budgets_malformed", Local;
        /// Admin answers whose provider news header was not one: nothing
        /// relayed was taken from it.
        ProviderNewsMalformed = "provider_news_malformed", Local;
        /// Policy sets the admin pushed (answers to the watch call).
        PushSets = "push_sets", Local;
        /// Policy sets a periodic sync brought before a push did.
        SyncSets = "sync_sets", Local;
        /// Watch calls that failed (the admin away, a timeout, a bad
        /// answer).
        PushFailures = "push_failures", Local;
        /// Answers not read for their usage because the worker held its
        /// most of response bodies already (charged the unread charge).
        UsageBufferFull = "usage_buffer_full", Local;
        /// Requests that came with a value of their own in a header
        /// pools route by (`route_header`): removed before Envoy routed
        /// them.
        RouteHeaderStripped = "route_header_stripped", Local;
        /// Calls whose body did not come within 10 s of their headers,
        /// held for it (a policy decides on the body): answered 408.
        BodyWaitTimeouts = "body_wait_timeouts", Local;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counts::{Counter, Kind};

    fn check<C: Counter>() {
        for (i, c) in C::ALL.iter().enumerate() {
            assert_eq!(c.index(), i, "{c:?}");
            assert!(!c.meaning().is_empty(), "{c:?} says what it means");
            assert!(
                c.name()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{c:?}: a stat and Prometheus name"
            );
            assert_eq!(C::by_name(c.name()), Some(*c), "names are unique");
        }
    }

    #[test]
    fn every_family_names_and_explains_each_counter_once() {
        check::<PolicyCounter>();
        check::<LimitCounter>();
        check::<ProviderCounter>();
        check::<FilterCounter>();
    }

    #[test]
    fn provider_stats_are_reported_through_the_providers_counters_only() {
        for &c in LimitCounter::ALL {
            if c.provider().is_some() {
                assert_eq!(c.kind(), Kind::Local, "{c:?} is reported once");
            }
        }
    }
}
