//! The admin's answer to a sync or a watch: a policy set, shares,
//! provider news and budgets, each handed to the part that keeps it.

use std::sync::Arc;

use super::ctx::Ctx;
use super::{provider, shares, Parts};
use crate::host::Host;
use crate::sync::{Answer, SyncReply};

impl Parts {
    pub(super) fn sync_reply<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        token: u32,
        reply: SyncReply<'_>,
    ) {
        if let Some(call) = self.sync.take_watch(token) {
            let (epoch, sync_now) = (reply.headers.epoch, reply.headers.sync_now);
            if let Some(set) = self
                .sync
                .on_watch_answer(ctx, reply.answer(), epoch, sync_now, call)
            {
                self.install_from_admin(ctx, set);
            }
            return;
        }
        let Some(sent_at) = self.sync.take_pending(token) else {
            return;
        };
        let answer = reply.answer();
        let answered_at_all = reply.answered();
        let headers = reply.headers;
        if let Some(shares) = headers.shares.filter(|_| answered_at_all) {
            let taken = self.shares.take(ctx, shares, sent_at);
            if let Some(shares::Shrank(shrank)) = taken {
                self.apply_shares(ctx);
                if shrank {
                    // The admin frees the old share's room for the others
                    // only once this Envoy says it holds the new one: at
                    // once, even right after another hurry (a share cut
                    // in steps waited 100 ms a step).
                    ctx.now = ctx.host.now();
                    self.sync.hurry_now(ctx);
                }
            }
        }
        let answered = matches!(answer, Answer::Unchanged | Answer::PolicySet(_));
        if let Some(set) = self.sync.on_answer(ctx, answer, headers.epoch) {
            self.install_from_admin(ctx, set);
        }
        if answered {
            let policies = Arc::clone(&self.policies);
            if let Some(news) = headers.news {
                ctx.now = ctx.host.now();
                let delay = ctx.now.since(sent_at).div(2);
                provider::take_news(ctx, &policies, news, delay);
            }
            ctx.now = ctx.host.now();
            if self.budgets.on_answer(ctx, &policies, headers.budgets) {
                // A keyed budget comes back in parts: the next at once.
                self.sync.hurry(ctx);
            }
        }
    }
}
