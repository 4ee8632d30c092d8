"""Support code of the test suite (importable as ``support.*``: pytest puts tests/ on sys.path).

- fixtures.py      every shared fixture; registered as a plugin by tests/conftest.py
- cli.py           REPO, BIN, in_ci(), cli_env(), run_cli(): this checkout's CLI from this venv
- ranks.py         RANK_PROBE, a job script whose ranks report in files of their own; rank_reports()
- shm.py           /dev/shm hygiene: MPICH's leftovers of aborted runs, entries a test left behind
- local_slurm.py   a real Slurm on this host (LocalSlurm); also runnable by hand
- cache_util.py    cache tests: sample data, invariant checks, child-process workers
- calib_sources.py calibration tests: an HDF5 source that degrades under concurrency
- calib_job.py     calibration tests: a small torch job written the usual way (DataLoader, DDP),
  run as a script by `hpcstagger calibrate --spec` and under mpiexec
- ckpt_util.py     checkpoint tests: a small model, training, bit-for-bit comparison, a fake clock
- model_scenarios.py  model tests: small scenarios
- spec_util.py     co-located run tests: a spec of two tiny jobs with a shared cache, filling it
- ckpt_crash_child.py, ckpt_hvd_job.py  the code that the crash test's forked children and the
  Horovod test's mpiexec ranks run (the latter as ``python tests/support/ckpt_hvd_job.py``)

Keep this file free of imports: the crash test's forkserver imports the package before its child.
"""
