//! Operator authentication: named users (argon2 hashes in the store) and
//! the bootstrap admin password, server-side sessions behind an HttpOnly
//! SameSite=Strict cookie, a CSRF token per session checked on every
//! mutating request, and API tokens kept as the SHA-256 of their secret.
//! Failed logins are slowed in [`crate::login`]; who may do what is decided
//! in [`crate::access`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use argon2::password_hash::{self, PasswordHash, PasswordHasher, SaltString};
use argon2::Argon2;

pub const SESSION_COOKIE: &str = "sluice_session";
pub const CSRF_HEADER: &str = "x-csrf-token";
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

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
#[derive(Clone)]
pub enum Credentials {
    /// An argon2 PHC hash of the admin password.
    Password { hash: String },
    /// No admin password: the store's users are the only way in.
    UsersOnly,
    /// `--insecure-dev`: no login needed; every request acts as `dev`.
    InsecureDev,
}

impl Credentials {
    pub fn from_password(password: &str) -> Result<Self, AuthError> {
        Ok(Self::Password {
            hash: hash_password(password)?,
        })
    }

    pub fn from_hash(hash: &str) -> Result<Self, AuthError> {
        PasswordHash::new(hash).map_err(|e| AuthError::BadHash(e.to_string()))?;
        Ok(Self::Password { hash: hash.into() })
    }

    pub fn verify(&self, password: &str) -> bool {
        self.verify_in(password, &mut Vec::new())
    }

    /// [`Credentials::verify`] with argon2's work area in `work`, kept by
    /// the caller from one check to the next: allocating its 19 MiB anew
    /// for every check leaves the allocator holding one more copy each
    /// time (measured: +19 MiB of resident memory per check).
    pub fn verify_in(&self, password: &str, work: &mut Vec<argon2::Block>) -> bool {
        match self {
            Credentials::InsecureDev => true,
            Credentials::UsersOnly => false,
            Credentials::Password { hash } => {
                verify_with_memory(hash, password.as_bytes(), work).unwrap_or(false)
            }
        }
    }

    pub fn is_insecure(&self) -> bool {
        matches!(self, Credentials::InsecureDev)
    }

    /// An admin password exists besides the store's users.
    pub fn has_bootstrap_password(&self) -> bool {
        matches!(self, Credentials::Password { .. })
    }
}

/// An argon2 PHC hash of `password`, with a fresh salt: what the store
/// keeps of a user's password.
pub fn hash_password(password: &str) -> Result<String, AuthError> {
    let salt_bytes = random_bytes::<16>()?;
    let salt = SaltString::encode_b64(&salt_bytes).map_err(|e| AuthError::Hash(e.to_string()))?;
    Ok(Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map_err(|e| AuthError::Hash(e.to_string()))?
        .to_string())
}

/// The SHA-256 of an API token's secret, in hex: what the store keeps. The
/// secret is 256 random bits, so a fast hash loses nothing to guessing and
/// checking a token costs microseconds, not argon2's 19 MiB.
pub fn token_hash(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The token of an `Authorization: Bearer <token>` header, as sent.
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// Whether `headers` carry `Authorization: Bearer <expected>`, compared
/// in constant time.
pub fn bears(headers: &axum::http::HeaderMap, expected: &str) -> bool {
    bearer(headers).is_some_and(|sent| constant_time_eq(sent.as_bytes(), expected.as_bytes()))
}

/// Compares without stopping at the first difference.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A new token: (id, secret), hex, from the OS's random numbers.
pub fn new_token_parts() -> Result<(String, String), AuthError> {
    let hex = |bytes: &[u8]| -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() };
    Ok((hex(&random_bytes::<8>()?), hex(&random_bytes::<32>()?)))
}

/// The largest work area a stored hash may ask for (its `m` parameter):
/// the hash is the operator's own, but a typo must not take the memory.
const MAX_WORK_BLOCKS: usize = 256 * 1024;

/// Checks `password` against the PHC `hash` with argon2's own primitives,
/// filling `work` (grown to the hash's memory cost, never shrunk).
fn verify_with_memory(hash: &str, password: &[u8], work: &mut Vec<argon2::Block>) -> Option<bool> {
    let parsed = PasswordHash::new(hash).ok()?;
    let algorithm = argon2::Algorithm::try_from(parsed.algorithm).ok()?;
    let version = match parsed.version {
        Some(v) => argon2::Version::try_from(v).ok()?,
        None => argon2::Version::default(),
    };
    let params = argon2::Params::try_from(&parsed).ok()?;
    let expected = parsed.hash?;
    let mut salt_buf = [0u8; 64];
    let salt = parsed.salt?.decode_b64(&mut salt_buf).ok()?;
    let blocks = params.block_count();
    if blocks > MAX_WORK_BLOCKS {
        return None;
    }
    if work.len() < blocks {
        work.resize(blocks, argon2::Block::default());
    }
    let mut out = vec![0u8; expected.len()];
    Argon2::new(algorithm, version, params)
        .hash_password_into_with_memory(password, salt, &mut out, &mut work[..blocks])
        .ok()?;
    // password_hash::Output compares in constant time.
    Some(password_hash::Output::new(&out).ok()? == expected)
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
    /// Logged in with the admin password, not as a stored user.
    pub bootstrap: bool,
    /// The [`password_fingerprint`] of the stored user's hash at login:
    /// a password changed since (here, on another replica or from the
    /// shell) ends the session.
    pub password: Option<String>,
    expires: Instant,
}

/// What a session keeps of the password it was opened with: the SHA-256
/// of the stored argon2 hash (which changes with every new password, its
/// salt being fresh).
pub fn password_fingerprint(password_hash: &str) -> String {
    token_hash(password_hash)
}

#[derive(Default)]
pub struct Sessions {
    by_token: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// A new session; returns (cookie token, session). `password`: the
    /// stored user's [`password_fingerprint`] (None for the admin
    /// password).
    pub fn create(
        &self,
        user: &str,
        bootstrap: bool,
        password: Option<String>,
    ) -> Result<(String, Session), AuthError> {
        let token = random_token()?;
        let session = Session {
            csrf: random_token()?,
            user: user.into(),
            bootstrap,
            password,
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

    /// Ends every session of `user` (their password changed, or they were
    /// removed).
    pub fn remove_user(&self, user: &str) {
        if let Ok(mut map) = self.by_token.lock() {
            map.retain(|_, s| s.bootstrap || s.user != user);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hashes_are_sha256_hex() {
        // SHA-256("abc"), FIPS 180-2's example.
        assert_eq!(
            token_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let (id, secret) = new_token_parts().unwrap();
        assert_eq!((id.len(), secret.len()), (16, 64));
        let token = sluice_api::people::format_token(&id, &secret);
        assert_eq!(
            sluice_api::people::parse_token(&token),
            Some((id.as_str(), secret.as_str()))
        );
        assert!(constant_time_eq(b"ab", b"ab") && !constant_time_eq(b"ab", b"ac"));
        assert!(!constant_time_eq(b"ab", b"abc"));
    }

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
        assert!(!Credentials::UsersOnly.verify(""));
        // One work area, reused: the same answers.
        let mut work = Vec::new();
        for _ in 0..3 {
            assert!(creds.verify_in("correct horse", &mut work));
            assert!(!creds.verify_in("wrong", &mut work));
        }
    }
}
