//! Who may do what in the admin: named users with a role, API tokens with a
//! scope, and the checks on what an operator types for them (names,
//! passwords, expiries). Pure: the admin hashes and stores, the UI shows.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use sluice_shared::duration::DurationMs;
use sluice_shared::validate::{FieldError, ValidationErrors};

/// What a person may do. Each role can do everything the one before can.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read policies, the audit log, the fleet; watch the live view.
    #[default]
    Viewer,
    /// Also create, change and delete policies.
    Editor,
    /// Also manage users and API tokens.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Editor, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Editor => "editor",
            Role::Admin => "admin",
        }
    }

    /// May change policies.
    pub fn can_edit(self) -> bool {
        self >= Role::Editor
    }

    /// May manage users and tokens.
    pub fn can_administer(self) -> bool {
        self >= Role::Admin
    }

    /// One line on what the role allows, for the UI and `--help`.
    pub fn describe(self) -> &'static str {
        match self {
            Role::Viewer => "read policies, the audit log and the fleet; watch the live view",
            Role::Editor => "also create, change and delete policies",
            Role::Admin => "also manage users and API tokens",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == text)
            .ok_or_else(|| format!("{text:?} is not a role: viewer, editor or admin"))
    }
}

/// What an API token may do: read as a viewer, or write as an editor.
/// Tokens never manage users or tokens: a leaked CI token must not mint
/// more of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenScope {
    Read,
    Write,
}

impl TokenScope {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenScope::Read => "read",
            TokenScope::Write => "write",
        }
    }

    /// The role a request bearing the token acts with.
    pub fn role(self) -> Role {
        match self {
            TokenScope::Read => Role::Viewer,
            TokenScope::Write => Role::Editor,
        }
    }
}

impl fmt::Display for TokenScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TokenScope {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "read" => Ok(TokenScope::Read),
            "write" => Ok(TokenScope::Write),
            _ => Err(format!("{text:?} is not a token scope: read or write")),
        }
    }
}

/// Longest user or token name.
pub const MAX_NAME_LEN: usize = 128;
/// Shortest password a user may be given.
pub const MIN_PASSWORD_LEN: usize = 12;
/// Longest password (argon2 hashes whatever it is given: a megabyte of
/// password must not cost a megabyte of hashing).
pub const MAX_PASSWORD_LEN: usize = 1024;
/// Longest a token may live.
pub const MAX_TOKEN_LIFETIME: DurationMs = DurationMs::from_secs(366 * 86_400);
/// What a token lives for when the request does not say.
pub const DEFAULT_TOKEN_LIFETIME: DurationMs = DurationMs::from_secs(90 * 86_400);

/// A user or token name: letters, digits and `. _ - @ +`, so that an
/// e-mail address (a reverse proxy's user) fits and nothing that could be
/// mistaken for markup, a path or a log field does.
pub fn check_name(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("must not be empty".into());
    }
    if text.len() > MAX_NAME_LEN {
        return Err(format!("must be at most {MAX_NAME_LEN} characters"));
    }
    match text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@' | '+')))
    {
        Some(c) => Err(format!(
            "{c:?} is not allowed: use letters, digits and . _ - @ +"
        )),
        None => Ok(()),
    }
}

pub fn check_password(text: &str) -> Result<(), String> {
    let chars = text.chars().count();
    if chars < MIN_PASSWORD_LEN {
        return Err(format!(
            "must be at least {MIN_PASSWORD_LEN} characters (it has {chars})"
        ));
    }
    if text.len() > MAX_PASSWORD_LEN {
        return Err(format!("must be at most {MAX_PASSWORD_LEN} bytes"));
    }
    Ok(())
}

/// A token's lifetime as typed (`"90d"`, `"12h"`): more than nothing, at
/// most [`MAX_TOKEN_LIFETIME`].
pub fn parse_lifetime(text: &str) -> Result<DurationMs, String> {
    let lifetime = DurationMs::parse(text)?;
    if lifetime.as_millis() == 0 {
        return Err("must be more than 0".into());
    }
    if lifetime > MAX_TOKEN_LIFETIME {
        return Err(format!("must be at most {MAX_TOKEN_LIFETIME}"));
    }
    Ok(lifetime)
}

/// What every API token starts with, so that secret scanners and people can
/// tell one when they see it.
pub const TOKEN_PREFIX: &str = "sluice_";
/// Hex digits in a token's id (public: it names the token in lists and the
/// audit log) and in its secret (256 bits).
pub const TOKEN_ID_LEN: usize = 16;
pub const TOKEN_SECRET_LEN: usize = 64;

/// A token as shown once to its creator: `sluice_<id>_<secret>`.
pub fn format_token(id: &str, secret: &str) -> String {
    format!("{TOKEN_PREFIX}{id}_{secret}")
}

/// `sluice_<id>_<secret>` → (id, secret); None for anything else, without
/// saying why (the caller answers 401 either way).
pub fn parse_token(text: &str) -> Option<(&str, &str)> {
    let rest = text.strip_prefix(TOKEN_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(id, TOKEN_ID_LEN) && hex(secret, TOKEN_SECRET_LEN)).then_some((id, secret))
}

/// `POST /login`. `user` defaults to `admin`, the account the admin
/// password (`SLUICE_ADMIN_PASSWORD`) logs in as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoginRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    pub password: String,
}

/// The account the admin password logs in as.
pub const BOOTSTRAP_ADMIN: &str = "admin";

/// One user as the API lists them (never the password hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserInfo {
    pub name: String,
    pub role: Role,
    pub created_ms: u64,
    pub created_by: String,
}

/// `GET /users`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserList {
    pub users: Vec<UserInfo>,
}

/// `POST /users`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewUser {
    pub name: String,
    pub role: Role,
    pub password: String,
}

/// `PATCH /users/{name}`: a new role, a new password, or both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserChange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
}

/// One API token as listed (never its secret or hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: String,
    pub name: String,
    pub scope: TokenScope,
    pub created_ms: u64,
    pub created_by: String,
    pub expires_ms: u64,
    /// When it was last used (to the minute); None if never.
    #[serde(default)]
    pub last_used_ms: Option<u64>,
}

/// `GET /tokens`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenList {
    pub tokens: Vec<TokenInfo>,
    pub now_ms: u64,
}

/// `POST /tokens`: `expires_in` as a duration (`"90d"`; default 90 days).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    pub name: String,
    pub scope: TokenScope,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in: Option<String>,
}

/// The answer to `POST /tokens`: the token itself, shown this once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedToken {
    pub token: String,
    pub info: TokenInfo,
}

impl NewUser {
    /// Every problem with the request, by field.
    pub fn check(&self) -> Result<(), ValidationErrors> {
        let mut errors = Vec::new();
        if let Err(message) = check_name(&self.name) {
            errors.push(field("name", message));
        }
        if let Err(message) = check_password(&self.password) {
            errors.push(field("password", message));
        }
        into_result(errors)
    }
}

impl UserChange {
    pub fn check(&self) -> Result<(), ValidationErrors> {
        let mut errors = Vec::new();
        if self.role.is_none() && self.password.is_none() {
            errors.push(field("", "name a new role, a new password, or both"));
        }
        if let Some(Err(message)) = self.password.as_deref().map(check_password) {
            errors.push(field("password", message));
        }
        into_result(errors)
    }
}

impl NewToken {
    /// The token's lifetime, or every problem with the request.
    pub fn check(&self) -> Result<DurationMs, ValidationErrors> {
        let mut errors = Vec::new();
        if let Err(message) = check_name(&self.name) {
            errors.push(field("name", message));
        }
        let lifetime = match self.expires_in.as_deref() {
            None => Some(DEFAULT_TOKEN_LIFETIME),
            Some(text) => parse_lifetime(text)
                .map_err(|message| errors.push(field("expires_in", message)))
                .ok(),
        };
        into_result(errors)?;
        lifetime.ok_or_else(|| ValidationErrors {
            errors: vec![field("expires_in", "no lifetime")],
        })
    }
}

fn field(path: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        path: path.into(),
        message: message.into(),
    }
}

fn into_result(errors: Vec<FieldError>) -> Result<(), ValidationErrors> {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors { errors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roles_order_what_they_may_do() {
        assert!(!Role::Viewer.can_edit());
        assert!(Role::Editor.can_edit() && !Role::Editor.can_administer());
        assert!(Role::Admin.can_edit() && Role::Admin.can_administer());
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
        }
        assert!("root"
            .parse::<Role>()
            .unwrap_err()
            .contains("viewer, editor or admin"));
        assert_eq!(TokenScope::Read.role(), Role::Viewer);
        assert_eq!(TokenScope::Write.role(), Role::Editor);
    }

    #[test]
    fn names_allow_emails_and_nothing_that_reads_as_markup_or_paths() {
        for ok in ["alice", "ci-deploy", "a.b_c+d@example.com", "X1"] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a b", "<script>", "../etc", "a/b", "é", "a\nb"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&"a".repeat(MAX_NAME_LEN + 1)).is_err());
    }

    #[test]
    fn passwords_have_a_floor_and_a_ceiling() {
        assert!(check_password("short").unwrap_err().contains("at least 12"));
        assert_eq!(check_password("twelve chars"), Ok(()));
        assert!(check_password(&"x".repeat(MAX_PASSWORD_LEN + 1)).is_err());
    }

    #[test]
    fn token_lifetimes_are_bounded() {
        assert_eq!(
            parse_lifetime("90d"),
            Ok(DurationMs::from_secs(90 * 86_400))
        );
        assert!(parse_lifetime("0s").is_err());
        assert!(parse_lifetime("400d").unwrap_err().contains("at most"));
        assert!(parse_lifetime("soon").is_err());
        let request = NewToken {
            name: "ci".into(),
            scope: TokenScope::Write,
            expires_in: None,
        };
        assert_eq!(request.check(), Ok(DEFAULT_TOKEN_LIFETIME));
    }

    #[test]
    fn every_bad_field_of_a_request_is_named() {
        let errors = NewUser {
            name: "a b".into(),
            role: Role::Viewer,
            password: "short".into(),
        }
        .check()
        .unwrap_err();
        let paths: Vec<&str> = errors.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["name", "password"]);
        let errors = NewToken {
            name: "".into(),
            scope: TokenScope::Read,
            expires_in: Some("2y".into()),
        }
        .check()
        .unwrap_err();
        let paths: Vec<&str> = errors.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["name", "expires_in"]);
        assert!(UserChange::default().check().is_err());
    }

    #[test]
    fn a_token_round_trips_and_anything_else_is_not_one() {
        let (id, secret) = ("0123456789abcdef", "f".repeat(TOKEN_SECRET_LEN));
        let token = format_token(id, &secret);
        assert_eq!(parse_token(&token), Some((id, secret.as_str())));
        for bad in [
            "",
            "sluice_",
            "sluice_0123456789abcdef",
            "sluice_0123456789abcdef_",
            "other_0123456789abcdef_ff",
            &format!("sluice_0123456789abcdeg_{secret}"),
            &format!("sluice_0123456789abcdef_{secret}0"),
        ] {
            assert_eq!(parse_token(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn any_text_parses_as_a_token_or_not_without_panicking(text in ".{0,120}") {
            if let Some((id, secret)) = parse_token(&text) {
                prop_assert_eq!(format_token(id, secret), text.clone());
            }
            let _ = check_name(&text);
            let _ = check_password(&text);
            let _ = parse_lifetime(&text);
        }
    }
}
