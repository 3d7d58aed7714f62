-- What each Envoy last reported of its budgets (further limits of an hour or
-- longer, by name), given back to it when it restarts so that a restart does
-- not refill a daily or monthly limit. Times in at_ms are the Envoy's clock.
CREATE TABLE budgets (
    instance   TEXT NOT NULL,
    name       TEXT NOT NULL,
    available  BIGINT NOT NULL,
    size       BIGINT NOT NULL,
    at_ms      BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    PRIMARY KEY (instance, name)
);
