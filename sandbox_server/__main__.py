from sandbox_server.cli import main

raise SystemExit(main())
