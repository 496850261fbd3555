"""Sandboxes forked from a template (serve --sandboxes template).

A template is a process per image, started once in the image's own root and interpreter, that never runs a
caller's code; each sandbox is a child of it that enters namespaces, a cgroup and a root of its own and drops
every privilege before it becomes the call's program. The host's side: `host` (the templates and how a sandbox
ends), `launch` (a bundle's sandbox forked), `bpf` (the seccomp filter compiled), `cgroups` (the call's cgroups).
The child's side, which runs in the image's interpreter with the standard library alone: `template` (the loop),
`contain` (the child's way in, one ordered list of steps), `kernel`, `mnt`, `net`, `caps`, `limits`, `cgroup`.
"""
