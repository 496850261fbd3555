"""gVisor's path: `strict`'s sandboxes run by runsc itself on runc's bundles, each a kernel of its own."""
