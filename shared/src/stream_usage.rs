//! Usage that is always there for OpenAI-style streams
//! (`usage.ask_stream_usage`): a streamed request that does not ask for
//! its usage gets `"stream_options": {"include_usage": true}` added, and
//! what the provider then adds to the answer (a last chunk with no
//! choices and the usage; `"usage": null` in every other chunk) is taken
//! out again before the caller sees it, so the caller's answer is the one
//! it would have had, byte for byte, and Sluice still reads the usage.
//!
//! Nothing here trusts either side: a body that is not a JSON object
//! asking for a stream is left as it is, and an event held back to be
//! looked at is bounded ([`MAX_HELD_EVENT`]); a longer one goes on as it
//! is.

use serde_json::Value;

/// The request body asking for its stream's usage, or None when it is to
/// go as it is: not a JSON object, not `"stream": true`, or already asking
/// (`stream_options.include_usage: true`).
pub fn ask_for_usage(body: &[u8]) -> Option<Vec<u8>> {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if map.get("stream") != Some(&Value::Bool(true)) {
        return None;
    }
    match map.get_mut("stream_options") {
        None => {
            // The caller's bytes kept, the field put first.
            let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
            let mut asked = Vec::with_capacity(body.len() + 40);
            asked.extend_from_slice(&body[..=open]);
            asked.extend_from_slice(br#""stream_options":{"include_usage":true},"#);
            asked.extend_from_slice(&body[open + 1..]);
            Some(asked)
        }
        Some(Value::Object(options)) => {
            if options.get("include_usage") == Some(&Value::Bool(true)) {
                return None;
            }
            options.insert("include_usage".into(), Value::Bool(true));
            serde_json::to_vec(&Value::Object(map)).ok()
        }
        // Not an object: the provider would refuse it either way.
        Some(_) => None,
    }
}

/// The most of one event held back to be looked at; a longer one (no
/// usage chunk is) goes on as it comes.
pub const MAX_HELD_EVENT: usize = 64 * 1024;

/// Takes what asking added out of a `text/event-stream` answer, as its
/// pieces pass: events are held until their end (a blank line) and then
/// passed on as they came, less the usage-only chunk and a chunk's
/// `"usage":null`.
#[derive(Debug, Default)]
pub struct UsageChunkStripper {
    /// The start of an event not ended yet.
    held: Vec<u8>,
    /// The event now passing was too long to hold: its rest goes on as it
    /// comes, up to its end.
    passing: bool,
    /// Usage-only chunks taken out so far.
    pub stripped: u32,
}

impl UsageChunkStripper {
    /// What of `chunk` the caller gets now; with `end`, everything left.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len());
        let mut rest = chunk;
        loop {
            if self.passing {
                match event_end(&self.held, rest) {
                    Some(at) => {
                        // `held` keeps the end of the previous piece only to
                        // find a boundary split between pieces; it was sent.
                        self.held.clear();
                        out.extend_from_slice(&rest[..at]);
                        rest = &rest[at..];
                        self.passing = false;
                    }
                    None => {
                        out.extend_from_slice(rest);
                        self.keep_tail(rest);
                        break;
                    }
                }
                continue;
            }
            match event_end(&self.held, rest) {
                Some(at) => {
                    let mut event = std::mem::take(&mut self.held);
                    event.extend_from_slice(&rest[..at]);
                    rest = &rest[at..];
                    self.pass(&event, &mut out);
                }
                None => {
                    self.held.extend_from_slice(rest);
                    if self.held.len() > MAX_HELD_EVENT {
                        out.append(&mut self.held);
                        self.passing = true;
                        self.keep_tail(&[]);
                    }
                    break;
                }
            }
        }
        if end {
            if self.passing {
                self.held.clear();
            } else {
                let event = std::mem::take(&mut self.held);
                self.pass(&event, &mut out);
            }
        }
        out
    }

    /// Passes one whole event on, unless it is the usage-only chunk.
    fn pass(&mut self, event: &[u8], out: &mut Vec<u8>) {
        match look_at(event) {
            Added::UsageChunk => self.stripped += 1,
            Added::NullUsage(without) => out.extend_from_slice(&without),
            Added::Nothing => out.extend_from_slice(event),
        }
    }

    /// While passing, the last bytes sent: a boundary may straddle pieces.
    fn keep_tail(&mut self, sent: &[u8]) {
        let mut tail = std::mem::take(&mut self.held);
        tail.extend_from_slice(sent);
        let from = tail.len().saturating_sub(3);
        self.held = tail.split_off(from);
    }
}

/// Where in `next` the event begun in `held` ends (just past its blank
/// line: `\n\n`, `\r\n\r\n` or `\r\r`), if it does.
fn event_end(held: &[u8], next: &[u8]) -> Option<usize> {
    // A boundary may begin in what is held: look at its last 3 bytes too.
    let carried = &held[held.len().saturating_sub(3)..];
    let mut window: Vec<u8> = carried.to_vec();
    for (i, &b) in next.iter().enumerate() {
        window.push(b);
        let n = window.len();
        let ends = (n >= 2 && (&window[n - 2..] == b"\n\n" || &window[n - 2..] == b"\r\r"))
            || (n >= 4 && &window[n - 4..] == b"\r\n\r\n");
        if ends {
            return Some(i + 1);
        }
        if window.len() > 8 {
            window.drain(..window.len() - 4);
        }
    }
    None
}

enum Added {
    /// `data: {... "choices": [], "usage": {...}}`: all of it added.
    UsageChunk,
    /// The event less its `"usage":null`.
    NullUsage(Vec<u8>),
    Nothing,
}

/// Whether the event is, or carries, what asking for usage added.
fn look_at(event: &[u8]) -> Added {
    let Some(data) = single_data(event) else {
        return Added::Nothing;
    };
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(data) else {
        return Added::Nothing;
    };
    let no_choices = matches!(map.get("choices"), Some(Value::Array(c)) if c.is_empty());
    match map.get("usage") {
        Some(Value::Object(_)) if no_choices => Added::UsageChunk,
        Some(Value::Null) => {
            without_null_usage(event, &map).map_or(Added::Nothing, Added::NullUsage)
        }
        _ => Added::Nothing,
    }
}

/// The JSON of an event made of one `data:` line (OpenAI's), if it is.
fn single_data(event: &[u8]) -> Option<&[u8]> {
    let text = event.strip_prefix(b"data:")?;
    let line_end = text.iter().position(|&b| b == b'\n' || b == b'\r')?;
    let rest = &text[line_end..];
    if !rest.iter().all(|&b| b == b'\n' || b == b'\r') {
        return None;
    }
    Some(text[..line_end].trim_ascii())
}

/// The event with its top-level `"usage":null` cut out (and the comma
/// that joined it), when the cut leaves exactly the same object less that
/// field; None otherwise (the event then goes as it is).
fn without_null_usage(event: &[u8], map: &serde_json::Map<String, Value>) -> Option<Vec<u8>> {
    const FIELD: &[u8] = b"\"usage\":null";
    let at = event.windows(FIELD.len()).position(|w| w == FIELD)?;
    let (start, end) = if at > 0 && event[at - 1] == b',' {
        (at - 1, at + FIELD.len())
    } else if event.get(at + FIELD.len()) == Some(&b',') {
        (at, at + FIELD.len() + 1)
    } else {
        return None;
    };
    let mut cut = event[..start].to_vec();
    cut.extend_from_slice(&event[end..]);
    let mut expected = map.clone();
    expected.remove("usage");
    let data = single_data(&cut)?;
    match serde_json::from_slice::<Value>(data) {
        Ok(Value::Object(left)) if left == expected => Some(cut),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const CONTENT: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok \"}}]}\n\n";
    const CONTENT_ASKED: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok \"}}],\"usage\":null}\n\n";
    const USAGE: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4,\"total_tokens\":13}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    #[test]
    fn a_streamed_request_is_asked_for_its_usage_keeping_its_bytes() {
        let body = br#" {"model":"gpt-4o","stream":true,"messages":[]}"#;
        let asked = ask_for_usage(body).unwrap_or_default();
        assert_eq!(
            asked,
            br#" {"stream_options":{"include_usage":true},"model":"gpt-4o","stream":true,"messages":[]}"#
        );
        // Options without include_usage (or with it false) get it.
        let asked = ask_for_usage(br#"{"stream":true,"stream_options":{"include_usage":false}}"#)
            .unwrap_or_default();
        let v: Value = serde_json::from_slice(&asked).unwrap_or_default();
        assert_eq!(v["stream_options"]["include_usage"], Value::Bool(true));
        // Left as they are: already asking, not a stream, not an object.
        for body in [
            &br#"{"stream":true,"stream_options":{"include_usage":true}}"#[..],
            br#"{"stream":false}"#,
            br#"{"stream":"true"}"#,
            br#"{"model":"m"}"#,
            br#"[{"stream":true}]"#,
            br#"{"stream":true,"stream_options":7}"#,
            b"not json",
            b"",
        ] {
            assert_eq!(
                ask_for_usage(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn what_asking_added_is_taken_out_and_the_rest_passes_as_it_came() {
        let asked = [CONTENT_ASKED, CONTENT_ASKED, USAGE, DONE].concat();
        let mut s = UsageChunkStripper::default();
        let out = s.feed(asked.as_bytes(), true);
        assert_eq!(
            String::from_utf8_lossy(&out),
            [CONTENT, CONTENT, DONE].concat()
        );
        assert_eq!(s.stripped, 1);
        // Events it did not add pass untouched, usage with choices too.
        let other = "event: ping\ndata: {}\n\ndata: {\"choices\":[{}],\"usage\":{\"total_tokens\":3}}\n\n: comment\n\n";
        let mut s = UsageChunkStripper::default();
        assert_eq!(s.feed(other.as_bytes(), true), other.as_bytes());
        assert_eq!(s.stripped, 0);
    }

    #[test]
    fn a_null_usage_only_in_a_nested_place_or_spaced_stays() {
        for event in [
            "data: {\"choices\":[{\"delta\":{\"usage\":null}}]}\n\n",
            "data: {\"choices\":[], \"usage\": null}\n\n",
            "data: {\"usage\":null}\n\n",
        ] {
            let mut s = UsageChunkStripper::default();
            assert_eq!(s.feed(event.as_bytes(), true), event.as_bytes(), "{event}");
        }
        let first = "data: {\"usage\":null,\"choices\":[{}]}\n\n";
        let mut s = UsageChunkStripper::default();
        assert_eq!(
            s.feed(first.as_bytes(), true),
            b"data: {\"choices\":[{}]}\n\n"
        );
    }

    #[test]
    fn an_event_too_long_to_hold_goes_on_as_it_comes() {
        let long = format!(
            "data: {{\"choices\":[],\"usage\":{{\"x\":\"{}\"}}}}\n\n",
            "y".repeat(2 * MAX_HELD_EVENT)
        );
        let mut s = UsageChunkStripper::default();
        let mut out = Vec::new();
        for piece in long.as_bytes().chunks(1000) {
            let sent = s.feed(piece, false);
            assert!(s.held.len() <= MAX_HELD_EVENT + 1000);
            out.extend(sent);
        }
        out.extend(s.feed(USAGE.as_bytes(), true));
        assert!(
            out == long.as_bytes(),
            "{} bytes of {}",
            out.len(),
            long.len()
        );
        assert_eq!(s.stripped, 1, "the next event is looked at again");
    }

    fn event() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(CONTENT.to_string()),
            Just(CONTENT_ASKED.to_string()),
            Just(USAGE.to_string()),
            Just(DONE.to_string()),
            Just(USAGE.replace("\n\n", "\r\n\r\n")),
            "[ -~]{0,40}".prop_map(|s| format!("data: {s}\n\n")),
            "[ -~\n]{0,40}",
        ]
    }

    proptest! {
        /// However the answer is cut into pieces, the caller gets the same
        /// bytes as from the whole answer at once.
        #[test]
        fn pieces_do_not_change_what_the_caller_gets(
            events in prop::collection::vec(event(), 0..12),
            cuts in prop::collection::vec(0usize..2000, 0..12),
        ) {
            let answer = events.concat().into_bytes();
            let whole = UsageChunkStripper::default().feed(&answer, true);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (answer.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = UsageChunkStripper::default();
            let mut out = Vec::new();
            let mut from = 0;
            for cut in cuts {
                out.extend(s.feed(&answer[from..cut], false));
                from = cut;
            }
            out.extend(s.feed(&answer[from..], true));
            prop_assert_eq!(out, whole);
        }
    }
}
