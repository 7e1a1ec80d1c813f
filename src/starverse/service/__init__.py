"""Starverse as a service: a REST API and a web console over the library's plans, jobs, checkpoints and bills.

``starverse serve`` runs :func:`starverse.service.app.create_app` under uvicorn on 127.0.0.1 and starts the
worker process (:mod:`starverse.service.worker`) that runs queued jobs. The service is a face over library
calls (planner search, cost-model estimate, the supervised training run, checkpoint store, billing ledger):
it holds tenants, tokens, the queue and what it sampled from running jobs, and no planning or training logic.
"""
