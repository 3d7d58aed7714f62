//! Budgets (further limits of an hour or longer) held by the admin across
//! restarts. An Envoy that syncs with an admin reports what each budget
//! holds; after a restart its budgets refuse calls (`budget-unknown`) until
//! the admin's first answer gave back what they had spent, so a restart
//! never refills a daily limit. Without an admin they are plain limits.
//!
//! A keyed budget (per team, per user) is held per key, with a sync token
//! only: the token's label secret hashes its keys alike after a restart
//! (see `worker/spend.rs`, which also reports the keys whose spend
//! changed). It is given back in parts of at most
//! [`sluice_wire::sync::MAX_KEYS_ANSWERED`] keys, one per sync, the Envoy
//! naming the last key it took ([`entries::budget_cursor_key`]); it stays
//! unknown until the last part. A key is given back to its own place (or a
//! free or idle one, as a call would take), and only what its place does
//! not hold yet, so a part given twice charges nothing twice.
//!
//! "Known" is per Envoy, in shared data (every VM of a restarted Envoy
//! starts unknown together); each VM caches the answer once it is yes,
//! as a budget never becomes unknown again in the same Envoy.

use std::collections::{BTreeMap, HashSet};

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicySet};
use sluice_shared::limiter::Standing;
use sluice_shared::time::Instant;
use sluice_wire::sync::{BudgetReport, BudgetsMessage, HeldBudget};

use super::ctx::Ctx;
use super::key_places;
use crate::entries::{
    self, budget_cursor_key, budget_known_key, state_key, Json, LimitOf, LimitState, Marker, Place,
};
use crate::host::{Host, Level};
use crate::metrics::FilterCounter;

#[derive(Debug, Default)]
pub(super) struct Budgets {
    /// Whether this Envoy syncs with an admin (which then holds budgets).
    held_by_admin: bool,
    /// Whether it syncs with a token (keyed budgets are then held too).
    keys_held: bool,
    known: HashSet<String>,
}

impl Budgets {
    pub fn configure(&mut self, held_by_admin: bool, keys_held: bool) {
        self.held_by_admin = held_by_admin;
        self.keys_held = held_by_admin && keys_held;
    }

    /// Whether the admin holds what `limit` spent.
    fn holds(&self, limit: &CompiledLimit) -> bool {
        self.held_by_admin && (limit.budget || (limit.keyed_budget && self.keys_held))
    }

    /// Whether `limit` may count calls: any limit that is no budget, and a
    /// budget once this Envoy knows what it spent before.
    pub fn is_known<H: Host + ?Sized>(&mut self, host: &H, limit: &CompiledLimit) -> bool {
        if !self.holds(limit) || self.known.contains(&limit.name) {
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
            if out.contains_key(&limit.name) || !self.holds(limit) {
                continue;
            }
            let known = self.is_known(host, limit);
            let size = limit.rate.available(&limit.rate.initial_state(), now);
            let report = if limit.keyed_budget {
                // Its keys' spend goes in `budget_keys`.
                BudgetReport {
                    known,
                    available: size,
                    size,
                    at_ms: now.as_millis(),
                    resume_after: if known { None } else { cursor(host, limit) },
                }
            } else {
                let state = entries::read(
                    host,
                    &state_key(LimitOf::Named(&limit.name), Place::Single),
                    &LimitState(&limit.rate),
                );
                BudgetReport {
                    known,
                    available: limit.rate.available(&state, now),
                    size,
                    at_ms: now.as_millis(),
                    resume_after: None,
                }
            };
            out.insert(limit.name.clone(), report);
        }
        out
    }

    /// The admin answered (`header`: its budgets header, if any): each
    /// budget not yet known takes what the admin held for it, if anything,
    /// and is known from now on (a keyed one once its last part is in). A
    /// header that is not one is counted and leaves the budgets unknown
    /// (they keep refusing) until an answer that is. True when more parts
    /// are to come: the next sync should not wait its interval.
    pub fn on_answer<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &CompiledPolicySet,
        held: Option<Result<BudgetsMessage, String>>,
    ) -> bool {
        if !self.held_by_admin {
            return false;
        }
        let held = match held.transpose() {
            Ok(held) => held.unwrap_or_default(),
            Err(why) => {
                ctx.metrics.add_filter(FilterCounter::BudgetsMalformed, 1);
                ctx.host.log(
                    Level::Warn,
                    &format!(
                        "sluice: ignored the admin's budgets header ({why}); budgets stay unknown"
                    ),
                );
                return false;
            }
        };
        let mut more = false;
        let mut done = HashSet::new();
        for limit in budgets_of(policies) {
            if !done.insert(limit.name.as_str()) || self.is_known(ctx.host, limit) {
                continue;
            }
            // A failure (counted and logged by the store) is asked again
            // next sync; with more parts to come a keyed budget stays
            // unknown until the last.
            let open = match held.get(&limit.name) {
                Some(record) if limit.keyed_budget => {
                    restore_keys(ctx, limit, record).is_ok() && !record.more
                }
                Some(record) => restore_spent(ctx, limit, record).is_ok(),
                None => true,
            };
            if !open {
                more |= limit.keyed_budget;
                continue;
            }
            let (host, store) = (ctx.host, &mut *ctx.store);
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
        more
    }
}

fn budgets_of(policies: &CompiledPolicySet) -> impl Iterator<Item = &CompiledLimit> {
    policies
        .policies
        .iter()
        .flat_map(|p| p.limits.iter())
        .filter(|l| l.budget || l.keyed_budget)
}

/// Gives an unkeyed budget back what it spent by the record's time.
fn restore_spent<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    record: &HeldBudget,
) -> Result<(), crate::store::StoreError> {
    let (host, now) = (ctx.host, ctx.now);
    let spent = record.spent();
    let at = Instant::from_millis(record.at_ms);
    ctx.store.update_with(
        host,
        &state_key(LimitOf::Named(&limit.name), Place::Single),
        &LimitState(&limit.rate),
        |state| {
            limit.rate.restore_spent(state, spent, at, now);
            ((), true)
        },
    )?;
    host.log(
        Level::Info,
        &format!(
            "sluice: budget {} resumes from the admin's record: {spent} of {} spent by {} ms",
            limit.name, record.size, record.at_ms
        ),
    );
    Ok(())
}

/// The last key of `limit` the admin gave back, when it gives it in parts.
fn cursor<H: Host + ?Sized>(host: &H, limit: &CompiledLimit) -> Option<i64> {
    entries::read(
        host,
        &budget_cursor_key(&limit.name),
        &Json::<Option<i64>>::default(),
    )
}

/// Gives each key of `record` back what it spent, to its own place (or one
/// it claims as a call would), charging only what the place does not hold
/// yet; with more parts to come, notes the last key taken. Err: shared
/// data failed (counted by the store); the part is asked for again.
fn restore_keys<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    record: &HeldBudget,
) -> Result<(), crate::store::StoreError> {
    let rate = &limit.rate;
    let now = ctx.now;
    let mut placeless = 0u64;
    for key in &record.keys {
        let at = Instant::from_millis(key.at_ms);
        let placed = key_places::on_limit_place(ctx, limit, key.owner, |state| {
            let holds = Standing::of(rate, state, now).spent;
            if key.spent <= holds {
                return ((), false);
            }
            rate.restore_spent(state, key.spent - holds, at, now);
            ((), true)
        })?;
        if placed.is_none() {
            placeless += 1;
        }
    }
    if placeless > 0 {
        ctx.host.log(
            Level::Warn,
            &format!(
                "sluice: budget {}: {placeless} keys the admin gave back found no place (every place they may use holds a key in use); they start afresh",
                limit.name
            ),
        );
    }
    let last = record.keys.last().map(|k| k.cursor());
    let next = if record.more { last } else { None };
    ctx.store.update_with(
        ctx.host,
        &budget_cursor_key(&limit.name),
        &Json::<Option<i64>>::default(),
        |cursor| {
            let changed = *cursor != next;
            *cursor = next;
            ((), changed)
        },
    )?;
    ctx.host.log(
        Level::Info,
        &format!(
            "sluice: budget {} resumes {} keys from the admin's record{}",
            limit.name,
            record.keys.len(),
            if record.more { ", more to come" } else { "" }
        ),
    );
    Ok(())
}
