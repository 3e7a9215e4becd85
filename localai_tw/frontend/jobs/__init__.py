"""The frontend's side of batch jobs (docs/jobs.md): the table, the claim-queue dispatch, the
cancel fan-out and the figures.  The kinds both sides share are in ``localai_tw.jobs``."""
