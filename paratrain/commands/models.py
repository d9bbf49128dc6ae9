"""`paratrain models`: the named model configs with their exact parameter counts and training recipes."""

from __future__ import annotations

import dataclasses
import json

from paratrain.models import MODEL_CONFIGS, get_recipe


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list named model configs", description=(
        "List the named model configs with their exact parameter counts (total, and active: the parameters one "
        "token uses, which for a mixture of experts counts top_k of its n_experts experts) and the recipe each trains with by "
        "default (peak and final learning rate, warm-up steps, AdamW betas, epsilon and weight decay, gradient "
        "clipping); `paratrain train` options override it."))
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return parser


def run(args) -> int:
    rows = [{"name": name, "parameters": cfg.num_params(), "active_parameters": cfg.num_active_params(),
             **dataclasses.asdict(cfg),
             "recipe": dataclasses.asdict(get_recipe(name))} for name, cfg in MODEL_CONFIGS.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<12} {'parameters':>16} {'active':>16} {'experts':>7} {'layers':>6} {'dim':>6} {'heads':>5} {'kv':>4} {'ffn':>6} {'vocab':>7} "
          f"{'lr':>8} {'min_lr':>8} {'warmup':>6} {'beta1':>5} {'beta2':>5} {'eps':>8} {'wd':>4} {'clip':>4}")
    for r in rows:
        p = r["recipe"]
        experts = f"{r['top_k']}/{r['n_experts']}" if r["n_experts"] else "-"
        print(f"{r['name']:<12} {r['parameters']:>16,} {r['active_parameters']:>16,} {experts:>7} {r['n_layers']:>6} {r['dim']:>6} {r['n_heads']:>5} "
              f"{r['n_kv_heads']:>4} {r['ffn_dim']:>6} {r['vocab_size']:>7} {p['lr']:>8.1e} {p['min_lr']:>8.1e} "
              f"{p['warmup_steps']:>6} {p['beta1']:>5g} {p['beta2']:>5g} {p['eps']:>8.0e} {p['weight_decay']:>4g} "
              f"{p['grad_clip']:>4g}")
    sources: dict[str, list[str]] = {}
    for r in rows:
        sources.setdefault(r["recipe"]["source"], []).append(r["name"])
    print("\nrecipes (lr peaks after the warm-up and decays by a cosine to min_lr at the last step):")
    for source, names in sources.items():
        print(f"  {', '.join(names)}: {source}")
    return 0
