"""Where every rank sits in a plan: group, pipeline replica, stage, tensor-parallel rank, and the layers it holds.

Ranks are numbered group by group, replica by replica, stage by stage (``repeat`` unrolled), tensor-parallel
rank innermost, so a TP group is consecutive ranks (one node) and a replica's stages follow in pipeline order.
This is the same order :func:`starverse.runtime.cluster.order_ranks_like_plan` gives the cluster's ranks.

A *replica* is the unit of data parallelism: one whole pipeline, holding every layer once. Its share of the
global batch is what rebalancing moves. A *virtual stage* (the interleaved schedule) is one chunk of a
stage's layers: stage ``s`` of a ``P``-stage pipeline with ``v`` virtual stages runs virtual stages
``s, s + P, ..., s + (v-1) P`` (the looped order of Narayanan et al. 2021, as torch's ``ScheduleInterleaved1F1B``
expects); a stage's ``layers`` are split over its chunks as evenly as possible, the first chunks taking the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from starverse.plan import Plan


@dataclass(frozen=True)
class RankPlace:
    """One rank's place in the plan."""

    rank: int
    """Global rank."""
    group: int
    """Index of its group in ``plan.groups``."""
    replica: int
    """Global index of its pipeline replica (over all groups)."""
    stage: int
    """Pipeline stage (0-based, ``repeat`` unrolled) inside its replica."""
    tp_rank: int
    """Rank inside the stage's tensor-parallel group."""
    accelerator: str
    """Accelerator id of its stage."""


@dataclass(frozen=True)
class Chunk:
    """One virtual stage: a contiguous run of the model's layers, with the embedding and/or head at the ends."""

    index: int
    """Virtual-stage index in pipeline order (0 .. stages × virtual_stages - 1)."""
    first_layer: int
    """First layer (block) it holds."""
    num_layers: int
    """Layers (blocks) it holds (may be 0 only in a pipeline of one stage)."""
    is_first: bool
    """Holds the input embedding."""
    is_last: bool
    """Holds the final norm and the output head."""

    @property
    def layers(self) -> range:
        """The layer indices it holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True)
class PipelineLayout:
    """The places of all ranks of a plan, and the chunks each replica's stages hold."""

    places: tuple[RankPlace, ...]
    """One entry per rank, indexed by rank."""
    replica_ranks: tuple[tuple[int, ...], ...]
    """Ranks of each replica (all stages, all TP ranks), indexed by replica."""
    replica_group: tuple[int, ...]
    """Group index of each replica."""
    stage_layers: tuple[tuple[int, ...], ...]
    """Layers per stage of each group (``repeat`` unrolled), indexed by group."""
    virtual_stages: int
    """Chunks per stage (1 unless the schedule is interleaved)."""

    @classmethod
    def from_plan(cls, plan: Plan) -> PipelineLayout:
        """Places in the rank order described in the module docstring."""
        v = plan.train.virtual_stages if plan.train.schedule == "interleaved" else 1
        places: list[RankPlace] = []
        replicas: list[tuple[int, ...]] = []
        replica_group: list[int] = []
        stage_layers: list[tuple[int, ...]] = []
        for gi, g in enumerate(plan.groups):
            stages = g.expanded_stages()
            stage_layers.append(tuple(s.layers for s in stages))
            for _ in range(g.replicas):
                mine: list[int] = []
                for si, s in enumerate(stages):
                    for t in range(s.tp):
                        rank = len(places)
                        places.append(RankPlace(rank, gi, len(replicas), si, t, s.accelerator))
                        mine.append(rank)
                replicas.append(tuple(mine))
                replica_group.append(gi)
        return cls(tuple(places), tuple(replicas), tuple(replica_group), tuple(stage_layers), v)

    @property
    def num_replicas(self) -> int:
        """Pipeline replicas over all groups (the data-parallel units)."""
        return len(self.replica_ranks)

    @property
    def is_pipelined(self) -> bool:
        """Some group has more than one stage (or interleaved chunks)."""
        return any(len(s) > 1 for s in self.stage_layers) or self.virtual_stages > 1

    @property
    def splits_match(self) -> bool:
        """Every group's pipeline cuts the layers the same way: the replicas of all groups hold the same
        parameters stage by stage (so one FSDP2 mesh per stage can span the groups)."""
        return len(set(self.stage_layers)) == 1

    def num_stages(self, group: int) -> int:
        """Pipeline depth of a group."""
        return len(self.stage_layers[group])

    def chunks(self, group: int) -> list[Chunk]:
        """Every virtual stage of a group's pipeline, in pipeline order."""
        stages = self.stage_layers[group]
        p, v = len(stages), self.virtual_stages
        split = [_even_split(n, v) for n in stages]
        out: list[Chunk] = []
        first = 0
        for vs in range(p * v):
            n = split[vs % p][vs // p]
            out.append(Chunk(vs, first, n, vs == 0, vs == p * v - 1))
            first += n
        return out

    def chunks_of(self, rank: int) -> list[Chunk]:
        """The virtual stages a rank runs (looped order: stage s runs s, s + P, ...)."""
        place = self.places[rank]
        p = self.num_stages(place.group)
        return [c for c in self.chunks(place.group) if c.index % p == place.stage]

    def stage_ranks(self, replica: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The ranks of a replica's stages with the same TP rank, in stage order (its pipeline's P2P group)."""
        return tuple(r for r in self.replica_ranks[replica] if self.places[r].tp_rank == tp_rank)

    def replica_of(self, rank: int) -> int:
        """The replica a rank belongs to."""
        return self.places[rank].replica


def _even_split(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` counts differing by at most one, the first ones larger."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
