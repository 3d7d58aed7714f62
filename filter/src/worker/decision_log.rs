//! What Envoy's access log and traces may say of Sluice's decision on a
//! call: the fields, their values, and when they are handed to Envoy.
//!
//! A decision is noted where it is made (at once, at a queue's turn or
//! timeout, as an answer settles what a call cost) and written to the
//! stream only while it is the stream's own hook that runs, or by a tick's
//! [`super::StreamAction::LogField`] just before the action that lets the stream
//! go or answers it: a wasm host call made for another stream in the
//! middle of a tick would redirect what the tick does next (the effective
//! context), and a native stream's state may be touched only on its own
//! thread.
//!
//! The wasm build writes filter state `wasm.sluice.<field>`, the native
//! build dynamic metadata `sluice` / `<field>` (see the book's
//! "Decisions in Envoy's access log").

use std::borrow::Cow;

use sluice_filter_core::headers::SLUICE_POLICY;
use sluice_shared::time::Span;

use super::to_shell::{LocalReply, StreamAction, LIMIT_HEADER, REASON_HEADER};
use crate::host::Host;

/// One field of a call's decision, as the access log names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// The policy that matched (a pool call: the pool's).
    Policy,
    /// [`Outcome`]'s word.
    Verdict,
    /// The limit that refused it (`x-sluice-limit`).
    Limit,
    /// Why it was refused, when the limit alone does not say
    /// (`x-sluice-reason`).
    Reason,
    /// How long it waited in the queue, in milliseconds.
    WaitMs,
    /// What it took from its policy's further limits as it went:
    /// `limit=cost`, comma-separated, in each limit's unit.
    Cost,
    /// What the answer said it really cost, as `cost` (limits that read
    /// usage only).
    Charged,
    /// The pool member it was sent to.
    Member,
}

impl Field {
    /// Every field, in the order the book lists them.
    pub const ALL: [Field; 8] = [
        Field::Policy,
        Field::Verdict,
        Field::Limit,
        Field::Reason,
        Field::WaitMs,
        Field::Cost,
        Field::Charged,
        Field::Member,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Field::Policy => "policy",
            Field::Verdict => "verdict",
            Field::Limit => "limit",
            Field::Reason => "reason",
            Field::WaitMs => "wait_ms",
            Field::Cost => "cost",
            Field::Charged => "charged",
            Field::Member => "member",
        }
    }
}

/// What became of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Went at once.
    Admitted,
    /// Answered by Sluice, never sent.
    Refused,
    /// Waited in the queue (and went, unless a later `refused` says not).
    Queued,
    /// A pool's `route` rung sent it to another member than its first.
    Routed,
    /// Sent for a cheaper model than it named.
    Downgraded,
}

impl Outcome {
    pub const fn word(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Refused => "refused",
            Outcome::Queued => "queued",
            Outcome::Routed => "routed",
            Outcome::Downgraded => "downgraded",
        }
    }
}

/// Decisions noted and not yet handed to Envoy.
#[derive(Debug, Default)]
pub struct DecisionLog {
    /// The plugin's `log_decisions`: off, nothing is noted.
    on: bool,
    /// Most values are words of this module's: borrowed, not allocated.
    pending: Vec<(u32, Field, Cow<'static, str>)>,
}

impl DecisionLog {
    pub fn set_on(&mut self, on: bool) {
        self.on = on;
        if !on {
            self.pending.clear();
        }
    }

    /// Whether decisions are noted: a value dear to build is built only then.
    pub fn is_on(&self) -> bool {
        self.on
    }

    pub fn note(&mut self, context_id: u32, field: Field, value: impl Into<Cow<'static, str>>) {
        if self.on {
            self.pending.push((context_id, field, value.into()));
        }
    }

    pub fn verdict(&mut self, context_id: u32, verdict: Outcome) {
        self.note(context_id, Field::Verdict, verdict.word());
    }

    /// A call Sluice answered itself: what its answer says of why.
    pub fn refused(&mut self, context_id: u32, reply: &LocalReply) {
        self.verdict(context_id, Outcome::Refused);
        for (field, header) in [
            (Field::Policy, SLUICE_POLICY),
            (Field::Limit, LIMIT_HEADER),
            (Field::Reason, REASON_HEADER),
        ] {
            if let Some(value) = reply.header(header) {
                self.note(context_id, field, value.to_owned());
            }
        }
    }

    /// Hands every noted field to Envoy now: a stream's own hook runs.
    pub fn write<H: Host + ?Sized>(&mut self, host: &H) {
        for (context_id, field, value) in self.pending.drain(..) {
            host.set_log_field(context_id, field.name(), &value);
        }
    }

    /// A call of `policy` decided at once: admitted or queued (None: a
    /// refusal, noted from its answer by the worker).
    pub fn decided(&mut self, context_id: u32, policy: &str, outcome: Option<Outcome>) {
        if let Some(outcome) = outcome.filter(|_| self.on) {
            self.note(context_id, Field::Policy, policy.to_owned());
            self.verdict(context_id, outcome);
        }
    }

    /// A tick's `actions`, with its refusals noted and every note of the
    /// tick set ahead of them: a stream's fields before it goes or is
    /// answered.
    pub fn ahead_of(&mut self, actions: Vec<StreamAction>) -> Vec<StreamAction> {
        for action in &actions {
            if let StreamAction::Reply(context_id, reply) = action {
                self.refused(*context_id, reply);
            }
        }
        if self.pending.is_empty() {
            return actions;
        }
        let mut all: Vec<StreamAction> = self
            .pending
            .drain(..)
            .map(|(id, field, value)| StreamAction::LogField(id, field.name(), value.into_owned()))
            .collect();
        all.extend(actions);
        all
    }

    /// How long a queued call waited, noted as it leaves the queue.
    pub fn waited(&mut self, context_id: u32, waited: Span) {
        if self.on {
            self.note(context_id, Field::WaitMs, waited.as_millis().to_string());
        }
    }
}

/// `name=value` pairs, comma-separated: a call's cost in each limit.
pub fn per_limit<'a>(pairs: impl Iterator<Item = (&'a str, u64)>) -> String {
    let mut out = String::new();
    for (name, value) in pairs {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(name);
        out.push('=');
        out.push_str(&value.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_logged_with_what_its_answer_says() {
        let reply = LocalReply {
            status: 429,
            headers: vec![
                (SLUICE_POLICY, "llm".to_string()),
                (LIMIT_HEADER, "tpm".to_string()),
                (REASON_HEADER, "provider-pause".to_string()),
            ],
            body: Vec::new(),
        };
        let mut log = DecisionLog::default();
        log.refused(7, &reply);
        assert!(log.pending.is_empty(), "off: nothing noted");
        log.set_on(true);
        log.refused(7, &reply);
        let actions = log.ahead_of(vec![StreamAction::Resume(8)]);
        let field =
            |field: &'static str, value: &str| StreamAction::LogField(7, field, value.into());
        assert_eq!(
            actions,
            vec![
                field("verdict", "refused"),
                field("policy", "llm"),
                field("limit", "tpm"),
                field("reason", "provider-pause"),
                StreamAction::Resume(8),
            ]
        );
        assert!(log.pending.is_empty());
    }

    #[test]
    fn costs_per_limit_read_as_name_equals_value() {
        assert_eq!(
            per_limit([("tpm", 1200), ("usd", 3)].into_iter()),
            "tpm=1200,usd=3"
        );
        assert_eq!(per_limit(std::iter::empty()), "");
    }
}
