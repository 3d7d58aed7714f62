//! Calls whose real cost comes with their response (a limit's `usage`):
//! admitted against an estimate, settled when the response ends (a 429,
//! which the provider did not serve, as having used nothing). The
//! difference is refunded, or charged as debt the calls that follow pay
//! ("pay later": never the call already in flight). A response that ends
//! early, carries no usage, is too large, or whose usage cannot be read is
//! charged the limit's unread charge (by default the most its cost can
//! be, whatever the caller's estimate said), and counted. What the worker
//! holds of response bodies at once is bounded ([`MAX_HELD_BYTES`]); a
//! body that would pass it is not read.

use sluice_filter_core::matcher::CompiledPolicy;
use sluice_filter_core::pricing::CallPrice;
use sluice_shared::limiter::RateLimiter;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;
use sluice_shared::usage::{usage_from_header, CompiledUsage, UsageError, UsageReader};

use super::ctx::Ctx;
use super::decision_log::{self, Field as LogField};
use super::limits::{self, LimitPlace};
use super::provider::Followed;
use crate::host::Host;
use crate::metrics::{FilterCounter, LimitCounter};

/// One limit of an admitted call, waiting for its usage.
#[derive(Debug)]
struct Owed {
    limit: String,
    /// Where its estimate was taken.
    place: LimitPlace,
    rate: RateLimiter,
    /// Tokens taken at admission.
    estimate: u64,
    source: CompiledUsage,
    /// The body's reader, once the response's headers said what it is.
    reader: Option<UsageReader>,
    /// Where it counts in the provider's count the limit follows.
    followed: Option<Followed>,
}

/// A call's limits waiting for its usage: each feature's part of a call
/// lives in its [`super::call::Call`].
#[derive(Debug)]
pub(super) struct UsageOwed {
    bill: Bill,
    owed: Vec<Owed>,
}

/// Whose call, taken when, and what its settled limits were charged so
/// far (`limit=tokens`, for the access log).
#[derive(Debug)]
struct Bill {
    context_id: u32,
    taken_at: Instant,
    charged: String,
}

/// How one limit's usage came out.
enum Outcome {
    Read(u64),
    Unread(LimitCounter),
}

impl Outcome {
    fn of(result: Result<u64, UsageError>) -> Self {
        match result {
            Ok(n) => Outcome::Read(n),
            Err(UsageError::TooLarge(_)) => Outcome::Unread(LimitCounter::UsageTooLarge),
            Err(UsageError::Malformed(_)) => Outcome::Unread(LimitCounter::UsageMalformed),
            Err(UsageError::Missing(_)) => Outcome::Unread(LimitCounter::UsageMissing),
        }
    }
}

/// The most of response bodies one worker holds at once, over every call
/// it reads usage for: past it, a body that would grow the total is not
/// read (charged its unread charge, counted `usage_too_large`), so many
/// large answers at once cannot exhaust the VM's memory.
pub const MAX_HELD_BYTES: usize = 64 * 1024 * 1024;

/// What the readers of every call hold now, all together (bounded by
/// [`MAX_HELD_BYTES`]).
#[derive(Debug, Default)]
pub(super) struct HeldBytes(usize);

impl HeldBytes {
    pub fn get(&self) -> usize {
        self.0
    }
}

impl UsageOwed {
    /// A call of `policy` went with `costs` taken from its further limits:
    /// those with `usage` wait for its response (None: none has it).
    pub fn of(
        context_id: u32,
        policy: &CompiledPolicy,
        costs: &[u64],
        places: &[LimitPlace],
        price: Option<&CallPrice>,
        now: Instant,
    ) -> Option<Self> {
        if !policy.reads_usage() {
            return None;
        }
        let owed: Vec<Owed> = policy
            .limits
            .iter()
            .enumerate()
            .zip(costs)
            .zip(places)
            .filter_map(|(((index, limit), cost), place)| {
                let source = policy.priced_usage(index, price)?;
                Some(Owed {
                    limit: limit.name.clone(),
                    place: place.clone(),
                    rate: limit.rate.clone(),
                    estimate: limit.rate.taken(*cost),
                    source,
                    reader: None,
                    followed: place.counted.map(|c| Followed::new(limit, c, *cost)),
                })
            })
            .collect();
        (!owed.is_empty()).then_some(Self {
            bill: Bill {
                context_id,
                taken_at: now,
                charged: String::new(),
            },
            owed,
        })
    }

    /// Whether every limit is settled: nothing is left to read.
    pub fn is_settled(&self) -> bool {
        self.owed.is_empty()
    }

    /// The response's headers: usage from a header settles now; a body's
    /// reader starts. True while the body is still wanted.
    pub fn on_answer_headers<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        headers: &R,
        end_of_stream: bool,
        held: &mut HeldBytes,
    ) -> bool
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let content_type = headers.header("content-type");
        let bill = &mut self.bill;
        if headers.header(":status").as_deref() == Some(b"429") {
            // Refused, not served: the provider used (and bills) nothing,
            // whatever the answer's body says.
            for owed in &mut self.owed {
                settle(ctx, owed, bill, Outcome::Read(0));
            }
            self.owed.clear();
            return false;
        }
        self.owed.retain_mut(|owed| {
            if let Some(name) = &owed.source.header {
                let value = headers.header(name);
                let outcome = Outcome::of(usage_from_header(value.as_deref(), name));
                settle(ctx, owed, bill, outcome);
                return false;
            }
            owed.reader = owed.source.body_reader(content_type.as_deref());
            true
        });
        self.after_progress(ctx, end_of_stream, held)
    }

    /// The next piece of the response's body. True while more is wanted.
    pub fn on_answer_body<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        chunk: &[u8],
        end_of_stream: bool,
        held: &mut HeldBytes,
    ) -> bool {
        let bill = &mut self.bill;
        let total = &mut held.0;
        self.owed.retain_mut(|owed| {
            let Some(reader) = owed.reader.as_mut() else {
                // Headers never came: the end settles it as aborted.
                return true;
            };
            let before = reader.buffered();
            if total.saturating_add(chunk.len()) > MAX_HELD_BYTES {
                reader.give_up();
                ctx.metrics.add_filter(FilterCounter::UsageBufferFull, 1);
            } else {
                reader.feed(chunk);
            }
            *total = (*total - before.min(*total)).saturating_add(reader.buffered());
            if !reader.has_failed() {
                return true;
            }
            // Nothing more to read for it: settle now, free its buffer.
            if let Some(reader) = owed.reader.take() {
                settle(ctx, owed, bill, Outcome::of(reader.finish()));
            }
            false
        });
        self.after_progress(ctx, end_of_stream, held)
    }

    /// Settles every reader at the end of the body. True while the body
    /// is still wanted.
    fn after_progress<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        end_of_stream: bool,
        held: &mut HeldBytes,
    ) -> bool {
        if end_of_stream {
            let bill = &mut self.bill;
            self.owed.retain_mut(|owed| {
                let Some(reader) = owed.reader.take() else {
                    return true;
                };
                held.0 = held.0.saturating_sub(reader.buffered());
                settle(ctx, owed, bill, Outcome::of(reader.finish()));
                false
            });
        }
        self.owed.iter().any(|o| o.reader.is_some())
    }

    /// The call ended: whatever was not settled (aborted mid-response, or
    /// never answered) keeps its estimate.
    pub fn on_end<H: Host + ?Sized>(mut self, ctx: &mut Ctx<'_, H>, held: &mut HeldBytes) {
        if self.owed.is_empty() {
            return;
        }
        // A stream's end is handled at the clock's last reading; settling
        // charges at the time it happens.
        ctx.read_clock();
        for mut owed in self.owed {
            if let Some(reader) = owed.reader.take() {
                held.0 = held.0.saturating_sub(reader.buffered());
            }
            settle(
                ctx,
                &mut owed,
                &mut self.bill,
                Outcome::Unread(LimitCounter::UsageAborted),
            );
        }
    }
}

/// Charges the limit what the call really cost (refund or debt), or its
/// unread charge when that could not be read; counts it either way.
fn settle<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    owed: &mut Owed,
    bill: &mut Bill,
    outcome: Outcome,
) {
    let taken_at = bill.taken_at;
    let charged = match outcome {
        Outcome::Read(used) => {
            ctx.metrics
                .add_limit(&owed.limit, LimitCounter::UsageRead, 1);
            owed.rate.taken(used)
        }
        Outcome::Unread(stat) => {
            ctx.metrics.add_limit(&owed.limit, stat, 1);
            owed.rate.taken(owed.source.unread_charge(owed.estimate))
        }
    };
    limits::adjust(
        ctx,
        &owed.place,
        &owed.rate,
        owed.estimate,
        charged,
        taken_at,
    );
    if let Some(followed) = &owed.followed {
        followed.settle(ctx, charged);
    }
    let tokens = i64::try_from(charged).unwrap_or(i64::MAX);
    ctx.metrics
        .add_limit(&owed.limit, LimitCounter::Tokens, tokens);
    if ctx.decisions.is_on() {
        let so_far = decision_log::per_limit(std::iter::once((owed.limit.as_str(), charged)));
        if !bill.charged.is_empty() {
            bill.charged.push(',');
        }
        bill.charged.push_str(&so_far);
        let id = bill.context_id;
        ctx.decisions
            .note(id, LogField::Charged, bill.charged.clone());
    }
}
