//! The fleet's network: every call an Envoy's worker dispatches to the
//! admin (a sync report, a held watch), carried there and back with a
//! drawn latency, lost by chance, refused while the admin is down, given
//! up on by Envoy at the call's timeout; and what the Envoys held of each
//! global limit, checked at every answer they take.

use std::collections::BTreeMap;

use sluice_shared::fleet::Amount;
use sluice_shared::time::{Instant, Span};
use sluice_wire::sync::{SharesMessage, SYNC_PATH, WATCH_PATH};
use sluice_wire::sync_answer::HttpAnswer;

use crate::admin::SimAdmin;
use crate::host::HttpCall;
use crate::rng::SimRng;

/// Envoys syncing with one admin.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub envoys: usize,
    /// The Envoys' sync interval.
    pub interval: Span,
    /// Each way between an Envoy and the admin, drawn evenly.
    pub latency: (Span, Span),
    /// The chance each message (a report, an answer) is lost.
    pub loss: f64,
    /// Envoys hold a watch, through which the admin tells them at once
    /// that fleet room was freed.
    pub push: bool,
}

/// Where a message to an Envoy goes: a worker of one life of an Envoy (a
/// restarted Envoy's new life never takes an answer meant for the old).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Worker {
    pub envoy: usize,
    pub life: u64,
    pub worker: usize,
}

#[derive(Debug)]
pub enum Message {
    /// A call on its way to the admin.
    ToAdmin {
        from: Worker,
        call: HttpCall,
        sent: Instant,
    },
    /// The answer to call `token` reaching its Envoy, or (None) Envoy
    /// giving up on the call.
    ToEnvoy {
        to: Worker,
        token: u32,
        answer: Option<HttpAnswer>,
        /// The shares the answer carries, and when their call went.
        shares: Option<(SharesMessage, Instant)>,
    },
    /// The kernel closed a dead Envoy's connections: the close reaching
    /// the admin (after a latency of its own, so a report in flight on
    /// another connection can arrive after it).
    Closed { instance: String },
}

/// A watch the admin holds.
struct Held {
    from: Worker,
    token: u32,
    gives_up: Instant,
    /// When the admin's hold ends.
    ends: Instant,
}

/// What the fleet did, for properties.
#[derive(Debug, Clone, Default)]
pub struct FleetOutcome {
    /// Each global limit, by the name its shares carry.
    pub limits: BTreeMap<String, Amount>,
    /// The most the live Envoys held of each at once (shares not yet
    /// expired, each Envoy's latest).
    pub most_held: BTreeMap<String, Amount>,
    pub syncs: u64,
    pub lost: u64,
    pub refused_while_down: u64,
    /// Every share an Envoy took: when, which Envoy, of what, how much.
    pub taken: Vec<(Instant, usize, String, Amount)>,
    /// Syncs the admin turned away unread ([`Network::turn_away`]).
    pub turned_away: u64,
    /// The most the running Envoys enforced of each global policy at
    /// once (their shares, or the fallbacks of lapsed ones), as their
    /// workers applied them, and when.
    pub most_in_force: BTreeMap<String, (Amount, Instant)>,
}

pub struct Network {
    pub fleet: Fleet,
    pub admin: SimAdmin,
    pub admin_up: bool,
    held: Vec<Held>,
    /// Per Envoy, the share of each limit it holds: (amount, valid until,
    /// id).
    shares: Vec<BTreeMap<String, (Amount, Instant, u64)>>,
    pub outcome: FleetOutcome,
    /// The limits whose ledger was recovering after the last sync.
    recovering: Vec<String>,
    /// Envoys whose syncs the admin turns away, from, until.
    turned_away: Vec<(usize, Instant, Instant)>,
}

/// What carrying a message asks of the world: messages to deliver later,
/// and lines for the trace.
#[derive(Default)]
pub struct Carried {
    pub later: Vec<(Instant, Message)>,
    pub notes: Vec<String>,
    /// When a hold the admin took ends ([`Network::end_holds`]).
    pub hold_ends: Option<Instant>,
}

impl Network {
    pub fn new(fleet: Fleet, admin: SimAdmin) -> Self {
        let outcome = FleetOutcome {
            limits: admin.global_limits(),
            ..FleetOutcome::default()
        };
        Self {
            shares: vec![BTreeMap::new(); fleet.envoys],
            fleet,
            admin,
            admin_up: true,
            held: Vec::new(),
            outcome,
            recovering: Vec::new(),
            turned_away: Vec::new(),
        }
    }

    /// The admin turns Envoy `envoy`'s syncs away unread from `from`
    /// until `until`: a 503 telling it to come back in a second, as one
    /// past its capacity sheds them.
    pub fn turn_away(&mut self, envoy: usize, from: Instant, until: Instant) {
        self.turned_away.push((envoy, from, until));
    }

    /// What the running Envoys enforce of each global policy at `now`.
    pub fn in_force(&mut self, now: Instant, in_force: &BTreeMap<String, Amount>) {
        for (name, amount) in in_force {
            let most = self
                .outcome
                .most_in_force
                .entry(name.clone())
                .or_insert((Amount::default(), now));
            if amount.rate > most.0.rate || amount.in_flight > most.0.in_flight {
                *most = (most.0.max(*amount), now);
            }
        }
    }

    fn latency(&self, rng: &mut SimRng) -> Span {
        let (low, high) = self.fleet.latency;
        Span::from_nanos(rng.between(low.as_nanos(), high.as_nanos()))
    }

    /// Worker `from` dispatched `call` at `now`.
    pub fn dispatch(
        &mut self,
        from: Worker,
        call: HttpCall,
        now: Instant,
        rng: &mut SimRng,
    ) -> Carried {
        let mut carried = Carried::default();
        let gives_up = now + call.timeout;
        if rng.chance(self.fleet.loss) {
            self.outcome.lost += 1;
            carried.later.push((gives_up, give_up(from, call.token)));
            return carried;
        }
        let at = now + self.latency(rng);
        carried.later.push((
            at,
            Message::ToAdmin {
                from,
                call,
                sent: now,
            },
        ));
        carried
    }

    /// A call reached the admin at `now`.
    pub fn at_admin(
        &mut self,
        (from, call, sent): (Worker, HttpCall, Instant),
        now: Instant,
        rng: &mut SimRng,
    ) -> Carried {
        let mut carried = Carried::default();
        let gives_up = sent + call.timeout;
        if !self.admin_up {
            // Connection refused: Envoy learns at once.
            self.outcome.refused_while_down += 1;
            carried.later.push((now, give_up(from, call.token)));
            return carried;
        }
        if call.path == WATCH_PATH {
            match self.admin.watch(&call.body) {
                Some(answer) => self.answer(
                    &mut carried,
                    (from, call.token, gives_up),
                    (answer, None),
                    now,
                    rng,
                ),
                None => {
                    // A newer watch of the same Envoy replaces the one held.
                    if let Some(old) = self.held.iter().position(|h| h.from.envoy == from.envoy) {
                        let old = self.held.remove(old);
                        self.end_watch(&mut carried, old, false, (now, rng));
                    }
                    let ends = now + sluice_filter::sync::watch::HOLD;
                    self.held.push(Held {
                        from,
                        token: call.token,
                        gives_up,
                        ends,
                    });
                    carried.hold_ends = Some(ends);
                }
            }
            return carried;
        }
        if call.path != SYNC_PATH {
            carried.later.push((now, give_up(from, call.token)));
            return carried;
        }
        if self
            .turned_away
            .iter()
            .any(|(envoy, start, until)| *envoy == from.envoy && (*start..*until).contains(&now))
        {
            self.outcome.turned_away += 1;
            self.admin.turned_away(now);
            let busy = HttpAnswer {
                status: 503,
                headers: vec![("retry-after", "1".to_string())],
                body: Vec::new(),
            };
            self.answer(
                &mut carried,
                (from, call.token, gives_up),
                (busy, None),
                now,
                rng,
            );
            return carried;
        }
        self.outcome.syncs += 1;
        let answered = self.admin.answer(&call.body, now);
        if let Some(error) = &answered.error {
            carried
                .notes
                .push(format!("admin, e{}'s sync: {error}", from.envoy));
        }
        let recovering = self.admin.recovering(now);
        if recovering != self.recovering {
            carried.notes.push(format!(
                "admin, after e{}'s sync: recovering {recovering:?} (nobody's share grows)",
                from.envoy
            ));
            self.recovering = recovering;
        }
        if answered.freed {
            // Every held watch is told to sync now.
            for held in std::mem::take(&mut self.held) {
                self.end_watch(&mut carried, held, true, (now, rng));
            }
        }
        let shares = Some((answered.shares, sent));
        self.answer(
            &mut carried,
            (from, call.token, gives_up),
            (answered.http, shares),
            now,
            rng,
        );
        carried
    }

    /// The admin's answer on its way back: lost, too late (Envoy gave up
    /// first), or taken.
    fn answer(
        &mut self,
        carried: &mut Carried,
        (to, token, gives_up): (Worker, u32, Instant),
        (answer, shares): (HttpAnswer, Option<(SharesMessage, Instant)>),
        now: Instant,
        rng: &mut SimRng,
    ) {
        let at = now + self.latency(rng);
        if rng.chance(self.fleet.loss) || at > gives_up {
            self.outcome.lost += 1;
            carried.later.push((gives_up.max(now), give_up(to, token)));
            return;
        }
        carried.later.push((
            at,
            Message::ToEnvoy {
                to,
                token,
                answer: Some(answer),
                shares,
            },
        ));
    }

    /// The watches held whose hold ended by `now` are answered.
    pub fn end_holds(&mut self, now: Instant, rng: &mut SimRng) -> Carried {
        let mut carried = Carried::default();
        let (due, kept): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.ends <= now);
        self.held = kept;
        for held in due {
            self.end_watch(&mut carried, held, false, (now, rng));
        }
        carried
    }

    /// The admin answers a watch it held: sync now, or nothing new.
    fn end_watch(
        &mut self,
        carried: &mut Carried,
        held: Held,
        sync_now: bool,
        (now, rng): (Instant, &mut SimRng),
    ) {
        let end = self.admin.watch_end(sync_now);
        self.answer(
            carried,
            (held.from, held.token, held.gives_up),
            (end, None),
            now,
            rng,
        );
    }

    /// The admin goes down (its held watches' connections reset) or up.
    pub fn set_admin_up(&mut self, up: bool, now: Instant) -> Carried {
        self.admin_up = up;
        let mut carried = Carried::default();
        if !up {
            for held in std::mem::take(&mut self.held) {
                carried.later.push((now, give_up(held.from, held.token)));
            }
        }
        carried
            .notes
            .push(format!("admin {}", if up { "back" } else { "down" }));
        carried
    }

    /// The admin's ledger store (Redis) goes down, or comes back empty.
    pub fn set_ledgers_up(&mut self, up: bool) -> Carried {
        self.admin.set_ledgers_up(up);
        let mut carried = Carried::default();
        carried.notes.push(format!(
            "the admin's ledgers {}",
            if up { "back, empty" } else { "down" }
        ));
        carried
    }

    /// Envoy `envoy` died: it holds nothing any more, and the close of its
    /// connections travels to the admin.
    pub fn envoy_died(
        &mut self,
        envoy: usize,
        instance: &str,
        now: Instant,
        rng: &mut SimRng,
    ) -> Carried {
        self.held.retain(|h| h.from.envoy != envoy);
        self.shares[envoy].clear();
        let mut carried = Carried::default();
        let closed = Message::Closed {
            instance: instance.to_string(),
        };
        carried.later.push((now + self.latency(rng), closed));
        carried
    }

    /// A dead Envoy's close reached the admin: if up, it notes the
    /// departure.
    pub fn closed(&mut self, instance: &str, now: Instant) {
        if self.admin_up {
            self.admin.departed(instance, now);
        }
    }

    /// Envoy `to` took `shares` (its call went at `sent`): what the live
    /// Envoys hold now is checked against each limit. Returns a line for
    /// the trace when a share moved.
    pub fn took(
        &mut self,
        to: Worker,
        (shares, sent): (SharesMessage, Instant),
        now: Instant,
    ) -> Vec<String> {
        let mut notes = Vec::new();
        for (name, share) in shares {
            let amount = Amount {
                rate: share.rate,
                in_flight: share.in_flight,
            };
            let until = sent + Span::from_millis(share.lease_ms);
            // As the Envoy keeps it: an answer older than the share it
            // holds (by id) does not replace it.
            let held = self.shares[to.envoy].get(&name).copied();
            if held.is_some_and(|(_, _, id)| id > share.id) {
                continue;
            }
            self.outcome
                .taken
                .push((now, to.envoy, name.clone(), amount));
            let before = self.shares[to.envoy].insert(name.clone(), (amount, until, share.id));
            let moved = before.is_none_or(|(b, _, _)| {
                (b.rate - amount.rate).abs() >= 0.5 || b.in_flight != amount.in_flight
            });
            if moved {
                notes.push(format!(
                    "e{} share of {name}: {:.1}/s {} in flight",
                    to.envoy, amount.rate, amount.in_flight
                ));
            }
        }
        for name in self.outcome.limits.keys() {
            let mut held = Amount::default();
            for envoy in &self.shares {
                if let Some((amount, until, _)) = envoy.get(name) {
                    if *until > now {
                        held.rate += amount.rate;
                        held.in_flight += amount.in_flight;
                    }
                }
            }
            let most = self.outcome.most_held.entry(name.clone()).or_default();
            most.rate = most.rate.max(held.rate);
            most.in_flight = most.in_flight.max(held.in_flight);
        }
        notes
    }
}

impl Message {
    /// For a call on its way to an admin that stalls until `until`: its
    /// Envoy giving up on it, when the call's timeout comes first. The
    /// call itself still waits in the admin's socket and is answered
    /// when the admin goes on (too late: that answer is lost).
    pub fn given_up_before(&self, until: Instant) -> Option<(Instant, Message)> {
        match self {
            Message::ToAdmin { from, call, sent } => {
                let gives_up = *sent + call.timeout;
                (gives_up < until).then(|| (gives_up, give_up(*from, call.token)))
            }
            _ => None,
        }
    }
}

fn give_up(to: Worker, token: u32) -> Message {
    Message::ToEnvoy {
        to,
        token,
        answer: None,
        shares: None,
    }
}
