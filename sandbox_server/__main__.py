from sandbox_server.cli.main import main

raise SystemExit(main())
