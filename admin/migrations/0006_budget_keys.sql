-- What each Envoy last reported of each key of its keyed budgets (a daily
-- budget per team, a monthly one per user): the key's hash under the
-- fleet's label secret (as a signed integer), what it spent by at_ms (the
-- Envoy's clock). Given back in parts when the Envoy restarts, so that a
-- restart refills no key's budget either.
CREATE TABLE budget_keys (
    instance   TEXT NOT NULL,
    name       TEXT NOT NULL,
    owner      BIGINT NOT NULL,
    spent      BIGINT NOT NULL,
    at_ms      BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    PRIMARY KEY (instance, name, owner)
);
-- The most recently heard of keys of a budget, kept when an instance reports
-- more than the budget's max_keys.
CREATE INDEX budget_keys_heard ON budget_keys (instance, name, updated_ms);
