//! Pauses the provider asked for: a refusal with `Retry-After` on a call
//! of a limit with `provider` stops that limit (for a keyed limit: that
//! key) for every worker, through one shared-data entry per limit (per
//! group of keys), read before the limit is taken.

use std::collections::HashMap;
use std::rc::Rc;

use sluice_shared::matcher::{CompiledLimit, CompiledPolicySet, RequestHeaders};
use sluice_shared::provider::{PauseSignal, PauseTable};
use sluice_shared::time::{Instant, Span};

use crate::host::{Host, Level};
use crate::metrics::{LimitStat, Metrics};
use crate::store::Store;

/// Where a limit's pauses live, and whose they are there: an unkeyed
/// limit has one entry (owner 0); a keyed one spreads its keys over
/// `max_keys` entries, each holding the pauses of the keys hashed to it.
fn pause_place(limit: &CompiledLimit, key: Option<u64>) -> (String, u64) {
    match (key, limit.keys) {
        (Some(hash), Some((max_keys, _))) => (
            format!(
                "sluice/p/{}/{}",
                limit.name,
                hash % u64::from(max_keys.max(1))
            ),
            hash,
        ),
        _ => (format!("sluice/p/{}", limit.name), 0),
    }
}

/// How long `limit` stays paused for a call with key `key` (None: it is
/// not paused). A missing or broken entry pauses nothing.
pub(super) fn paused<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    key: Option<u64>,
    now: Instant,
) -> Option<Span> {
    let provider = limit.provider.as_ref()?;
    let (entry, owner) = pause_place(limit, key);
    let (bytes, _) = host.shared_get(&entry);
    let table = PauseTable::decode(&bytes?)?;
    table
        .paused_until(owner, now, provider.max_pause)
        .map(|until| until.since(now))
}

/// One limit of an admitted call whose answer may pause it.
#[derive(Debug)]
struct Listener {
    limit: usize,
    key: Option<u64>,
}

/// A call whose answer is read: under which set and policy it went (a set
/// installed since does not change what its limits were).
#[derive(Debug)]
struct Call {
    set: Rc<CompiledPolicySet>,
    policy_index: usize,
    listeners: Vec<Listener>,
}

/// Admitted calls whose answers are read for the provider's word.
#[derive(Debug, Default)]
pub(super) struct Listening {
    calls: HashMap<u32, Call>,
}

impl Listening {
    /// A call of policy `policy_index` of `set` went: its limits with
    /// `provider` read its answer (`keys`: the call's key per further
    /// limit).
    pub fn expect(
        &mut self,
        context_id: u32,
        (set, policy_index): (&Rc<CompiledPolicySet>, usize),
        keys: &[Option<u64>],
    ) {
        let Some(policy) = set.policies.get(policy_index) else {
            return;
        };
        let listeners: Vec<Listener> = policy
            .limits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.provider.is_some())
            .map(|(i, _)| Listener {
                limit: i,
                key: keys.get(i).copied().flatten(),
            })
            .collect();
        if !listeners.is_empty() {
            self.calls.insert(
                context_id,
                Call {
                    set: Rc::clone(set),
                    policy_index,
                    listeners,
                },
            );
        }
    }

    pub fn awaits(&self, context_id: u32) -> bool {
        self.calls.contains_key(&context_id)
    }

    pub fn forget(&mut self, context_id: u32) {
        self.calls.remove(&context_id);
    }

    /// The answer's headers came: a refusal the limits listen to is
    /// counted, and one with a wait pauses them.
    pub fn on_headers<H, R>(
        &mut self,
        (host, store, metrics): (&H, &mut Store, &mut Metrics),
        context_id: u32,
        headers: &R,
        now: Instant,
    ) where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Some(call) = self.calls.remove(&context_id) else {
            return;
        };
        let Some(policy) = call.set.policies.get(call.policy_index) else {
            return;
        };
        let status = headers
            .header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok());
        for listener in call.listeners {
            let Some(limit) = policy.limits.get(listener.limit) else {
                continue;
            };
            let Some(provider) = &limit.provider else {
                continue;
            };
            match provider.pause_for(status, headers, now) {
                PauseSignal::None => {}
                PauseSignal::Refused => {
                    metrics.add_limit(&limit.name, LimitStat::ProviderRefused, 1);
                }
                PauseSignal::Malformed(e) => {
                    metrics.add_limit(&limit.name, LimitStat::ProviderRefused, 1);
                    metrics.add_limit(&limit.name, LimitStat::SignalMalformed, 1);
                    host.log(
                        Level::Debug,
                        &format!("sluice: limit {}: provider signal ignored: {e}", limit.name),
                    );
                }
                PauseSignal::Pause { wait, capped } => {
                    metrics.add_limit(&limit.name, LimitStat::ProviderRefused, 1);
                    if capped {
                        metrics.add_limit(&limit.name, LimitStat::PauseCapped, 1);
                    }
                    pause(
                        (host, store, metrics),
                        limit,
                        listener.key,
                        (status, wait, capped),
                        now,
                    );
                }
            }
        }
    }
}

/// Writes a pause of `wait` from `now` into the limit's entry, for every
/// worker to read, with a log line and a stat when it begins one.
fn pause<H: Host + ?Sized>(
    (host, store, metrics): (&H, &mut Store, &mut Metrics),
    limit: &CompiledLimit,
    key: Option<u64>,
    (status, wait, capped): (Option<u16>, Span, bool),
    now: Instant,
) {
    let (entry, owner) = pause_place(limit, key);
    let began = store.update(host, &entry, |bytes| {
        let mut table = bytes.and_then(PauseTable::decode).unwrap_or_default();
        let changed = table.pause(owner, now, wait);
        (changed, changed.then(|| table.encode()))
    });
    // A failed write is counted and logged by the store: no pause then.
    if !matches!(began, Ok(true)) {
        return;
    }
    metrics.add_limit(&limit.name, LimitStat::Paused, 1);
    let whose = if key.is_some() { " for this key" } else { "" };
    let cap = if capped { " (cut to max_pause)" } else { "" };
    // A warning: the provider is refusing calls, which an operator wants
    // to see at Envoy's usual log level.
    host.log(
        Level::Warn,
        &format!(
            "sluice: limit {} paused{whose} for {} ms{cap}: the provider answered {} with a wait",
            limit.name,
            wait.as_millis(),
            status.map_or_else(|| "?".to_string(), |s| s.to_string()),
        ),
    );
}
