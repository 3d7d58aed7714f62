//! The workers of a configuration: each made with its host, started
//! (the fallback policies, the sync, its first tick) and ticked on the
//! main thread, what a tick decides posted to the streams it is for.
//! [`Module`] keeps them; this is what drives them through [`NativeHost`].

use std::sync::atomic::Ordering;
use std::sync::Arc;

use sluice_filter::sync::SyncSettings;
use sluice_filter::worker::{StreamAction, Worker};
use sluice_filter_core::matcher::CompiledPolicySet;

use crate::abi;
use crate::host::NativeHost;
use crate::module::{now_ns, Module, Posted, Slot, MIN_TICK_NS};

/// More worker threads than any Envoy runs: a bound on what its answer
/// makes the module keep.
const MAX_WORKERS: u32 = 1024;

/// Every worker from the start, as every wasm VM is: each ticks (and
/// installs what the admin sends) before its first request.
pub fn start_all(module: &Arc<Module>) {
    // SAFETY: `config_new` runs on the main thread.
    let workers = unsafe { abi::envoy_dynamic_module_callback_get_concurrency() }.min(MAX_WORKERS);
    for index in 0..=workers as usize {
        slot(module, index);
    }
    module.start_ticker();
}

/// Worker `index`'s slot (0: the configuration's own; a worker thread's
/// is its Envoy worker index plus one), made and started on first use.
pub fn slot(module: &Module, index: usize) -> Arc<Slot> {
    // A host for making a worker: no stream, no slot of its own yet.
    let (slot, made) = module.slot_or_make(index, || Worker::new(&NativeHost::detached(module)));
    if made {
        start(module, &slot);
    }
    slot
}

fn start(module: &Module, slot: &Slot) {
    let host = NativeHost::ticking(module, slot);
    let mut w = slot.worker();
    let set = CompiledPolicySet::from_validated(module.settings.fallback.clone());
    w.set_time_scale(module.settings.time_scale);
    w.log_decisions(module.settings.log_decisions);
    w.declare_route_headers(&module.settings.route_headers);
    w.install(&host, set);
    w.set_sync(SyncSettings::from_config(&module.settings));
    w.start_ticking(&host);
}

/// The slot and token of callout `id`, once.
pub fn callout(module: &Module, id: u64) -> Option<(Arc<Slot>, u32)> {
    let (index, token) = module.take_callout(id)?;
    Some((slot(module, index), token))
}

/// Runs every worker whose tick is due; on the main thread.
pub fn tick_due(module: &Module) {
    module.woken();
    let now = now_ns();
    for slot in module.slots() {
        if slot.due_ns.load(Ordering::Acquire) > now {
            continue;
        }
        // The tick may set another period, and with it its next tick.
        let period = slot.period_ns.load(Ordering::Acquire).max(MIN_TICK_NS);
        slot.due_ns.store(now + period, Ordering::Release);
        let host = NativeHost::ticking(module, &slot);
        let actions = slot.worker().on_tick(&host);
        for action in actions {
            let (context_id, posted) = posted_of(action);
            let resuming = matches!(posted, Posted::Resume);
            if !module.post_to(context_id, posted) && resuming {
                slot.worker().on_resume_failed(&host, context_id);
            }
        }
    }
    module.wake_ticker();
}

fn posted_of(action: StreamAction) -> (u32, Posted) {
    match action {
        StreamAction::SetHeader(ctx, name, value) => (ctx, Posted::SetHeader(name, value)),
        StreamAction::LogField(ctx, field, value) => (ctx, Posted::LogField(field, value)),
        StreamAction::Resume(ctx) => (ctx, Posted::Resume),
        StreamAction::Reply(ctx, reply) => (
            ctx,
            Posted::Reply {
                status: reply.status,
                headers: reply
                    .headers
                    .into_iter()
                    .map(|(n, v)| (n.to_string(), v))
                    .collect(),
                body: reply.body,
            },
        ),
    }
}
