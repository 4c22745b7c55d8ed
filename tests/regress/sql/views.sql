-- What an operator reads: outbox_status, outbox_metrics, outbox_blocked and outbox_workers on a
-- server without a relay (outbox.workers = 0); who may read them; outbox_redrive and
-- outbox_redrive_all putting dead letters back; and the count of sessions listening on
-- outbox.notify_channel, which decides whether a commit that enqueued notifies.
CREATE EXTENSION outbox;
\set SHOW_CONTEXT never

-- Empty: nothing pending, no age, nobody listening.
SELECT pending, oldest_pending_age, dead, last_published_at, workers_running, workers_wanted,
       notify_listeners
FROM outbox_status;
SELECT database = current_database() AS this_database, pending, oldest_pending_seconds, dead,
       published_total, failed_total, dead_lettered_total, last_published_seconds,
       workers_running, workers_wanted
FROM outbox_metrics;
SELECT count(*) AS slots_in_use FROM outbox_workers WHERE pid IS NOT NULL;

-- Two events due and one delayed are pending; the oldest's age is its transaction's.
SELECT outbox_enqueue('status.t', '{"n": 1}', 'k') > 0 AS enqueued;
SELECT outbox_enqueue('status.t', '{"n": 2}', 'k') > 0 AS enqueued;
SELECT outbox_enqueue('status.t', '{"n": 3}', deliver_after => '1 hour') > 0 AS enqueued;
SELECT pending, oldest_pending_age >= '0'::interval AS aged, dead FROM outbox_status;
SELECT pending, oldest_pending_seconds >= 0 AS aged FROM outbox_metrics;

-- A rejected event shows in outbox_blocked with its key and error.
UPDATE outbox SET attempts = 2, last_error = 'WRONGTYPE', next_attempt_at = now() + '1 minute'
WHERE payload = '{"n": 1}';
SELECT topic, key, attempts, last_error, next_attempt_at > now() AS later FROM outbox_blocked;

-- Dead letters: counted, and put back by id (0 attempts, the error kept) or all at once.
INSERT INTO outbox_dead (id, topic, payload, created_at, attempts, last_error, key)
VALUES (900001, 'status.dead', '{"n": 4}', now(), 10, 'OOM', 'k4'),
       (900002, 'status.dead', '{"n": 5}', now(), 10, 'OOM', NULL),
       (900003, 'status.dead', '{"n": 6}', now(), 10, 'OOM', NULL);
SELECT dead FROM outbox_status;
SELECT outbox_redrive(900001) AS redriven;
SELECT outbox_redrive(900001) AS redriven_again;
SELECT id, topic, key, attempts, last_error, published_at FROM outbox WHERE id = 900001;
SELECT outbox_redrive_all() AS redriven_all;
SELECT outbox_redrive_all() AS redriven_all_again;
SELECT pending, dead FROM outbox_status;

-- Sessions listening on the channel, counted from their transaction's commit; UNLISTEN,
-- UNLISTEN *, DISCARD ALL and a rolled-back LISTEN take theirs back, and a LISTEN run by
-- PL/pgSQL's EXECUTE counts. Another channel counts apart.
SHOW outbox.notify_channel;
LISTEN outbox;
SELECT notify_listeners FROM outbox_status;
UNLISTEN outbox;
SELECT notify_listeners FROM outbox_status;
BEGIN;
LISTEN outbox;
SELECT notify_listeners AS before_commit FROM outbox_status;
ROLLBACK;
SELECT notify_listeners AS rolled_back FROM outbox_status;
DO $$ BEGIN EXECUTE 'LISTEN outbox'; END $$;
SELECT notify_listeners AS by_execute FROM outbox_status;
UNLISTEN *;
SELECT notify_listeners AS unlisten_all FROM outbox_status;
LISTEN outbox;
LISTEN other_channel;
SELECT notify_listeners, _outbox_notify_listeners('other_channel') AS other FROM outbox_status;
DISCARD ALL;
SELECT notify_listeners, _outbox_notify_listeners('other_channel') AS other FROM outbox_status;
-- A channel set by SET is looked up by name; an empty one turns notifications off.
LISTEN renamed;
SET outbox.notify_channel = 'renamed';
SELECT notify_listeners FROM outbox_status;
SET outbox.notify_channel = '';
SELECT notify_listeners FROM outbox_status;
RESET outbox.notify_channel;
UNLISTEN *;

-- A monitoring role reads the views it is granted, and neither the events nor outbox_blocked
-- (which shows topics and keys) without a grant of its own.
CREATE ROLE regress_outbox_monitor;
GRANT SELECT ON outbox_status, outbox_metrics, outbox_workers TO regress_outbox_monitor;
SET ROLE regress_outbox_monitor;
SELECT pending FROM outbox_status;
SELECT pending FROM outbox_metrics;
SELECT count(*) >= 0 AS readable FROM outbox_workers;
SELECT count(*) FROM outbox_blocked;
\echo SQLSTATE :SQLSTATE
SELECT count(*) FROM outbox;
\echo SQLSTATE :SQLSTATE
SELECT outbox_redrive_all();
\echo SQLSTATE :SQLSTATE
RESET ROLE;

DROP EXTENSION outbox;
DROP ROLE regress_outbox_monitor;
