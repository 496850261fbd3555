"""Shared state: what replicas of the server behind one load balancer keep in PostgreSQL (`serve --state`).

The connection pool, the schema and its migrations, the replicas' heartbeats (which tell a surviving replica that
another died), and the keys every replica signs with. What each concern keeps there is written beside that
concern (workspaces.shared, tasks.shared, access.shared); without `--state` nothing here is used and the server
keeps its state in local files, as one process.

It imports only the top-level modules; every other layer may import it.
"""
