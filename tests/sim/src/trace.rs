//! What a run did, per virtual second and tenant: readable, and the same
//! text for the same seed.

use std::collections::BTreeMap;
use std::fmt::Write;

use sluice_shared::time::Instant;

/// One tenant in one second.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantSecond {
    pub sent: u64,
    /// On to the provider (at once or from the queue).
    pub admitted: u64,
    pub queued: u64,
    /// Refused by Sluice, by the limit (or policy) named.
    pub refused: BTreeMap<String, u64>,
    pub provider_ok: u64,
    pub provider_429: u64,
    /// Refused by a pool member and tried on another by Envoy (each such
    /// try's answer is counted again, as the provider's).
    pub retried: u64,
}

pub struct Trace {
    start: Instant,
    pub seconds: BTreeMap<u64, BTreeMap<String, TenantSecond>>,
    /// What Envoy logged, by second: (milliseconds into it, the line).
    pub notes: BTreeMap<u64, Vec<(u64, String)>>,
}

impl Trace {
    /// Seconds are counted from the calendar second `start` falls in: a
    /// row is then one of the provider's calendar windows.
    pub fn new(start: Instant) -> Self {
        const SECOND: u64 = 1_000_000_000;
        Self {
            start: Instant::from_nanos(start.as_nanos() / SECOND * SECOND),
            seconds: BTreeMap::new(),
            notes: BTreeMap::new(),
        }
    }

    /// A line Envoy logged at `at`.
    pub fn note(&mut self, at: Instant, line: String) {
        let into = at.since(self.start);
        self.notes
            .entry(into.as_secs())
            .or_default()
            .push((into.as_millis() % 1000, line));
    }

    /// The second of the run `now` falls in.
    pub fn second_of(&self, now: Instant) -> u64 {
        now.since(self.start).as_secs()
    }

    fn at(&mut self, now: Instant, tenant: &str) -> &mut TenantSecond {
        let second = self.second_of(now);
        let tenants = self.seconds.entry(second).or_default();
        // Looked up first: a new String per call was a tenth of a run.
        if !tenants.contains_key(tenant) {
            tenants.insert(tenant.to_string(), TenantSecond::default());
        }
        tenants.get_mut(tenant).expect("inserted above")
    }

    pub fn sent(&mut self, now: Instant, tenant: &str) {
        self.at(now, tenant).sent += 1;
    }

    pub fn admitted(&mut self, now: Instant, tenant: &str) {
        self.at(now, tenant).admitted += 1;
    }

    pub fn queued(&mut self, now: Instant, tenant: &str) {
        self.at(now, tenant).queued += 1;
    }

    pub fn refused(&mut self, now: Instant, tenant: &str, by: &str) {
        *self
            .at(now, tenant)
            .refused
            .entry(by.to_string())
            .or_default() += 1;
    }

    pub fn provider(&mut self, now: Instant, tenant: &str, status: u32) {
        let second = self.at(now, tenant);
        if status == 200 {
            second.provider_ok += 1;
        } else {
            second.provider_429 += 1;
        }
    }

    pub fn retried(&mut self, now: Instant, tenant: &str) {
        self.at(now, tenant).retried += 1;
    }

    /// A tenant's totals over seconds `from..to` of the run.
    pub fn tenant(&self, tenant: &str, from: u64, to: u64) -> TenantSecond {
        let mut sum = TenantSecond::default();
        for (_, tenants) in self.seconds.range(from..to) {
            if let Some(s) = tenants.get(tenant) {
                sum.sent += s.sent;
                sum.admitted += s.admitted;
                sum.queued += s.queued;
                sum.provider_ok += s.provider_ok;
                sum.provider_429 += s.provider_429;
                sum.retried += s.retried;
                for (by, n) in &s.refused {
                    *sum.refused.entry(by.clone()).or_default() += n;
                }
            }
        }
        sum
    }

    /// One line per second and tenant, then what Envoy logged in it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let seconds: std::collections::BTreeSet<u64> = self
            .seconds
            .keys()
            .chain(self.notes.keys())
            .copied()
            .collect();
        let none = BTreeMap::new();
        for second in seconds {
            let tenants = self.seconds.get(&second).unwrap_or(&none);
            for (tenant, s) in tenants {
                let refused: Vec<String> = s
                    .refused
                    .iter()
                    .map(|(by, n)| format!("{by}:{n}"))
                    .collect();
                let _ = writeln!(
                    out,
                    "s{second:>3} {tenant:<8} sent {:>4} admitted {:>4} queued {:>4} refused [{}] provider ok {:>4} 429 {:>3}{}",
                    s.sent,
                    s.admitted,
                    s.queued,
                    refused.join(" "),
                    s.provider_ok,
                    s.provider_429,
                    if s.retried > 0 {
                        format!(" retried {}", s.retried)
                    } else {
                        String::new()
                    }
                );
            }
            let mut notes: Vec<&(u64, String)> =
                self.notes.get(&second).into_iter().flatten().collect();
            // Envoys' logs are taken when each ends, after the run's own.
            notes.sort_by_key(|(ms, _)| *ms);
            for (ms, line) in notes {
                let _ = writeln!(out, "      +{ms:>3} ms {line}");
            }
        }
        out
    }
}
