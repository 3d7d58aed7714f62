//! What limits of an hour or longer report having spent, through the
//! worker against the in-memory host: an unkeyed one's spend and renewal,
//! a keyed one's top spenders under labels the admin can find, read a
//! slice of places per report, and broken shared data read as fresh.

use sluice_shared::key_view::{hash_label, label_secret};
use sluice_shared::spend::SpendReport;

use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{answer, next_report, req, sync_settings, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

/// A daily budget for everyone, one per team shown by name, one per API
/// key shown as a hash; a per-second limit has no spend to show.
const TEAMS: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [
        {"name": "daily", "rate": {"requests": 100, "period": "1d", "algorithm": "fixed_window"}},
        {"name": "per-team", "rate": {"requests": 50, "period": "1d", "algorithm": "fixed_window"},
         "key": {"header": "x-team", "label": "value", "max_keys": 3000}},
        {"name": "per-api-key", "rate": {"requests": 50, "period": "1h", "algorithm": "fixed_window"},
         "key": {"header": "x-api-key", "max_keys": 1000}},
        {"name": "per-second", "rate": {"requests": 500, "period": "1s"}}]}]}"#;

const LLM: &[u8] = b"api.llm.example";

fn call(host: &FakeHost, w: &mut Worker, id: u32, team: &[u8], api_key: &[u8]) -> bool {
    let headers = [("x-team", team), ("x-api-key", api_key)];
    let r = req(LLM, &headers);
    let admitted = w.on_request(host, id, r.as_slice()) == Verdict::Continue;
    if admitted {
        w.on_stream_end(host, id);
    }
    admitted
}

/// A worker syncing with an admin (token `t0ken`), its budgets known.
fn known(host: &FakeHost) -> Worker {
    known_with(host, TEAMS)
}

/// A worker of `policies` syncing with an admin, its budgets known.
fn known_with(host: &FakeHost, policies: &str) -> Worker {
    let mut w = worker(host, policies);
    w.set_sync(Some(sync_settings()));
    let (_, token) = next_report(host, &mut w);
    answer(host, &mut w, token, 304, None);
    w
}

fn spend(w: &mut Worker, host: &FakeHost, limit: &str) -> SpendReport {
    let (report, token) = next_report(host, w);
    answer(host, w, token, 304, None);
    report.limits[limit].spend.clone().expect("a spend")
}

#[test]
fn each_long_limit_reports_its_spend_and_keyed_ones_their_top_spenders() {
    let host = FakeHost::at(T0);
    let mut w = known(&host);
    let mut id = 1;
    for (team, calls) in [(&b"team-a"[..], 5), (b"team-b", 3), (b"team-c", 1)] {
        for _ in 0..calls {
            assert!(call(&host, &mut w, id, team, b"sk-one"));
            id += 1;
        }
    }
    // 3 000 places, 512 read per report (two keyed limits share the 1 024):
    // the sixth report has read all.
    let mut teams = spend(&mut w, &host, "per-team");
    for _ in 0..5 {
        teams = spend(&mut w, &host, "per-team");
    }
    let secret = label_secret(Some("t0ken"));
    let shown: Vec<(&str, u64, u64, u64)> = teams
        .keys
        .iter()
        .map(|k| (k.label.as_str(), k.hash, k.spent, k.size))
        .collect();
    assert_eq!(
        shown,
        [
            ("team-a", secret.hash("per-team", b"team-a"), 5, 50),
            ("team-b", secret.hash("per-team", b"team-b"), 3, 50),
            ("team-c", secret.hash("per-team", b"team-c"), 1, 50),
        ],
        "labels and hashes as the admin names the keys"
    );
    assert_eq!((teams.spent, teams.size, teams.spending_keys), (9, 50, 3));
    assert!(
        (16 * 3600 * 1000 - 10_000..16 * 3600 * 1000).contains(&teams.renews_in_ms),
        "the teams' day renews with the day: {}",
        teams.renews_in_ms
    );

    let (report, _) = next_report(&host, &mut w);
    let daily = report.limits["daily"].spend.clone().expect("a spend");
    assert_eq!((daily.spent, daily.size), (9, 100));
    // T0 is 08:00 UTC and a few reports (a second each) went by: the day
    // renews in a little under 16 hours.
    let day_left = 16 * 3600 * 1000;
    assert!(
        (day_left - 10_000..day_left).contains(&daily.renews_in_ms),
        "{}",
        daily.renews_in_ms
    );
    assert!(daily.keys.is_empty());
    let api_keys = report.limits["per-api-key"].spend.clone().expect("a spend");
    assert_eq!(api_keys.keys.len(), 1);
    assert_eq!(
        api_keys.keys[0].label,
        hash_label(secret.hash("per-api-key", b"sk-one")),
        "a key not shown by value is its hash, never the key"
    );
    assert!(report.limits["per-second"].spend.is_none());
}

#[test]
fn broken_labels_and_places_read_as_hashes_and_fresh_states() {
    let host = FakeHost::at(T0);
    let mut w = known(&host);
    assert!(call(&host, &mut w, 1, b"team-a", b"sk-one"));
    // Garbage over the labels and over a place: nothing panics, the
    // label falls back to the hash, the broken place counts as fresh.
    let (labels, _) = host.shared_get("sluice/sl/per-team");
    assert!(labels.is_some(), "the label was written");
    host.shared_set("sluice/sl/per-team", b"{not json", None)
        .expect("set");
    host.shared_set("sluice/l/per-team/7", &[0xff; 3], None)
        .expect("set");
    let mut teams = SpendReport::default();
    for _ in 0..6 {
        teams = spend(&mut w, &host, "per-team");
    }
    let secret = label_secret(Some("t0ken"));
    assert_eq!(teams.keys.len(), 1);
    assert_eq!(
        teams.keys[0].label,
        hash_label(secret.hash("per-team", b"team-a"))
    );
    assert_eq!(teams.spent, 1);
}

/// Two VMs take turns to report: a key the one has read is in the other's
/// next report too, though that VM has read only a sixth of the places
/// itself (the live view showed such a key come and go, and its key one
/// level down stand as a root, until every VM had read it).
#[test]
fn every_vm_reports_the_top_keys_the_last_one_read() {
    let host = FakeHost::at(T0);
    let mut first = known(&host);
    let mut second = known(&host);
    let mut id = 1;
    for (team, calls) in [(&b"team-a"[..], 5), (b"team-b", 3), (b"team-c", 1)] {
        for _ in 0..calls {
            assert!(call(&host, &mut first, id, team, b"sk-one"));
            id += 1;
        }
    }
    for _ in 0..6 {
        spend(&mut first, &host, "per-team");
    }
    let teams = spend(&mut second, &host, "per-team");
    let shown: Vec<(&str, u64)> = teams
        .keys
        .iter()
        .map(|k| (k.label.as_str(), k.spent))
        .collect();
    assert_eq!(shown, [("team-a", 5), ("team-b", 3), ("team-c", 1)]);
    assert_eq!((teams.spent, teams.spending_keys), (9, 3));
}

/// The places left for the next VM are only a hint: garbage, places past
/// the limit's and a list longer than a report shows are read as far as
/// they make sense, and the report is what the places hold.
#[test]
fn a_broken_hint_of_top_places_reads_no_further_than_the_limits_places() {
    let host = FakeHost::at(T0);
    let mut w = known(&host);
    assert!(call(&host, &mut w, 1, b"team-a", b"sk-one"));
    for hint in [
        &b"{not json"[..],
        b"[4294967295, 3000, 7]",
        &serde_json::to_vec(&(0..100_000u32).collect::<Vec<_>>()).expect("json"),
    ] {
        host.shared_set("sluice/st/per-team", hint, None)
            .expect("set");
        let teams = spend(&mut w, &host, "per-team");
        assert!(teams.spent <= 1, "{teams:?}");
        let (left, _) = host.shared_get("sluice/st/per-team");
        // Garbage stays while this VM has read no spending place.
        let left: Vec<u32> = serde_json::from_slice(&left.expect("a hint")).unwrap_or_default();
        assert!(left.len() <= 1, "the top it read, not the hint: {left:?}");
    }
    let mut teams = SpendReport::default();
    for _ in 0..6 {
        teams = spend(&mut w, &host, "per-team");
    }
    assert_eq!((teams.spent, teams.keys.len()), (1, 1));
}

#[test]
fn without_a_token_keys_keep_the_envoys_own_secret() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    let mut settings = sync_settings();
    settings.token = None;
    w.set_sync(Some(settings));
    let (_, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    assert!(call(&host, &mut w, 1, b"team-a", b"sk-one"));
    let mut teams = SpendReport::default();
    for _ in 0..6 {
        teams = spend(&mut w, &host, "per-team");
    }
    assert_eq!(teams.spent, 1);
    assert_ne!(
        teams.keys[0].hash,
        label_secret(None).hash("per-team", b"team-a"),
        "the public secret places no keys an attacker could aim at"
    );
    assert_eq!(teams.keys[0].label, "team-a", "a value label all the same");
}

/// A team whose calls always wait their turn still gets its label: found
/// while its request is at hand, written when its turn comes and it
/// leaves holding its limits (it was written only for calls admitted at
/// once, so a key whose calls always queued showed as a hash).
#[test]
fn a_key_whose_calls_always_queue_gets_its_label_when_its_turn_comes() {
    const QUEUED: &str = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1, "period": "1s", "burst": 1},
         "on_limit": {"action": "queue", "max_wait": "5s"},
         "limits": [
            {"name": "per-team", "rate": {"requests": 50, "period": "1d", "algorithm": "fixed_window"},
             "key": {"header": "x-team", "label": "value", "max_keys": 100}}]}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, QUEUED);
    w.set_sync(Some(sync_settings()));
    let (_, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    let labels = |host: &FakeHost| -> String {
        let (bytes, _) = host.shared_get("sluice/sl/per-team");
        String::from_utf8(bytes.unwrap_or_default()).unwrap_or_default()
    };
    // The burst goes to team-a; team-q's call waits its turn.
    let first = req(LLM, &[("x-team", b"team-a")]);
    assert_eq!(w.on_request(&host, 1, first.as_slice()), Verdict::Continue);
    let queued = req(LLM, &[("x-team", b"team-q")]);
    assert!(matches!(
        w.on_request(&host, 2, queued.as_slice()),
        Verdict::Pause { .. }
    ));
    assert!(labels(&host).contains("team-a"), "{}", labels(&host));
    assert!(
        !labels(&host).contains("team-q"),
        "not before it holds its limits"
    );
    let mut resumed = false;
    for _ in 0..2_000 {
        host.advance_ms(1);
        if w.on_tick(&host)
            .contains(&crate::worker::StreamAction::Resume(2))
        {
            resumed = true;
            break;
        }
    }
    assert!(resumed, "team-q's turn came");
    assert!(labels(&host).contains("team-q"), "{}", labels(&host));
}

/// Each API key's spend names the team its calls carried, so the admin
/// can hang it under that team in the budget tree; a key seen under a
/// team and broken parent data read as no parent, never a panic.
#[test]
fn a_keyed_budgets_keys_name_the_key_their_calls_carried_in_the_budget_above() {
    let host = FakeHost::at(T0);
    let mut w = known(&host);
    let calls: [(&[u8], &[u8]); 4] = [
        (b"team-a", b"sk-one"),
        (b"team-a", b"sk-two"),
        (b"team-b", b"sk-three"),
        (b"team-b", b"sk-three"),
    ];
    for (id, (team, key)) in (1..).zip(calls) {
        assert!(call(&host, &mut w, id, team, key));
    }
    let mut api_keys = SpendReport::default();
    for _ in 0..2 {
        api_keys = spend(&mut w, &host, "per-api-key");
    }
    let secret = label_secret(Some("t0ken"));
    let parent_of = |key: &[u8]| {
        let hash = secret.hash("per-api-key", key);
        api_keys
            .keys
            .iter()
            .find(|k| k.hash == hash)
            .map(|k| k.parent)
    };
    let team = |name: &[u8]| Some(secret.hash("per-team", name));
    assert_eq!(parent_of(b"sk-one"), team(b"team-a"));
    assert_eq!(parent_of(b"sk-two"), team(b"team-a"));
    assert_eq!(parent_of(b"sk-three"), team(b"team-b"));

    // The teams are under the unkeyed daily budget: no parent key.
    let mut teams = SpendReport::default();
    for _ in 0..6 {
        teams = spend(&mut w, &host, "per-team");
    }
    assert!(teams.keys.iter().all(|k| k.parent == 0), "{teams:?}");

    // Garbage over the parents: the keys stand on their own.
    host.shared_set("sluice/sp/per-api-key", b"[1,", None)
        .expect("set");
    let api_keys = spend(&mut w, &host, "per-api-key");
    assert!(!api_keys.keys.is_empty());
    assert!(api_keys.keys.iter().all(|k| k.parent == 0), "{api_keys:?}");
}

/// Each budget tells the last call it refused per key (the team's) or
/// for all (the company's), why and where it stood, kept across reports
/// for the budget tree; broken shared data reads as no refusal.
#[test]
fn a_budget_tells_the_last_call_it_refused_per_key_and_why() {
    let host = FakeHost::at(T0);
    let mut w = known(&host);
    let mut id = 1;
    // Team a spends its 50 over two API keys; its 51st call is refused.
    for key in [&b"sk-one"[..], b"sk-two"] {
        for _ in 0..25 {
            assert!(call(&host, &mut w, id, b"team-a", key));
            id += 1;
        }
    }
    assert!(!call(&host, &mut w, id, b"team-a", b"sk-three"));
    // Team b takes the company's other 50, then the company refuses.
    for _ in 0..50 {
        assert!(call(&host, &mut w, id + 1, b"team-b", b"sk-four"));
        id += 1;
    }
    assert!(!call(&host, &mut w, id + 2, b"team-c", b"sk-five"));
    let secret = label_secret(Some("t0ken"));
    let mut teams = SpendReport::default();
    for _ in 0..3 {
        teams = spend(&mut w, &host, "per-team");
    }
    let refused: Vec<(u64, &str, u64, u64)> = teams
        .refused
        .iter()
        .map(|r| (r.key, r.reason.as_str(), r.spent, r.size))
        .collect();
    assert_eq!(
        refused,
        [(secret.hash("per-team", b"team-a"), "spent", 50, 50)],
        "the team's key, why, where it stood"
    );
    assert!(
        teams.refused[0].at_ms >= T0.as_millis(),
        "{:?}",
        teams.refused
    );
    let (report, token) = next_report(&host, &mut w);
    answer(&host, &mut w, token, 304, None);
    let daily = report.limits["daily"].spend.clone().expect("a spend");
    let refused: Vec<(u64, &str, u64, u64)> = daily
        .refused
        .iter()
        .map(|r| (r.key, r.reason.as_str(), r.spent, r.size))
        .collect();
    assert_eq!(refused, [(0, "spent", 100, 100)], "unkeyed: no key");
    assert!(report.limits["per-api-key"]
        .spend
        .as_ref()
        .is_some_and(|s| s.refused.is_empty()));

    host.shared_set("sluice/report/refused", b"{\"daily\": 7", None)
        .expect("set");
    let daily = spend(&mut w, &host, "daily");
    assert!(daily.refused.is_empty(), "{daily:?}");
}

/// The budget tree's fourth level: a budget keyed by the API key and the
/// body's model at once (`label: field`) reports each pair under the model's
/// name, hung under the API key its calls carried in the budget above.
#[test]
fn a_budget_per_api_key_and_model_names_the_model_under_its_api_key() {
    const MODELS: &str = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "limits": [
            {"name": "daily", "rate": {"requests": 100, "period": "1d", "algorithm": "fixed_window"}},
            {"name": "per-api-key", "rate": {"requests": 50, "period": "1d", "algorithm": "fixed_window"},
             "key": {"header": "x-api-key"}},
            {"name": "per-key-model", "rate": {"requests": 20, "period": "1d", "algorithm": "fixed_window"},
             "key": {"header": "x-api-key", "json": "model", "label": "field", "max_keys": 100}}]}]}"#;
    let host = FakeHost::at(T0);
    let mut w = known_with(&host, MODELS);
    let calls: [(&[u8], &str); 4] = [
        (b"sk-one", "gpt-4o"),
        (b"sk-one", "gpt-4o-mini"),
        (b"sk-one", "gpt-4o-mini"),
        (b"sk-two", "gpt-4o"),
    ];
    for (id, (key, model)) in (1..).zip(calls) {
        let key_header = [("x-api-key", key)];
        let headers = req(LLM, &key_header);
        let body = format!(r#"{{"model": "{model}"}}"#);
        let first = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Coming);
        assert_eq!(first, Verdict::ReadBody);
        let body = RequestBody::Read(Some(body.as_bytes()));
        let verdict = w.on_request_with(&host, id, headers.as_slice(), body);
        assert_eq!(verdict, Verdict::Continue, "call {id}");
        w.on_stream_end(&host, id);
    }
    // Each report reads a slice of the places: two give every one of 100.
    let mut pairs = std::collections::BTreeMap::new();
    for _ in 0..2 {
        for k in spend(&mut w, &host, "per-key-model").keys {
            pairs.insert(k.hash, (k.label, k.spent, k.parent));
        }
    }
    let secret = label_secret(Some("t0ken"));
    let api_key = |key: &[u8]| secret.hash("per-api-key", key);
    let mut seen: Vec<(String, u64, u64)> = pairs.into_values().collect();
    seen.sort();
    let mut expected = vec![
        ("gpt-4o".to_string(), 1, api_key(b"sk-one")),
        ("gpt-4o".to_string(), 1, api_key(b"sk-two")),
        ("gpt-4o-mini".to_string(), 2, api_key(b"sk-one")),
    ];
    expected.sort();
    assert_eq!(seen, expected);
}
