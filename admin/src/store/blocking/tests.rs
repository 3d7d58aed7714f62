use super::*;

/// Warning rows past the retention go as a new one is written; other
/// audit rows stay.
#[test]
fn warning_rows_past_their_retention_are_deleted() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut store = BlockingStore::open(&dir.path().join("s.db")).unwrap_or_else(|e| panic!("{e}"));
    store.warn_retention_ms = 86_400_000;
    let old = now_ms() - 2 * 86_400_000;
    store
        .db
        .touch(|sql| {
            audit_entry(sql, old, "sluice", "warn", "team", None, Some("{}".into()))?;
            audit_entry(sql, old, "alice", "update", "team", None, None)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // A sync keeps what it says of the set's limits only.
    let policy = serde_json::from_value(serde_json::json!({
        "name": "bank", "match": {"host": "bank.example"},
        "rate": {"requests": 100, "period": "1s"},
        "limits": [{"name": "team", "rate": {"requests": 10, "period": "1s"}}]}))
    .unwrap_or_else(|e| panic!("{e}"));
    store
        .create(policy, "alice")
        .unwrap_or_else(|e| panic!("{e}"));
    let report: SyncReport = serde_json::from_value(serde_json::json!({
        "instance": "envoy-a", "policy_version": 0, "at_ms": 1,
        "limits": {"team": {"warn_crossed": 2, "requests": 10, "period_ms": 1000}}}))
    .unwrap_or_else(|e| panic!("{e}"));
    store.record_sync(report).unwrap_or_else(|e| panic!("{e}"));
    let rows = store
        .db
        .read(|sql| {
            sql.query(
                "SELECT action, at_ms FROM audit WHERE action <> 'create' ORDER BY id",
                &[],
            )
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let kept: Vec<(String, bool)> = rows
        .iter()
        .map(|r| (r.text(0).unwrap_or_default(), r.uint(1).unwrap_or(0) == old))
        .collect();
    assert_eq!(
        kept,
        [("update".to_string(), true), ("warn".to_string(), false)],
        "the old warning row went, the person's change stayed"
    );
}

/// An Envoy's sync record commits without waiting for the disk; every
/// other change still waits for it, also right after a sync's.
#[test]
fn only_a_sync_record_commits_without_waiting_for_the_disk() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = BlockingStore::open(&dir.path().join("s.db")).unwrap_or_else(|e| panic!("{e}"));
    let synchronous = |sql: &mut dyn Sql| {
        sql.query_one("PRAGMA synchronous", &[])?
            .map_or(Ok(0), |r| r.uint(0))
    };
    let (normal, full) = (1, 2);
    let noted = store.db.note(synchronous).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(noted, normal);
    for access in ["touch", "write", "read"] {
        let seen = match access {
            "touch" => store.db.touch(synchronous),
            "write" => store.db.write(synchronous),
            _ => store.db.read(synchronous),
        }
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(seen, full, "{access}");
        store.db.note(synchronous).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The set a sync reads is parsed once per version: the same set while
/// nothing changes, the new one as soon as any handle on the database
/// (another replica) writes.
#[test]
fn a_sync_reads_the_set_again_only_when_it_changed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("s.db");
    let store = BlockingStore::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let other = BlockingStore::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let policy = |requests: u64| -> sluice_shared::Policy {
        serde_json::from_value(
            serde_json::json!({"name": "bank", "match": {"host": "bank.example"},
            "rate": {"requests": requests, "period": "1s"}}),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let sync = |store: &BlockingStore| {
        let report: SyncReport = serde_json::from_value(serde_json::json!({
            "instance": "envoy-a", "policy_version": 0, "at_ms": 1,
            "policies": {"bank": {"admitted": 3, "max_in_flight": 0},
                         "made-up": {"admitted": 4, "max_in_flight": 0}}}))
        .unwrap_or_else(|e| panic!("{e}"));
        let recorded = store.record_sync(report).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            recorded.epoch,
            store.epoch().unwrap_or_else(|e| panic!("{e}")),
            "the epoch read with the record"
        );
        let names: Vec<&String> = recorded.report.policies.keys().collect();
        let known: Vec<&String> = recorded.set.policies.iter().map(|p| &p.name).collect();
        assert_eq!(
            names, known,
            "only what the report says of the set's names is kept"
        );
        recorded.set
    };
    let first = sync(&store);
    let again = sync(&store);
    assert!(Arc::ptr_eq(&first, &again), "not parsed again");
    let (watched, epoch) = store.current().unwrap_or_else(|e| panic!("{e}"));
    assert!(Arc::ptr_eq(&watched, &again), "a watch reads the same set");
    assert_eq!(epoch, store.epoch().unwrap_or_else(|e| panic!("{e}")));
    other
        .create(policy(5), "alice")
        .unwrap_or_else(|e| panic!("{e}"));
    let (watched, _) = store.current().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(watched.version, first.version + 1, "a watch reads the edit");
    assert_eq!(watched.policies.len(), 1);
    let changed = sync(&store);
    assert!(Arc::ptr_eq(&watched, &changed), "parsed once for both");
    assert_eq!(changed.version, first.version + 1);
    assert_eq!(changed.policies.len(), 1);
    store
        .update("bank", policy(7), 1, "alice")
        .unwrap_or_else(|e| panic!("{e}"));
    let updated = sync(&store);
    assert_eq!(updated.version, changed.version + 1);
    assert!(updated.policies[0]
        .rate
        .as_ref()
        .is_some_and(|r| r.requests == 7));
}
