//! A provider table as bytes in shared data.

use super::*;

/// The bit of a row's watch word that holds `rolled_over` (the watch's
/// own count of moves takes the low byte).
pub(super) const ROLLED_OVER_BIT: u32 = 32;

impl ProviderTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.rows.len() * Self::ROW_LEN);
        out.push(Self::VERSION);
        for r in &self.rows {
            for word in [
                r.owner,
                r.pause_since.as_nanos(),
                r.pause_until.as_nanos(),
                r.pause_why.word(),
                r.admitted,
                r.allowance,
                r.allowance_until.as_nanos(),
                r.allowance_from,
                r.provider_limit,
                r.window.as_nanos(),
                r.pace_next.as_nanos(),
                r.pace_every.as_nanos(),
                r.relayed.began.as_nanos(),
                r.relayed.heard.as_nanos(),
                r.other,
                r.overcount,
                r.watch.end_seen.as_nanos(),
                r.watch.word() | u64::from(r.rolled_over) << ROLLED_OVER_BIT,
            ]
            .into_iter()
            .chain(r.adaptive.words())
            .chain(r.sent.words())
            {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
        out
    }

    /// Bytes that are no table (garbage, another version) read as an
    /// empty one: a broken entry must never stop calls.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != Self::VERSION
            || rest.len() % Self::ROW_LEN != 0
            || rest.len() / Self::ROW_LEN > Self::MAX_ROWS
        {
            return None;
        }
        let rows = rest
            .chunks_exact(Self::ROW_LEN)
            .map(|c| {
                let mut words = c
                    .chunks_exact(8)
                    .filter_map(|w| w.try_into().ok().map(u64::from_le_bytes));
                let mut next = || words.next();
                let watch_word;
                Some(Row {
                    owner: next()?,
                    pause_since: Instant::from_nanos(next()?),
                    pause_until: Instant::from_nanos(next()?),
                    pause_why: PauseWhy::from_word(next()?),
                    admitted: next()?,
                    allowance: next()?,
                    allowance_until: Instant::from_nanos(next()?),
                    allowance_from: next()?,
                    provider_limit: next()?,
                    window: Span::from_nanos(next()?),
                    pace_next: Instant::from_nanos(next()?),
                    pace_every: Span::from_nanos(next()?),
                    relayed: RelayedStretch {
                        began: Instant::from_nanos(next()?),
                        heard: Instant::from_nanos(next()?),
                    },
                    other: next()?,
                    overcount: next()?,
                    watch: {
                        let end_seen = Instant::from_nanos(next()?);
                        watch_word = next()?;
                        EndWatch {
                            end_seen,
                            ..EndWatch::from_word(watch_word & !(1 << ROLLED_OVER_BIT))
                        }
                    },
                    rolled_over: watch_word >> ROLLED_OVER_BIT & 1 == 1,
                    adaptive: {
                        let mut words = [0u64; Adaptive::WORDS];
                        for word in &mut words {
                            *word = next()?;
                        }
                        Adaptive::from_words(words)
                    },
                    sent: {
                        let mut sent = [0u64; SLOTS + 1];
                        for word in &mut sent {
                            *word = next()?;
                        }
                        SentWindow::from_words(sent)
                    },
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { rows })
    }
}

impl PauseWhy {
    const RELAYED: u64 = 1 << 16;
    const PROBE: u64 = 1 << 17;
    const HOLD: u64 = 1 << 18;

    fn word(self) -> u64 {
        let flag = |on: bool, bit: u64| if on { bit } else { 0 };
        u64::from(self.status)
            | flag(self.relayed, Self::RELAYED)
            | flag(self.probe, Self::PROBE)
            | flag(self.hold, Self::HOLD)
    }

    fn from_word(word: u64) -> Self {
        PauseWhy {
            status: (word & 0xffff) as u16,
            relayed: word & Self::RELAYED != 0,
            probe: word & Self::PROBE != 0,
            hold: word & Self::HOLD != 0,
        }
    }
}
