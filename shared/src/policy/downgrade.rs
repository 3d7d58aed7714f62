//! A money limit's downgrade rung (`downgrade`): past a share of the
//! budget, a call naming a dear model is sent for a cheaper one instead
//! (its body's model rewritten, priced at the new model), so a team's
//! spend steps down before it stops. Its checks; the filter's side is in
//! `filter/src/worker/downgrade.rs`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::check::{join_path, Report};
use crate::price::{ModelSource, PriceTable};

#[cfg(feature = "schema")]
use schemars::JsonSchema;

/// Most models a rung may name.
pub const MAX_DOWNGRADES: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DowngradeSpec {
    /// The share of the limit (`0.8`: 80 %) past which calls are
    /// downgraded: a call that leaves the limit (its key's, where keyed)
    /// at or past it goes to the cheaper model.
    pub at: f64,
    /// The cheaper model for each dear one, by the model's name as the
    /// request names it (a name ending in `*` covers every model it
    /// begins, the longest first, an exact name before any prefix):
    /// `{"gpt-4o": "gpt-4o-mini"}`. A model not named goes as it is.
    pub models: BTreeMap<String, String>,
}

impl DowngradeSpec {
    /// The model `model` is downgraded to (None: it is not).
    pub fn target(&self, model: &str) -> Option<&str> {
        if let Some(to) = self.models.get(model) {
            return Some(to);
        }
        self.models
            .iter()
            .filter_map(|(from, to)| Some((from.strip_suffix('*')?, to)))
            .filter(|(prefix, _)| model.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(_, to)| to.as_str())
    }
}

/// A rung of a money limit whose model is read from the JSON body (the
/// body is what is rewritten).
pub(crate) fn check_downgrade(
    r: &mut Report,
    spec: &DowngradeSpec,
    money: bool,
    model: Option<&ModelSource>,
) {
    if !money {
        r.at(
            "downgrade",
            "a downgrade steps a budget in money down to cheaper models: give the limit `\"cost\": \"price\"`",
        );
    }
    if model.is_some_and(|m| m.json.is_none()) {
        r.at(
            "downgrade",
            "a downgrade rewrites the model in the request's JSON body: the price must read the model from it (`cost.price.model.json`)",
        );
    }
    if !(spec.at > 0.0 && spec.at <= 1.0) {
        r.at(
            "downgrade.at",
            "a share of the limit, above 0 and at most 1 (0.8 downgrades past 80 %)",
        );
    }
    if spec.models.is_empty() {
        r.at(
            "downgrade.models",
            "name at least one model and the cheaper one it goes to",
        );
    }
    if spec.models.len() > MAX_DOWNGRADES {
        r.at(
            "downgrade.models",
            format!("at most {MAX_DOWNGRADES} models"),
        );
    }
    for (from, to) in &spec.models {
        let path = join_path("downgrade.models", from);
        if let Some(problem) = crate::price::name_problem(from) {
            r.at(&path, problem);
        } else if to.is_empty() || to.contains('*') || to.len() > 256 {
            r.at(&path, "the model it goes to: a model's name, without `*`");
        } else if from == to {
            r.at(&path, "goes to itself: name a cheaper model");
        }
    }
}

/// The models a rung sends calls to, each priced by name in `prices`
/// (not by its `default`: a downgrade to a model the table does not
/// know would be priced as a guess).
pub fn unpriced_targets<'a>(
    spec: &'a DowngradeSpec,
    prices: &'a PriceTable,
) -> impl Iterator<Item = (&'a String, &'a String)> + 'a {
    // A name refused on its own (empty, with `*`) is not said twice.
    spec.models.iter().filter(move |(_, to)| {
        !to.is_empty()
            && !to.contains('*')
            && !prices
                .models
                .keys()
                .any(|name| match name.strip_suffix('*') {
                    Some(prefix) => to.starts_with(prefix),
                    None => name == *to,
                })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_name_wins_then_the_longest_prefix() {
        let spec = DowngradeSpec {
            at: 0.8,
            models: [
                ("gpt-4o".to_string(), "gpt-4o-mini".to_string()),
                ("gpt-4*".to_string(), "gpt-4o-mini".to_string()),
                ("gpt-4-turbo*".to_string(), "gpt-3.5-turbo".to_string()),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(spec.target("gpt-4o"), Some("gpt-4o-mini"));
        assert_eq!(spec.target("gpt-4-turbo-2024"), Some("gpt-3.5-turbo"));
        assert_eq!(spec.target("gpt-4o-2024-08-06"), Some("gpt-4o-mini"));
        assert_eq!(spec.target("claude-3-opus"), None);
    }
}
