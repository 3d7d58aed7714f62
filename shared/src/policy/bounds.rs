//! Bounds that keep every value meaningful and every computation in range.

pub const MAX_POLICIES: usize = 1000;
pub const MAX_NAME_LEN: usize = 64;
pub const MAX_REQUESTS: u64 = 1_000_000_000;
/// A money limit's `rate.requests`, in millionths: a billion units.
pub const MAX_MONEY_BUDGET: u64 = 1_000_000_000_000_000;
pub const MAX_BURST: u64 = 1_000_000_000;
pub const MIN_PERIOD_MS: u64 = 1;
/// 31 days: a monthly quota.
pub const MAX_PERIOD_MS: u64 = 31 * 86_400_000;
/// A full bucket must drain back within this (burst / requests * period).
pub const MAX_BUCKET_SPAN_MS: u64 = 31 * 86_400_000;
pub const MAX_LIMITS: usize = 8;
pub const MIN_COLD_FACTOR: u32 = 2;
pub const MAX_COLD_FACTOR: u32 = 10;
pub const MAX_WARMUP_MS: u64 = 3_600_000;
pub const MAX_IN_FLIGHT: u32 = 1_000_000;
pub const MIN_SHARE_LEASE_MS: u64 = 500;
pub const MAX_SHARE_LEASE_MS: u64 = 300_000;
pub const MIN_LEASE_TTL_MS: u64 = 1_000;
pub const MAX_LEASE_TTL_MS: u64 = 86_400_000;
pub const MAX_WAIT_MS: u64 = 300_000;
pub const MAX_QUEUE: u32 = 100_000;
pub const MAX_KEYS: u32 = 1_000_000;
/// A key value named in `fair.weights` or `fair.min`.
pub const MAX_KEY_VALUE_LEN: usize = 256;
pub const MAX_BODY_LEN: usize = 4096;
pub const MAX_HOST_LEN: usize = 261;
pub const MAX_PATH_PREFIX_LEN: usize = 1024;
pub const MAX_HEADER_VALUE_LEN: usize = 1024;
pub const MAX_HEADER_MATCHES: usize = 16;
/// Paths summed for one limit's usage.
pub const MAX_USAGE_PATHS: usize = 8;
/// A usage path's weight, either way (output tokens counted 4 times,
/// cached ones -1).
pub const MAX_USAGE_WEIGHT: u64 = 1_000;
pub const MAX_JSON_PATH_LEN: usize = 256;
/// Names or indexes in one JSON path (`a.b.c` is 3).
pub const MAX_JSON_PATH_STEPS: usize = 16;
pub const MAX_JSON_MATCHES: usize = 8;
pub const MAX_JSON_ONE_OF: usize = 64;
pub const MAX_PROMPT_PATHS: usize = 8;
pub const MAX_PRICED_MODELS: usize = 1024;
pub const MAX_WARN_LINES: usize = 4;
pub const MAX_MODEL_NAME: usize = 128;
/// Per million tokens, in units of the currency.
pub const MAX_PRICE_PER_MILLION: u64 = 100_000;
/// What one MCP tool call may cost, in units of the currency.
pub const MAX_PRICE_PER_CALL: u64 = 10_000;
pub const MIN_CHARS_PER_TOKEN: f64 = 0.25;
pub const MAX_CHARS_PER_TOKEN: f64 = 64.0;
pub const MAX_USAGE_BODY_BYTES: u32 = 16 * 1024 * 1024;
pub const MIN_MAX_PAUSE_MS: u64 = 1;
pub const MAX_PAUSE_ON: usize = 8;
