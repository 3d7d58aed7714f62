//! What the admin holds of long limits across Envoys' restarts: the
//! budgets' keys, and what each Envoy reported its rungs did (warning
//! lines crossed, calls downgraded, routed, paced or refused by a budget).

use sluice_wire::stats::LimitCounter;

use super::*;

/// What a limit's rungs did over one minute, as its audit row holds it:
/// warning lines crossed (`warn`), or calls sent for a cheaper model
/// (`downgrade`) or refused by a budget (`refuse`).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(in crate::store) struct RungRow {
    #[serde(default, skip_serializing_if = "is_zero")]
    crossed: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    calls: u64,
    /// The Envoys that reported them, at most [`WARN_ROW_ENVOYS`]...
    envoys: Vec<String>,
    /// ...and how many reports came from others.
    #[serde(default, skip_serializing_if = "is_zero")]
    more_reports: u64,
}

pub(in crate::store) fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The rungs the audit log records: the counter an Envoy reports, the
/// row's action, and whether only budgets' (limits of an hour or longer,
/// whose reports carry their spend) count.
const RUNGS: [(LimitCounter, &str, bool); 5] = [
    (LimitCounter::WarnCrossed, "warn", false),
    (LimitCounter::Downgraded, "downgrade", false),
    (LimitCounter::Routed, "route", false),
    (LimitCounter::Paced, "queue", false),
    (LimitCounter::Refused, "refuse", true),
];

/// The audit log's record of what `report` says each limit's rungs did
/// since `previous` (the instance's report before; counts start again
/// when its Envoy restarts): one row per limit per rung per minute,
/// summing what every Envoy reported in it, so that no sync (nor a sync
/// token's holder making its counter go up and down) grows the log faster
/// than that. Rows older than `retention_ms` are deleted as new ones are
/// written.
pub(in crate::store) fn audit_rungs(
    sql: &mut dyn Sql,
    previous: Option<&SyncReport>,
    report: &SyncReport,
    retention_ms: u64,
) -> Result<(), StoreError> {
    let now = now_ms();
    for (name, limit) in &report.limits {
        for (counter, action, budgets_only) in RUNGS {
            if budgets_only && limit.spend.is_none() {
                continue;
            }
            let count = limit.counts.get(counter);
            let before = previous
                .and_then(|p| p.limits.get(name))
                .map_or(0, |l| l.counts.get(counter));
            let acted = if count >= before {
                count - before
            } else {
                count
            };
            if acted > 0 {
                audit_rung(sql, report, name, action, acted, now, retention_ms)?;
            }
        }
    }
    Ok(())
}

/// Adds `acted` to limit `name`'s row of `action` for this minute.
fn audit_rung(
    sql: &mut dyn Sql,
    report: &SyncReport,
    name: &str,
    action: &str,
    acted: u64,
    now: u64,
    retention_ms: u64,
) -> Result<(), StoreError> {
    let recent = sql.query_one(
        "SELECT id, new FROM audit WHERE action = $1 AND target = $2 AND at_ms >= $3 \
         ORDER BY id DESC LIMIT 1",
        &[
            action.into(),
            name.into(),
            now.saturating_sub(WARN_ROW_SPAN_MS).into(),
        ],
    )?;
    let found = match recent {
        Some(row) => Some((row.int(0)?, row.optional_text(1)?)),
        None => None,
    };
    let mut row: RungRow = found
        .as_ref()
        .and_then(|(_, new)| new.as_deref())
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or_default();
    if action == "warn" {
        row.crossed = row.crossed.saturating_add(acted);
    } else {
        row.calls = row.calls.saturating_add(acted);
    }
    if !row.envoys.contains(&report.instance) {
        if row.envoys.len() < WARN_ROW_ENVOYS {
            row.envoys.push(report.instance.clone());
        } else {
            row.more_reports = row.more_reports.saturating_add(1);
        }
    }
    let text = serde_json::to_string(&row).unwrap_or_default();
    match found {
        Some((id, _)) => {
            sql.execute(
                "UPDATE audit SET new = $1 WHERE id = $2",
                &[text.into(), id.into()],
            )?;
        }
        None => {
            sql.execute(
                "DELETE FROM audit WHERE action = $1 AND at_ms < $2",
                &[action.into(), now.saturating_sub(retention_ms).into()],
            )?;
            audit_entry(sql, now, "sluice", action, name, None, Some(text))?;
        }
    }
    Ok(())
}

/// Keeps what `report` says of its keyed budgets' keys: a key that spent
/// nothing (or gave its place up) is forgotten.
pub(in crate::store) fn record_budget_keys(
    sql: &mut dyn Sql,
    report: &SyncReport,
    keyed: &BTreeMap<&str, (u64, u32)>,
) -> Result<(), StoreError> {
    let instance = report.instance.as_str();
    for (name, keys) in &report.budget_keys {
        let Some((_, max_keys)) = keyed.get(name.as_str()) else {
            continue;
        };
        for key in keys {
            // The hash as SQL's signed integer, bit for bit.
            let owner = key.owner as i64;
            if key.spent == 0 {
                sql.execute(
                    "DELETE FROM budget_keys WHERE instance = $1 AND name = $2 AND owner = $3",
                    &[instance.into(), name.as_str().into(), owner.into()],
                )?;
                continue;
            }
            sql.execute(
                "INSERT INTO budget_keys (instance, name, owner, spent, at_ms, updated_ms)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (instance, name, owner) DO UPDATE SET spent = $4, at_ms = $5,
                   updated_ms = $6",
                &[
                    instance.into(),
                    name.as_str().into(),
                    owner.into(),
                    key.spent.into(),
                    report.at_ms.into(),
                    now_ms().into(),
                ],
            )?;
        }
        // An Envoy holds at most `max_keys` keys of it: whatever reports
        // say, the store keeps the most recently heard of that many (and
        // any heard of at the same time as the last of them).
        sql.execute(
            "DELETE FROM budget_keys WHERE instance = $1 AND name = $2 AND updated_ms < (
               SELECT updated_ms FROM budget_keys WHERE instance = $1 AND name = $2
               ORDER BY updated_ms DESC LIMIT 1 OFFSET $3)",
            &[
                instance.into(),
                name.as_str().into(),
                u64::from(max_keys.saturating_sub(1)).into(),
            ],
        )?;
    }
    Ok(())
}

/// The next part of each keyed budget in `wanted` (name, period) the
/// admin holds for `report`'s instance: the keys after the last it took,
/// at most [`MAX_KEYS_ANSWERED`] in all, `more` when some are left. Keys
/// last heard of more than a period ago hold nothing of the period now
/// (on the Envoy's own clock): they are not sent.
pub(in crate::store) fn give_back_budget_keys<'a>(
    sql: &mut dyn Sql,
    report: &SyncReport,
    wanted: impl Iterator<Item = (&'a str, u64)>,
    out: &mut BudgetsMessage,
) -> Result<(), StoreError> {
    let mut left = MAX_KEYS_ANSWERED;
    for (name, period_ms) in wanted {
        if left == 0 {
            break;
        }
        let from = match report.budgets.get(name).and_then(|b| b.resume_after) {
            Some(after) => match after.checked_add(1) {
                Some(next) => next,
                None => continue,
            },
            None => i64::MIN,
        };
        let rows = sql.query(
            "SELECT owner, spent, at_ms FROM budget_keys
             WHERE instance = $1 AND name = $2 AND owner >= $3 AND at_ms >= $4
             ORDER BY owner LIMIT $5",
            &[
                report.instance.as_str().into(),
                name.into(),
                from.into(),
                report.at_ms.saturating_sub(period_ms).into(),
                (left as u64 + 1).into(),
            ],
        )?;
        let more = rows.len() > left;
        let keys = rows
            .iter()
            .take(left)
            .map(|row| {
                Ok(HeldKey {
                    owner: row.int(0)? as u64,
                    spent: row.uint(1)?,
                    at_ms: row.uint(2)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if keys.is_empty() {
            continue;
        }
        left -= keys.len();
        out.insert(
            name.to_string(),
            HeldBudget {
                keys,
                more,
                ..HeldBudget::default()
            },
        );
    }
    Ok(())
}
