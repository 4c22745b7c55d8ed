//! Redis keys the tests set up or look for: a stream key that refuses every `XADD`, and the keys
//! that match a pattern.

use super::Redis;

/// Makes every XADD to `key` fail with WRONGTYPE: the key holds a hash.
pub fn poison(redis: &Redis, key: &str) {
    redis::cmd("HSET")
        .arg(key)
        .arg("f")
        .arg("v")
        .query::<i64>(&mut redis.conn())
        .unwrap();
}

/// Undoes `poison`: `XADD` to `key` works again.
pub fn unpoison(redis: &Redis, key: &str) {
    redis::cmd("DEL")
        .arg(key)
        .query::<i64>(&mut redis.conn())
        .unwrap();
}

/// Redis keys matching `pattern`, as text (bytes that are not UTF-8 replaced).
pub fn keys(redis: &Redis, pattern: &str) -> Vec<String> {
    let raw: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut redis.conn())
        .unwrap();
    raw.iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect()
}
