"""Who is calling and what they may do: bearer tokens (a tokens file or an OAuth issuer's JWTs), the identity a
request proves, approval rules, admission (rate, concurrency, the host's headroom) and the audit trail.

It may import policy, network, sandbox and the top-level modules (and the SDK's token-verifier interface);
it does not import tools, workspaces, calls or anything above.
"""
