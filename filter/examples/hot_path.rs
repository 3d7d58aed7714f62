//! The filter's per-call work, natively, for a profiler: the worker decides
//! `--calls` requests to one policy, each ended as Envoy ends a stream,
//! against an in-memory host that costs next to nothing. Under callgrind
//! (docs/PERFORMANCE.md) it names the functions where the filter's own
//! instructions go; in Envoy, host calls and V8 add to them.
//!
//! cargo build --release -p sluice-filter --example hot_path
//! valgrind --tool=callgrind --toggle-collect='*decide_calls*' \
//!   target/release/examples/hot_path --policy concurrency
//!
//! `--gap-us 250` spaces the calls as one worker at 4 000 calls a second
//! (`make bench` scenario 6's pace), where a prefetch serves 20 calls.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::process::ExitCode;

use sluice_filter::host::{Host, Level, SetError};
use sluice_filter::worker::{Verdict, Worker};
use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_filter_core::plugin::parse_plugin_config;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};

/// The variants scenario 6 of `make bench` counts, far from their limit.
const RATE: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 1000000}"#;

fn policy(variant: &str) -> Option<String> {
    let extra = match variant {
        "rate" => "",
        "concurrency" => r#", "concurrency": {"max_in_flight": 100000}"#,
        "per-key" => r#", "key": {"header": "x-api-key", "max_keys": 10000}"#,
        // A day's budget beside the rate: in windows of 24 h since the
        // epoch, or on Berlin's calendar (what a calendar window costs).
        "daily" => {
            r#", "limits": [{"name": "day", "rate": {"requests": 1000000000, "period": "1d", "algorithm": "fixed_window"}}]"#
        }
        "calendar-day" => {
            r#", "limits": [{"name": "day", "rate": {"requests": 1000000000, "period": "calendar_day", "algorithm": "fixed_window", "time_zone": "Europe/Berlin"}}]"#
        }
        _ => return None,
    };
    Some(format!(
        r#"{{"instance": "profile", "fallback": {{"version": 1, "policies": [{{"name": "bench", "match": {{"host": "api.bench.example"}}, {RATE}{extra}}}]}}}}"#
    ))
}

/// Shared data in a map, a clock moved by hand, and nothing else.
#[derive(Default)]
struct QuietHost {
    now: Cell<Instant>,
    shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    /// Host calls made, by kind (in Envoy each crosses out of the VM):
    /// counters cheap enough not to blur the profile.
    calls: [Cell<u64>; HOST_CALLS.len()],
    /// The tick period the worker last asked for: ticks come as Envoy's
    /// would (at 4 000 calls a second, one per 80 calls while a
    /// prefetch holds slots).
    tick: Cell<Option<Span>>,
    ticks: Cell<u64>,
}

const HOST_CALLS: [&str; 4] = ["now", "shared_get", "shared_set", "increment_metric"];

impl QuietHost {
    fn count(&self, kind: usize) {
        self.calls[kind].set(self.calls[kind].get() + 1);
    }
}

impl Host for QuietHost {
    fn now(&self) -> Instant {
        self.count(0);
        self.now.get()
    }

    fn monotonic(&self) -> Option<Instant> {
        self.count(0);
        Some(self.now.get())
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.count(1);
        match self.shared.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.count(2);
        let mut shared = self.shared.borrow_mut();
        if let (Some(cas), Some((_, held))) = (cas, shared.get(key)) {
            if cas != 0 && cas != *held {
                return Err(SetError::CasMismatch);
            }
        }
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        shared.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }

    fn log(&self, _level: Level, _message: &str) {}

    fn define_counter(&self, _name: &str) -> Option<u32> {
        Some(1)
    }

    fn define_gauge(&self, _name: &str) -> Option<u32> {
        Some(1)
    }

    fn increment_metric(&self, _id: u32, _delta: i64) {
        self.count(3);
    }

    fn reply(&self, _context_id: u32, _status: u32, _: &[(&str, &str)], _: &[u8]) -> bool {
        true
    }

    fn remove_request_header(&self, _name: &str) {}

    fn set_request_header(&self, _context_id: u32, _name: &str, _value: &str) -> bool {
        true
    }

    fn set_log_field(&self, _context_id: u32, _field: &str, _value: &str) -> bool {
        true
    }

    fn replace_request_body(&self, _old_len: usize, _body: &[u8]) -> bool {
        true
    }

    fn resume(&self, _context_id: u32) -> bool {
        true
    }

    fn set_tick_period(&self, period: Span) {
        self.tick.set(Some(period));
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        true
    }

    fn dispatch_http_call(&self, _: &str, _: &[(&str, &str)], _: &[u8], _: Span) -> Option<u32> {
        None
    }
}

struct Call {
    key: String,
}

impl RequestHeaders for Call {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        match name {
            ":authority" => Some(Cow::Borrowed(b"api.bench.example")),
            "x-api-key" => Some(Cow::Borrowed(self.key.as_bytes())),
            _ => None,
        }
    }
}

/// Calls spaced `gap` apart (by default 20 µs: 50 000 a second), as one
/// Envoy worker under load; each call's stream ends before the next
/// starts, and the worker ticks at the period it asked for. Returns how
/// many were let through.
#[inline(never)]
fn decide_calls(worker: &mut Worker, host: &QuietHost, calls: u32, gap: Span) -> u32 {
    let mut passed = 0;
    let call = Call { key: String::new() };
    let mut call = call;
    let mut last_tick = host.now.get();
    for n in 0..calls {
        host.now.set(host.now.get() + gap);
        if let Some(period) = host.tick.get() {
            if host.now.get() - last_tick >= period {
                last_tick = host.now.get();
                host.ticks.set(host.ticks.get() + 1);
                worker.on_tick(host);
            }
        }
        let context_id = n + 2;
        call.key.clear();
        call.key.push_str(KEYS[n as usize % KEYS.len()]);
        if matches!(
            worker.on_request(host, context_id, &call),
            Verdict::Continue
        ) {
            passed += 1;
        }
        worker.on_answer_headers(host, context_id, &call, true);
        worker.on_stream_end(host, context_id);
    }
    passed
}

const KEYS: [&str; 8] = ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7"];

fn main() -> ExitCode {
    let mut variant = "concurrency".to_string();
    let mut calls: u32 = 200_000;
    let mut gap = Span::from_nanos(20_000);
    let mut log_decisions = true;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--policy", Some(v)) => variant = v,
            ("--calls", Some(n)) => match n.parse() {
                Ok(n) => calls = n,
                Err(e) => {
                    eprintln!("--calls {n}: {e}");
                    return ExitCode::FAILURE;
                }
            },
            ("--gap-us", Some(n)) => match n.parse::<u64>() {
                Ok(n) => gap = Span::from_nanos(n * 1_000),
                Err(e) => {
                    eprintln!("--gap-us {n}: {e}");
                    return ExitCode::FAILURE;
                }
            },
            ("--log-decisions", Some(v)) if v == "on" || v == "off" => log_decisions = v == "on",
            _ => {
                eprintln!(
                    "usage: hot_path [--policy rate|concurrency|per-key|daily|calendar-day] [--calls N] [--gap-us MICROSECONDS] [--log-decisions on|off]"
                );
                return ExitCode::FAILURE;
            }
        }
    }
    let Some(json) = policy(&variant) else {
        eprintln!(
            "unknown policy variant {variant}: rate, concurrency, per-key, daily or calendar-day"
        );
        return ExitCode::FAILURE;
    };
    let config = match parse_plugin_config(json.as_bytes()) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors:?}");
            return ExitCode::FAILURE;
        }
    };
    let host = QuietHost::default();
    host.now.set(Instant::from_nanos(1_000_000_000_000_000));
    let mut worker = Worker::new(&host);
    // As the plugin's default (on), unless asked otherwise.
    worker.log_decisions(log_decisions && config.log_decisions);
    worker.install(&host, CompiledPolicySet::from_validated(config.fallback));
    worker.start_ticking(&host);
    let passed = decide_calls(&mut worker, &host, calls, gap);
    println!("{variant}: {passed} of {calls} calls let through");
    for (kind, n) in HOST_CALLS.iter().zip(&host.calls) {
        let per_call = n.get() as f64 / f64::from(calls.max(1));
        println!("  host calls {kind}: {per_call:.3} per call");
    }
    let ticks = host.ticks.get() as f64 / f64::from(calls.max(1));
    println!("  ticks: {ticks:.4} per call");
    if passed == calls {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
