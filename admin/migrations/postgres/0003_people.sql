-- Named users with a role, and API tokens with a scope and an expiry.
-- Passwords are argon2 PHC strings; a token is kept only as the SHA-256 of
-- its secret (256 random bits: a slow hash would add nothing).
CREATE TABLE users (
    name          TEXT PRIMARY KEY,
    role          TEXT NOT NULL,
    password_hash TEXT NOT NULL,
    created_ms    BIGINT NOT NULL,
    created_by    TEXT NOT NULL
);
CREATE TABLE api_tokens (
    id           TEXT PRIMARY KEY,
    name         TEXT NOT NULL UNIQUE,
    scope        TEXT NOT NULL,
    secret_hash  TEXT NOT NULL,
    created_ms   BIGINT NOT NULL,
    created_by   TEXT NOT NULL,
    expires_ms   BIGINT NOT NULL,
    last_used_ms BIGINT
);
