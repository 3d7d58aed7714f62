//! Budgets (further limits of an hour or longer) held by the admin across
//! restarts, through the worker against the in-memory host: unknown until
//! the admin answers, then resumed from its record; every broken answer
//! keeps them unknown or takes at most the limit's size.

use crate::sync::{ReplyBody, SyncReply};
use crate::testing::FakeHost;
use crate::tests::{answer, next_report, pass, req, status, sync_settings, worker, T0};
use crate::worker::{Verdict, Worker};

/// 10 calls a day (T0 is 08:00 UTC), beside a per-second rate.
const DAILY: &str = r#"{"version": 1, "policies": [
    {"name": "maps", "match": {"host": "api.maps.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "daily", "rate": {"requests": 10, "period": "1d", "algorithm": "fixed_window"}},
                {"name": "per-minute", "rate": {"requests": 600, "period": "1m"}}]}]}"#;

const MAPS: &[u8] = b"api.maps.example";

fn admitted(host: &FakeHost, w: &mut Worker, from: u32, tries: u32) -> u32 {
    let r = req(MAPS, &[]);
    let mut n = 0;
    for id in from..from + tries {
        if w.on_request(host, id, r.as_slice()) == Verdict::Continue {
            n += 1;
            w.on_stream_end(host, id);
        }
    }
    n
}

fn header_of<'a>(v: &'a Verdict, name: &str) -> Option<&'a str> {
    match v {
        Verdict::Reply(r) => r
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str()),
        _ => None,
    }
}

fn syncing(host: &FakeHost) -> Worker {
    let mut w = worker(host, DAILY);
    w.set_sync(Some(sync_settings()));
    w
}

#[test]
fn without_an_admin_a_budget_is_a_plain_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, DAILY);
    assert_eq!(admitted(&host, &mut w, 1, 20), 10);
}

#[test]
fn a_restarted_envoy_refuses_a_budget_until_the_admin_gives_back_what_it_spent() {
    let host = FakeHost::at(T0);
    let mut w = syncing(&host);
    let r = req(MAPS, &[]);
    let refused = w.on_request(&host, 1, r.as_slice());
    assert_eq!(status(&refused), 429);
    assert_eq!(
        header_of(&refused, "x-sluice-reason"),
        Some("budget-unknown")
    );
    assert_eq!(header_of(&refused, "x-sluice-limit"), Some("daily"));
    assert_eq!(header_of(&refused, "retry-after"), Some("1"));
    // The report asks: the budget is not known, and holds all of itself.
    let (report, token) = next_report(&host, &mut w);
    let daily = report.budgets["daily"];
    assert!(!daily.known);
    assert_eq!((daily.available, daily.size), (10, 10));
    assert!(
        !report.budgets.contains_key("per-minute"),
        "a minute is no budget"
    );
    // The admin held 7 spent of 10, a minute ago.
    let held = format!(
        r#"{{"daily": {{"available": 3, "size": 10, "at_ms": {}}}}}"#,
        T0.as_millis() + 1000 - 60_000
    );
    answer(&host, &mut w, token, 304, Some(held.as_bytes()));
    assert_eq!(admitted(&host, &mut w, 10, 20), 3);
    pass(&host, &mut w, 1);
    assert_eq!(host.metric("sluice.limit.daily.budget_unknown"), 1);
    // Known from now on; the report says so, and what is left.
    let (report, token) = next_report(&host, &mut w);
    let daily = report.budgets["daily"];
    assert!(daily.known);
    assert_eq!(daily.available, 0);
    // A later answer's record is not applied again: a full record would
    // change nothing, a stricter one takes nothing more.
    let stricter = format!(
        r#"{{"daily": {{"available": 0, "size": 10, "at_ms": {}}}}}"#,
        T0.as_millis()
    );
    answer(&host, &mut w, token, 304, Some(stricter.as_bytes()));
    let (report, _) = next_report(&host, &mut w);
    assert_eq!(report.budgets["daily"].available, 0);
    // Tomorrow the window is full again (a VM started then: a worker's
    // clock absorbs a 16 h step).
    host.advance_ms(16 * 3600 * 1000);
    let mut tomorrow = syncing(&host);
    assert_eq!(admitted(&host, &mut tomorrow, 100, 20), 10);
}

#[test]
fn an_admin_with_no_record_starts_the_budget_full() {
    let host = FakeHost::at(T0);
    let mut w = syncing(&host);
    let (_, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    assert_eq!(admitted(&host, &mut w, 1, 20), 10);
}

#[test]
fn a_failed_or_broken_answer_leaves_the_budget_unknown() {
    let host = FakeHost::at(T0);
    let mut w = syncing(&host);
    let (_, token) = next_report(&host, &mut w);
    // The admin failed: not an answer.
    answer(&host, &mut w, token, 500, None);
    assert_eq!(admitted(&host, &mut w, 1, 5), 0);
    // Nothing came back at all (Envoy gave up).
    let (_, token) = next_report(&host, &mut w);
    w.on_sync_reply(
        &host,
        token,
        SyncReply {
            sync_now: false,
            status: None,
            shares_header: None,
            epoch_header: None,
            budgets_header: Some(br#"{"daily": {"available": 10, "size": 10, "at_ms": 1}}"#),
            provider_header: None,
            body: ReplyBody::Read(None),
        },
    );
    assert_eq!(admitted(&host, &mut w, 10, 5), 0);
    // Answers whose budgets header is not one: counted, still unknown.
    let huge = vec![b' '; 70 * 1024];
    for (i, bad) in [
        &b"garbage"[..],
        br#"{"daily": {"available": -1, "size": 10, "at_ms": 1}}"#,
        br#"{"daily": 3}"#,
        &huge[..],
    ]
    .into_iter()
    .enumerate()
    {
        let (report, token) = next_report(&host, &mut w);
        assert!(!report.budgets["daily"].known);
        answer(&host, &mut w, token, 304, Some(bad));
        let from = 100 * (u32::try_from(i).expect("few") + 1);
        assert_eq!(admitted(&host, &mut w, from, 5), 0, "{i}");
    }
    pass(&host, &mut w, 1);
    assert_eq!(host.metric("sluice.budgets_malformed"), 4);
    // Then a good answer.
    let (_, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    assert_eq!(admitted(&host, &mut w, 1000, 20), 10);
}

#[test]
fn a_hostile_record_takes_at_most_the_budget_and_only_until_its_window_ends() {
    for record in [
        r#"{"daily": {"available": 0, "size": 18446744073709551615, "at_ms": 18446744073709551615}}"#,
        r#"{"daily": {"available": 99, "size": 18446744073709551615, "at_ms": 0}}"#,
        r#"{"daily": {"available": 18446744073709551615, "size": 0, "at_ms": 5}}"#,
        r#"{"other": {"available": 0, "size": 10, "at_ms": 0}, "daily": {"available": 0, "size": 1, "at_ms": 1800000000000}}"#,
    ] {
        let host = FakeHost::at(T0);
        let mut w = syncing(&host);
        let (_, token) = next_report(&host, &mut w);
        answer(&host, &mut w, token, 304, Some(record.as_bytes()));
        let today = admitted(&host, &mut w, 1, 20);
        assert!(today <= 10, "{record}: {today}");
        host.advance_ms(24 * 3600 * 1000);
        let mut tomorrow = syncing(&host);
        assert_eq!(admitted(&host, &mut tomorrow, 100, 20), 10, "{record}");
    }
}
