//! The test's own statements: the one value a query returns, and sessions of a database whose
//! defaults (a hostile search_path, read-only transactions, 1 ms timeouts) they do not take.

use std::time::Duration;

use super::{Client, Pg};

/// The one value `sql` returns.
pub fn one<T: for<'a> postgres::types::FromSql<'a>>(client: &mut Client, sql: &str) -> T {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// The first of a query's single `bigint` column.
pub fn count(client: &mut Client, sql: &str) -> i64 {
    one(client, sql)
}

/// Startup options of the test's own sessions: whatever a database's defaults say (a hostile
/// search_path, read-only transactions, 1 ms timeouts), the test's statements run as in a plain
/// session, and find pg_catalog's functions and operators first. Sent at connection start,
/// they apply before the first statement.
pub const SESSION_OPTIONS: &str = "-c search_path=pg_catalog,public \
     -c default_transaction_read_only=off -c default_transaction_isolation=read\\ committed \
     -c statement_timeout=0 -c lock_timeout=0 -c idle_in_transaction_session_timeout=0";

/// A session of the test's in `db`, as `postgres`, with `SESSION_OPTIONS`.
pub fn session(pg: &Pg, db: &str) -> Client {
    pg.connect_with(db, "postgres", SESSION_OPTIONS)
}

/// Runs `sql` on a fresh `session` of `db`, trying again while the server restarts.
pub fn query_in(pg: &Pg, db: &str, sql: &str) -> Vec<postgres::Row> {
    let mut last = None;
    for _ in 0..200 {
        match session(pg, db).query(sql, &[]) {
            Ok(rows) => return rows,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{sql} kept failing in database {db}: {last:?}")
}

/// The one value `sql` returns in `db`, read on a fresh session.
pub fn value_in<T: for<'a> postgres::types::FromSql<'a>>(pg: &Pg, db: &str, sql: &str) -> T {
    query_in(pg, db, sql)[0].get(0)
}

/// The state and last error of the only relay worker, read in `db` (where the extension is).
pub fn worker_state(pg: &Pg, db: &str) -> (String, Option<String>) {
    let rows = query_in(pg, db, "SELECT state, last_error FROM outbox_workers");
    (rows[0].get(0), rows[0].get(1))
}
