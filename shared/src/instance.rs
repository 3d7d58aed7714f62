//! An Envoy's instance name, as its plugin configuration, its reports and
//! the admin accept it.

/// The longest instance name.
pub const MAX_INSTANCE_LEN: usize = 128;

/// Checks an instance name: 1 to [`MAX_INSTANCE_LEN`] ASCII letters,
/// digits, `-`, `_`, `.` or `:` (a host name, a pod name, `host:port`).
/// The admin shows it, labels metrics and keys Redis with it, so nothing
/// else is let in.
pub fn check_instance(instance: &str) -> Result<(), String> {
    if instance.is_empty() || instance.len() > MAX_INSTANCE_LEN {
        return Err(format!("must be 1 to {MAX_INSTANCE_LEN} characters"));
    }
    if let Some(bad) = instance
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(format!(
            "{bad:?} is not allowed: only letters, digits, '-', '_', '.' and ':'"
        ));
    }
    Ok(())
}
