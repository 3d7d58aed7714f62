//! Named users, roles, API tokens and a trusted proxy's user header, over
//! real HTTP with a real SQLite file; the shell commands through the real
//! binary.

use std::io::Write;
use std::sync::Arc;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sluice_admin::access::ProxyUsers;
use sluice_admin::auth::{token_hash, Credentials};
use sluice_admin::store::Store;
use sluice_admin::AppState;
use sluice_api::people::{Role, TokenScope};

const PASSWORD: &str = "test-password-1";

struct Admin {
    base: String,
    http: reqwest::Client,
    store: Store,
    _dir: tempfile::TempDir,
}

#[derive(Clone)]
struct As {
    headers: Vec<(String, String)>,
}

impl As {
    fn nobody() -> Self {
        Self { headers: vec![] }
    }

    fn token(token: &str) -> Self {
        Self {
            headers: vec![("authorization".into(), format!("Bearer {token}"))],
        }
    }

    fn with(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

async fn start(credentials: Credentials, proxy_users: ProxyUsers) -> Admin {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("sluice.db")).unwrap();
    let state = Arc::new(
        AppState::new(store.clone(), credentials, Some("sync".into()), false)
            .with_proxy_users(proxy_users),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(sluice_admin::serve(
        listener,
        state,
        None,
        std::future::pending(),
    ));
    Admin {
        base,
        http: reqwest::Client::new(),
        store,
        _dir: dir,
    }
}

async fn start_default() -> Admin {
    start(
        Credentials::from_password(PASSWORD).unwrap(),
        ProxyUsers::default(),
    )
    .await
}

impl Admin {
    async fn call(
        &self,
        who: &As,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        for (k, v) in &who.headers {
            req = req.header(k, v);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Logs in as `user` (None: the admin password's account) with the
    /// CSRF token on every request.
    async fn login(&self, user: Option<&str>, password: &str) -> Result<As, StatusCode> {
        let mut body = json!({ "password": password });
        if let Some(user) = user {
            body["user"] = json!(user);
        }
        let resp = self
            .http
            .post(format!("{}/api/v1/login", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        if resp.status() != StatusCode::OK {
            return Err(resp.status());
        }
        let cookie = resp.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_string();
        let info: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        Ok(As {
            headers: vec![
                ("cookie".into(), cookie),
                (
                    "x-csrf-token".into(),
                    info["csrf_token"].as_str().unwrap().into(),
                ),
            ],
        })
    }

    async fn add_user(&self, admin: &As, name: &str, role: &str) -> As {
        let password = format!("{name}-password-123");
        let (status, body) = self
            .call(
                admin,
                Method::POST,
                "/api/v1/users",
                Some(json!({"name": name, "role": role, "password": password})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        self.login(Some(name), &password).await.unwrap()
    }

    async fn audit_actors(&self, admin: &As) -> Vec<(String, String, String)> {
        let (_, log) = self
            .call(admin, Method::GET, "/api/v1/audit?limit=50", None)
            .await;
        log["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["actor"].as_str().unwrap().to_string(),
                    e["action"].as_str().unwrap().to_string(),
                    e["target"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

fn policy(name: &str) -> Value {
    json!({"name": name, "match": {"host": format!("{name}.example")}, "rate": {"requests": 10, "period": "1s"}})
}

#[tokio::test]
async fn each_role_does_what_it_may_and_gets_403_for_the_rest() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let editor = admin.add_user(&root, "alice", "editor").await;
    let viewer = admin.add_user(&root, "vic", "viewer").await;
    let (_, me) = admin
        .call(&viewer, Method::GET, "/api/v1/session", None)
        .await;
    assert_eq!(
        (me["user"].as_str(), me["role"].as_str()),
        (Some("vic"), Some("viewer"))
    );

    // The editor changes policies, and the audit log names her.
    let (status, body) = admin
        .call(
            &editor,
            Method::POST,
            "/api/v1/policies",
            Some(policy("bank")),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // The viewer reads and watches, and changes nothing.
    for path in [
        "/api/v1/policies",
        "/api/v1/policies/bank",
        "/api/v1/audit",
        "/api/v1/users",
    ] {
        let (status, _) = admin.call(&viewer, Method::GET, path, None).await;
        assert_eq!(status, StatusCode::OK, "viewer GET {path}");
    }
    let refused = [
        (Method::POST, "/api/v1/policies", Some(policy("shop"))),
        (Method::PUT, "/api/v1/policies/bank", Some(policy("bank"))),
        (Method::DELETE, "/api/v1/policies/bank", None),
        (
            Method::POST,
            "/api/v1/users",
            Some(json!({"name": "x", "role": "admin", "password": "long enough pw"})),
        ),
        (Method::GET, "/api/v1/tokens", None),
        (
            Method::POST,
            "/api/v1/tokens",
            Some(json!({"name": "t", "scope": "write"})),
        ),
    ];
    for (method, path, body) in refused.clone() {
        let who = viewer.clone().with("if-match", "1");
        let (status, answer) = admin.call(&who, method.clone(), path, body).await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "viewer {method} {path}: {answer}"
        );
        println!("viewer {method} {path}: 403 {}", answer["error"]);
    }
    let (status, answer) = admin
        .call(
            &viewer,
            Method::POST,
            "/api/v1/policies",
            Some(policy("shop")),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        answer["error"],
        "vic is a viewer: changing policies takes an editor or an admin"
    );
    // The editor manages no one.
    for (method, path, body) in refused.into_iter().skip(3) {
        let (status, _) = admin.call(&editor, method.clone(), path, body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "editor {method} {path}");
    }

    // A role lowered takes effect on the next request of a live session;
    // a removed user's session is over.
    let (status, _) = admin
        .call(
            &root,
            Method::PATCH,
            "/api/v1/users/alice",
            Some(json!({"role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = admin
        .call(
            &editor,
            Method::POST,
            "/api/v1/policies",
            Some(policy("shop")),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "alice, now a viewer");
    let (status, _) = admin
        .call(&root, Method::DELETE, "/api/v1/users/vic", None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = admin
        .call(&viewer, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "vic, removed");
    // Logging out works for every role.
    let (status, _) = admin
        .call(&editor, Method::POST, "/api/v1/logout", Some(json!({})))
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);

    let actors = admin.audit_actors(&root).await;
    let expected = [
        ("admin", "user.remove", "vic"),
        ("admin", "user.change", "alice"),
        ("alice", "create", "bank"),
        ("vic", "login", "127.0.0.1"),
        ("admin", "user.add", "vic"),
        ("alice", "login", "127.0.0.1"),
        ("admin", "user.add", "alice"),
        ("admin", "login", "127.0.0.1"),
    ];
    let actual: Vec<(&str, &str, &str)> = actors
        .iter()
        .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
        .collect();
    assert_eq!(actual, expected);
}

#[tokio::test]
async fn api_tokens_are_scoped_shown_once_stored_hashed_and_expire() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let mut tokens = Vec::new();
    for (name, scope) in [("ci-deploy", "write"), ("dashboard", "read")] {
        let (status, created) = admin
            .call(
                &root,
                Method::POST,
                "/api/v1/tokens",
                Some(json!({"name": name, "scope": scope, "expires_in": "30d"})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        let token = created["token"].as_str().unwrap().to_string();
        assert!(token.starts_with("sluice_"), "{token}");
        tokens.push(token);
    }
    let (write, read) = (As::token(&tokens[0]), As::token(&tokens[1]));

    // A browser reads the list without a CSRF header (reads change
    // nothing); a write without it is refused.
    let cookie_only = As {
        headers: root.headers[..1].to_vec(),
    };
    let (status, _) = admin
        .call(&cookie_only, Method::GET, "/api/v1/tokens", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = admin
        .call(
            &cookie_only,
            Method::POST,
            "/api/v1/tokens",
            Some(json!({"name": "x", "scope": "read"})),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // Listed without secrets; stored as hashes only.
    let (_, listed) = admin.call(&root, Method::GET, "/api/v1/tokens", None).await;
    let text = listed.to_string();
    for token in &tokens {
        let secret = token.rsplit('_').next().unwrap();
        assert!(!text.contains(secret), "a listing shows a secret");
        let id = token.split('_').nth(1).unwrap();
        let stored = admin.store.token(id).await.unwrap().unwrap();
        assert_eq!(stored.secret_hash, token_hash(secret));
    }

    // Write: changes policies without a CSRF token (it is not a cookie),
    // named in the audit log; manages no one.
    let (status, body) = admin
        .call(
            &write,
            Method::POST,
            "/api/v1/policies",
            Some(policy("bank")),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, answer) = admin
        .call(
            &write,
            Method::POST,
            "/api/v1/tokens",
            Some(json!({"name": "more", "scope": "write"})),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("API tokens never manage"),
        "{answer}"
    );
    // Read: reads, and nothing else.
    let (status, _) = admin
        .call(&read, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = admin
        .call(
            &read,
            Method::POST,
            "/api/v1/policies",
            Some(policy("shop")),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (_, listed) = admin.call(&root, Method::GET, "/api/v1/tokens", None).await;
    assert!(
        listed["tokens"][0]["last_used_ms"].as_u64().is_some(),
        "{listed}"
    );

    // Tampered, malformed and revoked tokens: 401, and nothing changes.
    let mut tampered = tokens[0].clone();
    let last = tampered.pop().unwrap();
    tampered.push(if last == '0' { '1' } else { '0' });
    for bad in [
        tampered.as_str(),
        "sluice_",
        "garbage",
        "sluice_0000000000000000_0000000000000000000000000000000000000000000000000000000000000000",
    ] {
        let (status, answer) = admin
            .call(
                &As::token(bad),
                Method::POST,
                "/api/v1/policies",
                Some(policy("evil")),
            )
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{bad}: {answer}");
    }
    let id = tokens[1].split('_').nth(1).unwrap();
    let (status, _) = admin
        .call(&root, Method::DELETE, &format!("/api/v1/tokens/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = admin
        .call(&read, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "revoked");

    // Expired: refused, saying so.
    let secret = "ab".repeat(32);
    admin
        .store
        .add_token(
            "00000000000000ee".into(),
            "old".into(),
            TokenScope::Read,
            token_hash(&secret),
            sluice_admin::store::now_ms() - 1,
            "admin",
        )
        .await
        .unwrap();
    let expired = As::token(&format!("sluice_00000000000000ee_{secret}"));
    let (status, answer) = admin
        .call(&expired, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        answer["error"].as_str().unwrap().contains("expired"),
        "{answer}"
    );

    let actors = admin.audit_actors(&root).await;
    assert!(
        actors.contains(&("token:ci-deploy".into(), "create".into(), "bank".into())),
        "{actors:?}"
    );
    assert!(!actors
        .iter()
        .any(|(_, _, target)| target == "evil" || target == "shop"));
    println!("tokens: write token created bank as token:ci-deploy; read token 403 on writes; tampered/malformed/revoked/expired 401");
}

#[tokio::test]
async fn bad_people_requests_name_the_field_and_the_reason() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let cases = [
        (
            "/api/v1/users",
            json!({"name": "a b", "role": "viewer", "password": "short"}),
            vec!["name", "password"],
        ),
        (
            "/api/v1/users",
            json!({"name": "bob", "role": "root", "password": "long enough pw"}),
            vec!["role"],
        ),
        (
            "/api/v1/users",
            json!({"name": "bob", "role": "viewer", "password": "long enough pw", "admin": true}),
            vec!["admin"],
        ),
        ("/api/v1/users", json!({"name": "bob"}), vec![""]),
        (
            "/api/v1/tokens",
            json!({"name": "ci", "scope": "write", "expires_in": "2y"}),
            vec!["expires_in"],
        ),
        (
            "/api/v1/tokens",
            json!({"name": "ci", "scope": "admin"}),
            vec!["scope"],
        ),
    ];
    for (path, body, fields) in cases {
        let (status, answer) = admin
            .call(&root, Method::POST, path, Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {answer}");
        let paths: Vec<&str> = answer["errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["path"].as_str().unwrap())
            .collect();
        assert_eq!(paths, fields, "{body}: {answer}");
        println!("{path} {body} -> 422 {}", answer["errors"]);
    }
    let (status, _) = admin
        .call(
            &root,
            Method::PATCH,
            "/api/v1/users/bob",
            Some(json!({"role": "editor"})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    admin.add_user(&root, "bob", "viewer").await;
    let (status, answer) = admin
        .call(
            &root,
            Method::POST,
            "/api/v1/users",
            Some(json!({"name": "bob", "role": "admin", "password": "long enough pw"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    let (status, _) = admin
        .call(&root, Method::PATCH, "/api/v1/users/bob", Some(json!({})))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // Nothing was added by the refused requests.
    let (_, users) = admin.call(&root, Method::GET, "/api/v1/users", None).await;
    assert_eq!(users["users"].as_array().unwrap().len(), 1, "{users}");
}

#[tokio::test]
async fn unknown_users_and_wrong_passwords_get_the_same_answer() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    admin.add_user(&root, "bob", "viewer").await;
    let mut answers = Vec::new();
    for (user, password) in [
        ("bob", "wrong password!"),
        ("nobody", "wrong password!"),
        ("<bad name>", "x"),
    ] {
        let resp = admin
            .http
            .post(format!("{}/api/v1/login", admin.base))
            .header("content-type", "application/json")
            .body(json!({"user": user, "password": password}).to_string())
            .send()
            .await
            .unwrap();
        answers.push((resp.status(), resp.text().await.unwrap()));
    }
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    assert_eq!(answers[0].0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn without_an_admin_password_the_last_admin_user_stays() {
    let admin = start(Credentials::UsersOnly, ProxyUsers::default()).await;
    admin
        .store
        .add_user("ops", Role::Admin, hash("ops-password-123"), "cli:test")
        .await
        .unwrap();
    // The admin account of the password is not there.
    assert_eq!(
        admin.login(None, PASSWORD).await.err(),
        Some(StatusCode::UNAUTHORIZED)
    );
    let ops = admin.login(Some("ops"), "ops-password-123").await.unwrap();
    let (status, answer) = admin
        .call(&ops, Method::DELETE, "/api/v1/users/ops", None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        answer["error"].as_str().unwrap().contains("last admin"),
        "{answer}"
    );
    let (status, _) = admin
        .call(
            &ops,
            Method::PATCH,
            "/api/v1/users/ops",
            Some(json!({"role": "editor"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    admin.add_user(&ops, "second", "admin").await;
    let (status, _) = admin
        .call(&ops, Method::DELETE, "/api/v1/users/ops", None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "another admin exists");
}

fn hash(password: &str) -> String {
    sluice_admin::auth::hash_password(password).unwrap()
}

#[tokio::test]
async fn a_proxy_user_header_is_believed_from_the_proxy_only() {
    let from_here = ProxyUsers {
        header: Some("x-forwarded-user".into()),
        proxies: vec!["127.0.0.1/32".parse().unwrap()],
    };
    let admin = start(Credentials::from_password(PASSWORD).unwrap(), from_here).await;
    admin
        .store
        .add_user(
            "alice@example.com",
            Role::Editor,
            hash("unused-password"),
            "test",
        )
        .await
        .unwrap();
    let alice = As::nobody().with("x-forwarded-user", "alice@example.com");
    let (status, me) = admin
        .call(&alice, Method::GET, "/api/v1/session", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (me["via"].as_str(), me["role"].as_str()),
        (Some("proxy"), Some("editor"))
    );
    // A write needs the custom header (no cross-site form can send it).
    let (status, _) = admin
        .call(
            &alice,
            Method::POST,
            "/api/v1/policies",
            Some(policy("bank")),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "no x-csrf-token");
    let (status, _) = admin
        .call(
            &alice.clone().with("x-csrf-token", "proxy"),
            Method::POST,
            "/api/v1/policies",
            Some(policy("bank")),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    // Someone the proxy names who has no account here: 403, saying how.
    let (status, answer) = admin
        .call(
            &As::nobody().with("x-forwarded-user", "mallory"),
            Method::GET,
            "/api/v1/policies",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("sluice-admin user add mallory"),
        "{answer}"
    );
    let (status, _) = admin
        .call(
            &As::nobody().with("x-forwarded-user", "a b<script>"),
            Method::GET,
            "/api/v1/policies",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // A proxy that appends the header to the client's own: the client
    // would choose its user by the first value. Refused, whatever the
    // order.
    for (first, second) in [
        ("alice@example.com", "mallory"),
        ("mallory", "alice@example.com"),
    ] {
        let twice = As::nobody()
            .with("x-forwarded-user", first)
            .with("x-forwarded-user", second)
            .with("x-csrf-token", "proxy");
        let (status, answer) = admin
            .call(
                &twice,
                Method::POST,
                "/api/v1/policies",
                Some(policy("shop")),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        assert!(
            answer["error"].as_str().unwrap().contains("more than once"),
            "{answer}"
        );
    }
    let root = admin.login(None, PASSWORD).await.unwrap();
    let actors = admin.audit_actors(&root).await;
    assert!(
        actors.contains(&("alice@example.com".into(), "create".into(), "bank".into())),
        "{actors:?}"
    );

    // The same header from an address that is not the proxy: ignored.
    let elsewhere = ProxyUsers {
        header: Some("x-forwarded-user".into()),
        proxies: vec!["10.0.0.0/8".parse().unwrap()],
    };
    let admin = start(Credentials::from_password(PASSWORD).unwrap(), elsewhere).await;
    admin
        .store
        .add_user(
            "alice@example.com",
            Role::Admin,
            hash("unused-password"),
            "test",
        )
        .await
        .unwrap();
    let (status, _) = admin
        .call(&alice, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

/// `sluice-admin user add` / `token create` through the real binary, then
/// the service started with no admin password lets that user in.
#[tokio::test]
async fn the_first_admin_is_made_from_the_shell() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let binary = env!("CARGO_BIN_EXE_sluice-admin");
    let run = |args: &[&str], stdin: &str| {
        let mut child = std::process::Command::new(binary)
            .args(args)
            .arg("--db")
            .arg(&db)
            .env_remove("SLUICE_ADMIN_PASSWORD")
            .env_remove("SLUICE_ADMIN_PASSWORD_HASH")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, said, err) = run(
        &["user", "add", "ops", "--role", "admin", "--password-stdin"],
        "ops-password-123\n",
    );
    assert!(ok, "{err}");
    assert_eq!(said.trim(), "added ops as admin");
    let (ok, _, err) = run(&["user", "add", "x y", "--role", "admin"], "");
    assert!(!ok && err.contains("name: "), "{err}");
    let (ok, _, err) = run(&["user", "add", "eve", "--role", "root"], "");
    assert!(!ok && err.contains("not a role"), "{err}");
    let (ok, said, err) = run(
        &[
            "token",
            "create",
            "ci",
            "--scope",
            "write",
            "--expires",
            "7d",
        ],
        "",
    );
    assert!(ok, "{err}");
    let token = said.lines().last().unwrap().to_string();
    let (ok, listed, _) = run(&["user", "list"], "");
    assert!(
        ok && listed.starts_with("ops\tadmin\tadded by cli:"),
        "{listed}"
    );
    let (ok, _, err) = run(&["user", "remove", "ops"], "");
    assert!(!ok && err.contains("last admin"), "{err}");

    // The service, with no admin password: the shell's user and token work.
    let port = sluice_test_ports::free_port().expect("a free port");
    let mut server = std::process::Command::new(binary)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--db"])
        .arg(&db)
        .env_remove("SLUICE_ADMIN_PASSWORD")
        .env_remove("SLUICE_ADMIN_PASSWORD_HASH")
        .env(
            "SLUICE_SYNC_TOKEN",
            "sync-token-of-the-admin-tests-0123456789",
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let mut status = None;
    for _ in 0..100 {
        if let Ok(resp) = http
            .post(format!("{base}/api/v1/login"))
            .header("content-type", "application/json")
            .body(json!({"user": "ops", "password": "ops-password-123"}).to_string())
            .send()
            .await
        {
            status = Some(resp.status());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let by_token = http
        .post(format!("{base}/api/v1/policies"))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body(policy("bank").to_string())
        .send()
        .await
        .map(|r| r.status());
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(status, Some(StatusCode::OK));
    assert_eq!(by_token.ok(), Some(StatusCode::CREATED));
}

/// Finding a key's label hashes a guessed key the way the Envoys do: an
/// editor's, limited per caller, and audited (the label, never the key).
#[tokio::test]
async fn key_lookups_take_an_editor_are_limited_and_audited() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let mut keyed = policy("maps");
    keyed["key"] = json!({"header": "x-api-key"});
    let (status, _) = admin
        .call(&root, Method::POST, "/api/v1/policies", Some(keyed))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let path = "/api/v1/policies/maps/key-label";
    let guess = |n: usize| Some(json!({"key": format!("sk-guess-{n}")}));
    let viewer = admin.add_user(&root, "vic", "viewer").await;
    let (status, answer) = admin.call(&viewer, Method::POST, path, guess(0)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    let editor = admin.add_user(&root, "eve", "editor").await;
    let mut answered = 0;
    let mut refused = None;
    for n in 0..30 {
        let (status, answer) = admin.call(&editor, Method::POST, path, guess(n)).await;
        match status {
            StatusCode::OK => answered += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                refused = Some(answer);
                break;
            }
            other => panic!("{other}: {answer}"),
        }
    }
    println!("key lookups: a viewer 403; an editor {answered} answered, then 429: {refused:?}");
    assert_eq!(answered, 10, "a burst of 10");
    assert!(
        refused
            .as_ref()
            .and_then(|r| r["error"].as_str())
            .is_some_and(|e| e.contains("one more every 6 s")),
        "the 11th refused, saying why: {refused:?}"
    );
    // Another editor has lookups of their own.
    let (status, _) = admin.call(&root, Method::POST, path, guess(99)).await;
    assert_eq!(status, StatusCode::OK);
    let lookups: Vec<_> = admin
        .audit_actors(&root)
        .await
        .into_iter()
        .filter(|(_, action, _)| action == "key.lookup")
        .collect();
    assert_eq!(lookups.len(), 11, "{lookups:?}");
    assert!(lookups
        .iter()
        .any(|(actor, _, target)| actor == "eve" && target.starts_with("maps #")));
    assert!(
        lookups
            .iter()
            .all(|(_, _, target)| !target.contains("sk-guess")),
        "no key in the audit log: {lookups:?}"
    );
}

/// Reads a live stream until it ends (Some(time it ended)) or `limit`.
async fn stream_ends_within(
    response: reqwest::Response,
    limit: std::time::Duration,
) -> Option<std::time::Instant> {
    use futures_util::StreamExt;
    let mut body = response.bytes_stream();
    tokio::time::timeout(limit, async {
        while let Some(chunk) = body.next().await {
            if chunk.is_err() {
                break;
            }
        }
        std::time::Instant::now()
    })
    .await
    .ok()
}

async fn open_live(admin: &Admin, who: &As) -> reqwest::Response {
    let mut req = admin.http.get(format!("{}/api/v1/live", admin.base));
    for (k, v) in &who.headers {
        req = req.header(k, v);
    }
    let response = req.send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response
}

/// A password change, a user's removal or a token's revocation ends what
/// they had open: sessions (the old cookie gets 401, also when the
/// password changed elsewhere) and live streams (closed within a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_password_or_revoked_token_ends_sessions_and_live_streams() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let bob = admin.add_user(&root, "bob", "viewer").await;
    let bob_live = open_live(&admin, &bob).await;
    let (status, _) = admin
        .call(
            &root,
            Method::PATCH,
            "/api/v1/users/bob",
            Some(json!({"password": "a-brand-new-password"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let changed = std::time::Instant::now();
    let ended = stream_ends_within(bob_live, std::time::Duration::from_secs(3)).await;
    let (status, _) = admin
        .call(&bob, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "the old cookie");
    let ended_in = ended.map(|at| at.duration_since(changed));
    // A password changed behind this admin's back (the shell, another
    // replica) ends the session too.
    let carol = admin.add_user(&root, "carol", "viewer").await;
    admin
        .store
        .change_user(
            "carol",
            None,
            Some(hash("changed-from-the-shell")),
            "cli:ops",
            sluice_admin::store::AdminGuard::None,
        )
        .await
        .unwrap();
    let (status, _) = admin
        .call(&carol, Method::GET, "/api/v1/policies", None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "changed elsewhere");
    // A revoked token's stream.
    let (status, created) = admin
        .call(
            &root,
            Method::POST,
            "/api/v1/tokens",
            Some(json!({"name": "grafana", "scope": "read"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let token = As::token(created["token"].as_str().unwrap());
    let token_live = open_live(&admin, &token).await;
    let id = created["info"]["id"].as_str().unwrap();
    let (status, _) = admin
        .call(&root, Method::DELETE, &format!("/api/v1/tokens/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let revoked = std::time::Instant::now();
    let token_ended = stream_ends_within(token_live, std::time::Duration::from_secs(3))
        .await
        .map(|at| at.duration_since(revoked));
    println!(
        "ending access: bob's live stream closed {ended_in:?} after his password changed, his old cookie 401; \
         carol's cookie 401 after a change from the shell; a revoked token's stream closed {token_ended:?} after"
    );
    assert!(
        ended_in.is_some_and(|d| d < std::time::Duration::from_secs(1)),
        "{ended_in:?}"
    );
    assert!(
        token_ended.is_some_and(|d| d < std::time::Duration::from_secs(1)),
        "{token_ended:?}"
    );
}

/// Live streams are bounded per caller.
#[tokio::test]
async fn live_streams_are_bounded_per_caller() {
    let admin = start_default().await;
    let root = admin.login(None, PASSWORD).await.unwrap();
    let mut open = Vec::new();
    for _ in 0..sluice_admin::live::MAX_STREAMS_PER_CALLER {
        open.push(open_live(&admin, &root).await);
    }
    let (status, answer) = admin.call(&root, Method::GET, "/api/v1/live", None).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{answer}");
    // Another caller has room of their own; one closed makes room again.
    let vic = admin.add_user(&root, "vic", "viewer").await;
    drop(open_live(&admin, &vic).await);
    drop(open.pop());
    let again = tokio::time::timeout(std::time::Duration::from_secs(2), async {
        loop {
            let mut req = admin.http.get(format!("{}/api/v1/live", admin.base));
            for (k, v) in &root.headers {
                req = req.header(k, v);
            }
            let response = req.send().await.unwrap();
            if response.status() == StatusCode::OK {
                return response;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(again.is_ok(), "a closed stream gives its seat back");
}
