"""The tables of the shared state, as numbered migrations: each runs once, in order, in one transaction, when a
replica starts (two replicas starting at once take turns on an advisory lock)."""

from __future__ import annotations

__all__ = ["MIGRATIONS"]

MIGRATIONS: tuple[str, ...] = (
    # 1: replicas, keys, workspaces (records and archive chunks), tasks, approval questions, rate windows
    """
    CREATE TABLE replicas (
        owner text PRIMARY KEY,
        started_at timestamptz NOT NULL DEFAULT now(),
        beat_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE keys (
        name text PRIMARY KEY,
        secret bytea NOT NULL
    );
    CREATE TABLE workspaces (
        id text PRIMARY KEY,
        client text NOT NULL,
        session text,
        record jsonb NOT NULL,
        generation bigint NOT NULL DEFAULT 0
    );
    CREATE INDEX workspaces_client ON workspaces (client);
    CREATE TABLE workspace_chunks (
        workspace_id text NOT NULL REFERENCES workspaces (id) ON DELETE CASCADE,
        generation bigint NOT NULL,
        seq integer NOT NULL,
        data bytea NOT NULL,
        PRIMARY KEY (workspace_id, generation, seq)
    );
    CREATE TABLE tasks (
        id text PRIMARY KEY,
        owner text NOT NULL,
        server text NOT NULL,
        record jsonb NOT NULL,
        output text,
        cancel_asked boolean NOT NULL DEFAULT false
    );
    CREATE INDEX tasks_owner ON tasks (owner);
    CREATE TABLE questions (
        id text PRIMARY KEY,
        caller text NOT NULL,
        lapses_at timestamptz NOT NULL
    );
    CREATE INDEX questions_caller ON questions (caller);
    CREATE TABLE rate_calls (
        key text NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX rate_calls_key_at ON rate_calls (key, at);
    CREATE TABLE running_calls (
        id text PRIMARY KEY,
        key text NOT NULL,
        server text NOT NULL REFERENCES replicas (owner) ON DELETE CASCADE
    );
    CREATE INDEX running_calls_key ON running_calls (key);
    """,
    # 2: callers and their tokens' hashes (seeded from a tokens file by the first replica that finds none)
    """
    CREATE TABLE callers (
        name text PRIMARY KEY,
        policy text NOT NULL,
        sha256 text NOT NULL UNIQUE,
        created text NOT NULL
    );
    """,
    # 3: a caller's calls counted in one statement each (one round trip; their commits do not wait for the disk:
    # a count lost with a crashed database is a call not counted, or counted a minute too long)
    """
    CREATE FUNCTION sandbox_count_call(call_key text, most integer)
    RETURNS TABLE (made bigint, left_s double precision) LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        PERFORM pg_advisory_xact_lock(hashtextextended('rate:' || call_key, 0));
        SELECT count(*), extract(epoch FROM min(r.at) + interval '60 s' - clock_timestamp())
          INTO made, left_s FROM rate_calls r WHERE r.key = call_key AND r.at > now() - interval '60 s';
        IF made < most THEN
            INSERT INTO rate_calls (key) VALUES (call_key);
        END IF;
        RETURN NEXT;
    END $$;
    CREATE FUNCTION sandbox_enter_call(call_id text, call_key text, replica text, most integer, lost_s double precision)
    RETURNS bigint LANGUAGE plpgsql AS $$
    DECLARE running bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        PERFORM pg_advisory_xact_lock(hashtextextended('running:' || call_key, 0));
        SELECT count(*) INTO running FROM running_calls c JOIN replicas r ON r.owner = c.server
          WHERE c.key = call_key AND r.beat_at > now() - make_interval(secs => lost_s);
        IF running < most THEN
            INSERT INTO running_calls (id, key, server) VALUES (call_id, call_key, replica);
        END IF;
        RETURN running;
    END $$;
    CREATE FUNCTION sandbox_leave_call(call_id text) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        DELETE FROM running_calls WHERE id = call_id;
    END $$;
    """,
    # 4: the files a call returned, so that a resources/read reaching another replica finds them
    """
    CREATE TABLE result_files (
        uri text PRIMARY KEY,
        tenant text,
        mime text NOT NULL,
        content bytea NOT NULL,
        size integer NOT NULL,
        kept_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX result_files_tenant ON result_files (tenant, kept_at);
    """,
    # 5: one statement for each of a call's two writes. A call is counted and entered together once its turn
    # comes on its replica (NULL: it may run; else the field it is past and what that refusal says). A workspace is
    # saved by one statement: its record with its new size when the host's cap has room for it (taken: what all
    # workspaces would take, then), its new generation, its first chunk, and the older generations gone (a larger
    # archive's other chunks follow in the same transaction); saved and taken both NULL: the workspace is gone.
    """
    CREATE FUNCTION sandbox_admit_call(call_id text, call_key text, replica text, per_minute integer,
                                       most integer, lost_s double precision)
    RETURNS TABLE (refused text, amount bigint, left_s double precision) LANGUAGE plpgsql AS $$
    BEGIN
        SELECT CASE WHEN c.made >= per_minute THEN 'rate.calls_per_minute' END, c.made, c.left_s
          INTO refused, amount, left_s FROM sandbox_count_call(call_key, per_minute) c;
        IF refused IS NULL THEN
            amount := sandbox_enter_call(call_id, call_key, replica, most, lost_s);
            refused := CASE WHEN amount >= most THEN 'rate.concurrent_calls' END;
        END IF;
        RETURN NEXT;
    END $$;
    CREATE FUNCTION sandbox_save_workspace(workspace text, first_chunk bytea, sized jsonb, cap bigint)
    RETURNS TABLE (saved bigint, taken bigint) LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM 1 FROM workspaces WHERE id = workspace FOR UPDATE;
        IF NOT FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        IF sized IS NOT NULL THEN
            SELECT coalesce(sum((w.record->>'size_bytes')::bigint), 0) + (sized->>'size_bytes')::bigint
              INTO taken FROM workspaces w WHERE w.id <> workspace;
            IF taken > cap THEN
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
        UPDATE workspaces SET generation = generation + 1, record = coalesce(sized, record) WHERE id = workspace
          RETURNING generation INTO saved;
        INSERT INTO workspace_chunks (workspace_id, generation, seq, data) VALUES (workspace, saved, 0, first_chunk);
        DELETE FROM workspace_chunks WHERE workspace_id = workspace AND generation < saved;
        RETURN NEXT;
    END $$;
    """,
    # 6: hosts a person approved or declined live (network.ask) per session or caller, and the questions each was
    # asked, so that every replica decides alike (swept a day after their last use)
    """
    CREATE TABLE host_answers (
        scope text NOT NULL,
        target text NOT NULL,
        allowed boolean NOT NULL,
        at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, target)
    );
    CREATE TABLE host_questions (
        scope text PRIMARY KEY,
        asked integer NOT NULL,
        at timestamptz NOT NULL DEFAULT now()
    );
    """,
    # 7: archive chunks kept once by their content (SHA-256), each generation's chunks naming theirs: a fork or a
    # snapshot copies the names alone, so copies share every chunk until one of them saves. A chunk is put with
    # its use marked (`touched`), so that the sweep, which removes the chunks no generation names after a while,
    # never takes one a save is naming meanwhile. The chunks kept before are moved over.
    """
    CREATE TABLE workspace_blobs (
        digest bytea PRIMARY KEY,
        data bytea NOT NULL,
        touched timestamptz NOT NULL DEFAULT now()
    );
    INSERT INTO workspace_blobs (digest, data)
        SELECT DISTINCT ON (sha256(data)) sha256(data), data FROM workspace_chunks;
    ALTER TABLE workspace_chunks ADD COLUMN digest bytea;
    UPDATE workspace_chunks SET digest = sha256(data);
    ALTER TABLE workspace_chunks ALTER COLUMN digest SET NOT NULL;
    ALTER TABLE workspace_chunks DROP COLUMN data;
    CREATE INDEX workspace_chunks_digest ON workspace_chunks (digest);
    CREATE FUNCTION sandbox_put_chunk(chunk bytea) RETURNS bytea LANGUAGE sql AS $$
        INSERT INTO workspace_blobs (digest, data) VALUES (sha256(chunk), chunk)
        ON CONFLICT (digest) DO UPDATE SET touched = now() RETURNING digest
    $$;
    CREATE OR REPLACE FUNCTION sandbox_save_workspace(workspace text, first_chunk bytea, sized jsonb, cap bigint)
    RETURNS TABLE (saved bigint, taken bigint) LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM 1 FROM workspaces WHERE id = workspace FOR UPDATE;
        IF NOT FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        IF sized IS NOT NULL THEN
            SELECT coalesce(sum((w.record->>'size_bytes')::bigint), 0) + (sized->>'size_bytes')::bigint
              INTO taken FROM workspaces w WHERE w.id <> workspace;
            IF taken > cap THEN
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
        UPDATE workspaces SET generation = generation + 1, record = coalesce(sized, record) WHERE id = workspace
          RETURNING generation INTO saved;
        INSERT INTO workspace_chunks (workspace_id, generation, seq, digest)
          VALUES (workspace, saved, 0, sandbox_put_chunk(first_chunk));
        DELETE FROM workspace_chunks WHERE workspace_id = workspace AND generation < saved;
        RETURN NEXT;
    END $$;
    """,
    # 8: a replica draining (out of service, finishing what runs there), and a drain an operator asked for
    """
    ALTER TABLE replicas ADD COLUMN draining boolean NOT NULL DEFAULT false;
    ALTER TABLE replicas ADD COLUMN drain_asked boolean NOT NULL DEFAULT false;
    """,
    # 9: homes: where a replica answers its peers, the replica a mounted workspace lives on, and the services there
    """
    ALTER TABLE replicas ADD COLUMN address text;
    ALTER TABLE workspaces ADD COLUMN home text;
    CREATE TABLE services (
        id text PRIMARY KEY,
        workspace_id text NOT NULL,
        replica text NOT NULL,
        name text NOT NULL,
        caller text NOT NULL
    );
    CREATE INDEX services_workspace ON services (workspace_id);
    """,
    # 10: a replica's name, the same across its restarts (serve --name; its host's by default), one replica's alone
    """
    ALTER TABLE replicas ADD COLUMN name text;
    CREATE UNIQUE INDEX replicas_name ON replicas (name);
    """,
)
