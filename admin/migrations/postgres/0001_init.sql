-- The SQLite schema (../0001_init.sql) in PostgreSQL's types: every
-- integer is BIGINT, so the store binds the same i64 values to both.
CREATE TABLE policies (
    name          TEXT PRIMARY KEY,
    body          TEXT NOT NULL,
    version       BIGINT NOT NULL,
    position      BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    updated_by    TEXT NOT NULL
);

CREATE TABLE policy_history (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        TEXT NOT NULL,
    version     BIGINT NOT NULL,
    set_version BIGINT NOT NULL,
    body        TEXT,
    at_ms       BIGINT NOT NULL,
    actor       TEXT NOT NULL
);
CREATE INDEX policy_history_name ON policy_history (name, version);

CREATE TABLE audit (
    id     BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at_ms  BIGINT NOT NULL,
    actor  TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    old    TEXT,
    new    TEXT
);

CREATE TABLE settings (
    key   TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
INSERT INTO settings (key, value) VALUES ('policy_set_version', 0);

CREATE TABLE instances (
    id             TEXT PRIMARY KEY,
    first_seen_ms  BIGINT NOT NULL,
    last_sync_ms   BIGINT NOT NULL,
    policy_version BIGINT NOT NULL,
    syncs          BIGINT NOT NULL,
    report         TEXT NOT NULL
);
