//! A pass's claims: where each starts (past the cursor, or from the lowest id), what it reaches,
//! whether it looks for due events, and the rows it finds behind a failed or held key held at
//! once.

use std::time::{Duration, Instant};

use pgrx::pg_sys;

use super::cursor::{self, Reach, Verdict};
use super::memory::Claims;
use super::retry::DueLook;
use super::rows::Claimed;
use super::scope::{hold_groups, Scope};
use crate::model::lane;
use crate::relay::statements::Statements;
use crate::shmem::EnqueueActivity;

/// What a pass's claims borrow of the relay.
pub struct Claimer<'a> {
    pub index: usize,
    pub statements: &'a Statements,
    pub claims: &'a mut Claims,
    pub activity: &'static EnqueueActivity,
    pub poll_interval: Duration,
}

impl Claimer<'_> {
    /// What this pass may claim: the lanes of the worker's share, once it holds their groups'
    /// locks (`None` while another worker still does), and whether an event in them has failed
    /// (looked up as [`super::retry::FailingLook`] says).
    pub fn scope(&mut self) -> Option<Scope> {
        let (ordinal, workers) = ordinal(self.index);
        let share = lane::share(ordinal, workers);
        if self.claims.lanes.as_ref() != Some(&share.lanes) {
            // Another worker may have had these lanes meanwhile, and left events anywhere.
            self.claims.start.forget();
            self.claims.lanes = Some(share.lanes.clone());
        }
        if !hold_groups(share.groups.clone()) {
            return None;
        }
        let now = Instant::now();
        if self.claims.failing.stale(&share.lanes, now) {
            let failing = self.statements.any_failing(&share.lanes);
            self.claims.failing.looked(&share.lanes, now, failing);
        }
        Some(Scope {
            lanes: share.lanes,
            failing: self.claims.failing.failing(),
        })
    }

    /// The claim of a batch's next chunk, of `claimed` so far out of `batch_size`: after a full
    /// chunk (`got` events of `chunk`), while the batch has room and no claim read its fill of
    /// bytes; else nothing, which ends the pass's claims.
    pub fn next(
        &mut self,
        (got, chunk): (usize, usize),
        claimed: usize,
        batch_size: usize,
        full_of_bytes: bool,
        scope: &Scope,
    ) -> Claimed {
        if got == chunk && claimed < batch_size && !full_of_bytes {
            self.claim(chunk.min(batch_size - claimed), scope)
        } else {
            Claimed::default()
        }
    }

    /// Claims up to `limit` events of `scope`, past the last claim's reach while no transaction
    /// enqueued since (see `cursor.rs`), else from the lowest id, and holds the rows it found
    /// behind an earlier event of their key that failed or is held (see `hold.rs`). Held at
    /// once, before any reply of this pass can release their key: a row held after its key's
    /// release would wait for the look that finds it alone.
    pub fn claim(&mut self, limit: usize, scope: &Scope) -> Claimed {
        let now = Instant::now();
        let claimed = self.claim_at(now, limit, scope);
        if claimed.looked_due {
            self.claims.due_looked_at = Some(now);
        }
        if !claimed.blocked.is_empty() {
            self.statements.hold(&claimed.blocked);
        }
        claimed
    }

    /// [`Claimer::claim`], at `now`.
    fn claim_at(&mut self, now: Instant, limit: usize, scope: &Scope) -> Claimed {
        let statements = self.statements;
        // Before the claim: what commits after it wrote is looked for again.
        let commits = self.activity.commits_to();
        let quiet = self.activity.quiet();
        let above = self.claims.start.above(quiet, &scope.lanes);
        let below = self.claims.start.below_due(now, self.poll_interval);
        // From the lowest id: in every partition once per poll interval, while an event failed
        // (the claim that passes by its key's later events reads them all), and where a
        // `COMMIT PREPARED` may make events visible that no commit counted.
        let reach = if below || scope.failing || self.claims.two_phase {
            Reach::Everywhere
        } else {
            self.claims.start.reach(&commits, &scope.lanes)
        };
        let due = DueLook::at(
            now,
            self.claims.due_looked_at,
            self.poll_interval,
            scope.failing,
        );
        let claimed = statements.claim(limit, above, below, reach, due, scope);
        if !claimed.looked_fresh {
            // Due events filled it: it read nothing of the fresh events' partitions, and says
            // nothing of where their next claim starts.
            return claimed;
        }
        if let Reach::Leaf(leaf) = reach {
            // Its snapshot was taken after the counts were read: a commit counted since in
            // another partition may be visible to it, and hold an earlier event of a key whose
            // later one it took. Claimed again from every partition, this transaction's rows
            // with the rest.
            if cursor::moved_elsewhere(&commits, &self.activity.commits_to(), leaf) {
                self.claims.start.forget();
                return statements.claim(limit, None, false, Reach::Everywhere, due, scope);
            }
        }
        if (above.is_none() && reach == Reach::Everywhere) || (below && claimed.len() < limit) {
            self.claims.start.looked_below(now);
        }
        // A claim that passed by the events behind a failed key found too few only for now:
        // once that key's event is out, they are claimable where no commit has written since.
        if above.is_none() && claimed.len() < limit && !scope.failing {
            self.claims.start.exhausted(reach, &commits, &scope.lanes);
        }
        let verdict = self.claims.start.claimed(
            quiet,
            self.activity.started(),
            above,
            claimed.highest(),
            &scope.lanes,
        );
        match verdict {
            // The rows claimed past the cursor are this transaction's: claimed again with the
            // rest, not skipped.
            Verdict::Redo => statements.claim(limit, None, false, Reach::Everywhere, due, scope),
            Verdict::Keep => claimed,
        }
    }
}

/// This worker's place among its database's workers, and how many they are: what its share
/// of the lanes follows from.
fn ordinal(index: usize) -> (usize, usize) {
    // SAFETY: reads this process's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    match crate::shmem::shared() {
        Some(shared) => shared.ordinal_of(index, database),
        None => (0, 1),
    }
}
