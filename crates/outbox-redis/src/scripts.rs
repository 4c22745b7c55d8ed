//! The Lua scripts the relay publishes through (one call per stream and chunk: with markers, or
//! with IDMP or no dedupe), and how a call names them: by SHA1 on a connection that has loaded them
//! (`EVALSHA`), or whole (`EVAL`) on a cluster, whose nodes may not have loaded them and whose
//! pipelines take no `EVALSHA`.

use std::sync::OnceLock;

use redis::Cmd;

use crate::resp::Args;

/// The markers' script (`outbox.dedupe` with markers); see the file.
pub const DEDUPE: &str = include_str!("dedupe.lua");
/// The script that adds a stream's events with IDMP or without dedupe; see the file.
pub const ADD: &str = include_str!("add.lua");

/// How a script is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptCall {
    BySha,
    Whole,
}

/// A script, with its SHA1 and the compact form a cluster is sent with every call.
pub struct Script {
    source: &'static str,
    sha: OnceLock<String>,
    compact: OnceLock<String>,
}

pub static DEDUPE_SCRIPT: Script = Script::new(DEDUPE);
pub static ADD_SCRIPT: Script = Script::new(ADD);

impl Script {
    const fn new(source: &'static str) -> Script {
        Script {
            source,
            sha: OnceLock::new(),
            compact: OnceLock::new(),
        }
    }

    fn sha(&self) -> &str {
        self.sha
            .get_or_init(|| redis::Script::new(self.source).get_hash().to_string())
    }

    /// Without comment lines and indentation: half the bytes.
    fn compact(&self) -> &str {
        self.compact.get_or_init(|| {
            self.source
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty() && !line.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        })
    }

    /// The start of a call, written into a command being built: `EVALSHA <sha>` or `EVAL
    /// <source>`.
    pub fn write_call(&self, how: ScriptCall, args: &mut Args<'_>) {
        match how {
            ScriptCall::BySha => args.arg("EVALSHA").arg(self.sha()),
            ScriptCall::Whole => args.arg("EVAL").arg(self.compact()),
        };
    }

    /// The start of a call: `EVALSHA <sha>` or `EVAL <source>`.
    pub fn call(&self, how: ScriptCall) -> Cmd {
        match how {
            ScriptCall::BySha => {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(self.sha());
                cmd
            }
            ScriptCall::Whole => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(self.compact());
                cmd
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_names_the_script_by_its_sha_or_sends_it_compact() {
        let by_sha = DEDUPE_SCRIPT.call(ScriptCall::BySha);
        let args: Vec<_> = by_sha.args_iter().collect();
        assert_eq!(args.len(), 2);
        assert_eq!(DEDUPE_SCRIPT.sha().len(), 40);
        let compact = DEDUPE_SCRIPT.compact();
        assert!(compact.len() < DEDUPE.len() / 2 + DEDUPE.len() / 4);
        assert!(!compact.lines().any(|l| l.starts_with("--")));
    }
}
