//! What stands between a password guess and argon2: throttles per account
//! and per client address, taken *before* the password is checked, and a
//! bound on how many checks run at once. A storm of wrong logins then costs
//! a few argon2 runs, not one per request: memory and CPU stay for the
//! Envoys' syncs.
//!
//! The client address is the TCP peer, or, when the peer is a configured
//! trusted proxy, the address that proxy reports in a configured header
//! (the right-most one not itself a trusted proxy). IPv6 clients are
//! throttled per /64: one host owns a whole /64 and could otherwise rotate
//! through it.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::Duration;

use axum::http::HeaderMap;
use ipnet::IpNet;
use sluice_shared::limiter::token_bucket::{TokenBucket, TokenBucketState};
use sluice_shared::limiter::Decision;
use sluice_shared::{Instant, Span};
use tokio::sync::{Semaphore, SemaphorePermit};

/// Password checks running at once, at most: argon2 takes 19 MiB and a
/// core's worth of time for each.
pub const MAX_CONCURRENT_CHECKS: usize = 1;
/// How long a login waits for its turn to be checked before a 503.
const CHECK_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// Wrong passwords per account: a burst, then one every two seconds, from
/// anywhere. Stops a distributed guesser; a correct login costs nothing.
pub const ACCOUNT_BURST: u64 = 20;
pub const ACCOUNT_REFILL: Span = Span::from_secs(2);
/// Wrong passwords per client address: a burst of 5, then one every 10 s.
pub const ADDRESS_BURST: u64 = 5;
pub const ADDRESS_REFILL: Span = Span::from_secs(10);
/// Throttle entries kept per kind. A full table makes room by dropping
/// entries whose bucket refilled (they hold nothing); with none to drop,
/// a newcomer is refused until one refills. The table is never cleared.
pub const MAX_TRACKED: usize = 100_000;

/// Buckets of wrong guesses per key, bounded in number.
pub struct KeyedThrottle<K> {
    limiter: TokenBucket,
    max_keys: usize,
    buckets: Mutex<HashMap<K, TokenBucketState>>,
}

impl<K: Hash + Eq + Clone> KeyedThrottle<K> {
    pub fn new(burst: u64, refill: Span, max_keys: usize) -> Self {
        Self {
            limiter: TokenBucket::new(1, refill, burst, None),
            max_keys,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// How long `key` must wait before its next guess (None: it may try).
    pub fn wait(&self, key: &K, now: Instant) -> Option<Span> {
        let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        match buckets.get(key) {
            Some(state) => self.wait_for(state, now),
            None if buckets.len() < self.max_keys => None,
            // Full of keys that are all still throttled: a newcomer waits
            // for the first of them to refill (a refill period at most).
            None if buckets.values().any(|s| self.limiter.is_idle(s, now)) => None,
            None => Some(self.limiter.period()),
        }
    }

    fn wait_for(&self, state: &TokenBucketState, now: Instant) -> Option<Span> {
        let mut probe = *state;
        match self.limiter.try_acquire(&mut probe, now, 1) {
            Decision::Admit { .. } => None,
            Decision::Deny { retry_after, .. } => Some(retry_after),
        }
    }

    /// Takes a guess from `key`'s bucket; false when it has none left or
    /// the table has no room for a new key.
    pub fn take(&self, key: &K, now: Instant) -> bool {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if !buckets.contains_key(key) && buckets.len() >= self.max_keys {
            let limiter = &self.limiter;
            buckets.retain(|_, s| !limiter.is_idle(s, now));
            if buckets.len() >= self.max_keys {
                return false;
            }
        }
        let state = buckets.entry(key.clone()).or_default();
        self.limiter.try_acquire(state, now, 1).is_admit()
    }

    /// Gives the guess back (the password was right).
    pub fn refund(&self, key: &K, now: Instant) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(state) = buckets.get_mut(key) {
            // A token is one refill period of theoretical arrival time.
            let tat = Instant::from_nanos(state.tat_ns) - self.limiter.period();
            state.tat_ns = tat.max(now).as_nanos();
            state.tat_frac = 0;
            if self.limiter.is_idle(state, now) {
                buckets.remove(key);
            }
        }
    }

    pub fn tracked(&self) -> usize {
        self.buckets.lock().map(|b| b.len()).unwrap_or(0)
    }
}

/// Which address a throttle counts a client under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressKey {
    V4(std::net::Ipv4Addr),
    /// The /64 the address is in.
    V6Prefix(u64),
}

impl AddressKey {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => AddressKey::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => AddressKey::V4(v4),
                None => AddressKey::V6Prefix(prefix64(v6)),
            },
        }
    }
}

fn prefix64(v6: Ipv6Addr) -> u64 {
    (u128::from(v6) >> 64) as u64
}

/// Where the client's address comes from.
#[derive(Debug, Clone, Default)]
pub struct ClientAddressing {
    /// Peers whose `header` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// e.g. `x-forwarded-for`: comma-separated, client first.
    pub header: Option<String>,
}

impl ClientAddressing {
    /// The client behind `peer`: the peer itself unless it is a trusted
    /// proxy that says otherwise in the header.
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let trusted = |ip: &IpAddr| self.trusted_proxies.iter().any(|n| n.contains(ip));
        let Some(name) = &self.header else {
            return peer;
        };
        if !trusted(&peer) {
            return peer;
        }
        // Every value of the header, in order, as one list; the right-most
        // address not a trusted proxy is the client (what is left of it
        // the client could have written itself).
        let listed: Vec<IpAddr> = headers
            .get_all(name.as_str())
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|a| a.trim().parse().ok())
            .collect();
        listed
            .into_iter()
            .rev()
            .find(|ip| !trusted(ip))
            .unwrap_or(peer)
    }
}

/// Why a login was not checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Too many wrong guesses lately; retry after this long.
    Throttled(Span),
    /// Too many checks queued.
    Busy,
}

/// Checks passwords on one thread of its own, in one argon2 work area
/// (19 MiB) reused from check to check, and never on a thread the store's
/// queries need.
/// A password to check against credentials, or (None) against a decoy: a
/// login for an unknown user takes as long as a known user's, so timing
/// does not tell which names exist.
type CheckJob = (
    Option<crate::auth::Credentials>,
    String,
    tokio::sync::oneshot::Sender<bool>,
);

pub struct PasswordChecker {
    jobs: std::sync::mpsc::SyncSender<CheckJob>,
}

impl PasswordChecker {
    /// One thread checks passwords, one at a time, reusing argon2's work
    /// area (see [`crate::auth::Credentials::verify_in`]).
    pub fn new() -> Self {
        let (jobs, queue) = std::sync::mpsc::sync_channel::<CheckJob>(64);
        let spawned = std::thread::Builder::new()
            .name("sluice-passwords".into())
            .spawn(move || {
                let mut work = Vec::new();
                let mut decoy = None;
                for (credentials, password, answer) in queue {
                    let ok = match credentials {
                        Some(credentials) => credentials.verify_in(&password, &mut work),
                        None => {
                            if decoy.is_none() {
                                decoy = crate::auth::random_token()
                                    .ok()
                                    .and_then(|t| crate::auth::Credentials::from_password(&t).ok());
                            }
                            if let Some(decoy) = &decoy {
                                decoy.verify_in(&password, &mut work);
                            }
                            false
                        }
                    };
                    let _ = answer.send(ok);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no password-checking thread: every login will fail");
        }
        Self { jobs }
    }

    /// Whether `password` matches `credentials` (false if the checker is
    /// gone or its queue is full; always false, after as long, for None).
    pub async fn check(
        &self,
        credentials: Option<crate::auth::Credentials>,
        password: String,
    ) -> bool {
        let (answer, answered) = tokio::sync::oneshot::channel();
        if self.jobs.try_send((credentials, password, answer)).is_err() {
            return false;
        }
        answered.await.unwrap_or(false)
    }
}

impl Default for PasswordChecker {
    fn default() -> Self {
        Self::new()
    }
}

pub struct LoginGuard {
    pub accounts: KeyedThrottle<String>,
    pub addresses: KeyedThrottle<AddressKey>,
    checks: Semaphore,
    started: std::time::Instant,
}

impl Default for LoginGuard {
    fn default() -> Self {
        Self {
            accounts: KeyedThrottle::new(ACCOUNT_BURST, ACCOUNT_REFILL, MAX_TRACKED),
            addresses: KeyedThrottle::new(ADDRESS_BURST, ADDRESS_REFILL, MAX_TRACKED),
            checks: Semaphore::new(MAX_CONCURRENT_CHECKS),
            started: std::time::Instant::now(),
        }
    }
}

/// A guess taken from both throttles, with its turn to be checked.
pub struct Attempt<'a> {
    guard: &'a LoginGuard,
    account: String,
    address: AddressKey,
    _turn: SemaphorePermit<'a>,
}

impl Attempt<'_> {
    /// The password was right: the guess goes back to both throttles.
    pub fn succeeded(self) {
        let now = self.guard.now();
        self.guard.accounts.refund(&self.account, now);
        self.guard.addresses.refund(&self.address, now);
    }
}

impl LoginGuard {
    /// Monotonic time since the guard started (the wall clock may step).
    fn now(&self) -> Instant {
        let elapsed = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Offset so that the first guesses find full buckets.
        Instant::EPOCH + Span::from_secs(86_400) + Span::from_nanos(elapsed)
    }

    /// Takes a guess for `account` from `client` out of both throttles,
    /// then waits for a turn to check it. Nothing is taken when either
    /// throttle refuses.
    pub async fn attempt(&self, account: &str, client: IpAddr) -> Result<Attempt<'_>, Refused> {
        let now = self.now();
        let address = AddressKey::of(client);
        let account = account.to_string();
        let waits = [
            self.accounts.wait(&account, now),
            self.addresses.wait(&address, now),
        ];
        if let Some(wait) = waits.into_iter().flatten().max() {
            return Err(Refused::Throttled(wait));
        }
        if !self.accounts.take(&account, now) {
            return Err(Refused::Throttled(ACCOUNT_REFILL));
        }
        if !self.addresses.take(&address, now) {
            self.accounts.refund(&account, now);
            return Err(Refused::Throttled(ADDRESS_REFILL));
        }
        match tokio::time::timeout(CHECK_QUEUE_TIMEOUT, self.checks.acquire()).await {
            Ok(Ok(turn)) => Ok(Attempt {
                guard: self,
                account,
                address,
                _turn: turn,
            }),
            _ => {
                // Not checked: the guess goes back.
                self.accounts.refund(&account, now);
                self.addresses.refund(&address, now);
                Err(Refused::Busy)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Instant = Instant::from_nanos(1_000_000_000_000);

    #[test]
    fn a_key_gets_its_burst_then_waits() {
        let t = KeyedThrottle::new(3, Span::from_secs(10), 10);
        let k = "admin".to_string();
        for _ in 0..3 {
            assert_eq!(t.wait(&k, T0), None);
            assert!(t.take(&k, T0));
        }
        assert!(!t.take(&k, T0));
        let wait = t.wait(&k, T0).expect("throttled");
        assert!(wait <= Span::from_secs(10), "{wait:?}");
        assert!(t.take(&k, T0 + Span::from_secs(10)));
    }

    #[test]
    fn a_refund_gives_the_guess_back() {
        let t = KeyedThrottle::new(2, Span::from_secs(10), 10);
        let k = 7u32;
        assert!(t.take(&k, T0) && t.take(&k, T0));
        t.refund(&k, T0);
        assert!(t.take(&k, T0), "the refunded guess");
        assert!(!t.take(&k, T0));
    }

    #[test]
    fn a_full_table_makes_room_from_idle_keys_and_never_forgets_busy_ones() {
        let t = KeyedThrottle::new(1, Span::from_secs(10), 3);
        for k in 0..3u32 {
            assert!(t.take(&k, T0));
        }
        // Every entry is throttled: a fourth key is refused, and nobody's
        // throttle is cleared to make room.
        assert!(!t.take(&3, T0));
        assert!(t.wait(&3, T0).is_some());
        assert!(!t.take(&0, T0), "key 0 still throttled");
        assert_eq!(t.tracked(), 3);
        // Once they refilled, they make room.
        let later = T0 + Span::from_secs(11);
        assert!(t.take(&3, later));
        assert!(t.tracked() <= 3);
    }

    #[test]
    fn ipv6_clients_count_per_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(AddressKey::of(a), AddressKey::of(b));
        assert_ne!(AddressKey::of(a), AddressKey::of(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(
            AddressKey::of(mapped),
            AddressKey::of("10.0.0.1".parse().unwrap())
        );
    }

    #[test]
    fn only_a_trusted_proxy_names_the_client() {
        let addressing = ClientAddressing {
            trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
            header: Some("x-forwarded-for".into()),
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-forwarded-for",
            "6.6.6.6, 203.0.113.7, 10.1.1.1".parse().unwrap(),
        );
        let proxy: IpAddr = "10.2.2.2".parse().unwrap();
        let stranger: IpAddr = "198.51.100.1".parse().unwrap();
        // The right-most address that is not a trusted proxy.
        assert_eq!(
            addressing.client(proxy, &headers),
            "203.0.113.7".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            addressing.client(stranger, &headers),
            stranger,
            "not trusted"
        );
        headers.insert("x-forwarded-for", "garbage".parse().unwrap());
        assert_eq!(addressing.client(proxy, &headers), proxy);
        assert_eq!(ClientAddressing::default().client(proxy, &headers), proxy);
    }

    #[tokio::test]
    async fn a_throttled_login_takes_nothing_and_a_good_one_gives_back() {
        let guard = LoginGuard::default();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        for _ in 0..ADDRESS_BURST {
            let attempt = guard.attempt("admin", ip).await.expect("within the burst");
            drop(attempt);
        }
        assert!(matches!(
            guard.attempt("admin", ip).await,
            Err(Refused::Throttled(_))
        ));
        // Another address, same account: the account still has guesses.
        let other: IpAddr = "127.0.0.2".parse().unwrap();
        let attempt = guard
            .attempt("admin", other)
            .await
            .expect("account has room");
        attempt.succeeded();
        let attempt = guard.attempt("admin", other).await.expect("refunded");
        drop(attempt);
    }
}
