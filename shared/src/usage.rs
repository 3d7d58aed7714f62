//! A call's real cost read from its response, as the response streams by:
//! a JSON body (`usage.total_tokens`, or a sum of paths such as
//! `usage.input_tokens` + `usage.output_tokens`) or a `text/event-stream`
//! whose usage comes in its events (the last value of each path wins, so
//! OpenAI's final chunk and Anthropic's `message_start` + `message_delta`
//! both read right).
//!
//! Nothing here trusts the provider: the reader keeps at most `max_bytes`
//! (the whole JSON body, or one SSE line), and anything it cannot read —
//! not JSON, a path missing or not a whole number — is an error the
//! caller answers with the unread charge. A JSON body larger than
//! `max_bytes` is read from its first 4 KiB and its last 64 KiB, where
//! OpenAI and Anthropic put its `model` and its `usage` (a body grown
//! large with many choices must not escape its bill).
//!
//! A money limit's usage is priced at the call's model, and again at the
//! model its answer names (a deployment URL, or a provider that ran
//! another model than asked): the dearer of the two is charged.

use std::sync::Arc;

use serde_json::Value;

use crate::json_path::JsonPath;
use crate::policy::cost::CostSpec;
use crate::policy::usage::{UnreadCharge, UnreadName, UsagePaths, UsageSpec};
use crate::price::{CompiledPrices, PriceCost, UsageFormat};

/// Why a response's usage could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("the response is larger than the {0} bytes read for its usage")]
    TooLarge(usize),
    #[error("the response is not JSON: {0}")]
    Malformed(String),
    #[error("no whole number at {0}")]
    Missing(String),
}

/// A limit's [`UsageSpec`], parsed once for every response it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledUsage {
    /// Lowercase, as Envoy gives header names.
    pub header: Option<String>,
    json: Vec<WeightedPath>,
    events: Vec<WeightedPath>,
    pub max_body_bytes: usize,
    /// Tokens charged when the usage cannot be read (None: the estimate).
    unread: Option<u64>,
    /// Streamed requests are asked for their usage ([`crate::stream_usage`]).
    pub ask_stream_usage: bool,
    /// The paths' weighed sum counts this many to one (a million for a
    /// price per million tokens), rounded up.
    per: u64,
    /// A money limit's: its usage priced again at the answer's model.
    reprice: Option<Reprice>,
}

/// Prices to charge a money limit's usage at the model its answer names,
/// when that is dearer than the call's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reprice {
    pub format: UsageFormat,
    pub prices: Arc<CompiledPrices>,
}

/// What a money limit's call is priced at: its model's prices, the set's
/// prices for the model its answer names, and what it is charged when its
/// usage cannot be read (micro-units).
#[derive(Debug, Clone, Copy)]
pub struct Priced<'a> {
    pub format: UsageFormat,
    pub price: &'a crate::price::ModelPrice,
    pub prices: Option<&'a Arc<CompiledPrices>>,
    pub unread_ceiling: Option<u64>,
}

impl CompiledUsage {
    /// From a validated spec (a path that does not parse is left out) of
    /// a limit whose cost is `cost`.
    pub fn new(spec: &UsageSpec, cost: &CostSpec) -> Self {
        let parse = |paths: &UsagePaths| {
            paths
                .iter()
                .filter_map(|(p, weight)| Some((JsonPath::parse(p)?, weight)))
                .collect()
        };
        Self {
            header: spec.header.as_ref().map(|h| h.to_ascii_lowercase()),
            json: parse(&spec.json),
            events: parse(spec.event_paths()),
            max_body_bytes: usize::try_from(spec.max_body_bytes()).unwrap_or(usize::MAX),
            unread: unread_tokens(&spec.unread, cost),
            ask_stream_usage: spec.ask_stream_usage,
            per: 1,
            reprice: None,
        }
    }

    /// The usage of one call of a limit whose cost is money: its answer's
    /// token kinds at `price`, in micro-units (`spec`: the limit's own
    /// `usage`, for its read bound, unread charge and streams).
    pub fn priced(spec: Option<&UsageSpec>, cost: &CostSpec, call: Priced<'_>) -> Self {
        let default = UsageSpec::default();
        let spec = spec.unwrap_or(&default);
        let (json, events) = PriceCost::weighed_usage(call.format, call.price);
        let priced = UsageSpec {
            header: None,
            json,
            events,
            ..spec.clone()
        };
        let plain = Self::new(&priced, cost);
        // Unread: the ceiling, unless the limit names a larger charge.
        let unread = match (plain.unread, call.unread_ceiling) {
            (Some(named), Some(ceiling)) => Some(named.max(ceiling)),
            (named, ceiling) => named.or(ceiling),
        };
        Self {
            per: 1_000_000,
            unread,
            reprice: call.prices.map(|prices| Reprice {
                format: call.format,
                prices: Arc::clone(prices),
            }),
            ..plain
        }
    }

    /// What a call admitted against `estimate` is charged when its usage
    /// could not be read: the unread charge, never less than the estimate.
    pub fn unread_charge(&self, estimate: u64) -> u64 {
        self.unread.map_or(estimate, |n| n.max(estimate))
    }

    /// A reader of the body of a response of `content_type`; None when
    /// the cost comes from a header.
    pub fn body_reader(&self, content_type: Option<&[u8]>) -> Option<UsageReader> {
        if self.header.is_some() {
            return None;
        }
        let mut reader = UsageReader::new(Vec::new(), content_type, self.max_body_bytes);
        reader.per = self.per.max(1);
        reader.reprice = self.reprice.clone();
        let paths = match reader.mode {
            Mode::Json => self.json.clone(),
            Mode::EventStream => self.events.clone(),
        };
        Some(reader.with_paths(paths))
    }
}

/// The cost in a response header's value: a whole number (spaces
/// around allowed), anything else an error.
pub fn usage_from_header(value: Option<&[u8]>, name: &str) -> Result<u64, UsageError> {
    let value = value.ok_or_else(|| UsageError::Missing(name.to_string()))?;
    std::str::from_utf8(value.trim_ascii())
        .ok()
        .filter(|v| v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| {
            UsageError::Malformed(format!("header {name}: {}", String::from_utf8_lossy(value)))
        })
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// The whole body is one JSON document.
    Json,
    /// Server-sent events: `data:` lines, each a JSON document (or `[DONE]`).
    EventStream,
}

/// A path and what each of its units counts (negative: a discount).
pub type WeightedPath = (JsonPath, i64);

/// What of a JSON body larger than the reader's bound it keeps: its
/// start (where the answer names its model) and its end (its usage).
const JSON_HEAD: usize = 4 * 1024;
const JSON_TAIL: usize = 64 * 1024;

/// Reads usage from a response fed chunk by chunk; see the module docs.
#[derive(Debug, Clone)]
pub struct UsageReader {
    paths: Vec<WeightedPath>,
    mode: Mode,
    max_bytes: usize,
    /// The JSON body so far, or the SSE line not yet ended; past the
    /// bound, the JSON body's last bytes.
    pending: Vec<u8>,
    /// A JSON body past the bound: its first bytes (None: within it).
    head: Option<Vec<u8>>,
    /// The latest value seen of each path (event streams).
    latest: Vec<Option<u64>>,
    /// The model the answer names (event streams: the latest).
    model: Option<String>,
    failed: Option<UsageError>,
    /// The weighed sum counts this many to one, rounded up.
    per: u64,
    reprice: Option<Reprice>,
}

impl UsageReader {
    /// A reader for `paths`, for a response of `content_type` (an event
    /// stream when it says `text/event-stream`, JSON otherwise).
    pub fn new(paths: Vec<WeightedPath>, content_type: Option<&[u8]>, max_bytes: usize) -> Self {
        let is_stream = content_type.is_some_and(|ct| {
            ct.len() >= 17 && ct[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        Self {
            latest: vec![None; paths.len()],
            paths,
            mode: if is_stream {
                Mode::EventStream
            } else {
                Mode::Json
            },
            max_bytes,
            pending: Vec::new(),
            head: None,
            model: None,
            failed: None,
            per: 1,
            reprice: None,
        }
    }

    fn with_paths(mut self, paths: Vec<WeightedPath>) -> Self {
        self.latest = vec![None; paths.len()];
        self.paths = paths;
        self
    }

    /// Whether the usage is already known to be unreadable (too large).
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The next piece of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        match self.mode {
            Mode::Json => {
                if self.head.is_none()
                    && self.pending.len().saturating_add(chunk.len()) > self.max_bytes
                {
                    // Past the bound: keep the start, then only the end.
                    let head = self.pending[..self.pending.len().min(JSON_HEAD)].to_vec();
                    self.head = Some(head);
                }
                self.pending.extend_from_slice(chunk);
                if self.head.is_some() {
                    let keep = JSON_TAIL.min(self.max_bytes);
                    if let Some(excess) = self.pending.len().checked_sub(keep) {
                        self.pending.drain(..excess);
                    }
                    if let Some(head) = self.head.as_mut() {
                        let room = JSON_HEAD.saturating_sub(head.len());
                        if room > 0 {
                            // A head cut short by a small first piece: from
                            // what follows, while it is still the start.
                            head.extend(chunk.iter().take(room));
                        }
                    }
                }
            }
            Mode::EventStream => {
                let mut rest = chunk;
                while let Some(end) = rest.iter().position(|b| *b == b'\n') {
                    let (line, after) = rest.split_at(end);
                    if !self.push_line_part(line) {
                        return;
                    }
                    let line = std::mem::take(&mut self.pending);
                    self.event_line(&line);
                    rest = &after[1..];
                }
                self.push_line_part(rest);
            }
        }
    }

    /// Adds to the line being read; false (and failed) past `max_bytes`.
    fn push_line_part(&mut self, part: &[u8]) -> bool {
        if self.pending.len().saturating_add(part.len()) > self.max_bytes {
            self.fail(UsageError::TooLarge(self.max_bytes));
            return false;
        }
        self.pending.extend_from_slice(part);
        true
    }

    fn event_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            // Comments, `event:`, `id:`, blank lines: nothing to read.
            return;
        };
        let data = data.trim_ascii();
        if data.is_empty() || data == b"[DONE]" {
            return;
        }
        // An event that is not JSON says nothing of usage; later events may.
        let Ok(value) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        for ((path, _), latest) in self.paths.iter().zip(self.latest.iter_mut()) {
            if let Some(n) = path.find(&value) {
                *latest = Some(n);
            }
        }
        if self.reprice.is_some() {
            // OpenAI's chunks name it; Anthropic's `message_start` does.
            let named = value
                .get("model")
                .or_else(|| value.get("message").and_then(|m| m.get("model")));
            if let Some(model) = named.and_then(Value::as_str) {
                self.model = Some(model.chars().take(256).collect());
            }
        }
    }

    fn fail(&mut self, error: UsageError) {
        self.pending = Vec::new();
        self.head = None;
        self.failed = Some(error);
    }

    /// The body ended: the sum of the paths' values.
    pub fn finish(mut self) -> Result<u64, UsageError> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        let values: Vec<Option<u64>> = match (&self.mode, self.head.take()) {
            (Mode::Json, None) => {
                let value: Value = serde_json::from_slice(&self.pending)
                    .map_err(|e| UsageError::Malformed(e.to_string()))?;
                if let Some(model) = value.get("model").and_then(Value::as_str) {
                    self.model = Some(model.chars().take(256).collect());
                }
                self.paths.iter().map(|(p, _)| p.find(&value)).collect()
            }
            (Mode::Json, Some(head)) => {
                // Too large to hold: each path's top-level field read from
                // the body's end, the model from its start.
                self.model = last_field(&head, "model", true)
                    .and_then(|v| v.as_str().map(|m| m.chars().take(256).collect()));
                let values: Vec<Option<u64>> = self
                    .paths
                    .iter()
                    .map(|(p, _)| p.find_in_field(|key| last_field(&self.pending, key, false)))
                    .collect();
                if values.iter().all(Option::is_none) {
                    return Err(UsageError::TooLarge(self.max_bytes));
                }
                values
            }
            (Mode::EventStream, _) => {
                let last = std::mem::take(&mut self.pending);
                self.event_line(&last);
                self.latest.clone()
            }
        };
        let weights: Vec<i64> = self.paths.iter().map(|(_, w)| *w).collect();
        let mut total = self.weighed(&weights, &values)?;
        if let Some(dearer) = self.answer_weights() {
            total = total.max(self.weighed(&dearer, &values)?);
        }
        Ok(total)
    }

    /// The values weighed, summed and counted `per` to one, rounded up.
    fn weighed(&self, weights: &[i64], values: &[Option<u64>]) -> Result<u64, UsageError> {
        // Weights times u64 values fit an i128 whatever the answer says.
        let mut total: i128 = 0;
        for (((path, _), weight), value) in self.paths.iter().zip(weights).zip(values) {
            match value {
                Some(n) => total = total.saturating_add(i128::from(*weight) * i128::from(*n)),
                // A discount that is not there takes nothing off, nor a
                // path that counts nothing.
                None if *weight <= 0 => {}
                None => return Err(UsageError::Missing(path.as_str().to_string())),
            }
        }
        let per = i128::from(self.per.max(1));
        let total = total.max(0).saturating_add(per - 1) / per;
        Ok(u64::try_from(total).unwrap_or(u64::MAX))
    }

    /// A money limit's weights at the model its answer names, the same
    /// paths in the same order (None: it names none, or no price).
    fn answer_weights(&self) -> Option<Vec<i64>> {
        let reprice = self.reprice.as_ref()?;
        let price = reprice.prices.of(Some(self.model.as_deref()?))?;
        let (json, events) = PriceCost::weighed_usage(reprice.format, price);
        let paths = match self.mode {
            Mode::Json => json,
            Mode::EventStream => events,
        };
        (paths.len() == self.paths.len()).then(|| paths.iter().map(|(_, w)| w).collect())
    }

    /// The model the answer named, once its body was read.
    pub fn answer_model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// Bytes this reader holds now (the body so far, or a line).
    pub fn buffered(&self) -> usize {
        self.pending.len() + self.head.as_ref().map_or(0, Vec::len)
    }

    /// Stops reading (the worker holds too much already): the usage is
    /// unread, and the buffer is freed.
    pub fn give_up(&mut self) {
        self.fail(UsageError::TooLarge(self.max_bytes));
    }
}

/// The value of the field `key` in a piece of a JSON document: at its
/// last (or, `first`, its first) `"key":`. Inside a JSON string every
/// quote is escaped, so the text a provider's model wrote cannot hold
/// such a field; what follows the colon must parse as one value.
fn last_field(bytes: &[u8], key: &str, first: bool) -> Option<Value> {
    let needle = format!("\"{key}\"");
    let needle = needle.as_bytes();
    let starts: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    let ordered: Box<dyn Iterator<Item = &usize>> = if first {
        Box::new(starts.iter())
    } else {
        Box::new(starts.iter().rev())
    };
    for &at in ordered {
        let after = bytes.get(at + needle.len()..)?;
        let rest = after.trim_ascii_start();
        let Some(value) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Value>();
        if let Some(Ok(v)) = values.next() {
            return Some(v);
        }
    }
    None
}

/// The tokens charged for `unread` usage of a limit whose cost is `cost`
/// (None: the estimate).
fn unread_tokens(unread: &UnreadCharge, cost: &CostSpec) -> Option<u64> {
    // Money's estimate already counts the most output the call asked
    // for at its model's price: "max" is that estimate.
    if cost.is_price() {
        return match unread {
            UnreadCharge::Tokens(n) => Some(*n),
            UnreadCharge::Named(_) => None,
        };
    }
    match unread {
        UnreadCharge::Named(UnreadName::Max) => Some(cost.max_cost()),
        UnreadCharge::Named(UnreadName::Estimate) => None,
        UnreadCharge::Tokens(n) => Some(*n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(p: &[&str]) -> Vec<WeightedPath> {
        p.iter()
            .filter_map(|p| Some((JsonPath::parse(p)?, 1)))
            .collect()
    }

    fn read(p: &[&str], content_type: &str, chunks: &[&[u8]]) -> Result<u64, UsageError> {
        let mut r = UsageReader::new(paths(p), Some(content_type.as_bytes()), 4096);
        for c in chunks {
            r.feed(c);
        }
        r.finish()
    }

    #[test]
    fn a_json_body_in_pieces_gives_the_sum_of_its_paths() {
        let body: &[&[u8]] = &[
            br#"{"id": "x", "usage": {"input_"#,
            br#"tokens": 120, "output_tokens": 80}}"#,
        ];
        assert_eq!(
            read(
                &["usage.input_tokens", "usage.output_tokens"],
                "application/json",
                body
            ),
            Ok(200)
        );
        assert_eq!(
            read(&["usage.total_tokens"], "application/json", body),
            Err(UsageError::Missing("usage.total_tokens".into()))
        );
    }

    #[test]
    fn an_openai_stream_reads_its_last_chunk() {
        let stream: &[&[u8]] = &[
            b"data: {\"choices\": [{\"delta\": {\"content\": \"Hi\"}}], \"usage\": null}\n\n",
            b"data: {\"choices\": [], \"usage\": {\"total_tokens\": 4",
            b"2}}\n\ndata: [DONE]\n\n",
        ];
        assert_eq!(
            read(
                &["usage.total_tokens"],
                "text/event-stream; charset=utf-8",
                stream
            ),
            Ok(42)
        );
    }

    #[test]
    fn an_anthropic_stream_sums_input_from_the_start_and_output_from_the_last_delta() {
        let stream: &[&[u8]] = &[
            b"event: message_start\r\ndata: {\"type\": \"message_start\", \"message\": {\"usage\": {\"input_tokens\": 25, \"output_tokens\": 1}}}\r\n\r\n",
            b"event: message_delta\r\ndata: {\"type\": \"message_delta\", \"usage\": {\"output_tokens\": 10}}\r\n\r\n",
            b"event: message_delta\r\ndata: {\"type\": \"message_delta\", \"usage\": {\"output_tokens\": 15}}\r\n\r\n",
            b"event: message_stop\r\ndata: {\"type\": \"message_stop\"}\r\n\r\n",
        ];
        assert_eq!(
            read(
                &["message.usage.input_tokens", "usage.output_tokens"],
                "text/event-stream",
                stream
            ),
            Ok(40)
        );
    }

    #[test]
    fn hostile_responses_are_errors_never_panics() {
        let p = ["usage.total_tokens"];
        assert!(matches!(
            read(&p, "application/json", &[b"not json"]),
            Err(UsageError::Malformed(_))
        ));
        assert_eq!(
            read(
                &p,
                "application/json",
                &[br#"{"usage": {"total_tokens": -5}}"#]
            ),
            Err(UsageError::Missing("usage.total_tokens".into()))
        );
        assert_eq!(
            read(
                &p,
                "application/json",
                &[br#"{"usage": {"total_tokens": 1.5}}"#]
            ),
            Err(UsageError::Missing("usage.total_tokens".into()))
        );
        assert_eq!(
            read(&p, "application/json", &[&[b' '; 5000]]),
            Err(UsageError::TooLarge(4096))
        );
        // A line longer than the bound, even if split across chunks.
        let long = vec![b'x'; 3000];
        assert_eq!(
            read(&p, "text/event-stream", &[b"data: ", &long, &long]),
            Err(UsageError::TooLarge(4096))
        );
        // Huge numbers saturate rather than overflow.
        assert_eq!(
            read(
                &["a", "b"],
                "application/json",
                &[br#"{"a": 18446744073709551615, "b": 18446744073709551615}"#]
            ),
            Ok(u64::MAX)
        );
        assert_eq!(JsonPath::parse(""), None);
        assert_eq!(JsonPath::parse("usage..x"), None);
    }

    /// Third review, item 2: an answer past the bound is read from its
    /// end (its usage) and its start (its model); a body without them
    /// there is too large. A field's name inside a string (escaped
    /// quotes) is never taken for the field.
    #[test]
    fn an_answer_past_the_bound_is_read_from_its_end() {
        let p = ["usage.prompt_tokens", "usage.completion_tokens"];
        let filler = format!(
            r#"\"usage\": {{\"completion_tokens\": 1}} {}"#,
            "x".repeat(9000)
        );
        let body = format!(
            r#"{{"model": "gpt-4o", "choices": [{{"message": {{"content": "{filler}"}}}}], "usage": {{"prompt_tokens": 20, "completion_tokens": 64000}}}}"#
        );
        let mut r = UsageReader::new(paths(&p), Some(b"application/json"), 4096);
        for piece in body.as_bytes().chunks(1000) {
            r.feed(piece);
        }
        assert!(r.buffered() <= 4096 + JSON_HEAD, "{}", r.buffered());
        assert_eq!(r.finish(), Ok(64_020));
        let mut r = UsageReader::new(paths(&p), Some(b"application/json"), 4096);
        r.feed(&vec![b' '; 10_000]);
        assert_eq!(r.finish(), Err(UsageError::TooLarge(4096)));
    }

    /// Item 7: a money limit's usage is priced again at the model its
    /// answer names, JSON or stream, when dearer.
    #[test]
    fn the_model_that_answered_prices_the_usage_when_dearer() {
        use crate::price::{ModelPrice, Money, PriceTable};
        let price = |input: &str, output: &str| ModelPrice {
            input: Money::parse(input).unwrap_or_default(),
            output: Money::parse(output).unwrap_or_default(),
            cached_input: None,
        };
        let table = PriceTable {
            currency: "USD".into(),
            models: [
                ("gpt-4o-mini".to_string(), price("0.15", "0.6")),
                ("gpt-4o*".to_string(), price("2.5", "10")),
            ]
            .into_iter()
            .collect(),
            default: None,
            tools: Default::default(),
            tool_default: None,
        };
        let prices = Arc::new(CompiledPrices::new(&table));
        let mini = price("0.15", "0.6");
        let usage = CompiledUsage::priced(
            None,
            &CostSpec::Price(crate::policy::PriceCostSpec::Word(
                crate::policy::PriceWord::Price,
            )),
            Priced {
                format: UsageFormat::Openai,
                price: &mini,
                prices: Some(&prices),
                unread_ceiling: None,
            },
        );
        let read = |content_type: &str, body: &str| {
            let mut r = usage
                .body_reader(Some(content_type.as_bytes()))
                .unwrap_or_else(|| UsageReader::new(Vec::new(), None, 1));
            r.feed(body.as_bytes());
            r.finish()
        };
        let json = |model: &str| {
            format!(
                r#"{{"model": "{model}", "usage": {{"prompt_tokens": 1000, "completion_tokens": 1000}}}}"#
            )
        };
        // gpt-4o's 2 500 + 10 000, mini's 150 + 600.
        assert_eq!(
            read("application/json", &json("gpt-4o-2024-08-06")),
            Ok(12_500)
        );
        assert_eq!(read("application/json", &json("gpt-4o-mini")), Ok(750));
        assert_eq!(read("application/json", &json("unknown")), Ok(750));
        let stream = "data: {\"model\": \"gpt-4o-2024-08-06\", \"choices\": []}\n\n\
                      data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 1000, \"completion_tokens\": 1000}}\n\n";
        assert_eq!(read("text/event-stream", stream), Ok(12_500));
    }

    fn weighed(p: &[(&str, i64)]) -> Vec<WeightedPath> {
        p.iter()
            .filter_map(|(p, w)| Some((JsonPath::parse(p)?, *w)))
            .collect()
    }

    /// Weighed paths: output counted 4 times, cached prompt tokens taken
    /// off; a discount that is not there takes nothing off, a counted path
    /// that is not there leaves the usage missing, and the sum never goes
    /// below 0 or past u64.
    #[test]
    fn weights_count_kinds_of_tokens_and_a_missing_discount_is_zero() {
        let weights = [
            ("usage.prompt_tokens", 1),
            ("usage.completion_tokens", 4),
            ("usage.prompt_tokens_details.cached_tokens", -1),
        ];
        let read = |body: &str, content_type: &str| {
            let mut r = UsageReader::new(weighed(&weights), Some(content_type.as_bytes()), 4096);
            r.feed(body.as_bytes());
            r.finish()
        };
        let json = "application/json";
        assert_eq!(
            read(
                r#"{"usage": {"prompt_tokens": 1000, "completion_tokens": 50, "prompt_tokens_details": {"cached_tokens": 800}}}"#,
                json
            ),
            Ok(1000 + 200 - 800)
        );
        assert_eq!(
            read(
                r#"{"usage": {"prompt_tokens": 1000, "completion_tokens": 50}}"#,
                json
            ),
            Ok(1200)
        );
        assert_eq!(
            read(r#"{"usage": {"prompt_tokens": 1000}}"#, json),
            Err(UsageError::Missing("usage.completion_tokens".into()))
        );
        // A hostile answer: more cached than prompted, numbers at u64::MAX.
        assert_eq!(
            read(
                r#"{"usage": {"prompt_tokens": 1, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 18446744073709551615}}}"#,
                json
            ),
            Ok(0)
        );
        assert_eq!(
            read(
                r#"{"usage": {"prompt_tokens": 18446744073709551615, "completion_tokens": 18446744073709551615}}"#,
                json
            ),
            Ok(u64::MAX)
        );
        // A stream: the last value of each path across its events.
        let stream = "data: {\"usage\": null}\n\ndata: {\"usage\": {\"prompt_tokens\": 10, \"completion_tokens\": 5, \"prompt_tokens_details\": {\"cached_tokens\": 4}}}\n\ndata: [DONE]\n\n";
        assert_eq!(read(stream, "text/event-stream"), Ok(10 + 20 - 4));
    }
}
