from graft_exp.sweep.planning import main

raise SystemExit(main())
