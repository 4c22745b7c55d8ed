-- Every released version, updated with ALTER EXTENSION outbox UPDATE, ends with the objects a
-- fresh CREATE EXTENSION makes: the same tables and columns, partitions, indexes, constraints,
-- triggers, views, functions, operator classes, privileges and comments. Each version's
-- difference from the fresh install is listed: none is expected.
\set SHOW_CONTEXT never
SET client_min_messages = warning;
CREATE EXTENSION outbox;
CREATE SCHEMA regress_upgrade;
-- One line per member object of the extension, and per column, index, constraint and trigger
-- of its tables, without the OIDs that differ from one install to the next.
CREATE FUNCTION regress_upgrade.objects() RETURNS SETOF text LANGUAGE sql AS $$
  WITH members AS (
    SELECT d.classid, d.objid
    FROM pg_depend d JOIN pg_extension e ON d.refobjid = e.oid
    WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' AND e.extname = 'outbox'
  ), relations AS (
    SELECT c.oid, c.relname FROM members m JOIN pg_class c ON m.objid = c.oid
    WHERE m.classid = 'pg_class'::regclass
  )
  SELECT 'member ' || pg_describe_object(classid, objid, 0) FROM members
  UNION ALL
  SELECT 'function ' || p.oid::regprocedure::text || ' ' || pg_get_functiondef(p.oid)
         || ' acl ' || coalesce(p.proacl::text, 'default')
  FROM members m JOIN pg_proc p ON m.objid = p.oid WHERE m.classid = 'pg_proc'::regclass
  UNION ALL
  SELECT format('relation %s kind %s persistence %s options %s acl %s partition %s of %s by %s',
                c.relname, c.relkind, c.relpersistence, c.reloptions,
                coalesce(c.relacl::text, 'default'), pg_get_expr(c.relpartbound, c.oid),
                (SELECT i.inhparent::regclass::text FROM pg_inherits i WHERE i.inhrelid = c.oid),
                CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END)
  FROM relations r JOIN pg_class c ON c.oid = r.oid
  UNION ALL
  SELECT format('column %s.%s %s not null %s default %s identity %s generated %s acl %s',
                r.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                pg_get_expr(ad.adbin, ad.adrelid), a.attidentity, a.attgenerated,
                coalesce(a.attacl::text, 'default'))
  FROM relations r JOIN pg_attribute a ON a.attrelid = r.oid
  LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
  WHERE a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT format('index %s on %s', pg_get_indexdef(i.indexrelid), r.relname)
  FROM relations r JOIN pg_index i ON i.indrelid = r.oid
  UNION ALL
  SELECT format('constraint %s on %s %s', co.conname, r.relname, pg_get_constraintdef(co.oid))
  FROM relations r JOIN pg_constraint co ON co.conrelid = r.oid
  UNION ALL
  SELECT format('trigger %s', pg_get_triggerdef(t.oid))
  FROM relations r JOIN pg_trigger t ON t.tgrelid = r.oid WHERE NOT t.tgisinternal
  UNION ALL
  SELECT format('view %s %s', r.relname, pg_get_viewdef(r.oid))
  FROM relations r JOIN pg_class c ON c.oid = r.oid WHERE c.relkind = 'v'
  UNION ALL
  SELECT format('sequence %s %s %s %s %s', r.relname, s.seqtypid::regtype, s.seqincrement,
                s.seqmin, s.seqcycle)
  FROM relations r JOIN pg_sequence s ON s.seqrelid = r.oid
  UNION ALL
  SELECT format('comment %s %s', pg_describe_object(m.classid, m.objid, 0), obj_description(m.objid))
  FROM members m WHERE obj_description(m.objid) IS NOT NULL
$$;
CREATE TABLE regress_upgrade.fresh AS SELECT * FROM regress_upgrade.objects() AS line;
SELECT count(*) > 50 AS described FROM regress_upgrade.fresh;

-- The lines of an updated install that differ from the fresh one's, each way.
CREATE FUNCTION regress_upgrade.differences(version text) RETURNS TABLE (side text, line text)
LANGUAGE plpgsql AS $$
BEGIN
  DROP EXTENSION outbox CASCADE;
  EXECUTE format('CREATE EXTENSION outbox VERSION %L', version);
  ALTER EXTENSION outbox UPDATE;
  RETURN QUERY
    (SELECT 'updated only', o FROM regress_upgrade.objects() o
     EXCEPT SELECT 'updated only', f.line FROM regress_upgrade.fresh f)
    UNION ALL
    (SELECT 'fresh only', f.line FROM regress_upgrade.fresh f
     EXCEPT SELECT 'fresh only', o FROM regress_upgrade.objects() o);
END
$$;
SELECT v.version, d.side, d.line
FROM unnest(ARRAY['0.1.0', '0.2.0', '0.3.0', '0.4.0', '0.5.0', '0.6.0', '0.7.0', '0.8.0']) AS v(version),
     LATERAL regress_upgrade.differences(v.version) d
ORDER BY 1, 2, 3;
SELECT extversion FROM pg_extension WHERE extname = 'outbox';
DROP SCHEMA regress_upgrade CASCADE;
DROP EXTENSION outbox;
