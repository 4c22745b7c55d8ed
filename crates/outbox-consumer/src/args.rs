//! The consumer's settings: each from its flag (`--count 100` or `--count=100`), else from its
//! environment variable (`OUTBOX_CONSUMER_COUNT`), else its default.

use std::time::Duration;

pub const USAGE: &str = "\
usage: outbox-consumer --stream <name> [--stream <name>...] [options]

  --redis-url <url>          Redis to read from           [redis://127.0.0.1:6379]
  --stream <name>            stream to read; repeat it or separate names with commas
  --group <name>             consumer group               [outbox-consumer]
  --consumer <name>          this consumer's name; keep it across restarts [$HOSTNAME]
  --postgres <conninfo>      the store: where the inbox and the effects live
                             [host=127.0.0.1 user=postgres dbname=postgres]
  --count <n>                most entries read per stream at a time [100]
  --block-ms <ms>            how long one read waits for new entries [2000]
  --min-idle-ms <ms>         entries pending this long at another consumer are taken
                             over with XAUTOCLAIM [60000]
  --claim-every-ms <ms>      how often to look for such entries [5000]
  --exit-when-idle-ms <ms>   exit once nothing came for this long and nothing is pending
                             in the group (tests, one-off drains); default: run forever

Each flag may be given as an environment variable instead: --block-ms as
OUTBOX_CONSUMER_BLOCK_MS, --stream as OUTBOX_CONSUMER_STREAM, and so on.";

const FLAGS: [&str; 10] = [
    "redis-url",
    "stream",
    "group",
    "consumer",
    "postgres",
    "count",
    "block-ms",
    "min-idle-ms",
    "claim-every-ms",
    "exit-when-idle-ms",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub redis_url: String,
    pub streams: Vec<String>,
    pub group: String,
    pub consumer: String,
    pub postgres: String,
    pub count: u64,
    pub block: Duration,
    pub min_idle: Duration,
    pub claim_every: Duration,
    pub exit_when_idle: Option<Duration>,
}

/// The settings from the command line `args` (without the program name) and the environment,
/// which `env` reads; an error says what is wrong.
pub fn parse(args: &[String], env: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
    let mut given: Vec<(&str, String)> = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let flag = arg
            .strip_prefix("--")
            .ok_or_else(|| format!("unexpected argument {arg:?}"))?;
        let (name, value) = match flag.split_once('=') {
            Some((name, value)) => (name, value.to_string()),
            None => match rest.next() {
                Some(value) => (flag, value.clone()),
                None => return Err(format!("--{flag} needs a value")),
            },
        };
        let name = FLAGS
            .into_iter()
            .find(|known| *known == name)
            .ok_or_else(|| format!("unknown flag --{name}"))?;
        given.push((name, value));
    }
    let value = |name: &str| -> Option<String> {
        let flags: Vec<&str> = given
            .iter()
            .filter(|(flag, _)| *flag == name)
            .map(|(_, value)| value.as_str())
            .collect();
        match flags.as_slice() {
            [] => env(&env_name(name)),
            // Only --stream may be repeated, and each --stream adds to the list.
            _ if name == "stream" => Some(flags.join(",")),
            [.., last] => Some(last.to_string()),
        }
    };
    let text = |name: &str, default: &str| value(name).unwrap_or_else(|| default.to_string());
    let millis = |name: &str, default: u64| -> Result<Duration, String> {
        Ok(Duration::from_millis(number(name, value(name), default)?))
    };

    let streams: Vec<String> = text("stream", "")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if streams.is_empty() {
        return Err("no stream to read: give --stream <name>".into());
    }
    let count = number("count", value("count"), 100)?;
    if count == 0 {
        return Err("--count must be at least 1".into());
    }
    let exit_when_idle = match value("exit-when-idle-ms") {
        Some(_) => Some(millis("exit-when-idle-ms", 0)?),
        None => None,
    };
    Ok(Config {
        redis_url: text("redis-url", "redis://127.0.0.1:6379"),
        streams,
        group: text("group", "outbox-consumer"),
        consumer: value("consumer")
            .or_else(|| env("HOSTNAME"))
            .unwrap_or_else(|| "consumer-1".into()),
        postgres: text("postgres", "host=127.0.0.1 user=postgres dbname=postgres"),
        count,
        block: millis("block-ms", 2_000)?,
        min_idle: millis("min-idle-ms", 60_000)?,
        claim_every: millis("claim-every-ms", 5_000)?,
        exit_when_idle,
    })
}

/// `block-ms` -> `OUTBOX_CONSUMER_BLOCK_MS`.
fn env_name(flag: &str) -> String {
    format!("OUTBOX_CONSUMER_{}", flag.to_uppercase().replace('-', "_"))
}

fn number(name: &str, value: Option<String>, default: u64) -> Result<u64, String> {
    match value {
        None => Ok(default),
        Some(text) => text
            .trim()
            .parse()
            .map_err(|_| format!("--{name} takes a whole number, not {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_args(args: &[&str], env: &[(&str, &str)]) -> Result<Config, String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        parse(&args, |name| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.to_string())
        })
    }

    #[test]
    fn defaults_fill_what_is_not_given() {
        let config = parse_args(&["--stream", "orders"], &[]).unwrap();
        assert_eq!(config.streams, ["orders"]);
        assert_eq!(config.redis_url, "redis://127.0.0.1:6379");
        assert_eq!(config.group, "outbox-consumer");
        assert_eq!(config.consumer, "consumer-1");
        assert_eq!(config.count, 100);
        assert_eq!(config.block, Duration::from_millis(2_000));
        assert_eq!(config.min_idle, Duration::from_secs(60));
        assert_eq!(config.exit_when_idle, None);
    }

    #[test]
    fn streams_add_up_over_flags_and_commas() {
        let config = parse_args(&["--stream", "orders, payments", "--stream=refunds"], &[]);
        assert_eq!(config.unwrap().streams, ["orders", "payments", "refunds"]);
    }

    #[test]
    fn a_flag_wins_over_its_variable_which_wins_over_the_default() {
        let env = [
            ("OUTBOX_CONSUMER_STREAM", "a,b"),
            ("OUTBOX_CONSUMER_BLOCK_MS", "250"),
            ("OUTBOX_CONSUMER_COUNT", "7"),
            ("HOSTNAME", "pod-3"),
        ];
        let config = parse_args(&["--count", "9"], &env).unwrap();
        assert_eq!(config.streams, ["a", "b"]);
        assert_eq!(config.block, Duration::from_millis(250));
        assert_eq!(config.count, 9);
        assert_eq!(config.consumer, "pod-3");
        let config = parse_args(&["--consumer=c1", "--exit-when-idle-ms=0"], &env).unwrap();
        assert_eq!(config.consumer, "c1");
        assert_eq!(config.exit_when_idle, Some(Duration::ZERO));
    }

    #[test]
    fn mistakes_are_named() {
        let err = |args: &[&str]| parse_args(args, &[]).unwrap_err();
        assert_eq!(err(&[]), "no stream to read: give --stream <name>");
        assert_eq!(
            err(&["--stream", " , "]),
            "no stream to read: give --stream <name>"
        );
        assert_eq!(err(&["--stream"]), "--stream needs a value");
        assert_eq!(err(&["orders"]), "unexpected argument \"orders\"");
        assert_eq!(err(&["--streams=a"]), "unknown flag --streams");
        assert_eq!(
            err(&["--stream=a", "--block-ms", "2s"]),
            "--block-ms takes a whole number, not \"2s\""
        );
        assert_eq!(
            err(&["--stream=a", "--count=0"]),
            "--count must be at least 1"
        );
    }
}
