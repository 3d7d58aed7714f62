//! Budgets (further limits of an hour or longer) held by the admin across
//! restarts. An Envoy that syncs with an admin reports what each budget
//! holds; after a restart its budgets refuse calls (`budget-unknown`) until
//! the admin's first answer gave back what they had spent, so a restart
//! never refills a daily limit. Without an admin they are plain limits.
//!
//! "Known" is per Envoy, in shared data (every VM of a restarted Envoy
//! starts unknown together); each VM caches the answer once it is yes,
//! as a budget never becomes unknown again in the same Envoy.

use std::collections::{BTreeMap, HashSet};

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicySet};
use sluice_shared::time::Instant;
use sluice_wire::sync::BudgetReport;
use sluice_wire::sync_answer::read_budgets;

use super::ctx::Ctx;
use crate::entries::{self, budget_known_key, limit_key, LimitState, Marker};
use crate::host::{Host, Level};
use crate::metrics::FilterCounter;

#[derive(Debug, Default)]
pub(super) struct Budgets {
    /// Whether this Envoy syncs with an admin (which then holds budgets).
    held_by_admin: bool,
    known: HashSet<String>,
}

impl Budgets {
    pub fn configure(&mut self, held_by_admin: bool) {
        self.held_by_admin = held_by_admin;
    }

    /// Whether `limit` may count calls: any limit that is no budget, and a
    /// budget once this Envoy knows what it spent before.
    pub fn is_known<H: Host + ?Sized>(&mut self, host: &H, limit: &CompiledLimit) -> bool {
        if !limit.budget || !self.held_by_admin || self.known.contains(&limit.name) {
            return true;
        }
        if entries::read_as::<Marker, _>(host, &budget_known_key(&limit.name)).0 {
            self.known.insert(limit.name.clone());
            return true;
        }
        false
    }

    /// Every budget of the set (once, by name) as this Envoy holds it now.
    pub fn report<H: Host + ?Sized>(
        &mut self,
        host: &H,
        policies: &CompiledPolicySet,
        now: Instant,
    ) -> BTreeMap<String, BudgetReport> {
        let mut out = BTreeMap::new();
        if !self.held_by_admin {
            return out;
        }
        for limit in budgets_of(policies) {
            if out.contains_key(&limit.name) {
                continue;
            }
            let known = self.is_known(host, limit);
            let state = entries::read(host, &limit_key(&limit.name), &LimitState(&limit.rate));
            let report = BudgetReport {
                known,
                available: limit.rate.available(&state, now),
                size: limit.rate.available(&limit.rate.initial_state(), now),
                at_ms: now.as_millis(),
            };
            out.insert(limit.name.clone(), report);
        }
        out
    }

    /// The admin answered (`header`: its budgets header, if any): each
    /// budget not yet known takes what the admin held for it, if anything,
    /// and is known from now on. A header that is not one is counted and
    /// leaves the budgets unknown (they keep refusing) until an answer
    /// that is.
    pub fn on_answer<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &CompiledPolicySet,
        header: Option<&[u8]>,
    ) {
        let (host, store, metrics, now) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics, ctx.now);
        if !self.held_by_admin {
            return;
        }
        let held = match header.map(read_budgets).transpose() {
            Ok(held) => held.unwrap_or_default(),
            Err(why) => {
                metrics.add_filter(FilterCounter::BudgetsMalformed, 1);
                host.log(
                    Level::Warn,
                    &format!(
                        "sluice: ignored the admin's budgets header ({why}); budgets stay unknown"
                    ),
                );
                return;
            }
        };
        let mut done = HashSet::new();
        for limit in budgets_of(policies) {
            if !done.insert(limit.name.as_str()) || self.is_known(host, limit) {
                continue;
            }
            if let Some(record) = held.get(&limit.name) {
                let spent = record.spent();
                let at = Instant::from_millis(record.at_ms);
                let restored = store.update_with(
                    host,
                    &limit_key(&limit.name),
                    &LimitState(&limit.rate),
                    |state| {
                        limit.rate.restore_spent(state, spent, at, now);
                        ((), true)
                    },
                );
                if restored.is_err() {
                    // Counted and logged by the store; asked again next sync.
                    continue;
                }
                host.log(
                    Level::Info,
                    &format!(
                        "sluice: budget {} resumes from the admin's record: {spent} of {} spent by {} ms",
                        limit.name, record.size, record.at_ms
                    ),
                );
            }
            if store
                .update_as::<Marker, _, _>(host, &budget_known_key(&limit.name), |known| {
                    known.0 = true;
                    ((), true)
                })
                .is_ok()
            {
                self.known.insert(limit.name.clone());
            }
        }
    }
}

fn budgets_of(policies: &CompiledPolicySet) -> impl Iterator<Item = &CompiledLimit> {
    policies
        .policies
        .iter()
        .flat_map(|p| p.limits.iter())
        .filter(|l| l.budget)
}
