from qkrope.cli import main

raise SystemExit(main())
