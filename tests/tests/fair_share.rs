//! `fair`: one provider quota shared between tenants by weight, through a
//! real Envoy (`--concurrency 4`), against a mock provider allowing 100
//! calls per calendar second and counting per tenant (the runs are in
//! `sluice_e2e::fair`; `make bench` scenario 9 prints the same).

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_e2e::fair::{self, mean, parts, setup, GREEDY_E2E, PROVIDER_PER_SECOND};
use sluice_e2e::load;

/// Three greedy tenants (weights 1, 1 and 2) for 12 s: every second the
/// provider sees them 25/25/50 (within 5 %, beyond the two calls a
/// second's edges can move: `fair::EDGE_CALLS`), and so on average. The weight-2 tenant rests
/// (the other two share 50/50 from 2 s on) and comes back (its half again
/// from 2 s on). The provider refuses nothing; every refusal names the
/// fair share, but at most one call in a thousand that the share let
/// through and the rate then refused, its token taken by another worker's
/// call in between (one of 20 740 beside another test and two busy loops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tenants_share_the_quota_by_weight_and_idle_shares_are_lent() -> anyhow::Result<()> {
    let run = fair::weighted(GREEDY_E2E).await?;
    let (a_worst, a_mean) = parts(&run.steady, "a", 0.25);
    let (b_worst, b_mean) = parts(&run.steady, "b", 0.25);
    let (gold_worst, gold_mean) = parts(&run.steady, "gold", 0.5);
    let (rest_a, rest_a_mean) = parts(&run.resting, "a", 0.5);
    let (rest_b, _) = parts(&run.resting, "b", 0.5);
    let (back_gold, back_gold_mean) = parts(&run.back, "gold", 0.5);
    let totals: Vec<u64> = run.steady.values().map(|by| by.values().sum()).collect();
    println!(
        "fair 1/1/2: {} seconds; mean parts a {a_mean:.3} b {b_mean:.3} gold {gold_mean:.3}; worst second off by \
         a {:.1} % b {:.1} % gold {:.1} %; calls per second {totals:?}; gold resting: a {rest_a_mean:.3} (worst \
         {:.1} %, b worst {:.1} %); gold back: {back_gold_mean:.3} (worst {:.1} %); {} calls, {} refused ({} \
         fair-share, stat {}, others {:?}); most in a calendar second {}; provider refused {}",
        run.steady.len(),
        100.0 * a_worst,
        100.0 * b_worst,
        100.0 * gold_worst,
        100.0 * rest_a,
        100.0 * rest_b,
        100.0 * back_gold,
        run.calls,
        run.refused,
        run.fair_refusals,
        run.fair_refused_stat,
        run.others,
        run.most_in_a_second,
        run.refused_by_provider,
    );
    assert!(run.steady.len() >= 9, "{} whole seconds", run.steady.len());
    for (who, worst) in [("a", a_worst), ("b", b_worst), ("gold", gold_worst)] {
        assert!(
            worst <= 0.05,
            "{who}'s part was {:.1} % off in its worst second",
            100.0 * worst
        );
    }
    for (who, got, want) in [
        ("a", a_mean, 0.25),
        ("b", b_mean, 0.25),
        ("gold", gold_mean, 0.5),
    ] {
        assert!(
            (got - want).abs() <= 0.05 * want,
            "{who}'s mean part {got:.3}, not {want}"
        );
    }
    assert!(rest_a <= 0.05 && rest_b <= 0.05, "50/50 while gold rests");
    assert!(back_gold <= 0.05, "gold's half back within 2 s");
    assert_eq!(run.refused_by_provider, 0, "the provider refused calls");
    assert!(run.most_in_a_second <= PROVIDER_PER_SECOND);
    fair::assert_refusals_name_the_share(&run.others, run.calls, "reason - limit -");
    assert!(
        (run.fair_refused_stat - run.fair_refusals as f64).abs() <= 1.0,
        "stat {} vs {}",
        run.fair_refused_stat,
        run.fair_refusals
    );
    Ok(())
}

/// A noisy tenant offering 10 times the quota beside a quiet one at 20 a
/// second: the quiet tenant's calls go (but perhaps its very first, before
/// its share has brought it a token, and at most 1 % of the rest: the
/// simulator's bound, `fair::a_quiet_tenant_under_its_part_gets_all_it_asks`
/// over 1 000 seeds; a clean run of 6956ce2, the suites at full load
/// beside it, saw 1 of 141 refused after the first, and one of c5f302b,
/// the suites in six nextest slots instead of four, 2 of 139: a stall of
/// its client past 0.2 s made its next calls newcomers to the fair table,
/// which the noisy tenant left nothing for, fixed in 7f241d0), the noisy
/// tenant gets the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenant_gets_all_it_asks_beside_a_noisy_one() -> anyhow::Result<()> {
    let run = fair::noisy_quiet().await?;
    let (noisy, quiet) = (mean(&run.seconds, "noisy"), mean(&run.seconds, "quiet"));
    println!(
        "fair noisy/quiet: noisy offered 1000/s, quiet 20/s; the provider saw noisy {noisy:.1}/s, quiet {quiet:.1}/s \
         over {} seconds; quiet refused {}",
        run.seconds.len(),
        run.refusals(),
    );
    assert!(
        run.quiet_refused_later * 100 <= run.quiet_calls,
        "the quiet tenant lost more than 1 % of its calls"
    );
    assert!(quiet >= 19.0, "quiet {quiet:.1}/s");
    assert!(noisy >= 73.0, "noisy {noisy:.1}/s: the rest goes to it");
    assert_eq!(run.refused_by_provider, 0);
    Ok(())
}

/// A tenant calling twice a second beside a noisy one offering 10 times
/// the quota: each of its calls comes as a newcomer to the fair table (its
/// entry gone after two empty windows), and each goes. Before the table
/// kept a token for newcomers, the noisy tenant drained every token as it
/// came and such a tenant was refused nearly every call (the simulator's
/// `fair::a_tenant_calling_now_and_then_gets_every_call`, 10 000 seeds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_calling_now_and_then_gets_its_calls_beside_a_noisy_one() -> anyhow::Result<()> {
    let run = fair::noisy_beside(2).await?;
    println!(
        "fair now and then: noisy offered 1000/s, the other 2/s; the latter refused {}",
        run.refusals()
    );
    assert!(run.quiet_calls >= 10, "{} calls", run.quiet_calls);
    assert_eq!(
        run.quiet_refused_later, 0,
        "a tenant calling now and then was refused"
    );
    assert!(
        run.noisy_refused > 0,
        "the noisy tenant was never held back"
    );
    assert_eq!(run.refused_by_provider, 0);
    Ok(())
}

/// Reservations that add up to the whole rate, every tenant greedy: each
/// reserved tenant gets its reservation and the total stays within the
/// provider's limit (a peer's minimums once pushed it past), in reject
/// mode and in queue mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_adding_up_to_the_limit_never_push_past_it() -> anyhow::Result<()> {
    for queued in [false, true] {
        let run = fair::reserved(queued).await?;
        let (a, b, c) = (
            mean(&run.seconds, "a"),
            mean(&run.seconds, "b"),
            mean(&run.seconds, "c"),
        );
        println!(
            "fair reservations 60 + 35 of 95 ({}): the provider saw a {a:.1}/s, b {b:.1}/s, c {c:.1}/s; most in a \
             calendar second {}; {} calls; provider refused {}",
            if queued { "queue mode" } else { "reject mode" },
            run.most_in_a_second,
            run.calls,
            run.refused_by_provider,
        );
        // Each reserved tenant gets its reservation's part of what passed
        // (60 and 35 of 95), within 5 %: measured against what passed, not
        // against 95 a second, which a loaded machine's load generator and
        // Envoy may not reach (a 55.7/s, b 32.3/s of 88.7 in a CI run).
        let passed = a + b + c;
        assert!(
            a >= 0.95 * passed * 60.0 / 95.0 && b >= 0.95 * passed * 35.0 / 95.0,
            "reservations kept: a {a:.1}/s, b {b:.1}/s of {passed:.1}/s"
        );
        assert!(passed >= 0.75 * 95.0, "the limit used: {passed:.1}/s of 95");
        assert!(run.most_in_a_second <= PROVIDER_PER_SECOND);
        assert_eq!(run.refused_by_provider, 0);
    }
    Ok(())
}

/// Queue mode: the quiet tenant's calls wait for their share, not behind
/// the noisy tenant's backlog, against FIFO, where they wait about the
/// whole `max_wait` (2 s) or are refused. The bound is half of `max_wait`,
/// which a loaded machine cannot reach: beside three other suites and
/// lint, one clean run's p99 was 241 ms (p50 7.5 ms), a stall of
/// Envoy's workers rather than a wait in the queue. The figure itself
/// (p99 12.9 ms) is `make bench`'s, docs/BENCHMARKS.md section 9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_queue_keeps_a_quiet_tenants_wait_short_beside_a_noisy_backlog() -> anyhow::Result<()>
{
    let fair = fair::queue_waits(true).await?;
    let fifo = fair::queue_waits(false).await?;
    println!(
        "fair queue: noisy offers 950/s, quiet 20/s, max_wait 2 s; quiet waits with fair: p50 {:?}, p99 {:?}, worst \
         {:?}, {} refused, the provider saw quiet {:.1}/s; FIFO: p50 {:?}, p99 {:?}, worst {:?}, {} refused, the \
         provider saw quiet {:.1}/s",
        fair.p50,
        fair.p99,
        fair.worst,
        fair.refused,
        fair.quiet_rate,
        fifo.p50,
        fifo.p99,
        fifo.worst,
        fifo.refused,
        fifo.quiet_rate,
    );
    assert!(
        fair.p99 < Duration::from_millis(1_000),
        "fair p99 {:?}",
        fair.p99
    );
    // Once in a clean run beside three suites, lint and the simulator,
    // 25 quiet calls were refused (p99 467 ms) and never on an idle
    // machine or beside two busy loops: the first refusals are printed.
    assert_eq!(
        fair.refused, 0,
        "quiet calls refused with fair: {:?}",
        fair.first_refusals
    );
    assert!(fair.quiet_rate >= 19.0, "quiet {:.1}/s", fair.quiet_rate);
    assert!(
        fifo.p50 > Duration::from_millis(1_000) || fifo.refused > 60,
        "FIFO was not slow"
    );
    assert_eq!(fair.refused_by_provider + fifo.refused_by_provider, 0);
    Ok(())
}

/// What a client controls cannot break it: tenant values that are long,
/// binary or absent are tenants like any other, and the rate holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tenant_values_are_tenants_and_the_rate_holds() -> anyhow::Result<()> {
    let (mock, envoy) = setup(&fair::policy(
        r#", "fair": {"key": {"header": "x-api-key", "max_keys": 4}}"#,
        "",
    ))
    .await?;
    let url = envoy.url("/v1/complete");
    let http = load::client();
    let origin = std::time::Instant::now();
    let long = vec![b't'; 8_000];
    let mut statuses = BTreeMap::new();
    for n in 0..600u32 {
        let tenant: Vec<u8> = match n % 4 {
            0 => long.clone(),
            1 => format!("tenant-{n}").into_bytes(),
            2 => b"\xff\xfe\t x".to_vec(),
            _ => Vec::new(),
        };
        let mut request = http.get(&url).header("host", "api.llm.example");
        if !tenant.is_empty() {
            request = request.header(
                "x-api-key",
                reqwest::header::HeaderValue::from_bytes(&tenant)?,
            );
        }
        let outcome = load::send(request, origin).await;
        *statuses.entry(outcome.status).or_insert(0u32) += 1;
    }
    let seconds = origin.elapsed().as_secs_f64();
    let went = mock.arrivals().len();
    println!(
        "fair hostile tenants: 600 calls in {seconds:.1} s (a tenant of 8 000 bytes, 150 new tenants past max_keys 4, \
         bytes past ASCII, none): statuses {statuses:?}; the provider saw {went}"
    );
    assert!(
        statuses.keys().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
    assert!(
        went as f64 <= 5.0 + 95.0 * seconds + 1.0,
        "{went} in {seconds:.1} s"
    );
    assert_eq!(mock.rejected_by_mock(), 0);
    Ok(())
}

/// Two Envoys, one global limit shared fairly: tenant `a` calls through
/// Envoy a alone, `b` and `gold` (weight 2) through Envoy b. Each Envoy
/// asks for all it can get, but the admin weighs their keys: a is leased
/// about a quarter of the limit and b three quarters, so the provider sees
/// the tenants 25/25/50 (within 10 %) and refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_limit_is_shared_by_weight_across_two_envoys() -> anyhow::Result<()> {
    let run = fair::across_fleet(Duration::from_secs(13), false).await?;
    across_fleet_by_weight(&run, "the policy's own", 6);
    Ok(())
}

/// The same with a global further limit (`tps`, under a policy rate that
/// never refuses): its keys are weighed across the fleet as a policy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_further_limit_is_shared_by_weight_across_two_envoys() -> anyhow::Result<()> {
    let run = fair::across_fleet(Duration::from_secs(12), true).await?;
    across_fleet_by_weight(&run, "a further limit", 5);
    Ok(())
}

/// `whole_seconds`: at least as many measured.
fn across_fleet_by_weight(run: &fair::AcrossFleet, whose: &str, whole_seconds: usize) {
    let (a_worst, a_mean) = parts(&run.steady, "a", 0.25);
    let (b_worst, b_mean) = parts(&run.steady, "b", 0.25);
    let (gold_worst, gold_mean) = parts(&run.steady, "gold", 0.5);
    let totals: Vec<u64> = run.steady.values().map(|by| by.values().sum()).collect();
    println!(
        "fair across two Envoys ({whose} global {}/s): {} seconds; mean parts a {a_mean:.3} b {b_mean:.3} gold \
         {gold_mean:.3}; worst second off by a {:.1} % b {:.1} % gold {:.1} %; calls per second {totals:?}; \
         shares {:?}; live view (tenant, weight, share, used, asked /s) {:?}; {} calls; most in a calendar second {}; \
         provider refused {}",
        fair::FLEET_RATE,
        run.steady.len(),
        100.0 * a_worst,
        100.0 * b_worst,
        100.0 * gold_worst,
        run.shares,
        run.live,
        run.calls,
        run.most_in_a_second,
        run.refused_by_provider,
    );
    println!(
        "fair across two Envoys: per second {:?}; the admin's shares every 0.5 s {:?}",
        run.steady, run.trace
    );
    assert!(
        run.steady.len() >= whole_seconds,
        "{} whole seconds",
        run.steady.len()
    );
    // The live view names each tenant's key (as the Envoys hash it) with
    // its weight, a share by weight, and its demand past its share.
    let live = |tenant: &str| {
        run.live
            .iter()
            .find(|k| k.0 == tenant)
            .cloned()
            .unwrap_or_else(|| panic!("{tenant} not in the live view: {:?}", run.live))
    };
    let (a, b, gold) = (live("a"), live("b"), live("gold"));
    assert_eq!((a.1, b.1, gold.1), (1.0, 1.0, 2.0), "weights");
    assert!(
        (gold.2 / b.2 - 2.0).abs() <= 0.3 && (a.2 / b.2 - 1.0).abs() <= 0.15,
        "shares by weight: {:?}",
        run.live
    );
    assert!(
        a.2 + b.2 + gold.2 <= fair::FLEET_RATE as f64 * 1.02,
        "the shares divide the limit: {:?}",
        run.live
    );
    assert!(
        [&a, &b, &gold].iter().all(|k| k.4 > k.2),
        "greedy: each asks past its share: {:?}",
        run.live
    );
    for (who, mean, want) in [
        ("a", a_mean, 0.25),
        ("b", b_mean, 0.25),
        ("gold", gold_mean, 0.5),
    ] {
        assert!(
            (mean - want).abs() <= 0.1 * want,
            "{who}'s part was {mean:.3}, not {want} within 10 %"
        );
    }
    assert_eq!(run.refused_by_provider, 0, "the provider refused calls");
    assert!(run.most_in_a_second <= PROVIDER_PER_SECOND);
}

/// A further limit (95 a second beside the policy's 1 000) shared fairly:
/// `a` and `gold` (weight 2), both greedy, get a third and two thirds of
/// it at the provider (within 5 %); every refusal names the limit and the
/// fair share (or, at most one call in a thousand, the limit alone: see
/// above); the provider refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_further_limit_is_shared_by_weight() -> anyhow::Result<()> {
    let run = fair::further_limit().await?;
    let (a_worst, a_mean) = parts(&run.seconds, "a", 1.0 / 3.0);
    let (gold_worst, gold_mean) = parts(&run.seconds, "gold", 2.0 / 3.0);
    println!(
        "fair further limit tps 95/s: {} seconds; mean parts a {a_mean:.3} gold {gold_mean:.3}; worst second off by \
         a {:.1} % gold {:.1} %; {} calls, {} refused ({} naming tps and fair-share, others {:?}); most in a calendar second {}; \
         provider refused {}",
        run.seconds.len(),
        100.0 * a_worst,
        100.0 * gold_worst,
        run.calls,
        run.refused,
        run.fair_refusals,
        run.others,
        run.most_in_a_second,
        run.refused_by_provider,
    );
    assert!(
        run.seconds.len() >= 5,
        "{} whole seconds",
        run.seconds.len()
    );
    assert!(
        (a_mean - 1.0 / 3.0).abs() <= 0.05 / 3.0 && (gold_mean - 2.0 / 3.0).abs() <= 0.1 / 3.0,
        "parts a {a_mean:.3}, gold {gold_mean:.3}"
    );
    fair::assert_refusals_name_the_share(&run.others, run.calls, "reason - limit tps");
    assert_eq!(run.refused_by_provider, 0);
    assert!(run.most_in_a_second <= PROVIDER_PER_SECOND);
    Ok(())
}

/// Slots shared fairly, a policy's own and a further limit's: `a` and
/// `gold` (weight 4) each keep 20 callers busy with 100 ms calls against
/// 10 slots. As calls end, the slots go by weight: the provider serves
/// them a fifth and four fifths (within 10 %), never sees more than 10
/// calls at once and refuses none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_shared_by_weight() -> anyhow::Result<()> {
    for further in [false, true] {
        let run = fair::shared_slots(further).await?;
        let a = run.served.get("a").copied().unwrap_or(0) as f64;
        let gold = run.served.get("gold").copied().unwrap_or(0) as f64;
        let part = a / (a + gold).max(1.0);
        println!(
            "fair slots ({}): {} slots; the provider served a {a} and gold {gold} calls in 4.9 s (a's part {part:.3}); \
             {} calls, {} refused by the fair share, {} with no slot free; most in flight at the provider {}; \
             provider refused {}",
            if further { "a further limit" } else { "the policy's own" },
            fair::SLOTS,
            run.calls,
            run.fair_refusals,
            run.full_refusals,
            run.most_in_flight,
            run.refused_by_provider,
        );
        assert!(
            (part - 0.2).abs() <= 0.02,
            "a's part {part:.3}, not a fifth within 10 %"
        );
        assert!(a + gold >= 0.8 * 4.9 * 100.0, "the slots were kept busy");
        assert!(run.fair_refusals > 0, "the fair share refused");
        assert!(run.most_in_flight <= fair::SLOTS);
        assert_eq!(run.refused_by_provider, 0);
    }
    Ok(())
}

/// What `envoy/egress.yaml` puts before the filter: x-tenant set from who
/// the caller is.
fn tenant_from_peer() -> anyhow::Result<String> {
    let shipped =
        std::fs::read_to_string(sluice_e2e::envoy::workspace_root().join("envoy/egress.yaml"))?;
    let start = shipped
        .find("          - name: tenant-from-peer")
        .ok_or_else(|| anyhow::anyhow!("envoy/egress.yaml sets no tenant from the peer"))?;
    let end = start
        + shipped[start..]
            .find("          - name: sluice")
            .ok_or_else(|| anyhow::anyhow!("no filter after tenant-from-peer"))?;
    Ok(shipped[start..end].to_string())
}

/// Calls admitted over 3 s to each of two greedy callers, one from
/// 127.0.0.2 as tenant `honest`, one from 127.0.0.3 naming 50 tenants in
/// turn, 8 calls at a time each.
async fn honest_and_rotating(envoy: &sluice_e2e::envoy::Envoy) -> anyhow::Result<(u64, u64)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let url = envoy.url("/v1/complete");
    let until = std::time::Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    let admitted = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    for (who, from) in [(0usize, [127, 0, 0, 2]), (1, [127, 0, 0, 3])] {
        let http = reqwest::Client::builder()
            .local_address(std::net::IpAddr::from(from))
            .build()?;
        for lane in 0..8u64 {
            let (http, url, count) = (http.clone(), url.clone(), Arc::clone(&admitted[who]));
            tasks.push(tokio::spawn(async move {
                let mut n = lane;
                while std::time::Instant::now() < until {
                    n += 8;
                    let tenant = if who == 0 {
                        "honest".to_string()
                    } else {
                        format!("made-up-{}", n % 50)
                    };
                    let status = http
                        .get(&url)
                        .header("host", "api.llm.example")
                        .header("x-tenant", tenant)
                        .send()
                        .await
                        .map_or(0, |r| r.status().as_u16());
                    if status == 200 {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await?;
    }
    Ok((
        admitted[0].load(Ordering::Relaxed),
        admitted[1].load(Ordering::Relaxed),
    ))
}

/// Third security review, item 10: a fair key a caller chooses is one it
/// can multiply. Behind the shipped config's `tenant-from-peer` (x-tenant
/// is the caller's address, whatever it sends), a caller naming 50
/// tenants in turn gets one tenant's share beside an honest caller: at
/// most 60 % of the calls admitted (a half, and the race of 8 callers
/// each). Without it (the control), the same caller takes some 85 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_naming_many_tenants_gets_one_share_behind_the_shipped_config(
) -> anyhow::Result<()> {
    use sluice_demo::mock::{MockApi, MockLimits};
    use sluice_e2e::envoy::{workspace_root, Envoy};
    let mock = MockApi::start(
        "127.0.0.1:0".parse()?,
        MockLimits {
            max_per_second: 0,
            max_in_flight: 0,
        },
    )
    .await?;
    let config = r#"{"instance": "e2e-fair-peer", "fallback": {"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 100, "period": "1s", "burst": 100},
         "fair": {"key": {"header": "x-tenant"}}}]}}"#;
    let test = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
    let sluice = "          - name: sluice\n";
    anyhow::ensure!(test.contains(sluice), "egress-test.yaml has the filter");
    let behind = test.replacen(sluice, &format!("{}{sluice}", tenant_from_peer()?), 1);
    let mut shares = Vec::new();
    for (name, template) in [
        ("behind tenant-from-peer", &behind),
        ("the control, without it", &test),
    ] {
        let envoy = Envoy::start_with(template, config, mock.addr.port(), 4)?;
        let (honest, rotating) = honest_and_rotating(&envoy).await?;
        let share = rotating as f64 / (honest + rotating).max(1) as f64;
        println!(
            "fair key from the peer, {name}: over 3 s the honest caller got {honest} calls, the one naming 50 tenants {rotating} ({:.1} %)",
            100.0 * share
        );
        shares.push(share);
    }
    anyhow::ensure!(
        shares[0] <= 0.6,
        "behind the config the rotating caller took {:.3}",
        shares[0]
    );
    anyhow::ensure!(
        shares[1] >= 0.7,
        "the control should show the hole: {:.3}",
        shares[1]
    );
    Ok(())
}
