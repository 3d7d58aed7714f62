//! Operator authentication: one admin password (argon2 hash), server-side
//! sessions behind an HttpOnly SameSite=Strict cookie, a CSRF token per
//! session checked on every mutating request, and failed logins slowed per
//! client address with the same GCRA limiter the filter uses.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use sluice_shared::limiter::token_bucket::{TokenBucket, TokenBucketState};
use sluice_shared::limiter::Decision;
use sluice_shared::Span;

pub const SESSION_COOKIE: &str = "sluice_session";
pub const CSRF_HEADER: &str = "x-csrf-token";
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Failed logins per client address: a burst of 5, then one every 10 s.
const LOGIN_BURST: u64 = 5;
const LOGIN_REFILL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("hashing the admin password: {0}")]
    Hash(String),
    #[error("the admin password hash is not a valid PHC string: {0}")]
    BadHash(String),
    #[error("no random numbers from the OS: {0}")]
    Random(String),
}

/// How the operator proves who they are.
pub enum Credentials {
    /// An argon2 PHC hash of the admin password.
    Password { hash: String },
    /// `--insecure-dev`: no login needed; every request acts as `dev`.
    InsecureDev,
}

impl Credentials {
    pub fn from_password(password: &str) -> Result<Self, AuthError> {
        let salt_bytes = random_bytes::<16>()?;
        let salt =
            SaltString::encode_b64(&salt_bytes).map_err(|e| AuthError::Hash(e.to_string()))?;
        let hash = Argon2::default()
            .hash_password(password.as_bytes(), &salt)
            .map_err(|e| AuthError::Hash(e.to_string()))?
            .to_string();
        Ok(Self::Password { hash })
    }

    pub fn from_hash(hash: &str) -> Result<Self, AuthError> {
        PasswordHash::new(hash).map_err(|e| AuthError::BadHash(e.to_string()))?;
        Ok(Self::Password { hash: hash.into() })
    }

    pub fn verify(&self, password: &str) -> bool {
        match self {
            Credentials::InsecureDev => true,
            Credentials::Password { hash } => PasswordHash::new(hash)
                .map(|parsed| {
                    Argon2::default()
                        .verify_password(password.as_bytes(), &parsed)
                        .is_ok()
                })
                .unwrap_or(false),
        }
    }

    pub fn is_insecure(&self) -> bool {
        matches!(self, Credentials::InsecureDev)
    }
}

pub fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(buf)
}

pub fn random_token() -> Result<String, AuthError> {
    Ok(random_bytes::<32>()?
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[derive(Debug, Clone)]
pub struct Session {
    pub csrf: String,
    pub user: String,
    expires: Instant,
}

#[derive(Default)]
pub struct Sessions {
    by_token: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// A new session; returns (cookie token, session).
    pub fn create(&self, user: &str) -> Result<(String, Session), AuthError> {
        let token = random_token()?;
        let session = Session {
            csrf: random_token()?,
            user: user.into(),
            expires: Instant::now() + SESSION_TTL,
        };
        if let Ok(mut map) = self.by_token.lock() {
            let now = Instant::now();
            map.retain(|_, s| s.expires > now);
            map.insert(token.clone(), session.clone());
        }
        Ok((token, session))
    }

    pub fn get(&self, token: &str) -> Option<Session> {
        let map = self.by_token.lock().ok()?;
        map.get(token)
            .filter(|s| s.expires > Instant::now())
            .cloned()
    }

    pub fn remove(&self, token: &str) {
        if let Ok(mut map) = self.by_token.lock() {
            map.remove(token);
        }
    }
}

/// Slows password guessing: each failed login takes a token from the
/// client address's bucket; with none left, logins are refused until one
/// comes back.
pub struct LoginThrottle {
    limiter: TokenBucket,
    started: Instant,
    buckets: Mutex<HashMap<IpAddr, TokenBucketState>>,
}

impl Default for LoginThrottle {
    fn default() -> Self {
        Self {
            limiter: TokenBucket::new(1, refill(), LOGIN_BURST, None),
            started: Instant::now(),
            buckets: Mutex::new(HashMap::new()),
        }
    }
}

fn refill() -> Span {
    Span::from_nanos(u64::try_from(LOGIN_REFILL.as_nanos()).unwrap_or(u64::MAX))
}

impl LoginThrottle {
    /// Monotonic time since the throttle started, offset so that a first
    /// failure at start finds a full bucket.
    fn now(&self) -> sluice_shared::Instant {
        let elapsed = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        sluice_shared::Instant::EPOCH
            + Span::from_nanos(elapsed)
            + refill().saturating_mul(LOGIN_BURST)
    }

    /// Time to wait before this address may try again, if it must.
    pub fn blocked_for(&self, ip: IpAddr) -> Option<Duration> {
        let now = self.now();
        let buckets = self.buckets.lock().ok()?;
        let state = buckets.get(&ip)?;
        let available = self.limiter.available(state, now);
        if available > 0 {
            return None;
        }
        let mut probe = *state;
        match self.limiter.try_acquire(&mut probe, now, 1) {
            Decision::Deny { retry_after, .. } => Some(retry_after.as_duration()),
            Decision::Admit { .. } => None,
        }
    }

    pub fn failed(&self, ip: IpAddr) {
        let now = self.now();
        if let Ok(mut buckets) = self.buckets.lock() {
            if buckets.len() > 100_000 {
                buckets.clear();
            }
            let state = buckets.entry(ip).or_default();
            let _ = self.limiter.try_acquire(state, now, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_verifies_and_hash_round_trips() {
        let creds = Credentials::from_password("correct horse").unwrap();
        assert!(creds.verify("correct horse"));
        assert!(!creds.verify("wrong"));
        let Credentials::Password { hash } = &creds else {
            panic!()
        };
        assert!(hash.starts_with("$argon2"));
        assert!(Credentials::from_hash(hash)
            .unwrap()
            .verify("correct horse"));
        assert!(Credentials::from_hash("not a hash").is_err());
    }

    #[test]
    fn five_failures_then_blocked() {
        let throttle = LoginThrottle::default();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        for _ in 0..LOGIN_BURST {
            assert!(throttle.blocked_for(ip).is_none());
            throttle.failed(ip);
        }
        let wait = throttle.blocked_for(ip).expect("blocked after the burst");
        assert!(wait <= LOGIN_REFILL);
        assert!(throttle.blocked_for("10.0.0.1".parse().unwrap()).is_none());
    }
}
