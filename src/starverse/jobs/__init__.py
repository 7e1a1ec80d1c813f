"""A job's wiring in one place: ``run_job(job) -> JobResult`` (the CLI's ``train`` and the service use it).

``wiring.build_callbacks`` builds the checkpoint, preemption, billing and metrics callbacks in their fixed
order; ``run.prepare_job`` checks a job and builds its cluster and supervisor; ``run.run_job`` trains it;
``ledger.job_bill`` reads its bill.
"""

from __future__ import annotations

from starverse.jobs.ledger import JobBill, check_ledger_job, job_bill
from starverse.jobs.run import JobProgress, JobResult, PreparedJob, prepare_job, run_job
from starverse.jobs.wiring import JobCallbacks, build_callbacks

__all__ = ["JobBill", "JobCallbacks", "JobProgress", "JobResult", "PreparedJob", "build_callbacks",
           "check_ledger_job", "job_bill", "prepare_job", "run_job"]
