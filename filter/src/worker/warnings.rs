//! Calls that left a limit past one of its warning lines (`warn_at`):
//! their answers carry `x-sluice-warn`, one item per such limit. Which
//! lines a take crossed is decided in `sluice_shared::warn`.

use sluice_shared::warn::warn_item;

/// The header a warned call's answer carries.
pub const WARN_HEADER: &str = "x-sluice-warn";

/// The header's value for a call that left these limits past a line
/// (name, thousandths of it used, unless the limit keeps them to itself);
/// None: it left none past one.
pub(super) fn warn_value(past: &[super::limits::PastWarning]) -> Option<String> {
    if past.is_empty() {
        return None;
    }
    let value = past
        .iter()
        .map(|(limit, used)| warn_item(limit, *used))
        .collect::<Vec<_>>()
        .join(", ");
    Some(value)
}
