from kvflow.cli import main

raise SystemExit(main())
