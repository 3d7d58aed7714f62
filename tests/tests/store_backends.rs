//! The policy store on both of its databases, each opened twice as two
//! admin replicas would: a real SQLite file and a real PostgreSQL server.
//! The same behaviour on both (versions, conflicts, validation, history,
//! audit, instances), no lost update when both replicas write at once, and
//! what each costs per policy write and per Envoy sync.

use std::time::{Duration, Instant};

use sluice_admin::store::{BlockingStore as Store, StoreError};
use sluice_e2e::postgres::PostgresServer;
use sluice_shared::Policy;
use sluice_wire::sync::{BudgetReport, KeySpent, SyncReport};

fn policy(name: &str, requests: u64) -> Policy {
    serde_json::from_value(
        serde_json::json!({"name": name, "match": {"host": format!("{name}.example")},
        "rate": {"requests": requests, "period": "1s"}}),
    )
    .expect("a valid policy")
}

/// Updates `name` `times` times through `store`, re-reading on conflict as
/// the UI does; returns how many conflicts it met.
fn hammer(store: &Store, name: &str, times: u64) -> anyhow::Result<u64> {
    let mut conflicts = 0;
    for i in 0..times {
        loop {
            let current = store.get(name)?;
            match store.update(name, policy(name, 1 + i), current.version, "replica") {
                Ok(_) => break,
                Err(StoreError::Stale { .. }) => conflicts += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(conflicts)
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(index).copied().unwrap_or_default()
}

struct Costs {
    write: (Duration, Duration),
    sync: (Duration, Duration),
}

/// Writes and syncs, one at a time: the latency each adds.
fn measure(store: &Store) -> anyhow::Result<Costs> {
    store.create(policy("timed", 1), "bench")?;
    let mut writes = Vec::new();
    for i in 0..200 {
        let started = Instant::now();
        store.update("timed", policy("timed", 2 + i), 1 + i, "bench")?;
        writes.push(started.elapsed());
    }
    let mut syncs = Vec::new();
    for i in 0..500u64 {
        let report = SyncReport {
            instance: format!("envoy-{}", i % 5),
            policy_version: i,
            at_ms: i,
            ..SyncReport::default()
        };
        // What the sync endpoint does per request: the record, the set
        // and the epoch, in one transaction.
        let started = Instant::now();
        store.record_sync(report)?;
        syncs.push(started.elapsed());
    }
    Ok(Costs {
        write: (percentile(&mut writes, 0.5), percentile(&mut writes, 0.99)),
        sync: (percentile(&mut syncs, 0.5), percentile(&mut syncs, 0.99)),
    })
}

/// The same checks on any backend, through two handles on one database.
fn behaves(kind: &str, first: Store, second: Store) -> anyhow::Result<()> {
    assert_eq!(first.kind(), kind);
    first.create(policy("bank", 10), "alice")?;
    assert_eq!(second.get("bank")?.version, 1, "the other replica sees it");
    assert_eq!(second.policy_set_version()?, first.policy_set_version()?);
    second.update("bank", policy("bank", 20), 1, "bob")?;
    match first.update("bank", policy("bank", 30), 1, "alice") {
        Err(StoreError::Stale { current: 2, .. }) => {}
        other => panic!("{kind}: a stale write was not refused: {other:?}"),
    }
    match first.create(policy("bank", 5), "alice") {
        Err(StoreError::Invalid(errors)) => assert_eq!(errors.errors[0].path, "name"),
        other => panic!("{kind}: a duplicate name was not refused: {other:?}"),
    }
    first.create(policy("ship", 3), "alice")?;
    let (_, listed) = second.list()?;
    assert_eq!(
        listed
            .iter()
            .map(|s| s.policy.name.as_str())
            .collect::<Vec<_>>(),
        ["bank", "ship"],
        "{kind}: evaluation order"
    );
    second.delete("ship", 1, "bob")?;
    assert!(matches!(first.get("ship"), Err(StoreError::NotFound(_))));
    let history = first.history("ship")?;
    assert_eq!(history.len(), 2, "{kind}: {history:?}");
    assert!(history[0].policy.is_none(), "newest first: the deletion");
    let audit = second.audit_log(10, None)?;
    assert_eq!(audit.first().map(|a| a.action.as_str()), Some("delete"));
    assert!(audit
        .iter()
        .any(|a| a.actor == "alice" && a.action == "create"));
    let report = SyncReport {
        instance: "envoy-1".into(),
        policy_version: 4,
        at_ms: 1,
        ..SyncReport::default()
    };
    first.record_sync(report.clone())?;
    second.record_sync(report)?;
    let instances = first.instances("", 1000)?;
    assert_eq!(instances.len(), 1);
    assert_eq!((instances[0].syncs, instances[0].policy_version), (2, 4));

    // A budget one replica keeps is given back by the other.
    let set = first.policy_set()?;
    let budget = |known: bool, available: u64| SyncReport {
        instance: "envoy-1".into(),
        budgets: [(
            "daily".to_string(),
            BudgetReport {
                known,
                available,
                size: 100,
                at_ms: 5,
                resume_after: None,
            },
        )]
        .into(),
        ..SyncReport::default()
    };
    assert!(first.record_budgets(&budget(true, 30), &set)?.is_empty());
    assert!(first.record_budgets(&budget(true, 25), &set)?.is_empty());
    let held = second.record_budgets(&budget(false, 100), &set)?;
    assert_eq!(
        held.get("daily").map(|h| (h.available, h.size, h.at_ms)),
        Some((25, 100, 5)),
        "{kind}"
    );

    // A keyed budget's keys, hashes over the whole u64 range (stored as
    // signed integers, bit for bit), kept by one replica and given back
    // by the other in the order the parts go.
    let teams: Policy = serde_json::from_value(serde_json::json!({"name": "teams",
        "match": {"host": "teams.example"}, "rate": {"requests": 10, "period": "1s"},
        "limits": [{"name": "team-daily", "rate": {"requests": 100, "period": "1d", "algorithm": "fixed_window"},
                    "key": {"header": "x-team", "max_keys": 4}}]}))?;
    first.create(teams, "alice")?;
    let set = first.policy_set()?;
    let owners = [u64::MAX, 1, 1 << 63, 42];
    let team_budget = |known: bool, keys: Vec<KeySpent>| SyncReport {
        instance: "envoy-1".into(),
        at_ms: 1_000,
        budgets: [(
            "team-daily".to_string(),
            BudgetReport {
                known,
                available: 100,
                size: 100,
                at_ms: 1_000,
                resume_after: None,
            },
        )]
        .into(),
        budget_keys: [("team-daily".to_string(), keys)].into(),
        ..SyncReport::default()
    };
    for (owner, spent) in owners.iter().zip(1..) {
        let key = KeySpent {
            owner: *owner,
            spent,
        };
        assert!(first
            .record_budgets(&team_budget(true, vec![key]), &set)?
            .is_empty());
        // Heard of one after another.
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    // One more than the budget's 4 places: the one heard of longest ago
    // goes.
    let fifth = KeySpent { owner: 5, spent: 5 };
    assert!(first
        .record_budgets(&team_budget(true, vec![fifth]), &set)?
        .is_empty());
    let held = second.record_budgets(&team_budget(false, Vec::new()), &set)?;
    let given: Vec<(u64, u64)> = held
        .get("team-daily")
        .map(|h| h.keys.iter().map(|k| (k.owner, k.spent)).collect())
        .unwrap_or_default();
    assert_eq!(
        given,
        [(1 << 63, 3), (1, 2), (5, 5), (42, 4)],
        "{kind}: the 4 heard of last, in signed order"
    );

    // Both replicas write the same policy at once: every write lands once.
    let before = first.get("bank")?.version;
    let (conflicts_a, conflicts_b) = std::thread::scope(|s| {
        let a = s.spawn(|| hammer(&first, "bank", 50));
        let b = s.spawn(|| hammer(&second, "bank", 50));
        (a.join(), b.join())
    });
    let (conflicts_a, conflicts_b) = (
        conflicts_a.map_err(|_| anyhow::anyhow!("writer panicked"))??,
        conflicts_b.map_err(|_| anyhow::anyhow!("writer panicked"))??,
    );
    let after = second.get("bank")?.version;
    assert_eq!(after, before + 100, "{kind}: no write lost");
    assert_eq!(first.history("bank")?.len() as u64, after);

    let costs = measure(&first)?;
    println!(
        "store {kind}: 2 replicas x 50 contended updates -> version {before} -> {after}, {} conflicts retried; \
         policy write p50 {:?} p99 {:?}; sync (record + read set) p50 {:?} p99 {:?}",
        conflicts_a + conflicts_b,
        costs.write.0,
        costs.write.1,
        costs.sync.0,
        costs.sync.1,
    );
    Ok(())
}

#[test]
fn sqlite_store_with_two_handles_on_one_file() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sluice.db");
    behaves("sqlite", Store::open(&path)?, Store::open(&path)?)
}

#[test]
fn postgres_store_with_two_replicas_on_one_server() -> anyhow::Result<()> {
    let mut server = PostgresServer::start()?;
    let url = server.database("sluice")?;
    // Two replicas starting together: the migration runs once.
    let (first, second) = std::thread::scope(|s| {
        let a = s.spawn(|| Store::open_postgres(&url, None));
        let b = s.spawn(|| Store::open_postgres(&url, None));
        (a.join(), b.join())
    });
    let first = first.map_err(|_| anyhow::anyhow!("open panicked"))??;
    let second = second.map_err(|_| anyhow::anyhow!("open panicked"))??;
    behaves("postgres", first.clone(), second.clone())?;
    // PostgreSQL restarts, dropping every connection: each replica's next
    // request reconnects, and nothing is lost.
    server.restart()?;
    assert_eq!(first.get("bank")?.version, 102);
    second.update("bank", policy("bank", 7), 102, "bob")?;
    assert_eq!(first.get("bank")?.version, 103);
    println!(
        "store postgres: restarted under two open replicas; both went on (bank at version 103)"
    );
    // A third start on the same database finds the schema in place.
    let again = Store::open_postgres(&url, None)?;
    assert_eq!(again.get("bank")?.version, 103);
    Ok(())
}

/// A PostgreSQL that accepts TLS only: `sslmode=require` with the server's
/// CA given works; the system's CAs alone, another CA, or no TLS at all
/// fail, each with an error that says so.
#[test]
fn postgres_over_tls_checks_the_servers_certificate() -> anyhow::Result<()> {
    let certs = tempfile::tempdir()?;
    let (cert, key) = sluice_admin::server::self_signed(&certs.path().join("server"))?;
    let ca = certs.path().join("server/ca.pem");
    sluice_admin::server::self_signed(&certs.path().join("other"))?;
    let other_ca = certs.path().join("other/ca.pem");
    let server = PostgresServer::start_tls(&cert, &key)?;
    let url = server.database("sluice")?;
    let tls_url = format!("{url}?sslmode=require");

    let store = Store::open_postgres(&tls_url, Some(&ca))?;
    store.create(policy("bank", 5), "alice")?;
    assert_eq!(store.get("bank")?.version, 1);

    let error = |result: Result<Store, StoreError>| match result {
        Ok(_) => "connected".to_string(),
        Err(e) => e.to_string(),
    };
    let plain = error(Store::open_postgres(&url, Some(&ca)));
    let system_cas_only = error(Store::open_postgres(&tls_url, None));
    let wrong_ca = error(Store::open_postgres(&tls_url, Some(&other_ca)));
    let missing_ca = error(Store::open_postgres(
        &tls_url,
        Some(&certs.path().join("nowhere.pem")),
    ));
    println!(
        "store postgres TLS: with its CA: wrote and read; without TLS: {plain}; system CAs only: {system_cas_only}; \
         another CA: {wrong_ca}; a CA file that is not there: {missing_ca}"
    );
    assert!(
        plain.contains("no encryption") || plain.contains("pg_hba"),
        "{plain}"
    );
    for refused in [&system_cas_only, &wrong_ca] {
        assert!(refused.to_lowercase().contains("certificate"), "{refused}");
    }
    assert!(missing_ca.contains("nowhere.pem"), "{missing_ca}");
    Ok(())
}

/// The key-value store fleet ledgers and relayed news live in, on both of
/// its backends: in memory (one admin) and in a real Redis (replicas). The
/// same contract on both, then what only Redis has: a replica that wrote
/// in between makes the other read again, and keeps losing only when
/// every try was raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_value_store_keeps_one_contract_in_memory_and_in_redis() -> anyhow::Result<()> {
    use sluice_admin::kv::{Kv, KvError, RedisConnection, Write};
    use sluice_e2e::redis::RedisServer;

    fn set(value: &str, keep_ms: u64) -> Write {
        Write::Set {
            value: value.to_string(),
            keep_ms,
        }
    }
    async fn contract(kind: &str, kv: &Kv) -> anyhow::Result<()> {
        assert_eq!(kv.get("a").await?, None, "{kind}");
        let seen = kv
            .update("a", 3, |raw| {
                Ok::<_, KvError>((raw.to_string(), set("1", 60_000)))
            })
            .await?;
        assert_eq!(seen.as_deref(), Some(""), "{kind}: none reads as empty");
        let seen = kv
            .update("a", 3, |raw| {
                Ok::<_, KvError>((raw.to_string(), Write::Keep))
            })
            .await?;
        assert_eq!(seen.as_deref(), Some("1"), "{kind}");
        kv.update("short", 3, |_| Ok::<_, KvError>(((), set("x", 50))))
            .await?;
        let got = kv.get_many(&["a", "short", "none"]).await?;
        assert_eq!(
            got,
            vec![Some("1".into()), Some("x".into()), None],
            "{kind}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(kv.get("short").await?, None, "{kind}: expired");
        assert_eq!(kv.get("a").await?.as_deref(), Some("1"), "{kind}");
        let failed = kv
            .update("a", 3, |_| -> Result<((), Write), KvError> {
                Err(KvError::Ca("none".into(), std::io::Error::other("refused")))
            })
            .await;
        assert!(failed.is_err(), "{kind}");
        assert_eq!(kv.get("a").await?.as_deref(), Some("1"), "{kind}: kept");
        println!("kv {kind}: read, write, keep, expiry and a failed change behave alike");
        Ok(())
    }

    contract("memory", &Kv::memory("t:", 100)).await?;
    let redis = RedisServer::start()?;
    let connection = RedisConnection::open(&redis.url(), None).await?;
    let one = Kv::redis(&connection, "t:");
    contract("redis", &one).await?;
    assert!(one.is_shared() && !Kv::memory("t:", 1).is_shared());

    // Another replica on its own connection, under another prefix: apart.
    let other = RedisConnection::open(&redis.url(), None).await?;
    assert_eq!(Kv::redis(&other, "u:").get("a").await?, None);
    let two = Kv::redis(&other, "t:");
    // Two replicas adding one to a counter at once, 100 times each: no
    // lost update.
    let bump = |kv: &'static Kv| async move {
        let mut raced = 0u32;
        for _ in 0..100 {
            let mut tries = 0u32;
            let done = kv
                .update("n", 50, |raw| {
                    tries += 1;
                    let n: u64 = raw.parse().unwrap_or(0);
                    Ok::<_, KvError>(((), set(&(n + 1).to_string(), 60_000)))
                })
                .await?;
            anyhow::ensure!(done.is_some(), "50 tries all raced");
            raced += tries - 1;
        }
        Ok::<u32, anyhow::Error>(raced)
    };
    let one: &'static Kv = Box::leak(Box::new(one));
    let two: &'static Kv = Box::leak(Box::new(two));
    let (a, b) = tokio::join!(tokio::spawn(bump(one)), tokio::spawn(bump(two)));
    let raced = a?? + b??;
    assert_eq!(
        one.get("n").await?.as_deref(),
        Some("200"),
        "no lost update"
    );
    // A change that another replica's write interrupts every time: the
    // update gives up after its tries and says so (None), writing nothing.
    let mut rival = redis::Client::open(redis.url())?.get_connection()?;
    let mut tries = 0u32;
    let gave_up = one
        .update("n", 3, |_| {
            tries += 1;
            let _: () = redis::cmd("SET")
                .arg("t:n")
                .arg(format!("rival {tries}"))
                .query(&mut rival)?;
            Ok::<_, anyhow::Error>(((), set("lost", 60_000)))
        })
        .await?;
    assert_eq!((gave_up, tries), (None, 3));
    assert_eq!(one.get("n").await?.as_deref(), Some("rival 3"));
    println!("kv redis: 200 updates from two replicas, none lost ({raced} raced and read again); three raced tries give up");
    Ok(())
}

/// Fleet ledgers shared by two admin replicas in a real Redis, in parts:
/// each sync through either replica gives the very share one ledger in
/// memory gives for the same syncs (the same secret tags both), through
/// an instance going silent and forgotten, a replica further behind than
/// the log reaches (it reads the ledger whole), and Redis restarting
/// empty (each takes the ledger as lost, as the one in memory does when
/// it is forgotten). Then both replicas syncing at once: they end with
/// the same ledger, and the shares they gave never add up to more than
/// the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_ledger_in_redis_as_one_admin_does_in_memory() -> anyhow::Result<()> {
    use sluice_admin::fleet::Ledgers;
    use sluice_admin::kv::RedisConnection;
    use sluice_e2e::redis::RedisServer;
    use sluice_shared::time::Span;
    use sluice_shared::PolicySet;
    use sluice_wire::stats::PolicyCounter;
    use sluice_wire::sync::{HeldShareReport, PolicyReport, ShareMessage};

    let policy: Policy = serde_json::from_value(serde_json::json!({
        "name": "fleet", "match": {"host": "fleet.example"}, "scope": "global",
        "rate": {"requests": 1000, "period": "1s"}, "concurrency": {"max_in_flight": 100}}))?;
    let set = PolicySet {
        version: 1,
        prices: Default::default(),
        policies: vec![policy],
    };
    let mut redis = RedisServer::start()?;
    let secret = [7u8; sluice_shared::fleet::share_tag::SECRET_LEN];
    let replicas = [
        Ledgers::redis(&RedisConnection::open(&redis.url(), None).await?).with_secret(secret),
        Ledgers::redis(&RedisConnection::open(&redis.url(), None).await?).with_secret(secret),
    ];
    let memory = Ledgers::default().with_secret(secret);
    // Past every ledger's start, so that none takes itself for young.
    let start = replicas[0].now().max(replicas[1].now()).max(memory.now()) + Span::from_secs(3_600);

    // What each instance has admitted so far, and the share it holds.
    let mut counted = [0u64; 7];
    let mut held: [Option<ShareMessage>; 7] = [None; 7];
    let report = |i: usize, counted: u64, held: Option<ShareMessage>, at_ms: u64| {
        let mut counts = PolicyReport::default();
        counts.counts.set(PolicyCounter::Admitted, counted);
        counts
            .counts
            .set(PolicyCounter::Rejected, counted / (i as u64 + 1));
        counts
            .counts
            .set(PolicyCounter::InFlight, (i as u64 * 7) % 40);
        let mut report = SyncReport {
            instance: format!("envoy-{i}"),
            at_ms,
            ..Default::default()
        };
        report.policies.insert("fleet".into(), counts);
        if let Some(share) = held {
            report.shares.insert("fleet".into(), share.id);
            report.held.insert(
                "fleet".into(),
                HeldShareReport {
                    rate: share.rate,
                    in_flight: share.in_flight,
                    instances: share.instances,
                    tag: share.tag,
                },
            );
        }
        report
    };
    let mut elapsed = Span::ZERO;
    // Phase 1: runs of three syncs on each replica, 23 ms apart; envoy-6
    // goes silent after a while and is forgotten. Phase 2: only the
    // first replica, 0.1 ms apart, past what the log keeps; envoy-5 syncs
    // at its start only, so that the log no longer names it when the
    // second replica looks again. Phase 3: after Redis restarted empty.
    let mut plan: Vec<(usize, usize, Span)> = (0..700)
        .filter_map(|n| {
            (n % 7 != 6 || n < 80).then_some((n % 7, (n / 3) % 2, Span::from_millis(23)))
        })
        .collect();
    plan.extend(
        (0..4_300)
            .map(|n| if n < 20 { n % 6 } else { n % 5 })
            .map(|i| (i, 0, Span::from_nanos(100_000))),
    );
    plan.push((0, 1, Span::from_millis(23)));
    let caught_up = plan.len();
    plan.extend((1..6).map(|i| (i, 1, Span::from_millis(23))));
    let restart_at = plan.len();
    plan.extend((0..300).map(|n| (n % 6, n % 2, Span::from_millis(23))));
    fn view<T: serde::Serialize>(v: T) -> serde_json::Result<serde_json::Value> {
        serde_json::to_value(v)
    }
    // Each member and when it last synced, as a ledger's view shows them.
    let members = |views: serde_json::Value| -> Vec<(String, u64)> {
        views[0]["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| {
                Some((
                    m["instance"].as_str()?.to_string(),
                    m["last_sync_ms"].as_u64()?,
                ))
            })
            .collect()
    };
    for (n, &(i, replica, wait)) in plan.iter().enumerate() {
        if n == caught_up {
            // The second replica, back after the log moved on, read the
            // ledger whole: every member as one ledger has it (envoy-5's
            // last sync too, which the log no longer names).
            let now = start + elapsed;
            let expected = members(view(memory.views_at(&set, now).await?)?);
            for replica in &replicas {
                assert_eq!(members(view(replica.views_at(&set, now).await?)?), expected);
            }
        }
        if n == restart_at {
            redis.restart()?;
            memory.forget_all();
        }
        elapsed = elapsed + wait;
        let now = start + elapsed;
        counted[i] += 20 + 13 * i as u64;
        let report = report(i, counted[i], held[i], now.as_millis());
        let reference = memory.shares_at(&set, &report, now).await?;
        let mut tries = 0;
        let shared = loop {
            match replicas[replica].shares_at(&set, &report, now).await {
                Ok(shares) => break shares,
                // Reconnecting after the restart.
                Err(e) if n >= restart_at && tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => anyhow::bail!("sync {n} through replica {replica}: {e}"),
            }
        };
        assert_eq!(
            shared.message, reference.message,
            "sync {n} of envoy-{i} through replica {replica}"
        );
        assert_eq!(shared.freed, reference.freed, "sync {n}");
        held[i] = shared.message.get("fleet").copied();
    }
    let last = start + elapsed + Span::from_millis(23);
    let expected = members(view(memory.views_at(&set, last).await?)?);
    for replica in &replicas {
        let seen = members(view(replica.views_at(&set, last).await?)?);
        assert_eq!(seen, expected, "the same members");
    }
    assert_eq!(expected.len(), 6, "envoy-6 forgotten: {expected:?}");

    // Both replicas at once, three instances each, 300 syncs apiece.
    let base = last + Span::from_secs(1);
    let run = |replica: usize, first: usize| {
        let (ledgers, set) = (&replicas[replica], &set);
        async move {
            let mut held: [Option<ShareMessage>; 3] = [None; 3];
            for n in 0..300u64 {
                let k = (n % 3) as usize;
                let i = first + k;
                let now = base + Span::from_millis(n * 7);
                let report = report(i, 1_000 * n, held[k], now.as_millis());
                let shares = ledgers.shares_at(set, &report, now).await?;
                held[k] = shares.message.get("fleet").copied();
            }
            anyhow::Ok(held)
        }
    };
    let (a, b) = tokio::join!(run(0, 0), run(1, 3));
    let given: Vec<ShareMessage> = a?.into_iter().chain(b?).flatten().collect();
    let rate: f64 = given.iter().map(|s| s.rate).sum();
    let in_flight: u32 = given.iter().map(|s| s.in_flight).sum();
    assert!(
        rate <= 1000.0 * (1.0 + 1e-9) && in_flight <= 100,
        "{given:?}"
    );
    let end = base + Span::from_secs(3);
    assert_eq!(
        view(replicas[0].views_at(&set, end).await?)?,
        view(replicas[1].views_at(&set, end).await?)?,
        "both replicas read one ledger"
    );
    println!(
        "fleet ledgers in Redis: {} syncs through two replicas gave what one ledger in memory gives; \
         at once, they gave {rate:.1}/s and {in_flight} in flight of 1000/s and 100",
        plan.len()
    );
    Ok(())
}
