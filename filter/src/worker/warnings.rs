//! Calls that left a limit past one of its warning lines (`warn_at`):
//! their answers carry `x-sluice-warn`, one item per such limit. Which
//! lines a take crossed is decided in `sluice_shared::warn`.

use rustc_hash::FxHashMap;

use sluice_shared::warn::warn_item;

/// The header a warned call's answer carries.
pub const WARN_HEADER: &str = "x-sluice-warn";

#[derive(Debug, Default)]
pub(super) struct Warnings {
    /// The header's value, per call.
    calls: FxHashMap<u32, String>,
}

impl Warnings {
    /// Call `context_id` left these limits past a line: (name, thousandths
    /// of it used, unless the limit keeps them to itself).
    pub fn expect(&mut self, context_id: u32, past: &[super::limits::PastWarning]) {
        if past.is_empty() {
            return;
        }
        let value = past
            .iter()
            .map(|(limit, used)| warn_item(limit, *used))
            .collect::<Vec<_>>()
            .join(", ");
        self.calls.insert(context_id, value);
    }

    pub fn awaits(&self, context_id: u32) -> bool {
        !self.calls.is_empty() && self.calls.contains_key(&context_id)
    }

    /// The answer's header, once.
    pub fn header(&mut self, context_id: u32) -> Option<(&'static str, String)> {
        if self.calls.is_empty() {
            return None;
        }
        self.calls.remove(&context_id).map(|v| (WARN_HEADER, v))
    }

    pub fn forget(&mut self, context_id: u32) {
        if !self.calls.is_empty() {
            self.calls.remove(&context_id);
        }
    }
}
