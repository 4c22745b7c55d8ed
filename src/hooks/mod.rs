//! What the extension hooks into every backend of a server that preloads it: the utility hook
//! (`utility.rs`), and what it does before a `DROP DATABASE` or a rename of a database the relay
//! works in (`step_aside.rs`), and the count of sessions listening (`listen.rs`); and into every
//! backend that loads it, the executor-start hook (`executor.rs`).

pub mod executor;
mod listen;
mod step_aside;
pub mod utility;
