//! MCP batches (a JSON array of JSON-RPC messages) under a policy that
//! counts MCP messages. A batch whose counted messages all fall under
//! that policy, which reads nothing from each message, is decided as one
//! call costing the messages it counts. Any other batch is split: each
//! message goes into the part of the policy it would fall under sent
//! alone (messages of a policy that keys or prices each message, a part
//! each), and the batch goes only if every part is admitted.

use serde_json::Value;
use sluice_shared::request_headers::RequestHeaders;

use super::{BatchProblem, KeySecrets};
use super::{
    BodyJson, Classification, Classified, CompiledLimit, CompiledPolicy, CompiledPolicySet,
};
use crate::mcp::MAX_BATCH;

/// Messages of a split batch decided together as one call of
/// `class`'s policy: by their indices in the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPart {
    pub class: Classification,
    pub messages: Vec<usize>,
}

impl BatchPart {
    /// The part's body, cut from `batch`'s: its one message, or an array
    /// of its messages.
    pub fn body(&self, batch: &BodyJson) -> BodyJson {
        let Some(Value::Array(all)) = batch.json() else {
            return BodyJson::Absent;
        };
        match self.messages.as_slice() {
            [one] => all
                .get(*one)
                .cloned()
                .map_or(BodyJson::Absent, BodyJson::Json),
            many => BodyJson::Json(Value::Array(
                many.iter().filter_map(|at| all.get(*at).cloned()).collect(),
            )),
        }
    }
}

impl CompiledPolicySet {
    /// Why a batch of MCP messages (a JSON array) cannot be decided as
    /// one call of policy `chosen`, costing the messages it counts: one of
    /// its messages, sent alone, would fall under another policy (it would
    /// ride free with the batch), or the policy reads keys or costs from
    /// each message (the batch as a whole has none). None for any other
    /// body.
    #[cold]
    #[inline(never)]
    pub(super) fn batch_problem<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secrets: KeySecrets<'_>,
        body: &BodyJson,
        chosen: usize,
    ) -> Option<BatchProblem> {
        let policy = self.policies.get(chosen)?;
        let Some(Value::Array(batch)) = body.json() else {
            return None;
        };
        if !policy.counts_mcp() {
            return None;
        }
        if batch.len() > MAX_BATCH {
            return Some(BatchProblem::TooLarge);
        }
        if reads_each_message(policy) {
            return Some(BatchProblem::ReadsEachMessage);
        }
        let elsewhere = batch.iter().any(|message| {
            let alone = BodyJson::Json(message.clone());
            matches!(
                self.classify(req, secrets, &alone),
                Classified::Decided { class: Some(c), .. } if c.policy_index != chosen
            )
        });
        elsewhere.then_some(BatchProblem::Mixed)
    }

    /// The parts of a batch that `problem` keeps from being decided as
    /// one call, each message in the part of the policy it falls under
    /// sent alone (messages under none ride free, as they would alone).
    /// Err(`problem`) when the parts cannot be decided together: a part's
    /// policy routes through a pool, shares fairly,
    /// reads its cost from the answer or rewrites the body, or two parts
    /// would each hold a call in flight of their own policy (a stream
    /// holds one such slot).
    #[cold]
    #[inline(never)]
    pub(super) fn split_batch<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secrets: KeySecrets<'_>,
        body: &BodyJson,
        problem: BatchProblem,
    ) -> Result<Vec<BatchPart>, BatchProblem> {
        if problem == BatchProblem::TooLarge {
            return Err(problem);
        }
        let Some(Value::Array(batch)) = body.json() else {
            return Err(problem);
        };
        let mut parts: Vec<BatchPart> = Vec::new();
        for (at, message) in batch.iter().enumerate() {
            let alone = BodyJson::Json(message.clone());
            let class = match self.classify(req, secrets, &alone) {
                Classified::Decided { class: None, .. } => continue,
                Classified::Decided {
                    class: Some(class), ..
                } => class,
                // A batch inside a batch, or a message the policy refuses
                // as it reads it: nothing JSON-RPC allows.
                _ => return Err(problem),
            };
            let policy = self.policies.get(class.policy_index).ok_or(problem)?;
            if !decides_in_parts(policy) {
                return Err(problem);
            }
            let together = !reads_each_message(policy);
            let joined = parts
                .iter_mut()
                .find(|part| together && part.class.policy_index == class.policy_index);
            match joined {
                Some(part) => part.messages.push(at),
                None => parts.push(BatchPart {
                    class,
                    messages: vec![at],
                }),
            }
        }
        for part in parts.iter_mut().filter(|part| part.messages.len() > 1) {
            // A policy's messages together cost what they count together.
            match self.classify(req, secrets, &part.body(body)) {
                Classified::Decided {
                    class: Some(class), ..
                } if class.policy_index == part.class.policy_index => part.class = class,
                _ => return Err(problem),
            }
        }
        let holding_own_slots = parts
            .iter()
            .filter_map(|part| self.policies.get(part.class.policy_index))
            .filter(|policy| policy.concurrency.is_some())
            .count();
        if holding_own_slots > 1 {
            return Err(problem);
        }
        Ok(parts)
    }
}

/// Whether `policy` keys or prices each message by what it says, so that
/// a batch's messages are decided each alone.
fn reads_each_message(policy: &CompiledPolicy) -> bool {
    policy.keys_from_body()
        || policy
            .limits
            .iter()
            .any(CompiledLimit::cost_reads_each_message)
}

/// Whether a call of `policy` can be decided at once (a queueing
/// policy's part does not wait: admitted now or refused), taking only
/// what can be given back if another part of its batch is refused.
fn decides_in_parts(policy: &CompiledPolicy) -> bool {
    policy.pool.is_none()
        && policy.fair.is_none()
        && !policy.reads_usage()
        && !policy.may_rewrite_body()
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use sluice_shared::key_hash::KeySecret;

    use super::*;

    const SET: &str = r#"{"version": 1, "policies": [
        {"name": "search", "match": {"host": "mcp.example", "mcp": {"tools": ["search"]}},
         "rate": {"requests": 30, "period": "1m"}},
        {"name": "slow", "match": {"host": "mcp.example", "mcp": {"tools": ["slow"]}},
         "concurrency": {"max_in_flight": 2}},
        {"name": "per-tool", "match": {"host": "mcp.example", "mcp": {"tools": ["lookup", "translate"]}},
         "key": {"json": "params.name"}, "rate": {"requests": 3, "period": "1m"}},
        {"name": "queued", "match": {"host": "mcp.example", "mcp": {"tools": ["report"]}},
         "rate": {"requests": 1, "period": "1m"}, "on_limit": {"action": "queue", "max_wait": "10s"}},
        {"name": "render", "match": {"host": "mcp.example", "mcp": {"tools": ["render"]}},
         "concurrency": {"max_in_flight": 1}},
        {"name": "shared", "match": {"host": "mcp.example", "mcp": {"tools": ["share"]}},
         "rate": {"requests": 10, "period": "1s"}, "fair": {"key": {"header": "x-tenant"}}}]}"#;

    const SECRET: KeySecret = KeySecret::from_bytes([7; KeySecret::LEN]);

    fn classify(tools: &[&str]) -> Classified {
        let set = CompiledPolicySet::from_json(SET).unwrap_or_else(|e| panic!("{e}"));
        let batch: Vec<Value> = tools
            .iter()
            .enumerate()
            .map(|(id, tool)| {
                json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": {"name": tool}})
            })
            .collect();
        let headers: &[(&str, &[u8])] = &[(":authority", b"mcp.example")];
        set.classify(
            headers,
            KeySecrets::new(&SECRET, None),
            &BodyJson::Json(Value::Array(batch)),
        )
    }

    /// (policy index, cost, messages) of each part.
    fn parts_of(classified: Classified) -> Vec<(usize, u64, Vec<usize>)> {
        match classified {
            Classified::Split { parts } => parts
                .into_iter()
                .map(|p| (p.class.policy_index, p.class.cost, p.messages))
                .collect(),
            other => panic!("not split: {other:?}"),
        }
    }

    #[test]
    fn a_batch_is_split_by_the_policy_each_message_falls_under_alone() {
        let parts = parts_of(classify(&[
            "search", "slow", "fetch", "search", "lookup", "lookup",
        ]));
        assert_eq!(
            parts,
            [
                (0, 2, vec![0, 3]),
                (1, 1, vec![1]),
                (2, 1, vec![4]),
                (2, 1, vec![5]),
            ],
            "a policy's messages together, unless it keys each: a part each"
        );
        // One policy keying each message: split too, a part per message.
        assert_eq!(parts_of(classify(&["translate", "lookup"])).len(), 2);
    }

    #[test]
    fn a_batch_whose_parts_cannot_be_decided_together_is_not_split() {
        let refused = |tools: &[&str]| match classify(tools) {
            Classified::BatchRefused { problem, .. } => problem,
            other => panic!("{tools:?} was {other:?}"),
        };
        assert_eq!(refused(&["search", "share"]), BatchProblem::Mixed);
        assert_eq!(refused(&["slow", "render"]), BatchProblem::Mixed);
        assert_eq!(
            refused(&["lookup", "share"]),
            BatchProblem::ReadsEachMessage
        );
        // A queueing policy's part is split off: decided at once.
        assert_eq!(parts_of(classify(&["search", "report"])).len(), 2);
        // A batch one policy decides whole is no split.
        assert!(matches!(
            classify(&["search", "search", "fetch"]),
            Classified::Decided { class: Some(c), .. } if c.policy_index == 0 && c.cost == 2
        ));
    }
}
