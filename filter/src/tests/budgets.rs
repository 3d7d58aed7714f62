//! Budgets (further limits of an hour or longer) held by the admin across
//! restarts, through the worker against the in-memory host: unknown until
//! the admin answers, then resumed from its record; every broken answer
//! keeps them unknown or takes at most the limit's size.

use crate::testing::FakeHost;
use crate::tests::{
    answer, header_of, next_report, pass, reply_with, req, status, sync_settings, worker, T0,
};
use crate::worker::{Verdict, Worker};
use sluice_wire::sync::BUDGETS_HEADER;

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
        reply_with(
            None,
            &[(
                BUDGETS_HEADER,
                Some(br#"{"daily": {"available": 10, "size": 10, "at_ms": 1}}"#),
            )],
            None,
        ),
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

/// 5 calls a day per team.
const TEAMS: &str = r#"{"version": 1, "policies": [
    {"name": "maps", "match": {"host": "api.maps.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "team-daily", "rate": {"requests": 5, "period": "1d", "algorithm": "fixed_window"},
                 "key": {"header": "x-team", "max_keys": 64}}]}]}"#;

fn team_admitted(host: &FakeHost, w: &mut Worker, team: &[u8], from: u32, tries: u32) -> u32 {
    let headers = [("x-team", team)];
    let r = req(MAPS, &headers);
    let mut n = 0;
    for id in from..from + tries {
        if w.on_request(host, id, r.as_slice()) == Verdict::Continue {
            n += 1;
            w.on_stream_end(host, id);
        }
    }
    n
}

fn owner(team: &[u8]) -> u64 {
    sluice_shared::key_view::label_secret(Some("t0ken")).hash("team-daily", team)
}

#[test]
fn a_keyed_budget_reports_its_keys_and_comes_back_in_parts() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    w.set_sync(Some(sync_settings()));
    let (report, token) = next_report(&host, &mut w);
    assert!(!report.budgets["team-daily"].known);
    assert_eq!(
        team_admitted(&host, &mut w, b"team-a", 1, 3),
        0,
        "unknown: closed"
    );
    answer(&host, &mut w, token, 304, None);
    assert_eq!(team_admitted(&host, &mut w, b"team-a", 10, 3), 3);
    assert_eq!(team_admitted(&host, &mut w, b"team-b", 20, 1), 1);
    let (report, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    let mut said: Vec<(u64, u64)> = report.budget_keys["team-daily"]
        .iter()
        .map(|k| (k.owner, k.spent))
        .collect();
    said.sort_unstable();
    let mut want = vec![(owner(b"team-a"), 3), (owner(b"team-b"), 1)];
    want.sort_unstable();
    assert_eq!(said, want, "the keys whose spend changed");
    let (report, _) = next_report(&host, &mut w);
    assert!(report.budget_keys.is_empty(), "nothing changed since");

    // A restart: a new Envoy (fresh shared data) asks, and is given the
    // keys in two parts; a part given twice charges nothing twice.
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    w.set_sync(Some(sync_settings()));
    let (report, token) = next_report(&host, &mut w);
    assert_eq!(report.budgets["team-daily"].resume_after, None);
    let at = T0.as_millis();
    let part = |team: &[u8], spent: u64, more: bool| {
        format!(
            r#"{{"team-daily": {{"available": 0, "size": 0, "at_ms": 0, "more": {more},
                 "keys": [{{"owner": {}, "spent": {spent}, "at_ms": {at}}}]}}}}"#,
            owner(team)
        )
    };
    let first = part(b"team-a", 3, true);
    answer(&host, &mut w, token, 304, Some(first.as_bytes()));
    assert_eq!(
        team_admitted(&host, &mut w, b"team-b", 30, 2),
        0,
        "closed until the last part"
    );
    let (report, token) = next_report(&host, &mut w);
    let daily = report.budgets["team-daily"];
    assert!(!daily.known);
    let cursor = owner(b"team-a") as i64;
    assert_eq!(daily.resume_after, Some(cursor), "names the last key taken");
    // The same part again (an answer lost and asked again): no double charge.
    answer(&host, &mut w, token, 304, Some(first.as_bytes()));
    let (_, token) = next_report(&host, &mut w);
    let last = part(b"team-b", 1, false);
    answer(&host, &mut w, token, 304, Some(last.as_bytes()));
    assert_eq!(
        team_admitted(&host, &mut w, b"team-a", 40, 5),
        2,
        "team-a: 2 left"
    );
    assert_eq!(
        team_admitted(&host, &mut w, b"team-b", 50, 5),
        4,
        "team-b: 4 left"
    );
    assert_eq!(
        team_admitted(&host, &mut w, b"team-c", 60, 6),
        5,
        "team-c: fresh"
    );
    let (report, _) = next_report(&host, &mut w);
    assert!(report.budgets["team-daily"].known);
    assert_eq!(report.budgets["team-daily"].resume_after, None);
}

#[test]
fn hostile_parts_take_at_most_each_keys_size_and_too_many_keys_are_refused() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    w.set_sync(Some(sync_settings()));
    let (_, token) = next_report(&host, &mut w);
    let too_many = format!(
        r#"{{"team-daily": {{"available": 0, "size": 0, "at_ms": 0, "keys": [{}]}}}}"#,
        (0..=sluice_wire::sync::MAX_KEYS_ANSWERED)
            .map(|i| format!(r#"{{"owner": {i}, "spent": 1, "at_ms": 0}}"#))
            .collect::<Vec<_>>()
            .join(",")
    );
    answer(&host, &mut w, token, 304, Some(too_many.as_bytes()));
    assert_eq!(
        team_admitted(&host, &mut w, b"team-a", 1, 2),
        0,
        "still unknown"
    );
    let (_, token) = next_report(&host, &mut w);
    // Spent far beyond the size, dated in the future: the day's 5 at most.
    let huge = format!(
        r#"{{"team-daily": {{"available": 0, "size": 0, "at_ms": 0,
             "keys": [{{"owner": {}, "spent": 18446744073709551615, "at_ms": 18446744073709551615}}]}}}}"#,
        owner(b"team-a")
    );
    answer(&host, &mut w, token, 304, Some(huge.as_bytes()));
    assert_eq!(
        team_admitted(&host, &mut w, b"team-a", 10, 3),
        0,
        "spent for the day"
    );
    assert_eq!(team_admitted(&host, &mut w, b"team-b", 20, 6), 5);
}

#[test]
fn without_a_token_a_keyed_budget_is_a_plain_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    let mut settings = sync_settings();
    settings.token = None;
    w.set_sync(Some(settings));
    assert_eq!(
        team_admitted(&host, &mut w, b"team-a", 1, 6),
        5,
        "open at once"
    );
    let (report, _) = next_report(&host, &mut w);
    assert!(!report.budgets.contains_key("team-daily"));
}

/// A day's budget in Kathmandu (UTC+05:45; T0 is 13:45 there): it renews
/// at local midnight, 10 h 15 min after T0, and a warning line crossed
/// again that new day counts again (once a local day, not once in 25
/// hours since 1970: T0 starts such a span, which would have hidden it).
#[test]
fn a_calendar_day_renews_at_local_midnight_and_its_warning_counts_once_a_local_day() {
    let set = r#"{"version": 1, "policies": [
        {"name": "maps", "match": {"host": "api.maps.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "limits": [{"name": "kathmandu-daily", "warn_at": [0.5],
                     "rate": {"requests": 10, "period": "calendar_day", "algorithm": "fixed_window",
                              "time_zone": "Asia/Kathmandu"}}]}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, set);
    assert_eq!(admitted(&host, &mut w, 1, 6), 6);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.kathmandu-daily.warn_crossed"), 1);
    assert_eq!(admitted(&host, &mut w, 10, 10), 4);
    let refused = w.on_request(&host, 30, req(MAPS, &[]).as_slice());
    assert_eq!(status(&refused), 429);
    assert_eq!(
        header_of(&refused, "x-sluice-renews-at"),
        Some("2027-01-16T00:00:00+05:45[Asia/Kathmandu]")
    );
    assert_eq!(header_of(&refused, "x-sluice-renews-in"), Some("36900"));
    // A second before local midnight: still spent.
    host.advance_ms(36_899_000);
    assert_eq!(admitted(&host, &mut w, 40, 1), 0);
    host.advance_ms(1_000);
    assert_eq!(admitted(&host, &mut w, 50, 6), 6);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.kathmandu-daily.warn_crossed"), 2);
}
