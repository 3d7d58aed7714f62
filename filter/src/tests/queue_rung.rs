//! The budget ladder's queue rung through the worker, in virtual time:
//! past its line a window's rest is released evenly until the window
//! renews; a call ahead of that pace waits in the policy's queue until
//! the pace reaches it, or is refused at once when that is further than
//! its `max_wait`, naming the limit.

use crate::testing::FakeHost;
use crate::tests::{req, status, worker, T0};
use crate::worker::{LocalReply, StreamAction, Verdict, Worker};

const LLM: &[u8] = b"api.llm.example";

/// Ten calls per 100 s window (T0 starts one), the last five paced; a
/// queued call waits at most `max_wait`. `key` keys the policy and the
/// limit alike (each key queues on its own).
fn paced(max_wait: &str, key: &str) -> String {
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}},
         "rate": {{"requests": 1000, "period": "1s"}}{key},
         "on_limit": {{"action": "queue", "max_wait": "{max_wait}", "max_queue": 100}},
         "limits": [{{"name": "budget", "rate": {{"requests": 10, "period": "100s", "algorithm": "fixed_window"}},
                      "queue": {{"at": 0.5}}{key}}}]}}]}}"#
    )
}

fn arrive(host: &FakeHost, w: &mut Worker, ids: std::ops::Range<u32>, team: &[u8]) -> Vec<u32> {
    let headers = [("x-team", team)];
    let r = req(LLM, &headers);
    ids.map(|id| status(&w.on_request(host, id, r.as_slice())))
        .collect()
}

/// Ticks every 10 ms for `ms`: (ms into the run, stream) resumed, and
/// refused with the reply.
type Refused = Vec<(u64, u32, LocalReply)>;

fn run(host: &FakeHost, w: &mut Worker, ms: u64) -> (Vec<(u64, u32)>, Refused) {
    let (mut resumed, mut refused) = (Vec::new(), Vec::new());
    for at in (10..=ms).step_by(10) {
        host.advance_ms(10);
        for action in w.on_tick(host) {
            match action {
                StreamAction::Resume(ctx) => resumed.push((at, ctx)),
                StreamAction::Reply(ctx, reply) => refused.push((at, ctx, reply)),
                StreamAction::SetHeader(..) | StreamAction::LogField(..) => {}
            }
        }
    }
    (resumed, refused)
}

#[test]
fn past_its_line_a_budget_lets_calls_go_at_the_pace_of_its_rest() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &paced("30s", ""));
    // Half the window's ten at once; the sixth waits.
    assert_eq!(
        arrive(&host, &mut w, 1..7, b"a"),
        [200, 200, 200, 200, 200, 0]
    );
    // The rest (five) is released over the window's 100 s: one per 20 s.
    let (resumed, refused) = run(&host, &mut w, 25_000);
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(resumed, [(20_000, 6)]);
    // At 25 s the seventh's turn is 40 s and the eighth's 60 s: the
    // eighth's wait runs out first (at 55 s), refused in the budget's name.
    assert_eq!(arrive(&host, &mut w, 7..9, b"a"), [0, 0]);
    let (resumed, refused) = run(&host, &mut w, 35_000);
    assert_eq!(resumed, [(15_000, 7)]);
    let refused: Vec<(u64, u32, Option<&str>)> = refused
        .iter()
        .map(|(at, id, reply)| (*at, *id, reply.header("x-sluice-reason")))
        .collect();
    assert_eq!(
        refused,
        [(30_010, 8, Some("paced"))],
        "at the first tick past its deadline, held by the pace"
    );
    assert_eq!(host.metric("sluice.policy.llm.queue_timeouts"), 1);
    // Held by the pace on arrival: the sixth, seventh and eighth.
    assert_eq!(host.metric("sluice.limit.budget.paced"), 3);
    // The next window's first half goes at once again.
    host.advance_ms(100_000 - 60_000);
    assert_eq!(
        arrive(&host, &mut w, 10..16, b"a"),
        [200, 200, 200, 200, 200, 0]
    );
}

#[test]
fn a_turn_beyond_max_wait_is_refused_at_once_with_when_the_pace_reaches_it() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &paced("10s", ""));
    assert_eq!(arrive(&host, &mut w, 1..6, b"a"), [200; 5]);
    let r = req(LLM, &[("x-team", b"a")]);
    let Verdict::Reply(refused) = w.on_request(&host, 6, r.as_slice()) else {
        panic!("a turn 20 s away is not queued for a max_wait of 10 s");
    };
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-sluice-limit"), Some("budget"));
    let retry: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After");
    assert_eq!(retry, 20, "the pace reaches it at 20 s");
    assert_eq!(refused.header("x-sluice-reason"), Some("paced"));
    let body = String::from_utf8_lossy(&refused.body);
    assert!(body.contains("past its queue line"), "{body}");
    host.advance_ms(10);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.budget.paced"), 1);
    assert_eq!(host.metric("sluice.limit.budget.refused"), 1);
}

#[test]
fn each_key_is_paced_past_its_own_line() {
    let host = FakeHost::at(T0);
    let key = r#", "key": {"header": "x-team"}"#;
    let mut w = worker(&host, &paced("30s", key));
    assert_eq!(
        arrive(&host, &mut w, 1..7, b"a"),
        [200, 200, 200, 200, 200, 0]
    );
    // Team b has spent nothing: its first five go at once, though team
    // a's sixth waits ahead of them in the queue.
    assert_eq!(
        arrive(&host, &mut w, 7..12, b"b"),
        [200, 200, 200, 200, 200]
    );
    let (resumed, refused) = run(&host, &mut w, 25_000);
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(resumed, [(20_000, 6)]);
}

/// A pool's own limit paced: a call ahead of the pace waits in the
/// pool's queue (no member is passed over for it: the limit is every
/// member's) and goes at its turn to a member that has room.
#[test]
fn a_pools_own_paced_limit_holds_its_calls_and_routes_them_at_their_turn() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "on_limit": {"action": "queue", "max_wait": "30s"},
         "limits": [{"name": "budget", "queue": {"at": 0.5},
                     "rate": {"requests": 10, "period": "100s", "algorithm": "fixed_window"}}],
         "pool": {"members": [
           {"name": "east", "cluster": "llm-east",
            "limits": [{"name": "east-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}}]},
           {"name": "west", "cluster": "llm-west",
            "limits": [{"name": "west-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}}]}]}}]}"#,
    );
    assert_eq!(
        arrive(&host, &mut w, 1..7, b"a"),
        [200, 200, 200, 200, 200, 0]
    );
    let mut actions = Vec::new();
    for at in (10..=25_000).step_by(10) {
        host.advance_ms(10);
        actions.extend(w.on_tick(&host).into_iter().map(|a| (at, a)));
    }
    // Its member's cluster is set as it resumes, at its turn.
    let routes: Vec<(u64, String)> = actions
        .iter()
        .filter_map(|(at, a)| match a {
            StreamAction::SetHeader(6, name, cluster) if name == "x-sluice-member" => {
                Some((*at, cluster.clone()))
            }
            _ => None,
        })
        .collect();
    assert!(
        matches!(routes.as_slice(), [(20_000, c)] if c == "llm-east" || c == "llm-west"),
        "{routes:?}"
    );
    let others: Vec<&(u64, StreamAction)> = actions
        .iter()
        .filter(|(_, a)| !matches!(a, StreamAction::SetHeader(..)))
        .collect();
    assert!(
        matches!(others.as_slice(), [(20_000, StreamAction::Resume(6))]),
        "{others:?}"
    );
    assert_eq!(host.metric("sluice.limit.budget.paced"), 1);
}
