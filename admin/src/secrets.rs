//! Whether the secrets the admin starts with are secrets: the shipped
//! manifests carry placeholders (`replace-...`) that must never reach a
//! running admin, and a sync token short enough to guess would let anyone
//! on the network speak for an Envoy (report, claim shares, pause the
//! fleet through provider news).

/// The fewest bytes a sync token may have (`openssl rand -hex 32` gives
/// 64).
pub const MIN_SYNC_TOKEN_BYTES: usize = 32;

/// What the manifests' placeholders begin with.
const PLACEHOLDER: &str = "replace-";

/// A secret the admin was given: its environment variable, its flag,
/// and its value.
pub struct Given<'a> {
    pub variable: &'static str,
    pub flag: &'static str,
    pub value: &'a str,
}

/// Why the admin refuses to start with `given` (None: it may), naming the
/// variable and never the value. `min_len`: the fewest bytes it may have.
pub fn refusal(given: &Given<'_>, min_len: usize) -> Option<String> {
    let Given {
        variable,
        flag,
        value,
    } = given;
    if value.trim_start().starts_with(PLACEHOLDER) {
        return Some(format!(
            "{variable} ({flag}) is still a placeholder of the shipped manifests ({PLACEHOLDER}...): \
             set a secret of your own (openssl rand -hex 32)"
        ));
    }
    if value.len() < min_len {
        return Some(format!(
            "{variable} ({flag}) is {} bytes long: at least {min_len} (openssl rand -hex 32 gives 64)",
            value.len()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(value: &str) -> Given<'_> {
        Given {
            variable: "SLUICE_SYNC_TOKEN",
            flag: "--sync-token",
            value,
        }
    }

    #[test]
    fn placeholders_and_short_tokens_are_refused_naming_the_variable_not_the_value() {
        let placeholder = refusal(&given("replace-with-openssl-rand-hex-32"), 32);
        let placeholder = placeholder.unwrap_or_default();
        assert!(placeholder.starts_with("SLUICE_SYNC_TOKEN (--sync-token) is still a placeholder"));
        assert!(!placeholder.contains("with-openssl"));
        let short = refusal(&given("e2e-token"), 32).unwrap_or_default();
        assert_eq!(
            short,
            "SLUICE_SYNC_TOKEN (--sync-token) is 9 bytes long: at least 32 (openssl rand -hex 32 gives 64)"
        );
        assert_eq!(refusal(&given(&"a".repeat(32)), 32), None);
        assert_eq!(refusal(&given("short password"), 0), None);
        assert!(refusal(&given("replace-me"), 0).is_some());
    }
}
