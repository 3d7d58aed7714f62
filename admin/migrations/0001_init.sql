-- Policies in their evaluation order (first match wins), each with its own
-- version for optimistic concurrency.
CREATE TABLE policies (
    name          TEXT PRIMARY KEY,
    body          TEXT NOT NULL,        -- the policy as JSON, validated
    version       INTEGER NOT NULL,     -- per policy, for ETag / If-Match
    position      INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    updated_by    TEXT NOT NULL
);

-- Every version of every policy; body NULL when the policy was deleted.
CREATE TABLE policy_history (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    set_version INTEGER NOT NULL,
    body        TEXT,
    at_ms       INTEGER NOT NULL,
    actor       TEXT NOT NULL
);
CREATE INDEX policy_history_name ON policy_history (name, version);

-- Who changed what, when: old -> new.
CREATE TABLE audit (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms  INTEGER NOT NULL,
    actor  TEXT NOT NULL,
    action TEXT NOT NULL,               -- create | update | delete | login | ...
    target TEXT NOT NULL,
    old    TEXT,
    new    TEXT
);

-- The policy set's version: one counter bumped by every policy write.
CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO settings (key, value) VALUES ('policy_set_version', 0);

-- Each Envoy seen by the sync endpoint.
CREATE TABLE instances (
    id             TEXT PRIMARY KEY,
    first_seen_ms  INTEGER NOT NULL,
    last_sync_ms   INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    syncs          INTEGER NOT NULL,
    report         TEXT NOT NULL
);
