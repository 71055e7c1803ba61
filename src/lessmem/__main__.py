from lessmem.cli import main

raise SystemExit(main())
