//! A prepared statement whose rows are read as the executor produces them.
//!
//! Through SPI's tuple table, each row of a claim would be formed into a tuple (its payload
//! copied once more), kept until the statement ended, and taken apart again by the relay. A
//! statement run here hands each row's columns to the caller straight from the executor's slot,
//! while they are valid, and keeps nothing. It is kept because it saves the relay's main thread
//! time while it drains a backlog, by the measure BENCHMARKS.md gives (`BENCH_ONLY=builds`
//! against a build that reads the rows through SPI's tuple table).

use std::ffi::CStr;
use std::ptr::NonNull;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::pg::compat;

/// A statement prepared once and kept, like pgrx's `OwnedPreparedStatement`, but run with a
/// receiver of our own.
pub struct Plan {
    plan: NonNull<pg_sys::_SPI_plan>,
    /// The types the statement's columns must have, in order.
    columns: &'static [pg_sys::Oid],
}

/// The receiver the executor calls: PostgreSQL's part first, so that a pointer to it is a
/// pointer to the whole.
#[repr(C)]
struct Receiver<'a> {
    dest: pg_sys::DestReceiver,
    columns: &'static [pg_sys::Oid],
    /// What reads the rows: called once per row with its columns' values and nulls.
    row: *mut (dyn FnMut(&[pg_sys::Datum], &[bool]) + 'a),
}

impl Plan {
    /// Prepares `sql` (in the database's encoding; `shown` is how a log line shows it), whose
    /// parameters have the types `args` and whose columns must have the types `columns`, and
    /// keeps it for the life of the worker (or until dropped).
    pub fn prepare(
        sql: &CStr,
        shown: &str,
        args: &[pg_sys::Oid],
        columns: &'static [pg_sys::Oid],
    ) -> Plan {
        let mut args = args.to_vec();
        let plan = Spi::connect(|_| {
            // SAFETY: inside an SPI connection; `sql` and `args` outlive the call, which
            // copies what it keeps. A statement that does not parse raises an ERROR.
            let plan =
                unsafe { pg_sys::SPI_prepare(sql.as_ptr(), args.len() as i32, args.as_mut_ptr()) };
            let Some(plan) = NonNull::new(plan) else {
                error!(
                    "outbox relay: cannot prepare {shown}: SPI code {}",
                    unsafe { pg_sys::SPI_result }
                );
            };
            // SAFETY: a plan just prepared, not yet kept.
            if unsafe { pg_sys::SPI_keepplan(plan.as_ptr()) } != 0 {
                error!("outbox relay: cannot keep the plan of {shown}");
            }
            plan
        });
        Plan { plan, columns }
    }

    /// Runs the statement with `args` (type and value, none null), handing each row to `row`;
    /// returns how many rows it produced.
    pub fn run(
        &self,
        args: &[(pg_sys::Oid, pg_sys::Datum)],
        row: &mut dyn FnMut(&[pg_sys::Datum], &[bool]),
        failed: &str,
    ) -> u64 {
        Spi::connect_mut(|_| {
            // SAFETY: inside an SPI connection, in the worker's transaction. The parameter list
            // is allocated in the current memory context, SPI's for this call, and filled
            // with by-value datums or datums the caller keeps alive; `receiver` outlives the
            // execution, which alone calls it.
            unsafe {
                let params = pg_sys::makeParamList(args.len() as i32);
                let slots = (*params).params.as_mut_slice(args.len());
                for (slot, &(oid, value)) in slots.iter_mut().zip(args) {
                    *slot = pg_sys::ParamExternData {
                        value,
                        isnull: false,
                        pflags: pg_sys::PARAM_FLAG_CONST as u16,
                        ptype: oid,
                    };
                }
                let mut receiver = Receiver {
                    dest: pg_sys::DestReceiver {
                        receiveSlot: Some(receive_slot),
                        rStartup: Some(startup),
                        rShutdown: Some(nothing),
                        rDestroy: Some(nothing),
                        // Neither `DestNone` (SPI would report a discarded result) nor
                        // `DestSPI` (SPI would look for its tuple table).
                        mydest: pg_sys::CommandDest::DestTuplestore,
                    },
                    columns: self.columns,
                    row,
                };
                let options = pg_sys::SPIExecuteOptions {
                    params,
                    read_only: false,
                    allow_nonatomic: false,
                    must_return_tuples: false,
                    tcount: 0,
                    // From the whole receiver, which the callbacks read through it.
                    dest: (&raw mut receiver).cast(),
                    owner: std::ptr::null_mut(),
                };
                let code = pg_sys::SPI_execute_plan_extended(self.plan.as_ptr(), &options);
                if code != pg_sys::SPI_OK_SELECT as i32 {
                    error!("outbox relay: {failed}: SPI code {code}");
                }
                pg_sys::SPI_processed
            }
        })
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: a plan kept by `prepare` and freed once.
        unsafe { pg_sys::SPI_freeplan(self.plan.as_ptr()) };
    }
}

/// Checks the statement's columns before the first row.
#[pg_guard]
unsafe extern "C-unwind" fn startup(
    dest: *mut pg_sys::DestReceiver,
    _operation: std::ffi::c_int,
    typeinfo: pg_sys::TupleDesc,
) {
    // SAFETY: `dest` is the first field of a `Receiver` (see `Plan::run`); `typeinfo` is the
    // executor's descriptor of the rows to come.
    let receiver = unsafe { &*(dest as *const Receiver) };
    let types = unsafe { compat::attributes(typeinfo) }
        .iter()
        .map(|attribute| attribute.atttypid);
    if !types.eq(receiver.columns.iter().copied()) {
        error!("outbox relay: the claim's columns are not of the expected types");
    }
}

/// Hands one row's columns to the caller.
#[pg_guard]
unsafe extern "C-unwind" fn receive_slot(
    slot: *mut pg_sys::TupleTableSlot,
    dest: *mut pg_sys::DestReceiver,
) -> bool {
    // SAFETY: as in `startup`; `slot` holds a row of the descriptor `startup` checked, whose
    // values stay valid until this call returns.
    unsafe {
        let receiver = &mut *(dest as *mut Receiver);
        let count = receiver.columns.len();
        if ((*slot).tts_nvalid as usize) < count {
            pg_sys::slot_getsomeattrs_int(slot, count as i32);
        }
        let values = std::slice::from_raw_parts((*slot).tts_values, count);
        let nulls = std::slice::from_raw_parts((*slot).tts_isnull, count);
        (*receiver.row)(values, nulls);
    }
    true
}

#[pg_guard]
unsafe extern "C-unwind" fn nothing(_dest: *mut pg_sys::DestReceiver) {}
