"""Project rollout and RL-step speedups of speculative decoding onto a
cluster with the performance model (``rayspec.perfmodel``).

    python -m jobs.project_speedup --model qwen3-8b --hardware h100 --replicas 8 \\
        --acceptance-length 2.3 --response-mean 4096 --max-new-tokens 16384
    python -m jobs.project_speedup --model <hf dir> --hardware gb200 --run runs/gsm8k
    python -m jobs.project_speedup --validate [--bench docs/benchmarks/rollout_quick_one_openmp.json] \
        [--hw rejection_noise_s_per_logit=43e-9]

The workload comes from ``--run`` (a rayspec run directory: response
lengths, prompt length, acceptance per position) or from the flags
(capped-exponential response lengths, an i.i.d. acceptance rate fitted to
``--acceptance-length`` at ``--k``). Prints, for k = 0..``--k-max`` and for
the best batch-size schedule of k, the rollout and step seconds and the
speedups against no speculation, then the weight sync of each transport
(seconds by part and share of the step; ``rayspec.perfmodel.weight_sync``);
writes JSON (``--out``) and a plot of
concurrency and step cost over one rollout (``--plot``, beside ``--out``).
``--validate`` prints the validation tables instead (``rayspec.perfmodel.validate``)
and writes their rows to ``--out`` as a JSON list of {case, figure, k,
published, projected, role, error}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rayspec.model_shape import ModelShape
from rayspec.perfmodel import hardware
from rayspec.perfmodel.pipeline import (Pipeline, Workload, capped_exponential_lengths, geometric_rates, simulate_step,
                                        with_sync)
from rayspec.perfmodel.simulate import Engine, best_schedule
from rayspec.perfmodel.weight_sync import TRANSPORTS, sync_time
from rayspec.rollout.adaptive import extrapolate_rates, format_schedule

# mean prompt tokens of the first b GSM8K train prompts (chat template, SmolLM2 tokenizer): the
# prompts jobs.bench_rollout --quick runs at concurrency b (16: its rollout cells, the first 4 x 4)
QUICK_PROMPT_LENS = {1: 83.0, 4: 91.5, 8: 100.375, 16: 91.5, 32: 108.53125}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.project_speedup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", help="HF model dir, config.json, or preset (qwen3-8b, "
                    "qwen3-235b-a22b, smollm2-135m)")
    ap.add_argument("--hardware", default="h100", help="preset: h100, h200, gb200, cpu")
    ap.add_argument("--hw", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a hardware field, e.g. --hw mem_bw=3e12 (repeatable)")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "draft_model", "mtp", "ngram"])
    ap.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3 draft vocabulary (tokens)")
    ap.add_argument("--draft-layers", type=int, default=4, help="layers of a draft_model (truncated copy)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per replica")
    ap.add_argument("--replicas", type=int, default=1, help="rollout replicas (data parallel)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM max_num_seqs per replica")
    ap.add_argument("--run", help="rayspec run directory to take the workload from")
    ap.add_argument("--sequences", type=int, default=512, help="sequences per RL step (prompts x group)")
    ap.add_argument("--prompt-len", type=float, default=256, help="prompt tokens per sequence")
    ap.add_argument("--response-mean", type=float, default=2048, help="mean response tokens")
    ap.add_argument("--max-new-tokens", type=int, default=8192, help="response cap (tokens)")
    ap.add_argument("--acceptance-length", type=float, default=2.0, help="measured acceptance length at --k")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens the acceptance was measured at")
    ap.add_argument("--k-max", type=int, default=5, help="largest k to project")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature (0: greedy, the rejection sampler draws no noise)")
    ap.add_argument("--mode", default="sync", choices=["sync", "async"])
    ap.add_argument("--policy-lag", type=int, default=1, help="async only")
    ap.add_argument("--train-devices", type=int, help="default: the rollout devices (colocated)")
    ap.add_argument("--weight-sync", default="collective", choices=list(TRANSPORTS),
                    help="weight transport of the modelled steps (both are printed)")
    ap.add_argument("--nodes", type=int, help="nodes the run spans (default: its devices / --gpus-per-node)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--validate", action="store_true", help="print the validation tables and exit")
    ap.add_argument("--bench", default=str(Path(__file__).resolve().parents[1] / "docs/benchmarks/rollout_quick_one_openmp.json"),
                    help="--validate: jobs.bench_rollout --quick JSON measured on the cpu preset's machine")
    ap.add_argument("--out", default="runs/project_speedup/projection.json",
                    help="JSON output (its directory is created)")
    ap.add_argument("--plot", help="plot path (default: --out with .png)")
    return ap.parse_args(argv)


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--hw {item}: expected FIELD=VALUE")
        out[key] = value
    return out


def _draft(target: ModelShape, ns) -> ModelShape | None:
    return {"eagle3": lambda: target.eagle3_head(ns.draft_vocab), "mtp": target.mtp_head,
            "draft_model": lambda: target.truncated(ns.draft_layers), "ngram": lambda: None}[ns.method]()


def project(ns) -> dict:
    if ns.temperature < 0:
        raise ValueError(f"--temperature {ns.temperature}: must be >= 0")
    target = ModelShape.from_hf_config(ns.model)
    hw = hardware.get(ns.hardware, **_overrides(ns.hw))
    if ns.run:
        work = Workload.from_run(ns.run, prompt_len=ns.prompt_len)
        work.rates = extrapolate_rates(work.rates, ns.k_max) or [0.0] * ns.k_max  # unmeasured positions
    else:
        work = Workload(capped_exponential_lengths(ns.sequences, ns.response_mean, ns.max_new_tokens),
                        ns.prompt_len, geometric_rates(ns.acceptance_length, ns.k, ns.k_max), "flags")
    devices = ns.tp * ns.replicas
    train_devices = ns.train_devices or devices
    # colocated (sync) the roles share the devices; async splits them
    nodes = ns.nodes or math.ceil((devices if ns.mode == "sync" else devices + train_devices) / ns.gpus_per_node)
    pipe = Pipeline(ns.mode, train_devices, ns.policy_lag if ns.mode == "async" else 0, ns.weight_sync, nodes)
    plain = Engine(target, hw, "none", None, ns.tp, ns.replicas, ns.max_num_seqs, ns.temperature)
    spec = Engine(target, hw, ns.method, _draft(target, ns), ns.tp, ns.replicas, ns.max_num_seqs, ns.temperature)
    base = simulate_step(plain, work, pipe, 0)
    rows = [dict(k="none", rollout_s=base.rollout_s, step_s=base.step_s, rollout_speedup=1.0, step_speedup=1.0)]
    runs = {"none": base}
    for k in range(1, ns.k_max + 1):
        runs[f"k={k}"] = simulate_step(spec, work, pipe, k)
    sched = best_schedule(spec, work.lengths, work.prompt_len, work.rates, ns.k_max)
    runs["best schedule"] = simulate_step(spec, work, pipe, sched)
    for name, st in list(runs.items())[1:]:
        rows.append(dict(k=name, rollout_s=st.rollout_s, step_s=st.step_s,
                         rollout_speedup=base.rollout_s / st.rollout_s, step_speedup=base.step_s / st.step_s))
    nbytes = target.weight_bytes(1e9, hw.dtype_bytes)
    sync = []
    for transport in TRANSPORTS:
        if transport == "shared_memory" and nodes > 1:
            continue  # tmpfs is per host
        t = sync_time(transport, nbytes, hw, nodes, pipe.mode)
        sync.append(dict(transport=transport, bytes=nbytes, nodes=nodes, gather_s=t.gather_s,
                         transfer_s=t.transfer_s, load_s=t.load_s, sync_s=t.seconds,
                         **{f"share_{n}": t.seconds / with_sync(runs[n], pipe, t.seconds).step_s
                            for n in ("none", "best schedule")}))
    return dict(model=target.name, hardware=hw.to_dict(), method=ns.method, tp=ns.tp, replicas=ns.replicas,
                temperature=ns.temperature, weight_sync=sync,
                pipeline=vars(pipe), workload=dict(sequences=len(work.lengths), prompt_len=work.prompt_len,
                                                   response_mean=sum(work.lengths) / len(work.lengths),
                                                   rates=work.rates, source=work.source),
                parts={n: dict(logprob_s=s.logprob_s, train_s=s.train_s, sync_s=s.sync_s) for n, s in runs.items()},
                rows=rows, num_speculative_tokens_per_batch_size=[list(r) for r in sched],
                traces={"none": base.rollout.trace, "best schedule": runs["best schedule"].rollout.trace})


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, trace in result["traces"].items():
        t = [e[0] for e in trace]
        ax1.step(t, [e[1] for e in trace], where="post", label=name)
        ax2.step(t, [e[3] * 1e3 for e in trace], where="post", label=name)
    ax1.set_ylabel("sequences in flight")
    ax2.set_ylabel("engine step (ms)")
    ax2.set_xlabel("rollout time (s), slowest replica")
    ax1.legend()
    ax1.set_title(f"{result['model']} on {result['hardware']['name']}: one rollout")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def validate(ns) -> list[dict]:
    from rayspec.perfmodel.calibrate import fit_plain, plain_points
    from rayspec.perfmodel.validate import (HERE_TOLERANCE, PAPER_ASSUMPTIONS, PAPER_TOLERANCE, Figure, adaptive_k,
                                            calibrate_k3, here, project_235b, published, weight_sync_anchors)

    cells = json.loads(Path(ns.bench).read_text())
    target = ModelShape.from_hf_config("smollm2-135m")
    hw = fit_plain(plain_points(cells, QUICK_PROMPT_LENS), target, hardware.get("cpu", **_overrides(ns.hw)))
    rows = here(cells, hw, target, QUICK_PROMPT_LENS, max_num_seqs=32, rollout_cap=128)
    print(f"1. here: calibrated on the plain cells of {ns.bench}; tolerance {HERE_TOLERANCE:.0%}")
    print(f"{'method':<10}{'draft':<11}{'shape':<9}{'k':>2}{'conc':>5}{'measured':>10}{'model':>8}{'error':>8}")
    for r in rows:
        flag = "" if abs(r["error"]) <= HERE_TOLERANCE else "  over"
        print(f"{r['method']:<10}{r['draft']:<11}{r['shape']:<9}{r['k']:>2}{r['concurrency']:>5}"
              f"{r['measured']:>10.1f}{r['predicted']:>8.1f}{r['error']:>+8.0%}{flag}")
    cal = calibrate_k3()
    print(f"\n2. published figures (tolerance {PAPER_TOLERANCE:.0%}); calibrated on k = 3: "
          f"{cal.field} = {getattr(cal.hw, cal.field) * 1e3:.2f} ms, train_mfu = {cal.hw.train_mfu:.3f}")
    figures = published(cal) + project_235b(cal)
    print(f"{'case':<16}{'figure':<62}{'k':>2}{'published':>10}{'model':>8}{'error':>8}  role")
    for f in figures:
        err = "" if math.isnan(f.published) else f"{f.error:>+8.0%}"
        flag = "  over" if err and f.role == "predicted" and abs(f.error) > PAPER_TOLERANCE else ""
        print(f"{f.case:<16}{f.figure:<62}{'' if f.k is None else f.k:>2}{f.published:>10.2f}{f.projected:>8.2f}"
              f"{err:>8}  {f.role}{flag}")
    print("\n3. adaptive k on the same workloads (generation / sync step speedup)")
    adaptive = adaptive_k(cal)
    for r in adaptive:
        pub = "" if r["published"] is None else f"published {r['published']:.2f}"
        print(f"{r['case']:<10}{r['k']:<10}{r['generation_speedup']:>6.2f}{r['step_speedup']:>6.2f}  {pub}"
              f"{r['schedule'] or ''}")
    print("\n4. weight sync: published refits and rayspec's transports (seconds)")
    anchors = weight_sync_anchors(cal)
    for r in anchors:
        if "transport" in r:
            print(f"{r['source']:<52}{r['transport']:<14}{r['sync_s']:>9.2f} s  {r['share_of_step']:.1%} of the step")
        else:
            modelled = "  ".join(f"{t} {r[t]:.2f}" for t in TRANSPORTS if r[t] is not None)
            print(f"{r['source']:<44}{r['model']:<52}published {r['published_s']:.2f}  {modelled}")
    print("\nassumptions:\n" + "\n".join(f"  {k}: {v}" for k, v in PAPER_ASSUMPTIONS.items()))
    out = [Figure("here", f"tokens/s {r['method']} {r['draft']} {r['shape']} concurrency {r['concurrency']}",
                  r["k"], r["measured"], r["predicted"]).to_dict() for r in rows]
    out += [f.to_dict() for f in figures]
    out += [Figure(r["case"], f"generation speedup, schedule {r['schedule']}", None, math.nan,
                   r["generation_speedup"], "projection").to_dict() for r in adaptive if r["schedule"]]
    out += [Figure("weight sync", f"{r['source']}: {r['model']}, collective refit seconds", None, r["published_s"],
                   r["collective"]).to_dict() for r in anchors if "transport" not in r]
    return out


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        result = validate(ns) if ns.validate else project(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not ns.validate:
        print(f"{result['model']} on {ns.replicas} x {ns.tp} {ns.hardware}, {ns.method}, {ns.mode}, "
              f"T={ns.temperature:g}; "
              f"{result['workload']['sequences']} sequences, mean response "
              f"{result['workload']['response_mean']:.0f} tokens")
        print(f"{'k':<15}{'rollout s':>10}{'speedup':>9}{'step s':>9}{'speedup':>9}")
        for r in result["rows"]:
            print(f"{r['k']:<15}{r['rollout_s']:>10.1f}{r['rollout_speedup']:>9.2f}{r['step_s']:>9.1f}"
                  f"{r['step_speedup']:>9.2f}")
        print("num_speculative_tokens_per_batch_size:", result["num_speculative_tokens_per_batch_size"],
              f"({format_schedule([tuple(r) for r in result['num_speculative_tokens_per_batch_size']])})")
        ws = result["weight_sync"]
        print(f"\nweight sync: {ws[0]['bytes'] / 1e9:.1f} GB a refit, {ws[0]['nodes']} node(s) "
              f"(steps above: {ns.weight_sync})")
        print(f"{'transport':<14}{'gather s':>9}{'transfer s':>11}{'load s':>8}{'sync s':>8}"
              f"{'share of step: none':>21}{'best schedule':>15}")
        for w in ws:
            print(f"{w['transport']:<14}{w['gather_s']:>9.2f}{w['transfer_s']:>11.2f}{w['load_s']:>8.2f}"
                  f"{w['sync_s']:>8.2f}{w['share_none']:>21.1%}{w['share_best schedule']:>15.1%}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not ns.validate:
        plot(result, Path(ns.plot) if ns.plot else out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
