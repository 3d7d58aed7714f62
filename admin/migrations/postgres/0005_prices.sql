-- The policy set's price table (one row, or none): what each model costs,
-- for limits whose cost is money. Changing it changes the set's version.
CREATE TABLE prices (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    body          TEXT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    updated_by    TEXT NOT NULL
);
