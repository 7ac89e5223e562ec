"""`python -m rollplex ...` (what torchrun launches: `torchrun --nproc-per-node N -m rollplex run SPEC`)."""

from rollplex.cli import main

raise SystemExit(main())
