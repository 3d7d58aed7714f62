//! Fleet mode in a worker: the shares of global policies this Envoy holds
//! (published in shared data by whichever VM's sync brought them), and the
//! limits each global policy applies for its share now: the newest share
//! while its lease runs, then its fallback.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_shared::fleet::{lapsed_asleep, share_in_force, Amount, Share};
use sluice_shared::policy::Scope;
use sluice_shared::time::Instant;
use sluice_wire::sync::SharesMessage;

use super::ctx::Ctx;
use crate::host::{Host, Level};
use crate::metrics::FilterCounter;
use crate::sync::fleet::{self, HeldShare, HeldShares};

/// Whether a share of the answer just taken shrank by more than a wobble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shrank(pub bool);

/// A share cut below this part of the one it replaces is told to the
/// admin at once (a sync now, not at the interval): until then it keeps the
/// old one reserved, and an Envoy whose load grew cannot have that room.
const SHRINK_TO_TELL: f64 = 0.9;

#[derive(Debug, Default)]
pub(super) struct FleetShares {
    /// The sequence of the published shares this worker last took up.
    seq: u64,
    held: HeldShares,
    /// The share each global policy applies now.
    applied: BTreeMap<String, Amount>,
    /// When this worker last applied its shares (each tick while it runs).
    last_applied: Option<Instant>,
    /// Shares (by name, the end of their lease) that lapsed while this
    /// worker was stalled: they give nothing until a later sync brings
    /// another ([`lapsed_asleep`]).
    lapsed_asleep: BTreeMap<String, Instant>,
}

impl FleetShares {
    /// A new policy set: every global policy applies its share afresh.
    pub fn forget_applied(&mut self) {
        self.applied.clear();
    }

    /// The share each global policy (by its name) and global further
    /// limit (as `policy/limit`) enforces, as of the last time they were
    /// applied.
    pub fn applied(&self) -> &BTreeMap<String, Amount> {
        &self.applied
    }

    /// Takes up shares another VM's sync published.
    pub fn pick_up<H: Host + ?Sized>(&mut self, host: &H) {
        if fleet::published_seq(host) == self.seq {
            return;
        }
        let (seq, held) = fleet::published(host);
        self.seq = seq;
        self.held = held;
    }

    /// The shares header of an answer to a call sent at `sent_at`: published
    /// for every worker. None when it changed nothing (it did not parse, or
    /// could not be stored: the shares held stay); otherwise whether a share
    /// shrank, which the admin keeps reserved at its old size until this
    /// Envoy says, at its next sync, that it holds the new one.
    pub fn take<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        message: Result<SharesMessage, String>,
        sent_at: Instant,
    ) -> Option<Shrank> {
        let (host, store, metrics) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics);
        let Some(shares) = message.ok().and_then(|m| fleet::held_shares(m, sent_at)) else {
            metrics.add_filter(FilterCounter::SyncFailures, 1);
            host.log(
                Level::Warn,
                "sluice: the admin's shares header does not parse; keeping the shares held",
            );
            return None;
        };
        self.pick_up(host);
        if shares.values().any(|s| s.expires_at <= ctx.now) {
            // Its shares ended before it was taken: it waited out a stall
            // of this process (Envoy gives up on a call long before a lease
            // ends otherwise), and the admin, which heard nothing from this
            // Envoy meanwhile, may have given their room away. As a share
            // that lapsed during a stall (`lapsed_asleep`), they give
            // nothing: the shares held stay, until a later sync brings
            // others (the simulator's `a_paused_envoy_never_costs_the_limit`,
            // seed 801: their fallback, taken 20 ms after the stall, had
            // the fleet enforce 435 of 290).
            return Some(Shrank(false));
        }
        let shrank = shares.iter().any(|(name, new)| {
            self.held.get(name).is_some_and(|old| {
                new.amount.rate < old.amount.rate * SHRINK_TO_TELL
                    || new.amount.in_flight < old.amount.in_flight
            })
        });
        // On failure the store counted and logged why.
        fleet::publish(host, store, &shares)
            .is_ok()
            .then_some(Shrank(shrank))
    }

    /// The share `name` enforces at `now` of `limit`, given the newest held
    /// and when this worker last ran: the share while its lease runs, then
    /// its fallback, or nothing if it lapsed while the worker was stalled.
    fn in_force(
        &mut self,
        name: &str,
        newest: Option<Share>,
        limit: Amount,
        last_ran: Option<Instant>,
        now: Instant,
    ) -> Amount {
        if let Some(share) = newest {
            if last_ran.is_some_and(|last| lapsed_asleep(&share, last, now)) {
                self.lapsed_asleep
                    .insert(name.to_string(), share.expires_at);
            }
            match self.lapsed_asleep.get(name) {
                Some(end) if *end == share.expires_at => return Amount::default(),
                Some(_) => {
                    self.lapsed_asleep.remove(name);
                }
                None => {}
            }
        }
        share_in_force(newest, limit, now)
    }

    /// Gives each global policy of `policies`, and each global further
    /// limit, the limits of its share in force at `now`; the set is copied
    /// only when a share changed.
    pub fn apply<H: Host + ?Sized>(
        &mut self,
        host: &H,
        policies: &mut Arc<CompiledPolicySet>,
        now: Instant,
    ) {
        let last_ran = self.last_applied.replace(now);
        let mut changes = Vec::new();
        // Numbered as the set numbers them: a pool member's policy holds
        // copies of its pool's further limits, which take their shares too.
        for (i, p) in policies.all().enumerate() {
            if p.is_global() && p.member_of.is_none() {
                let newest = self.held.get(p.name()).map(HeldShare::as_share);
                let share = self.in_force(
                    p.name(),
                    newest,
                    Amount::of_policy(&p.policy),
                    last_ran,
                    now,
                );
                if self.applied.get(p.name()) != Some(&share) {
                    changes.push((i, None, p.name().to_string(), share));
                }
            }
            for (at, (spec, _)) in p.rate_limit_specs().enumerate() {
                if spec.scope != Scope::Global {
                    continue;
                }
                let name = spec.fleet_name();
                let newest = self.held.get(&name).map(HeldShare::as_share);
                let share = self.in_force(&name, newest, Amount::of_limit(spec), last_ran, now);
                // Per policy: a limit two policies name is applied in both
                // (and in each member of a pool).
                let applied_as = match p.member_of {
                    Some((_, member)) => format!("{}@{member}/{name}", p.name()),
                    None => format!("{}/{name}", p.name()),
                };
                if self.applied.get(&applied_as) != Some(&share) {
                    changes.push((i, Some(at), applied_as, share));
                }
            }
        }
        if changes.is_empty() {
            return;
        }
        let policies = Arc::make_mut(policies);
        for (i, limit, applied_as, share) in changes {
            let Some(p) = policies.policy_mut(i) else {
                continue;
            };
            match limit {
                None => {
                    p.apply_share(share);
                    host.log(
                        Level::Debug,
                        &format!(
                            "sluice: global policy {} now allows {:.1}/s, {} in flight{}",
                            p.name(),
                            share.rate,
                            share.in_flight,
                            if p.fleet_closed { " (closed)" } else { "" }
                        ),
                    );
                }
                Some(at) => {
                    p.apply_limit_share(at, share);
                    host.log(
                        Level::Debug,
                        &format!(
                            "sluice: global limit {applied_as} now allows {:.1}/s",
                            share.rate
                        ),
                    );
                }
            }
            self.applied.insert(applied_as, share);
        }
    }
}
