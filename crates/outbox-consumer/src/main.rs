//! outbox-consumer: reads the outbox's Redis streams through a consumer group and applies each
//! event exactly once to a PostgreSQL store. A reference meant to be copied into a service.
//!
//! The order of the steps is what makes it safe to kill at any moment (SIGKILL included):
//!
//! 1. read entries (`XREADGROUP`): Redis records them as pending at this consumer;
//! 2. apply them and remember their identities, in one PostgreSQL transaction (store.rs);
//! 3. acknowledge them (`XACK`, or `XACKDEL` where the server has it): Redis forgets them.
//!
//! Killed before step 2 commits: the store has nothing of the batch, whose entries are still
//! pending and are read again. Killed between 2 and 3: they are read again too, and the inbox
//! says they were applied. So there is no shutdown procedure, and any error ends the process
//! (status 1): run it under something that starts it again (systemd, Kubernetes).
//!
//! Entries stay pending until acknowledged. At start the consumer first finishes its own (those
//! it read under the same `--consumer` name before it stopped), then takes over those left by
//! consumers that are gone (`XAUTOCLAIM`), which it also does every `--claim-every-ms`.

mod args;
mod event;
mod store;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use redis::{Connection, Value};
use store::Entry;

type Error = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|arg| arg == "--help" || arg == "-h") {
        println!("{}", args::USAGE);
        return ExitCode::SUCCESS;
    }
    let config = match args::parse(&argv, |name| std::env::var(name).ok()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("outbox-consumer: {e}\n\n{}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-consumer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: args::Config) -> Result<(), Error> {
    let mut pg = postgres::Client::connect(&config.postgres, postgres::NoTls)
        .map_err(|e| format!("cannot connect to PostgreSQL: {}", store::message(&e)))?;
    store::create_tables(&mut pg)
        .map_err(|e| format!("cannot create the tables: {}", store::message(&e)))?;
    let mut redis = connect_redis(&config)?;
    for stream in &config.streams {
        create_group(&mut redis, stream, &config.group)?;
    }
    let ack = Ack::detect(&mut redis);
    println!(
        "start group={} consumer={} streams={} ack={}",
        config.group,
        config.consumer,
        config.streams.join(","),
        ack.command()
    );
    let mut consumer = Consumer {
        config,
        pg,
        redis,
        ack,
    };

    consumer.finish_own_pending()?;
    consumer.claim_abandoned()?;
    let mut last_claim = Instant::now();
    let mut last_entry = Instant::now();
    loop {
        let mut handled = consumer.read_new()?;
        if last_claim.elapsed() >= consumer.config.claim_every {
            handled += consumer.claim_abandoned()?;
            last_claim = Instant::now();
        }
        if handled > 0 {
            last_entry = Instant::now();
        }
        if let Some(idle) = consumer.config.exit_when_idle {
            if last_entry.elapsed() >= idle && consumer.pending_in_group()? == 0 {
                println!("idle: exiting");
                return Ok(());
            }
        }
    }
}

fn connect_redis(config: &args::Config) -> Result<Connection, Error> {
    let redis = redis::Client::open(config.redis_url.as_str())
        .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(5)))
        .map_err(|e| format!("cannot connect to Redis: {e}"))?;
    // A read waits up to --block-ms for entries; past that and a margin, Redis is unreachable,
    // and ending the process beats waiting forever.
    redis.set_read_timeout(Some(config.block + Duration::from_secs(10)))?;
    Ok(redis)
}

/// Creates the group at the start of the stream (`0`, not `$`), so that a group created after
/// the relay began publishing reads every event still in the stream; `MKSTREAM` creates the
/// stream if the relay has not yet. A group that exists keeps its position.
fn create_group(redis: &mut Connection, stream: &str, group: &str) -> Result<(), Error> {
    let created = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query::<()>(redis);
    match created {
        Err(e) if e.code() != Some("BUSYGROUP") => {
            Err(format!("cannot create group {group} of {stream}: {e}").into())
        }
        _ => Ok(()),
    }
}

/// How entries are acknowledged. Either way the entry leaves the pending list and is not
/// delivered to this group again.
#[derive(Clone, Copy)]
enum Ack {
    /// `XACK`: the entry stays in the stream until `MAXLEN` trims it (`outbox.stream_maxlen`).
    Xack,
    /// `XACKDEL ... ACKED` (Redis 8.2+) also deletes the entry from the stream, but only if
    /// every other group of the stream is done with it: while one has not read it yet, or still
    /// has it pending, the entry stays for that group and this is a plain `XACK`. That group's
    /// own acknowledgement deletes it if it is an `XACKDEL ... ACKED` too; a plain `XACK` leaves
    /// it to `MAXLEN`. With every group acknowledging so, the stream holds only what some group
    /// still needs. (A group created later does not see the deleted entries.)
    Xackdel,
}

impl Ack {
    fn detect(redis: &mut Connection) -> Ack {
        // COMMAND INFO answers nil for a command the server does not have.
        let info = redis::cmd("COMMAND")
            .arg("INFO")
            .arg("XACKDEL")
            .query::<Vec<Value>>(redis);
        match info {
            Ok(info) if matches!(info.first(), Some(Value::Array(_))) => Ack::Xackdel,
            Ok(_) => Ack::Xack,
            Err(e) => {
                eprintln!("outbox-consumer: COMMAND INFO failed ({e}); acknowledging with XACK");
                Ack::Xack
            }
        }
    }

    fn command(self) -> &'static str {
        match self {
            Ack::Xack => "XACK",
            Ack::Xackdel => "XACKDEL",
        }
    }

    fn send(
        self,
        redis: &mut Connection,
        stream: &str,
        group: &str,
        ids: &[&str],
    ) -> redis::RedisResult<()> {
        let mut cmd = redis::cmd(self.command());
        cmd.arg(stream).arg(group);
        if let Ack::Xackdel = self {
            cmd.arg("ACKED").arg("IDS").arg(ids.len());
        }
        // The reply counts (XACK) or lists (XACKDEL) the entries acknowledged: those of a batch
        // taken over meanwhile by another consumer were acknowledged by it, which is fine.
        cmd.arg(ids).query::<Value>(redis).map(drop)
    }
}

struct Consumer {
    config: args::Config,
    pg: postgres::Client,
    redis: Connection,
    ack: Ack,
}

impl Consumer {
    /// Handles the entries this consumer read before it stopped and did not acknowledge. The id
    /// `0` instead of `>` reads the consumer's pending list rather than new entries; each read
    /// goes on after the last entry of the one before, until none is left.
    fn finish_own_pending(&mut self) -> Result<(), Error> {
        let mut after = vec!["0".to_string(); self.config.streams.len()];
        loop {
            let mut read_any = false;
            for (stream, entries) in self.read_group(&after, None)? {
                let position = self.config.streams.iter().position(|s| *s == stream);
                if let (Some(i), Some((last, _))) = (position, entries.last()) {
                    after[i] = last.clone();
                    read_any = true;
                }
                self.handle(&stream, &entries, "pending")?;
            }
            if !read_any {
                return Ok(());
            }
        }
    }

    /// Reads and handles entries no consumer of the group has seen; returns how many.
    fn read_new(&mut self) -> Result<usize, Error> {
        let new = vec![">".to_string(); self.config.streams.len()];
        let mut handled = 0;
        // BLOCK 0 would wait forever and keep the claims below from running.
        let block = self.config.block.max(Duration::from_millis(1));
        for (stream, entries) in self.read_group(&new, Some(block))? {
            handled += entries.len();
            self.handle(&stream, &entries, "new")?;
        }
        Ok(handled)
    }

    /// `XREADGROUP` of every stream, each from its id in `ids`; per stream, up to `--count`
    /// entries.
    fn read_group(
        &mut self,
        ids: &[String],
        block: Option<Duration>,
    ) -> Result<Vec<(String, Vec<Entry>)>, Error> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg("COUNT")
            .arg(self.config.count);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(block.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(&self.config.streams).arg(ids);
        // Nil when BLOCK ran out with nothing new.
        let reply: Option<Vec<(String, Vec<Entry>)>> = cmd.query(&mut self.redis)?;
        Ok(reply.unwrap_or_default())
    }

    /// Takes over and handles the entries pending at any consumer of the group for longer than
    /// `--min-idle-ms`: those of a consumer that died and did not come back under its name.
    /// Those of a consumer that is alive but slower than that are taken too; the inbox still
    /// applies each event once, but set the time well above what a batch takes.
    fn claim_abandoned(&mut self) -> Result<usize, Error> {
        let mut claimed = 0;
        for stream in self.config.streams.clone() {
            let mut cursor = "0-0".to_string();
            loop {
                // The cursor to go on from ("0-0" at the end), the entries now pending at this
                // consumer, and (Redis 7.0+; 6.2 sends only the first two) the ids of pending
                // entries deleted from the stream, which Redis has dropped from the pending list.
                let reply: Vec<Value> = redis::cmd("XAUTOCLAIM")
                    .arg(&stream)
                    .arg(&self.config.group)
                    .arg(&self.config.consumer)
                    .arg(self.config.min_idle.as_millis() as u64)
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(self.config.count)
                    .query(&mut self.redis)?;
                let mut parts = reply.into_iter();
                let (Some(next), Some(entries)) = (parts.next(), parts.next()) else {
                    return Err("XAUTOCLAIM answered fewer than two parts".into());
                };
                let next: String = redis::from_redis_value(next)?;
                // Redis 6.2 answers nil for an entry deleted while it was pending, and keeps
                // it pending: those are looked up and acknowledged below, as 7.0 drops them.
                let replies: Vec<Value> = redis::from_redis_value(entries)?;
                let vanished = replies.iter().any(|reply| matches!(reply, Value::Nil));
                let entries: Vec<Entry> = replies
                    .into_iter()
                    .filter(|reply| !matches!(reply, Value::Nil))
                    .map(redis::from_redis_value)
                    .collect::<Result<_, _>>()?;
                let mut deleted: Vec<String> = match parts.next() {
                    Some(deleted) => redis::from_redis_value(deleted)?,
                    None => Vec::new(),
                };
                if vanished {
                    deleted.extend(self.acknowledge_deleted(&stream)?);
                }
                if !deleted.is_empty() {
                    eprintln!(
                        "outbox-consumer: {stream}: entries deleted before they were applied: {}",
                        deleted.join(" ")
                    );
                }
                claimed += entries.len();
                self.handle(&stream, &entries, "claimed")?;
                if next == "0-0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(claimed)
    }

    /// Acknowledges the entries pending in the group whose entry is gone from `stream` (Redis
    /// 6.2 keeps them pending, and `XAUTOCLAIM` answers nil for them, without their ids);
    /// returns their ids. It reads the whole pending list, `--count` at a time, and looks each
    /// entry up: work done only once such a nil was seen.
    fn acknowledge_deleted(&mut self, stream: &str) -> Result<Vec<String>, Error> {
        type Pending = Vec<(String, String, u64, u64)>;
        let mut gone = Vec::new();
        let mut start = "-".to_string();
        loop {
            let page: Pending = redis::cmd("XPENDING")
                .arg(stream)
                .arg(&self.config.group)
                .arg(&start)
                .arg("+")
                .arg(self.config.count)
                .query(&mut self.redis)?;
            let Some((last, ..)) = page.last() else {
                break;
            };
            start = format!("({last}");
            let mut lookups = redis::pipe();
            for (id, ..) in &page {
                lookups.cmd("XRANGE").arg(stream).arg(id).arg(id);
            }
            let found: Vec<Vec<Entry>> = lookups.query(&mut self.redis)?;
            for ((id, ..), entries) in page.iter().zip(found) {
                if entries.is_empty() {
                    gone.push(id.clone());
                }
            }
            if (page.len() as u64) < self.config.count {
                break;
            }
        }
        if !gone.is_empty() {
            redis::cmd("XACK")
                .arg(stream)
                .arg(&self.config.group)
                .arg(&gone)
                .query::<Value>(&mut self.redis)?;
        }
        Ok(gone)
    }

    /// Applies a batch of one stream, then acknowledges it. Only after the commit: an entry that
    /// Redis forgot before its effect was durable would be lost by a crash in between.
    fn handle(&mut self, stream: &str, entries: &[Entry], source: &str) -> Result<(), Error> {
        if entries.is_empty() {
            return Ok(());
        }
        let tally = store::apply_batch(&mut self.pg, stream, entries)
            .map_err(|e| format!("cannot apply a batch of {stream}: {}", store::message(&e)))?;
        let ids: Vec<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
        self.ack
            .send(&mut self.redis, stream, &self.config.group, &ids)
            .map_err(|e| format!("cannot acknowledge a batch of {stream}: {e}"))?;
        if tally.dead > 0 {
            eprintln!(
                "outbox-consumer: {stream}: {} entries are not events this consumer can apply; \
                 see outbox_consumer_dead",
                tally.dead
            );
        }
        if tally.trimmed > 0 {
            eprintln!(
                "outbox-consumer: {stream}: {} entries were deleted from the stream before they \
                 were applied (outbox.stream_maxlen too low?)",
                tally.trimmed
            );
        }
        println!(
            "batch stream={stream} source={source} entries={} applied={} duplicates={} dead={} \
             trimmed={}",
            entries.len(),
            tally.applied,
            tally.duplicates,
            tally.dead,
            tally.trimmed
        );
        Ok(())
    }

    /// Entries pending in the whole group, at any consumer.
    fn pending_in_group(&mut self) -> Result<u64, Error> {
        let mut total = 0;
        for stream in &self.config.streams {
            // The summary form: count, lowest id, highest id, count per consumer.
            let (count, ..): (u64, Value, Value, Value) = redis::cmd("XPENDING")
                .arg(stream)
                .arg(&self.config.group)
                .query(&mut self.redis)?;
            total += count;
        }
        Ok(total)
    }
}
