//! What a set's policies must agree on between them: unique names, a
//! limit named by several policies the same limit, a pool member's limits
//! its own, money limits priced (and read at one model).

use std::collections::HashMap;

use crate::policy::check::FieldError;
use crate::policy::{CostSpec, NamedLimit, Policy};
use crate::price::PriceTable;

/// What no one policy can tell: names unique, shared limits agreed on, a
/// pool member's limits its own, money limits priced.
pub(super) fn check_across_policies(
    policies: &[(usize, Policy)],
    prices: Option<&PriceTable>,
    errors: &mut Vec<FieldError>,
) {
    check_unique_names(policies, errors);
    check_shared_limits(policies, errors);
    check_member_limits_own(policies, errors);
    check_priced_limits(policies, prices, errors);
    check_money_models_agree(policies, errors);
}

/// A call is priced once, at the model its policy's money limits say
/// where to read: they (and its pool members') must say the same.
fn check_money_models_agree(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    for (index, policy) in policies {
        let prefix = format!("policies[{index}].");
        let mut first: Option<(String, crate::price::ModelSource)> = None;
        for (path, limit) in policy.every_limit_at(&prefix) {
            let CostSpec::Price(spec) = &limit.cost else {
                continue;
            };
            let source = spec.cost().model;
            match &first {
                None => first = Some((path, source)),
                Some((at, want)) if *want != source => errors.push(FieldError {
                    path: format!("{path}.cost.price.model"),
                    message: format!(
                        "the policy's money limits price a call at one model: {at} reads it elsewhere"
                    ),
                }),
                Some(_) => {}
            }
        }
    }
}

/// A limit named in several policies is one limit: they must agree on it.
/// Every policy that disagrees is told, so an edit to either side is
/// refused with an error on its own field.
fn check_shared_limits(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut by_name: HashMap<&str, Vec<(usize, usize, &NamedLimit)>> = HashMap::new();
    for (index, policy) in policies {
        for (at, limit) in policy.limits.iter().enumerate() {
            by_name
                .entry(limit.name.as_str())
                .or_default()
                .push((*index, at, limit));
        }
    }
    let mut found = Vec::new();
    for (name, uses) in &by_name {
        for (index, at, limit) in uses {
            let differs = |field: &str, same: &dyn Fn(&NamedLimit) -> bool| {
                uses.iter()
                    .find(|(i, _, l)| i != index && !same(l))
                    .map(|(other, _, _)| FieldError {
                        path: format!("policies[{index}].limits[{at}].{field}"),
                        message: format!(
                            "limit {name:?} is also in policies[{other}] with another {field}; a limit named in several policies is one limit"
                        ),
                    })
            };
            found.extend(
                differs("rate", &|l| l.rate == limit.rate)
                    .or_else(|| differs("concurrency", &|l| l.concurrency == limit.concurrency))
                    .or_else(|| differs("key", &|l| l.key == limit.key))
                    .or_else(|| differs("scope", &|l| l.scope == limit.scope))
                    .or_else(|| differs("provider", &|l| l.provider == limit.provider))
                    .or_else(|| differs("fair", &|l| l.fair == limit.fair)),
            );
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    errors.extend(found);
}

fn check_unique_names(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut first_seen: HashMap<&str, usize> = HashMap::new();
    for (index, policy) in policies {
        match first_seen.get(policy.name.as_str()) {
            Some(first) => errors.push(FieldError {
                path: format!("policies[{index}].name"),
                message: format!(
                    "duplicate name {:?}, already used by policies[{first}]",
                    policy.name
                ),
            }),
            None => {
                first_seen.insert(&policy.name, *index);
            }
        }
    }
}

/// A pool member's limits are its own: no other policy or member names
/// them (a limit named twice is one limit, and a member's room is its own).
fn check_member_limits_own(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut uses: HashMap<&str, Vec<String>> = HashMap::new();
    for (index, policy) in policies {
        for (at, limit) in policy.limits.iter().enumerate() {
            uses.entry(limit.name.as_str())
                .or_default()
                .push(format!("policies[{index}].limits[{at}]"));
        }
        for (m, member) in policy
            .pool
            .iter()
            .flat_map(|p| p.members.iter().enumerate())
        {
            for (at, limit) in member.limits.iter().enumerate() {
                uses.entry(limit.name.as_str())
                    .or_default()
                    .push(format!("policies[{index}].pool.members[{m}].limits[{at}]"));
            }
        }
    }
    let mut found = Vec::new();
    for (name, paths) in &uses {
        if paths.len() < 2 || !paths.iter().any(|p| p.contains(".pool.")) {
            continue;
        }
        for path in paths.iter().filter(|p| p.contains(".pool.")) {
            let other = paths
                .iter()
                .find(|p| *p != path)
                .cloned()
                .unwrap_or_default();
            found.push(FieldError {
                path: format!("{path}.name"),
                message: format!(
                    "limit {name:?} is also named at {other}: a pool member's limits are its own"
                ),
            });
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    errors.extend(found);
}

/// A limit whose cost is `price` needs the set's `prices` (an MCP
/// policy's, prices of tools).
fn check_priced_limits(
    policies: &[(usize, Policy)],
    prices: Option<&PriceTable>,
    errors: &mut Vec<FieldError>,
) {
    let prices_no_tool = prices.is_some_and(|t| t.tools.is_empty() && t.tool_default.is_none());
    for (index, policy) in policies {
        let prefix = format!("policies[{index}].");
        // An MCP policy's money limits price its calls by tool.
        let by_tool = policy.matcher.mcp.is_some();
        for (path, limit) in policy.every_limit_at(&prefix) {
            if !limit.cost.is_price() {
                continue;
            }
            if let (Some(downgrade), Some(table)) = (&limit.downgrade, prices) {
                for (from, to) in crate::policy::downgrade::unpriced_targets(downgrade, table) {
                    errors.push(FieldError {
                        path: format!("{path}.downgrade.models.{from}"),
                        message: format!(
                            "goes to {to:?}, which the set's `prices` do not name: a downgrade is priced at its model's own price"
                        ),
                    });
                }
            }
            let message = match prices {
                None => "a price needs the set's `prices`: what each model costs, and in which currency",
                Some(_) if by_tool && prices_no_tool => {
                    "the policy counts MCP tool calls, priced by tool, and the set's `prices` price no tool: give `prices.tools` or `prices.tool_default`"
                }
                Some(_) => continue,
            };
            errors.push(FieldError {
                path: format!("{path}.cost"),
                message: message.into(),
            });
        }
    }
}
