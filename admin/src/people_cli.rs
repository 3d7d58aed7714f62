//! `sluice-admin user …` and `sluice-admin token …`: manage people and API
//! tokens from a shell, against the same store the service uses (the first
//! admin user is made this way). Changes are audited as `cli:<login>`.

use std::io::{BufRead, Write};

use clap::Subcommand;
use sluice_api::people::{
    check_name, check_password, format_token, parse_lifetime, NewUser, Role, TokenScope,
};

use crate::auth::{hash_password, new_token_parts, random_token, token_hash};
use crate::store::{now_ms, AdminGuard, BlockingStore, StoreError};

#[derive(Debug, Clone, Subcommand)]
pub enum UserAction {
    /// Add a user. The password is read from stdin with --password-stdin;
    /// otherwise one is generated and printed once.
    Add {
        name: String,
        /// viewer (read and watch), editor (also change policies) or admin
        /// (also users and tokens).
        #[arg(long)]
        role: Role,
        #[arg(long)]
        password_stdin: bool,
    },
    /// List users and their roles.
    List,
    /// Give a user another role.
    SetRole { name: String, role: Role },
    /// Give a user a new password (from stdin with --password-stdin, or
    /// generated and printed once).
    SetPassword {
        name: String,
        #[arg(long)]
        password_stdin: bool,
    },
    /// Remove a user (the last admin stays unless an admin password is set).
    Remove { name: String },
}

#[derive(Debug, Clone, Subcommand)]
pub enum TokenAction {
    /// Create an API token; it is printed once and kept only hashed.
    Create {
        name: String,
        /// read (as a viewer) or write (as an editor).
        #[arg(long)]
        scope: TokenScope,
        /// How long it is valid, e.g. 30d, 12h (at most 366d).
        #[arg(long, default_value = "90d")]
        expires: String,
    },
    /// List tokens (never their secrets).
    List,
    /// Revoke a token by its id.
    Revoke { id: String },
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("reading the password from stdin: {0}")]
    Stdin(std::io::Error),
    #[error("writing the answer: {0}")]
    Stdout(std::io::Error),
    #[error("hashing: {0}")]
    Hash(String),
}

fn invalid(field: &'static str) -> impl Fn(String) -> CliError {
    move |message| CliError::Invalid { field, message }
}

/// Who the audit log names for a change made here.
pub fn cli_actor() -> String {
    let login = std::env::var("USER")
        .ok()
        .filter(|u| check_name(u).is_ok())
        .unwrap_or_else(|| "unknown".into());
    format!("cli:{login}")
}

/// A password from `stdin` (its first line), or a new random one that is
/// also printed.
fn password(
    from_stdin: bool,
    stdin: &mut impl BufRead,
    out: &mut impl Write,
) -> Result<String, CliError> {
    if from_stdin {
        let mut line = String::new();
        stdin.read_line(&mut line).map_err(CliError::Stdin)?;
        let password = line.trim_end_matches(['\r', '\n']).to_string();
        check_password(&password).map_err(invalid("password"))?;
        return Ok(password);
    }
    // 128 bits, as 32 hex digits: typed once into a password manager.
    let password = random_token()
        .map_err(|e| CliError::Hash(e.to_string()))?
        .chars()
        .take(32)
        .collect::<String>();
    writeln!(out, "password (shown once): {password}").map_err(CliError::Stdout)?;
    Ok(password)
}

fn hash(password: &str) -> Result<String, CliError> {
    hash_password(password).map_err(|e| CliError::Hash(e.to_string()))
}

pub fn run_user(
    store: &BlockingStore,
    action: UserAction,
    guard: AdminGuard,
    stdin: &mut impl BufRead,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let actor = cli_actor();
    match action {
        UserAction::Add {
            name,
            role,
            password_stdin,
        } => {
            check_name(&name).map_err(invalid("name"))?;
            let password = password(password_stdin, stdin, out)?;
            NewUser {
                name: name.clone(),
                role,
                password: password.clone(),
            }
            .check()
            .map_err(|e| CliError::Invalid {
                field: "user",
                message: e.to_string(),
            })?;
            let user = store.add_user(&name, role, &hash(&password)?, &actor)?;
            writeln!(out, "added {} as {}", user.name, user.role).map_err(CliError::Stdout)?;
        }
        UserAction::List => {
            for user in store.users()? {
                writeln!(
                    out,
                    "{}\t{}\tadded by {}",
                    user.name, user.role, user.created_by
                )
                .map_err(CliError::Stdout)?;
            }
        }
        UserAction::SetRole { name, role } => {
            let user = store.change_user(&name, Some(role), None, &actor, guard)?;
            writeln!(out, "{} is now {}", user.name, user.role).map_err(CliError::Stdout)?;
        }
        UserAction::SetPassword {
            name,
            password_stdin,
        } => {
            if store.user(&name)?.is_none() {
                return Err(StoreError::NoSuchUser(name).into());
            }
            let password = password(password_stdin, stdin, out)?;
            store.change_user(&name, None, Some(&hash(&password)?), &actor, guard)?;
            writeln!(out, "new password set for {name}").map_err(CliError::Stdout)?;
        }
        UserAction::Remove { name } => {
            store.remove_user(&name, &actor, guard)?;
            writeln!(out, "removed {name}").map_err(CliError::Stdout)?;
        }
    }
    Ok(())
}

pub fn run_token(
    store: &BlockingStore,
    action: TokenAction,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let actor = cli_actor();
    match action {
        TokenAction::Create {
            name,
            scope,
            expires,
        } => {
            check_name(&name).map_err(invalid("name"))?;
            let lifetime = parse_lifetime(&expires).map_err(invalid("--expires"))?;
            let (id, secret) = new_token_parts().map_err(|e| CliError::Hash(e.to_string()))?;
            let expires_ms = now_ms().saturating_add(lifetime.as_millis());
            let info =
                store.add_token(&id, &name, scope, &token_hash(&secret), expires_ms, &actor)?;
            writeln!(
                out,
                "token {} ({}, {} scope, expires in {expires}):\n{}",
                info.name,
                info.id,
                info.scope,
                format_token(&id, &secret)
            )
            .map_err(CliError::Stdout)?;
        }
        TokenAction::List => {
            let now = now_ms();
            for t in store.tokens()? {
                let state = if t.expires_ms <= now {
                    "expired"
                } else {
                    "valid"
                };
                writeln!(
                    out,
                    "{}\t{}\t{}\t{state}\tcreated by {}",
                    t.id, t.name, t.scope, t.created_by
                )
                .map_err(CliError::Stdout)?;
            }
        }
        TokenAction::Revoke { id } => {
            store.revoke_token(&id, &actor)?;
            writeln!(out, "revoked {id}").map_err(CliError::Stdout)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Credentials;

    fn store() -> (tempfile::TempDir, BlockingStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlockingStore::open(&dir.path().join("s.db")).unwrap();
        (dir, store)
    }

    fn run(store: &BlockingStore, action: UserAction, stdin: &str) -> Result<String, CliError> {
        let mut out = Vec::new();
        run_user(
            store,
            action,
            AdminGuard::KeepOne,
            &mut stdin.as_bytes(),
            &mut out,
        )?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn a_user_added_from_the_shell_can_log_in_with_the_password_it_was_given() {
        let (_dir, store) = store();
        let said = run(
            &store,
            UserAction::Add {
                name: "alice".into(),
                role: Role::Admin,
                password_stdin: false,
            },
            "",
        )
        .unwrap();
        let password = said
            .lines()
            .find_map(|l| l.strip_prefix("password (shown once): "))
            .unwrap();
        let stored = store.user("alice").unwrap().unwrap();
        let credentials = Credentials::from_hash(&stored.password_hash).unwrap();
        assert!(credentials.verify(password));
        assert_eq!(stored.info.created_by, cli_actor());
        run(
            &store,
            UserAction::Add {
                name: "bob".into(),
                role: Role::Viewer,
                password_stdin: true,
            },
            "a long enough password\n",
        )
        .unwrap();
        let bob = store.user("bob").unwrap().unwrap();
        assert!(Credentials::from_hash(&bob.password_hash)
            .unwrap()
            .verify("a long enough password"));
    }

    #[test]
    fn bad_names_passwords_and_the_last_admin_are_refused_with_the_reason() {
        let (_dir, store) = store();
        let err = run(
            &store,
            UserAction::Add {
                name: "a b".into(),
                role: Role::Admin,
                password_stdin: false,
            },
            "",
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("name: "), "{err}");
        let err = run(
            &store,
            UserAction::Add {
                name: "carol".into(),
                role: Role::Admin,
                password_stdin: true,
            },
            "short\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("at least 12"), "{err}");
        assert_eq!(store.count_users().unwrap(), 0);
        run(
            &store,
            UserAction::Add {
                name: "carol".into(),
                role: Role::Admin,
                password_stdin: false,
            },
            "",
        )
        .unwrap();
        let err = run(
            &store,
            UserAction::Remove {
                name: "carol".into(),
            },
            "",
        )
        .unwrap_err();
        assert!(err.to_string().contains("last admin"), "{err}");
    }

    #[test]
    fn a_token_is_printed_once_and_kept_hashed() {
        let (_dir, store) = store();
        let mut out = Vec::new();
        run_token(
            &store,
            TokenAction::Create {
                name: "ci".into(),
                scope: TokenScope::Write,
                expires: "30d".into(),
            },
            &mut out,
        )
        .unwrap();
        let said = String::from_utf8(out).unwrap();
        let token = said.lines().last().unwrap();
        let (id, secret) = sluice_api::people::parse_token(token).unwrap();
        let record = store.token(id).unwrap().unwrap();
        assert_eq!(record.secret_hash, token_hash(secret));
        assert!(!record.secret_hash.contains(secret));
        let err = run_token(
            &store,
            TokenAction::Create {
                name: "ci2".into(),
                scope: TokenScope::Read,
                expires: "5y".into(),
            },
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("--expires: "), "{err}");
    }
}
