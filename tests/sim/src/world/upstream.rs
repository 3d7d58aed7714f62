//! Where a call Sluice let through goes: the provider, or the pool
//! member its route header names, Envoy trying a refused call once more
//! on the other member before Sluice sees the answer.

use sluice_shared::time::Instant;

use super::{Event, World};
use crate::headers::Headers;
use crate::pool::{ANSWERED_HEADER, ATTEMPT_MEMBER_HEADER, RETRIED_STATUSES};

/// One try of a call at an upstream.
#[derive(Debug)]
pub(super) struct Attempt {
    pub envoy: usize,
    pub conn: usize,
    pub stream: u32,
    /// The member an earlier try was refused by (Envoy's retry).
    pub refused_by: Option<usize>,
}

impl World {
    /// `attempt`'s call (its request as Sluice passed it on) reaches the
    /// upstream Envoy routes it to at `now`; its answer, or Envoy's retry
    /// on another member, is scheduled for when it comes back.
    pub(super) fn upstream(&mut self, now: Instant, attempt: Attempt, request: Headers) {
        let tenant = self.callers[self.connections[attempt.conn].caller]
            .tenant
            .clone();
        let call = self.connections[attempt.conn].call;
        let life = self.lives[attempt.envoy];
        let mut rng = self.rng.borrow_mut();
        let (member, answer) = match &self.scenario.pool {
            None => (None, self.provider.call(now, (&request, call), &mut rng)),
            Some(pool) => {
                let member = match attempt.refused_by {
                    None => pool.named(request.text(&pool.route_header).as_deref()),
                    Some(tried) => pool.retry_after(tried),
                };
                let Some(member) = member else {
                    drop(rng);
                    // The pool's host has no route but the members':
                    // Envoy's own 404, through Sluice's answer hooks.
                    self.trace.refused(now, &tenant, "envoy: no member");
                    self.schedule(
                        now,
                        Event::Answer {
                            at: (attempt.envoy, life),
                            stream: attempt.stream,
                            conn: attempt.conn,
                            status: 404,
                            headers: Headers::of(&[(":status", "404")]),
                            body: Vec::new(),
                        },
                    );
                    return;
                };
                let mut answer = self.members[member].call(now, (&request, call), &mut rng);
                let name = pool.members[member].name.clone();
                if pool.attempts_heard {
                    // The member cluster's header_mutation, per attempt.
                    answer.headers.set(ATTEMPT_MEMBER_HEADER, &name);
                }
                (Some((member, name)), answer)
            }
        };
        drop(rng);
        if member.is_some() {
            if let Some(envoy) = self.envoys[attempt.envoy].as_mut() {
                envoy.attempt_goes(attempt.stream, &request);
            }
        }
        self.trace.provider(now, &tenant, answer.status);
        let back = now + answer.after;
        if let Some((member, _)) = member
            .as_ref()
            .filter(|_| attempt.refused_by.is_none() && RETRIED_STATUSES.contains(&answer.status))
        {
            let tries_again = self
                .scenario
                .pool
                .as_ref()
                .and_then(|pool| pool.retry_after(*member))
                .is_some();
            if tries_again {
                self.trace.retried(now, &tenant);
                let retry = Attempt {
                    refused_by: Some(*member),
                    ..attempt
                };
                self.schedule(
                    back,
                    Event::Retry {
                        at: (retry.envoy, life),
                        attempt: retry,
                        request,
                        refusal: answer.headers,
                    },
                );
                return;
            }
        }
        let mut headers = answer.headers;
        if let Some((_, name)) = member {
            headers.set(ANSWERED_HEADER, &name);
        }
        self.schedule(
            back,
            Event::Answer {
                at: (attempt.envoy, life),
                stream: attempt.stream,
                conn: attempt.conn,
                status: answer.status,
                headers,
                body: answer.body,
            },
        );
    }
}
