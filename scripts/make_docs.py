"""Write the planner's tables in README.md and docs/planner.md from the real commands' ``--json`` (``make docs``).

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; only that text is rewritten.
Verdict tables come from ``starverse plan JOB --pool POOL --json`` on the files in ``examples/`` (run
in-process through the same ``result_to_json`` the command prints); the README's benchmark table from the
records ``scripts/run_benches.py`` stores (``make bench``); the planner's benchmark tables from the JSON that
``benchmarks/bench_plan.py --save`` stores in ``benchmarks/results/bench_plan.json`` (timings move from run to
run, so the committed text follows the stored run, not a fresh one).

Usage: ``.venv/bin/python scripts/make_docs.py [--check] [--loso FILE]`` (``--check``: exit 1 and name the
tables that differ, writing nothing; ``tests/unit/test_docs_tables.py`` runs it; ``--loso FILE``: the held-out
figures from that ``scripts/loso.py`` output rather than a fresh refit).
"""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starverse.catalog import load_catalog
from starverse.cli.plan import result_to_json
from starverse.costmodel.fit import TARGETS, constants_set_to, leave_one_source_out
from starverse.costmodel.validate import LoadedCase, by_source, find_cases, load_case, score_case
from starverse.errors import InfeasiblePlanError
from starverse.planner import load_job, load_pool, search

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCH_RESULT = ROOT / "benchmarks" / "results" / "bench_plan.json"
BENCH_RUNS = ROOT / "benchmarks" / "results"
"""``scripts/run_benches.py`` stores one ``<bench>.run.json`` per benchmark here (the README's benchmark table)."""

S1, S2, S3, HD = "scenario1-mixed-70b", "scenario2-100b", "scenario3-power-cap", "hetero-dp"
SCENARIO_TABLES: dict[str, list[tuple[str, str]]] = {
    "s1": [(f"{S1}/job-throughput.yaml", f"{S1}/pool-mixed.yaml"), (f"{S1}/job-throughput.yaml", f"{S1}/pool-a100.yaml"),
           (f"{S1}/job.yaml", f"{S1}/pool-mixed.yaml"), (f"{S1}/job.yaml", f"{S1}/pool-a100.yaml"),
           (f"{S1}/job.yaml", f"{S1}/pool-mixed-spot.yaml"), (f"{S1}/job.yaml", f"{S1}/pool-three-arch.yaml"),
           (f"{S1}/job-throughput.yaml", f"{S1}/pool-three-arch.yaml"), (f"{S1}/job-lora.yaml", f"{S1}/pool-mixed.yaml")],
    "s2": [(f"{S2}/job-throughput.yaml", f"{S2}/pool-a100.yaml"), (f"{S2}/job-throughput.yaml", f"{S2}/pool-h100.yaml"),
           (f"{S2}/job-throughput.yaml", f"{S2}/pool-4090.yaml"), (f"{S2}/job-throughput.yaml", f"{S2}/pool-all.yaml"),
           (f"{S2}/job.yaml", f"{S2}/pool-all.yaml")],
    "s3": [(f"{S3}/job.yaml", f"{S3}/pool-tpu-v5p.yaml"), (f"{S3}/job.yaml", f"{S3}/pool-4090.yaml"),
           (f"{S3}/job.yaml", f"{S3}/pool-both.yaml")],
    "x": [(f"{HD}/job.yaml", f"{HD}/pool.yaml"), (f"{HD}/job-20.yaml", f"{HD}/pool-16.yaml")],
}
"""Marker name in docs/planner.md -> the (job, pool) commands of its rows."""


def plan_json(job: str, pool: str) -> dict[str, Any]:
    """``starverse plan JOB --pool POOL --json --top 1`` (in-process), or ``{"error": ...}`` when infeasible."""
    catalog = load_catalog(profile="")
    try:
        result = search(load_job(EXAMPLES / job), load_pool(EXAMPLES / pool, catalog), catalog, top=1)
    except InfeasiblePlanError as e:
        return {"error": str(e)}
    return result_to_json(result)


def _plan_pair(pair: tuple[str, str]) -> tuple[tuple[str, str], dict[str, Any]]:
    return pair, plan_json(*pair)


LONGEST_FIRST = ((f"{S2}/job-throughput.yaml", f"{S2}/pool-all.yaml"),
                 (f"{S1}/job-throughput.yaml", f"{S1}/pool-three-arch.yaml"), (f"{S3}/job.yaml", f"{S3}/pool-both.yaml"))
"""The searches that take longest (measured: ~40, ~15 and ~11 s of the ~100 s CPU of all 18), handed to the
workers first so that no worker starts one of them when the others are done (a scheduling hint only: every
search's document is the same whatever the order)."""


def plan_all(pairs: set[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """:func:`plan_json` of every (job, pool): on forked worker processes, one per CPU, where the platform forks
    and there is more than one CPU (the searches are independent and deterministic, so the documents are those
    of one search after the other; together they take minutes of CPU), else one after the other."""
    todo = sorted(pairs, key=lambda pair: (LONGEST_FIRST.index(pair) if pair in LONGEST_FIRST else len(LONGEST_FIRST),
                                           pair))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # the workers find _plan_pair by its module's name: not when this file was loaded without registering it
    if (min(cpus, len(todo)) < 2 or "fork" not in multiprocessing.get_all_start_methods()
            or sys.modules.get(__name__) is None):
        return {pair: plan_json(*pair) for pair in sorted(pairs)}
    pool = multiprocessing.get_context("fork").Pool(min(cpus, len(todo)))
    try:
        done = dict(pool.imap_unordered(_plan_pair, todo))
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()  # the workers leave on the pool's sentinel, not on a SIGTERM that a handler may catch
    pool.join()
    return {pair: done[pair] for pair in sorted(pairs)}


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _cmd(job: str, pool: str) -> str:
    return f"`starverse plan {job} --pool {pool}`"


def scenario_row(job: str, pool: str, doc: dict[str, Any]) -> str:
    """One row: command, devices and layout, tokens/s (spot-adjusted), MFU, price, job time and cost, kW,
    host RAM per node for offloaded state."""
    if "error" in doc:
        first = doc["error"].split("; what would help")[0].replace("|", "\\|")
        return f"| {_cmd(job, pool)} | **no plan**: {first} | – | – | – | – | – | – | – |"
    p = doc["plans"][0]
    ccy = doc["currency"]
    devices = " + ".join(f"{n}×{k}" for k, n in p["devices"].items())
    mode = f" (**{p['mode'].upper()} alternative**: full training has no plan)" if p["alternative"] else ""
    tps = _n(p["tokens_per_s"])
    if p["spot_factor"] > 1:
        tps += f" (×{p['spot_factor']:.2f} spot: {_n(p['effective_tokens_per_s'])})"
    host = ", ".join(f"{_n(v)} GB ({k})" for k, v in p["host_memory_gb_per_node"].items()) or "–"
    # what the search can claim for the chosen plan (stats.claim): marked when it is not proven
    kind = "" if doc["stats"]["claim"].startswith("proven optimal") else " *(not proven)*"
    layout = p["layout"].replace("|", "\\|")
    hours = f"{_n(p['hours'])} h" if p["hours"] is not None else "–"
    total = f"{_n(p['total_cost'])} {ccy}" if p["total_cost"] is not None else "–"
    return (f"| {_cmd(job, pool)} | {devices}{mode} — {layout}{kind} | {tps} | {p['mfu'] * 100:.1f} % | "
            f"{p['cost_per_hour']:,.2f} | {hours} | {total} | {p['power_kw']:.1f} | {host} |")


SCENARIO_HEADER = ("| command (in `examples/`) | chosen devices and layout | tokens/s | MFU | per hour | job time | "
                   "job cost | kW | host RAM per node |\n|---|---|---|---|---|---|---|---|---|")


def scenario_table(name: str, docs: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The table of marker ``name``."""
    return "\n".join([SCENARIO_HEADER, *(scenario_row(j, p, docs[(j, p)]) for j, p in SCENARIO_TABLES[name])])


def _best(doc: dict[str, Any]) -> str:
    """Short form of a command's chosen plan: devices, tokens/s, cost of the job."""
    if "error" in doc:
        return "no plan (" + doc["error"].split(":", 1)[1].split(";")[0].strip() + ")"
    p = doc["plans"][0]
    devices = " + ".join(f"{n}×{k}" for k, n in p["devices"].items())
    total = f", {_n(p['total_cost'])} {doc['currency']} for the job" if p["total_cost"] is not None else ""
    if p["alternative"]:
        devices = f"full training has no plan; {p['mode'].upper()} alternative: {devices}"
    return f"{devices} at {_n(p['effective_tokens_per_s'])} tokens/s{total}"


def _tps(doc: dict[str, Any]) -> float:
    return float(doc["plans"][0]["effective_tokens_per_s"]) if "plans" in doc else 0.0


def verdict_table(docs: dict[tuple[str, str], dict[str, Any]]) -> str:
    """README: each claim of the brief with the planner's figures for it."""
    def d(job: str, pool: str) -> dict[str, Any]:
        return docs[(job, pool)]

    mixed_t, a100_t = d(f"{S1}/job-throughput.yaml", f"{S1}/pool-mixed.yaml"), d(f"{S1}/job-throughput.yaml",
                                                                                    f"{S1}/pool-a100.yaml")
    mixed, a100 = d(f"{S1}/job.yaml", f"{S1}/pool-mixed.yaml"), d(f"{S1}/job.yaml", f"{S1}/pool-a100.yaml")
    spot = d(f"{S1}/job.yaml", f"{S1}/pool-mixed-spot.yaml")
    all_t = d(f"{S2}/job-throughput.yaml", f"{S2}/pool-all.yaml")
    singles = [d(f"{S2}/job-throughput.yaml", f"{S2}/pool-{k}.yaml") for k in ("a100", "h100", "4090")]
    best_single = max(_tps(x) for x in singles)
    both = d(f"{S3}/job.yaml", f"{S3}/pool-both.yaml")
    ratio = (f" ({_tps(a100_t) / _tps(mixed_t):.1f}× the mixed pool)" if _tps(mixed_t) and _tps(a100_t) else "")
    gain = f"; {_tps(all_t) / best_single:.2f}× the best single fleet" if best_single and _tps(all_t) else ""
    rows: list[tuple[str, str, str]] = [
        ("Llama-2-70B on 16×RTX 4090 + 3×TPU v5e runs 2.8× faster than on 16×A100",
         f"fastest on the mixed pool: {_best(mixed_t)}; on 16×A100: {_best(a100_t)}{ratio}",
         f"`starverse plan {S1}/job-throughput.yaml --pool {S1}/pool-mixed.yaml` (and `pool-a100.yaml`)"),
        ("45 % lower cost", f"cost-performance on the mixed pool: {_best(mixed)}; on 16×A100: {_best(a100)}",
         f"`starverse plan {S1}/job.yaml --pool {S1}/pool-mixed.yaml` (and `pool-a100.yaml`)"),
        ('"one job across three architectures" (spot, Bamboo p3 losses)', _best(spot),
         f"`starverse plan {S1}/job.yaml --pool {S1}/pool-mixed-spot.yaml`"),
        ("~100B model: ~80 % linear scaling on 160×4090 with ZeRO-3",
         f"fastest on all three fleets: {_best(all_t)}{gain}"
         + (" (a heterogeneous pipeline, proven optimal by the exact search)"
            if "plans" in all_t and all_t["plans"][0]["kind"] == "hetero-pipeline"
            and all_t["stats"]["claim"].startswith("proven optimal") else
            " (not proven optimal)" if "plans" in all_t and not all_t["stats"]["claim"].startswith("proven")
            else ""),
         f"`starverse plan {S2}/job-throughput.yaml --pool {S2}/pool-all.yaml`"),
        ("10 kW cap: 128×TPU v5p vs 160×RTX 4090", f"within 10 kW: {_best(both)}",
         f"`starverse plan {S3}/job.yaml --pool {S3}/pool-both.yaml`"),
    ]
    return "\n".join(["| claim | the planner's figures (chosen plan) | command |", "|---|---|---|",
                      *(f"| {a} | {b.replace('|', chr(92) + '|')} | {c} |" for a, b, c in rows)])


def bench_table(bench: dict[str, Any]) -> str:
    """docs/planner.md: the headline figures of the stored benchmark run, with their targets."""
    proven = bench.get("search_pipelines_proven")
    rows = [("`search_s_median` — Llama-2-70B, 6 offers × 1,024 devices, heterogeneous pipelines included",
             f"{bench['search_s_median']:.3f} s", "≤ 1 s"),
            ("the same searches' CPU time (`search_cpu_s_median`; wall time above stretches with the load)",
             "?" if bench.get("search_cpu_s_median") is None else f"{bench['search_cpu_s_median']:.3f} s", "≤ 1 s"),
            ("pipeline search of that run: bound closed within its caps? (gap left, nodes bounded)",
             "?" if proven is None else
             f"{'yes' if proven else 'no'} ({bench['search_bound_gap']:.1%}, {bench['search_pipeline_nodes']:,})",
             "proven"),
            ("`cli_s_median` — the whole `starverse plan … --json` process", f"{bench['cli_s_median']:.3f} s", "≤ 3 s"),
            ("`hetero_pp_gain` — ~100B, all offers, best plan / best single kind", f"{bench['hetero_pp_gain']:.3f}",
             "≥ 1.62"),
            ("`simulate_jobs_per_s` — 64-device spot plan, 24 h of work, Bamboo p3", f"{bench['simulate_jobs_per_s']:,.0f}",
             "≥ 1,000")]
    for name, ratio in sorted(bench["spot_factor_vs_sim"].items()):
        rows.append((f"`spot_factor_vs_sim` {name} (Young/Daly / simulated p50; planner after the check)",
                     f"{ratio['formula']:.3f}; {ratio['planner']:.3f}", "planner within 0.9-1.1"))
    rows.append(("1-minute load average of the shared 2-core machine while it ran",
                 f"{bench['load_average_1min']:.1f}" if bench.get("load_average_1min") is not None else "?",
                 "(timings scale with it)"))
    return "\n".join(["| figure | value | target |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def scaling_table(bench: dict[str, Any]) -> str:
    """docs/planner.md: search time against the number of offers (stored benchmark run)."""
    def yes(x: Any) -> str:
        return "?" if x is None else "yes" if x else "no"

    rows = [f"| {r['offers']} | {r['devices_per_offer']:,} | {r['search_s']:.3f} | {r['growth_vs_1_offer']} | "
            f"{r['combinations']:,} | {yes(r['proven_optimal'])} | {yes(r.get('pipelines_proven'))} |"
            for r in bench["scaling"]]
    return "\n".join(["| offers | devices per offer | search s | growth | combinations bounded | proven (groups) | "
                      "proven (pipelines) |", "|---|---|---|---|---|---|---|", *rows])


def quality_table(bench: dict[str, Any]) -> str:
    """docs/planner.md: the chosen plan against the best single kind and an even split (stored run)."""
    even = {r["scenario"]: r for r in bench["vs_even_split"]}
    rows = []
    for r in bench["vs_best_single"]:
        single = f"{r['ratio']:.3f}" if r.get("ratio") is not None else f"— ({r.get('why', 'no plan')[:90]})"
        e = even[r["scenario"]]
        ev = f"{e['ratio']:.3f}" if e.get("ratio") is not None else "—"
        rows.append(f"| {r['scenario']} | {single} | {ev} ({e.get('note', e.get('why', ''))}) |")
    return "\n".join(["| scenario | vs best single accelerator | vs even split |", "|---|---|---|", *rows])


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def _flat(figures: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Scalar figures of a benchmark's JSON, nested objects as ``a.b`` (lists left out: per-round samples)."""
    out: list[tuple[str, str]] = []
    for k, v in figures.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        elif not isinstance(v, list):
            out.append((f"{prefix}{k}", _fmt(v)))
    return out


def benchmarks_table(records: list[dict[str, Any]]) -> str:
    """README: every stored benchmark run (``scripts/run_benches.py``) with its figures and the load it ran under."""
    rows = ["| benchmark | ran at (load average, 1 min) | figures |", "|---|---|---|"]
    for r in records:
        load = r.get("load_average_1min") or {}
        when = f"{r['ran_at'][:16].replace('T', ' ')} UTC (load {load.get('start', '?')} → {load.get('end', '?')})"
        figs = r.get("figures")
        body = "; ".join(f"`{k}` {v}" for k, v in _flat(figs)) if figs else f"**no figures**: {r.get('error')}"
        rows.append(f"| `{r['bench']}.py` | {when} | {body} |")
    return "\n".join(rows)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _rho(x: float | None) -> str:
    """A Spearman figure; none for a source of one configuration."""
    return "–" if x is None else f"{x:.2f}"


LOSO_DOCUMENT: dict[str, Any] | None = None
"""``scripts/loso.py``'s output over data/validation where a caller already has it (the docs-tables test, which
runs the script once per session); None: this script runs the leave-one-source-out refits itself."""


@functools.cache
def _validation_run() -> tuple[list[LoadedCase], Any, dict[str, Any]]:
    """Every case of data/validation, the catalog, and the leave-one-source-out run over them (``scripts/loso.py``'s
    document; run once for every table that reads it)."""
    cases = [load_case(p) for p in find_cases([str(ROOT / "data" / "validation")])]
    catalog = load_catalog()
    loso = LOSO_DOCUMENT if LOSO_DOCUMENT is not None else leave_one_source_out(cases, catalog)
    return cases, catalog, loso


@functools.cache
def validation_table() -> str:
    """README: the cost model against every source of data/validation, in-sample and held out (every fitted
    constant refitted without the source: ``scripts/loso.py``), with issue 9's held-out targets."""
    cases, catalog, loso = _validation_run()
    rows = ["| source | runs | median | p90 | max | Spearman | held out: median / p90 / Spearman | held-out targets met |",
            "|---|---|---|---|---|---|---|---|"]
    in_sample = by_source([score_case(c, catalog) for c in cases])
    for name, h in sorted(loso["held_out"].items()):
        src = in_sample[name]
        missed = [k for k, ok in h["meets"].items() if ok is False]
        rows.append(
            f"| {name} | {h['n']} | {_pct(src['median_abs_error'])} | {_pct(src['p90_abs_error'])} | "
            f"{_pct(src['max_abs_error'])} | {_rho(src['spearman'])} | {_pct(h['median_abs_error'])} / "
            f"{_pct(h['p90_abs_error'])} / {_rho(h['spearman'])} | {'missed: ' + ', '.join(missed) if missed else 'all'} |"
        )
    fitted = "; ".join(f"`{k}` = {v['all']:.4g} (held out: {min(v['without'].values()):.4g}–{max(v['without'].values()):.4g})"
                       for k, v in loso["fitted"].items())
    return "\n".join(rows) + f"\n\nFitted over all sources together: {fitted}."


def cases_table() -> str:
    """docs/costmodel.md: every validation case outside AMP's and DT-FM's (whose 90 and 69 runs have their own
    folders) with its error."""
    rows = ["| case | predicted tokens/s | measured tokens/s | error | predicted / measured peak GB |",
            "|---|---:|---:|---:|---:|"]
    catalog = load_catalog()
    for path in find_cases([str(ROOT / "data" / "validation")]):
        if "amp-aws" in path.parts or "dtfm-aws" in path.parts:
            continue
        r = score_case(load_case(path), catalog)
        mem = (f"{r.predicted_memory_gb:.1f} / {r.measured_memory_gb:.2f}"
               + (" (log not compared: measured.peak_memory_excluded)" if r.memory_excluded else "")
               if r.predicted_memory_gb is not None and r.measured_memory_gb is not None else "")
        name = path.stem + (" (refused)" if not r.fits else "")
        rows.append(f"| {name} | {_n(r.predicted) if r.predicted else '–'} | {_n(r.measured) if r.measured else '–'} | "
                    f"{f'{100 * r.error:+.1f} %' if r.error is not None else '–'} | {mem} |")
    return "\n".join(rows)


RESIDUAL_ERROR = 0.15
"""``residuals`` lists a case whose held-out |tokens/s error| is above this (or whose peak memory misses issue 9's
target, or that is refused although it ran)."""


def case_layout(case: LoadedCase) -> str:
    """A case's plan in one line: per group replicas × stages × TP (CP), accelerators, micro-batch; ZeRO, recompute."""
    parts = []
    for g in case.plan.groups:
        accs = "/".join(dict.fromkeys(st.accelerator for st in g.stages))
        tps = "/".join(str(t) for t in dict.fromkeys(st.tp for st in g.stages))
        stages = sum(st.repeat for st in g.stages)
        cp = f" CP {g.cp}" if g.cp > 1 else ""
        mb = f", mb {g.micro_batch}" if g.micro_batch is not None else ""
        parts.append(f"{g.replicas} × PP {stages} × TP {tps}{cp} {accs}{mb}")
    # identical groups (the slices of a multislice run) once, with their count
    counted = [(part, sum(1 for _ in run)) for part, run in itertools.groupby(parts)]
    parts = [part if n == 1 else f"{n} groups of ({part})" for part, n in counted]
    train = case.plan.train
    extra = f"; ZeRO-{train.zero_stage}" if train.zero_stage else ""
    extra += f"; recompute {train.recompute}" if train.recompute != "none" else ""
    return " + ".join(parts) + extra


def residuals_table() -> str:
    """docs/costmodel.md: per source, the cases the model misses held out (scored with the fitted constants of the
    leave-one-source-out run that left the source out): |tokens/s error| above ``RESIDUAL_ERROR``, peak memory
    beyond issue 9's target, or refused although they ran."""
    cases, catalog, loso = _validation_run()
    rows = ["| source | case | layout | held-out error | peak memory: predicted / measured GB (error) |",
            "|---|---|---|---:|---|"]
    for src in sorted(loso["held_out"]):
        values = {name: v["without"][src] for name, v in loso["fitted"].items()}
        mine = [c for c in cases if c.source == src]
        with constants_set_to(values):
            results = [score_case(c, catalog) for c in mine]
        for case, r in zip(mine, results, strict=True):
            err, mem = r.error, r.memory_error
            if not ((err is not None and abs(err) > RESIDUAL_ERROR) or not r.fits
                    or (mem is not None and abs(mem) > TARGETS["memory_abs_error"])):
                continue
            gb = (f"{r.predicted_memory_gb:.1f} / {r.measured_memory_gb:.2f} ({100 * mem:+.0f} %)"
                  if mem is not None and r.predicted_memory_gb is not None and r.measured_memory_gb is not None
                  else "–")
            name = case.name + (" (refused)" if not r.fits else "")
            e = f"{100 * err:+.1f} %" if err is not None else "–"
            rows.append(f"| {src} | {name} | {case_layout(case)} | {e} | {gb} |")
    return "\n".join(rows)


def render() -> dict[Path, dict[str, Callable[[], str]]]:
    """File -> marker -> the text that belongs between its markers."""
    pairs = {pair for rows in SCENARIO_TABLES.values() for pair in rows}
    cache: dict[tuple[str, str], dict[str, Any]] = {}

    def docs() -> dict[tuple[str, str], dict[str, Any]]:
        if not cache:
            cache.update(plan_all(pairs))
        return cache

    out: dict[Path, dict[str, Callable[[], str]]] = {
        ROOT / "docs/planner.md": {name: (lambda n=name: scenario_table(n, docs())) for name in SCENARIO_TABLES},
        ROOT / "README.md": {"verdicts": lambda: verdict_table(docs()), "validation": validation_table},
        ROOT / "docs/costmodel.md": {"validation": validation_table, "cases": cases_table,
                                    "residuals": residuals_table},
    }
    records = {f.name.removesuffix(".run.json"): json.loads(f.read_text()) for f in sorted(BENCH_RUNS.glob("*.run.json"))}
    out[ROOT / "README.md"]["benchmarks"] = lambda: benchmarks_table(list(records.values()))
    for doc in sorted((ROOT / "docs").glob("*.md")):  # `<!-- table:bench-NAME -->`: that benchmark's last run
        for name in re.findall(r"<!-- table:(bench_\w+) -->", doc.read_text()):
            out.setdefault(doc, {})[name] = (
                lambda n=name: benchmarks_table([records[n]]) if n in records
                else f"`{n}.py` has not been run by `make bench` yet."
            )
    if BENCH_RESULT.exists():
        bench = json.loads(BENCH_RESULT.read_text())
        out[ROOT / "docs/planner.md"]["bench"] = lambda: bench_table(bench)
        out[ROOT / "docs/planner.md"]["scaling"] = lambda: scaling_table(bench)
        out[ROOT / "docs/planner.md"]["quality"] = lambda: quality_table(bench)
    return out


def rewrite(text: str, name: str, body: str) -> str:
    """``text`` with the block between the markers of ``name`` replaced by ``body``."""
    pat = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table:{re.escape(name)} -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"missing markers <!-- table:{name} --> ... <!-- /table:{name} -->")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv: list[str]) -> int:
    """Write the tables (or, with ``--check``, name those that differ and exit 1). ``--loso FILE``: read
    ``scripts/loso.py``'s output from FILE instead of running the refits again."""
    global LOSO_DOCUMENT
    check = "--check" in argv
    if "--loso" in argv:
        LOSO_DOCUMENT = json.loads(Path(argv[argv.index("--loso") + 1]).read_text())
    stale = []
    for path, tables in render().items():
        text = path.read_text()
        new = text
        for name, make in tables.items():
            before, new = new, rewrite(new, name, make())
            if new != before:
                stale.append(f"{path.relative_to(ROOT)}: table '{name}'")
        if new != text and not check:
            path.write_text(new)
    if check and stale:
        print("tables differ from what scripts/make_docs.py writes (run `make docs`): " + "; ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
