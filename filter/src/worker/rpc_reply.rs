//! A refusal of an MCP call said as JSON-RPC, which an agent's MCP client
//! hands to the tool call that made it: each request answered by an
//! error carrying its `id`, with the limit, the reason and when to retry
//! in its `data`, on HTTP 200 (the MCP TypeScript SDK's client turns any
//! other status into a transport error, the body unread); the headers
//! stay. A call with nobody to answer (notifications only) keeps the
//! policy's status, with no body.

use serde_json::{json, Map, Value};
use sluice_filter_core::headers::{retry_after_value, RETRY_AFTER, SLUICE_POLICY};
use sluice_filter_core::mcp::RpcCall;
use sluice_shared::time::Span;

use super::refusal::{
    BUDGET_HEADER, CURRENCY_HEADER, RENEWS_AT_HEADER, RENEWS_HEADER, SPENT_HEADER,
};
use super::to_shell::{LocalReply, LIMIT_HEADER, REASON_HEADER};

/// JSON-RPC's error code for a call refused by a limit: in the range the
/// specification leaves to servers (-32000 to -32099), the one several MCP
/// servers use for rate limits.
pub const RPC_LIMITED: i64 = -32029;
/// JSON-RPC's code for a request the server will not take as it is.
pub const RPC_INVALID_REQUEST: i64 = -32600;

/// The error a refusal answers each request it refused with.
struct RpcError {
    code: i64,
    message: String,
    data: Map<String, Value>,
}

impl RpcError {
    /// What `reply` says, as JSON-RPC.
    fn of(reply: &LocalReply) -> Self {
        let header = |name: &str| reply.header(name).map(str::to_string);
        let mut data = Map::new();
        for (field, name) in [
            ("policy", SLUICE_POLICY),
            ("limit", LIMIT_HEADER),
            ("reason", REASON_HEADER),
            ("spent", SPENT_HEADER),
            ("budget", BUDGET_HEADER),
            ("currency", CURRENCY_HEADER),
            ("renews_at", RENEWS_AT_HEADER),
        ] {
            if let Some(value) = header(name) {
                data.insert(field.into(), value.into());
            }
        }
        for (field, name) in [
            ("retry_after_s", RETRY_AFTER),
            ("renews_in_s", RENEWS_HEADER),
        ] {
            if let Some(seconds) = header(name).and_then(|v| v.parse::<u64>().ok()) {
                data.insert(field.into(), seconds.into());
            }
        }
        // A call refused for what it is, not for a limit: retrying it as
        // it is does not help.
        let code = if reply.status == 400 {
            RPC_INVALID_REQUEST
        } else {
            RPC_LIMITED
        };
        Self {
            code,
            message: String::from_utf8_lossy(&reply.body).trim().to_string(),
            data,
        }
    }

    /// The answer to request `id`: refused by this limit itself (`own`),
    /// or with its batch, which this limit refused.
    fn answer(&self, id: &Value, own: bool) -> Value {
        let message = if own {
            self.message.clone()
        } else {
            format!("refused with its batch: {}", self.message)
        };
        json!({"jsonrpc": "2.0", "id": id,
            "error": {"code": self.code, "message": message, "data": self.data}})
    }
}

/// `reply` said as JSON-RPC to `call`: see the module's header.
pub(super) fn for_rpc(reply: LocalReply, call: &RpcCall) -> LocalReply {
    let error = RpcError::of(&reply);
    let answer = match call {
        RpcCall::Single(Some(id)) => Some(error.answer(id, true)),
        RpcCall::Single(None) => None,
        RpcCall::Batch(elements) => {
            let answers: Vec<Value> = elements
                .iter()
                .filter_map(|(id, counted)| id.as_ref().map(|id| error.answer(id, *counted)))
                .collect();
            (!answers.is_empty()).then_some(Value::Array(answers))
        }
    };
    with_answer(reply, answer)
}

/// The refusal of a batch split into parts: `refused` holds each refused
/// part's reply and the indices of its messages in the batch, whose `ids`
/// (None: a notification) the answer follows. Each request of a refused
/// part is answered with its part's error, every other request with the
/// first refusal's, "refused with its batch"; the headers are the first
/// refusal's, retried when the last of them has room.
pub(super) fn for_split_batch(
    refused: Vec<(LocalReply, Vec<usize>)>,
    ids: &[Option<Value>],
) -> Option<LocalReply> {
    let errors: Vec<(RpcError, &[usize])> = refused
        .iter()
        .map(|(reply, messages)| (RpcError::of(reply), messages.as_slice()))
        .collect();
    let first = errors.first()?;
    let answers: Vec<Value> = ids
        .iter()
        .enumerate()
        .filter_map(|(at, id)| {
            let id = id.as_ref()?;
            let own = errors.iter().find(|(_, messages)| messages.contains(&at));
            Some(match own {
                Some((error, _)) => error.answer(id, true),
                None => first.0.answer(id, false),
            })
        })
        .collect();
    let retry = refused
        .iter()
        .filter_map(|(reply, _)| reply.header(RETRY_AFTER)?.parse::<u64>().ok())
        .max();
    let mut replies = refused.into_iter().map(|(reply, _)| reply);
    let mut reply = replies.next()?;
    if let Some(seconds) = retry {
        reply.headers.retain(|(name, _)| *name != RETRY_AFTER);
        reply
            .headers
            .push((RETRY_AFTER, retry_after_value(Span::from_secs(seconds))));
    }
    Some(with_answer(
        reply,
        (!answers.is_empty()).then_some(Value::Array(answers)),
    ))
}

/// `reply`'s headers with `answer` as its JSON body on 200, or with no
/// body and its own status when nobody is to be answered.
fn with_answer(reply: LocalReply, answer: Option<Value>) -> LocalReply {
    let mut headers: Vec<(&'static str, String)> = reply
        .headers
        .into_iter()
        .filter(|(name, _)| *name != "content-type")
        .collect();
    match answer {
        Some(answer) => {
            headers.push(("content-type", "application/json".to_string()));
            LocalReply {
                status: 200,
                headers,
                body: answer.to_string().into_bytes(),
            }
        }
        None => LocalReply {
            status: reply.status,
            headers,
            body: Vec::new(),
        },
    }
}
