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
)
