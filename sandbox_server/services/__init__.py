"""Services: programs a call starts that outlive it, reachable by their workspace's next calls and previewed by
their caller. Owns their records, caps and lifetimes; imports the sandbox layer (their containers and network),
the policy, the audit log and the workspace store (a service holds its workspace as a running call does)."""
