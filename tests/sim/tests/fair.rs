//! Fair shares over many seeds: a tenant under its fair part gets all it
//! asks, however small its bursts and however many connections and
//! workers the greedy tenant beside it spreads over.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, RetryAfter, Shape};
use sluice_sim::property::{for_seeds, provider_refused_none, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Scenario};

/// The book's first fair-shares policy.
const FAIR: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 95, "period": "1s", "burst": 5},
     "fair": {"key": {"header": "x-tenant"}, "weights": {"a": 1, "b": 1}}}]}"#;

fn quiet_beside_greedy(seed: u64) -> Scenario {
    beside_greedy(seed, quiet(seed))
}

/// The quiet tenant of [`a_quiet_tenant_under_its_part_gets_all_it_asks`]:
/// 20 a second, 2 to 4 calls at once.
fn quiet(seed: u64) -> Caller {
    // The seed picks the quiet tenant's burst: 2 to 4 calls at once, of
    // the limit's burst of 5 (a tenant that sends the whole burst at once
    // would keep it from the other however quiet).
    let burst = 2 + (seed / 4 % 3) as usize;
    Caller {
        tenant: "b".into(),
        host: "api.llm.example".into(),
        connections: burst,
        // 20 a second in all, `burst` at a time.
        shape: Shape::Paced {
            every: Span::from_millis(1000 * burst as u64 / 20),
        },
        llm: None,
        envoy: 0,
        active: Vec::new(),
    }
}

/// A tenant calling now and then: one call every 250 ms to 2.5 s (by
/// seed), more than two of the fair table's windows apart, so that each
/// finds its entry gone and comes as a newcomer.
fn now_and_then(seed: u64) -> Caller {
    let every = [250, 400, 777, 1_000, 2_500][(seed / 4 % 5) as usize];
    Caller {
        connections: 1,
        shape: Shape::Paced {
            every: Span::from_millis(every),
        },
        ..quiet(seed)
    }
}

/// Tenant a greedy (the seed picks its connections and how soon each
/// tries again, and Envoy's workers) beside tenant `b`.
fn beside_greedy(seed: u64, b: Caller) -> Scenario {
    let workers = 1 + (seed % 4) as usize;
    // The greedy tenant's connections and how soon each tries again.
    let greedy = [2, 4, 8, 24][(seed / 12 % 4) as usize];
    let backoff = Span::from_millis(10 + seed / 48 % 4 * 10);
    Scenario {
        workers,
        policies: FAIR.to_string(),
        provider: ProviderShape::calls(100, (Span::from_millis(5), Span::from_millis(40))),
        callers: vec![
            Caller {
                tenant: "a".into(),
                host: "api.llm.example".into(),
                connections: greedy,
                shape: Shape::Greedy {
                    backoff,
                    heeds: RetryAfter::Ignored,
                },
                llm: None,
                envoy: 0,
                active: Vec::new(),
            },
            b,
        ],
        duration: Span::from_secs(6),
        faults: Faults::default(),
        fleet: None,
        pool: None,
    }
}

#[test]
fn a_quiet_tenant_under_its_part_gets_all_it_asks() {
    for_seeds(
        "fair::a_quiet_tenant_under_its_part_gets_all_it_asks",
        |seed| {
            let outcome = run(&quiet_beside_greedy(seed), seed).map_err(|e| panic!("{e}"))?;
            // After the first two seconds (shares follow demand).
            let b = outcome.trace.tenant("b", 2, 6);
            let refused: u64 = b.refused.values().sum();
            if refused * 100 > b.sent {
                let why = format!(
                    "b sent {} and was refused {refused} ({:?})",
                    b.sent, b.refused
                );
                return Err(Failure::new(outcome, why));
            }
            // The greedy tenant gets the rest, but for what b's kept burst
            // costs: while b's part holds its next burst (4 of the limit's
            // 5), a has a room of one token, and what fills it past that
            // before a's next try overflows, as a full bucket's tokens do
            // (seen: 65 to 75 a second for a, 85 to 100 % of the limit used;
            // before b's burst was kept, a got 85 and b 10 of its 20).
            let a = outcome.trace.tenant("a", 2, 6);
            // (With 2 or 4 connections and answers of up to 40 ms, a cannot
            // ask for all of the rest; trying again only every 30 or 40 ms,
            // it leaves the room of one token full for longer.)
            let scenario = quiet_beside_greedy(seed);
            let saturating = scenario.callers[0].connections >= 8
                && matches!(scenario.callers[0].shape, Shape::Greedy { backoff, .. } if backoff <= Span::from_millis(20));
            if saturating && (a.admitted + b.admitted) * 100 < 4 * 95 * 85 {
                let why = format!("a got {} and b {} of 4 s at 95/s", a.admitted, b.admitted);
                return Err(Failure::new(outcome, why));
            }
            provider_refused_none(outcome)
        },
    );
}

/// Runs a tenant calling now and then beside a greedy one; fails when
/// the tenant was refused a call, or the provider refused any.
fn now_and_then_holds(seed: u64) -> Result<sluice_sim::world::Outcome, Failure> {
    let outcome = run(&beside_greedy(seed, now_and_then(seed)), seed).map_err(|e| panic!("{e}"))?;
    let b = outcome.trace.tenant("b", 0, 6);
    let refused: u64 = b.refused.values().sum();
    if refused > 0 || b.sent == 0 {
        let why = format!(
            "b sent {} and was refused {refused} ({:?})",
            b.sent, b.refused
        );
        return Err(Failure::new(outcome, why));
    }
    provider_refused_none(outcome)
}

/// A tenant calling once every 250 ms to 2.5 s beside a greedy one gets
/// every call, its first among them (10 000 seeds at 2026-12-02: none
/// refused). Each of its calls comes as a newcomer to the fair table
/// (its entry gone after two empty windows). Found by this property:
/// the greedy tenant drained its part and the pool as they filled and
/// nothing was left for the newcomer; at 40 seeds of each pace, one call
/// a second was refused 160 of 160, every 400 ms 307 of 400, every 250 ms
/// 171 of 640. The table now keeps a token for newcomers (its reserve),
/// a newcomer may take from the parts of keys asking past their shares,
/// and among quiet keys the smallest share keeps its part first (a
/// greedy tenant on 2 connections asks under the limit alone and counts
/// as quiet; it took the room the other kept).
#[test]
fn a_tenant_calling_now_and_then_gets_every_call() {
    for_seeds(
        "fair::a_tenant_calling_now_and_then_gets_every_call",
        now_and_then_holds,
    );
}

/// Three greedy tenants of weights 1, 1 and 2 under a limit of 95 a
/// second with a burst from `bursts` (by seed); the seed picks Envoy's
/// workers, the tenants' connections and how soon each tries again.
/// `gold` rests from 4 s to 7 s. The provider allows the most the limit
/// lets through in a calendar second (95 and the burst).
fn greedy_by_weight(seed: u64, bursts: &[u64]) -> Scenario {
    let burst = bursts[(seed / 4 % bursts.len() as u64) as usize];
    let policies = format!(
        r#"{{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 95, "period": "1s", "burst": {burst}}},
         "fair": {{"key": {{"header": "x-tenant"}}, "weights": {{"a": 1, "b": 1, "gold": 2}}}}}}]}}"#
    );
    let connections = [4, 12][(seed / 12 % 2) as usize];
    let backoff = Span::from_millis([10, 20][(seed / 24 % 2) as usize]);
    let greedy = |tenant: &str, active: Vec<(Span, Span)>| Caller {
        tenant: tenant.into(),
        host: "api.llm.example".into(),
        connections,
        shape: Shape::Greedy {
            backoff,
            heeds: RetryAfter::Ignored,
        },
        llm: None,
        envoy: 0,
        active,
    };
    Scenario {
        workers: 1 + (seed % 4) as usize,
        policies,
        provider: ProviderShape::calls(95 + burst, (Span::from_millis(5), Span::from_millis(40))),
        callers: vec![
            greedy("a", Vec::new()),
            greedy("b", Vec::new()),
            greedy(
                "gold",
                vec![
                    (Span::ZERO, Span::from_secs(4)),
                    (Span::from_secs(7), Span::from_secs(60)),
                ],
            ),
        ],
        duration: Span::from_secs(10),
        faults: Faults::default(),
        fleet: None,
        pool: None,
    }
}

/// Checks that greedy tenants shared the limit by weight in the seconds
/// that say so, within 5 % of their weights, and that the provider
/// refused nothing.
fn shared_by_weight(seed: u64, bursts: &[u64]) -> Result<sluice_sim::world::Outcome, Failure> {
    let outcome = run(&greedy_by_weight(seed, bursts), seed).map_err(|e| panic!("{e}"))?;
    let all: &[(&str, f64)] = &[("a", 0.25), ("b", 0.25), ("gold", 0.5)];
    let checks: [(u64, &[(&str, f64)]); 4] =
        [(2, all), (3, all), (6, &[("a", 0.5), ("b", 0.5)]), (9, all)];
    for (second, wants) in checks {
        let served = |tenant: &str| outcome.trace.tenant(tenant, second, second + 1).provider_ok;
        let total: u64 = ["a", "b", "gold"].iter().map(|t| served(t)).sum();
        for &(tenant, want) in wants {
            let part = served(tenant) as f64 / total.max(1) as f64;
            if (part - want).abs() > 0.05 * want {
                let why = format!(
                    "second {second}: {tenant} got {} of {total} ({:.1} %, want {:.0} % within 5 %)",
                    served(tenant),
                    100.0 * part,
                    100.0 * want
                );
                return Err(Failure::new(outcome, why));
            }
        }
    }
    provider_refused_none(outcome)
}

/// Greedy tenants share the limit by weight, second by second, within 5
/// % of their weights (a 25 % part of 95 calls: 23 or 24, not 22 or 25):
/// all three once their shares have formed (seconds 2 and 3); a and b half
/// each 2 s after gold rests (second 6); gold its half again within 2 s of
/// coming back (second 9). Bursts of 5 and 10. (At 10 000 seeds one seed,
/// 3 435, is a call off in a second: a got 25 of 95, 5.3 %; the 5 % of a
/// 25 % part of 95 calls is 1.19 calls.)
#[test]
fn greedy_tenants_share_by_weight_each_second_and_an_idle_part_is_lent_and_returned() {
    for_seeds(
        "fair::greedy_tenants_share_by_weight_each_second_and_an_idle_part_is_lent_and_returned",
        |seed| shared_by_weight(seed, &[5, 10]),
    );
}

/// Under a burst smaller than the tenants are many, or about as many (2
/// or 3 between three greedy tenants): the limit is used whole (at least
/// 93 calls in each second checked) and each tenant gets at least 85 % of
/// its weighted part of seconds 2, 3 and 9 together. Before parts could go
/// into debt, each part held a token at least, the parts together more
/// than a burst of 2, and the last in turn nothing: 54 to 69 calls a
/// second of the 95 went, gold 12 to 23 of its 47 (seed 0).
#[test]
fn greedy_tenants_use_a_small_burst_whole_and_by_weight() {
    for_seeds(
        "fair::greedy_tenants_use_a_small_burst_whole_and_by_weight",
        |seed| {
            let outcome = run(&greedy_by_weight(seed, &[2, 3]), seed).map_err(|e| panic!("{e}"))?;
            let served = |tenant: &str, second: u64| {
                outcome.trace.tenant(tenant, second, second + 1).provider_ok
            };
            let tenants = [("a", 0.25), ("b", 0.25), ("gold", 0.5)];
            let mut total = 0;
            for second in [2, 3, 9] {
                let in_second: u64 = tenants.iter().map(|(t, _)| served(t, second)).sum();
                if in_second < 93 {
                    let why = format!("second {second}: {in_second} calls of the 95");
                    return Err(Failure::new(outcome, why));
                }
                total += in_second;
            }
            for (tenant, weight) in tenants {
                let got: u64 = [2, 3, 9].iter().map(|&s| served(tenant, s)).sum();
                let part = got as f64 / (weight * total as f64);
                if part < 0.85 {
                    let why = format!(
                        "{tenant} got {got} of {total} in seconds 2, 3 and 9: {:.0} % of its part",
                        100.0 * part
                    );
                    return Err(Failure::new(outcome, why));
                }
            }
            provider_refused_none(outcome)
        },
    );
}

/// Each second within 5 % of the weights under the same small bursts: a
/// known gap. Parts in debt use the limit whole and keep the weights over
/// seconds (40 seeds of a burst of 2: parts 0.252, 0.253 and 0.495 of
/// seconds 2, 3 and 9); but a second's part swings by what a part holds
/// and owes, up to 6.5 calls of a 23.75 part, and with 4 connections a
/// tenant some seeds serve 7-12 % under its part over 3 s: its callers
/// wait 10-20 ms after a refusal, its part fills to its share of the
/// burst (a token, for gold) meanwhile, and what overflows goes to the
/// pool, which the others take. With a burst of 3, 2.5 calls in a second.
#[test]
#[ignore = "issue 50: with a burst of 2 or 3 between three greedy tenants a second's parts are up to 6.5 calls off the weights; run with --ignored"]
fn greedy_tenants_share_by_weight_each_second_under_a_small_burst() {
    for_seeds(
        "fair::greedy_tenants_share_by_weight_each_second_under_a_small_burst",
        |seed| shared_by_weight(seed, &[2, 3]),
    );
}
