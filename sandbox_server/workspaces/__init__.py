"""Kept workspaces: their records (store), where their files live (contents: a mounted image or an archive),
reading them from the host without following a sandbox's links (files), how they and their files are named
(naming), and a call run in one (kept).

It may import policy, network, sandbox and the top-level modules; not tools, access or anything above.
"""
