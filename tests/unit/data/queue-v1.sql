-- A queue database written by volutectl 0.1.0 (schema 1, before user_version), as
-- sqlite3's iterdump prints it: the starting point of tests/unit/test_migrations.py.
BEGIN TRANSACTION;
CREATE TABLE deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    mind TEXT NOT NULL,
    session TEXT NOT NULL,
    message BLOB NOT NULL,
    interrupt INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'pending',   -- pending, running, done, dead, dropped
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before REAL,                         -- backoff after a failure
    created_at REAL NOT NULL,
    held_since REAL,                         -- set while the gate holds the row
    hold_reason TEXT,
    held_ms INTEGER NOT NULL DEFAULT 0,      -- total time held, over all holds
    turn_id INTEGER,                         -- the turn carrying it (running) or that ran it
    folded INTEGER NOT NULL DEFAULT 0,       -- handed to a live turn's inbox
    last_error TEXT,
    finished_at REAL
);
INSERT INTO "deliveries" VALUES(1,'mimsy','chat',X'68656C6C6F2031',0,'pending',2,1700000100.0,1700000000.0,NULL,NULL,0,NULL,0,NULL,NULL);
INSERT INTO "deliveries" VALUES(2,'mimsy','chat',X'68656C6C6F2032',0,'pending',0,NULL,1700000000.0,NULL,NULL,0,NULL,0,NULL,NULL);
INSERT INTO "deliveries" VALUES(3,'whorl','main',X'686561727462656174',0,'running',0,NULL,1700000000.0,NULL,NULL,0,4,0,NULL,NULL);
INSERT INTO "deliveries" VALUES(4,'pip','dm',X'73746F702074686174',1,'running',0,NULL,1700000000.0,NULL,NULL,0,3,0,NULL,NULL);
INSERT INTO "deliveries" VALUES(5,'pip','dm',X'6D6F7265',0,'running',0,NULL,1700000000.0,NULL,NULL,0,3,1,NULL,NULL);
INSERT INTO "deliveries" VALUES(6,'mimsy','chat',X'646F6E65206F6E65',0,'done',0,NULL,1700000000.0,NULL,NULL,0,1,0,NULL,1700000002.0);
INSERT INTO "deliveries" VALUES(7,'whorl','main',X'77696C6C20646965',0,'dead',10,NULL,1700000000.0,NULL,NULL,0,2,0,'turn exited 1',1700000004.0);
INSERT INTO "deliveries" VALUES(8,'pip','x',X'64726F70706564',0,'dropped',0,NULL,1700000000.0,NULL,NULL,0,NULL,0,NULL,1700000005.0);
INSERT INTO "deliveries" VALUES(9,'mimsy','dm',X'68656C64206F6E65',0,'pending',0,NULL,1700000000.0,1700000009.0,'mind_busy',0,NULL,0,NULL,NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    mind TEXT NOT NULL,
    session TEXT NOT NULL,
    unit TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL DEFAULT 'starting',  -- starting, running, ended
    released INTEGER NOT NULL DEFAULT 0,     -- the command was allowed to exec
    started_at REAL NOT NULL,
    ended_at REAL,
    outcome TEXT,                            -- ok, failed, never_ran, start_failed
    exit_status INTEGER,
    detail TEXT
);
INSERT INTO "turns" VALUES(1,'mimsy','chat','volute-turn-mimsy-1.scope','ended',1,1700000001.0,1700000002.0,'ok',0,'exited 0');
INSERT INTO "turns" VALUES(2,'whorl','main','volute-turn-whorl-2.scope','ended',1,1700000003.0,1700000004.0,'failed',1,'exited 1');
INSERT INTO "turns" VALUES(3,'pip','dm','volute-turn-pip-3.scope','running',1,1700000006.0,NULL,NULL,NULL,NULL);
INSERT INTO "turns" VALUES(4,'whorl','main','volute-turn-whorl-4.scope','starting',0,1700000008.0,NULL,NULL,NULL,NULL);
CREATE INDEX deliveries_open ON deliveries(state, id);
CREATE INDEX deliveries_turn ON deliveries(turn_id);
CREATE INDEX turns_open ON turns(state);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('deliveries',9);
INSERT INTO "sqlite_sequence" VALUES('turns',4);
COMMIT;
