"""ZeRO-1 proper (``ShardedOptimizer``): each rank holds the optimizer state of a disjoint partition of the
parameters, and a DCP checkpoint written under ZeRO-1 loads into a plain AdamW and back, state for state.

(Exactness against one process is in test_parallel_exact.py and, with uneven rebalanced shares,
test_parallel_fit.py.)
"""

from __future__ import annotations

import numpy as np
import torch

from starverse.runtime.launch import RankSpec, launch
from starverse.runtime.modeling import build_model

CFG = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def _moments(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, np.ndarray]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s["exp_avg"].detach().numpy().copy() for p, s in opt.state.items() if "exp_avg" in s}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    import torch.distributed as dist

    x = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=x, labels=x).loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _rank(env, ckpt_dir: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from starverse.checkpoint.state import apply_train_state, train_state
    from starverse.runtime.parallel.parallelize import ParallelConfig, group_mesh, parallelize
    from starverse.runtime.parallel.zero1 import ShardedOptimizer
    from starverse.runtime.steps import make_optimizer

    mesh = group_mesh("cpu", env.world_size, 1)
    pm = parallelize(build_model(CFG, seed=0), ParallelConfig(zero_stage=1), mesh)
    model = pm.model
    opt = pm.shard_optimizer(make_optimizer(model, 1e-2, 0.1))
    assert isinstance(opt, ShardedOptimizer)
    for s in range(2):
        _step(model, opt, s)
    mine = _moments(opt, model)
    dcp.save(train_state(model, opt), checkpoint_id=ckpt_dir)

    # the same checkpoint into a plain (unsharded) AdamW: every parameter's state, the owners' values
    plain_model = build_model(CFG, seed=1)
    plain = make_optimizer(plain_model, 1e-2, 0.1)
    sd = train_state(plain_model, plain)
    dcp.load(sd, checkpoint_id=ckpt_dir)
    apply_train_state(plain_model, plain, sd)
    everything = _moments(plain, plain_model)

    # and back into a fresh ZeRO-1 optimizer: this rank's partition again; one more step equals the original's
    again_model = build_model(CFG, seed=2)
    again = parallelize(again_model, ParallelConfig(zero_stage=1), mesh).shard_optimizer(
        make_optimizer(again_model, 1e-2, 0.1))
    sd = train_state(again_model, again)
    dcp.load(sd, checkpoint_id=ckpt_dir)
    apply_train_state(again_model, again, sd)
    reloaded = _moments(again, again_model)
    _step(model, opt, 7)
    _step(again_model, again, 7)
    diff = float(max((a.detach() - b.detach()).abs().max() for a, b in zip(model.parameters(),
                                                                          again_model.parameters(), strict=True)))
    dist.barrier()
    optimizer_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    return {"mine": mine, "everything": everything, "reloaded": reloaded, "diff": diff,
            "optimizer_bytes": optimizer_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def test_zero1_shards_the_state_and_its_checkpoint_loads_across_layouts(tmp_path):
    results = launch(_rank, [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)], timeout_s=300,
                     args=(str(tmp_path / "ckpt"),))
    names = {n for n, _ in build_model(CFG).named_parameters()}
    parts = [set(r["mine"]) for r in results]
    assert parts[0] and parts[1] and not parts[0] & parts[1]  # disjoint partitions, none empty
    assert parts[0] | parts[1] == names  # together every parameter
    for r in results:
        # AdamW holds 2 moments per parameter; one rank holds those of about half of the parameters
        assert r["optimizer_bytes"] <= 0.6 * 2 * r["param_bytes"]
        assert set(r["everything"]) == names
        for owner in results:
            for n, v in owner["mine"].items():
                np.testing.assert_array_equal(r["everything"][n], v)
        assert r["reloaded"].keys() == r["mine"].keys()
        for n, v in r["mine"].items():
            np.testing.assert_array_equal(r["reloaded"][n], v)
        assert r["diff"] == 0.0  # the reloaded optimizer continues exactly as the original
