//! One Redis key changed by read, compute, compare-and-set: what several
//! admin replicas sharing Redis change together (fleet ledgers, relayed
//! provider news) is never overwritten by a replica that read it before
//! another wrote it.

use redis::aio::ConnectionManager;

/// Sets ARGV[2] (expiring after ARGV[3] ms) if the value is still ARGV[1]
/// ("" for none).
const COMPARE_AND_SET: &str = r#"
local current = redis.call('GET', KEYS[1])
if current == false then current = '' end
if current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// Reads `key` and stores what `change` makes of its value ("" for none):
/// `change` returns what the caller wants back, the new value and how
/// long it is kept (ms). When another replica wrote the key in between,
/// it reads and tries again, at most `tries` times. None: every try lost
/// the race.
pub async fn update<T, E>(
    connection: &ConnectionManager,
    key: &str,
    tries: u32,
    mut change: impl FnMut(&str) -> Result<(T, String, u64), E>,
) -> Result<Option<T>, E>
where
    E: From<redis::RedisError>,
{
    let script = redis::Script::new(COMPARE_AND_SET);
    let mut connection = connection.clone();
    for _ in 0..tries {
        let raw: Option<String> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut connection)
            .await?;
        let raw = raw.unwrap_or_default();
        let (answer, new, keep_ms) = change(&raw)?;
        let stored: i64 = script
            .key(key)
            .arg(&raw)
            .arg(&new)
            .arg(keep_ms)
            .invoke_async(&mut connection)
            .await?;
        if stored == 1 {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}
