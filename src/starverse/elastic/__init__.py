"""Surviving device losses: preemption notices, checkpoint intervals, and the supervisor that re-plans and resumes.

``notice`` (sources of preemption notices), ``preemption.PreemptionCallback`` (stop at a step boundary with an
emergency checkpoint), ``interval`` and ``traces`` (Young/Daly from the measured save cost and real spot traces;
no torch), ``supervisor.Supervisor`` (relaunch on what remains, resume from the last complete checkpoint),
``job`` (the ``starverse train`` job file). See docs/insurance.md. Submodules are imported on use.
"""
