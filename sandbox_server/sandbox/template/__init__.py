"""The template's path: a bundle's sandbox forked from a template of its image rather than started by runc.

A template is the server's own interpreter (standard library only), started once per seccomp filter, that never
runs a caller's code; each sandbox is a child of it that enters namespaces, a cgroup and a root of its own and
drops every privilege before it becomes the call's program. A warm template (`warm`) has imported an image's
preload list in a sandbox of its own and forks that image's sandboxes already warm. The host's side: `host` (the
templates and how a sandbox ends), `launch` (a bundle's sandbox forked), `userns` (a warm template's user
namespace and view), `bpf` (the seccomp filter compiled), `cgroups` (the call's cgroups). The child's side, with
the standard library alone: `template` (the loop), `contain` (the child's way in, one ordered list of steps),
`kernel`, `mnt`, `net`, `caps`, `limits`, `cgroup`, `warm`.
"""
