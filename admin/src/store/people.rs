//! Users and API tokens in the store. Every change writes an audit entry in
//! the same transaction, naming who made it; hashes never leave this module
//! except to be checked.

use serde_json::json;
use sluice_api::people::{Role, TokenInfo, TokenScope, UserInfo};

use super::blocking::{audit_entry, BlockingStore};
use super::db::{Row, Sql};
use super::{now_ms, StoreError};

/// A user's record with the hash their password is checked against.
#[derive(Debug, Clone)]
pub struct UserRecord {
    pub info: UserInfo,
    pub password_hash: String,
}

/// A token's record with the hash its secret is checked against.
#[derive(Debug, Clone)]
pub struct TokenRecord {
    pub info: TokenInfo,
    pub secret_hash: String,
}

/// What a change to a user must leave standing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminGuard {
    /// Another way in as an admin exists (the admin password): the last
    /// admin user may go.
    None,
    /// The store's users are the only way in: the last admin may not be
    /// removed or demoted.
    KeepOne,
}

const LAST_USED_GRANULARITY_MS: u64 = 60_000;

fn role_of(row: &Row, i: usize) -> Result<Role, StoreError> {
    row.text(i)?
        .parse()
        .map_err(|e: String| StoreError::Corrupt(format!("user role: {e}")))
}

fn user_of(row: &Row) -> Result<UserRecord, StoreError> {
    Ok(UserRecord {
        info: UserInfo {
            name: row.text(0)?,
            role: role_of(row, 1)?,
            created_ms: row.uint(2)?,
            created_by: row.text(3)?,
        },
        password_hash: row.text(4)?,
    })
}

fn token_of(row: &Row) -> Result<TokenRecord, StoreError> {
    let scope: TokenScope = row
        .text(2)?
        .parse()
        .map_err(|e: String| StoreError::Corrupt(format!("token scope: {e}")))?;
    Ok(TokenRecord {
        info: TokenInfo {
            id: row.text(0)?,
            name: row.text(1)?,
            scope,
            created_ms: row.uint(4)?,
            created_by: row.text(5)?,
            expires_ms: row.uint(6)?,
            last_used_ms: row.optional_uint(7)?,
        },
        secret_hash: row.text(3)?,
    })
}

const USER_COLUMNS: &str = "name, role, created_ms, created_by, password_hash";
const TOKEN_COLUMNS: &str =
    "id, name, scope, secret_hash, created_ms, created_by, expires_ms, last_used_ms";

fn audit(
    sql: &mut dyn Sql,
    actor: &str,
    action: &str,
    target: &str,
    old: Option<serde_json::Value>,
    new: Option<serde_json::Value>,
) -> Result<(), StoreError> {
    audit_entry(
        sql,
        now_ms(),
        actor,
        action,
        target,
        old.map(|v| v.to_string()),
        new.map(|v| v.to_string()),
    )
}

fn admins(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    let row = sql.query_one(
        "SELECT COUNT(*) FROM users WHERE role = $1",
        &[Role::Admin.as_str().into()],
    )?;
    row.map_or(Ok(0), |r| r.uint(0))
}

fn find_user(sql: &mut dyn Sql, name: &str) -> Result<Option<UserRecord>, StoreError> {
    sql.query_one(
        &format!("SELECT {USER_COLUMNS} FROM users WHERE name = $1"),
        &[name.into()],
    )?
    .map(|r| user_of(&r))
    .transpose()
}

impl BlockingStore {
    pub fn add_user(
        &self,
        name: &str,
        role: Role,
        password_hash: &str,
        actor: &str,
    ) -> Result<UserInfo, StoreError> {
        let now = now_ms();
        self.db.write(|sql| {
            let added = sql.execute(
                "INSERT INTO users (name, role, password_hash, created_ms, created_by)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO NOTHING",
                &[
                    name.into(),
                    role.as_str().into(),
                    password_hash.into(),
                    now.into(),
                    actor.into(),
                ],
            )?;
            if added == 0 {
                return Err(StoreError::Exists(format!("a user named {name:?} exists")));
            }
            audit(
                sql,
                actor,
                "user.add",
                name,
                None,
                Some(json!({ "role": role })),
            )?;
            Ok(UserInfo {
                name: name.into(),
                role,
                created_ms: now,
                created_by: actor.into(),
            })
        })
    }

    pub fn users(&self) -> Result<Vec<UserInfo>, StoreError> {
        let rows = self.db.read(|sql| {
            sql.query(
                &format!("SELECT {USER_COLUMNS} FROM users ORDER BY name"),
                &[],
            )
        })?;
        rows.iter().map(|r| user_of(r).map(|u| u.info)).collect()
    }

    pub fn user(&self, name: &str) -> Result<Option<UserRecord>, StoreError> {
        self.db.read(|sql| find_user(sql, name))
    }

    pub fn count_users(&self) -> Result<u64, StoreError> {
        self.db.read(|sql| {
            sql.query_one("SELECT COUNT(*) FROM users", &[])?
                .map_or(Ok(0), |r| r.uint(0))
        })
    }

    /// A new role, a new password hash, or both.
    pub fn change_user(
        &self,
        name: &str,
        role: Option<Role>,
        password_hash: Option<&str>,
        actor: &str,
        guard: AdminGuard,
    ) -> Result<UserInfo, StoreError> {
        self.db.write(|sql| {
            let mut user = find_user(sql, name)?
                .ok_or_else(|| StoreError::NoSuchUser(name.into()))?
                .info;
            let old_role = user.role;
            if let Some(role) = role {
                if guard == AdminGuard::KeepOne
                    && old_role == Role::Admin
                    && role != Role::Admin
                    && admins(sql)? <= 1
                {
                    return Err(StoreError::LastAdmin(name.into()));
                }
                sql.execute(
                    "UPDATE users SET role = $2 WHERE name = $1",
                    &[name.into(), role.as_str().into()],
                )?;
                user.role = role;
            }
            if let Some(hash) = password_hash {
                sql.execute(
                    "UPDATE users SET password_hash = $2 WHERE name = $1",
                    &[name.into(), hash.into()],
                )?;
            }
            audit(
                sql,
                actor,
                "user.change",
                name,
                Some(json!({ "role": old_role })),
                Some(json!({ "role": user.role, "password_changed": password_hash.is_some() })),
            )?;
            Ok(user)
        })
    }

    pub fn remove_user(
        &self,
        name: &str,
        actor: &str,
        guard: AdminGuard,
    ) -> Result<(), StoreError> {
        self.db.write(|sql| {
            let user = find_user(sql, name)?.ok_or_else(|| StoreError::NoSuchUser(name.into()))?;
            if guard == AdminGuard::KeepOne && user.info.role == Role::Admin && admins(sql)? <= 1 {
                return Err(StoreError::LastAdmin(name.into()));
            }
            sql.execute("DELETE FROM users WHERE name = $1", &[name.into()])?;
            audit(
                sql,
                actor,
                "user.remove",
                name,
                Some(json!({ "role": user.info.role })),
                None,
            )
        })
    }

    pub fn add_token(
        &self,
        id: &str,
        name: &str,
        scope: TokenScope,
        secret_hash: &str,
        expires_ms: u64,
        actor: &str,
    ) -> Result<TokenInfo, StoreError> {
        let now = now_ms();
        self.db.write(|sql| {
            let taken = sql.query_one(
                "SELECT id FROM api_tokens WHERE name = $1 OR id = $2",
                &[name.into(), id.into()],
            )?;
            if taken.is_some() {
                return Err(StoreError::Exists(format!(
                    "a token named {name:?} exists (revoke it first, or choose another name)"
                )));
            }
            sql.execute(
                "INSERT INTO api_tokens (id, name, scope, secret_hash, created_ms, created_by, expires_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &[
                    id.into(),
                    name.into(),
                    scope.as_str().into(),
                    secret_hash.into(),
                    now.into(),
                    actor.into(),
                    expires_ms.into(),
                ],
            )?;
            audit(
                sql,
                actor,
                "token.create",
                name,
                None,
                Some(json!({ "id": id, "scope": scope, "expires_ms": expires_ms })),
            )?;
            Ok(TokenInfo {
                id: id.into(),
                name: name.into(),
                scope,
                created_ms: now,
                created_by: actor.into(),
                expires_ms,
                last_used_ms: None,
            })
        })
    }

    pub fn tokens(&self) -> Result<Vec<TokenInfo>, StoreError> {
        let rows = self.db.read(|sql| {
            sql.query(
                &format!("SELECT {TOKEN_COLUMNS} FROM api_tokens ORDER BY name"),
                &[],
            )
        })?;
        rows.iter().map(|r| token_of(r).map(|t| t.info)).collect()
    }

    pub fn token(&self, id: &str) -> Result<Option<TokenRecord>, StoreError> {
        self.db.read(|sql| {
            sql.query_one(
                &format!("SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE id = $1"),
                &[id.into()],
            )?
            .map(|r| token_of(&r))
            .transpose()
        })
    }

    /// Notes that the token was used at `now`, to the minute: a script
    /// calling every second costs one write a minute.
    pub fn token_used(&self, id: &str, now: u64) -> Result<(), StoreError> {
        self.db.touch(|sql| {
            sql.execute(
                "UPDATE api_tokens SET last_used_ms = $2
                 WHERE id = $1 AND (last_used_ms IS NULL OR last_used_ms < $3)",
                &[
                    id.into(),
                    now.into(),
                    now.saturating_sub(LAST_USED_GRANULARITY_MS).into(),
                ],
            )
            .map(drop)
        })
    }

    /// Revokes (deletes) the token `id`; the audit log keeps what it was.
    pub fn revoke_token(&self, id: &str, actor: &str) -> Result<(), StoreError> {
        self.db.write(|sql| {
            let token = sql
                .query_one(
                    &format!("SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE id = $1"),
                    &[id.into()],
                )?
                .map(|r| token_of(&r))
                .transpose()?
                .ok_or_else(|| StoreError::NoSuchToken(id.into()))?;
            sql.execute("DELETE FROM api_tokens WHERE id = $1", &[id.into()])?;
            audit(
                sql,
                actor,
                "token.revoke",
                &token.info.name,
                Some(json!({ "id": id, "scope": token.info.scope })),
                None,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, BlockingStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlockingStore::open(&dir.path().join("s.db")).unwrap();
        (dir, store)
    }

    #[test]
    fn users_are_added_changed_and_removed_with_an_audit_entry_each() {
        let (_dir, store) = store();
        store.add_user("alice", Role::Admin, "h1", "admin").unwrap();
        store.add_user("bob", Role::Viewer, "h2", "alice").unwrap();
        assert!(matches!(
            store.add_user("bob", Role::Editor, "h3", "alice"),
            Err(StoreError::Exists(_))
        ));
        let bob = store
            .change_user(
                "bob",
                Some(Role::Editor),
                Some("h4"),
                "alice",
                AdminGuard::KeepOne,
            )
            .unwrap();
        assert_eq!(bob.role, Role::Editor);
        assert_eq!(store.user("bob").unwrap().unwrap().password_hash, "h4");
        // The last admin stays while the users are the only way in.
        assert!(matches!(
            store.remove_user("alice", "alice", AdminGuard::KeepOne),
            Err(StoreError::LastAdmin(_))
        ));
        assert!(matches!(
            store.change_user(
                "alice",
                Some(Role::Viewer),
                None,
                "alice",
                AdminGuard::KeepOne
            ),
            Err(StoreError::LastAdmin(_))
        ));
        store
            .remove_user("alice", "admin", AdminGuard::None)
            .unwrap();
        assert!(matches!(
            store.remove_user("nobody", "admin", AdminGuard::None),
            Err(StoreError::NoSuchUser(_))
        ));
        let names: Vec<String> = store.users().unwrap().into_iter().map(|u| u.name).collect();
        assert_eq!(names, ["bob"]);
        let log = store.audit_log(10, None).unwrap();
        let actions: Vec<(&str, &str, &str)> = log
            .iter()
            .map(|e| (e.actor.as_str(), e.action.as_str(), e.target.as_str()))
            .collect();
        assert_eq!(
            actions,
            [
                ("admin", "user.remove", "alice"),
                ("alice", "user.change", "bob"),
                ("alice", "user.add", "bob"),
                ("admin", "user.add", "alice"),
            ]
        );
        assert_eq!(
            log[1].new,
            Some(json!({"role": "editor", "password_changed": true}))
        );
    }

    #[test]
    fn tokens_are_found_by_id_noted_when_used_and_revoked() {
        let (_dir, store) = store();
        let info = store
            .add_token(
                "00112233aabbccdd",
                "ci",
                TokenScope::Write,
                "hash",
                5_000,
                "alice",
            )
            .unwrap();
        assert!(matches!(
            store.add_token("ffff2233aabbccdd", "ci", TokenScope::Read, "x", 1, "alice"),
            Err(StoreError::Exists(_))
        ));
        let found = store.token("00112233aabbccdd").unwrap().unwrap();
        assert_eq!(
            (found.info.clone(), found.secret_hash.as_str()),
            (info, "hash")
        );
        store.token_used("00112233aabbccdd", 100_000).unwrap();
        store.token_used("00112233aabbccdd", 130_000).unwrap();
        assert_eq!(
            store
                .token("00112233aabbccdd")
                .unwrap()
                .unwrap()
                .info
                .last_used_ms,
            Some(100_000),
            "used again within the minute: not written"
        );
        store.token_used("00112233aabbccdd", 170_000).unwrap();
        assert_eq!(store.tokens().unwrap()[0].last_used_ms, Some(170_000));
        store.revoke_token("00112233aabbccdd", "alice").unwrap();
        assert!(store.token("00112233aabbccdd").unwrap().is_none());
        assert!(matches!(
            store.revoke_token("00112233aabbccdd", "alice"),
            Err(StoreError::NoSuchToken(_))
        ));
        assert_eq!(store.audit_log(1, None).unwrap()[0].action, "token.revoke");
    }
}
