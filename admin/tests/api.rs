//! The admin API over real HTTP, with a real SQLite file in a temp dir.

use std::sync::Arc;

use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sluice_admin::auth::Credentials;
use sluice_admin::store::Store;
use sluice_admin::AppState;

const PASSWORD: &str = "test-password-1";
const SYNC_TOKEN: &str = "sync-secret-0123456789abcdef-0123456789";

struct Admin {
    base: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
    db: std::path::PathBuf,
}

struct Session {
    cookie: String,
    csrf: String,
    set_cookie: String,
}

/// Serves `state` on a free local port until the test ends.
async fn serve(state: Arc<AppState>, dir: tempfile::TempDir, db: std::path::PathBuf) -> Admin {
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
        _dir: dir,
        db,
    }
}

async fn start() -> Admin {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    start_on(dir, db).await
}

/// A store file at `db` holding `policy`, created by `admin` before the
/// service starts on it.
fn store_with(db: &std::path::Path, policy: &Value) {
    let store = Store::open(db).unwrap();
    let policy = sluice_shared::parse_policy(&policy.to_string()).unwrap();
    store.blocking().create(policy, "admin").unwrap();
}

async fn start_on(dir: tempfile::TempDir, db: std::path::PathBuf) -> Admin {
    start_with(dir, db, false).await
}

async fn start_with(dir: tempfile::TempDir, db: std::path::PathBuf, secure_cookies: bool) -> Admin {
    start_configured(dir, db, secure_cookies, |state| state).await
}

/// An admin whose state `configure` adjusts before it serves.
async fn start_configured(
    dir: tempfile::TempDir,
    db: std::path::PathBuf,
    secure_cookies: bool,
    configure: impl FnOnce(AppState) -> AppState,
) -> Admin {
    let state = Arc::new(configure(new_state(&db, secure_cookies)));
    serve(state, dir, db).await
}

/// The admin's state on the SQLite file `db`, the test's password and
/// sync token.
fn new_state(db: &std::path::Path, secure_cookies: bool) -> AppState {
    AppState::new(
        Store::open(db).unwrap(),
        Credentials::from_password(PASSWORD).unwrap(),
        Some(SYNC_TOKEN.into()),
        secure_cookies,
    )
}

/// [`new_state`], shared, for a test that looks into it while it serves.
fn state_on(db: &std::path::Path) -> Arc<AppState> {
    Arc::new(new_state(db, false))
}

impl Admin {
    async fn call(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, HeaderMap, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        (
            status,
            headers,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn login(&self) -> Session {
        let (status, headers, body) = self
            .call(
                Method::POST,
                "/api/v1/login",
                &[],
                Some(json!({"password": PASSWORD})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let set_cookie = headers["set-cookie"].to_str().unwrap().to_string();
        let cookie = set_cookie.split(';').next().unwrap().to_string();
        Session {
            cookie,
            csrf: body["csrf_token"].as_str().unwrap().to_string(),
            set_cookie,
        }
    }

    /// As the logged-in operator, with the CSRF token.
    async fn edit(
        &self,
        s: &Session,
        method: Method,
        path: &str,
        extra: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, HeaderMap, Value) {
        let mut headers = vec![
            ("cookie", s.cookie.as_str()),
            ("x-csrf-token", s.csrf.as_str()),
        ];
        headers.extend_from_slice(extra);
        self.call(method, path, &headers, body).await
    }
}

fn bank(requests: u64) -> Value {
    json!({"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": requests, "period": "1s", "burst": 20}})
}

fn etag(h: &HeaderMap) -> String {
    h.get("etag")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn crud_with_versions_and_audit() {
    let admin = start().await;
    let s = admin.login().await;
    let (status, h, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(100)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(etag(&h), "\"1\"");
    assert_eq!(h["location"], "/api/v1/policies/bank");
    assert_eq!(body["policy"]["rate"]["requests"], 100);

    let (status, h, body) = admin
        .edit(&s, Method::GET, "/api/v1/policies/bank", &[], None)
        .await;
    assert_eq!((status, etag(&h)), (StatusCode::OK, "\"1\"".into()));
    assert_eq!(body["updated_by"], "admin");

    // Edit with the version we saw.
    let (status, h, body) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/policies/bank",
            &[("if-match", "\"1\"")],
            Some(bank(150)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(etag(&h), "\"2\"");
    // A second editor still holding version 1 is refused, told the current one.
    let (status, h, body) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/policies/bank",
            &[("if-match", "\"1\"")],
            Some(bank(999)),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["current_version"], 2);
    assert_eq!(etag(&h), "\"2\"");
    // No version at all: the edit must say what it is based on.
    let (status, _, _) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/policies/bank",
            &[],
            Some(bank(999)),
        )
        .await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED);

    let (status, h, body) = admin
        .edit(&s, Method::GET, "/api/v1/policies", &[], None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["version"], 2, "the set version counts every write");
    assert_eq!(etag(&h), "\"2\"");
    assert_eq!(body["policies"][0]["policy"]["rate"]["requests"], 150);

    let (status, _, _) = admin
        .edit(
            &s,
            Method::DELETE,
            "/api/v1/policies/bank",
            &[("if-match", "\"1\"")],
            None,
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, _, _) = admin
        .edit(
            &s,
            Method::DELETE,
            "/api/v1/policies/bank",
            &[("if-match", "\"2\"")],
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _, _) = admin
        .edit(&s, Method::GET, "/api/v1/policies/bank", &[], None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (_, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/audit", &[], None)
        .await;
    let entries = body["entries"].as_array().unwrap();
    let actions: Vec<&str> = entries
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["delete", "update", "create", "login"]);
    let update = &entries[1];
    assert_eq!(update["actor"], "admin");
    assert_eq!(update["target"], "bank");
    assert_eq!(update["old"]["rate"]["requests"], 100);
    assert_eq!(update["new"]["rate"]["requests"], 150);
    assert!(entries[0]["new"].is_null() && entries[0]["old"]["rate"]["requests"] == 150);

    let (_, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/policies/bank/history", &[], None)
        .await;
    assert_eq!(body["history"].as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn invalid_policies_get_422_with_every_field_error() {
    let admin = start().await;
    let s = admin.login().await;
    let bad = json!({"name": "bank", "match": {"host": "api.bank.example"},
        "rate": {"requests": 0, "period": "1s", "burst": 0}, "concurrency": {"max_in_flight": 0}});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bad))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let errors: Vec<String> = body["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}: {}",
                e["path"].as_str().unwrap(),
                e["message"].as_str().unwrap()
            )
        })
        .collect();
    println!("422 errors: {errors:?}");
    assert!(
        errors.contains(&"rate.requests: must be >= 1".to_string()),
        "{errors:?}"
    );
    assert!(
        errors.contains(&"rate.burst: must be >= 1".to_string()),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("concurrency.max_in_flight:")),
        "{errors:?}"
    );

    let (status, _, body) = admin.edit(&s, Method::POST, "/api/v1/policies", &[], Some(json!({"name": "x", "match": {"host": "a"}, "rate": {"requests": 1, "period": "1s", "bogus": 1}}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("bogus"),
        "{body}"
    );

    // Duplicate names.
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(10)))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(20)))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["errors"][0]["path"], "name");

    // Renaming through PUT is refused, naming the field.
    let mut renamed = bank(10);
    renamed["name"] = json!("other");
    let (status, _, body) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/policies/bank",
            &[("if-match", "1")],
            Some(renamed),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["errors"][0]["path"], "name");

    // Nothing invalid was stored, and the good one is intact.
    let (_, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/policies", &[], None)
        .await;
    assert_eq!(body["policies"].as_array().unwrap().len(), 1);
    assert_eq!(body["policies"][0]["policy"]["rate"]["requests"], 10);

    // The editor's live check.
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/validate", &[], Some(bank(5)))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/validate", &[], Some(bank(0)))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["errors"][0]["path"], "rate.requests");
}

#[tokio::test]
async fn auth_is_required_where_it_should_be() {
    let admin = start().await;
    // Reads and writes without a session: 401.
    for (method, path) in [
        (Method::GET, "/api/v1/policies"),
        (Method::GET, "/api/v1/policies/bank"),
        (Method::GET, "/api/v1/audit"),
        (Method::GET, "/api/v1/instances"),
        (Method::GET, "/api/v1/live"),
        (Method::POST, "/api/v1/policies"),
        (Method::PUT, "/api/v1/policies/bank"),
        (Method::DELETE, "/api/v1/policies/bank"),
        (Method::POST, "/api/v1/validate"),
        (Method::POST, "/api/v1/logout"),
    ] {
        let body = matches!(method, Method::POST | Method::PUT).then(|| bank(1));
        let (status, _, _) = admin
            .call(method.clone(), path, &[("if-match", "1")], body)
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}");
    }
    // A session but no (or a wrong) CSRF token: 403 on every write.
    let s = admin.login().await;
    for (method, path) in [
        (Method::POST, "/api/v1/policies"),
        (Method::PUT, "/api/v1/policies/bank"),
        (Method::DELETE, "/api/v1/policies/bank"),
        (Method::POST, "/api/v1/logout"),
    ] {
        let body = matches!(method, Method::POST | Method::PUT).then(|| bank(1));
        let (status, _, _) = admin
            .call(
                method.clone(),
                path,
                &[("cookie", &s.cookie), ("if-match", "1")],
                body.clone(),
            )
            .await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "{method} {path} without CSRF"
        );
        let (status, _, _) = admin
            .call(
                method.clone(),
                path,
                &[
                    ("cookie", &s.cookie),
                    ("x-csrf-token", "nope"),
                    ("if-match", "1"),
                ],
                body,
            )
            .await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "{method} {path} with a wrong CSRF token"
        );
    }
    // Open: health and metrics.
    assert_eq!(
        admin.call(Method::GET, "/healthz", &[], None).await.0,
        StatusCode::OK
    );
    let (status, _, metrics) = admin.call(Method::GET, "/metrics", &[], None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(metrics
        .as_str()
        .unwrap()
        .contains("sluice_admin_policy_set_version"));
    // The cookie's flags.
    let flags = s.set_cookie.to_ascii_lowercase();
    println!(
        "session cookie: {}",
        s.set_cookie.replace(&s.cookie[15..], "<token>")
    );
    assert!(flags.contains("httponly"), "{flags}");
    assert!(flags.contains("samesite=strict"), "{flags}");
    assert!(flags.contains("path=/"), "{flags}");
    // Logout ends the session.
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/logout", &[], None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(
        admin
            .call(
                Method::GET,
                "/api/v1/policies",
                &[("cookie", &s.cookie)],
                None
            )
            .await
            .0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn behind_https_the_session_cookie_is_secure() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let admin = start_with(dir, db, true).await;
    let s = admin.login().await;
    let flags: Vec<String> = s
        .set_cookie
        .split(';')
        .skip(1)
        .map(|f| f.trim().to_ascii_lowercase())
        .collect();
    println!("session cookie flags with --secure-cookies: {flags:?}");
    for want in ["httponly", "secure", "samesite=strict", "path=/"] {
        assert!(flags.iter().any(|f| f == want), "{want} missing: {flags:?}");
    }
    // A browser session: no Max-Age or Expires, gone when the browser closes.
    assert!(!flags
        .iter()
        .any(|f| f.starts_with("max-age") || f.starts_with("expires")));
}

/// The login's `Set-Cookie` over TLS, by a raw HTTP/1.1 request through a
/// TLS connection that trusts `ca`.
async fn login_over_tls(port: u16, ca: &std::path::Path) -> String {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let body = json!({"password": PASSWORD}).to_string();
    let request = format!(
        "POST /api/v1/login HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.unwrap_or_default();
    answer
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("set-cookie:")
                .then(|| l.to_string())
        })
        .unwrap_or_else(|| panic!("no cookie in {answer}"))
}

/// An admin that serves TLS marks the cookie of a login over TLS
/// `Secure` without being told; a login over its plain listener (a local
/// trial, a health checker) gets one a browser keeps on plain HTTP.
#[tokio::test]
async fn over_tls_the_session_cookie_is_secure_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = sluice_admin::server::self_signed(&dir.path().join("tls")).unwrap();
    let tls = sluice_admin::server::tls_config(&cert, &key).unwrap();
    let state = state_on(&dir.path().join("sluice.db"));
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let secure = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (plain_port, tls_port) = (
        plain.local_addr().unwrap().port(),
        secure.local_addr().unwrap().port(),
    );
    tokio::spawn(sluice_admin::serve_with_tls(
        plain,
        Some((secure, tls)),
        state,
        None,
        std::future::pending(),
    ));
    let over_tls = login_over_tls(tls_port, &dir.path().join("tls/ca.pem")).await;
    let plain_admin = Admin {
        base: format!("http://127.0.0.1:{plain_port}"),
        http: reqwest::Client::new(),
        _dir: dir,
        db: std::path::PathBuf::new(),
    };
    let over_plain = plain_admin.login().await.set_cookie;
    println!("session cookie over TLS: {over_tls}; over plain HTTP: {over_plain}");
    let flags = |c: &str| -> Vec<String> {
        c.split(';')
            .skip(1)
            .map(|f| f.trim().to_ascii_lowercase())
            .collect()
    };
    assert!(flags(&over_tls).iter().any(|f| f == "secure"), "{over_tls}");
    assert!(
        flags(&over_tls).iter().any(|f| f == "httponly"),
        "{over_tls}"
    );
    assert!(
        !flags(&over_plain).iter().any(|f| f == "secure"),
        "{over_plain}"
    );
}

#[tokio::test]
async fn failed_logins_are_slowed() {
    let admin = start().await;
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let (status, h, _) = admin
            .call(
                Method::POST,
                "/api/v1/login",
                &[],
                Some(json!({"password": "guess"})),
            )
            .await;
        statuses.push((
            status.as_u16(),
            h.get("retry-after")
                .map(|v| v.to_str().unwrap().to_string()),
        ));
    }
    println!("8 wrong passwords: {statuses:?}");
    assert!(statuses[..5].iter().all(|(s, _)| *s == 401));
    assert!(statuses[5..].iter().all(|(s, r)| *s == 429 && r.is_some()));
    // Even the right password waits while the address is blocked.
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/login",
            &[],
            Some(json!({"password": PASSWORD})),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn sync_needs_the_token_and_sends_the_set_only_when_it_changed() {
    let admin = start().await;
    let s = admin.login().await;
    admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(100)))
        .await;
    let report = |version: u64| {
        json!({"instance": "envoy-a", "policy_version": version, "at_ms": 1000,
        "policies": {"bank": {"admitted": 5, "rejected": 1, "queued": 0, "queue_timeouts": 0, "shadow_limited": 0, "in_flight": 0, "max_in_flight": 0, "tokens": 19}}})
    };
    let (status, _, _) = admin
        .call(Method::POST, "/api/v1/sync", &[], Some(report(0)))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", "Bearer wrong")],
            Some(report(0)),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let auth = format!("Bearer {SYNC_TOKEN}");
    let (status, h, body) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(report(0)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["version"], 1);
    assert_eq!(body["policies"][0]["name"], "bank");
    assert_eq!(etag(&h), "\"1\"");
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(report(1)),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(json!({"nonsense": true})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (_, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/instances", &[], None)
        .await;
    let inst = &body["instances"][0];
    assert_eq!(inst["id"], "envoy-a");
    assert_eq!(inst["policy_version"], 1);
    assert_eq!(inst["syncs"], 2);
    assert_eq!(inst["live"], true);
    assert_eq!(inst["report"]["policies"]["bank"]["tokens"], 19);
}

#[tokio::test]
async fn the_store_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    store_with(&db, &bank(42));
    let admin = start_on(dir, db.clone()).await;
    let s = admin.login().await;
    let (_, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/policies/bank", &[], None)
        .await;
    assert_eq!(body["policy"]["rate"]["requests"], 42);
    let store = Store::open(&admin.db).unwrap();
    assert_eq!(
        store.blocking().journal_mode().unwrap().as_deref(),
        Some("wal")
    );
    assert_eq!(
        store.blocking().integrity_check().unwrap().as_deref(),
        Some("ok")
    );
}

#[test]
fn refuses_to_start_without_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-admin"))
        .args(["--listen", "127.0.0.1:0", "--db"])
        .arg(dir.path().join("x.db"))
        .env_remove("SLUICE_ADMIN_PASSWORD")
        .env_remove("SLUICE_ADMIN_PASSWORD_HASH")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!(
        "without credentials: exit {:?}: {}",
        out.status.code(),
        stderr.trim()
    );
    assert!(!out.status.success());
    assert!(stderr.contains("no admin credentials"), "{stderr}");
}

#[test]
fn a_seed_fills_only_a_store_that_never_held_a_policy() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("seed.db")).unwrap();
    let set = sluice_shared::parse_policy_set(
        &json!({"version": 1, "policies": [bank(100), {"name": "llm", "match": {"host": "api.llm.example"},
            "concurrency": {"max_in_flight": 8}}]})
        .to_string(),
    )
    .unwrap();
    assert_eq!(store.blocking().seed(&set, "seed").unwrap(), 2);
    let (version, listed) = store.blocking().list().unwrap();
    assert_eq!(version, 1, "one set version for the whole seed");
    let names: Vec<&str> = listed.iter().map(|p| p.policy.name.as_str()).collect();
    assert_eq!(names, ["bank", "llm"]);
    assert_eq!(
        store.blocking().seed(&set, "seed").unwrap(),
        0,
        "seeded once only"
    );
    store.blocking().delete("bank", 1, "admin").unwrap();
    store.blocking().delete("llm", 1, "admin").unwrap();
    assert_eq!(
        store.blocking().seed(&set, "seed").unwrap(),
        0,
        "a store emptied by hand stays empty"
    );
    let audit = store.blocking().audit_log(50, None).unwrap();
    assert_eq!(audit.iter().filter(|a| a.action == "seed").count(), 2);
}

#[test]
fn a_bad_seed_stops_the_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("seed.json");
    std::fs::write(
        &seed,
        r#"{"version": 1, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-admin"))
        .args(["--listen", "127.0.0.1:0", "--insecure-dev", "--db"])
        .arg(dir.path().join("x.db"))
        .arg("--seed")
        .arg(&seed)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("bad seed: exit {:?}: {}", out.status.code(), stderr.trim());
    assert!(!out.status.success());
    assert!(
        stderr.contains("policies[0].rate.requests: must be >= 1"),
        "{stderr}"
    );
}

async fn wrong_login(admin: &Admin, forwarded_for: Option<&str>) -> StatusCode {
    let headers: Vec<(&str, &str)> = forwarded_for
        .map(|f| vec![("x-forwarded-for", f)])
        .unwrap_or_default();
    admin
        .call(
            Method::POST,
            "/api/v1/login",
            &headers,
            Some(json!({"password": "guess"})),
        )
        .await
        .0
}

/// Behind a reverse proxy every user shares its address: the throttle
/// counts the client the trusted proxy names, so one guesser does not lock
/// the operator out; a client that is not a trusted proxy cannot pick
/// whom it counts as. The account itself has a throttle of its own.
#[tokio::test]
async fn logins_are_throttled_per_client_behind_a_trusted_proxy_and_per_account() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let admin = start_configured(dir, db, false, |state| {
        state.with_addressing(sluice_admin::login::ClientAddressing {
            trusted_proxies: vec!["127.0.0.0/8".parse().unwrap()],
            header: Some("x-forwarded-for".into()),
        })
    })
    .await;
    let mut guesser = Vec::new();
    for _ in 0..7 {
        guesser.push(wrong_login(&admin, Some("203.0.113.9")).await.as_u16());
    }
    // The operator, behind the same proxy, still logs in.
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/login",
            &[("x-forwarded-for", "198.51.100.20")],
            Some(json!({"password": PASSWORD})),
        )
        .await;
    println!(
        "behind a proxy: one client's 7 wrong passwords {guesser:?}; the operator then -> {status}"
    );
    assert_eq!(&guesser[..5], &[401; 5]);
    assert_eq!(&guesser[5..], &[429; 2]);
    assert_eq!(status, StatusCode::OK);
    // Many addresses against the one account: its own throttle holds
    // (20, then one every 2 s), whatever the addresses.
    let mut statuses = Vec::new();
    for i in 0..30 {
        statuses.push(
            wrong_login(&admin, Some(&format!("192.0.2.{i}")))
                .await
                .as_u16(),
        );
    }
    let checked = statuses.iter().filter(|s| **s == 401).count();
    println!(
        "30 addresses, one account: {checked} checked, {} refused unchecked",
        statuses.len() - checked
    );
    assert!(checked <= 21, "{statuses:?}");
    assert!(statuses[25..].iter().all(|s| *s == 429));
}

/// A filter that names a version of this store the store has not reached
/// (a backup was restored, or it took a forged answer) gets the store's
/// set under a new epoch, which it takes; a filter on the current version
/// of the current epoch gets 304.
#[tokio::test]
async fn an_envoy_ahead_of_the_store_gets_a_new_store_epoch() {
    let admin = start().await;
    let s = admin.login().await;
    admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(100)))
        .await;
    let auth = format!("Bearer {SYNC_TOKEN}");
    let sync = |version: u64, epoch: u64| {
        let auth = auth.clone();
        let admin = &admin;
        async move {
            admin
                .call(
                    Method::POST,
                    "/api/v1/sync",
                    &[("authorization", &auth)],
                    Some(json!({"instance": "e", "policy_version": version, "policy_epoch": epoch, "at_ms": 1})),
                )
                .await
        }
    };
    let epoch_of = |h: &HeaderMap| -> u64 {
        h.get("sluice-store-epoch")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    let (status, h, _) = sync(0, 0).await;
    assert_eq!(status, StatusCode::OK);
    let epoch = epoch_of(&h);
    assert_ne!(epoch, 0);
    let (status, h, _) = sync(1, epoch).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert_eq!(
        epoch_of(&h),
        epoch,
        "the epoch holds while nothing odd happens"
    );
    // Another store's epoch: the set, same epoch.
    let (status, h, _) = sync(1, epoch ^ 1).await;
    assert_eq!((status, epoch_of(&h)), (StatusCode::OK, epoch));
    // Ahead of the store in its own epoch: a new epoch.
    let (status, h, body) = sync(u64::MAX, epoch).await;
    let renewed = epoch_of(&h);
    println!("an Envoy at version u64::MAX of epoch {epoch}: {status} with version {} under epoch {renewed}", body["version"]);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["version"], 1);
    assert_ne!(renewed, epoch);
    let (status, _, _) = sync(1, renewed).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
}

/// Reports with counters and clocks at their limits: nothing panics (a
/// debug build checks every addition), no lock is poisoned, and the live
/// view and the instances list keep working. The list is paginated.
#[tokio::test]
async fn hostile_report_values_never_break_the_live_view_and_instances_page() {
    let admin = start().await;
    let s = admin.login().await;
    let auth = format!("Bearer {SYNC_TOKEN}");
    let max = u64::MAX;
    for (instance, at) in [
        ("huge-1", max),
        ("huge-2", max),
        ("huge-1", max - 1),
        ("normal", 5),
    ] {
        let report = json!({"instance": instance, "policy_version": max, "at_ms": at,
            "policies": {"bank": {"admitted": max, "rejected": max, "queued": max, "queue_timeouts": max,
                "shadow_limited": max, "in_flight": max, "max_in_flight": max, "tokens": max, "waiting": max}}});
        let (status, _, body) = admin
            .call(
                Method::POST,
                "/api/v1/sync",
                &[("authorization", &auth)],
                Some(report),
            )
            .await;
        assert!(
            status.is_success() || status == StatusCode::NOT_MODIFIED,
            "{status} {body}"
        );
    }
    // The live stream's first event still comes.
    let resp = admin
        .http
        .get(format!("{}/api/v1/live", admin.base))
        .header("cookie", &s.cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, _, page) = admin
        .edit(&s, Method::GET, "/api/v1/instances?limit=2", &[], None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["instances"].as_array().map(Vec::len), Some(2));
    let next = page["next"].as_str().unwrap().to_string();
    let (_, _, rest) = admin
        .edit(
            &s,
            Method::GET,
            &format!("/api/v1/instances?limit=2&after={next}"),
            &[],
            None,
        )
        .await;
    let names: Vec<&str> = page["instances"]
        .as_array()
        .into_iter()
        .chain(rest["instances"].as_array())
        .flatten()
        .filter_map(|i| i["id"].as_str())
        .collect();
    assert_eq!(names, ["huge-1", "huge-2", "normal"]);
    assert!(rest.get("next").is_none());
}

/// `/metrics` names every policy: with `--metrics-token` a scrape needs
/// it, and a scrape reads nothing from the store (a slow or absent
/// database cannot stall Prometheus, nor Prometheus the database).
#[tokio::test]
async fn metrics_asks_for_its_token_when_one_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let admin = start_configured(dir, db, false, |state| {
        state.with_metrics_token(Some("scrape-secret".into()))
    })
    .await;
    let s = admin.login().await;
    admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(100)))
        .await;
    let scrape = |auth: Option<&'static str>| {
        let admin = &admin;
        async move {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
            let (status, _, body) = admin.call(Method::GET, "/metrics", &headers, None).await;
            (status, body.as_str().unwrap_or_default().to_string())
        }
    };
    let (none, _) = scrape(None).await;
    let (wrong, _) = scrape(Some("Bearer scrape-secreT")).await;
    let (basic, _) = scrape(Some("Basic scrape-secret")).await;
    let (right, text) = scrape(Some("Bearer scrape-secret")).await;
    println!("/metrics: no token {none}, wrong token {wrong}, basic {basic}, right token {right}");
    assert_eq!(none, StatusCode::UNAUTHORIZED);
    assert_eq!(wrong, StatusCode::UNAUTHORIZED);
    assert_eq!(basic, StatusCode::UNAUTHORIZED);
    assert_eq!(right, StatusCode::OK);
    // The version written by the edit, though the scrape read no store.
    assert!(text.contains("sluice_admin_policy_set_version 1"), "{text}");
}

/// An admin with `--insecure-dev` (no login) on the operator's machine.
async fn start_insecure(allowed_hosts: &[&str]) -> Admin {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let store = Store::open(&db).unwrap();
    let state = Arc::new(
        AppState::new(store, Credentials::InsecureDev, None, false)
            .with_allowed_hosts(allowed_hosts.iter().map(|h| h.to_string()).collect()),
    );
    serve(state, dir, db).await
}

/// Without a login, a page on another site could point its own DNS name
/// at 127.0.0.1 and drive the admin from the operator's browser (DNS
/// rebinding): its requests carry that name as Host, and are refused.
#[tokio::test]
async fn insecure_dev_answers_only_requests_that_name_it_by_a_local_name() {
    let admin = start_insecure(&["sluice-admin"]).await;
    let port = admin.base.rsplit(':').next().unwrap().to_string();
    let mut seen = Vec::new();
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "LOCALHOST".to_string(),
        format!("sluice-admin:{port}"),
        format!("rebind.attacker.example:{port}"),
        "127.0.0.1.attacker.example".to_string(),
        "localhost.attacker.example".to_string(),
        format!("sluice-admin.attacker.example:{port}"),
    ] {
        let (status, _, _) = admin
            .call(
                Method::GET,
                "/api/v1/policies",
                &[("host", host.as_str())],
                None,
            )
            .await;
        seen.push((host, status.as_u16()));
    }
    println!("--insecure-dev by Host: {seen:?}");
    for (host, status) in &seen {
        let local = !host.contains("attacker");
        assert_eq!(*status, if local { 200 } else { 421 }, "Host {host}");
    }
    // A write is refused as well, and changes nothing.
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/policies",
            &[("host", "rebind.attacker.example")],
            Some(bank(1)),
        )
        .await;
    assert_eq!(status, StatusCode::MISDIRECTED_REQUEST);
    let (_, _, listed) = admin.call(Method::GET, "/api/v1/policies", &[], None).await;
    assert_eq!(listed["policies"], json!([]), "{listed}");
}

/// Runs the admin binary with `args` (and `env`) expecting it to refuse
/// to start; returns its error output.
fn refused_start(args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-admin"));
    command
        .args(args)
        .arg("--db")
        .arg(dir.path().join("x.db"))
        .env_remove("SLUICE_ADMIN_PASSWORD")
        .env_remove("SLUICE_ADMIN_PASSWORD_HASH")
        .env_remove("SLUICE_SYNC_TOKEN");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    println!("{args:?} {env:?}: exit {:?}: {stderr}", out.status.code());
    assert!(!out.status.success(), "it started: {args:?} {env:?}");
    stderr
}

/// `--insecure-dev` is for one developer's machine: mixed with a password
/// or a sync token (a deployment) or on an address others reach, the admin
/// refuses to start and says why.
#[test]
fn insecure_dev_refuses_to_run_where_it_would_be_exposed() {
    let with_password = refused_start(
        &["--listen", "127.0.0.1:0", "--insecure-dev"],
        &[("SLUICE_ADMIN_PASSWORD", "a-real-password")],
    );
    assert!(
        with_password.contains("--insecure-dev turns the login off"),
        "{with_password}"
    );
    let with_token = refused_start(
        &["--listen", "127.0.0.1:0", "--insecure-dev"],
        &[("SLUICE_SYNC_TOKEN", "a-token")],
    );
    assert!(with_token.contains("sync token"), "{with_token}");
    let exposed = refused_start(&["--listen", "0.0.0.0:0", "--insecure-dev"], &[]);
    assert!(exposed.contains("loopback only"), "{exposed}");
    let half_tls = refused_start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--insecure-dev",
            "--tls-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    assert!(
        half_tls.contains("--tls-listen goes with a certificate"),
        "{half_tls}"
    );
}

/// Third security review, item 8: the admin refuses to start with a
/// placeholder of the shipped manifests as its password, sync token or
/// metrics token, or with a sync token under 32 bytes, naming the
/// variable and never echoing the value.
#[test]
fn placeholder_secrets_and_short_sync_tokens_are_refused_at_startup() {
    let long = "0123456789abcdef0123456789abcdef";
    for (variable, value, says) in [
        (
            "SLUICE_ADMIN_PASSWORD",
            "replace-with-a-password",
            "SLUICE_ADMIN_PASSWORD (--admin-password) is still a placeholder",
        ),
        (
            "SLUICE_SYNC_TOKEN",
            "replace-with-openssl-rand-hex-32",
            "SLUICE_SYNC_TOKEN (--sync-token) is still a placeholder",
        ),
        (
            "SLUICE_METRICS_TOKEN",
            "replace-with-openssl-rand-hex-32",
            "SLUICE_METRICS_TOKEN (--metrics-token) is still a placeholder",
        ),
        (
            "SLUICE_SYNC_TOKEN",
            "short-token",
            "SLUICE_SYNC_TOKEN (--sync-token) is 11 bytes long: at least 32",
        ),
    ] {
        let mut env = vec![
            ("SLUICE_ADMIN_PASSWORD", "a-real-password"),
            ("SLUICE_SYNC_TOKEN", long),
        ];
        env.retain(|(v, _)| *v != variable);
        env.push((variable, value));
        let refused = refused_start(&["--listen", "127.0.0.1:0"], &env);
        println!(
            "refused at startup: {}",
            refused.lines().last().unwrap_or_default()
        );
        assert!(refused.contains(says), "{refused}");
        assert!(
            !refused.contains(value),
            "the value is not echoed: {refused}"
        );
    }
}

/// A limit named in several policies is one limit: a policy that gives it
/// another rate is refused (422, on its own field), and nothing is saved.
#[tokio::test]
async fn a_shared_limit_with_another_rate_is_refused_on_the_policys_own_field() {
    let admin = start().await;
    let s = admin.login().await;
    let charges = json!({"name": "charges", "match": {"host": "api.stripe.example", "path_prefix": "/v1/charges"},
        "rate": {"requests": 25, "period": "1s"},
        "limits": [{"name": "account", "rate": {"requests": 100, "period": "1s"}}]});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(charges))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let same = json!({"name": "refunds", "match": {"host": "api.stripe.example", "path_prefix": "/v1/refunds"},
        "rate": {"requests": 25, "period": "1s"},
        "limits": [{"name": "account", "rate": {"requests": 100, "period": "1s"}}]});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(same))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let other = json!({"name": "stripe", "match": {"host": "api.stripe.example"},
        "rate": {"requests": 25, "period": "1s"},
        "limits": [{"name": "account", "rate": {"requests": 90, "period": "1s"}}]});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(other))
        .await;
    println!("shared limit, another rate: {status} {body}");
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["errors"][0]["path"], "limits[0].rate");
    assert!(body["errors"][0]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("a limit named in several policies is one limit"));
    let (status, _, _) = admin
        .edit(&s, Method::GET, "/api/v1/policies/stripe", &[], None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "nothing saved");
}

/// An Envoy's sync with its daily budget `known` or not, holding
/// `available` of 100 at `at_ms`.
fn budget_report(instance: &str, known: bool, available: u64, at_ms: u64) -> Value {
    json!({"instance": instance, "policy_version": 1, "at_ms": at_ms,
        "budgets": {"daily": {"known": known, "available": available, "size": 100, "at_ms": at_ms}}})
}

/// A sync with the sync token, answered 2xx or 3xx: its status and headers.
async fn sync_with(admin: &Admin, report: Value) -> (StatusCode, HeaderMap) {
    let auth = format!("Bearer {SYNC_TOKEN}");
    let (status, h, body) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(report),
        )
        .await;
    assert!(
        status.is_success() || status.is_redirection(),
        "{status} {body}"
    );
    (status, h)
}

async fn sync_budgets(admin: &Admin, report: Value) -> (StatusCode, Option<Value>) {
    let (status, h) = sync_with(admin, report).await;
    let held = h
        .get("sluice-budgets")
        .map(|v| serde_json::from_slice(v.as_bytes()).unwrap());
    (status, held)
}

#[tokio::test]
async fn budgets_are_held_per_envoy_across_an_admin_restart_and_given_back_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let daily = json!({"name": "maps", "match": {"host": "api.maps.example"},
        "rate": {"requests": 10, "period": "1s"},
        "limits": [{"name": "daily", "rate": {"requests": 100, "period": "1d", "algorithm": "fixed_window"}},
                   {"name": "per-minute", "rate": {"requests": 60, "period": "1m"}}]});
    store_with(&db, &daily);
    let admin = start_on(dir, db.clone()).await;
    // A first start: nothing held, nothing given back.
    let (_, held) = sync_budgets(&admin, budget_report("envoy-a", false, 100, 1_000)).await;
    assert_eq!(held, None);
    // Known from then on: each report is kept, none is answered.
    for (available, at) in [(70, 2_000), (40, 3_000)] {
        let (status, held) =
            sync_budgets(&admin, budget_report("envoy-a", true, available, at)).await;
        assert_eq!((status, held), (StatusCode::NOT_MODIFIED, None));
    }
    // The admin restarts on the same file.
    let dir2 = admin._dir;
    let admin = start_on(dir2, db).await;
    // envoy-a restarts: asks, and gets back its 40 left at 3 000 ms; its
    // full "unknown" report does not replace the record.
    for _ in 0..2 {
        let (_, held) = sync_budgets(&admin, budget_report("envoy-a", false, 100, 9_000)).await;
        assert_eq!(
            held,
            Some(json!({"daily": {"available": 40, "size": 100, "at_ms": 3_000}}))
        );
    }
    // Another Envoy has a budget of its own.
    let (_, held) = sync_budgets(&admin, budget_report("envoy-b", false, 100, 9_000)).await;
    assert_eq!(held, None);
    // An Envoy on a set without the budget yet (its fallback) gets the
    // record of the set it is about to get.
    let (status, held) = sync_budgets(
        &admin,
        json!({"instance": "envoy-a", "policy_version": 0, "at_ms": 9_500}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(held.unwrap()["daily"]["available"], 40);
    // Hostile reports: refused whole, the record untouched.
    let auth = format!("Bearer {SYNC_TOKEN}");
    let many: serde_json::Map<String, Value> = (0..1001)
        .map(|i| {
            (
                format!("b{i}"),
                json!({"known": true, "available": 0, "size": 1, "at_ms": 1}),
            )
        })
        .collect();
    let long_name = "x".repeat(65);
    for budgets in [
        Value::Object(many),
        json!({long_name: {"known": true, "available": 0, "size": 1, "at_ms": 1}}),
        json!({"daily": {"known": true, "available": -5, "size": 100, "at_ms": 1}}),
    ] {
        let (status, _, body) = admin
            .call(
                Method::POST,
                "/api/v1/sync",
                &[("authorization", &auth)],
                Some(json!({"instance": "envoy-a", "policy_version": 1, "at_ms": 1, "budgets": budgets})),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    let (_, held) = sync_budgets(&admin, budget_report("envoy-a", false, 100, 9_000)).await;
    assert_eq!(held.unwrap()["daily"]["available"], 40);
}

/// A keyed budget is held per key: each report's changed keys are kept
/// (a key that spent nothing is forgotten), and an Envoy that asks gets
/// them back in parts of 256 keys, in order, each part after the last key
/// it names; keys last heard of more than a period before are not sent.
#[tokio::test]
async fn keyed_budgets_are_held_per_key_and_given_back_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let teams = json!({"name": "maps", "match": {"host": "api.maps.example"},
        "rate": {"requests": 10, "period": "1s"},
        "limits": [{"name": "team-daily", "rate": {"requests": 100, "period": "1d", "algorithm": "fixed_window"},
                    "key": {"header": "x-team", "max_keys": 4096}}]});
    store_with(&db, &teams);
    let admin = start_on(dir, db).await;
    let day = 86_400_000u64;
    let report = |known: bool, at_ms: u64, keys: Value, resume_after: Option<i64>| {
        let mut budget = json!({"known": known, "available": 100, "size": 100, "at_ms": at_ms});
        if let Some(after) = resume_after {
            budget["resume_after"] = json!(after);
        }
        json!({"instance": "envoy-a", "policy_version": 1, "at_ms": at_ms,
            "budgets": {"team-daily": budget}, "budget_keys": {"team-daily": keys}})
    };
    // 300 keys spend (owners spread over the whole u64 range, so that the
    // signed order the admin keeps is tried), one of them long ago.
    let owner = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let keys: Vec<Value> = (1..=300)
        .map(|i| json!({"owner": owner(i), "spent": i % 90 + 1}))
        .collect();
    sync_budgets(
        &admin,
        report(true, day, json!([{"owner": owner(999), "spent": 7}]), None),
    )
    .await;
    sync_budgets(&admin, report(true, 3 * day, Value::Array(keys), None)).await;
    // A key that spent nothing (its day renewed) is forgotten.
    sync_budgets(
        &admin,
        report(
            true,
            3 * day,
            json!([{"owner": owner(300), "spent": 0}]),
            None,
        ),
    )
    .await;
    // The Envoy restarts and asks: two parts.
    let (_, held) = sync_budgets(&admin, report(false, 3 * day + 5_000, json!([]), None)).await;
    let first = held.expect("a first part");
    let part = &first["team-daily"];
    assert_eq!(part["more"], true);
    let taken = part["keys"].as_array().unwrap();
    assert_eq!(taken.len(), 256);
    let cursor = |k: &Value| k["owner"].as_u64().unwrap() as i64;
    assert!(
        taken.windows(2).all(|w| cursor(&w[0]) < cursor(&w[1])),
        "in order"
    );
    let last = cursor(taken.last().unwrap());
    let (_, held) = sync_budgets(
        &admin,
        report(false, 3 * day + 6_000, json!([]), Some(last)),
    )
    .await;
    let second = held.expect("a second part");
    let rest = second["team-daily"]["keys"].as_array().unwrap();
    assert_eq!(second["team-daily"].get("more"), None);
    assert_eq!(
        rest.len(),
        43,
        "299 kept, the forgotten and the old one left out"
    );
    let all: Vec<(u64, u64)> = taken
        .iter()
        .chain(rest)
        .map(|k| (k["owner"].as_u64().unwrap(), k["spent"].as_u64().unwrap()))
        .collect();
    assert!(all.contains(&(owner(7), 8)));
    assert!(all
        .iter()
        .all(|(o, _)| *o != owner(300) && *o != owner(999)));
    // Past the last key, nothing more.
    let after_all = cursor(rest.last().unwrap());
    let (_, held) = sync_budgets(
        &admin,
        report(false, 3 * day + 7_000, json!([]), Some(after_all)),
    )
    .await;
    assert_eq!(held, None);
    // Hostile: more keys than a report may carry is refused whole.
    let many: Vec<Value> = (0..2049).map(|i| json!({"owner": i, "spent": 1})).collect();
    let auth = format!("Bearer {SYNC_TOKEN}");
    let (status, _, body) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(report(true, 3 * day, Value::Array(many), None)),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

/// Push: a watch is held until the policy set differs from the one it
/// names, answered at once when it already does, `304` after its hold;
/// the sync token and a well-formed body are required; stopping the
/// admin answers held watches rather than waiting for them.
#[tokio::test]
async fn a_watch_is_answered_as_soon_as_an_edit_lands() {
    use std::time::{Duration, Instant};
    let admin = start().await;
    let s = admin.login().await;
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(bank(10)))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, _, list) = admin
        .call(
            Method::GET,
            "/api/v1/policies",
            &[("cookie", &s.cookie)],
            None,
        )
        .await;
    let version = list["version"].as_u64().unwrap();
    let bearer = format!("Bearer {SYNC_TOKEN}");
    let watch = |v: u64, wait_ms: &'static str| {
        let (admin, bearer) = (&admin, bearer.clone());
        async move {
            admin
                .call(
                    Method::POST,
                    "/api/v1/sync/watch",
                    &[("authorization", &bearer), ("sluice-wait-ms", wait_ms)],
                    Some(json!({"instance": "e1", "policy_version": v})),
                )
                .await
        }
    };
    // Behind: answered at once with the set and the store's epoch.
    let (status, headers, body) = watch(0, "5000").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["version"].as_u64(), Some(version));
    assert!(headers.contains_key("sluice-store-epoch"));
    // Current, nothing changes: 304 after the hold.
    let started = Instant::now();
    let (status, _, _) = watch(version, "300").await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert!(started.elapsed() >= Duration::from_millis(300));
    // Ahead of the store (a restored backup): not sent the older set.
    let (status, _, _) = watch(version + 5, "300").await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    // Current, an edit lands 200 ms in: answered with it right after.
    let held = tokio::spawn({
        let base = admin.base.clone();
        let bearer = bearer.clone();
        async move {
            let started = Instant::now();
            let resp = reqwest::Client::new()
                .post(format!("{base}/api/v1/sync/watch"))
                .header("authorization", bearer)
                .header("content-type", "application/json")
                .body(json!({"instance": "e1", "policy_version": version}).to_string())
                .send()
                .await
                .unwrap();
            let status = resp.status();
            let body: Value =
                serde_json::from_str(&resp.text().await.unwrap_or_default()).unwrap_or_default();
            (status, body, Instant::now(), started)
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _, _) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/policies/bank",
            &[("if-match", &format!("\"{version}\""))],
            Some(bank(20)),
        )
        .await;
    let edited = Instant::now();
    assert_eq!(status, StatusCode::OK);
    let (status, body, answered, started) = held.await.unwrap();
    let after_edit = answered.saturating_duration_since(edited);
    println!(
        "watch: held {:?}, answered {after_edit:?} after the edit's 200",
        answered - started
    );
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["version"].as_u64(), Some(version + 1));
    assert!(after_edit < Duration::from_millis(100), "{after_edit:?}");
    // No token, a wrong one, a bad body.
    let (status, _, _) = admin
        .call(
            Method::POST,
            "/api/v1/sync/watch",
            &[("authorization", "Bearer wrong")],
            Some(json!({"instance": "e1", "policy_version": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for bad in [
        json!({"policy_version": 0}),
        json!({"instance": "", "policy_version": 0}),
        json!("x"),
    ] {
        let (status, _, body) = admin
            .call(
                Method::POST,
                "/api/v1/sync/watch",
                &[("authorization", &bearer)],
                Some(bad),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
}

/// A held watch does not hold up the admin's shutdown.
#[tokio::test]
async fn stopping_the_admin_answers_held_watches() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let state = state_on(&dir.path().join("sluice.db"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(sluice_admin::serve(listener, state, None, async move {
        let _ = stopped.await;
    }));
    let held = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{base}/api/v1/sync/watch"))
            .header("authorization", format!("Bearer {SYNC_TOKEN}"))
            .body(json!({"instance": "e1", "policy_version": 0}).to_string())
            .send()
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    let took = started.elapsed();
    let answer = held.await.unwrap();
    println!("watch at shutdown: {answer:?}; the admin stopped in {took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// One Envoy's sync for the global policy `llm`, naming the share it
/// holds (as the filter does): the share the admin answers with.
async fn fleet_sync(admin: &Admin, instance: &str, held: Option<&Value>) -> Value {
    fleet_sync_over(&admin.http, admin, instance, held).await
}

/// [`fleet_sync`] over `http`'s connections.
async fn fleet_sync_over(
    http: &reqwest::Client,
    admin: &Admin,
    instance: &str,
    held: Option<&Value>,
) -> Value {
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut report = json!({"instance": instance, "policy_version": 1, "at_ms": at_ms});
    if let Some(h) = held {
        report["grants"] = json!({"llm": h["id"]});
        report["held"] = json!({"llm": {"rate": h["rate"], "in_flight": h["in_flight"],
                                         "instances": h["instances"]}});
    }
    let answer = http
        .post(format!("{}/api/v1/sync", admin.base))
        .header("authorization", format!("Bearer {SYNC_TOKEN}"))
        .header("content-type", "application/json")
        .body(report.to_string())
        .send()
        .await
        .unwrap();
    let status = answer.status();
    assert!(status.is_success() || status.is_redirection(), "{status}");
    let grants: Value = answer
        .headers()
        .get("sluice-grants")
        .map(|v| serde_json::from_slice(v.as_bytes()).unwrap())
        .unwrap_or_default();
    grants["llm"].clone()
}

/// `instance` opens a watch the admin holds, and closes its connection
/// after `after`, unanswered.
async fn close_a_held_watch(admin: &Admin, instance: &str, after: std::time::Duration) {
    let closed = reqwest::Client::builder()
        .timeout(after)
        .build()
        .unwrap()
        .post(format!("{}/api/v1/sync/watch", admin.base))
        .header("authorization", format!("Bearer {SYNC_TOKEN}"))
        .header("sluice-wait-ms", "20000")
        .header("content-type", "application/json")
        .body(json!({"instance": instance, "policy_version": 1}).to_string())
        .send()
        .await;
    assert!(closed.is_err(), "the watch was held: {closed:?}");
}

/// The global policy `llm` (300/s, lease 2 s), and Envoys `a` and `c`
/// (c over `c_http`'s connections) syncing every 100 ms past the new
/// admin's recovery (1.5 leases): a's share then, about half.
async fn a_and_c_sharing_llm(admin: &Admin, c_http: &reqwest::Client) -> Value {
    use std::time::{Duration, Instant};
    let s = admin.login().await;
    let llm = json!({"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
        "share_lease": "2s", "rate": {"requests": 300, "period": "1s", "burst": 30}});
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(llm))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (mut a, mut c) = (Value::Null, Value::Null);
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3_600) {
        a = fleet_sync(admin, "a", Some(&a).filter(|v| !v.is_null())).await;
        c = fleet_sync_over(c_http, admin, "c", Some(&c).filter(|v| !v.is_null())).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let even = a["rate"].as_f64().unwrap();
    assert!((100.0..=200.0).contains(&even), "a {a}, c {c}");
    a
}

/// `a` syncs every 100 ms until it holds all of `llm` (c's share moved
/// to it): how long that took, at least three of c's missed syncs (600 ms
/// at least) and within 1.5 s, not a lease and a half.
async fn until_cs_share_moves_to_a(admin: &Admin, a: &mut Value) -> std::time::Duration {
    use std::time::{Duration, Instant};
    let gone = Instant::now();
    let moved = loop {
        *a = fleet_sync(admin, "a", Some(a)).await;
        if a["rate"].as_f64().unwrap() >= 290.0 {
            break gone.elapsed();
        }
        assert!(
            gone.elapsed() < Duration::from_millis(1_500),
            "c's share did not move: a {a}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        moved >= Duration::from_millis(550),
        "before c missed three syncs and 600 ms"
    );
    moved
}

/// a syncs on for a second and keeps all of `llm`.
async fn a_keeps_it_all(admin: &Admin, a: &mut Value) {
    for _ in 0..10 {
        *a = fleet_sync(admin, "a", Some(a)).await;
        assert!(a["rate"].as_f64().unwrap() >= 290.0, "a {a}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A SIGKILLed Envoy's kernel closes its held watch. The admin notes it;
/// when that Envoy then misses three syncs its share goes to the others at
/// once, not a lease and a half after its last sync (3 s here).
#[tokio::test]
async fn a_watch_closed_unanswered_frees_a_silent_envoys_fleet_share() {
    use std::time::Duration;
    let admin = start().await;
    let mut a = a_and_c_sharing_llm(&admin, &admin.http).await;
    // c holds a watch, then its connection closes (the client gives up).
    close_a_held_watch(&admin, "c", Duration::from_millis(200)).await;
    let moved = until_cs_share_moves_to_a(&admin, &mut a).await;
    println!("a closed watch: c's share moved to a {moved:?} after (a {a})");
    // A live Envoy whose watch closes syncs on and keeps its share.
    close_a_held_watch(&admin, "a", Duration::from_millis(100)).await;
    a_keeps_it_all(&admin, &mut a).await;
}

/// An Envoy SIGKILLed between two syncs, with no watch held: its kernel
/// closes the connection it synced over, and its share moves as when a
/// held watch closes (not a lease and a half after its last sync).
#[tokio::test]
async fn a_connection_closed_between_syncs_frees_a_silent_envoys_fleet_share() {
    let admin = start().await;
    // c syncs over a connection of its own, kept alive between syncs.
    let c_http = reqwest::Client::new();
    let mut a = a_and_c_sharing_llm(&admin, &c_http).await;
    drop(c_http);
    let moved = until_cs_share_moves_to_a(&admin, &mut a).await;
    println!("a connection closed between syncs: c's share moved to a {moved:?} after (a {a})");
    // A live Envoy whose sync connection closes syncs on over another
    // and keeps its share.
    let a_http = reqwest::Client::new();
    a = fleet_sync_over(&a_http, &admin, "a", Some(&a)).await;
    drop(a_http);
    a_keeps_it_all(&admin, &mut a).await;
}

/// 10 000 watches from one instance, 200 at a time: each new one answers
/// the one it replaces at once, so the instance holds one watch however
/// many it opens, and another instance's watch is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_watches_from_one_instance_leave_one_held() {
    use futures_util::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let state = state_on(&db);
    let admin = serve(Arc::clone(&state), dir, db).await;
    let (_, headers) = sync_with(
        &admin,
        json!({"instance": "e1", "policy_version": 0, "at_ms": 1}),
    )
    .await;
    let epoch: u64 = headers["sluice-store-epoch"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let watch = |instance: &'static str, timeout_s: u64| {
        let http = admin.http.clone();
        let url = format!("{}/api/v1/sync/watch", admin.base);
        async move {
            http.post(url)
                .header("authorization", format!("Bearer {SYNC_TOKEN}"))
                .header("sluice-wait-ms", "20000")
                .header("content-type", "application/json")
                .body(
                    json!({"instance": instance, "policy_version": 0, "policy_epoch": epoch})
                        .to_string(),
                )
                .timeout(std::time::Duration::from_secs(timeout_s))
                .send()
                .await
                .map(|r| r.status())
        }
    };
    let other = tokio::spawn(watch("e2", 60));
    let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sampling = {
        let (state, most) = (Arc::clone(&state), Arc::clone(&most));
        tokio::spawn(async move {
            loop {
                most.fetch_max(state.changes.held(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
    };
    let started = std::time::Instant::now();
    let answers: Vec<_> = futures_util::stream::iter(0..10_000)
        .map(|_| watch("e1", 1))
        .buffer_unordered(200)
        .collect()
        .await;
    let took = started.elapsed();
    // The newest e1 watch was left by its client: the admin lets it go.
    let mut held_now = state.changes.held();
    for _ in 0..100 {
        if held_now == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        held_now = state.changes.held();
    }
    sampling.abort();
    let replaced = answers
        .iter()
        .filter(|a| matches!(a, Ok(StatusCode::NOT_MODIFIED)))
        .count();
    let still_held = answers.iter().filter(|a| a.is_err()).count();
    println!(
        "watches: 10 000 from one instance, 200 at a time, in {took:.2?}: {replaced} answered 304 when replaced, \
         {still_held} still held at the client's timeout; at most {} instances holding a watch at any time \
         (with one other instance), {held_now} at the end (the other's)",
        most.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(replaced, 9_999);
    assert_eq!(still_held, 1, "the newest is held");
    assert!(most.load(std::sync::atomic::Ordering::Relaxed) <= 2);
    assert_eq!(held_now, 1);
    assert!(
        !other.is_finished(),
        "the other instance's watch is left alone"
    );
    other.abort();
}

/// The price table through the API: saved (a new set version, in the
/// audit log, in what Envoys get), refused with each bad field's path
/// (422), kept while a money limit needs it.
#[tokio::test]
async fn prices_are_versioned_with_the_set_and_checked_with_its_policies() {
    let admin = start().await;
    let s = admin.login().await;
    let (status, _, body) = admin
        .edit(&s, Method::GET, "/api/v1/prices", &[], None)
        .await;
    assert_eq!((status, body), (StatusCode::OK, Value::Null));
    let money = json!({"name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 100, "period": "1s"},
        "limits": [{"name": "team-monthly", "key": {"header": "x-team"},
                    "rate": {"requests": 500000000, "period": "30d", "algorithm": "fixed_window"},
                    "cost": "price"}]});
    // No prices yet: the money limit is refused, its field named.
    let (status, _, body) = admin
        .edit(
            &s,
            Method::POST,
            "/api/v1/policies",
            &[],
            Some(money.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("limits[0].cost"), "{body}");
    // A bad table: every field named.
    let bad =
        json!({"currency": "USDX", "models": {"gpt-4o": {"input": "2.50", "output": "100001"}}});
    let (status, _, body) = admin
        .edit(&s, Method::PUT, "/api/v1/prices", &[], Some(bad))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let text = body.to_string();
    assert!(
        text.contains("prices.currency") && text.contains("prices.models.gpt-4o.output"),
        "{text}"
    );
    let (status, _, body) = admin
        .edit(
            &s,
            Method::PUT,
            "/api/v1/prices",
            &[],
            Some(json!({"currency": "USD", "models": {"m": {"input": "x"}}})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("prices.models.m.input"), "{body}");
    // A good one: a new set version, then the money limit is welcome.
    let table = json!({"currency": "USD", "models": {"gpt-4o": {"input": "2.50", "output": "10", "cached_input": "1.25"}}});
    let (status, _, body) = admin
        .edit(&s, Method::PUT, "/api/v1/prices", &[], Some(table.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["version"], 1);
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(money))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // The same table again changes nothing.
    let (_, _, body) = admin
        .edit(&s, Method::PUT, "/api/v1/prices", &[], Some(table))
        .await;
    assert_eq!(body["version"], 2);
    // Removing it while a limit counts money is refused.
    let (status, _, body) = admin
        .edit(&s, Method::PUT, "/api/v1/prices", &[], Some(Value::Null))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(
        body.to_string().contains("policies[0].limits[0].cost"),
        "{body}"
    );
    // What Envoys get carries it, amounts as exact text.
    let auth = format!("Bearer {SYNC_TOKEN}");
    let (status, _, body) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(json!({"instance": "envoy-a", "policy_version": 0, "at_ms": 1000})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["prices"]["models"]["gpt-4o"]["input"], "2.5");
    let (_, _, audit) = admin
        .edit(&s, Method::GET, "/api/v1/audit", &[], None)
        .await;
    assert!(
        audit.to_string().contains("\"action\":\"prices\""),
        "{audit}"
    );
    // Warning lines crossed, as an Envoy reports them (a count since it
    // started): one audit row per limit per minute, summing what each
    // report crossed (third review, item 11); a restarted Envoy's count
    // starts again.
    let crossed = |n: u64| {
        json!({"instance": "envoy-a", "policy_version": 2, "at_ms": 2000,
               "limits": {"team-monthly": {"warn_crossed": n, "requests": 500000000, "period_ms": 2592000000u64}}})
    };
    let mut lines = Vec::new();
    for n in [1, 1, 3, 1] {
        let (status, _, body) = admin
            .call(
                Method::POST,
                "/api/v1/sync",
                &[("authorization", &auth)],
                Some(crossed(n)),
            )
            .await;
        assert!(
            status.is_success() || status == StatusCode::NOT_MODIFIED,
            "{status} {body}"
        );
        let (_, _, audit) = admin
            .edit(&s, Method::GET, "/api/v1/audit", &[], None)
            .await;
        let warns: Vec<String> = audit["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["action"] == "warn" && e["target"] == "team-monthly")
            .map(|e| e["new"].to_string())
            .collect();
        lines.push(warns);
    }
    let counts: Vec<usize> = lines.iter().map(Vec::len).collect();
    assert_eq!(counts, [1, 1, 1, 1], "{lines:?}");
    let newest = |i: usize| lines[i].first().cloned().unwrap_or_default();
    // 1, then none new, then 2 more, then a restart's 1: 4 in the minute.
    assert!(newest(0).contains(r#""crossed":1,"#), "{lines:?}");
    assert!(newest(1).contains(r#""crossed":1,"#), "{lines:?}");
    assert!(newest(2).contains(r#""crossed":3,"#), "{lines:?}");
    assert!(newest(3).contains(r#""crossed":4,"#), "{lines:?}");
    assert!(newest(3).contains("envoy-a"), "{lines:?}");
}

/// Third security review, item 11: a sync token's holder cannot grow the
/// audit log without bound through warning rows. 1 000 syncs from 40
/// instances, their warning counters going up and down: one row for the
/// minute, summing them; rows past `--warn-retention` are deleted.
#[tokio::test]
async fn warning_rows_of_the_audit_log_are_bounded() {
    let admin = start().await;
    let s = admin.login().await;
    let budget = json!({"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 1000, "period": "1s"},
        "limits": [{"name": "team-monthly", "rate": {"requests": 500000000, "period": "30d", "algorithm": "fixed_window"},
                    "warn_at": [0.8]}]});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(budget))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let auth = format!("Bearer {SYNC_TOKEN}");
    for i in 0..1000u64 {
        let report = json!({"instance": format!("rogue-{}", i % 40), "policy_version": 1, "at_ms": 1000 + i,
            "limits": {"team-monthly": {"warn_crossed": (i / 40) % 2 * 5 + 1,
                                        "requests": 500000000, "period_ms": 2592000000u64}}});
        let (status, _, body) = admin
            .call(
                Method::POST,
                "/api/v1/sync",
                &[("authorization", &auth)],
                Some(report),
            )
            .await;
        assert!(
            status.is_success() || status == StatusCode::NOT_MODIFIED,
            "{status} {body}"
        );
    }
    let (_, _, audit) = admin
        .edit(&s, Method::GET, "/api/v1/audit", &[], None)
        .await;
    let warns: Vec<&Value> = audit["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["action"] == "warn")
        .collect();
    println!(
        "1 000 syncs of 40 instances with warning counters going up and down: {} audit row(s): {}",
        warns.len(),
        warns
            .first()
            .map(|e| e["new"].to_string())
            .unwrap_or_default()
    );
    assert_eq!(warns.len(), 1, "{warns:?}");
    let row = &warns[0]["new"];
    assert_eq!(row["envoys"].as_array().map(Vec::len), Some(8));
    // 40 instances, 25 reports each: 8 named, 800 reports from the others.
    assert_eq!(row["more_reports"], 800);
}

/// A global further limit's ledger is in the fleet view as
/// `limits/<name>`, with the Envoys that sync it (before, the view listed
/// global policies only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_view_lists_a_global_further_limits_shares() {
    let admin = start().await;
    let s = admin.login().await;
    let llm = json!({"name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 1000, "period": "1s"},
        "limits": [{"name": "tps", "scope": "global", "rate": {"requests": 90, "period": "1s"},
                    "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 2}}}]});
    let (status, _, _) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(llm))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    for instance in ["a", "b"] {
        fleet_sync(&admin, instance, None).await;
    }
    let (status, _, view) = admin
        .edit(&s, Method::GET, "/api/v1/fleet", &[], None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let tps = view["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == "limits/tps")
        .unwrap_or_else(|| panic!("no limits/tps in {view}"))
        .clone();
    assert_eq!(tps["limit"]["rate"], 90.0);
    let members: Vec<&str> = tps["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["instance"].as_str())
        .collect();
    assert_eq!(members, ["a", "b"], "{tps}");
}

/// A model-price catalog in LiteLLM's format, merged into the set's
/// prices: what it adds, changes and refuses, dry or applied, and the
/// catalogs and tables it cannot be merged with (issue 52, item 5).
#[tokio::test]
async fn a_price_catalog_is_imported_with_what_it_changes_and_refuses() {
    let admin = start().await;
    let s = admin.login().await;
    let catalog = json!({
        "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "litellm_provider": "see the docs"},
        "gpt-4o": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05, "cache_read_input_token_cost": 1.25e-06, "litellm_provider": "openai"},
        "gpt-4o-mini": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07, "litellm_provider": "openai"},
        "dall-e-3": {"output_cost_per_image": 0.04, "litellm_provider": "openai"},
        "claude-x": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05, "litellm_provider": "anthropic"}
    });
    let import = |query: &str| format!("/api/v1/prices/import{query}");
    let (status, _, body) = admin
        .edit(
            &s,
            Method::POST,
            &import("?dry_run=true&provider=openai"),
            &[],
            Some(catalog.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let models = |list: &Value| -> Vec<String> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|m| m["model"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(models(&body["added"]), ["gpt-4o", "gpt-4o-mini"]);
    assert_eq!(models(&body["refused"]), ["dall-e-3"]);
    assert_eq!(body["not_selected"], 1);
    assert_eq!(body["applied"], false);
    let (_, _, prices) = admin
        .edit(&s, Method::GET, "/api/v1/prices", &[], None)
        .await;
    assert_eq!(prices, Value::Null, "a dry run changes nothing");

    let (status, _, body) = admin
        .edit(
            &s,
            Method::POST,
            &import("?only=gpt-4o*"),
            &[],
            Some(catalog.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (body["applied"].clone(), body["version"].clone()),
        (json!(true), json!(1))
    );
    let (_, _, prices) = admin
        .edit(&s, Method::GET, "/api/v1/prices", &[], None)
        .await;
    assert_eq!(prices["currency"], "USD");
    assert_eq!(
        prices["models"]["gpt-4o"],
        json!({"input": "2.5", "output": "10", "cached_input": "1.25"})
    );
    assert_eq!(prices["models"]["gpt-4o-mini"]["input"], "0.15");
    let (_, _, body) = admin
        .edit(
            &s,
            Method::POST,
            &import("?only=gpt-4o*"),
            &[],
            Some(catalog.clone()),
        )
        .await;
    assert_eq!(
        (body["unchanged"].clone(), body["applied"].clone()),
        (json!(2), json!(false))
    );

    // What is no catalog is refused whole, and says why.
    for bad in [json!([1, 2]), json!("gpt-4o")] {
        let (status, _, body) = admin
            .edit(&s, Method::POST, &import(""), &[], Some(bad))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(body.to_string().contains("not a price catalog"), "{body}");
    }
    let (status, _, _) = admin
        .call(Method::POST, &import(""), &[], Some(catalog.clone()))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "an import is an edit");
    // More models than a table holds: refused, nothing changed.
    let many: serde_json::Map<String, Value> = (0..1100)
        .map(|i| {
            (
                format!("model-{i}"),
                json!({"input_cost_per_token": 1e-06, "output_cost_per_token": 2e-06}),
            )
        })
        .collect();
    let (status, _, body) = admin
        .edit(
            &s,
            Method::POST,
            &import(""),
            &[],
            Some(Value::Object(many)),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("prices.models"), "{body}");
    // Larger than any catalog: refused before it is read.
    let huge = format!("{{\"m\": \"{}\"}}", "x".repeat(17 * 1024 * 1024));
    let resp = admin
        .http
        .post(format!("{}{}", admin.base, import("")))
        .header("cookie", &s.cookie)
        .header("x-csrf-token", &s.csrf)
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // A table in euros does not take dollar prices.
    let euros = json!({"currency": "EUR", "models": {"in-house": {"input": "1", "output": "2"}}});
    let (status, _, _) = admin
        .edit(&s, Method::PUT, "/api/v1/prices", &[], Some(euros))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = admin
        .edit(&s, Method::POST, &import(""), &[], Some(catalog))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(
        body.to_string().contains("prices.currency") && body.to_string().contains("EUR"),
        "{body}"
    );
}

/// `GET /budgets` gives the stacked budgets as a tree: the company's over
/// each team's over each API key's, added up over the Envoys, each key
/// under the team its calls carried, the tightest rung marked; without a
/// login, nothing.
#[tokio::test]
async fn budgets_are_given_as_the_tree_their_stacking_forms() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let llm = json!({"name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 10, "period": "1s"},
        "limits": [
          {"name": "company", "rate": {"requests": 1000, "period": "30d", "algorithm": "fixed_window"}, "warn_at": [0.8]},
          {"name": "team", "rate": {"requests": 300, "period": "30d", "algorithm": "fixed_window"},
           "key": {"header": "x-team", "label": "value"}},
          {"name": "api-key", "rate": {"requests": 50, "period": "1d", "algorithm": "fixed_window"},
           "key": {"header": "x-api-key"}}]});
    store_with(&db, &llm);
    let admin = start_on(dir, db).await;
    let (status, _, _) = admin.call(Method::GET, "/api/v1/budgets", &[], None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let limit =
        |spend: Value| json!({"requests": 1000, "period_ms": 2_592_000_000u64, "spend": spend});
    let key = |label: &str, hash: u64, spent: u64, size: u64, parent: u64| json!({"label": label, "hash": hash, "spent": spent, "size": size, "parent": parent});
    for (instance, search_spent, k1_spent) in [("envoy-a", 200, 10), ("envoy-b", 90, 9)] {
        let report = json!({"instance": instance, "policy_version": 1, "at_ms": 1_000,
            "limits": {
              "company": limit(json!({"spent": 400, "size": 1000, "renews_in_ms": 60_000})),
              "team": limit(json!({"spent": search_spent + 10, "size": 300, "spending_keys": 2,
                  "keys": [key("search", 11, search_spent, 300, 0), key("ads", 12, 10, 300, 0)]})),
              "api-key": limit(json!({"spent": k1_spent + 3, "size": 50, "spending_keys": 2,
                  "keys": [key("#k1", 21, k1_spent, 50, 11), key("#k2", 22, 3, 50, 12)]}))}});
        sync_with(&admin, report).await;
    }
    let s = admin.login().await;
    let (status, _, tree) = admin
        .edit(&s, Method::GET, "/api/v1/budgets", &[], None)
        .await;
    assert_eq!(status, StatusCode::OK, "{tree}");
    let roots = tree["roots"].as_array().unwrap();
    assert_eq!(roots.len(), 1, "{tree}");
    let company = &roots[0];
    assert_eq!(company["limit"], "company");
    assert_eq!(
        (company["spent"].as_u64(), company["size"].as_u64()),
        (Some(800), Some(2000))
    );
    assert_eq!(company["warn_at"], json!([0.8]));
    let teams = company["children"].as_array().unwrap();
    let search = teams.iter().find(|t| t["key"] == "search").unwrap();
    // 290 of 600 (two Envoys' 300 each) over the company's 800 of 2000.
    assert_eq!(
        (search["spent"].as_u64(), search["size"].as_u64()),
        (Some(290), Some(600))
    );
    assert_eq!(search["tightest"], true);
    // Under ads (20 of 600, its key 6 of 100) the company's 40 % is.
    assert_eq!(company["tightest"], true);
    let k1 = &search["children"][0];
    assert_eq!(
        (k1["key"].as_str(), k1["spent"].as_u64()),
        (Some("#k1"), Some(19))
    );
    assert_eq!(k1["tightest"], false);
    let ads = teams.iter().find(|t| t["key"] == "ads").unwrap();
    assert_eq!(ads["children"][0]["key"], "#k2");
    assert_eq!(ads["tightest"], false);
}

/// The ladder's rungs are in the audit log: calls sent for a cheaper model
/// and calls a budget refused, one row per limit per rung per minute
/// summing what the Envoys reported; a short limit's refusals are not
/// (stats count them; a row a minute per rate limit would drown the log).
#[tokio::test]
async fn downgrades_routes_paces_and_budget_refusals_are_audited_per_minute() {
    let admin = start().await;
    let s = admin.login().await;
    let llm = json!({"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 1000, "period": "1s"},
        "limits": [{"name": "team-monthly", "rate": {"requests": 500000000, "period": "30d", "algorithm": "fixed_window"}},
                   {"name": "per-second", "rate": {"requests": 10, "period": "1s"}}]});
    let (status, _, body) = admin
        .edit(&s, Method::POST, "/api/v1/policies", &[], Some(llm))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let report = |instance: &str, downgraded: u64, refused: u64| {
        json!({"instance": instance, "policy_version": 1, "at_ms": 2000,
               "limits": {
                 "team-monthly": {"downgraded": downgraded, "routed": downgraded + 1, "paced": downgraded + 2, "refused": refused, "requests": 500000000,
                                  "period_ms": 2592000000u64, "spend": {"spent": 1, "size": 500000000}},
                 "per-second": {"refused": refused * 10, "requests": 10, "period_ms": 1000}}})
    };
    for (instance, downgraded, refused) in [("envoy-a", 3, 2), ("envoy-a", 5, 2), ("envoy-b", 1, 4)]
    {
        sync_with(&admin, report(instance, downgraded, refused)).await;
    }
    let (_, _, audit) = admin
        .edit(&s, Method::GET, "/api/v1/audit", &[], None)
        .await;
    let rows = |action: &str, target: &str| -> Vec<Value> {
        audit["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["action"] == action && e["target"] == target)
            .map(|e| e["new"].clone())
            .collect()
    };
    // a: 3 then 2 more; b: 1. Refused: a 2 (then none new), b 4.
    assert_eq!(
        rows("downgrade", "team-monthly"),
        [json!({"calls": 6, "envoys": ["envoy-a", "envoy-b"]})]
    );
    // Routed: a 4 then 6, b 2.
    assert_eq!(
        rows("route", "team-monthly"),
        [json!({"calls": 8, "envoys": ["envoy-a", "envoy-b"]})]
    );
    // Paced by its queue rung: a 5 then 7, b 3.
    assert_eq!(
        rows("queue", "team-monthly"),
        [json!({"calls": 10, "envoys": ["envoy-a", "envoy-b"]})]
    );
    assert_eq!(
        rows("refuse", "team-monthly"),
        [json!({"calls": 6, "envoys": ["envoy-a", "envoy-b"]})]
    );
    assert!(rows("refuse", "per-second").is_empty(), "{audit}");
}

/// Past `--max-syncs-in-flight` a sync is shed at once: 503 with
/// Retry-After and a reason, counted as `shed`, nothing recorded; the
/// next sync after one finishes is answered.
#[tokio::test]
async fn a_sync_past_the_syncs_in_flight_is_shed_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let state = Arc::new(new_state(&db, false).with_max_syncs_in_flight(2));
    let admin = serve(Arc::clone(&state), dir, db).await;
    let report = json!({"instance": "envoy-busy", "policy_version": 0, "at_ms": 1000});
    let auth = format!("Bearer {SYNC_TOKEN}");
    // Two syncs being answered (their turns held, as a slow store would).
    let held = state.sync_turns.try_acquire_many(2).unwrap();
    let (status, h, body) = admin
        .call(
            Method::POST,
            "/api/v1/sync",
            &[("authorization", &auth)],
            Some(report.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        h.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-syncs-in-flight")),
        "{body}"
    );
    let instances = state.store.instances("", 10).await.unwrap();
    assert!(
        instances.is_empty(),
        "a shed sync records nothing: {instances:?}"
    );
    let (_, _, metrics) = admin.call(Method::GET, "/metrics", &[], None).await;
    let metrics = metrics.as_str().unwrap_or_default();
    assert!(
        metrics.contains("sluice_admin_sync_requests_total{result=\"shed\"} 1"),
        "{metrics}"
    );
    drop(held);
    // Answered (304: the Envoy holds the store's version 0 already).
    let (status, _) = sync_with(&admin, report).await;
    assert_eq!(status, StatusCode::NOT_MODIFIED);
    assert_eq!(state.store.instances("", 10).await.unwrap().len(), 1);
}
