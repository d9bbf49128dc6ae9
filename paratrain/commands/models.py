"""`paratrain models`: the named model configs with their exact parameter counts."""

from __future__ import annotations

import dataclasses
import json

from paratrain.models import MODEL_CONFIGS


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list named model configs", description=(
        "List the named model configs with their exact parameter counts."))
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return parser


def run(args) -> int:
    rows = [{"name": name, "parameters": cfg.num_params(), **dataclasses.asdict(cfg)}
            for name, cfg in MODEL_CONFIGS.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<12} {'parameters':>16} {'layers':>6} {'dim':>6} {'heads':>5} {'kv':>4} {'ffn':>6} {'vocab':>7}")
    for r in rows:
        print(f"{r['name']:<12} {r['parameters']:>16,} {r['n_layers']:>6} {r['dim']:>6} {r['n_heads']:>5} "
              f"{r['n_kv_heads']:>4} {r['ffn_dim']:>6} {r['vocab_size']:>7}")
    return 0
