"""The first schema: tenants, tokens, jobs (the queue), job events and samples, balance entries.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the tables."""
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("quota_bytes", sa.BigInteger, nullable=False),
        sa.Column("currency", sa.String(8), nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("revoked", sa.Boolean, nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("worker_id", sa.String(32), nullable=True),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("resume_from", sa.Integer, nullable=True),
        sa.Column("stop_requested", sa.Boolean, nullable=False),
        sa.Column("launches", sa.Integer, nullable=False),
        sa.Column("fresh_starts", sa.Integer, nullable=False),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("stop_reason", sa.Text, nullable=True),
        sa.Column("last_step", sa.Integer, nullable=True),
        sa.Column("max_steps", sa.Integer, nullable=False),
    )
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant_id", "created_at"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_table(
        "job_samples",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float, nullable=True),
        sa.Column("tokens_per_s", sa.Float, nullable=True),
        sa.Column("shares", sa.Text, nullable=False),
    )
    op.create_table(
        "balance_entries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("amount_micros", sa.BigInteger, nullable=False),
        sa.Column("note", sa.Text, nullable=False),
    )


def downgrade() -> None:
    """Drop the tables."""
    for t in ("balance_entries", "job_samples", "job_events", "jobs", "tokens", "tenants"):
        op.drop_table(t)
