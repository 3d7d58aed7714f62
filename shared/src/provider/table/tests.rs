use super::*;
use proptest::prelude::*;

const NOW: Instant = Instant::from_millis(1_700_000_000_000);
const CAP: Span = Span::from_secs(300);

fn count(remaining: u64, reset_ms: u64) -> Count {
    Count {
        remaining,
        reset_in: Span::from_millis(reset_ms),
        limit: None,
        window: Span::ZERO,
    }
}

#[test]
fn a_pause_holds_its_owner_only_and_a_longer_one_wins() {
    let mut table = ProviderTable::default();
    assert!(table.pause(7, NOW, Span::from_secs(3)));
    assert_eq!(
        table.paused_until(7, NOW, CAP),
        Some(NOW + Span::from_secs(3))
    );
    assert_eq!(table.paused_until(8, NOW, CAP), None);
    assert!(
        !table.pause(7, NOW, Span::from_secs(1)),
        "a shorter pause changes nothing"
    );
    assert!(table.pause(7, NOW, Span::from_secs(5)));
    assert_eq!(table.paused_until(7, NOW + Span::from_secs(5), CAP), None);
    assert_eq!(ProviderTable::decode(&table.encode()), Some(table));
}

#[test]
fn the_state_says_why_a_pause_runs_and_what_the_count_leaves() {
    let mut table = ProviderTable::default();
    let why = PauseWhy {
        status: 429,
        relayed: true,
        ..PauseWhy::default()
    };
    let heard = table.hear_pause(0, NOW, Span::from_secs(3), why, CAP, Span::ZERO);
    let began = PauseSet {
        until: NOW + Span::from_secs(3),
        began: true,
    };
    assert_eq!(heard, (true, Some(began)));
    let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    table.follow(
        0,
        admitted,
        Count {
            remaining: 7,
            reset_in: Span::from_secs(1),
            limit: Some(40),
            window: Span::from_secs(1),
        },
        NOW,
    );
    let state = table.state(0, NOW + Span::from_millis(500), CAP, None);
    assert_eq!(state.remaining, Some(7));
    assert_eq!(state.provider_limit, Some(40));
    assert_eq!(state.paused, Some((NOW, NOW + Span::from_secs(3), why)));
    assert_eq!(state.rate, None);
    let decoded = ProviderTable::decode(&table.encode()).unwrap_or_default();
    assert_eq!(
        decoded.state(0, NOW, CAP, None).paused.map(|p| p.2),
        Some(why)
    );
    let later = table.state(0, NOW + Span::from_secs(4), CAP, None);
    assert_eq!((later.paused, later.provider_limit), (None, Some(40)));
    assert_eq!(table.state(9, NOW, CAP, None), RowState::default());
}

#[test]
fn a_cut_another_envoy_made_is_followed_once_while_fresh() {
    let mut table = ProviderTable::default();
    let full = 100.0;
    let at = NOW - Span::from_millis(400);
    assert!(table.throttled(0, Heard::Relayed, at, NOW, Throttle::plain(full)));
    let rate = table.state(0, NOW, CAP, Some(full)).rate;
    assert!(rate.is_some_and(|r| r < full), "{rate:?}");
    // The admin relays it again at the next sync: no second cut.
    assert!(!table.throttled(
        0,
        Heard::Relayed,
        at,
        NOW + Span::from_secs(1),
        Throttle::plain(full)
    ));
    // Old news is not followed.
    let mut fresh = ProviderTable::default();
    assert!(!fresh.throttled(
        0,
        Heard::Relayed,
        NOW - Span::from_secs(6),
        NOW,
        Throttle::plain(full)
    ));
    // A time from the future is taken as now.
    assert!(fresh.throttled(
        0,
        Heard::Relayed,
        NOW + Span::from_secs(3600),
        NOW,
        Throttle::plain(full)
    ));
    assert_eq!(fresh.state(0, NOW, CAP, Some(full)).cut_at, Some(NOW));
}

#[test]
fn a_full_table_drops_what_ends_first() {
    let mut table = ProviderTable::default();
    for owner in 0..ProviderTable::MAX_ROWS as u64 {
        table.pause(owner, NOW, Span::from_secs(10 + owner));
    }
    table.pause(99, NOW, Span::from_secs(5));
    assert_eq!(table.rows().len(), ProviderTable::MAX_ROWS);
    assert_eq!(table.paused_until(0, NOW, CAP), None);
    assert!(table.paused_until(99, NOW, CAP).is_some());
}

#[test]
fn broken_entries_pause_nothing() {
    for bytes in [&b""[..], b"\x01", b"\x05\x00", &[5u8; 1 + 160 * 9]] {
        assert!(ProviderTable::decode(bytes).is_none());
    }
    let mut table = ProviderTable::default();
    table.rows.push(Row {
        pause_since: NOW + Span::from_secs(3600),
        pause_until: Instant::MAX,
        ..Row::default()
    });
    assert_eq!(
        table.paused_until(0, NOW, CAP),
        None,
        "begins in the future"
    );
    table.rows[0].pause_since = NOW;
    assert_eq!(table.paused_until(0, NOW, CAP), Some(NOW + CAP), "capped");
}

#[test]
fn the_answer_caps_what_goes_until_the_reset_less_what_went_since() {
    let mut table = ProviderTable::default();
    // Call X goes (count 1), then 3 more (count 4) before X's answer
    // says 5 are left until the reset in 1 s.
    let Allowed::Yes { admitted: x } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    for _ in 0..3 {
        table.admit(0, NOW, 1, None);
    }
    assert!(table.follow(0, x, count(5, 1000), NOW));
    // 5 - 3 admitted since X: 2 more may go.
    assert!(matches!(table.admit(0, NOW, 1, None), Allowed::Yes { .. }));
    assert!(matches!(table.admit(0, NOW, 1, None), Allowed::Yes { .. }));
    assert_eq!(
        table.admit(0, NOW, 1, None),
        Allowed::No {
            until: NOW + Span::from_secs(1)
        }
    );
    // The reset passes: the provider's window turned.
    let later = NOW + Span::from_millis(1000);
    assert!(matches!(
        table.admit(0, later, 1, None),
        Allowed::Yes { .. }
    ));
}

#[test]
fn an_earlier_calls_answer_read_late_changes_nothing() {
    let mut table = ProviderTable::default();
    let Allowed::Yes { admitted: a } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    let Allowed::Yes { admitted: b } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    assert!(table.follow(0, b, count(10, 1000), NOW));
    // A's answer (older: it says 11 left) comes after B's.
    assert!(!table.follow(0, a, count(11, 1000), NOW));
    assert_eq!(table.row(0).map(|r| r.allowance), Some(10));
    // The same answer read by a second worker: no change, no double count.
    assert!(!table.follow(0, b, count(10, 1000), NOW));
    assert_eq!(table.row(0).map(|r| r.allowance), Some(10));
}

#[test]
fn a_call_given_back_returns_its_tokens_to_the_allowance() {
    let mut table = ProviderTable::default();
    let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    table.follow(0, admitted, count(2, 1000), NOW);
    let Allowed::Yes { admitted } = table.admit(0, NOW, 2, None) else {
        panic!()
    };
    assert!(matches!(table.admit(0, NOW, 1, None), Allowed::No { .. }));
    table.give_back(0, admitted, 2, NOW);
    assert!(matches!(table.admit(0, NOW, 2, None), Allowed::Yes { .. }));
}

#[test]
fn past_the_reset_the_providers_limit_is_expected_again_and_paced() {
    let mut table = ProviderTable::default();
    let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    let said = Count {
        remaining: 0,
        reset_in: Span::from_millis(200),
        limit: Some(40),
        window: Span::from_secs(1),
    };
    table.follow(0, admitted, said, NOW);
    assert!(matches!(table.admit(0, NOW, 1, None), Allowed::No { .. }));
    // The next window holds 40, one every 25 ms (4 may go ahead).
    let next = NOW + Span::from_millis(200);
    let went = (0..100)
        .filter(|_| matches!(table.admit(0, next, 1, None), Allowed::Yes { .. }))
        .count();
    assert_eq!(went, 5, "an even pace, a few ahead");
    let mut went_in_window = went;
    for ms in 1..1000 {
        let at = next + Span::from_millis(ms);
        if matches!(table.admit(0, at, 1, None), Allowed::Yes { .. }) {
            went_in_window += 1;
        }
    }
    assert_eq!(went_in_window, 40, "the window's 40, no more");
}

#[test]
fn an_answer_about_a_window_that_turned_does_not_refill_the_next() {
    let mut table = ProviderTable::default();
    let said = |remaining, reset_ms| Count {
        remaining,
        reset_in: Span::from_millis(reset_ms),
        limit: Some(40),
        window: Span::from_secs(1),
    };
    let Allowed::Yes { admitted: first } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    let Allowed::Yes { admitted: last } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    table.follow(0, first, said(0, 100), NOW);
    // The window turns: 40 again, paced.
    let next = NOW + Span::from_millis(100);
    assert!(matches!(table.admit(0, next, 1, None), Allowed::Yes { .. }));
    // The last call of the old window answers late: "0 left, reset in 2 ms".
    assert!(!table.follow(0, last, said(0, 2), next + Span::from_millis(8)));
    let row = table.row(0).copied().unwrap_or_default();
    assert_eq!(row.allowance, 39);
    assert_eq!(row.allowance_until, next + Span::from_secs(1));
}

#[test]
fn answers_far_from_the_limit_change_nothing() {
    let mut table = ProviderTable::default();
    // A fixed window: each answer's reset is the same instant (a
    // millisecond's jitter either way).
    let said = |remaining| Count {
        remaining,
        reset_in: Span::from_secs(60) - Span::from_millis(remaining % 3),
        limit: Some(1_000_000),
        window: Span::from_secs(60),
    };
    let Allowed::Yes { admitted: first } = table.admit(0, NOW, 1, None) else {
        panic!()
    };
    assert!(table.follow(0, first, said(999_000), NOW));
    let mut later = Vec::new();
    for _ in 0..10 {
        if let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) {
            later.push(admitted);
        }
    }
    // Each later call's answer is as loose as what the row holds.
    for (i, admitted) in later.iter().enumerate() {
        assert!(!table.follow(0, *admitted, said(999_000 - 1 - i as u64), NOW));
    }
    // A reset that moves on (a sliding window's, a bucket's) is kept:
    // the count is whole only then.
    let moved = Count {
        reset_in: Span::from_secs(61),
        ..said(999_000)
    };
    let last = later.last().copied().unwrap_or(first);
    assert!(table.follow(0, last, moved, NOW));
    assert_eq!(
        table.row(0).map(|r| r.allowance_until),
        Some(NOW + Span::from_secs(61))
    );
    // A stricter one is written.
    let last = later.last().copied().unwrap_or(first);
    assert!(table.follow(0, last, said(500), NOW + Span::from_millis(20)));
    assert_eq!(table.row(0).map(|r| r.allowance), Some(500));
}

/// A provider allowing `quota` tokens in any window of `window`
/// (sliding) or in each calendar window (fixed), answering as OpenAI
/// does: its limit, what is left, and when the count is whole again.
struct WindowProvider {
    quota: u64,
    window: Span,
    sliding: bool,
    /// A sliding window's reset says when its oldest tokens free,
    /// not when it is whole again.
    oldest_free: bool,
    log: Vec<(Instant, u64)>,
}

impl WindowProvider {
    fn counts(&self, at: Instant, now: Instant) -> bool {
        if self.sliding {
            at + self.window > now
        } else {
            at.as_nanos() / self.window.as_nanos() == now.as_nanos() / self.window.as_nanos()
        }
    }

    /// A call of `cost` arrives at `now`: whether it is served, and
    /// the answer's count.
    fn call(&mut self, now: Instant, cost: u64) -> (bool, Count) {
        let used: u64 = self
            .log
            .iter()
            .filter(|(at, _)| self.counts(*at, now))
            .map(|c| c.1)
            .sum();
        let served = used + cost <= self.quota;
        if served {
            self.log.push((now, cost));
        }
        let used = used + if served { cost } else { 0 };
        let counted = || self.log.iter().filter(|(at, _)| self.counts(*at, now));
        let whole_at = if self.sliding {
            let reset_from = if self.oldest_free {
                counted().next()
            } else {
                counted().next_back()
            };
            reset_from.map_or(now, |(at, _)| *at + self.window)
        } else {
            let w = self.window.as_nanos();
            Instant::from_nanos((now.as_nanos() / w + 1) * w)
        };
        let count = Count {
            remaining: self.quota.saturating_sub(used),
            reset_in: whole_at.since(now),
            limit: Some(self.quota),
            window: self.window,
        };
        (served, count)
    }
}

fn sliding(quota: u64) -> WindowProvider {
    WindowProvider {
        quota,
        window: Span::from_secs(60),
        sliding: true,
        oldest_free: false,
        log: Vec::new(),
    }
}

/// Sends `cost` every `every` for `seconds`, reading each answer at
/// once: the tokens the provider served in the last minute, and how
/// many calls it refused.
fn steady(
    provider: &mut WindowProvider,
    table: &mut ProviderTable,
    (every, cost): (Span, u64),
    seconds: u64,
) -> (u64, u64) {
    steady_estimated(provider, table, (every, cost, cost), seconds)
}

/// As [`steady`], each call counted at `estimate` and using `cost`,
/// settled when its answer is read.
fn steady_estimated(
    provider: &mut WindowProvider,
    table: &mut ProviderTable,
    (every, estimate, cost): (Span, u64, u64),
    seconds: u64,
) -> (u64, u64) {
    let mut refused = 0;
    let mut now = NOW;
    while now < NOW + Span::from_secs(seconds) {
        if let Allowed::Yes { admitted } = table.admit(0, now, estimate, None) {
            let (served, count) = provider.call(now, cost);
            refused += u64::from(!served);
            table.follow(0, admitted, count, now);
            table.settle(0, admitted, now, estimate, cost, now);
        }
        now += every;
    }
    let last_minute = provider
        .log
        .iter()
        .filter(|(at, _)| *at + Span::from_secs(60) > now)
        .map(|c| c.1)
        .sum();
    (last_minute, refused)
}

#[test]
fn calls_estimated_above_their_use_still_use_a_sliding_window() {
    // Each call estimated at 160 tokens and using 100 (an LLM's
    // max_tokens against its answer): settled, what Sluice keeps of
    // the window holds what was used. Without settling it held the
    // estimates and the provider served 12 500 of its 20 000.
    let mut provider = sliding(20_000);
    let mut table = ProviderTable::default();
    let (used, refused) = steady_estimated(
        &mut provider,
        &mut table,
        (Span::from_millis(150), 160, 100),
        300,
    );
    assert_eq!(refused, 0);
    assert!(used >= 19_000, "{used} of the last minute's 20 000");
}

#[test]
fn a_refused_calls_estimate_back_makes_no_room_in_a_full_sliding_window() {
    let mut provider = sliding(1_000);
    let mut table = ProviderTable::default();
    steady(&mut provider, &mut table, (Span::from_millis(500), 10), 50);
    assert!(table.row(0).is_some_and(|r| r.watch.slides()));
    // Someone else takes all the window has left; Sluice's next call
    // is refused, and its answer says nothing is left.
    let now = NOW + Span::from_secs(50);
    let left = table.state(0, now, CAP, None).remaining.unwrap_or_default();
    provider.log.push((now, left));
    let Allowed::Yes { admitted } = table.admit(0, now, 10, None) else {
        panic!("Sluice's count has room for it");
    };
    let (served, count) = provider.call(now, 10);
    assert!(!served);
    table.follow(0, admitted, count, now);
    // Refused, it used nothing: settled so, its estimate leaves the
    // window Sluice keeps, and the others' part takes it.
    table.settle(0, admitted, now, 10, 0, now);
    assert!(
        matches!(table.admit(0, now, 10, None), Allowed::No { .. }),
        "{:?}",
        table.row(0)
    );
}

#[test]
fn a_settled_call_gives_a_count_in_force_what_it_did_not_use() {
    let mut table = ProviderTable::default();
    let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
        panic!("the first call goes");
    };
    assert!(table.follow(0, admitted, count(1_000, 60_000), NOW));
    let Allowed::Yes { admitted } = table.admit(0, NOW, 800, None) else {
        panic!("800 of 1 000 go");
    };
    assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(200));
    assert!(table.settle(0, admitted, NOW, 800, 300, NOW));
    assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(700));
    // A call that went before the answer setting the count was in it
    // already, as the provider counted it.
    assert!(!table.settle(0, 1, NOW, 1, 0, NOW));
    assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(700));
}

#[test]
fn a_sliding_window_is_used_as_it_frees() {
    // 20 000 tokens in any minute; callers ask for twice that. Its
    // reset says when it is whole again, or when its oldest tokens
    // free: that one stays put for the first minute (the oldest are
    // the first call's), then creeps on by a call's spacing at each
    // answer, by then a whole window before the end of the window
    // Sluice rolled over into.
    for oldest_free in [false, true] {
        let mut provider = WindowProvider {
            oldest_free,
            ..sliding(20_000)
        };
        let mut table = ProviderTable::default();
        let (used, refused) = steady(
            &mut provider,
            &mut table,
            (Span::from_millis(150), 100),
            300,
        );
        assert_eq!(refused, 0, "oldest free: {oldest_free}");
        assert!(
            used >= 19_000,
            "{used} of the last minute's 20 000 (oldest free: {oldest_free})"
        );
        assert!(table.row(0).is_some_and(|r| r.watch.slides()));
    }
    // A fixed window's resets do not move: its count is followed as
    // before, and what it serves is at most its quota.
    let mut fixed = WindowProvider {
        sliding: false,
        ..sliding(20_000)
    };
    let mut table = ProviderTable::default();
    let (_, refused) = steady(&mut fixed, &mut table, (Span::from_millis(150), 100), 300);
    assert_eq!(refused, 0);
    assert!(table.row(0).is_some_and(|r| !r.watch.slides()));
}

#[test]
fn others_counted_in_a_sliding_window_hold_until_its_reset() {
    let mut provider = sliding(1_000);
    // Someone else took 600 just now.
    provider.log.push((NOW, 600));
    let mut table = ProviderTable::default();
    let (_, refused) = steady(&mut provider, &mut table, (Span::from_millis(500), 10), 50);
    assert_eq!(refused, 0);
    let row = table.row(0).copied().unwrap_or_default();
    assert!(row.watch.slides());
    // Others' 600, and the first call, sent before any answer said
    // the window: what the ring does not hold is counted as others'.
    assert!((600..=610).contains(&row.other), "{row:?}");
    let state = table.state(0, NOW + Span::from_secs(50), CAP, None);
    assert!(state.remaining.is_some_and(|r| r < 400), "{state:?}");
}

/// A provider allowing 30 calls per calendar second, then 12 from 2 s
/// on, counting refused calls too and answering them 429 with
/// `Retry-After: 1`; Sluice's adaptive limit is told 30 a second and
/// has calls waiting always. Answers take `latency` and up to
/// `jitter` more. Returns per second (served, refused).
/// `phase`: how far into a second of the clock the calls begin;
/// `offset`: how far the provider's seconds run ahead of the clock's
/// (0: its windows are the clock's, as a counter keyed by
/// `floor(now / period)` has them).
fn against_a_dropping_provider(
    seconds: u64,
    (phase, offset): (Span, Span),
    latency: Span,
    jitter: Span,
) -> Vec<(u64, u64)> {
    // Each answer takes `latency` and up to `jitter` more, drawn
    // from a fixed sequence so that a run repeats.
    let mut draw = phase.as_nanos() | 1;
    let full = 30.0;
    let throttle = Throttle {
        full,
        wait: Span::from_secs(1),
        period: Span::from_secs(1),
    };
    let adaptive = AdaptiveLimit {
        full,
        period: throttle.period,
    };
    let mut table = ProviderTable::default();
    let mut windows = vec![(0u64, 0u64); seconds as usize + 2];
    let mut in_flight: Vec<(Instant, u64, bool, Instant)> = Vec::new();
    let mut own_next = NOW + phase;
    let mut now = NOW + phase;
    while now < NOW + phase + Span::from_secs(seconds) {
        let answered: Vec<_> = in_flight.iter().filter(|c| c.0 <= now).copied().collect();
        in_flight.retain(|c| c.0 > now);
        for (_, admitted, refused, sent) in answered {
            if refused {
                table.throttled(0, Heard::Here { admitted, sent }, now, now, throttle);
                table.pause(0, now, throttle.wait);
            }
        }
        if table.paused_until(0, now, CAP).is_none() && own_next <= now {
            if let Allowed::Yes { admitted } = table.admit(0, now, 1, Some(adaptive)) {
                own_next = own_next.max(now) + Span::from_nanos(1_000_000_000 / 30);
                let second = (now.since(NOW) + offset).as_secs() as usize;
                let limit = if second < 2 { 30 } else { 12 };
                let w = &mut windows[second];
                let refused = w.0 + w.1 >= limit;
                if refused {
                    w.1 += 1;
                } else {
                    w.0 += 1;
                }
                draw = draw.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let extra = (draw >> 33) % (jitter.as_nanos() + 1);
                in_flight.push((
                    now + latency + Span::from_nanos(extra),
                    admitted,
                    refused,
                    now,
                ));
            }
        }
        now += Span::from_nanos(500_000);
    }
    windows
}

/// Runs against providers whose windows are offset from the clock by
/// `offsets` (ms), the calls beginning anywhere in a second and the
/// answers taking 5 to 40 ms, alike or not; checks each run.
fn after_a_drop(offsets: &[u64], check: impl Fn(&[(u64, u64)], &str)) {
    let latencies = [(5u64, 0u64), (10, 0), (20, 0), (40, 0), (5, 30)];
    for &offset_ms in offsets {
        for (latency_ms, jitter_ms) in latencies {
            for phase_ms in (0..1000).step_by(100) {
                let windows = against_a_dropping_provider(
                    90,
                    (Span::from_millis(phase_ms), Span::from_millis(offset_ms)),
                    Span::from_millis(latency_ms),
                    Span::from_millis(jitter_ms),
                );
                let shown = format!(
                    "phase {phase_ms} ms, offset {offset_ms} ms, latency {latency_ms} ms + up to {jitter_ms}: {windows:?}"
                );
                check(&windows, &shown);
            }
        }
    }
}

/// (served, refused) from the drop on, what was served from 10 s
/// after it in 78 s, and how many of those seconds saw a refusal.
fn after_the_drop(windows: &[(u64, u64)]) -> (u64, u64, u64, usize) {
    let after = &windows[2..90];
    let served = after.iter().map(|w| w.0).sum();
    let refused = after.iter().map(|w| w.1).sum();
    let settled = windows[12..90].iter().map(|w| w.0).sum();
    let probes = windows[12..90].iter().filter(|w| w.1 > 0).count();
    (served, refused, settled, probes)
}

#[test]
fn after_a_drop_refusals_near_one_rate_make_it_known_and_it_is_used() {
    // Windows the clock aligns, and windows offset from it (a
    // provider counting from when its key's window began): at most
    // 1 % refused, at least 90 % of the new limit used, probes above
    // it grow rarer (at most two after the first 10 s).
    after_a_drop(&[0, 100, 300, 500, 700, 900], |windows, shown| {
        let (served, refused, settled, probes) = after_the_drop(windows);
        assert!(
            refused * 100 <= served + refused,
            "{refused} of {} refused: {shown}",
            served + refused
        );
        assert!(
            settled * 10 >= 78 * 12 * 9,
            "settled {settled} in 78 s: {shown}"
        );
        assert!(probes <= 2, "{shown}");
    });
}

proptest! {
    /// Calls of any size at any times against a provider whose window
    /// slides or is fixed (its quota partly taken by someone else at
    /// the start), each answer read at once: once Sluice has read an
    /// answer, the provider refuses none of the calls it lets through.
    #[test]
    fn following_a_window_never_sends_past_it(
        quota in 20u64..500,
        before in 0u64..400,
        window_s in prop::sample::select(vec![10u64, 20, 60]),
        slides in any::<bool>(),
        oldest_free in any::<bool>(),
        steps in proptest::collection::vec((0u64..6_000, 1u64..20), 1..300),
    ) {
        let mut provider = WindowProvider {
            quota,
            window: Span::from_secs(window_s),
            sliding: slides,
            oldest_free,
            log: vec![(NOW, before.min(quota))],
        };
        let mut table = ProviderTable::default();
        let mut now = NOW;
        let mut known = false;
        for (advance_ms, cost) in steps {
            now += Span::from_millis(advance_ms);
            if let Allowed::Yes { admitted } = table.admit(0, now, cost, None) {
                let (served, count) = provider.call(now, cost);
                prop_assert!(served || !known, "refused at {:?} (quota {}, {:?})", now.since(NOW), quota, table.row(0));
                table.follow(0, admitted, count, now);
                known = true;
            }
        }
    }

    #[test]
    fn any_bytes_decode_to_a_bounded_table_or_none(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        now_ms in 0u64..4_000_000_000_000,
        owner in any::<u64>(),
    ) {
        let now = Instant::from_millis(now_ms);
        if let Some(mut table) = ProviderTable::decode(&bytes) {
            prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
            if let Some(until) = table.paused_until(owner, now, CAP) {
                prop_assert!(until > now);
                prop_assert!(until <= now + CLOCK_SKEW + CAP);
            }
            let _ = table.admit(owner, now, 1, None);
            prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
        }
    }

    #[test]
    fn pauses_stay_bounded_and_each_lasts_what_it_asked(
        steps in proptest::collection::vec((0u64..12, 0u64..5_000, 1u64..10_000), 1..60),
    ) {
        let mut table = ProviderTable::default();
        let mut now = NOW;
        for (owner, advance, wait_ms) in steps {
            now += Span::from_millis(advance);
            let before = table.paused_until(owner, now, CAP);
            table.pause(owner, now, Span::from_millis(wait_ms));
            let after = table.paused_until(owner, now, CAP);
            prop_assert!(after >= Some(now + Span::from_millis(wait_ms)));
            prop_assert!(after >= before);
            prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
            prop_assert_eq!(ProviderTable::decode(&table.encode()), Some(table.clone()));
        }
    }

    /// Calls go and answers come back in any order, each saying what
    /// the provider had left when the call arrived; the provider's
    /// window holds `quota`, of which someone else used `used_before`.
    /// Once Sluice has read one answer, its calls never take the
    /// provider past the quota (or past where it already was): no
    /// answer, however late or however often read, lets through calls
    /// the provider already counted.
    #[test]
    fn following_answers_in_any_order_never_sends_past_the_quota(
        quota in 1u64..50,
        used_before in 0u64..60,
        ops in proptest::collection::vec((0u8..3, any::<prop::sample::Index>(), 1u64..3), 1..200),
    ) {
        let mut table = ProviderTable::default();
        let mut provider_used = used_before;
        // Calls in flight: the row's count when each went, and what
        // the provider had left when it arrived.
        let mut in_flight: Vec<(u64, u64)> = Vec::new();
        let mut answered: Vec<(u64, u64)> = Vec::new();
        let mut known_at: Option<u64> = None;
        for (op, pick, cost) in ops {
            match op {
                0 => {
                    if let Allowed::Yes { admitted } = table.admit(0, NOW, cost, None) {
                        provider_used += cost;
                        in_flight.push((admitted, quota.saturating_sub(provider_used)));
                    }
                }
                1 if !in_flight.is_empty() => {
                    let (admitted, remaining) = in_flight.remove(pick.index(in_flight.len()));
                    table.follow(0, admitted, count(remaining, 60_000), NOW);
                    answered.push((admitted, remaining));
                    known_at.get_or_insert(provider_used);
                }
                // Another worker reads an answer already read.
                2 if !answered.is_empty() => {
                    let (admitted, remaining) = answered[pick.index(answered.len())];
                    table.follow(0, admitted, count(remaining, 60_000), NOW);
                }
                _ => {}
            }
        }
        if let Some(known_at) = known_at {
            prop_assert!(
                provider_used <= quota.max(known_at),
                "the provider counted {} of {}, {} when Sluice first knew",
                provider_used, quota, known_at
            );
        }
    }
}
