"""Which failure a launcher raises when several ranks report at once: the root cause, by type."""

from __future__ import annotations

from starverse.errors import CheckpointError, ConfigError, LostRankError, RankCodeError
from starverse.providers.ray import _failure
from starverse.runtime.launch import RankSpec

RANKS = [RankSpec(rank=0, device_kind="cpu"), RankSpec(rank=1, device_kind="cpu")]
NODES = ["127.0.0.1", "127.0.0.2"]
PEER_LOST = CheckpointError("checkpoint failed: RuntimeError: Read error [127.0.0.1]: Connection reset by peer")


def test_a_lost_rank_outranks_the_checkpoint_error_its_peer_saw():
    # rank 1's node went away while rank 0 was inside a checkpoint collective: the loss is the root cause,
    # so the supervisor re-plans without the device instead of failing the job on a checkpoint error.
    err = _failure(RANKS, NODES, {}, {0: ("CheckpointError: ...", "tb", PEER_LOST)}, {1: "actor died"})
    assert isinstance(err, LostRankError) and (err.rank, err.node) == (1, "127.0.0.2")


def test_bad_input_outranks_a_lost_rank_and_typed_errors_stay_themselves():
    bad = ConfigError("dataset 'x' is empty")
    assert _failure(RANKS, NODES, {}, {0: ("ConfigError", None, bad)}, {1: "actor died"}) is bad
    assert _failure(RANKS, NODES, {}, {0: ("CheckpointError", None, PEER_LOST)}, {}) is PEER_LOST
    code = _failure(RANKS, NODES, {}, {1: ("RuntimeError: boom", "tb", None)}, {})
    assert isinstance(code, RankCodeError) and code.rank == 1
